#!/usr/bin/env bash
set -uo pipefail
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
(cmake --preset cuda >/dev/null && cmake --build --preset cuda --target test_gpu moecore_op_bench > $OUT/build.log 2>&1) || { tail -30 $OUT/build.log; exit 1; }
T=$(find build/cuda -name test_gpu -type f | head -1)
timeout 100 stdbuf -oL build/cuda/moecore_op_bench --ops grouped_gemm --backend wgmma --out $OUT/opbench.json > $OUT/opbench.log 2>&1; echo "opbench rc=$?"
cat $OUT/opbench.log | tail -12
timeout 100 $T --gtest_filter='Cases/AdamWParity.*:AdamW*:RmsnormRope*:*Rope*:*Swiglu*' > $OUT/tests.log 2>&1; echo "tests rc=$?"
grep -E "FAILED|PASSED|tests ran" $OUT/tests.log | tail -8
timeout 150 ncu --set full -k regex:'fp8_m_contiguous' -c 2 build/cuda/moecore_op_bench --ops grouped_fp8 > $OUT/ncu-fp8.txt 2>&1; echo "ncu rc=$?"
grep -E "Duration|L2 Cache Throughput|Compute \(SM\)|Issue Slots Busy|Registers Per|Stall|Achieved Occupancy|Local Memory|smsp__pcsamp" $OUT/ncu-fp8.txt | head -30
