#!/usr/bin/env bash
# FP8 update prefetch branch vs main: tests then fp8 step alternately.
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs-pf; rm -rf $L; mkdir -p $L
ROOT=$PWD
(cmake --preset cuda >/dev/null && cmake --build --preset cuda --target moecore) > $L/build-main.log 2>&1 &
(cd .gpu/pf && ln -sf $ROOT/.deps .deps && cmake --preset cuda >/dev/null && cmake --build --preset cuda --target moecore test_gpu) > $L/build-pf.log 2>&1
wait; echo "built at ${SECONDS}s"; ls build/cuda/moecore .gpu/pf/build/cuda/moecore || { grep -h error $L/*.log | head; exit 1; }
tgz() { (cd $L && tar czf $OUT/logs.tgz .); }
timeout 150 .gpu/pf/build/cuda/tests/test_gpu --gtest_filter="AdamW*:CudaStep.Fp8*:CudaTrain.*Fp8*" > $L/tests.log 2>&1
echo "tests rc=$? $(grep -E '^\[  (PASSED|FAILED)' $L/tests.log | tr '\n' ' ') at ${SECONDS}s"; grep -E '^\[  FAILED' $L/tests.log | head; tgz
b() { local name=$1 bin=$2; shift 2
  timeout 120 $bin bench configs/olmoe-8l.toml --model.n_layers=7 --warmup 3 --steps 10 "$@" --json $L/$name.json > $L/$name.log 2>&1
  echo "$name rc=$? $(grep -E '^tokens/s/GPU' $L/$name.log) | $(grep -E '^ *optimizer' $L/$name.log) at ${SECONDS}s"; tgz; }
for r in 1 2; do
  b main-fp8-$r build/cuda/moecore --train.precision=fp8
  b pf-fp8-$r .gpu/pf/build/cuda/moecore --train.precision=fp8
done
grep -h 'step time\|^ *optimizer' $L/*fp8*.log | cut -c1-120
