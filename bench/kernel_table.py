#!/usr/bin/env python3
"""Where one training step's GPU time goes, kernel by kernel, from Nsight Compute's raw CSV.

Record a run's kernel durations (every kernel of the bench, one replay each, GPU clocks left alone):

  ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \\
      build/cuda/moecore bench configs/olmoe-8l.toml --warmup 1 --steps 1 > bf16.csv

then `bench/kernel_table.py bf16.csv [fp8.csv ...]` prints, for the last whole step of each file
(the kernels after the previous step's optimizer update through the last one), every kernel name
with its launches and milliseconds, largest first, side by side when several files are given,
then the step's time by class of kernel (CLASSES: the experts' GEMMs, their weight gradients, the
dense GEMMs, the attention core, the optimizer, the rest).
Where the file also holds `dram__bytes_read.sum` and `dram__bytes_write.sum` (add them to ncu's
--metrics), each row also gives the kernel's DRAM traffic in TB/s (its bytes over its time), so a
memory-bound kernel below the GPU's bandwidth shows in the table; with --bytes also its MB read and
written a launch (the mean over its launches), to set against what it must move once (a kernel that
reads an input several times from DRAM shows there). Bytes are counted as they reach DRAM: dirty
lines still in L2 when a kernel ends are not, so a kernel's writes may read low.
A step ends with the AdamW update kernel (--step-kernel names another). Files may be gzipped.
The durations are of kernels run one at a time under the profiler: their sum is below the step
the bench times (no overlap between streams, and the clocks of an idle-between-kernels GPU).
"""
import argparse
import collections
import csv
import gzip
import json
import math
import re
import sys


DRAM_COLUMNS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
BYTE_UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}


def read_kernels(path):
    """[(kernel name, duration in ns, (DRAM bytes read, written) or None)] in launch order."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not quoted
    except (OSError, EOFError) as e:
        sys.exit(f"kernel_table: cannot read {path}: {e}")
    rows = list(csv.reader(lines))
    if not rows or "Kernel Name" not in rows[0] or "gpu__time_duration.sum" not in rows[0]:
        sys.exit(f"kernel_table: {path}: no 'Kernel Name' and 'gpu__time_duration.sum' columns "
                 "(expected ncu --metrics gpu__time_duration.sum --csv --page raw)")
    name_col, time_col = rows[0].index("Kernel Name"), rows[0].index("gpu__time_duration.sum")
    unit = rows[1][time_col] if len(rows) > 1 else ""
    scale = {"ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}.get(unit)
    if scale is None:
        sys.exit(f"kernel_table: {path}: unknown duration unit '{unit}'")
    # DRAM bytes, where both columns are there.
    byte_cols = []
    if all(c in rows[0] for c in DRAM_COLUMNS):
        for c in DRAM_COLUMNS:
            col = rows[0].index(c)
            u = rows[1][col] if len(rows) > 1 else ""
            if u not in BYTE_UNITS:
                sys.exit(f"kernel_table: {path}: unknown unit '{u}' of {c}")
            byte_cols.append((col, BYTE_UNITS[u]))
    out = []
    for r in rows[2:]:
        try:
            ns = float(r[time_col].replace(",", "")) * scale
        except (IndexError, ValueError):
            continue
        nbytes = None
        if byte_cols:
            try:
                nbytes = tuple(float(r[c].replace(",", "")) * u for c, u in byte_cols)
            except (IndexError, ValueError):
                nbytes = (float("nan"), float("nan"))  # a kernel whose bytes ncu did not give: unknown
        out.append((r[name_col], ns, nbytes))
    return out


def known(v):
    """v, or None where it is NaN (a launch whose bytes ncu did not give)."""
    return None if math.isnan(v) else v


def short_name(full):
    """The function's own name: no return type, namespaces, template arguments or parameters."""
    s = re.sub(r"\(.*", "", full)
    depth, plain = 0, []
    for ch in s:  # drop <...>, nested
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif depth == 0:
            plain.append(ch)
    s = "".join(plain).strip().split(" ")[-1]
    s = s.split("::")[-1] or full
    return s if len(s) <= 64 else s[:61] + "..."


# Kernel classes, first match wins (by the short name): what FP8 or a faster GEMM can take, and what
# it cannot (the attention core, the optimizer, the memory-bound rest).
CLASSES = (
    ("experts' grouped GEMMs (forward, data gradient)",
     re.compile(r"^grouped_gemm_(m_contiguous|fp8_m_contiguous)")),
    ("experts' weight gradients", re.compile(r"^grouped_gemm_(k_contiguous|fp8_wgrad)")),
    ("dense GEMMs (cuBLASLt)", re.compile(r"^(nvjet|sm90_xmma|cutlass|splitKreduce)|gemm")),
    ("attention core (cuDNN or own)", re.compile(r"^(cudnn|matmul_dq|compute_dot_do_o)|attention|flash")),
    ("optimizer (update, gradient norm)", re.compile(r"^(adamw|grad_sum|grad_norm|f64_sum)")),
)
OTHER_CLASS = "the rest (norms, SwiGLU, permutes, residual adds, quantisation, ...)"


