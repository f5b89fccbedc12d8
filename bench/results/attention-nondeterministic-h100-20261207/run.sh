#!/usr/bin/env bash
# cuDNN attention backward: deterministic against not (experiment).
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs-nd; rm -rf $L; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt
(cmake --preset cuda >/dev/null && timeout 300 cmake --build --preset cuda --target moecore moecore_op_bench) > $L/build.log 2>&1
echo "built at ${SECONDS}s"; ls build/cuda/moecore build/cuda/moecore_op_bench || { grep -h error $L/build.log | head; exit 1; }
tgz() { (cd $L && tar czf $OUT/logs.tgz .); }
for r in 1 2; do
  timeout 60 build/cuda/moecore_op_bench --ops attention > $L/attn-det-$r.log 2>&1; echo "det rc=$?"; grep -iE "cudnn|backward|forward" $L/attn-det-$r.log | head -4
  MOECORE_EXP_NONDET=1 timeout 60 build/cuda/moecore_op_bench --ops attention > $L/attn-nondet-$r.log 2>&1; echo "nondet rc=$?"; grep -iE "cudnn|backward|forward" $L/attn-nondet-$r.log | head -4
done; tgz
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
shape="--model.n_layers=7"; [ "$mib" -gt 100000 ] && shape=""
b() { local name=$1; shift
      timeout 100 build/cuda/moecore bench configs/olmoe-8l.toml $shape --warmup 3 --steps 10 --json $L/$name.json > $L/$name.log 2>&1
      echo "$name rc=$? $(grep -E '^tokens/s/GPU' $L/$name.log) | $(grep -E '^memory' $L/$name.log | cut -c1-40) | $(grep -E '^ *attention' $L/$name.log)"; tgz; }
b det; MOECORE_EXP_NONDET=1 b nondet; b det-r2; MOECORE_EXP_NONDET=1 b nondet-r2
