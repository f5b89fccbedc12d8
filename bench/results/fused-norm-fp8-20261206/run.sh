#!/usr/bin/env bash
# device call 2: GPU tests of the FP8 path, fused-norm step against 8c64628, ncu of the FP8 grouped GEMM
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; t0=$(date +%s)
nvidia-smi -L
ln -sf ../.deps .base/.deps
(cmake --preset cuda >/dev/null && timeout 200 cmake --build --preset cuda --target moecore test_gpu moecore_op_bench) > $L/build.log 2>&1 || { tail -30 $L/build.log; exit 1; }
echo "build $(( $(date +%s)-t0 )) s"
timeout 150 build/cuda/tests/test_gpu --gtest_filter='Fp8*:*Fp8*:RmsnormForwardFp8.*:Grouped*:Shapes/Grouped*' > $L/tests.log 2>&1; echo "tests rc=$?"
grep -E '^\[  (FAILED|PASSED) |^\[==========\]' $L/tests.log | tail -5; grep -E '^\[  FAILED' $L/tests.log | head
echo "t=$(( $(date +%s)-t0 ))"
SUITE=0 OTHER_COMMIT=8c64628 MOECORE_COMMIT=244a62f BENCH_ARGS="--model.n_layers=6 --train.precision=fp8" OUT=$L \
  timeout 280 scripts/bench-compare .base configs/olmoe-8l.toml 2 > $L/compare.log 2>&1; echo "compare rc=$?"
tail -12 $L/compare.log
grep -h -o '"last_loss":[^,]*' $L/bench-compare-*/*.json
echo "t=$(( $(date +%s)-t0 ))"
NV=$(python3 -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])")/lib
timeout 120 ncu --kernel-name regex:grouped_gemm_fp8 --launch-skip 1 --launch-count 1 --section SpeedOfLight \
  --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section SourceCounters --section Occupancy build/cuda/moecore_op_bench --ops grouped_fp8 --tokens 4096 --experts 16 \
  --iters 1 --warmup 0 > $L/ncu_fp8.txt 2>&1; echo "ncu rc=$?"
echo "t=$(( $(date +%s)-t0 ))"
(cd $L && tar czf $OUT/logs.tgz .)
