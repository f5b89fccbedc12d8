#!/usr/bin/env bash
# main's figures on this GPU: olmoe-8l bf16 / fp8 / bf16 deferred-32, scaling-e8 dropless bf16 / fp8, the
# precision tables, and the FP8 / step / rowwise tests of the GPU suite.
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs-s3; rm -rf $L; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt
(cmake --preset cuda >/dev/null && timeout 300 cmake --build --preset cuda --target moecore test_gpu moecore_op_bench) > $L/build.log 2>&1
echo "built at ${SECONDS}s"; ls build/cuda/moecore build/cuda/tests/test_gpu || { grep -h error $L/build.log | head; exit 1; }
tgz() { (cd $L && tar czf $OUT/logs.tgz .); }
timeout ${TEST_S:-150} build/cuda/tests/test_gpu --gtest_filter="${TESTS:-*Fp8*:CudaStep.*:CudaRowwise.*}" > $L/tests.log 2>&1
echo "tests rc=$? $(grep -E '^\[  (PASSED|FAILED)' $L/tests.log | tr '\n' ' ') at ${SECONDS}s"; grep -E '^\[  FAILED' $L/tests.log | head; tgz
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
shape="--model.n_layers=7"; [ "$mib" -gt 100000 ] && shape=""
D="--optim.deferred_update=true --optim.deferred_update_sms=32"; E="--moe.capacity_factor=0"
b() { local name=$1 cfg=$2; shift 2; local s=$shape; [ "$cfg" = configs/scaling-e8.toml ] && s="--warmup 2 --steps 5"
      [ "$cfg" = configs/olmoe-8l.toml ] && s="$shape --warmup 3 --steps 10"
      timeout 120 build/cuda/moecore bench "$cfg" $s "$@" --json $L/$name.json > $L/$name.log 2>&1
      echo "$name rc=$? $(grep -E '^tokens/s/GPU' $L/$name.log) | $(grep -E '^step' $L/$name.log | head -1 | cut -c1-50) | $(grep -E '^memory' $L/$name.log | cut -c1-40) at ${SECONDS}s"; tgz; }
for n in ${BENCHES:-bf16 fp8 bf16-d32 e8-bf16 e8-fp8}; do
  case $n in
    bf16) b bf16 configs/olmoe-8l.toml --train.precision=bf16 ;;
    fp8) b fp8 configs/olmoe-8l.toml --train.precision=fp8 ;;
    bf16-d32) b bf16-d32 configs/olmoe-8l.toml --train.precision=bf16 $D ;;
    e8-bf16) b e8-bf16 configs/scaling-e8.toml $E --train.precision=bf16 ;;
    e8-fp8) b e8-fp8 configs/scaling-e8.toml $E --train.precision=fp8 ;;
  esac
done
[ -f $L/fp8.json ] && python3 bench/precision_table.py $L/bf16.json $L/fp8.json > $L/olmoe-8l-table.md 2>&1
[ -f $L/e8-fp8.json ] && python3 bench/precision_table.py $L/e8-bf16.json $L/e8-fp8.json > $L/scaling-e8-table.md 2>&1
tgz; grep -h 'of ceiling' $L/*.log | cut -c1-150; cat $L/olmoe-8l-table.md 2>/dev/null | head -24
