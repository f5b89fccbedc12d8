#!/usr/bin/env bash
# Call A: build main (base) and the tree beside it; FP8 tests of the tree; the grouped FP8 op bench of both, alternately.
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs-a; rm -rf $L; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt
if [ ! -x /tmp/base/build/cuda/moecore ]; then
  rm -rf /tmp/base; mkdir -p /tmp/base; tar xzf .gpu/main.tgz -C /tmp/base && ln -s "$(pwd)/.deps" /tmp/base/.deps
  (cd /tmp/base && cmake --preset cuda >/dev/null && timeout 400 cmake --build --preset cuda --target moecore moecore_op_bench -j 5) > $L/base-build.log 2>&1 &
fi
if false; then
  rm -rf /tmp/mid; mkdir -p /tmp/mid; tar xzf .gpu/mid.tgz -C /tmp/mid && ln -s "$(pwd)/.deps" /tmp/mid/.deps
  (cd /tmp/mid && cmake --preset cuda >/dev/null && timeout 400 cmake --build --preset cuda --target moecore_op_bench -j 5) > $L/mid-build.log 2>&1 &
fi
(cmake --preset cuda >/dev/null && timeout 400 cmake --build --preset cuda --target moecore test_gpu moecore_op_bench -j 8) > $L/build.log 2>&1
wait; echo "built at ${SECONDS}s"; ls /tmp/base/build/cuda/moecore build/cuda/moecore build/cuda/tests/test_gpu >/dev/null || { grep -h -B2 -A3 error $L/*build.log | head -30; exit 1; }
tgz() { (cd $L && tar czf $OUT/logs.tgz .); }
for r in 1 2; do
  for v in base new; do d=$(pwd); [ $v = base ] && d=/tmp/base; [ $v = mid ] && d=/tmp/mid
    (cd $d && timeout 60 build/cuda/moecore_op_bench --ops grouped_fp8 --iters 20 --warmup 3) > $L/op-$v-$r.log 2>&1
    echo "== $v $r"; grep -E '^(gate_up|down) (forward|dgrad)' $L/op-$v-$r.log | cut -c1-100
  done
done; tgz
timeout ${TEST_S:-200} build/cuda/tests/test_gpu --gtest_filter="${TESTS:-Fp8Gpu.*:CudaStep.Fp8*:GroupedGemm*:ExpertsOp*}" > $L/tests.log 2>&1
echo "tests rc=$? $(grep -E '^\[  (PASSED|FAILED)' $L/tests.log | tr '\n' ' ') at ${SECONDS}s"; grep -E '^\[  FAILED' $L/tests.log | head; tgz
