#!/usr/bin/env bash
# H200: main's figures (olmoe-8l whole, scaling-e8 dropless; bf16 / fp8 / deferred-32) and the branch's FP8
# step (the experts' update without their BF16 copy) beside them, plus the branch's FP8 step tests.
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs-s1; rm -rf $L /tmp/base; mkdir -p $L /tmp/base; nvidia-smi -L | tee $L/gpu.txt
tar xzf .gpu/main.tgz -C /tmp/base && ln -s "$(pwd)/.deps" /tmp/base/.deps
(cd /tmp/base && cmake --preset cuda >/dev/null && timeout 300 cmake --build --preset cuda --target moecore moecore_op_bench) > $L/base-build.log 2>&1 &
(cmake --preset cuda >/dev/null && timeout 300 cmake --build --preset cuda --target moecore test_gpu) > $L/build.log 2>&1
wait; echo "built at ${SECONDS}s"; ls /tmp/base/build/cuda/moecore build/cuda/moecore build/cuda/tests/test_gpu || { grep -h error $L/*build.log | head; exit 1; }
tgz() { (cd $L && tar czf $OUT/logs.tgz .); }
timeout 170 build/cuda/tests/test_gpu --gtest_filter='*Fp8*:AdamWFp8Weights.*:CudaStep.GradNorm*:CudaStep.*Load*:CudaStep.*Checkpoint*:CudaStep.*Resume*' > $L/tests.log 2>&1
echo "tests rc=$? $(grep -E '^\[  (PASSED|FAILED)' $L/tests.log | tr '\n' ' ') at ${SECONDS}s"; tgz
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
shape="--model.n_layers=6"; [ "$mib" -gt 100000 ] && shape=""
D="--optim.deferred_update=true --optim.deferred_update_sms=32"; E="--moe.capacity_factor=0"
b() { local dir=$1 name=$2 cfg=$3; shift 3
      (cd $dir && timeout 100 build/cuda/moecore bench "$cfg" $shape --warmup 3 --steps 10 "$@" --json $L/$name.json > $L/$name.log 2>&1)
      echo "$name rc=$? $(grep -E '^tokens/s/GPU' $L/$name.log) | $(grep -E "^memory" $L/$name.log | cut -c1-40) at ${SECONDS}s"; tgz; }
B=/tmp/base; T=$(pwd)
b $B bf16 configs/olmoe-8l.toml --train.precision=bf16
b $B fp8 configs/olmoe-8l.toml --train.precision=fp8
b $T fp8-nobf16 configs/olmoe-8l.toml --train.precision=fp8
b $B bf16-d32 configs/olmoe-8l.toml --train.precision=bf16 $D
b $B fp8-r2 configs/olmoe-8l.toml --train.precision=fp8
b $T fp8-nobf16-r2 configs/olmoe-8l.toml --train.precision=fp8
b $B e8-bf16 configs/scaling-e8.toml $E --train.precision=bf16
b $B e8-fp8 configs/scaling-e8.toml $E --train.precision=fp8
b $T e8-fp8-nobf16 configs/scaling-e8.toml $E --train.precision=fp8
(cd $B && timeout 60 build/cuda/moecore_op_bench --ops grouped_gemm --backend wgmma --iters 10 --warmup 2) > $L/op.log 2>&1; grep wgmma $L/op.log | cut -c1-70
python3 bench/precision_table.py $L/bf16.json $L/fp8.json > $L/olmoe-8l-table.md 2>&1
python3 bench/precision_table.py $L/bf16.json $L/fp8-nobf16.json > $L/olmoe-8l-table-nobf16.md 2>&1
python3 bench/precision_table.py $L/e8-bf16.json $L/e8-fp8.json > $L/scaling-e8-table.md 2>&1
python3 bench/precision_table.py $L/e8-bf16.json $L/e8-fp8-nobf16.json > $L/scaling-e8-table-nobf16.md 2>&1
tgz; cat $L/olmoe-8l-table.md | head -30
