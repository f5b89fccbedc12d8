#!/usr/bin/env python3
"""torch._grouped_mm on the same grouped-GEMM problems as moecore_op_bench, in the same run.

Reads moecore_op_bench's JSON (shapes, per-expert row counts, one result per op and backend),
times torch's grouped GEMM (CUTLASS) for the six expert GEMMs with CUDA events (warm-up, median),
and prints one table: op | TFLOP/s of each moecore backend (mma, wgmma) | torch TFLOP/s | speed
of each backend relative to torch (torch us / moecore us; > 1 is faster). Writes the merged
record to --out.

usage: grouped_mm_torch.py MOECORE_RESULT.json [--out FILE.json]
"""
import json
import sys

import torch


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    ours = json.load(open(sys.argv[1]))
    out_path = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    rows, E, D, I = ours["rows"], ours["experts"], ours["d_model"], ours["hidden"]
    counts = torch.tensor(ours["counts"], dtype=torch.int32)
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()  # group ends, as torch expects
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, D, device=dev, dtype=bf, generator=g)
    h = torch.randn(rows, I, device=dev, dtype=bf, generator=g)
    w_gu = torch.randn(E, 2 * I, D, device=dev, dtype=bf, generator=g) * 0.02  # [E, n, k] as moecore
    w_dn = torch.randn(E, D, I, device=dev, dtype=bf, generator=g) * 0.02
    dy_gu = torch.randn(rows, 2 * I, device=dev, dtype=bf, generator=g)
    dy_dn = torch.randn(rows, D, device=dev, dtype=bf, generator=g)
    # Layouts torch._grouped_mm takes: b as [E, k, n] with k contiguous (a transposed view of
    # moecore's [E, n, k]) for forward; for dgrad b = w[e] ([E, n, k] as [E, K=n, N=k]) prepared
    # column-major outside the timed region; wgrad is the 2d x 2d form grouped along rows.
    w_gu_t, w_dn_t = w_gu.transpose(1, 2), w_dn.transpose(1, 2)
    w_gu_d = w_gu.transpose(1, 2).contiguous().transpose(1, 2)
    w_dn_d = w_dn.transpose(1, 2).contiguous().transpose(1, 2)
    dy_gu_t = dy_gu.t().contiguous()
    dy_dn_t = dy_dn.t().contiguous()
    x_c, h_c = x.t().contiguous().t(), h.t().contiguous().t()
    # torch's 2d x 2d (row-grouped) form needs every group's row count to be a multiple of 8
    # (16 bytes of BF16); its wgrad runs on counts rounded down to multiples of 8 with the
    # remainder given to expert 0 (same total rows and FLOPs), and the record says so.
    aligned = [c - c % 8 for c in ours["counts"]]
    aligned[0] += rows - sum(aligned)
    offs_w = torch.cumsum(torch.tensor(aligned, dtype=torch.int32), 0).to(torch.int32).cuda()
    gm = torch._grouped_mm
    problems = {
        "gate_up forward": (lambda: gm(x, w_gu_t, offs=offs), 2.0 * rows * 2 * I * D),
        "gate_up dgrad": (lambda: gm(dy_gu, w_gu_d, offs=offs), 2.0 * rows * 2 * I * D),
        "gate_up wgrad": (lambda: gm(dy_gu_t, x_c, offs=offs_w), 2.0 * rows * 2 * I * D),
        "down forward": (lambda: gm(h, w_dn_t, offs=offs), 2.0 * rows * D * I),
        "down dgrad": (lambda: gm(dy_dn, w_dn_d, offs=offs), 2.0 * rows * D * I),
        "down wgrad": (lambda: gm(dy_dn_t, h_c, offs=offs_w), 2.0 * rows * D * I),
    }
    backends = []
    for r in ours["results"]:
        b = r.get("backend", "mma")
        if b not in backends:
            backends.append(b)
    header = f"{'op':<18} | " + " | ".join(f"{b + ' TF/s':>11}" for b in backends)
    header += f" | {'torch TF/s':>10} | " + " | ".join(f"{b + ' x torch':>13}" for b in backends)
    print(header)
    merged = []
    for op, (fn, flops) in problems.items():
        mine = {r.get("backend", "mma"): r for r in ours["results"] if r["op"] == op}
        if not mine:
            continue
        try:
            ms = timed(fn, ours["warmup"], ours["iters"])
            t_us, t_tf = ms * 1e3, flops / (ms * 1e-3) / 1e12
        except Exception as e:  # a layout torch refuses: report, do not hide
            print(f"{op:<18} | torch failed: {e}")
            merged += [{**r, "torch_error": str(e)} for r in mine.values()]
            continue
        line = f"{op:<18} | " + " | ".join(
            f"{mine[b]['tflops']:11.1f}" if b in mine else f"{'-':>11}" for b in backends)
        line += f" | {t_tf:10.1f} | " + " | ".join(
            f"{t_us / mine[b]['us_median']:13.2f}" if b in mine else f"{'-':>13}" for b in backends)
        print(line)
        merged += [{**r, "torch_us_median": t_us, "torch_tflops": t_tf, "x_torch": t_us / r["us_median"]}
                   for r in mine.values()]
    rec = {**ours, "results": merged, "torch": torch.__version__,
           "torch_wgrad_counts": aligned, "note": "torch wgrad on 8-row-aligned group sizes"}
    if out_path:
        json.dump(rec, open(out_path, "w"), indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
