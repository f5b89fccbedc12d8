#!/usr/bin/env bash
# GPU calls 2 and 3, on the machine of call 1 (its build): deep staging against the default, then the
# deferred update's reserve r swept, and Nsight Compute on the default weight-gradient kernel.
export PATH=/usr/local/cuda/bin:$PATH; L=$OUT
for s in default deep; do
  MOECORE_GROUPED_GEMM_STAGING=$s build/cuda/moecore_op_bench --ops grouped_gemm --backend wgmma --iters 5 --warmup 1 > $L/op-$s.log 2>&1
done
for r in 1 2; do for s in default deep; do
  MOECORE_GROUPED_GEMM_STAGING=$s timeout 60 build/cuda/moecore bench configs/olmoe-8l.toml --model.n_layers=6 --warmup 3 \
    --steps 10 --json $L/step-$s-$r.json > $L/step-$s-$r.log 2>&1
done; done
for s in default deep; do
  MOECORE_GROUPED_GEMM_STAGING=$s timeout 60 build/cuda/moecore bench configs/olmoe-8l.toml --model.n_layers=6 \
    --optim.deferred_update=true --optim.deferred_update_sms=32 --warmup 3 --steps 10 --json $L/d32-$s.json > $L/d32-$s.log 2>&1
done
# call 3
for r in 24 28 36 40 32; do
  timeout 60 build/cuda/moecore bench configs/olmoe-8l.toml --model.n_layers=6 --optim.deferred_update=true \
    --optim.deferred_update_sms=$r --warmup 3 --steps 10 --json $L/d$r.json > $L/d$r.log 2>&1
done
timeout 150 ncu --set full -k regex:grouped_gemm_k_contiguous_sm90 --launch-skip 2 --launch-count 1 \
  build/cuda/moecore_op_bench --ops grouped_gemm --backend wgmma --iters 2 --warmup 1 > $L/ncu-wgrad.txt 2>&1
