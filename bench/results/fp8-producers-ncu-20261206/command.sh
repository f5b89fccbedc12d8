#!/usr/bin/env bash
# device call 2: merged main's FP8 tests; the FP8 producers under Nsight Compute; the fp8 step against 088237b
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; nvidia-smi -L
ln -sf ../.deps .base/.deps
(cmake --preset cuda >/dev/null && timeout 200 cmake --build --preset cuda --target moecore test_gpu moecore_op_bench) > $L/build.log 2>&1 || { tail -30 $L/build.log; (cd $L && tar czf $OUT/logs.tgz .); exit 1; }
echo "built at ${SECONDS}s"
timeout 150 build/cuda/tests/test_gpu --gtest_filter='Fp8Gpu.*:CudaStep.Fp8*:CudaFp8Model*:CudaRowwise.*:MoePermuteGpuFp8.*:RunPlan*:AdamWFp8Weights.*' > $L/tests.log 2>&1; echo "tests rc=$? at ${SECONDS}s"
grep -E '^\[  (PASSED|FAILED)|FAILED  \]' $L/tests.log
timeout 150 ncu --kernel-name regex:'swiglu|permute_gather|unpermute_backward' --launch-count 14 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
  --section SchedulerStats --section LaunchStats --section InstructionStats \
  build/cuda/moecore_op_bench --ops grouped_fp8 --tokens 4096 --experts 16 --iters 1 --warmup 0 > $L/ncu.log 2>&1
echo "ncu rc=$? at ${SECONDS}s"
grep -E '^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Executed Ipc A|Issue Slots Busy' $L/ncu.log | head -120
left=$((585 - SECONDS)); echo "compare budget ${left}s"
SUITE=0 OTHER_COMMIT=088237b MOECORE_COMMIT=0e7676e BENCH_ARGS="--model.n_layers=6 --train.precision=fp8" OUT=$L \
  timeout $left scripts/bench-compare .base configs/olmoe-8l.toml 1 > $L/compare.log 2>&1; echo "compare rc=$?"
tail -6 $L/compare.log
for f in $L/bench-compare-*/{this,other}-*.log; do echo "$(basename $f) $(grep -m1 '^  experts' $f)"; done
grep -h -o '"last_loss":[^,]*' $L/bench-compare-*/*.json
(cd $L && tar czf $OUT/logs.tgz .)
