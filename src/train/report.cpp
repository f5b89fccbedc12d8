// The report page: metrics.jsonl read per run directory, the records embedded as JSON, and an
// inline script that draws line charts (SVG paths, one per run and series) against step, tokens
// or wall time, and a heatmap of each run's per-layer expert load (layer_load_imbalance). The plan
// page: the planner's figures of every layout, and a script that looks up the chosen one and
// draws the GPU / layer / expert grid, the memory by part and the traffic per collective.
#include "train/report.h"

#include <ctime>
#include <filesystem>
#include <map>

#include "checkpoint/files.h"
#include "core/error.h"
#include "model/layout.h"
#include "train/planner.h"

namespace moe {

namespace fs = std::filesystem;

namespace {

constexpr const char* kDataOpen = "<script type=\"application/json\" id=\"moecore-data\">";
constexpr const char* kDataClose = "</script>";

// Style and the chart helpers both pages share: window errors are written into the page (a
// headless browser's DOM dump shows them), axes with round ticks, line charts as SVG paths.
constexpr const char* kCommonHead = R"HTML(<meta charset="utf-8">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:16px 24px;color:#222;max-width:1240px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:18px 0 6px}
.note{color:#555;font-size:12px} .warn{color:#a40;font-size:13px}
#js-errors{color:#b00;font-weight:bold;white-space:pre-wrap}
.grid{display:flex;flex-wrap:wrap;gap:12px} .chart{border:1px solid #ddd;border-radius:4px;padding:4px}
.chart svg{display:block} .legend span{margin-right:14px;white-space:nowrap}
.swatch{display:inline-block;width:12px;height:3px;vertical-align:middle;margin-right:4px}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ddd;padding:2px 8px;text-align:right}
th{background:#f4f4f4} td.l,th.l{text-align:left}
label{margin-right:14px} select{font:inherit}
</style>
<script>
window.addEventListener('error', function (e) {
  var d = document.getElementById('js-errors');
  if (d) d.textContent += 'JS error: ' + e.message + ' (line ' + e.lineno + ')\n';
});
var SVGNS = 'http://www.w3.org/2000/svg';
var PALETTE = ['#1f77b4', '#d62728', '#2ca02c', '#9467bd', '#ff7f0e', '#17becf', '#8c564b', '#e377c2', '#7f7f7f', '#bcbd22'];
function el(tag, attrs, parent, text) {
  var e = document.createElementNS(SVGNS, tag);
  for (var k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function niceTicks(lo, hi, n) {
  if (!(hi > lo)) { var p = Math.abs(lo) > 0 ? Math.abs(lo) * 0.05 : 1; lo -= p; hi += p; }
  var raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / mag;
  var step = (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag, out = [];
  for (var v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  return {lo: lo, hi: hi, ticks: out};
}
function fmt(v) {
  var a = Math.abs(v);
  if (a === 0) return '0';
  if (a >= 1e9) return (v / 1e9).toPrecision(3) + 'G';
  if (a >= 1e6) return (v / 1e6).toPrecision(3) + 'M';
  if (a >= 1e4) return (v / 1e3).toPrecision(3) + 'k';
  if (a < 1e-3) return v.toExponential(1);
  return String(+v.toPrecision(4));
}
// series: [{label, color, dash, points: [[x, y], ...]}]; draws into a new .chart div of `parent`.
function lineChart(parent, id, title, xlabel, series) {
  var W = 600, H = 250, L = 58, R = 12, T = 24, B = 38;
  var div = document.createElement('div');
  div.className = 'chart'; div.id = id; parent.appendChild(div);
  var svg = el('svg', {width: W, height: H, viewBox: '0 0 ' + W + ' ' + H}, div);
  el('text', {x: L, y: 15, 'font-size': 13, 'font-weight': 'bold'}, svg, title);
  var xs = [], ys = [];
  series.forEach(function (s) { s.points.forEach(function (p) { xs.push(p[0]); ys.push(p[1]); }); });
  if (!xs.length) {
    el('text', {x: W / 2, y: H / 2, 'text-anchor': 'middle', fill: '#888', class: 'empty'}, svg, 'not recorded');
    return div;
  }
  var xt = niceTicks(Math.min.apply(null, xs), Math.max.apply(null, xs), 6);
  var yt = niceTicks(Math.min.apply(null, ys), Math.max.apply(null, ys), 5);
  var sx = function (x) { return L + (x - xt.lo) / (xt.hi - xt.lo) * (W - L - R); };
  var sy = function (y) { return H - B - (y - yt.lo) / (yt.hi - yt.lo) * (H - T - B); };
  xt.ticks.forEach(function (v) {
    el('line', {x1: sx(v), x2: sx(v), y1: T, y2: H - B, stroke: '#eee'}, svg);
    el('text', {x: sx(v), y: H - B + 14, 'font-size': 11, 'text-anchor': 'middle'}, svg, fmt(v));
  });
  yt.ticks.forEach(function (v) {
    el('line', {x1: L, x2: W - R, y1: sy(v), y2: sy(v), stroke: '#eee'}, svg);
    el('text', {x: L - 4, y: sy(v) + 4, 'font-size': 11, 'text-anchor': 'end'}, svg, fmt(v));
  });
  el('rect', {x: L, y: T, width: W - L - R, height: H - T - B, fill: 'none', stroke: '#999'}, svg);
  el('text', {x: (L + W - R) / 2, y: H - 6, 'font-size': 12, 'text-anchor': 'middle'}, svg, xlabel);
  series.forEach(function (s) {
    if (!s.points.length) return;
    var d = s.points.map(function (p, i) { return (i ? 'L' : 'M') + sx(p[0]).toFixed(1) + ' ' + sy(p[1]).toFixed(1); }).join(' ');
    el('path', {d: d, fill: 'none', stroke: s.color, 'stroke-width': 1.8, 'stroke-dasharray': s.dash || 'none',
                class: 'series', 'data-label': s.label, 'data-points': s.points.length}, svg);
    if (s.points.length < 40) s.points.forEach(function (p) {
      el('circle', {cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: s.color}, svg);
    });
  });
  var leg = document.createElement('div');
  leg.className = 'legend note';
  series.forEach(function (s) {
    if (!s.points.length) return;
    var sp = document.createElement('span');
    sp.innerHTML = '<span class="swatch" style="background:' + s.color + '"></span>';
    sp.appendChild(document.createTextNode(s.label));
    leg.appendChild(sp);
  });
  div.appendChild(leg);
  return div;
}
</script>
)HTML";

constexpr const char* kReportBody = R"HTML(<title>moecore report</title>
</head><body>
<h1>moecore training report</h1>
<div class="note" id="runs-note"></div>
<div id="js-errors"></div>
<div id="warnings" class="warn"></div>
<p><b>x axis:</b>
<label><input type="radio" name="xaxis" value="step" checked> step</label>
<label><input type="radio" name="xaxis" value="tokens"> tokens seen</label>
<label><input type="radio" name="xaxis" value="wall_s"> wall time (s)</label></p>
<div id="charts" class="grid"></div>
<h2>Expert load per MoE layer (max / mean tokens per expert; 1 = balanced)</h2>
<div class="note">One row per MoE layer, one column per logged interval; darker = more imbalanced.
Colour scale shared by every run.</div>
<div id="heatmaps"></div>
<script>
var DATA = JSON.parse(document.getElementById('moecore-data').textContent);
var AXES = {step: 'step', tokens: 'tokens seen', wall_s: 'wall time since the run started, s'};
function steps(run) { return run.records.filter(function (r) { return typeof r.loss === 'number'; }); }
function evals(run) { return run.records.filter(function (r) { return typeof r.eval_loss === 'number'; }); }
function pts(recs, ax, key) {
  var out = [];
  recs.forEach(function (r) {
    var x = r[ax], y = typeof key === 'function' ? key(r) : r[key];
    if (typeof x === 'number' && typeof y === 'number' && isFinite(y)) out.push([x, y]);
  });
  return out;
}
function color(i) { return PALETTE[i % PALETTE.length]; }
function draw() {
  var ax = document.querySelector('input[name=xaxis]:checked').value;
  var charts = document.getElementById('charts');
  charts.innerHTML = '';
  var multi = DATA.runs.length > 1;
  function label(run, what) { return multi ? run.name + ' ' + what : what; }
  var loss = [];
  DATA.runs.forEach(function (run, i) {
    loss.push({label: label(run, 'train'), color: color(i), points: pts(steps(run), ax, 'loss')});
    loss.push({label: label(run, 'eval'), color: color(i), dash: '5 3', points: pts(evals(run), ax, 'eval_loss')});
  });
  lineChart(charts, 'chart-loss', 'loss (solid: train, dashed: eval)', AXES[ax], loss);
  var single = [
    ['eval_loss', 'eval loss', 'eval_loss', evals],
    ['tokens_per_s', 'throughput, tokens/s', 'tokens_per_s', steps],
    ['mfu', 'MFU (model FLOPs / peak; GPU runs)', 'mfu', steps],
    ['grad_norm', 'grad norm (before clipping)', 'grad_norm', steps],
    ['lr', 'learning rate', 'lr', steps],
    ['lb_loss', 'load-balancing loss', 'lb_loss', steps],
    ['z_loss', 'router z-loss', 'z_loss', steps],
    ['load_imbalance', 'load imbalance (mean over layers)', 'load_imbalance', steps],
    ['dropped_frac', 'dropped share of routes (expert capacity)', 'dropped_frac', steps]];
  single.forEach(function (c) {
    var series = DATA.runs.map(function (run, i) { return {label: run.name, color: color(i), points: pts(c[3](run), ax, c[2])}; });
    lineChart(charts, 'chart-' + c[0], c[1], AXES[ax], series);
  });
  // Per MoE layer (the records' `moe` list): a series per layer (and run), where recorded.
  [['moe_lb_loss', 'load-balancing loss per MoE layer', 'lb_loss'],
   ['moe_load_max_mean', 'max/mean tokens per expert per MoE layer (over the interval)', 'load_max_mean'],
   ['moe_bias_abs_max', 'expert bias, largest |bias| per MoE layer', 'bias_abs_max']].forEach(function (c) {
    var series = [];
    DATA.runs.forEach(function (run, i) {
      var recs = steps(run).filter(function (r) { return Array.isArray(r.moe) && typeof r[ax] === 'number'; });
      var layers = recs.reduce(function (m, r) { return Math.max(m, r.moe.length); }, 0);
      for (var l = 0; l < layers; ++l) {
        var points = [];
        recs.forEach(function (r) {
          var m = r.moe[l];
          if (m && typeof m[c[2]] === 'number') points.push([r[ax], m[c[2]]]);
        });
        var name = 'layer ' + (recs.length && recs[0].moe[l] ? recs[0].moe[l].layer : l);
        series.push({label: label(run, name), color: color(multi ? i : l), dash: multi && l ? '4 2' : undefined,
                     points: points});
      }
    });
    if (series.some(function (s) { return s.points.length > 0; }))
      lineChart(charts, 'chart-' + c[0], c[1], AXES[ax], series);
  });
  drawHeatmaps(ax);
}
function heat(t) {  // 0..1 -> pale yellow .. dark red
  var a = [255, 247, 188], b = [240, 130, 40], c = [110, 10, 30], p, q, u;
  if (t < 0.5) { p = a; q = b; u = t * 2; } else { p = b; q = c; u = (t - 0.5) * 2; }
  return 'rgb(' + [0, 1, 2].map(function (k) { return Math.round(p[k] + (q[k] - p[k]) * u); }).join(',') + ')';
}
function drawHeatmaps(ax) {
  var host = document.getElementById('heatmaps');
  host.innerHTML = '';
  var vmax = 1;
  DATA.runs.forEach(function (run) { steps(run).forEach(function (r) {
    (r.layer_load_imbalance || []).forEach(function (v) { if (v > vmax) vmax = v; }); }); });
  DATA.runs.forEach(function (run, ri) {
    var recs = steps(run).filter(function (r) { return Array.isArray(r.layer_load_imbalance) && typeof r[ax] === 'number'; });
    var div = document.createElement('div');
    div.className = 'chart'; div.id = 'heatmap-' + ri;
    host.appendChild(div);
    var layers = recs.reduce(function (m, r) { return Math.max(m, r.layer_load_imbalance.length); }, 0);
    var W = 1180, L = 70, R = 90, T = 22, rowH = Math.max(8, Math.min(22, 300 / Math.max(1, layers))), B = 34;
    var H = T + rowH * Math.max(1, layers) + B;
    var svg = el('svg', {width: W, height: H}, div);
    el('text', {x: L, y: 15, 'font-size': 13, 'font-weight': 'bold'}, svg, run.name);
    if (!recs.length || !layers) {
      el('text', {x: W / 2, y: T + 14, 'text-anchor': 'middle', fill: '#888', class: 'empty'}, svg,
         'no per-layer expert load recorded (older metrics.jsonl, or a model without MoE layers)');
      return;
    }
    var x0 = 0, x1 = recs[recs.length - 1][ax];
    var sx = function (x) { return L + (x - x0) / ((x1 - x0) || 1) * (W - L - R); };
    recs.forEach(function (r, j) {
      var a = j ? recs[j - 1][ax] : x0, b = r[ax];
      r.layer_load_imbalance.forEach(function (v, l) {
        var cell = el('rect', {x: sx(a), y: T + l * rowH, width: Math.max(1, sx(b) - sx(a)), height: rowH - 1,
                               fill: heat(vmax > 1 ? (v - 1) / (vmax - 1) : 0), class: 'cell'}, svg);
        el('title', {}, cell, 'MoE layer ' + l + ', ' + ax + ' ' + fmt(b) + ': max/mean ' + v.toFixed(3));
      });
    });
    for (var l = 0; l < layers; ++l)
      el('text', {x: L - 4, y: T + l * rowH + rowH * 0.7, 'font-size': 10, 'text-anchor': 'end'}, svg, 'moe ' + l);
    niceTicks(x0, x1, 8).ticks.forEach(function (v) {
      if (v < x0 || v > x1) return;
      el('text', {x: sx(v), y: H - B + 14, 'font-size': 11, 'text-anchor': 'middle'}, svg, fmt(v));
    });
    el('text', {x: (L + W - R) / 2, y: H - 6, 'font-size': 12, 'text-anchor': 'middle'}, svg, AXES[ax]);
    for (var k = 0; k <= 10; ++k)
      el('rect', {x: W - R + 20, y: T + (10 - k) * 8, width: 14, height: 8, fill: heat(k / 10)}, svg);
    el('text', {x: W - R + 38, y: T + 8, 'font-size': 10}, svg, fmt(vmax));
    el('text', {x: W - R + 38, y: T + 86, 'font-size': 10}, svg, '1.0');
  });
}
(function () {
  var note = DATA.runs.map(function (r) {
    return r.name + ' (' + r.dir + '): ' + steps(r).length + ' step records, ' + evals(r).length + ' eval records';
  }).join('; ');
  document.getElementById('runs-note').textContent = 'Generated ' + DATA.generated + ' by moecore report. Runs: ' + note + '.';
  var w = DATA.runs.filter(function (r) { return r.truncated; }).map(function (r) {
    return r.name + ': the last line of metrics.jsonl was incomplete (the run is still writing) and is left out.';
  });
  DATA.runs.forEach(function (r) {
    if (steps(r).some(function (x) { return typeof x.tokens !== 'number'; }))
      w.push(r.name + ': some records carry no tokens / wall_s (written by an older moecore): they are missing on those axes.');
  });
  document.getElementById('warnings').textContent = w.join(' ');
  var m = /^#x=(step|tokens|wall_s)$/.exec(location.hash);  // report.html#x=tokens opens on that axis
  if (m) document.querySelector('input[name=xaxis][value=' + m[1] + ']').checked = true;
  document.querySelectorAll('input[name=xaxis]').forEach(function (i) { i.addEventListener('change', draw); });
  draw();
})();
</script>
</body></html>
)HTML";

constexpr const char* kPlanBody = R"HTML(<title>moecore plan</title>
</head><body>
<h1>moecore plan: <span id="cfg-name"></span></h1>
<div class="note">Every figure on this page was computed by <code>moecore plan</code>'s planner (C++,
src/train/planner.cpp) for every layout it enumerates and embedded when the page was written; the
page only looks them up, it computes nothing of its own. The cuda backend (BF16) on
<span id="gpu-name"></span>; formulas and their accuracy: docs/planning.md.</div>
<div id="js-errors"></div>
<p>
<label>GPUs <select id="sel-gpus"></select></label>
<label>pp <select id="sel-pp"></select></label>
<label>dp = GPUs / pp: <b id="val-dp"></b></label>
<label>ep <select id="sel-ep"></select></label>
<label>recompute <select id="sel-mode"><option>none</option><option>selective</option><option>full</option></select></label>
</p>
<div id="status"></div>
<h2>Which GPU holds which layers and experts</h2>
<div class="note">A row per GPU, a column per layer. Grey: a dense layer (replicated on every GPU).
MoE layer: the dark segment is the slice of the experts the GPU holds (ep rank = GPU mod ep);
the attention and router weights of every layer are on every GPU (pp 1).</div>
<div id="grid" class="chart"></div>
<h2>Memory per GPU by part</h2>
<div class="note">One bar per recompute mode (the chosen one outlined); the red line is the usable
memory per GPU.</div>
<div id="memory" class="chart"></div>
<h2>Traffic per GPU and step</h2>
<div id="traffic" class="chart"></div>
<h2>Layouts of this GPU count that fit, best first (estimated tokens/s/GPU)</h2>
<div id="ranking"></div>
<script>
var DATA = JSON.parse(document.getElementById('moecore-data').textContent);
var MODES = ['none', 'selective', 'full'];
function $(id) { return document.getElementById(id); }
function gib(b) { return (b / 1073741824).toFixed(2); }
function options(sel, values, keep) {
  sel.innerHTML = '';
  values.forEach(function (v) { var o = document.createElement('option'); o.value = o.textContent = v; sel.appendChild(o); });
  if (values.indexOf(+keep) >= 0) sel.value = keep;
}
function layoutsOf(g, pp) { return DATA.layouts.filter(function (l) { return l.gpus === g && l.pp === pp; }); }
function find(g, pp, ep) {
  var ls = layoutsOf(g, pp);
  for (var i = 0; i < ls.length; ++i) if (ls[i].ep === ep || ls[i].error_all_ep) return ls[i];
  return null;
}
function refresh(from) {
  var g = +$('sel-gpus').value;
  if (from === 'gpus' || from === 'init') {
    var pps = []; DATA.layouts.forEach(function (l) { if (l.gpus === g && pps.indexOf(l.pp) < 0) pps.push(l.pp); });
    options($('sel-pp'), pps.sort(function (a, b) { return a - b; }), $('sel-pp').value || 1);
  }
  var pp = +$('sel-pp').value;
  if (from !== 'ep' && from !== 'mode') {
    var eps = layoutsOf(g, pp).filter(function (l) { return l.ep; }).map(function (l) { return l.ep; });
    options($('sel-ep'), eps.length ? eps : [1], $('sel-ep').value || DATA.configured.ep);
  }
  $('val-dp').textContent = g / pp;
  draw(find(g, pp, +$('sel-ep').value), $('sel-mode').value, g);
}
function draw(l, mode, g) {
  ['grid', 'memory', 'traffic'].forEach(function (id) { $(id).innerHTML = ''; });
  var st = $('status');
  if (!l || l.error) {
    st.className = 'warn';
    st.textContent = 'Not available: ' + (l ? l.error : 'no such layout');
    $('grid').textContent = $('memory').textContent = $('traffic').textContent = 'not available for this layout';
    drawRanking(g);
    return;
  }
  var p = l.plan, m = p.modes[mode];
  st.className = m.fits ? 'note' : 'warn';
  if (m.refused) st.textContent = 'dp ' + p.layout.dp + ', pp ' + p.layout.pp + ', recompute ' + mode + ': refused: ' +
    m.refused;
  else st.textContent = 'dp ' + p.layout.dp + ', ep ' + p.layout.ep + ', ep-dp ' + p.layout.ep_dp + ', pp ' + p.layout.pp +
    ', recompute ' + mode + ': ' + gib(m.memory_bytes) + ' GiB per GPU of ' + gib(p.gpu_memory_bytes) +
    (m.fits ? ' (fits)' : ' (DOES NOT FIT)') + '; step ' + m.time_ms.step.toFixed(1) + ' ms, ' +
    Math.round(m.tokens_per_s_per_gpu) + ' tokens/s/GPU, MFU ' + (100 * m.mfu).toFixed(1) + '%; global batch ' +
    p.batch.global_batch + ' x ' + p.batch.seq_len + ' (' + p.batch.micro_steps + ' micro-steps)' +
    (p.batch.note ? '; ' + p.batch.note : '');
  drawGrid(p);
  drawMemory(p, mode);
  drawTraffic(p);
  drawRanking(g);
}
function drawGrid(p) {
  var G = p.layout.gpus, ep = p.layout.ep, E = DATA.model.num_experts, nl = DATA.model.n_layers;
  var shown = Math.min(G, 64), L = 150, R = 120, T = 22, rowH = Math.max(10, Math.min(26, 520 / shown));
  var W = 1180, cw = (W - L - R) / nl, H = T + rowH * shown + 10;
  var svg = el('svg', {width: W, height: H}, $('grid'));
  for (var c = 0; c < nl; ++c)
    el('text', {x: L + c * cw + cw / 2, y: 15, 'font-size': 10, 'text-anchor': 'middle'}, svg,
       (DATA.model.dense_layers.indexOf(c) >= 0 ? 'dense ' : 'L') + c);
  var local = E / ep, dp = p.layout.dp, stages = p.pipeline ? p.pipeline.stages : null;
  for (var r = 0; r < shown; ++r) {
    // Pipeline outermost: GPU r is in stage r / dp and holds only that stage's layers.
    var er = r % ep, first = er * local, y = T + r * rowH, s = Math.floor(r / dp), st = stages ? stages[s] : null;
    el('text', {x: L - 6, y: y + rowH * 0.7, 'font-size': 11, 'text-anchor': 'end'}, svg,
       'GPU ' + r + (st ? ' (stage ' + s + ', dp ' + (r % dp) + ')' : ' (dp ' + r + ', ep ' + er + ')'));
    for (var c2 = 0; c2 < nl; ++c2) {
      var x = L + c2 * cw;
      if (st && (c2 < st.first_layer || c2 >= st.end_layer)) {
        var off = el('rect', {x: x + 1, y: y + 1, width: cw - 2, height: rowH - 2, fill: '#f7f7f7', stroke: '#fff',
                              class: 'grid-cell'}, svg);
        el('title', {}, off, 'GPU ' + r + ', layer ' + c2 + ': on another pipeline stage');
        continue;
      }
      var dense = DATA.model.dense_layers.indexOf(c2) >= 0;
      var box = el('rect', {x: x + 1, y: y + 1, width: cw - 2, height: rowH - 2, fill: dense ? '#bbb' : '#e4ecf7',
                            stroke: '#fff', class: 'grid-cell'}, svg);
      el('title', {}, box, 'GPU ' + r + ', layer ' + c2 + (dense ? ': dense MLP' : ': experts ' + first + '-' + (first + local - 1) + ' of ' + E));
      if (!dense)
        el('rect', {x: x + 1 + (cw - 2) * first / E, y: y + 3, width: Math.max(1, (cw - 2) * local / E),
                    height: rowH - 6, fill: '#2b5797', class: 'expert-slice'}, svg);
    }
    el('text', {x: W - R + 6, y: y + rowH * 0.7, 'font-size': 11}, svg,
       'experts ' + first + (local > 1 ? '-' + (first + local - 1) : ''));
  }
  if (G > shown)
    el('text', {x: L, y: H - 1, 'font-size': 11, fill: '#555'}, svg, '(first 64 of ' + G + ' GPUs; the rest repeat the ep pattern)');
}
function drawMemory(p, mode) {
  var mb = p.memory_bytes;
  var parts = [['BF16 params', function () { return mb.params_bf16; }],
               ['FP32 master weights', function () { return mb.master_fp32; }],
               ['FP8 weight codes', function () { return mb.fp8_weight_codes || 0; }],
               ['FP32 gradients', function () { return mb.grads_fp32; }],
               ['AdamW moments (' + mb.moments_sharding + (mb.moment_bytes === 2 ? ', BF16' : '') + ')',
                function () { return mb.moments; }],
               ['activations kept', function (m) { return m.activations.kept_bytes; }],
               ['recompute pools', function (m) { return m.activations.pool_bytes; }],
               ['scratch and workspaces', function (m) { return m.activations.scratch_bytes; }],
               ['expert exchange buffers', function () { return mb.exchange; }]];
  var colors = ['#4e79a7', '#a0cbe8', '#76b7b2', '#f28e2b', '#ffbe7d', '#59a14f', '#8cd17d', '#b6992d', '#e15759'];
  var W = 1180, L = 100, R = 30, T = 10, bh = 30, gap = 14;
  var max = Math.max(p.gpu_memory_bytes, MODES.reduce(function (a, k) { return Math.max(a, p.modes[k].memory_bytes); }, 0));
  var sx = function (b) { return L + b / max * (W - L - R); };
  var H = T + 3 * (bh + gap) + 60;
  var svg = el('svg', {width: W, height: H}, $('memory'));
  MODES.forEach(function (k, i) {
    var m = p.modes[k], y = T + i * (bh + gap), x = 0, sum = 0;
    el('text', {x: L - 6, y: y + bh * 0.65, 'font-size': 12, 'text-anchor': 'end', 'font-weight': k === mode ? 'bold' : 'normal'}, svg, k);
    parts.forEach(function (pt, j) {
      var v = pt[1](m) || 0; sum += v;
      if (v <= 0) return;
      var r = el('rect', {x: sx(x), y: y, width: Math.max(0.5, sx(x + v) - sx(x)), height: bh, fill: colors[j], class: 'mem-part'}, svg);
      el('title', {}, r, k + ': ' + pt[0] + ' ' + gib(v) + ' GiB');
      x += v;
    });
    var other = m.memory_bytes - sum;
    if (other > 1e6) {
      var r2 = el('rect', {x: sx(x), y: y, width: sx(x + other) - sx(x), height: bh, fill: '#ccc', class: 'mem-part'}, svg);
      el('title', {}, r2, k + ': other ' + gib(other) + ' GiB');
    }
    if (k === mode) el('rect', {x: L, y: y - 2, width: sx(m.memory_bytes) - L, height: bh + 4, fill: 'none', stroke: '#000', 'stroke-width': 2}, svg);
    el('text', {x: sx(m.memory_bytes) + 4, y: y + bh * 0.65, 'font-size': 11}, svg, gib(m.memory_bytes) + ' GiB' + (m.refused ? ' (refused)' : m.fits ? '' : ' (does not fit)'));
  });
  var yl = T + 3 * (bh + gap);
  el('line', {x1: sx(p.gpu_memory_bytes), x2: sx(p.gpu_memory_bytes), y1: T - 4, y2: yl - gap + 4, stroke: '#d00', 'stroke-width': 2}, svg);
  el('text', {x: sx(p.gpu_memory_bytes), y: yl + 4, 'font-size': 11, fill: '#d00', 'text-anchor': 'end'}, svg, gib(p.gpu_memory_bytes) + ' GiB usable');
  parts.forEach(function (pt, j) {
    var x = L + (j % 4) * 260, y = yl + 18 + Math.floor(j / 4) * 16;
    el('rect', {x: x, y: y - 9, width: 12, height: 10, fill: colors[j]}, svg);
    el('text', {x: x + 16, y: y, 'font-size': 11}, svg, pt[0]);
  });
}
function drawTraffic(p) {
  var c = p.comm_bytes_per_step, mstep = p.batch.micro_steps;
  var rows = [['DP gradient all-reduce', c.dp_allreduce_sent], ['ZeRO-1 reduce-scatter (gradients)', c.zero_reduce_scatter_sent],
              ['ZeRO-1 all-gather (FP32 parameters)', c.zero_all_gather_sent],
              ['EP dispatch forward', c.ep_dispatch_fwd_per_micro_step * mstep], ['EP combine forward', c.ep_combine_fwd_per_micro_step * mstep],
              ['EP dispatch backward', c.ep_dispatch_bwd_per_micro_step * mstep], ['EP combine backward', c.ep_combine_bwd_per_micro_step * mstep]];
  if (p.layout.pp > 1) rows.push(['pipeline sends (residual stream)', c.pp_per_step]);
  var W = 1180, L = 260, R = 120, T = 8, bh = 18;
  var max = Math.max(1, c.total);
  var H = T + (rows.length + 1) * (bh + 6) + 4;
  var svg = el('svg', {width: W, height: H}, $('traffic'));
  rows.concat([['total per step', c.total]]).forEach(function (r, i) {
    var y = T + i * (bh + 6);
    el('text', {x: L - 6, y: y + bh * 0.75, 'font-size': 12, 'text-anchor': 'end', 'font-weight': i === rows.length ? 'bold' : 'normal'}, svg, r[0]);
    if (r[1] > 0) el('rect', {x: L, y: y, width: Math.max(1, r[1] / max * (W - L - R)), height: bh,
                              fill: i === rows.length ? '#555' : '#76b7b2', class: 'traffic-bar'}, svg);
    el('text', {x: L + (r[1] > 0 ? r[1] / max * (W - L - R) : 0) + 6, y: y + bh * 0.75, 'font-size': 11}, svg, (r[1] / 1e9).toFixed(3) + ' GB');
  });
}
function drawRanking(g) {
  var e = DATA.rankings[String(g)], host = $('ranking');
  if (!e) { host.textContent = 'not available'; return; }
  if (e.error) { host.textContent = e.error; return; }
  var h = '<table><tr><th>rank</th><th>dp</th><th>ep</th><th>ep-dp</th><th>pp</th><th class="l">recompute</th><th>GiB/GPU</th><th>step ms</th><th>tokens/s/GPU</th><th>TFLOP/s/GPU</th><th>comm GB/step</th></tr>';
  e.fitting.forEach(function (f, i) {
    h += '<tr><td>' + (i + 1) + '</td><td>' + f.dp + '</td><td>' + f.ep + '</td><td>' + f.ep_dp + '</td><td>' + f.pp + '</td><td class="l">' + f.recompute +
         '</td><td>' + gib(f.memory_bytes) + '</td><td>' + f.step_ms.toFixed(1) + '</td><td>' + Math.round(f.tokens_per_s_per_gpu) +
         '</td><td>' + f.tflops_per_gpu.toFixed(1) + '</td><td>' + (f.comm_bytes_per_step / 1e9).toFixed(2) + '</td></tr>';
  });
  if (!e.fitting.length) h += '<tr><td colspan="11" class="l">no layout of ' + g + ' GPUs fits</td></tr>';
  host.innerHTML = h + '</table>';
}
(function () {
  $('cfg-name').textContent = DATA.config;
  $('gpu-name').textContent = DATA.gpu_name + ' (' + DATA.gpu_memory_gib + ' GiB usable per GPU)';
  var gs = []; DATA.layouts.forEach(function (l) { if (gs.indexOf(l.gpus) < 0) gs.push(l.gpus); });
  options($('sel-gpus'), gs, DATA.configured.gpus);
  $('sel-mode').value = DATA.configured.recompute;
  $('sel-gpus').addEventListener('change', function () { refresh('gpus'); });
  $('sel-pp').addEventListener('change', function () { refresh('pp'); });
  $('sel-ep').addEventListener('change', function () { refresh('ep'); });
  $('sel-mode').addEventListener('change', function () { refresh('mode'); });
  var best = DATA.configured.start_at_best && DATA.rankings[String(DATA.configured.gpus)];
  if (best && best.fitting && best.fitting.length) {  // --gpus N: start at the planner's best layout of N
    options($('sel-ep'), [best.fitting[0].ep], best.fitting[0].ep);
    $('sel-mode').value = best.fitting[0].recompute;
    refresh('init');
    $('sel-ep').value = best.fitting[0].ep;
    refresh('ep');
  } else {
    refresh('init');
    $('sel-pp').value = DATA.configured.pp;
    refresh('pp');
    $('sel-ep').value = DATA.configured.ep;
    refresh('ep');
  }
})();
</script>
</body></html>
)HTML";

std::string utc_stamp() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace

std::string json_for_script(const nlohmann::json& j) {
  const std::string s = j.dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    out += s[i];
    if (s[i] == '<' && i + 1 < s.size() && s[i + 1] == '/') out += '\\';
  }
  return out;
}

nlohmann::json embedded_json(const std::string& html, const std::string& what) {
  const size_t a = html.find(kDataOpen);
  MOE_CHECK(a != std::string::npos, what, " holds no embedded data (", kDataOpen, ")");
  const size_t begin = a + std::string(kDataOpen).size();
  const size_t end = html.find(kDataClose, begin);
  MOE_CHECK(end != std::string::npos, what, ": the embedded data is not closed by ", kDataClose);
  const nlohmann::json j = nlohmann::json::parse(html.substr(begin, end - begin), nullptr, false);
  MOE_CHECK(!j.is_discarded(), what, ": the embedded data is not valid JSON");
  return j;
}

RunMetrics read_run_metrics(const std::string& dir) {
  MOE_CHECK(fs::is_directory(dir), "'", dir, "' is not a directory: expected a run directory (run.dir of moecore train)");
  const std::string path = (fs::path(dir) / "metrics.jsonl").string();
  MOE_CHECK(fs::exists(path), "the run directory '", dir, "' has no metrics.jsonl: expected the run.dir of a ",
            "`moecore train` run that has logged at least once");
  const std::string text = read_regular_file(path);
  RunMetrics run;
  run.dir = dir;
  run.name = fs::path(dir).lexically_normal().filename().string();
  if (run.name.empty() || run.name == ".") run.name = fs::path(dir).lexically_normal().parent_path().filename().string();
  if (run.name.empty()) run.name = dir;
  size_t pos = 0;
  int64_t line_no = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    const bool last = nl == std::string::npos || nl + 1 >= text.size();
    if (nl == std::string::npos) nl = text.size();
    const std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json rec = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!rec.is_object()) {
      MOE_CHECK(last, path, " line ", line_no, " is not a JSON object (only the last line of a run being ",
                "written may be incomplete): '", line.substr(0, 80), line.size() > 80 ? "...'" : "'");
      run.truncated = true;
      continue;
    }
    run.records.push_back(std::move(rec));
  }
  return run;
}

std::string report_html(std::vector<RunMetrics> runs) {
  MOE_CHECK(!runs.empty(), "the report needs at least one run directory");
  std::map<std::string, int> seen;
  for (const RunMetrics& r : runs) ++seen[r.name];
  for (RunMetrics& r : runs)
    if (seen[r.name] > 1) r.name = r.dir;  // two runs of one name: their paths tell them apart
  nlohmann::json data = {{"generated", utc_stamp()}, {"runs", nlohmann::json::array()}};
  for (const RunMetrics& r : runs)
    data["runs"].push_back({{"name", r.name}, {"dir", r.dir}, {"truncated", r.truncated}, {"records", r.records}});
  return std::string("<!DOCTYPE html>\n<html><head>\n") + kCommonHead + kDataOpen + json_for_script(data) + kDataClose +
         "\n" + kReportBody;
}

nlohmann::json plan_page_data(const Config& cfg, const std::string& config_name, int64_t max_gpus,
                              double gpu_memory_gib, bool start_at_best, const LayoutRequest* start,
                              const GpuCeilings& gpu) {
  MOE_CHECK(max_gpus >= 1, "--gpus must be >= 1, got ", max_gpus);
  nlohmann::json dense = nlohmann::json::array();
  for (int64_t l = 0; l < cfg.model.n_layers; ++l)
    if (is_dense_layer(cfg.model, l)) dense.push_back(l);
  nlohmann::json layouts = nlohmann::json::array(), rankings = nlohmann::json::object();
  for (int64_t g = 1; g <= max_gpus; ++g) {
    for (const int64_t pp : {1, 2, 4, 8}) {
      if (g % pp != 0) continue;
      const int64_t dp = g / pp;
      if (pp > 1) {  // the GPU pipeline step runs ep 1 only: one entry
        nlohmann::json entry = {{"gpus", g}, {"dp", dp}, {"pp", pp}, {"ep", nullptr}, {"error_all_ep", true}};
        try {
          entry["plan"] = layout_plan_json(plan_layout(cfg, LayoutRequest{dp, 1, pp}, gpu_memory_gib, gpu));
          entry.erase("error_all_ep");
          entry["ep"] = 1;
        } catch (const Error& e) {
          entry["error"] = e.what();
        }
        layouts.push_back(entry);
        continue;
      }
      for (int64_t ep = 1; ep <= dp; ++ep) {
        if (dp % ep != 0) continue;
        nlohmann::json entry = {{"gpus", g}, {"dp", dp}, {"ep", ep}, {"pp", pp}};
        try {
          entry["plan"] = layout_plan_json(plan_layout(cfg, LayoutRequest{dp, ep, pp}, gpu_memory_gib, gpu));
        } catch (const Error& e) {
          entry["error"] = e.what();
        }
        layouts.push_back(entry);
      }
    }
    try {
      rankings[std::to_string(g)] =
          enumeration_json(enumerate_layouts(cfg, g, gpu_memory_gib, gpu), g, gpu_memory_gib);
    } catch (const Error& e) {
      rankings[std::to_string(g)] = {{"error", e.what()}};
    }
  }
  const int64_t conf_dp = cfg.parallel.dp > 0 ? cfg.parallel.dp : std::max<int64_t>(1, cfg.parallel.ep);
  return {{"config", config_name},
          {"generated", utc_stamp()},
          {"gpu_name", gpu.name},
          {"gpu_memory_gib", gpu_memory_gib},
          {"max_gpus", max_gpus},
          {"configured",
           {{"gpus", start ? start->dp * start->pp : start_at_best ? max_gpus : std::min(max_gpus, conf_dp * cfg.parallel.pp)},
            {"start_at_best", start_at_best && !start},
            {"ep", start ? start->ep : cfg.parallel.ep},
            {"pp", start ? start->pp : 1},
            {"recompute", cfg.train.recompute}}},
          {"model",
           {{"n_layers", cfg.model.n_layers},
            {"dense_layers", dense},
            {"num_experts", cfg.moe.num_experts},
            {"top_k", cfg.moe.top_k}}},
          {"layouts", layouts},
          {"rankings", rankings}};
}

std::string plan_html(const nlohmann::json& data) {
  return std::string("<!DOCTYPE html>\n<html><head>\n") + kCommonHead + kDataOpen + json_for_script(data) + kDataClose +
         "\n" + kPlanBody;
}

}  // namespace moe
