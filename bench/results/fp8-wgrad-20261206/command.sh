#!/usr/bin/env bash
# The GPU call (one H100): fp8-next against main 088237b (.base), tests, op bench, rowwise at one PE, the fp8 step
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; nvidia-smi -L
ln -sf ../.deps .base/.deps
(cmake --preset cuda >/dev/null && timeout 200 cmake --build --preset cuda --target moecore test_gpu moecore_op_bench) > $L/build.log 2>&1 || { tail -30 $L/build.log; (cd $L && tar czf $OUT/logs.tgz .); exit 1; }
echo "built at ${SECONDS}s"
timeout 200 build/cuda/tests/test_gpu --gtest_filter='Fp8Gpu.*:CudaStep.Fp8*:RunPlan*:AdamWFp8Weights.*:CudaFp8Model*:CudaRowwise.*:EpRowwiseGpu.*' > $L/tests.log 2>&1; echo "tests rc=$? at ${SECONDS}s"
grep -E '^\[  (PASSED|FAILED)|FAILED  \]' $L/tests.log
grep -B2 -A12 -m3 'Failure' $L/tests.log | head -60
timeout 60 build/cuda/moecore_op_bench --ops grouped_fp8 --tokens 4096 --experts 16 --iters 5 --warmup 1 > $L/opbench.log 2>&1; echo "opbench rc=$?"
grep -iE 'wgrad|dw' $L/opbench.log | head -20
timeout 90 build/cuda/moecore bench configs/olmoe-8l.toml --warmup 3 --steps 10 --model.n_layers=6 --train.precision=fp8 \
  --parallel.ep_backend=rowwise --json $L/rowwise-fp8.json > $L/rowwise-fp8.log 2>&1; echo "rowwise fp8 rc=$?"
grep -E '^tokens/s/GPU|^step|peak' $L/rowwise-fp8.log | head -5
left=$((585 - SECONDS)); echo "compare budget ${left}s"
SUITE=0 OTHER_COMMIT=088237b MOECORE_COMMIT=fp8-next BENCH_ARGS="--model.n_layers=6 --train.precision=fp8" OUT=$L \
  timeout $left scripts/bench-compare .base configs/olmoe-8l.toml 2 > $L/compare.log 2>&1; echo "compare rc=$?"
tail -8 $L/compare.log
for f in $L/bench-compare-*/{this,other}-*.log; do echo "$(basename $f) $(grep -m1 '^  experts' $f)"; done
grep -h -o '"last_loss":[^,]*' $L/bench-compare-*/*.json
(cd $L && tar czf $OUT/logs.tgz .)
