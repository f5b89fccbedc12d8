#!/usr/bin/env bash
# olmoe-8l (all 8 layers) on one H200: the update at the end against the deferred update on r SMs, and BF16 moments.
# Call 1: `bash run.sh` (its default BENCHES). Call 2, the same GPU warm: `STEPS=30 BENCHES="end m16 d32m16 end m16 d32m16" bash run.sh`.
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs-h2; rm -rf $L; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt
(cmake --preset cuda >/dev/null && timeout 300 cmake --build --preset cuda --target moecore) > $L/build.log 2>&1
echo "built at ${SECONDS}s"; ls build/cuda/moecore || { grep -h error $L/build.log | head; exit 1; }
tgz() { (cd $L && tar czf $OUT/logs.tgz .); }
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
shape="--model.n_layers=7"; [ "$mib" -gt 100000 ] && shape=""
b() { local name=$1; shift
      timeout 150 build/cuda/moecore bench ${cfg:-configs/olmoe-8l.toml} $shape --warmup 3 --steps ${STEPS:-10} "$@" --json $L/$name.json \
        > $L/$name.log 2>&1
      echo "$name rc=$? $(grep -E '^tokens/s/GPU' $L/$name.log | cut -d'|' -f2,4) | $(grep -E '^memory' $L/$name.log | cut -c9-30) | $(grep -E '^GPU clocks' $L/$name.log | cut -c24-60) at ${SECONDS}s"; tgz; }
for n in ${BENCHES:-end fp8 d32 m16 end fp8 rnd d32m16 fp8d32 e8 e8d32m16}; do
  case $n in
    end) b $n-$SECONDS ;;
    e8) cfg=configs/scaling-e8.toml b $n-$SECONDS --moe.capacity_factor=0 ;;
    e8d32m16) cfg=configs/scaling-e8.toml b $n-$SECONDS --moe.capacity_factor=0 --optim.deferred_update=true \
                --optim.deferred_update_sms=32 --optim.moment_dtype=bf16 ;;
    rnd) b $n-$SECONDS --moe.routing=random ;;
    fp8) b $n-$SECONDS --train.precision=fp8 ;;
    fp8d32) b $n-$SECONDS --train.precision=fp8 --optim.deferred_update=true --optim.deferred_update_sms=32 ;;
    d[0-9]*m16) r=${n#d}; r=${r%m16}; b $n-$SECONDS --optim.deferred_update=true --optim.deferred_update_sms=$r --optim.moment_dtype=bf16 ;;
    d*) b $n-$SECONDS --optim.deferred_update=true --optim.deferred_update_sms=${n#d} ;;
    m16) b $n-$SECONDS --optim.moment_dtype=bf16 ;;
  esac
done
tgz
grep -H 'of ceiling' $L/*.log | cut -c1-170
