#!/usr/bin/env bash
# BF16 AdamW moments: the optimizer and trainer tests, then olmoe-8l with FP32 and BF16 moments alternately.
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs-m3; rm -rf $L; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt
(cmake --preset cuda >/dev/null && timeout 300 cmake --build --preset cuda --target moecore test_gpu moecore_op_bench) > $L/build.log 2>&1
echo "built at ${SECONDS}s"; ls build/cuda/moecore build/cuda/tests/test_gpu || { grep -h error $L/build.log | head; exit 1; }
tgz() { (cd $L && tar czf $OUT/logs.tgz .); }
[ -n "$TESTS" ] && timeout ${TEST_S:-220} build/cuda/tests/test_gpu --gtest_filter="$TESTS" > $L/tests.log 2>&1

mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
shape="--model.n_layers=7"; [ "$mib" -gt 100000 ] && shape=""
D="--optim.deferred_update=true --optim.deferred_update_sms=32"
E8="--moe.capacity_factor=0 --warmup 2 --steps 5"
b() { local name=$1; shift; local cfg="configs/olmoe-8l.toml $shape --warmup 3 --steps 10"
      case $name in e8*) cfg="configs/scaling-e8.toml $E8" ;; esac
      timeout 120 build/cuda/moecore bench $cfg "$@" --json $L/$name.json > $L/$name.log 2>&1
      echo "$name rc=$? $(grep -E '^tokens/s/GPU' $L/$name.log) | $(grep -E '^memory' $L/$name.log | cut -c1-40) | $(grep -E '^ *optimizer' $L/$name.log) at ${SECONDS}s"; tgz; }
for n in ${BENCHES:-bf16 bf16-m16 bf16-r2 bf16-m16-r2 fp8 fp8-m16 d32 d32-m16 e8-bf16 e8-m16}; do
  case $n in
    e8-m16) b $n --train.precision=bf16 --optim.moment_dtype=bf16 ;;
    e8-bf16) b $n --train.precision=bf16 ;;
    d32) b $n --train.precision=bf16 $D ;;
    bf16*-m16*) b $n --train.precision=bf16 --optim.moment_dtype=bf16 ;;
    bf16*) b $n --train.precision=bf16 ;;
    fp8-m16*) b $n --train.precision=fp8 --optim.moment_dtype=bf16 ;;
    fp8*) b $n --train.precision=fp8 ;;
    d32-m16) b $n --train.precision=bf16 --optim.moment_dtype=bf16 $D ;;
  esac
done
tgz; grep -h 'of ceiling' $L/*.log | cut -c1-150
timeout 90 build/cuda/moecore_op_bench --ops adamw --out $L/adamw.json > $L/adamw.log 2>&1; echo "adamw rc=$?"; grep -E "^(moments|BF16)" $L/adamw.log; tgz