def kernel_class(name):
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return OTHER_CLASS


def last_step(kernels, step_kernel):
    ends = [i for i, (n, *_) in enumerate(kernels) if step_kernel in n]
    if not ends:
        sys.exit(f"kernel_table: no launch of '{step_kernel}' (the kernel that ends a step)")
    start = ends[-2] + 1 if len(ends) >= 2 else 0
    return kernels[start:ends[-1] + 1], len(ends)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+", help="ncu --csv --page raw output (.csv or .csv.gz)")
    ap.add_argument("--step-kernel", default="adamw_update_segments", help="the kernel that ends each step")
    ap.add_argument("--top", type=int, default=40, help="rows printed (0: all)")
    ap.add_argument("--bytes", action="store_true",
                    help="with DRAM columns: also each kernel's MB read and written a launch (the mean)")
    ap.add_argument("--json", help="also write the tables as JSON here")
    a = ap.parse_args()

    tables = []
    for path in a.csv:
        step, steps = last_step(read_kernels(path), a.step_kernel)
        agg = collections.OrderedDict()
        has_bytes = bool(step) and step[0][2] is not None
        for name, ns, nbytes in step:
            k = short_name(name)
            calls, total, rd, wr = agg.get(k, (0, 0.0, 0.0, 0.0))
            launch_rd, launch_wr = nbytes or (0.0, 0.0)
            agg[k] = (calls + 1, total + ns, rd + launch_rd, wr + launch_wr)
        by_kernel = {}
        for k, (c, t, rd, wr) in agg.items():
            by_kernel[k] = {"calls": c, "ms": t / 1e6}
            if has_bytes:  # NaN where a launch's bytes are missing (printed as "-", JSON null)
                b = rd + wr
                rate = b / t / 1e3 if t > 0 else 0.0
                by_kernel[k].update({"dram_gb": known(b / 1e9), "dram_tb_per_s": known(rate),
                                     "dram_read_mb_per_launch": known(rd / c / 1e6),
                                     "dram_write_mb_per_launch": known(wr / c / 1e6)})
        by_class = collections.OrderedDict((label, 0.0) for label, _ in CLASSES)
        by_class[OTHER_CLASS] = 0.0
        for k, e in by_kernel.items():
            by_class[kernel_class(k)] += e["ms"]
        tables.append({"file": path, "steps_seen": steps, "kernels": len(step), "dram": has_bytes,
                       "total_ms": sum(ns for _, ns, _ in step) / 1e6, "by_kernel": by_kernel,
                       "by_class": by_class})

    names = sorted({k for t in tables for k in t["by_kernel"]},
                   key=lambda k: -max(t["by_kernel"].get(k, {"ms": 0.0})["ms"] for t in tables))
    if a.top > 0:
        names = names[:a.top]
    width = max([len(n) for n in names] + [6])
    per_launch = lambda t: a.bytes and t["dram"]  # the MB columns of that file
    head = f"{'kernel':<{width}}" + "".join(
        f" | {'calls':>5} {'ms':>8} {'share':>6}" + (f" {'TB/s':>5}" if t["dram"] else "") +
        (f" {'MB rd':>8} {'MB wr':>8}" if per_launch(t) else "") for t in tables)
    print("one step's kernels, largest first; columns per file: " +
          ", ".join(f"[{i}] {t['file']} ({t['kernels']} kernels, {t['total_ms']:.2f} ms)"
                    for i, t in enumerate(tables)))
    print(head)
    print("-" * len(head))
    for n in names:
        line = f"{n:<{width}}"
        for t in tables:
            e = t["by_kernel"].get(n)
            line += (f" | {e['calls']:>5} {e['ms']:>8.3f} {100 * e['ms'] / t['total_ms']:>5.1f}%" if e
                     else f" | {'-':>5} {'-':>8} {'-':>6}")
            if t["dram"]:
                rate = e["dram_tb_per_s"] if e else None
                line += f" {rate:>5.2f}" if rate is not None else f" {'-':>5}"
            if per_launch(t):
                for key in ("dram_read_mb_per_launch", "dram_write_mb_per_launch"):
                    mb = e[key] if e else None
                    line += f" {mb:>8.1f}" if mb is not None else f" {'-':>8}"
        print(line)
    print(f"{'sum':<{width}}" + "".join(f" | {t['kernels']:>5} {t['total_ms']:>8.3f} {100.0:>5.1f}%" +
                                        (f" {'':>5}" if t["dram"] else "") +
                                        (f" {'':>8} {'':>8}" if per_launch(t) else "") for t in tables))
    # The same step by class of kernel.
    cwidth = max(len(c) for c in tables[0]["by_class"])
    print()
    print(f"{'class':<{cwidth}}" + "".join(f" | {'ms':>8} {'share':>6}" for _ in tables))
    for c in tables[0]["by_class"]:
        print(f"{c:<{cwidth}}" + "".join(
            f" | {t['by_class'][c]:>8.3f} {100 * t['by_class'][c] / t['total_ms']:>5.1f}%" for t in tables))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(tables, f, indent=1)


if __name__ == "__main__":
    main()
