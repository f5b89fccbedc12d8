#!/usr/bin/env bash
# device call 8: the FP8 experts' AdamW at four blocks a multiprocessor against fb5f6a8: its GPU tests, then the fp8 step
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; nvidia-smi -L
ln -sf ../.deps .base/.deps
(cmake --preset cuda >/dev/null && timeout 200 cmake --build --preset cuda --target moecore test_gpu) > $L/build.log 2>&1 || { tail -20 $L/build.log; exit 1; }
timeout 60 build/cuda/tests/test_gpu --gtest_filter='AdamWFp8Weights.*:CudaStep.Fp8*' > $L/tests.log 2>&1; echo "tests rc=$?"
grep -E '^\[  (PASSED|FAILED)' $L/tests.log
SUITE=0 OTHER_COMMIT=fb5f6a8 MOECORE_COMMIT=fb5f6a8+4-blocks BENCH_ARGS="--model.n_layers=6 --train.precision=fp8" OUT=$L \
  timeout 300 scripts/bench-compare .base configs/olmoe-8l.toml 2 > $L/compare.log 2>&1; echo "compare rc=$?"
tail -8 $L/compare.log
for f in $L/bench-compare-*/{this,other}-*.log; do echo "$(basename $f) $(grep -m1 '^  optimizer' $f)"; done
grep -h -o '"last_loss":[^,]*' $L/bench-compare-*/*.json
(cd $L && tar czf $OUT/logs.tgz .)
