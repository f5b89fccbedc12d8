#!/usr/bin/env python3
"""Activation recomputation on one GPU: a table from `moecore bench --json` records of the same
config with train.recompute = none, selective, full (in that order on the command line).

activation GiB = measured peak - model state, the model state being the run plan's
(`mem_estimate_state_gib` of the record: weights, gradients and moments as the rank holds them;
18 bytes per parameter on one GPU), so the figure is the saved activations, the backward scratch
and the workspaces together. Records without that field (older benches) use 18 bytes per parameter.
Usage: bench/recompute_table.py NONE.json SELECTIVE.json FULL.json
"""
import json
import sys

GIB = 2.0 ** 30


def main(paths):
    if len(paths) != 3:
        sys.exit("usage: recompute_table.py NONE.json SELECTIVE.json FULL.json")
    recs = [json.load(open(p)) for p in paths]
    for mode, r in zip(("none", "selective", "full"), recs):
        got = r.get("settings", {}).get("recompute")
        if got != mode:
            sys.exit(f"{r.get('command', '?')}: expected train.recompute = {mode!r}, the record says {got!r}")
        if r.get("num_gpus", 1) != 1:
            sys.exit(f"{r.get('command', '?')}: the table is for one-GPU records, this one ran on {r['num_gpus']}")
    state = recs[0].get("mem_estimate_state_gib", 18.0 * recs[0]["total_params"] / GIB)
    base_act = recs[0]["mem_peak_gib"] - state
    base_tps = recs[0]["tokens_per_s_per_gpu"]
    print(f"recompute on {recs[0]['config']}: model state {state:.2f} GiB (the run plan's; {recs[0]['total_params']} parameters)")
    print("| mode | activation GiB | activations removed | peak GiB | estimate GiB | tokens/s/GPU | throughput | step ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode, r in zip(("none", "selective", "full"), recs):
        act = r["mem_peak_gib"] - state
        print(f"| {mode} | {act:.2f} | {100 * (1 - act / base_act):.1f}% | {r['mem_peak_gib']:.2f} | "
              f"{r['mem_estimate_gib']:.2f} | {r['tokens_per_s_per_gpu']:.0f} | "
              f"{100 * r['tokens_per_s_per_gpu'] / base_tps:.1f}% | {r['step_ms']['mean']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
