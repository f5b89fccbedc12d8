#!/usr/bin/env bash
# The FP8 experts' update in the op bench, and under Nsight Compute beside the plain update.
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs-fu; rm -rf $L; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt
(cmake --preset cuda >/dev/null && cmake --build --preset cuda --target moecore_op_bench) > $L/build.log 2>&1
echo "built at ${SECONDS}s"; ls build/cuda/moecore_op_bench || { grep -h error $L/build.log | head; exit 1; }
tgz() { (cd $L && tar czf $OUT/logs.tgz .); }
build/cuda/moecore_op_bench --ops adamw --iters 20 --warmup 3 --out $L/adamw.json > $L/adamw.log 2>&1; echo "op bench rc=$? at ${SECONDS}s"; tgz
for k in adamw_update_fp8_weights adamw_update_segments; do
  timeout 200 ncu --set full -k regex:$k -c 1 -o $L/$k build/cuda/moecore_op_bench --ops adamw --iters 1 --warmup 0 > $L/ncu-$k.log 2>&1
  echo "ncu $k rc=$? at ${SECONDS}s"
  ncu --import $L/$k.ncu-rep --page details > $L/$k.txt 2>&1; rm -f $L/$k.ncu-rep; tgz
done
cat $L/adamw.log | head -30
for k in adamw_update_fp8_weights adamw_update_segments; do echo "== $k"; grep -E "DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Registers Per|L2 Hit|Mem Busy|Max Bandwidth|Block Limit|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc" $L/$k.txt | head -20; done
