#!/usr/bin/env python3
"""BF16 against the FP8 recipe on one GPU: a table from two `moecore bench --json` records of the
same config, train.precision = bf16 first and fp8 second (the same GPU call, so the two ran on the
same device state).

Rows: tokens/s/GPU, TFLOP/s/GPU (BF16-equivalent: the same FLOP count for both, so the ratio is the
throughput ratio), step time, measured peak memory and the run plan's estimate, first and last
loss; then each phase of the profiled eager step (CUDA events) side by side, with the ratio. The
FP8 experts quantise their inputs and weights inside the `experts` phase, so its time includes
every quantisation pass.
Usage: bench/precision_table.py BF16.json FP8.json
"""
import json
import sys


def main(paths):
    if len(paths) != 2:
        sys.exit("usage: precision_table.py BF16.json FP8.json")
    recs = [json.load(open(p)) for p in paths]
    for want, r in zip(("bf16", "fp8"), recs):
        got = r.get("settings", {}).get("precision")
        if got != want:
            sys.exit(f"{r.get('command', '?')}: expected train.precision = {want!r}, the record says {got!r}")
    if recs[0]["config"] != recs[1]["config"]:
        sys.exit(f"the records are of different configs: {recs[0]['config']} and {recs[1]['config']}")
    moments = [r.get("settings", {}).get("moment_dtype", "fp32") for r in recs]
    if moments[0] != moments[1]:
        sys.exit(f"the records differ in optim.moment_dtype ({moments[0]} and {moments[1]}): the optimizer "
                 "phase would not compare the precisions")
    b, f = recs
    print(f"train.precision on {b['config']}: bf16 vs fp8 (fp8: the forward GEMMs and data gradients of the "
          f"routed experts, MLPs and attention projections in block-scaled FP8, quantisation counted)")
    print("| figure | bf16 | fp8 | fp8 / bf16 |")
    print("| --- | --- | --- | --- |")

    def row(name, x, y, fmt="{:.0f}"):
        ratio = f"{y / x:.3f}x" if x else "-"
        print(f"| {name} | {fmt.format(x)} | {fmt.format(y)} | {ratio} |")

    row("tokens/s/GPU", b["tokens_per_s_per_gpu"], f["tokens_per_s_per_gpu"])
    row("TFLOP/s/GPU (BF16-equivalent FLOPs)", b["tflops_per_gpu"], f["tflops_per_gpu"], "{:.1f}")
    row("step ms (mean)", b["step_ms"]["mean"], f["step_ms"]["mean"], "{:.2f}")
    row("peak memory GiB", b["mem_peak_gib"], f["mem_peak_gib"], "{:.2f}")
    row("run plan's estimate GiB", b["mem_estimate_gib"], f["mem_estimate_gib"], "{:.2f}")
    row("first loss", b["first_loss"], f["first_loss"], "{:.4f}")
    row("last loss", b["last_loss"], f["last_loss"], "{:.4f}")
    pb, pf = b.get("phase_ms") or {}, f.get("phase_ms") or {}
    if pb and pf:
        print("| phase (profiled eager step, ms) | bf16 | fp8 | fp8 / bf16 |")
        print("| --- | --- | --- | --- |")
        for name in pb:
            if name in pf:
                row(name, pb[name], pf[name], "{:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
