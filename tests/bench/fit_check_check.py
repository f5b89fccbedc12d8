#!/usr/bin/env python3
"""scripts/fit-check (scripts/gpu-check's memory fit by the run plan) with a moecore binary: on an
80 GB GPU (79.6 GiB) olmoe-8l's fp8 bench (83.757 GiB) does not fit and 7 of its 8 layers is the
most that does; on an H200 (140.4 GiB) all 8 fit, and so does scaling-e16 with full recompute
(135.4 GiB) but not on the smaller GPU; bad arguments exit 2 naming the argument.
Usage: fit_check_check.py --moecore BIN --source-dir DIR
"""
import argparse
import os
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moecore", required=True)
    ap.add_argument("--source-dir", required=True)
    a = ap.parse_args()
    script = os.path.join(a.source_dir, "scripts", "fit-check")
    olmoe = os.path.join(a.source_dir, "configs", "olmoe-8l.toml")
    e16 = os.path.join(a.source_dir, "configs", "scaling-e16.toml")

    def run(*args):
        return subprocess.run([script, *args], capture_output=True, text=True, cwd=a.source_dir)

    failures = []

    def expect(what, r, code, out=None, err=None):
        if r.returncode != code or (out is not None and r.stdout.strip() != out) or (err and err not in r.stderr):
            failures.append(f"{what}: exit {r.returncode} (want {code}), stdout {r.stdout.strip()!r}"
                            f"{f' (want {out!r})' if out is not None else ''}, stderr {r.stderr.strip()!r}")

    expect("olmoe-8l fp8 on 79.6 GiB", run("fits", a.moecore, "79.6", olmoe, "--train.precision=fp8"), 1, "83.757")
    expect("olmoe-8l fp8 on 140.4 GiB", run("fits", a.moecore, "140.4", olmoe, "--train.precision=fp8"), 0, "83.757")
    expect("olmoe-8l fp8 layers on 79.6 GiB",
           run("layers", a.moecore, "79.6", "8", olmoe, "--train.precision=fp8"), 0, "7")
    expect("olmoe-8l fp8 layers on 140.4 GiB",
           run("layers", a.moecore, "140.4", "8", olmoe, "--train.precision=fp8"), 0, "8")
    expect("olmoe-8l layers on 10 GiB", run("layers", a.moecore, "10", "8", olmoe), 1, "")
    full = ("--moe.capacity_factor=0", "--train.recompute=full")
    expect("scaling-e16 full on 140.4 GiB", run("fits", a.moecore, "140.4", e16, *full), 0, "135.440")
    expect("scaling-e16 full on 79.6 GiB", run("fits", a.moecore, "79.6", e16, *full), 1, "135.440")
    expect("GPU_GIB not a number", run("fits", a.moecore, "80GB", olmoe), 2, "", "GPU_GIB")
    expect("MAX below 2", run("layers", a.moecore, "80", "1", olmoe), 2, "", "MAX")
    expect("no such config", run("fits", a.moecore, "80", os.path.join(a.source_dir, "configs", "nope.toml")), 2, "",
           "nope.toml")
    expect("no such binary", run("fits", os.path.join(a.source_dir, "nope"), "80", olmoe), 2, "", "MOECORE")
    if failures:
        sys.exit("\n".join(failures))
    print("fit-check: 11 cases as expected")


if __name__ == "__main__":
    main()
