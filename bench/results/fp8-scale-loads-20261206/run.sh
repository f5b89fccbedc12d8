#!/usr/bin/env bash
# device call 5: the FP8 grouped GEMM with the scale loads after the MMA issue (new) against c050b0b (base),
# alternately, then the warp-stall profile of the new kernel
NV=$(python3 -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])")/lib
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib:$NV:${LD_LIBRARY_PATH:-} PATH=/usr/local/cuda/bin:$PATH
L=$OUT/logs; mkdir -p $L; nvidia-smi -L
for r in 1 2; do for v in base new; do
  timeout 100 .gpu/op_bench_$v --ops grouped_fp8 --iters 10 --warmup 2 --out $L/$v-$r.json > $L/$v-$r.log 2>&1
  echo "== $v round $r rc=$?"; grep -E '^(gate_up|down) (forward|dgrad)|^experts' $L/$v-$r.log
done; done
timeout 150 ncu --kernel-name regex:grouped_gemm_fp8 --launch-skip 0 --launch-count 1 --section WarpStateStats \
  --section SpeedOfLight --page details --print-details all .gpu/op_bench_new --ops grouped_fp8 --iters 1 --warmup 0 \
  > $L/ncu_stalls.txt 2>&1; echo "ncu rc=$?"
grep -v '^==PROF' $L/ncu_stalls.txt | grep -i -E 'stall|Duration|Throughput' | head -40
(cd $L && tar czf $OUT/logs.tgz .)
