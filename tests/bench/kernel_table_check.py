#!/usr/bin/env python3
"""bench/kernel_table.py on the committed kernel profile of one olmoe-8l step
(bench/results/step-kernels-20261204/): its step is the kernels after the second-to-last AdamW
update through the last (summed here from the CSV independently), the experts' four grouped GEMMs
forward and data gradient appear 4 x n_layers times and the AdamW update once, the class table adds
up to the step and holds the kernels its patterns name, a file with DRAM byte columns gives each
kernel's TB/s (and with --bytes its MB read and written a launch), and files without the duration
column, without a step-ending kernel or with an unknown byte unit are refused, naming the problem.
Usage: kernel_table_check.py --source-dir DIR
"""
import argparse
import csv
import gzip
import os
import re
import subprocess
import sys
import tempfile


def run(script, *args):
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True)


def rows_of(stdout):
    out = {}
    for line in stdout.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) >= 2 and parts[1] and parts[1].split()[0].isdigit():
            calls, ms = parts[1].split()[:2]
            out[parts[0]] = (int(calls), float(ms))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source-dir", required=True)
    a = ap.parse_args()
    script = os.path.join(a.source_dir, "bench", "kernel_table.py")
    path = os.path.join(a.source_dir, "bench", "results", "step-kernels-20261204", "olmoe-8l-bf16.csv.gz")
    r = run(script, path, "--top", "0")
    if r.returncode != 0:
        sys.exit(f"kernel_table.py failed: {r.stderr}")
    got = rows_of(r.stdout)

    # The step summed straight from the CSV.
    lines = [line for line in gzip.open(path, "rt") if line.startswith('"')]
    table = list(csv.reader(lines))
    name, dur = table[0].index("Kernel Name"), table[0].index("gpu__time_duration.sum")
    kernels = [(row[name], float(row[dur].replace(",", ""))) for row in table[2:]]
    ends = [i for i, (n, _) in enumerate(kernels) if "adamw_update_segments" in n]
    step = kernels[ends[-2] + 1:ends[-1] + 1]
    total_ms = sum(t for _, t in step) / 1e6
    if got.get("sum") != (len(step), round(total_ms, 3)):
        sys.exit(f"sum row {got.get('sum')}, expected ({len(step)}, {total_ms:.3f})")

    config = open(os.path.join(a.source_dir, "configs", "olmoe-8l.toml")).read()
    layers = int(re.search(r"^n_layers\s*=\s*(\d+)", config, re.M).group(1))
    for kernel, calls in (("grouped_gemm_m_contiguous_sm90", 4 * layers), ("adamw_update_segments", 1)):
        if kernel not in got or got[kernel][0] != calls:
            sys.exit(f"{kernel}: expected {calls} launches in the step, got {got.get(kernel)}")

    # The class table: the classes add up to the step, and each holds the kernels its pattern names
    # (summed here from the kernel rows: the grouped GEMMs, the weight gradients, the optimizer).
    lines = r.stdout.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("class"))
    classes = {x.split("|")[0].strip(): float(x.split("|")[1].split()[0]) for x in lines[start + 1:] if "|" in x}
    if len(classes) != 6 or abs(sum(classes.values()) - total_ms) > 0.01:
        sys.exit(f"classes {classes} do not add up to the step's {total_ms:.3f} ms")
    expect = {
        "experts' grouped GEMMs (forward, data gradient)": got["grouped_gemm_m_contiguous_sm90"][1],
        "experts' weight gradients": got["grouped_gemm_k_contiguous_sm90"][1],
        "optimizer (update, gradient norm)": sum(ms for k, (_, ms) in got.items()
                                                  if k != "sum" and re.match(r"(adamw|grad_sum|grad_norm)", k)),
    }
    for label, ms in expect.items():
        if abs(classes.get(label, -1.0) - ms) > 0.002:
            sys.exit(f"class '{label}': {classes.get(label)} ms, its kernels sum to {ms:.3f}")

    with tempfile.TemporaryDirectory() as tmp:
        bad = os.path.join(tmp, "bad.csv")
        open(bad, "w").write('"ID","Kernel Name"\n"",""\n"0","k"\n')
        r = run(script, bad)
        if r.returncode == 0 or "gpu__time_duration.sum" not in r.stderr or bad not in r.stderr:
            sys.exit(f"a file without durations was not refused by name: {r.returncode} {r.stderr}")
        no_step = os.path.join(tmp, "nostep.csv")
        open(no_step, "w").write('"ID","Kernel Name","gpu__time_duration.sum"\n"","","ns"\n"0","k","1000"\n')
        r = run(script, no_step)
        if r.returncode == 0 or "adamw_update_segments" not in r.stderr:
            sys.exit(f"a file without a step-ending kernel was not refused: {r.returncode} {r.stderr}")
        dram_head = '"ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"\n'

        def table_of(name, body, *args):
            """kernel_table.py on a CSV with DRAM columns: (its run, copy_kernel's row fields, the sum row)."""
            path = os.path.join(tmp, name)
            open(path, "w").write(dram_head + body)
            r = run(script, path, *args)
            lines = r.stdout.splitlines()
            line = next((x for x in lines if x.startswith("copy_kernel")), "")
            fields = line.split("|")[1].split() if "|" in line else []
            return r, fields, next((x for x in lines if x.startswith("sum")), "")

        # A kernel's TB/s is its bytes read and written over its time, summed over its launches
        # (2 launches: 3 MB + 1 GB and 1 MB + 2 GB in 1 + 0.5 ms: 3.004 GB / 1.5 ms).
        dram_body = ('"","","Mbyte","Gbyte","msecond"\n'
                     '"0","adamw_update_segments","0","0","1"\n'
                     '"1","copy_kernel(float*)","3","1","1"\n'
                     '"2","copy_kernel(float*)","1","2","0.5"\n'
                     '"3","adamw_update_segments","1000","1","1"\n')
        r, parts, _ = table_of("dram.csv", dram_body)
        if r.returncode != 0 or parts != ["2", "1.500", "60.0%", "2.00"]:
            sys.exit(f"DRAM columns: expected copy_kernel at 2 launches, 1.500 ms, 60.0%, 2.00 TB/s, got "
                     f"{parts} (rc {r.returncode}, {r.stderr})")
        # --bytes: the MB read and written a launch, the means (4 MB and 3 GB over 2 launches).
        r, parts, _ = table_of("dram.csv", dram_body, "--bytes")
        if r.returncode != 0 or parts != ["2", "1.500", "60.0%", "2.00", "2.0", "1500.0"]:
            sys.exit(f"--bytes: expected copy_kernel's 2.0 MB read and 1500.0 MB written a launch, got "
                     f"{parts} (rc {r.returncode}, {r.stderr})")
        # A launch without its bytes keeps its time in the step, and its kernel's rate is "-".
        gap_body = ('"","","byte","byte","ns"\n'
                    '"0","adamw_update_segments","0","0","1000"\n'
                    '"1","copy_kernel(float*)","n/a","5","1000"\n'
                    '"2","adamw_update_segments","1","1","1000"\n')
        r, parts, total = table_of("gap.csv", gap_body)
        if r.returncode != 0 or parts != ["1", "0.001", "50.0%", "-"] or "0.002" not in total:
            sys.exit(f"a launch without bytes: expected its time kept and its rate '-', got {parts} / {total!r} "
                     f"(rc {r.returncode}, {r.stderr})")
        r, parts, _ = table_of("gap.csv", gap_body, "--bytes")
        if r.returncode != 0 or parts != ["1", "0.001", "50.0%", "-", "-", "-"]:
            sys.exit(f"--bytes, a launch without bytes: expected its MB as '-', got {parts} (rc {r.returncode})")
        r, _, _ = table_of("badunit.csv", '"","","bits","byte","ns"\n"0","adamw_update_segments","1","1","1"\n')
        if r.returncode == 0 or "dram__bytes_read.sum" not in r.stderr:
            sys.exit(f"an unknown byte unit was not refused by name: {r.returncode} {r.stderr}")
    print(f"kernel_table.py: a step of {len(step)} kernels, {total_ms:.3f} ms, as the CSV gives it; "
          "its classes add up to it; DRAM rates and bytes per kernel; bad files refused")


if __name__ == "__main__":
    main()
