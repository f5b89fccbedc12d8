#!/usr/bin/env python3
"""bench/precision_table.py on committed bench records (bench/results/fp8-model-20261202/mlp/):
the ratios it prints are the records' figures divided (tokens/s, peak memory, the experts and mlp
phases), and it refuses records in the wrong order, of different configs or of different moment
dtypes (optim.moment_dtype), naming the problem.
Usage: precision_table_check.py --source-dir DIR
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def run(script, *paths):
    return subprocess.run([sys.executable, script, *paths], capture_output=True, text=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source-dir", required=True)
    a = ap.parse_args()
    script = os.path.join(a.source_dir, "bench", "precision_table.py")
    rec = os.path.join(a.source_dir, "bench", "results", "fp8-model-20261202", "mlp")
    bf16, fp8 = os.path.join(rec, "scaling-e8-bf16.json"), os.path.join(rec, "scaling-e8-fp8.json")
    r = run(script, bf16, fp8)
    if r.returncode != 0:
        sys.exit(f"precision_table.py failed: {r.stderr}")
    b, f = json.load(open(bf16)), json.load(open(fp8))
    rows = {line.split("|")[1].strip(): line for line in r.stdout.splitlines() if line.startswith("| ")}
    want = {
        "tokens/s/GPU": f["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"],
        "peak memory GiB": f["mem_peak_gib"] / b["mem_peak_gib"],
        "experts": f["phase_ms"]["experts"] / b["phase_ms"]["experts"],
        "mlp": f["phase_ms"]["mlp"] / b["phase_ms"]["mlp"],
    }
    for name, ratio in want.items():
        line = rows.get(name)
        if line is None:
            sys.exit(f"no row '{name}' in:\n{r.stdout}")
        if f"{ratio:.3f}x" not in line:
            sys.exit(f"row '{name}': expected the ratio {ratio:.3f}x, got: {line}")
    swapped = run(script, fp8, bf16)
    if swapped.returncode == 0 or "expected train.precision = 'bf16'" not in swapped.stderr:
        sys.exit(f"swapped records were not refused: {swapped.returncode} {swapped.stderr}")
    with tempfile.TemporaryDirectory() as tmp:
        other = dict(f)
        other["config"] = "olmoe-8l"
        path = os.path.join(tmp, "other.json")
        json.dump(other, open(path, "w"))
        mixed = run(script, bf16, path)
        if mixed.returncode == 0 or "different configs" not in mixed.stderr:
            sys.exit(f"records of different configs were not refused: {mixed.returncode} {mixed.stderr}")
        other = dict(f)
        other["settings"] = dict(f.get("settings", {}), moment_dtype="bf16")
        json.dump(other, open(path, "w"))
        mixed = run(script, bf16, path)
        if mixed.returncode == 0 or "optim.moment_dtype (fp32 and bf16)" not in mixed.stderr:
            sys.exit(f"records of different moment dtypes were not refused: {mixed.returncode} {mixed.stderr}")
    print("precision_table.py: ratios as the records give them; wrong order, mixed configs and moment dtypes refused")


if __name__ == "__main__":
    main()
