#!/usr/bin/env bash
set -uo pipefail
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
(cmake --preset cuda >/dev/null && cmake --build --preset cuda --target moecore test_gpu moecore_op_bench > $OUT/build.log 2>&1) || { grep -E "error" $OUT/build.log | head; tail -5 $OUT/build.log; exit 1; }
T=$(find build/cuda -name test_gpu -type f | head -1)
timeout 120 $T --gtest_filter='Fp8Gpu.*' > $OUT/tests.log 2>&1; echo "tests rc=$?"
grep -E "FAILED|PASSED|tests ran|Failure" $OUT/tests.log | tail -8
timeout 90 stdbuf -oL build/cuda/moecore_op_bench --ops grouped_fp8 --out $OUT/grouped_fp8.json > $OUT/grouped_fp8.log 2>&1; echo "opbench rc=$?"
grep -A6 "^op " $OUT/grouped_fp8.log | head -8
for c in off on off on; do
  MOECORE_FP8_CLUSTER=$c timeout 70 build/cuda/moecore bench configs/olmoe-8l.toml --model.n_layers=6 --warmup 3 --steps 10 --train.precision=fp8 > $OUT/step-fp8-$c.log 2>&1
  echo "fp8 cluster=$c: $(grep -o 'step [0-9.]* ms' $OUT/step-fp8-$c.log | tail -1) | $(grep -E '^  experts ' $OUT/step-fp8-$c.log)"
  mv $OUT/step-fp8-$c.log $OUT/step-fp8-$c-$RANDOM.log
done
cd $OUT && tar czf steps.tgz step-fp8-*.log && rm step-fp8-*.log
