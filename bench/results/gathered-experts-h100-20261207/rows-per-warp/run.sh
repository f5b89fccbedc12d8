#!/usr/bin/env bash
# The second call: run with PRECISIONS= from the repository root, where .gpu/nx holds main at cda53f9
# with ../variants.patch and then variant.patch applied (the gathered producers' copies by row: 4 lanes
# a row in the forward, 8 a (row, box) in the weight gradient).
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs-nx2; rm -rf $L; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt
cd .gpu/nx && ln -sf ../../.deps .deps
(cmake --preset cuda >/dev/null && cmake --build --preset cuda --target moecore moecore_op_bench test_gpu) > $L/build.log 2>&1
echo "built at ${SECONDS}s"; ls build/cuda/moecore || { grep -h error $L/build.log | head; exit 1; }
tgz() { (cd $L && tar czf $OUT/logs.tgz .); }
# The gathered forward's bitwise test (and the restructured grouped GEMM parity tests, the clock sampler's).
timeout 240 build/cuda/tests/test_gpu --gtest_filter='*Gathered*' \
  > $L/tests.log 2>&1
echo "tests rc=$? $(grep -E '^\[  (PASSED|FAILED)' $L/tests.log | tr '\n' ' ') at ${SECONDS}s"; tgz
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
shape="--model.n_layers=7"; [ "$mib" -gt 100000 ] && shape=""
r=0; for v in 0 0; do r=$((r+1)); al=; [ $v = 1 ] && al=1
  env ${al:+MOECORE_MGRID_ALIGN=1} build/cuda/moecore_op_bench --ops grouped_gemm --backend wgmma --iters 10 --warmup 2 \
    > $L/op-$v-$r.log 2>&1
  echo "op align=$v: $(grep -E '^(gate_up|down) (forward|dgrad) |^permute|^gu |^gathered' $L/op-$v-$r.log | tr -s ' ' | tr '\n' ';')"
done
# The gathered experts in the step (BF16): ABBA against the permute pass, with the memory line.
r=0; for v in 0 1 1 0; do r=$((r+1)); g=; [ $v = 1 ] && g=1
  env ${g:+MOECORE_GATHER_EXPERTS=1} timeout 120 build/cuda/moecore bench configs/olmoe-8l.toml $shape --warmup 3 \
    --steps 10 > $L/step-gather-$v-$r.log 2>&1
  echo "step gather=$v: $(grep -E '^tokens/s/GPU' $L/step-gather-$v-$r.log) | $(grep -E '^memory' $L/step-gather-$v-$r.log | cut -c1-60) | $(grep -E '^ *(experts|dispatch) ' $L/step-gather-$v-$r.log | tr -s ' ' | tr '\n' ';')"; tgz
done
for p in ${PRECISIONS-bf16}; do r=0; for v in 0 1 1 0; do r=$((r+1)); al=; [ $v = 1 ] && al=1
  env ${al:+MOECORE_MGRID_ALIGN=1} timeout 120 build/cuda/moecore bench configs/olmoe-8l.toml $shape --train.precision=$p \
    --warmup 3 --steps 10 > $L/step-$p-$v-$r.log 2>&1
  echo "step $p align=$v: $(grep -E '^tokens/s/GPU' $L/step-$p-$v-$r.log) | $(grep -E '^ *experts' $L/step-$p-$v-$r.log)"; tgz
done; done
