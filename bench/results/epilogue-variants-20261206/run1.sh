#!/usr/bin/env bash
# GPU call 1: build; the variant tests; op bench default/alternate; olmoe-8l (whole on an H200,
# 6 layers on an H100) default vs alternate epilogues, update at the end and deferred on 32 SMs, alternately;
# fp8 and scaling-e8 (H200) for the precision ratios.
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt; git log -1 --format=%h > $L/commit.txt 2>/dev/null
(cmake --preset cuda >/dev/null && timeout 280 cmake --build --preset cuda --target moecore test_gpu moecore_op_bench) > $L/build.log 2>&1 || { grep -E "error" $L/build.log | head; exit 1; }
echo "built at ${SECONDS}s"
tar() { (cd $L && command tar czf $OUT/logs.tgz .); }
timeout 90 build/cuda/tests/test_gpu --gtest_filter='GroupedGemm.AlternateEpilogues*:Fp8Gpu.GroupedGemmAlternate*:GroupedGemm.DeepStaging*:SumF64.*:CudaStep.GradNorm*' > $L/tests.log 2>&1; echo "tests rc=$? at ${SECONDS}s"
grep -E '^\[  (PASSED|FAILED)|FAILED  \]' $L/tests.log | head; tar
for e in together alternate; do
  MOECORE_GROUPED_GEMM_EPILOGUES=$e timeout 60 build/cuda/moecore_op_bench --ops grouped_gemm --backend wgmma --iters 5 --warmup 1 --out $L/op-$e.json > $L/op-$e.log 2>&1
  echo "op $e rc=$? at ${SECONDS}s"; grep -E "forward|dgrad|wgrad" $L/op-$e.log | head -6; tar
done
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
shape="--model.n_layers=6"; [ "$mib" -gt 100000 ] && shape=""
D="--optim.deferred_update=true --optim.deferred_update_sms=32"
b() { local name=$1 e=$2 cfg=$3; shift 3; [ $SECONDS -gt 560 ] && { echo "$name skipped (time)"; return; }
      MOECORE_GROUPED_GEMM_EPILOGUES=$e timeout 80 build/cuda/moecore bench $cfg $shape "$@" --warmup 3 --steps 10 --json $L/$name.json > $L/$name.log 2>&1
      echo "$name rc=$? $(grep -E '^tokens/s/GPU' $L/$name.log) | $(grep -E '^of ceiling' $L/$name.log | cut -c1-80) at ${SECONDS}s"; tar; }
C=configs/olmoe-8l.toml
E="configs/scaling-e8.toml --moe.capacity_factor=0"
MX="--train.precision=fp8 --train.fp8_scaling=mx"
b bf16-together-1 together $C; b bf16-alternate-1 alternate $C
b d32-together-1 together $C $D; b d32-alternate-1 alternate $C $D
b fp8-together together $C --train.precision=fp8; b fp8-alternate alternate $C --train.precision=fp8
if [ -z "$shape" ]; then  # an H200: the precision figures first, then the second round
  b mx together $C $MX
  b e8-bf16 together $E; b e8-fp8 together $E --train.precision=fp8; b e8-mx together $E $MX
fi
b bf16-together-2 together $C; b bf16-alternate-2 alternate $C
b d32-together-2 together $C $D; b d32-alternate-2 alternate $C $D
for p in "bf16-together-1 fp8-together olmoe-8l" "e8-bf16 e8-fp8 scaling-e8"; do set -- $p
  [ -f $L/$1.json ] && [ -f $L/$2.json ] && python3 bench/precision_table.py $L/$1.json $L/$2.json > $L/$3-table.md 2>&1
done
tar
