#!/usr/bin/env bash
# Run from the repository root, where .gpu/nx holds main at cda53f9 with ../gathered-experts-h100-20261207/
# variants.patch, ../gathered-experts-h100-20261207/rows-per-warp/variant.patch and then variant.patch applied:
# the gathered gate/up forward under train.recompute = selective (MOECORE_GATHER_FORWARD=1) against the permute
# pass, and the LM head in chunks of 8192 rows against 4096 (MOECORE_HEAD_CHUNK_ROWS); both switches exist only
# in that tree.
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs-nx3; rm -rf $L; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt
cd .gpu/nx && ln -sf ../../.deps .deps
(cmake --preset cuda >/dev/null && cmake --build --preset cuda --target moecore test_gpu) > $L/build.log 2>&1
echo "built at ${SECONDS}s"; ls build/cuda/moecore || { grep -h error $L/build.log | head; exit 1; }
tgz() { (cd $L && tar czf $OUT/logs.tgz .); }
timeout 240 build/cuda/tests/test_gpu --gtest_filter='*Gathered*' > $L/tests.log 2>&1
echo "tests rc=$? $(grep -E '^\[  (PASSED|FAILED)' $L/tests.log | tr '\n' ' ') at ${SECONDS}s"; tgz
r=0; for v in 0 1 1 0; do r=$((r+1)); g=; [ $v = 1 ] && g=1
  env ${g:+MOECORE_GATHER_FORWARD=1} timeout 120 build/cuda/moecore bench configs/olmoe-8l.toml --train.recompute=selective \
    --warmup 3 --steps 10 > $L/step-gf-$v-$r.log 2>&1
  echo "selective gather_fwd=$v: $(grep -E '^tokens/s/GPU' $L/step-gf-$v-$r.log) | $(grep -E '^memory' $L/step-gf-$v-$r.log | cut -c1-40) | $(grep -E '^ *(experts|dispatch) ' $L/step-gf-$v-$r.log | tr -s ' ' | tr '\n' ';')"; tgz
done
# The LM head's chunk (4096 rows, 4 chunks of olmoe-8l's 16,384 tokens) against 8192: one FP32 dW accumulation
# instead of three, a logits buffer twice as large.
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
shape="--model.n_layers=7"; [ "$mib" -gt 100000 ] && shape=""
r=0; for c in 4096 8192 8192 4096; do r=$((r+1))
  MOECORE_HEAD_CHUNK_ROWS=$c timeout 100 build/cuda/moecore bench configs/olmoe-8l.toml $shape --warmup 3 --steps 10 \
    > $L/step-head-$c-$r.log 2>&1
  echo "head chunk $c: $(grep -E '^tokens/s/GPU' $L/step-head-$c-$r.log) | $(grep -E '^memory' $L/step-head-$c-$r.log | cut -c1-40) | $(grep -E '^ *lm_head ' $L/step-head-$c-$r.log | tr -s ' ')"; tgz
done
