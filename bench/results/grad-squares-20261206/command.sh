#!/usr/bin/env bash
# The experts' gradient square sums: tests, then olmoe-8l with the fused norm against MOECORE_GRAD_NORM=separate.
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt
(cmake --preset cuda >/dev/null && timeout 250 cmake --build --preset cuda --target moecore test_gpu) > $L/build.log 2>&1 || { grep -E "error" $L/build.log | head; exit 1; }
echo "built at ${SECONDS}s"
timeout 150 build/cuda/tests/test_gpu --gtest_filter='Groups/GroupedGemmParity.Wgrad*:GroupedGemm.ZeroMaxRows:CudaStep.GradNorm*:CudaStep.DeferredUpdate*:CudaStep.GraphMatchesEager*:CudaStep.Fp8Steps*:*Experts*' > $L/tests.log 2>&1; echo "tests rc=$? at ${SECONDS}s"
grep -E '^\[  (PASSED|FAILED)|FAILED  \]' $L/tests.log | head -20
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
shape="--model.n_layers=6"; [ "$mib" -gt 100000 ] && shape=""
D="--optim.deferred_update=true --optim.deferred_update_sms=32"
b() { local name=$1 env=$2; shift 2
      env MOECORE_GRAD_NORM=$env timeout 100 build/cuda/moecore bench configs/olmoe-8l.toml $shape --warmup 3 --steps 10 "$@" --json $L/$name.json > $L/$name.log 2>&1
      echo "$name rc=$? $(grep -E '^tokens/s/GPU' $L/$name.log) | $(grep -E '^  optimizer|^  experts' $L/$name.log | tr -s ' ' | tr '\n' ' ')"
      (cd $L && tar czf $OUT/logs.tgz .); }
for r in 1 2; do
  b sep-$r separate; b fused-$r fused
  b sep-d32-$r separate $D; b fused-d32-$r fused $D
done
(cd $L && tar czf $OUT/logs.tgz .)
