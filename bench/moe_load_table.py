#!/usr/bin/env python3
"""The load-balancing loss against the real expert load of a run: one Markdown table row per step
record of RUN_DIR/metrics.jsonl with the training loss, lb_loss and z_loss (interval means over
MoE layers), then per MoE layer its lb_loss and load_max_mean (max/mean of the interval's tokens
per expert) from the record's `moe` key. Only figures the records hold; standard library only.

    python3 bench/moe_load_table.py runs/gerrymander [--every N]
"""
import argparse
import json
import os
import sys


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            if not line.endswith("\n"):
                break  # a torn last line of a live run
            rec = json.loads(line)
            if "loss" in rec and "moe" in rec:
                yield rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--every", type=int, default=1, help="keep every N-th step record (the last always)")
    a = ap.parse_args()
    rows = list(records(a.run_dir))
    if not rows:
        sys.exit(f"{a.run_dir}/metrics.jsonl has no step records with a 'moe' key")
    keep = [r for i, r in enumerate(rows) if i % a.every == 0 or i == len(rows) - 1]
    layers = [m["layer"] for m in rows[0]["moe"]]
    head = ["step", "loss", "lb_loss", "z_loss"] + [f"lb L{l}" for l in layers] + [f"max/mean L{l}" for l in layers]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in keep:
        cells = [str(r["step"]), f"{r['loss']:.3f}", f"{r['lb_loss']:.4f}", f"{r['z_loss']:.2f}"]
        cells += [f"{m['lb_loss']:.4f}" for m in r["moe"]]
        cells += [f"{m['load_max_mean']:.2f}" for m in r["moe"]]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
