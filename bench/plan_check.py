#!/usr/bin/env python3
"""The run plan's memory estimate against the measured peak, one row per `moecore bench --json`
record: config, layout, recompute mode, measured peak (moecore's device allocations, largest over
GPUs), the plan's estimate, and the error (estimate - peak) / peak. The last line says whether every
record is within the 10% the planner is held to. GPU records only (the CPU bench has no device peak).
Usage: bench/plan_check.py BENCH.json [BENCH.json ...]
"""
import json
import sys

LIMIT = 0.10


def main(paths):
    if not paths:
        sys.exit("usage: plan_check.py BENCH.json [BENCH.json ...]")
    rows = []
    for p in paths:
        try:
            r = json.load(open(p))
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"{p}: not a bench record ({e})")
        s = r.get("settings", {})
        if s.get("device") != "cuda" or "mem_peak_gib" not in r or "mem_estimate_gib" not in r:
            continue
        layout = f"dp={s.get('dp', 1)} ep={s.get('ep', 1)}" + (" zero" if s.get("zero") else "")
        if s.get("moment_dtype", "fp32") != "fp32":
            layout += f" {s['moment_dtype']} moments"
        err = (r["mem_estimate_gib"] - r["mem_peak_gib"]) / r["mem_peak_gib"]
        rows.append((r["config"], layout, s.get("recompute", "none"), r["mem_peak_gib"], r["mem_estimate_gib"], err))
    if not rows:
        sys.exit("plan_check.py: no GPU bench record with mem_peak_gib and mem_estimate_gib among " + " ".join(paths))
    print("run plan memory estimate vs measured peak (moecore plan / the bench's estimate):")
    print("| config | layout | recompute | peak GiB | estimate GiB | error |")
    print("| --- | --- | --- | --- | --- | --- |")
    for cfg, layout, mode, peak, est, err in rows:
        print(f"| {cfg} | {layout} | {mode} | {peak:.2f} | {est:.2f} | {100 * err:+.2f}% |")
    worst = max(abs(r[5]) for r in rows)
    print(f"worst error {100 * worst:.2f}%: {'within' if worst <= LIMIT else 'OUTSIDE'} {100 * LIMIT:.0f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
