#!/usr/bin/env bash
# first call: new tests, op bench for the fused ops, step bench vs baseline
set -uo pipefail
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
ln -sfn ../.deps .base/.deps
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=""; [ "$mem" -lt 100000 ] && LAYERS="--model.n_layers=6"
(cmake --preset cuda >/dev/null && cmake --build --preset cuda --target moecore test_gpu moecore_op_bench > $OUT/build.log 2>&1) || { tail -30 $OUT/build.log; exit 1; }
T=$(find build/cuda -name test_gpu -type f | head -1)
timeout 200 $T --gtest_filter='RopeRmsnormBackward.*:GroupedGemmSwiglu.*:Cases/AdamWParity.*:Shapes/RmsnormParity.*:Shapes/RopeParity.*:RmsnormRope.*:RmsnormBackwardAdd.*:CudaModel.*:CudaStep.*:*Experts*:*GroupedGemm*:*Attention*' > $OUT/tests.log 2>&1; echo "tests rc=$?"
grep -E "FAILED|PASSED|tests ran" $OUT/tests.log | tail -15
timeout 60 build/cuda/moecore_op_bench --ops grouped_gemm > $OUT/opbench.log 2>&1; echo "opbench rc=$?"
grep -iE "swiglu|fused" $OUT/opbench.log | head -20
OUT_SAVE=$OUT
timeout 120 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section ComputeWorkloadAnalysis -k regex:'m_contiguous_sm90' -c 6 build/cuda/moecore_op_bench --ops grouped_fp8 > $OUT/ncu-fp8.txt 2>&1; echo "ncu rc=$?"
OUT=$OUT/cmp SUITE=0 OTHER_COMMIT=f69948a MOECORE_COMMIT=wired BENCH_ARGS="$LAYERS" timeout 300 scripts/bench-compare .base configs/olmoe-8l.toml 2 2>&1 | tail -12
for r in 32 40; do
  timeout 60 build/cuda/moecore bench configs/olmoe-8l.toml $LAYERS --warmup 3 --steps 10 --optim.deferred_update=true --optim.deferred_update_sms=$r > $OUT_SAVE/cmp/deferred-$r.log 2>&1
  echo "deferred r=$r: $(grep -o 'step [0-9.]* ms' $OUT_SAVE/cmp/deferred-$r.log | tail -1) $(grep -o 'TFLOP/s/GPU [0-9.]*' $OUT_SAVE/cmp/deferred-$r.log | tail -1)"
done
cd $OUT_SAVE && tar czf cmp.tgz cmp && rm -rf cmp
