#!/usr/bin/env python3
"""Headless-browser check of the pages `moecore report` and `moecore plan --html` write.

Trains a short CPU run (8 steps, a record every 2, evals every 4), writes its report and the plan
page of configs/olmoe-8l.toml (1..4 GPUs, opened at dp 4, ep 2), loads each in headless Chromium
(--dump-dom) and checks that the script drew: no "JS error" in the page's error box, one SVG
path per run and series with as many points as metrics.jsonl has records, every heatmap cell
(records x MoE layers), the tokens axis when opened as report.html#x=tokens; on the plan page the
grid cells (GPUs x layers), the expert slices, the memory parts and the traffic bars.
Exit 0: passed; 1: a check failed; 77: no Chromium here (CTest reports the entry as skipped).
Usage: browser_check.py --moecore PATH --source-dir DIR
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile


def browser():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def dump_dom(chrome, url, tmp):
    cmd = [chrome, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
           "--user-data-dir=" + os.path.join(tmp, "profile"), "--virtual-time-budget=5000", "--dump-dom", url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0 or "<html" not in r.stdout:
        sys.exit("FAIL: %s exited %d on %s:\n%s" % (chrome, r.returncode, url, r.stderr[-2000:]))
    return r.stdout


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit("FAIL: %s exited %d:\n%s%s" % (" ".join(cmd), r.returncode, r.stdout, r.stderr))
    return r.stdout


failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def no_js_errors(dom, page):
    m = re.search(r'<div id="js-errors">(.*?)</div>', dom, re.S)
    check(m is not None, page + ": the error box is in the page")
    check(m is not None and m.group(1).strip() == "", page + ": no JS error (got: %r)" % (m.group(1)[:300] if m else ""))


def count(dom, cls):
    return len(re.findall(r'<(?:rect|path)[^>]*class="%s"' % cls, dom))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moecore", required=True)
    ap.add_argument("--source-dir", required=True)
    args = ap.parse_args()
    chrome = browser()
    if chrome is None:
        print("SKIP: no chromium / google-chrome on PATH (scripts/setup.sh installs the Debian package chromium)")
        return 77
    with tempfile.TemporaryDirectory(prefix="moecore_browser_") as tmp:
        run_dir = os.path.join(tmp, "short_run")
        run([args.moecore, "train", "--train.steps=8", "--log.interval=2", "--train.eval_interval=4",
             "--run.dir=" + run_dir])
        records = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
        steps = [r for r in records if "loss" in r]
        evals = [r for r in records if "eval_loss" in r]
        layers = len(steps[0]["layer_load_imbalance"])
        report = os.path.join(tmp, "report.html")
        run([args.moecore, "report", run_dir, "-o", report])

        dom = dump_dom(chrome, "file://" + report, tmp)
        no_js_errors(dom, "report")
        paths = re.findall(r'<path[^>]*class="series"[^>]*data-label="([^"]*)"[^>]*data-points="(\d+)"', dom)
        check(len(paths) >= 8, "report: at least 8 series paths drawn (got %d)" % len(paths))
        check(("train", str(len(steps))) in paths, "report: the train loss path has %d points" % len(steps))
        check(("eval", str(len(evals))) in paths, "report: the eval loss path has %d points" % len(evals))
        for chart in ("loss", "eval_loss", "tokens_per_s", "grad_norm", "lr", "lb_loss", "z_loss", "load_imbalance",
                      "dropped_frac", "moe_lb_loss", "moe_load_max_mean", "moe_bias_abs_max"):
            m = re.search(r'<div class="chart" id="chart-%s">(.*?)</div></div>' % chart, dom, re.S)
            check(m is not None and 'class="series"' in m.group(1), "report: chart %s has a data path" % chart)
        # The per-layer charts: one series per MoE layer, each with a point per step record.
        m = re.search(r'<div class="chart" id="chart-moe_lb_loss">(.*?)</div></div>', dom, re.S)
        per_layer = re.findall(r'<path[^>]*class="series"[^>]*data-label="layer \d+"[^>]*data-points="(\d+)"',
                               m.group(1) if m else "")
        check(per_layer == [str(len(steps))] * layers,
              "report: the per-layer lb chart has %d series of %d points, got %s" % (layers, len(steps), per_layer))
        m = re.search(r'id="chart-mfu">(.*?)</div>', dom, re.S)
        check(m is not None and "not recorded" in m.group(1), "report: MFU of a CPU run is said to be not recorded")
        cells = count(dom, "cell")
        check(cells == len(steps) * layers, "report: %d heatmap cells (%d records x %d MoE layers), got %d"
              % (len(steps) * layers, len(steps), layers, cells))
        dom_t = dump_dom(chrome, "file://" + report + "#x=tokens", tmp)
        no_js_errors(dom_t, "report#x=tokens")
        check(dom_t.count(">tokens seen</text>") >= 9, "report#x=tokens: every chart drawn against tokens seen")

        plan = os.path.join(tmp, "plan.html")
        cfg = os.path.join(args.source_dir, "configs", "olmoe-8l.toml")
        run([args.moecore, "plan", cfg, "--html", "--gpus", "4", "--layout", "dp=4,ep=2", "-o", plan])
        dom = dump_dom(chrome, "file://" + plan, tmp)
        no_js_errors(dom, "plan")
        check(count(dom, "grid-cell") == 4 * 8, "plan: 32 grid cells (4 GPUs x 8 layers), got %d" % count(dom, "grid-cell"))
        check(count(dom, "expert-slice") == 4 * 8, "plan: an expert slice per GPU and MoE layer, got %d"
              % count(dom, "expert-slice"))
        check("experts 0-31" in dom and "experts 32-63" in dom, "plan: ep 2 splits the 64 experts in halves")
        check(count(dom, "mem-part") >= 3 * 6, "plan: memory parts of the 3 modes drawn, got %d" % count(dom, "mem-part"))
        check(count(dom, "traffic-bar") >= 5, "plan: ZeRO-1 and EP traffic bars and the total, got %d"
              % count(dom, "traffic-bar"))
        check("<td>1</td><td>4</td>" in dom, "plan: the ranking of 4-GPU layouts is listed")
    if failures:
        print("%d check(s) failed" % len(failures))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
