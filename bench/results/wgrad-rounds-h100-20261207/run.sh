#!/usr/bin/env bash
# The variants tree (main at e03b02e with variants.patch applied) unpacked at .gpu/nx:
# the norms' tests and QK-norm's backward under ncu; the weight gradients with L2 hints 0..3 in the op bench;
# the bf16 step with hints 0 and 3 alternately.
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs-nx; rm -rf $L; mkdir -p $L; nvidia-smi -L | tee $L/gpu.txt
ROOT=$PWD
(cmake --preset cuda >/dev/null && cmake --build --preset cuda --target moecore) > $L/build-main.log 2>&1 &
cd .gpu/nx && ln -sf $ROOT/.deps .deps
(cmake --preset cuda >/dev/null && cmake --build --preset cuda --target moecore moecore_op_bench test_gpu) > $L/build.log 2>&1
wait; echo "built at ${SECONDS}s"; ls build/cuda/moecore $ROOT/build/cuda/moecore || { grep -h error $L/build*.log | head; exit 1; }
tgz() { (cd $L && tar czf $OUT/logs.tgz --exclude='build*' .); }
build/cuda/tests/test_gpu --gtest_filter="*Rmsnorm*:*Rope*:GroupedGemm*:*Wgrad*:*Fp8*:*Swiglu*:*Permute*" > $L/tests.log 2>&1
echo "tests rc=$? $(grep -E '^\[  (PASSED|FAILED)' $L/tests.log | tr '\n' ' ') at ${SECONDS}s"; tgz
# The norms' backward and the FP8 producers (div_mod) in both trees, fp8 step kernels under ncu.
for t in main nx; do bin=build/cuda/moecore; [ $t = main ] && bin=$ROOT/build/cuda/moecore
  timeout 90 ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    -k regex:"rmsnorm_backward_row_chunks|fp8_quantize_rows128|swiglu_.*fp8|permute_gather_rows_fp8" --csv --page raw \
    $bin bench configs/olmoe-8l.toml --model.n_layers=7 --train.precision=fp8 --warmup 1 --steps 1 \
    > $L/ncu-$t.csv 2> $L/ncu-$t.err; echo "ncu $t rc=$?"; tgz
done
for v in 0 1 2 3 A0 A3; do h=${v#A}; al=; [ "$v" != "$h" ] && al=1
  env MOECORE_WGRAD_L2=$h ${al:+MOECORE_WGRAD_ALIGN=1} build/cuda/moecore_op_bench --ops grouped_gemm --backend wgmma \
    --iters 10 --warmup 2 > $L/op-$v.log 2>&1
  echo "op $v: $(grep -i wgrad $L/op-$v.log | tr -s ' ' | tr '\n' ';' | cut -c1-300)"; tgz
done
best=$(for v in 1 2 3 A0 A3; do echo "$(grep -E '^gate_up wgrad +\|' $L/op-$v.log | awk -F'|' '{print $3+0}') $v"; done | sort -n | head -1 | cut -d' ' -f2)
echo "best op variant: ${best:-none}"; best=${best:-3}
for v in 0 $best; do h=${v#A}; al=; [ "$v" != "$h" ] && al=1
  env MOECORE_WGRAD_L2=$h ${al:+MOECORE_WGRAD_ALIGN=1} timeout 120 ncu --set full -k regex:grouped_gemm_k_contiguous_sm90 -c 1 \
    build/cuda/moecore_op_bench --ops grouped_gemm --backend wgmma --iters 1 --warmup 0 > $L/ncu-wgrad-$v.txt 2>&1
  echo "ncu wgrad $v: $(grep -E ' (Duration|DRAM Throughput|L2 Hit Rate|Compute \(SM\) Throughput|L2 Cache Throughput) ' $L/ncu-wgrad-$v.txt | tr -s ' ' | tr '\n' ';')"
done
r=0; for v in 0 $best $best 0; do r=$((r+1)); h=${v#A}; al=; [ "$v" != "$h" ] && al=1
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv \
    -lms 200 > $L/smi-$v-$r.csv 2>&1 & smi=$!
  env MOECORE_WGRAD_L2=$h ${al:+MOECORE_WGRAD_ALIGN=1} timeout 100 build/cuda/moecore bench configs/olmoe-8l.toml \
    --model.n_layers=7 --warmup 3 --steps 10 --json $L/step-$v-$r.json > $L/step-$v-$r.log 2>&1
  echo "step $v r$r: $(grep -E '^tokens/s/GPU' $L/step-$v-$r.log) | $(grep -E '^ *experts' $L/step-$v-$r.log)"; kill $smi
  echo "  clocks: $(awk -F, 'NR>1 && $3+0>300 {n++; c+=$1; p+=$3} END {if (n) printf "%d samples >300W: sm %.0f MHz, %.0f W", n, c/n, p/n}' $L/smi-$v-$r.csv)"; tgz
done
python3 - $L/ncu-main.csv $L/ncu-nx.csv <<'PY'
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
        print(f"  {k:60s} {c:4d} {ns / c / 1e3:9.1f} us/call {b / ns if ns else 0:6.2f} B/ns")
PY
