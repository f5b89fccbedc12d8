#!/usr/bin/env bash
# RMSNorm rows held (forward) and staged (backward): tests, then the bf16 step against the base tree alternately,
# then the norm kernels under ncu in both trees.
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs-rn; rm -rf $L; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt
ROOT=$PWD
(cmake --preset cuda >/dev/null && cmake --build --preset cuda --target moecore test_gpu) > $L/build-new.log 2>&1 &
(cd .gpu/base && ln -sf $ROOT/.deps .deps && cmake --preset cuda >/dev/null && cmake --build --preset cuda --target moecore) > $L/build-base.log 2>&1
wait; echo "built at ${SECONDS}s"; ls build/cuda/moecore .gpu/base/build/cuda/moecore || { grep -h error $L/build-*.log | head; exit 1; }
tgz() { (cd $L && tar czf $OUT/logs.tgz --exclude='build-*' .); }
timeout 240 build/cuda/tests/test_gpu --gtest_filter="${TESTS:-*Rmsnorm*:*Rope*:CudaTrain.*:CudaStep.*:CudaRecompute.*}" > $L/tests.log 2>&1
echo "tests rc=$? $(grep -E '^\[  (PASSED|FAILED)' $L/tests.log | tr '\n' ' ') at ${SECONDS}s"; grep -E '^\[  FAILED' $L/tests.log | head; tgz
b() { local name=$1 bin=$2; shift 2
  timeout 120 $bin bench configs/olmoe-8l.toml --model.n_layers=7 --warmup 3 --steps 10 "$@" --json $L/$name.json > $L/$name.log 2>&1
  echo "$name rc=$? $(grep -E '^tokens/s/GPU' $L/$name.log) | $(grep -E '^ *attention' $L/$name.log) | $(grep -E '^expert load' $L/$name.log | cut -c60-) at ${SECONDS}s"; tgz; }
for r in 1 2; do
  b base-bf16-$r .gpu/base/build/cuda/moecore --train.precision=bf16
  b new-bf16-$r build/cuda/moecore --train.precision=bf16
done
for t in base new; do
  bin=build/cuda/moecore; [ $t = base ] && bin=.gpu/base/build/cuda/moecore
  timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum -k regex:rmsnorm \
    --csv --page raw $bin bench configs/olmoe-8l.toml --model.n_layers=7 --warmup 1 --steps 1 > $L/ncu-$t.csv 2> $L/ncu-$t.err
  echo "ncu $t rc=$? at ${SECONDS}s"; tgz
done
python3 - $L/ncu-base.csv $L/ncu-new.csv <<'PY'
import csv, sys, collections
for p in sys.argv[1:]:
    rows = list(csv.reader([l for l in open(p) if l.startswith('"')]))
    if not rows: print(p, "empty"); continue
    h = rows[0]; n, t = h.index("Kernel Name"), h.index("gpu__time_duration.sum")
    r, w = h.index("dram__bytes_read.sum"), h.index("dram__bytes_write.sum")
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for x in rows[2:]:
        k = x[n].split("(")[0][-60:]
        a = agg[k]; a[0] += 1; a[1] += float(x[t].replace(",", "")); a[2] += float(x[r].replace(",", "")) + float(x[w].replace(",", ""))
    print(p, rows[1][t], rows[1][r])
    for k, (c, ns, b) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"  {k:60s} {c:4d} {ns/1e6/ c * 1e3:9.1f} us/call {b/ns if ns else 0:6.2f} (bytes/ns if unit byte)")
PY
