#!/usr/bin/env bash
# device call: build, new tests, op benches, step benches with the kernel switches
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L
nvidia-smi -L
t0=$(date +%s)
(cmake --preset cuda >/dev/null && timeout 250 cmake --build --preset cuda --target moecore test_gpu moecore_op_bench) > $L/build.log 2>&1 || { tail -30 $L/build.log; exit 1; }
echo "build $(( $(date +%s)-t0 )) s"
timeout 120 build/cuda/tests/test_gpu --gtest_filter='Fp8Gpu.*:Groups/GroupedGemmParity.*:RmsnormForwardFp8.*' > $L/tests.log 2>&1; echo "tests rc=$?"
grep -E '^\[  (FAILED|PASSED) |FAILED|Failure' $L/tests.log | head -20
echo "t=$(( $(date +%s)-t0 ))"
timeout 100 stdbuf -oL build/cuda/moecore_op_bench --ops grouped_fp8 --tokens 4096 --experts 16 --iters 5 --warmup 1 --out $L/op_fp8.json > $L/op_fp8.log 2>&1; echo "op fp8 rc=$?"
echo "t=$(( $(date +%s)-t0 ))"
timeout 100 stdbuf -oL build/cuda/moecore_op_bench --ops grouped_gemm --backend wgmma --iters 5 --warmup 1 --out $L/op_gg.json > $L/op_gg.log 2>&1; echo "op gg rc=$?"
echo "t=$(( $(date +%s)-t0 ))"
b() { local name=$1; shift; env "$@" timeout 70 build/cuda/moecore bench configs/olmoe-8l.toml --model.n_layers=6 --warmup 3 --steps 10 $EXTRA --json $L/$name.json > $L/$name.log 2>&1; echo "$name rc=$? $(grep -iE 'step time|TFLOP' $L/$name.log | tail -2 | tr '\n' ' ')"; }
EXTRA= b bf16 MOECORE_GROUPED_GEMM_DIRECT_STORE=off
EXTRA= b bf16_direct MOECORE_GROUPED_GEMM_DIRECT_STORE=on
EXTRA=--train.precision=fp8 b fp8_base MOECORE_FP8_KERNEL=base
EXTRA=--train.precision=fp8 b fp8_async MOECORE_FP8_KERNEL=async-scales
EXTRA=--train.precision=fp8 b fp8_asyncd MOECORE_FP8_KERNEL=async-scales-direct
echo "t=$(( $(date +%s)-t0 ))"
(cd $L && tar czf $OUT/logs.tgz .) 
cat $L/op_fp8.log | tail -40
cat $L/op_gg.log | tail -30
