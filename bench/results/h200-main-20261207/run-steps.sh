#!/usr/bin/env bash
# Call B (after a.sh, warm machine): olmoe-8l and scaling-e8 steps of main and of the tree, alternately.
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs-b; rm -rf $L; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt
ls /tmp/base/build/cuda/moecore build/cuda/moecore >/dev/null || exit 1
tgz() { (cd $L && tar czf $OUT/logs-b.tgz .); }
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
shape="--model.n_layers=7"; [ "$mib" -gt 100000 ] && shape=""
E="--moe.capacity_factor=0 --warmup 2 --steps 5"
b() { local dir=$1 name=$2 cfg=$3; shift 3; local s="$shape --warmup 3 --steps 10"; [ "$cfg" = configs/scaling-e8.toml ] && s=""
      (cd $dir && timeout 120 build/cuda/moecore bench "$cfg" $s "$@" --json $L/$name.json > $L/$name.log 2>&1)
      echo "$name rc=$? $(grep -E '^tokens/s/GPU' $L/$name.log) | $(grep -E '^memory' $L/$name.log | cut -c1-30) at ${SECONDS}s"; tgz; }
B=/tmp/base; T=$(pwd)
for n in ${RUNS:-bf16 fp8-base fp8-new fp8-base-r2 fp8-new-r2 e8-bf16 e8-fp8-base e8-fp8-new}; do
  case $n in
    bf16) b $B bf16 configs/olmoe-8l.toml --train.precision=bf16 ;;
    fp8-base*) b $B $n configs/olmoe-8l.toml --train.precision=fp8 ;;
    fp8-new*) b $T $n configs/olmoe-8l.toml --train.precision=fp8 ;;
    e8-bf16) b $B $n configs/scaling-e8.toml $E --train.precision=bf16 ;;
    e8-fp8-base) b $B $n configs/scaling-e8.toml $E --train.precision=fp8 ;;
    e8-fp8-new) b $T $n configs/scaling-e8.toml $E --train.precision=fp8 ;;
  esac
done
for p in fp8-base fp8-new e8-fp8-base e8-fp8-new; do
  bb=bf16; [[ $p == e8* ]] && bb=e8-bf16
  [ -f $L/$p.json ] && python3 bench/precision_table.py $L/$bb.json $L/$p.json > $L/table-$p.md 2>&1
done; tgz
for p in fp8-base fp8-new; do echo "== $p"; grep -E '^\| (tokens/s|peak)|^\| experts' $L/table-$p.md; done
