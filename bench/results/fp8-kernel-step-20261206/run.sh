#!/usr/bin/env bash
# device call 7: olmoe-8l (6 layers) fp8 step of fb5f6a8 against c050b0b (the FP8 kernel's scale loads and epilogue)
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; nvidia-smi -L
ln -sf ../.deps .base/.deps
SUITE=0 OTHER_COMMIT=c050b0b MOECORE_COMMIT=fb5f6a8 BENCH_ARGS="--model.n_layers=6 --train.precision=fp8" OUT=$L \
  timeout 380 scripts/bench-compare .base configs/olmoe-8l.toml 2 > $L/compare.log 2>&1; echo "compare rc=$?"
tail -10 $L/compare.log
for f in $L/bench-compare-*/*.log; do echo "$(basename $f) $(grep -m1 '^  experts' $f)"; done
grep -h -o '"last_loss":[^,]*' $L/bench-compare-*/*.json
(cd $L && tar czf $OUT/logs.tgz .)
timeout 120 ncu --kernel-name regex:adamw_update_fp8_weights --launch-count 1 --section Occupancy --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section LaunchStats --section WarpStateStats --page details --print-details all \
  build/cuda/moecore bench configs/olmoe-8l.toml --model.n_layers=2 --train.precision=fp8 --warmup 0 --steps 1 --out= \
  > $L/ncu_adamw_fp8.txt 2>&1; echo "ncu rc=$?"
grep -v '^==PROF' $L/ncu_adamw_fp8.txt | grep -E 'Registers Per|Achieved Occ|Theoretical Occ|Block Limit|DRAM Through|Duration|Stall (Long|Barrier|Wait|LG|Short|Not Sel|Math)|Memory Throughput' | head -30
(cd $L && tar czf $OUT/logs.tgz .)
