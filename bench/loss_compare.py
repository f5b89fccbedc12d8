#!/usr/bin/env python3
"""The losses of two training runs of the same config, step by step, from their metrics.jsonl
(`moecore train ... --log.interval=1`): the largest relative difference of the loss and of the
grad norm, and whether it is within the bound (default 1e-3, the order of the GPU-vs-CPU parity
of a BF16 step; two runs of one tree are bitwise equal). Exit status 1 when outside the bound,
or when the runs do not have the same steps.
Usage: bench/loss_compare.py RUN_DIR_A RUN_DIR_B [--bound 1e-3] [--name-a A --name-b B]"""
import argparse
import json
import sys


def records(run_dir):
    out = {}
    with open(f"{run_dir}/metrics.jsonl") as f:
        for line in f:
            line = line.strip()
            if not line.endswith("}"):
                continue  # a torn last line
            r = json.loads(line)
            if "loss" in r and "step" in r:
                out[r["step"]] = r
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--bound", type=float, default=1e-3)
    p.add_argument("--name-a", default="a")
    p.add_argument("--name-b", default="b")
    args = p.parse_args()
    ra, rb = records(args.a), records(args.b)
    if not ra or sorted(ra) != sorted(rb):
        print(f"loss_compare: the runs log different steps ({len(ra)} and {len(rb)} records)", file=sys.stderr)
        return 1
    worst_loss = worst_norm = 0.0
    print(f"step  loss {args.name_a:>12}  loss {args.name_b:>12}  rel diff")
    for s in sorted(ra):
        la, lb = ra[s]["loss"], rb[s]["loss"]
        d = abs(la - lb) / max(abs(lb), 1e-30)
        worst_loss = max(worst_loss, d)
        na, nb = ra[s].get("grad_norm"), rb[s].get("grad_norm")
        if na is not None and nb is not None:
            worst_norm = max(worst_norm, abs(na - nb) / max(abs(nb), 1e-30))
        print(f"{s:4d}  {la:17.6f}  {lb:17.6f}  {d:.2e}")
    ok = worst_loss <= args.bound and worst_norm <= args.bound
    print(f"worst relative difference: loss {worst_loss:.2e}, grad norm {worst_norm:.2e} "
          f"({'within' if ok else 'outside'} {args.bound:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
