#!/usr/bin/env bash
# Call 2, on call 1's build (build/cuda: main; /tmp/this: the variants' tree): five rounds of the step,
# three of the deferred step, and the weight gradients' op bench rows, main against conflict-free staging.
export PATH=/usr/local/cuda/bin:$PATH; L=/tmp/logs-w2; mkdir -p $L; T=/tmp/this; ls $T
for r in 1 2 3 4 5; do for t in base this; do B=build/cuda; [ $t = this ] && B=$T
  $B/moecore bench configs/olmoe-8l.toml --model.n_layers=6 --warmup 3 --steps 10 --json $L/s-$t-$r.json > $L/s-$t-$r.log 2>&1
  echo "step $t $r $(grep -E '^tokens/s/GPU' $L/s-$t-$r.log | cut -c1-90)"; done; done
for r in 1 2 3; do for t in base this; do B=build/cuda; [ $t = this ] && B=$T
  $B/moecore bench configs/olmoe-8l.toml --model.n_layers=6 --warmup 3 --steps 10 --optim.deferred_update=true \
    --optim.deferred_update_sms=32 > $L/d-$t-$r.log 2>&1
  echo "d32 $t $r $(grep -E '^tokens/s/GPU' $L/d-$t-$r.log | cut -c1-90)"; done; done
for t in base this; do B=build/cuda; [ $t = this ] && B=$T
  $B/moecore_op_bench --ops grouped_gemm --backend wgmma --iters 10 --warmup 2 > $L/op2-$t.log 2>&1
  echo "op $t"; grep wgrad $L/op2-$t.log | cut -c1-60; done
cd $L && tar czf $OUT/w2.tgz .
