#!/usr/bin/env bash
# device call 6: the grouped GEMM kernels' tests after the producer-entry helper; the bf16 and fp8 steps
# (olmoe-8l whole on an H200, 6 layers on an 80 GB GPU; scaling-e8 where it fits), with each GPU's ceiling line
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt
(cmake --preset cuda >/dev/null && timeout 220 cmake --build --preset cuda --target moecore test_gpu) > $L/build.log 2>&1 || { tail -30 $L/build.log; (cd $L && tar czf $OUT/logs.tgz .); exit 1; }
echo "built at ${SECONDS}s"
timeout 100 build/cuda/tests/test_gpu --gtest_filter='*GroupedGemm*:Fp8Gpu.*:CudaStep.Fp8*' > $L/tests.log 2>&1; echo "tests rc=$? at ${SECONDS}s"
grep -E '^\[  (PASSED|FAILED)|FAILED  \]' $L/tests.log
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
shape=""; [ "$mib" -lt 100000 ] && shape="--model.n_layers=6"
for p in bf16 fp8; do
  timeout 120 build/cuda/moecore bench configs/olmoe-8l.toml $shape --warmup 3 --steps 10 --train.precision=$p \
    --json $L/olmoe-8l-$p.json > $L/olmoe-8l-$p.log 2>&1; echo "olmoe-8l $shape $p rc=$? at ${SECONDS}s"
  grep -E '^tokens/s/GPU|^memory|^of ceiling' $L/olmoe-8l-$p.log
done
python3 bench/precision_table.py $L/olmoe-8l-bf16.json $L/olmoe-8l-fp8.json > $L/olmoe-8l-table.md 2>&1; cat $L/olmoe-8l-table.md
if [ -z "$shape" ]; then
  for p in bf16 fp8; do
    timeout 130 build/cuda/moecore bench configs/scaling-e8.toml --moe.capacity_factor=0 --warmup 2 --steps 5 \
      --train.precision=$p --json $L/scaling-e8-$p.json > $L/scaling-e8-$p.log 2>&1; echo "scaling-e8 $p rc=$? at ${SECONDS}s"
    grep -E '^tokens/s/GPU|^memory|^of ceiling' $L/scaling-e8-$p.log
  done
  python3 bench/precision_table.py $L/scaling-e8-bf16.json $L/scaling-e8-fp8.json > $L/scaling-e8-table.md 2>&1; cat $L/scaling-e8-table.md
fi
(cd $L && tar czf $OUT/logs.tgz .)
