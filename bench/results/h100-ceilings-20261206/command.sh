#!/usr/bin/env bash
# device call 4: the H100's own ceilings, by the op bench (grouped GEMM, cuDNN attention, dense GEMM, AdamW traffic)
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; nvidia-smi -L
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee $L/gpu.csv
(cmake --preset cuda >/dev/null && timeout 200 cmake --build --preset cuda --target moecore_op_bench) > $L/build.log 2>&1 || { tail -30 $L/build.log; exit 1; }
echo "built at ${SECONDS}s"
B=build/cuda/moecore_op_bench
timeout 150 $B --ops grouped_gemm --backend wgmma --out $L/grouped_gemm.json > $L/grouped_gemm.log 2>&1; echo "grouped rc=$? at ${SECONDS}s"
timeout 100 $B --ops attention --attn-backend cudnn --out $L/attention.json > $L/attention.log 2>&1; echo "attention rc=$? at ${SECONDS}s"
timeout 100 $B --ops fp8_gemm --out $L/fp8_gemm.json > $L/fp8_gemm.log 2>&1; echo "fp8_gemm rc=$? at ${SECONDS}s"
timeout 150 $B --ops adamw --warmup 3 --iters 10 --out $L/adamw.json > $L/adamw.log 2>&1; echo "adamw rc=$? at ${SECONDS}s"
cat $L/grouped_gemm.log | head -30; cat $L/attention.log | tail -8; head -30 $L/fp8_gemm.log; head -16 $L/adamw.log
(cd $L && tar czf $OUT/logs.tgz .)
