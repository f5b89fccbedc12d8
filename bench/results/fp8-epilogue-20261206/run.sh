#!/usr/bin/env bash
# device call 6: the FP8 kernel's one-barrier-pair epilogue (new2) against cf9d707 (new): tests, then alternately timed
NV=$(python3 -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])")/lib
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib:$NV:${LD_LIBRARY_PATH:-} PATH=/usr/local/cuda/bin:$PATH
L=$OUT/logs; mkdir -p $L; nvidia-smi -L
timeout 100 .gpu/t/test_gpu --gtest_filter='Fp8Gpu.*' > $L/tests.log 2>&1; echo "tests rc=$?"; grep -E '^\[  (PASSED|FAILED)' $L/tests.log
for r in 1 2; do for v in new new2; do
  timeout 100 .gpu/op_bench_$v --ops grouped_fp8 --iters 10 --warmup 2 --out $L/$v-$r.json > $L/$v-$r.log 2>&1
  echo "== $v round $r rc=$?"; grep -E '^(gate_up|down) (forward|dgrad)' $L/$v-$r.log
done; done
(cd $L && tar czf $OUT/logs.tgz .)
