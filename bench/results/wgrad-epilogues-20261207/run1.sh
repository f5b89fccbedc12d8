#!/usr/bin/env bash
# The grouped GEMMs' epilogues: main's (base), conflict-free FP32 staging (this), the wgrad's overwritten
# tile straight from registers (direct, direct-cs: MOECORE_WGRAD_EPILOGUE), the forward/dgrad tiles from
# registers (fwd: MOECORE_FWD_EPILOGUE=direct). Run on main with
# variants.patch applied: build, keep the binaries, reverse the patch in place and rebuild main.
P=bench/results/wgrad-epilogues-20261207/variants.patch
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs-wgrad; rm -rf $L; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt
tar() { (cd $L && command tar czf $OUT/wgrad-logs.tgz .); }
(cmake --preset cuda >/dev/null && timeout 200 cmake --build --preset cuda --target moecore test_gpu moecore_op_bench) > $L/build.log 2>&1 || { grep -E "error" $L/build.log | head; tar; exit 1; }
echo "built at ${SECONDS}s"
T=/tmp/this; mkdir -p $T && cp build/cuda/moecore build/cuda/moecore_op_bench build/cuda/tests/test_gpu $T/
(patch -s -R -p1 < $P || git apply -R $P) && (timeout 120 cmake --build --preset cuda --target moecore moecore_op_bench) > $L/build-base.log 2>&1 || { grep -E "error" $L/build-base.log | head; tar; exit 1; }
echo "base built at ${SECONDS}s"
F='Groups/GroupedGemmParity.*:GroupedGemm.*:CudaStep.GradNorm*:CudaRecompute.FirstBackward*'
timeout 40 $T/test_gpu --gtest_filter="$F" > $L/tests.log 2>&1; echo "tests rc=$? at ${SECONDS}s"
MOECORE_WGRAD_EPILOGUE=direct-cs MOECORE_FWD_EPILOGUE=direct timeout 40 $T/test_gpu --gtest_filter="$F" > $L/tests-direct.log 2>&1; echo "tests direct rc=$? at ${SECONDS}s"
grep -hE '^\[  (PASSED|FAILED)|FAILED  \]' $L/tests.log $L/tests-direct.log | head; tar
run() { local t=$1; shift; B=build/cuda; [ $t != base ] && B=$T; W=staged; G=staged
  case $t in direct*) W=$t;; fwd) G=direct;; esac
  MOECORE_WGRAD_EPILOGUE=$W MOECORE_FWD_EPILOGUE=$G "$B/$@"; }
V="base this direct direct-cs fwd"
for t in $V; do
  run $t moecore_op_bench --ops grouped_gemm --backend wgmma --iters 5 --warmup 1 > $L/op-$t.log 2>&1; echo "op $t"; grep -E "wgmma" $L/op-$t.log | cut -c1-60; done
tar
for r in 1 2; do for t in base this direct-cs fwd; do
  run $t moecore bench configs/olmoe-8l.toml --model.n_layers=6 --warmup 3 --steps 10 --json $L/step-$t-$r.json > $L/step-$t-$r.log 2>&1
  echo "step $t $r $(grep -E '^tokens/s/GPU' $L/step-$t-$r.log) | $(grep -E '^  experts' $L/step-$t-$r.log | tr -s ' ') at ${SECONDS}s"; tar; done; done
