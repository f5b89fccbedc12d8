// moecore command-line entry point: train (and --dry-run), plan (and --html), report, bench, inspect,
// export-hf, import-hf, eval, generate, logits, tokenize, data prepare, version. Every command's
// arguments go through one parser (cli/args.h).
// Every error reaches the user as one "error: ..." line and exit status 1 (a mistake in the
// command line also prints the command's usage line); in a multi-process job as "[rank r]
// error: ..." followed by an abort of every rank (MPI_Abort; over TCP the rank exits and its
// peers fail on the closed connections). No command, or an unknown one, exits with status 2.
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/files.h"
#include "checkpoint/hf.h"
#include "checkpoint/sha256.h"
#include "cli/args.h"
#include "core/config_io.h"
#include "core/error.h"
#include "core/signals.h"
#include "data/embedded.h"
#include "data/prepare.h"
#include "data/sources.h"
#include "data/tokenizer.h"
#include "model/layout.h"
#include "model/generate.h"
#include "model/model.h"
#include "parallel/comm.h"
#include "train/bench.h"
#include "train/ceilings.h"
#include "train/device.h"
#include "train/evaluate.h"
#include "train/model_state.h"
#include "train/planner.h"
#include "train/report.h"
#include "train/run_plan.h"
#include "train/trainer.h"

#ifndef MOECORE_VERSION
#define MOECORE_VERSION "unknown"
#endif
#ifndef MOECORE_GIT_COMMIT
#define MOECORE_GIT_COMMIT "unknown"
#endif

namespace moe {
namespace {

using cli::CommandSpec;
using cli::ParsedArgs;
using cli::UsageError;

constexpr const char* kUsage =
    "usage: moecore <command> [options]\n"
    "\n"
    "commands:\n"
    "  train [CONFIG.toml] [--section.key=value ...]   train a model (no CONFIG: the embedded default)\n"
    "  train --dry-run [--world N] ...                 print the resolved config and the run plan: layout,\n"
    "                                                  batch arithmetic, FLOPs, memory per rank (N ranks)\n"
    "  plan [CONFIG.toml] [--gpus N] [--layout dp=N,ep=N,pp=N] [--gpu-memory GiB] [--json]\n"
    "                                                  per-GPU memory by part and recompute mode, communication\n"
    "                                                  and step time of a layout; with --gpus N alone every\n"
    "                                                  layout that fits, best first (docs/planning.md)\n"
    "  plan [CONFIG.toml] --html [-o plan.html] [--gpus N] [--layout ...]\n"
    "                                                  an interactive page of every layout of 1..N GPUs\n"
    "  report RUN_DIR [RUN_DIR ...] [-o report.html]   one HTML page of the runs' metrics.jsonl: loss, eval\n"
    "                                                  loss, throughput, MFU, grad norm, lr, lb/z, expert load\n"
    "  bench [CONFIG.toml] [--warmup N] [--steps N] [--inputs random|zeros|corpus] [--out DIR | --json PATH]\n"
    "        [--section.key=value ...]                 time warm training steps: tokens/s, TFLOP/s, phases, memory\n"
    "  sweep CONFIG.toml... [bench options]            the bench on each config that fits, relative to the first\n"
    "  inspect CHECKPOINT_DIR                          print a checkpoint's step, config and tensors\n"
    "  export-hf CHECKPOINT_DIR OUT_DIR [--dtype bf16|fp32] [--tokenizer tokenizer.json]\n"
    "                                                  write a Hugging Face OLMoE model (config.json, safetensors,\n"
    "                                                  tokenizer files)\n"
    "  import-hf HF_DIR OUT_CHECKPOINT_DIR             turn an HF OLMoE model into a moecore checkpoint\n"
    "  eval CHECKPOINT_DIR [--config C] [--json] [--section.key=value ...]\n"
    "                                                  loss, perplexity and tokens on held-out data\n"
    "  generate CHECKPOINT_DIR --prompt TEXT [--tokenizer tokenizer.json] [--max-new-tokens N]\n"
    "           [--temperature T] [--top-p P] [--seed S] [--json]\n"
    "                                                  continue a prompt (CPU, KV cache): greedy or sampled\n"
    "  logits CHECKPOINT_DIR --tokens ID,ID,... [--out FILE]\n"
    "                                                  run one sequence, print its loss, write FP32 logits\n"
    "  tokenize --out FILE [--dtype uint16|uint32] [--eos ID] TEXT_FILE...\n"
    "                                                  byte-level tokenizer: one document per file\n"
    "  data prepare --tokenizer tokenizer.json --out DIR [--text-key KEY] [--jobs N] [--lines] [--eos-id ID] INPUT...\n"
    "                                                  tokenize .jsonl / .jsonl.gz / .txt into .npy token files\n"
    "  version                                         print the version and the commit it was built from\n"
    "\n"
    "Options take --name=value or --name value; CONFIG.toml may also be given as --config PATH.\n"
    "`moecore <command> --help` for details.\n";

std::string version_text() {
  return std::string("moecore ") + MOECORE_VERSION + " (commit " + MOECORE_GIT_COMMIT + ")";
}

template <typename... Parts>
[[noreturn]] void usage_fail(const Parts&... parts) {
  throw UsageError(detail::concat(parts...));
}

// CONFIG.toml as a positional or as --config PATH (not both); "" for the embedded default.
std::string config_path(const ParsedArgs& a) {
  const std::optional<std::string> flag = a.value("--config");
  if (flag && !a.positionals.empty())
    usage_fail("the config is given twice: '", a.positionals[0], "' and --config ", *flag, "; give one");
  if (flag) {
    if (flag->empty()) usage_fail("--config needs a path, got an empty value");
    return *flag;
  }
  return a.positionals.empty() ? "" : a.positionals[0];
}

// The resolved config and the run plan of `world` ranks (rank 0's figures are every rank's:
// ranks differ only in which experts and shards they hold, not in how many).
void print_dry_run(const Config& cfg, int64_t world) {
  std::cout << config_to_toml(cfg) << "\n";
  const std::string device = resolve_device(cfg.train);
  std::cout << describe_run_plan(make_run_plan(cfg, world, device));
  if (device == "cpu" && cfg.parallel.pp > 1) {
    std::cout << "# on cuda: parallel.pp > 1 is refused (pipeline stages run on the CPU backend only)\n";
  } else if (device == "cpu") {  // what the same run needs on the CUDA backend
    Config gpu = cfg;
    gpu.train.device = "cuda";
    gpu.train.precision = "bf16";
    std::cout << "# on cuda (bf16):\n" << describe_run_plan(make_run_plan(gpu, world, "cuda"));
  }
}

// ---------------------------------------------------------------- commands

const CommandSpec kTrain{
    "train",
    {"CONFIG.toml"},
    0,
    true,
    {{"--config", "PATH", "the run's config file (instead of the positional CONFIG.toml)"},
     {"--dry-run", "", "print the resolved config and the run plan, then exit"},
     {"--world", "N", "with --dry-run: the plan for N ranks, without launching them"}},
    "Without CONFIG the embedded default (configs/tiny.toml) trains on the built-in corpus.\n"
    "Overrides apply after the file, in order: --train.steps=50 or --train.steps 50.\n"};

int cmd_train(const ParsedArgs& a) {
  const std::string path = config_path(a);
  const bool dry = a.has("--dry-run");
  if (a.has("--world") && !dry)
    usage_fail("--world N goes with --dry-run (a real run takes its world size from the launcher)");
  const int64_t dry_world = a.int_or("--world", 0, 1, kMaxRanks);
  // Join the job first (MPI or TCP when a launcher started us), so that every later error is reported
  // with its rank and ends all ranks. A dry run joins only to learn the world size.
  Comm* world = dry && dry_world > 0 ? nullptr : &world_comm();
  const Config cfg = load_config(path, a.overrides);
  if (dry) {
    if (world == nullptr || world->rank() == 0) print_dry_run(cfg, world ? world->size() : dry_world);
    return 0;
  }
  const TrainSummary s = train(cfg, std::cout, *world);
  if (s.stopped_by != 0) return 128 + s.stopped_by;  // train() said where it stopped and how to continue
  if (world->rank() != 0 || s.steps_done == s.start_step) return 0;  // nothing trained: train() said why
  std::printf("done: steps %lld-%lld, loss %.4f -> %.4f", (long long)s.start_step + 1, (long long)s.steps_done,
              s.first_loss, s.last_loss);
  if (s.initial_eval_loss >= 0 && s.final_eval_loss >= 0)
    std::printf(", eval loss %.4f -> %.4f", s.initial_eval_loss, s.final_eval_loss);
  else if (s.final_eval_loss >= 0)
    std::printf(", eval loss %.4f", s.final_eval_loss);
  if (s.last_checkpoint.empty())
    std::printf(", %.1f s; no checkpoint written\n", s.wall_s);
  else
    std::printf(", %.1f s; checkpoint %s\n", s.wall_s, s.last_checkpoint.c_str());
  return 0;
}

const CommandSpec kPlan{
    "plan",
    {"CONFIG.toml"},
    0,
    true,
    {{"--config", "PATH", "the config file (instead of the positional CONFIG.toml)"},
     {"--gpus", "N", "plan N GPUs; without --layout: every layout (pp dividing N, dp = N / pp, ep dividing dp at "
                      "pp = 1) x recompute mode, best first"},
     {"--layout", "dp=N,ep=N,pp=N", "plan this layout (pp > 1: as the GPU pipeline step runs it, ep 1)"},
     {"--gpu", "h200|h100", "the GPU whose measured rates and reference step the plan uses (default: the visible GPU "
                            "where it is one of them, else h200)"},
     {"--gpu-memory", "GiB", "usable memory per GPU (default the --gpu's: 139.8 for an H200, 79.6 for an H100)"},
     {"--json", "", "print the plan as JSON"},
     {"--html", "", "write an interactive page of every layout of 1..N GPUs (--gpus N, default 8), opened at --layout or N's best"},
     {"--out", "FILE", "with --html: the page to write (default plan.html)", false, "-o"}},
    "Plans the run on the cuda backend (BF16, or FP8 with train.precision = fp8) without a GPU: per-GPU\n"
    "memory by part (BF16 weights, FP32 master, FP8 weight codes, gradients, AdamW moments replicated or\n"
    "ZeRO-1-sharded, activations for each recompute mode side by side, exchange buffers, scratch), bytes\n"
    "per step of each collective, and a step time estimated from op rates measured on an H200 or,\n"
    "with --gpu h100, an H100 80GB (src/train/ceilings.h; FP8 GEMMs at their measured rates). The layout\n"
    "comes from --layout, else from the config's parallel keys (parallel.dp = 0: dp = parallel.ep, one GPU by\n"
    "default). When dp x micro_batch does\n"
    "not divide train.global_batch, the plan raises the global batch to the least multiple that it\n"
    "does and says so. Formulas, sources and accuracy: docs/planning.md.\n"
    "With --html: one self-contained page (no network needed) with the planner's figures for every\n"
    "GPU count 1..N, pp 1, 2, 4, 8 (refused by the planner: shown so) and ep dividing dp, each\n"
    "recompute mode: the GPU / layer / expert grid, memory per GPU by part, traffic per collective\n"
    "(docs/report.md).\n"};

// A positive, finite number of GiB.
double parse_gib(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !(v > 0) || !std::isfinite(v))
    usage_fail(flag, ": expected a positive number of GiB, got '", text, "'");
  return v;
}

int cmd_plan(const ParsedArgs& a) {
  const std::string path = config_path(a);
  const int64_t gpus = a.int_or("--gpus", 0, 1, kMaxRanks);
  // --gpu, else the visible GPU where its figures are measured, else an H200.
  const GpuCeilings* visible = a.has("--gpu") ? nullptr : measured_rates(visible_gpu_name());
  const GpuCeilings& gpu = visible != nullptr ? *visible : planner_gpu(a.value_or("--gpu", "h200"));
  const double mem = a.has("--gpu-memory") ? parse_gib("--gpu-memory", *a.value("--gpu-memory")) : gpu.memory_gib;
  const bool json = a.has("--json");
  if (a.has("--out") && !a.has("--html")) usage_fail("--out FILE goes with --html (the page to write)");
  if (a.has("--html")) {
    if (json) usage_fail("--html and --json are two outputs; give one");
  }
  const Config cfg = load_config(path, a.overrides);
  if (a.has("--html")) {
    const std::string out = a.value_or("--out", "plan.html");
    if (out.empty()) usage_fail("--out needs a file name, got an empty value");
    const std::string name = path.empty() ? "the embedded default config" : path;
    std::optional<LayoutRequest> start;
    if (a.has("--layout")) start = parse_layout(*a.value("--layout"), gpus);
    const int64_t max_gpus = gpus > 0 ? gpus : start ? std::max<int64_t>(8, start->dp * start->pp) : 8;
    if (max_gpus > 1024) usage_fail("--gpus: the --html page plans every count 1..N; expected N <= 1024, got ", max_gpus);
    if (start && start->dp * start->pp > max_gpus)
      usage_fail("--layout ", *a.value("--layout"), " needs ", start->dp * start->pp, " GPUs, more than --gpus ", max_gpus);
    write_file_atomic(out, plan_html(plan_page_data(cfg, name, max_gpus, mem, /*start_at_best=*/gpus > 0,
                                                    start ? &*start : nullptr, gpu)));
    std::cout << "wrote " << out << " (layouts of 1.." << max_gpus << " GPUs)\n";
    return 0;
  }
  if (gpus > 0 && !a.has("--layout")) {
    const Enumeration e = enumerate_layouts(cfg, gpus, mem, gpu);
    std::cout << (json ? enumeration_json(e, gpus, mem).dump(1) + "\n" : describe_enumeration(e, gpus, mem, gpu));
    return 0;
  }
  LayoutRequest layout;
  if (a.has("--layout")) {
    layout = parse_layout(*a.value("--layout"), gpus);
  } else {
    // parallel.dp = 0 takes the world from the launcher: plan the smallest one parallel.ep allows.
    layout.dp = cfg.parallel.dp > 0 ? cfg.parallel.dp : std::max<int64_t>(1, cfg.parallel.ep);
    layout.ep = cfg.parallel.ep;
    layout.pp = cfg.parallel.pp;
  }
  const LayoutPlan p = plan_layout(cfg, layout, mem, gpu);
  std::cout << (json ? layout_plan_json(p).dump(1) + "\n" : describe_layout_plan(p, gpu));
  return 0;
}

const CommandSpec kReport{
    "report",
    {"RUN_DIR..."},
    1,
    false,
    {{"--out", "FILE", "the page to write (default report.html)", false, "-o"}},
    "Writes one self-contained HTML page (inline script and styles, nothing fetched) of the metrics.jsonl\n"
    "of each RUN_DIR: loss and eval loss, tokens/s, MFU (GPU runs), grad norm, learning rate, lb and z\n"
    "loss, load imbalance, and a heatmap of each MoE layer's expert load over the run; several runs\n"
    "overlaid (legend: the directory names); x axis step, tokens seen or wall time. The records are\n"
    "embedded as JSON. A run still being written is fine: an incomplete last line is left out and said\n"
    "so. See docs/report.md.\n"};

int cmd_report(const ParsedArgs& a) {
  const std::string out = a.value_or("--out", "report.html");
  if (out.empty()) usage_fail("--out needs a file name, got an empty value");
  std::vector<RunMetrics> runs;
  for (const std::string& dir : a.positionals) runs.push_back(read_run_metrics(dir));
  write_file_atomic(out, report_html(runs));
  for (const RunMetrics& r : runs)
    if (r.truncated)
      std::cout << "note: the last line of " << r.dir << "/metrics.jsonl is incomplete (a run still writing?): left out\n";
  std::cout << "wrote " << out << " (" << runs.size() << " run" << (runs.size() == 1 ? "" : "s") << ")\n";
  return 0;
}

constexpr int64_t kMaxBenchSteps = 1000000;

const CommandSpec kBench{
    "bench",
    {"CONFIG.toml"},
    0,
    true,
    {{"--config", "PATH", "the config file (instead of the positional CONFIG.toml)"},
     {"--warmup", "N", "untimed steps first (default 2)"},
     {"--steps", "N", "timed steps (default 5)"},
     {"--inputs", "KIND", "random (default: random token ids, normal weights), zeros (ids and weight "
                          "matrices 0) or corpus (the data config's tokens, the embedded corpus by default)"},
     {"--out", "DIR", "write the JSON record under DIR (default bench/results; --out= for none)"},
     {"--json", "PATH", "write the JSON record to PATH instead"}},
    "Runs warm training steps on random tokens and prints tokens/s, TFLOP/s (FLOPs per token from\n"
    "docs/architecture.md), MFU, step time by phase and peak memory; writes the same as JSON under\n"
    "DIR (default bench/results; --out= for none) or to PATH. train.device and train.precision pick\n"
    "the backend as for train: cuda runs one GPU (CUDA graph, device-side initialisation), cpu the\n"
    "reference. `mpirun -np N moecore bench ...` (cuda) runs data parallel over N GPUs (NCCL), each\n"
    "GPU with the one-GPU step's micro-batches (global batch x N), and reports figures per GPU and the\n"
    "gradient all-reduce. See docs/benchmarks.md for what each figure means.\n"};

// The options bench and sweep share.
BenchOptions bench_options(const ParsedArgs& a, const std::string& command) {
  BenchOptions opt;
  opt.command = command;
  opt.warmup = a.int_or("--warmup", opt.warmup, 0, kMaxBenchSteps);
  opt.steps = a.int_or("--steps", opt.steps, 1, kMaxBenchSteps);
  opt.out_dir = a.value_or("--out", opt.out_dir);
  opt.json_path = a.value_or("--json", opt.json_path);
  opt.inputs = a.value_or("--inputs", opt.inputs);
  return opt;
}

int cmd_bench(const ParsedArgs& a, const std::string& command) {
  BenchOptions opt = bench_options(a, command);
  const std::string path = config_path(a);
  if (!path.empty()) opt.config_name = std::filesystem::path(path).stem().string();
  // Join the job first (MPI or TCP when a launcher started us), so that every later error is reported
  // with its rank and ends all ranks.
  Comm& world = world_comm();
  const Config cfg = load_config(path, a.overrides);
  run_bench(cfg, opt, std::cout, world);
  return 0;
}

const CommandSpec kSweep{
    "sweep",
    {"CONFIG.toml..."},
    1,
    true,
    {{"--warmup", "N", "untimed steps first, per config (default 2)"},
     {"--steps", "N", "timed steps per config (default 5)"},
     {"--inputs", "KIND", "random (default), zeros or corpus, as for bench"},
     {"--out", "DIR", "write the sweep's JSON under DIR (default bench/results; --out= for none)"},
     {"--json", "PATH", "write the sweep's JSON to PATH instead"}},
    "Runs `moecore bench` on each CONFIG in turn in one process (the same options and --section.key=value\n"
    "overrides for all), after checking that its run plan fits the GPU's free memory; a config that does\n"
    "not fit is listed with the planner's reason instead. Prints tokens/s and TFLOP/s per GPU of each\n"
    "relative to the first that ran, and writes one JSON whose `sweep` list holds each bench record.\n"
    "Example: moecore sweep configs/scaling1-e{8,16,32,64,128}.toml --steps 10 (docs/experiments.md).\n"};

int cmd_sweep(const ParsedArgs& a, const std::string& command) {
  const BenchOptions opt = bench_options(a, command);
  Comm& world = world_comm();
  std::vector<std::pair<std::string, Config>> configs;
  for (const std::string& path : a.positionals)
    configs.emplace_back(std::filesystem::path(path).stem().string(), load_config(path, a.overrides));
  run_sweep(configs, opt, std::cout, world);
  return 0;
}

// A checkpoint argument: a step_<N> directory or a checkpoint directory (its latest step).
std::string step_dir_of(const std::string& arg) {
  const auto dir = resolve_checkpoint(arg);
  MOE_CHECK(dir.has_value(), "no complete checkpoint at '", arg,
            "': expected a step_<N> directory or a checkpoint directory holding one");
  return *dir;
}

const CommandSpec kInspect{"inspect",
                           {"CHECKPOINT_DIR"},
                           1,
                           false,
                           {},
                           "CHECKPOINT_DIR is a step_<N> directory or a checkpoint directory (its latest step "
                           "is shown).\n"};

int cmd_inspect(const ParsedArgs& a) {
  const std::string dir = step_dir_of(a.positionals[0]);
  const LoadedCheckpoint ck = LoadedCheckpoint::open(dir);
  const TrainState state = read_train_state(ck);
  std::cout << "checkpoint " << dir << "\nstep " << ck.step() << "\n";
  const nlohmann::json& st = ck.train_state();
  for (auto it = st.begin(); it != st.end(); ++it)
    if (it.key() != "config") std::cout << it.key() << " " << it.value().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  if (state.config) std::cout << "\n[config]\n" << *state.config << "\n";
  auto list = [](const char* file, const SafetensorsFile& f) {
    int64_t bytes = 0;
    for (const auto& t : f.tensors()) bytes += int64_t(t.end - t.begin);
    std::printf("%s: %zu tensors, %.2f MiB\n", file, f.tensors().size(), double(bytes) / (1 << 20));
    for (const auto& t : f.tensors())
      std::printf("  %-60s %-5s %s\n", t.name.c_str(), t.dtype_name.c_str(), shape_str(t.shape).c_str());
  };
  if (!ck.sliced()) {
    list("model.safetensors", ck.model());
    if (ck.has_optim()) list("optim.safetensors", ck.optim());
    return 0;
  }
  // Sliced over several ranks: the global tensors reassembled from their slices.
  std::cout << "sliced over " << ck.world_size() << " ranks:";
  for (const std::string& f : ck.data_files()) std::cout << " " << f;
  std::cout << "\n";
  auto list_global = [](const char* what, const std::vector<GlobalTensorInfo>& ts) {
    int64_t bytes = 0;
    for (const auto& t : ts) bytes += t.bytes;
    std::printf("%s: %zu tensors, %.2f MiB\n", what, ts.size(), double(bytes) / (1 << 20));
    for (const auto& t : ts)
      std::printf("  %-60s %-5s %-16s %d slice%s\n", t.name.c_str(), t.dtype_name.c_str(), shape_str(t.shape).c_str(),
                  t.num_slices, t.num_slices == 1 ? "" : "s");
  };
  list_global("model", ck.model_tensors());
  if (ck.has_optim()) list_global("optim", ck.optim_tensors());
  return 0;
}

const CommandSpec kTokenize{
    "tokenize",
    {"TEXT_FILE..."},
    1,
    false,
    {{"--out", "FILE", "the token file to write", true},
     {"--dtype", "uint16|uint32", "token integer type (default uint16)"},
     {"--eos", "ID", "end-of-document id written after each file (default 0)"}},
    "Writes a headerless token file (ids = bytes, EOS after each file) for data.source = \"tokens\".\n"};

int cmd_tokenize(const ParsedArgs& a) {
  const std::string out = a.value_or("--out", "");
  if (out.empty()) usage_fail("--out needs a file name, got an empty value");
  const std::string dtype = a.value_or("--dtype", "uint16");
  if (dtype != "uint16" && dtype != "uint32") usage_fail("--dtype: expected uint16 or uint32, got '", dtype, "'");
  const int64_t eos = a.int_or("--eos", 0, 0, dtype == "uint16" ? 0xFFFF : 0x7FFFFFFF);
  const StopSignals signals;  // a signal ends the write cleanly, without a partial file
  tokenize_text_files(a.positionals, out, dtype, eos);
  std::cout << "wrote " << out << "\n";
  return 0;
}

const CommandSpec kDataPrepare{
    "data prepare",
    {"INPUT..."},
    1,
    false,
    {{"--tokenizer", "FILE", "a Hugging Face tokenizer.json (byte-level BPE)", true},
     {"--out", "DIR", "where the .npy token files and summary.json go (created if missing)", true},
     {"--text-key", "KEY", "the JSON key of a .jsonl document (default text)"},
     {"--jobs", "N", "tokenizer threads (default: every core)"},
     {"--lines", "", "a .txt input holds one document per non-empty line (default: the whole file)"},
     {"--eos-id", "ID", "end-of-document id (default: the tokenizer's <|endoftext|>, </s>, ... token)"}},
    "Tokenizes INPUT files (.jsonl and .jsonl.gz: one JSON object a line, the document under KEY;\n"
    ".txt: one document) with the tokenizer into DIR/<stem>.npy, one per input: uint16 ids when the\n"
    "vocabulary has at most 65536 tokens, else uint32, EOS after every document. DIR/summary.json has\n"
    "the counts per input, the tokenizer's path and SHA-256, and the dtype. The output is the same\n"
    "for every --jobs. Files appear only when every input is done; Ctrl-C stops and leaves nothing\n"
    "(exit 130). Train on them with data.source = \"tokens\" and data.paths = [\"DIR/<stem>.npy\", ...].\n"};

int cmd_data_prepare(const ParsedArgs& a) {
  PrepareOptions opt;
  opt.tokenizer = a.value_or("--tokenizer", "");
  opt.out_dir = a.value_or("--out", "");
  if (opt.tokenizer.empty()) usage_fail("--tokenizer needs a tokenizer.json path, got an empty value");
  if (opt.out_dir.empty()) usage_fail("--out needs a directory, got an empty value");
  opt.text_key = a.value_or("--text-key", opt.text_key);
  if (opt.text_key.empty()) usage_fail("--text-key needs a key name, got an empty value");
  opt.jobs = a.int_or("--jobs", 0, 1, 1024);
  opt.lines = a.has("--lines");
  if (a.has("--eos-id")) opt.eos_id = a.int_or("--eos-id", 0, 0, 0x7FFFFFFF);
  if (MOECORE_HAS_TOKENIZER) opt.tokenizer_sha256 = sha256_file(opt.tokenizer);
  opt.progress = isatty(STDERR_FILENO) != 0;
  const StopSignals signals;  // Ctrl-C: stop, remove the temporaries, exit 130
  const PrepareResult r = prepare_data(a.positionals, opt, std::cerr);
  if (r.stopped_by != 0) {
    std::cerr << "data prepare: stopped by " << StopSignals::name(r.stopped_by) << "; nothing was written to '"
              << opt.out_dir << "'\n";
    return 128 + r.stopped_by;
  }
  char rate[64];
  std::snprintf(rate, sizeof rate, "%.1f s, %.1f MB/s", r.seconds, r.seconds > 0 ? double(r.bytes) / 1e6 / r.seconds : 0.0);
  std::cout << "wrote " << r.files.size() << " token file" << (r.files.size() == 1 ? "" : "s") << " and summary.json to "
            << opt.out_dir << ": " << r.documents << " documents, " << r.tokens << " tokens (" << r.dtype << ", EOS "
            << r.eos_id << (r.eos_token.empty() ? "" : " " + r.eos_token) << "), " << r.bytes << " bytes of text in "
            << rate << " with " << r.jobs << " thread" << (r.jobs == 1 ? "" : "s") << "\n";
  return 0;
}

const CommandSpec kExportHf{
    "export-hf",
    {"CHECKPOINT_DIR", "OUT_DIR"},
    2,
    false,
    {{"--dtype", "bf16|fp32", "weight type of the safetensors shards (default bf16)"},
     {"--max-shard-bytes", "N", "largest shard in bytes (default 5000000000)"},
     {"--tokenizer", "FILE", "a tokenizer.json to export with the model (default: the run's; see below)"}},
    "Writes config.json (OlmoeForCausalLM), model-*.safetensors shards with per-expert names and\n"
    "model.safetensors.index.json, each under a temporary name and then renamed, and the tokenizer:\n"
    "tokenizer.json (--tokenizer FILE, else data.tokenizer or the tokenizer data prepare's summary.json\n"
    "beside the run's token files names, else for the embedded corpus its byte-level vocabulary),\n"
    "tokenizer_config.json and special_tokens_map.json (copied from beside FILE, else written with\n"
    "eos_token = the token of data.eos_id). Models OLMoE cannot\n"
    "express (dense MLP layers, shared experts, a sigmoid router, no QK-norm, an expert bias) are\n"
    "refused, naming the keys to train with instead (docs/hf.md).\n"};

int cmd_export_hf(const ParsedArgs& a) {
  HfExportOptions opt;
  opt.dtype = a.value_or("--dtype", opt.dtype);
  if (opt.dtype != "bf16" && opt.dtype != "fp32") usage_fail("--dtype: expected bf16 or fp32, got '", opt.dtype, "'");
  opt.max_shard_bytes = a.int_or("--max-shard-bytes", opt.max_shard_bytes, 1);
  opt.tokenizer = a.value_or("--tokenizer", "");
  if (a.has("--tokenizer") && opt.tokenizer.empty()) usage_fail("--tokenizer needs a tokenizer.json path, got an empty value");
  if (!a.has("--tokenizer")) opt.tokenizer = recorded_tokenizer(checkpoint_config(LoadedCheckpoint::open(step_dir_of(a.positionals[0]))));
  const StopSignals signals;  // a signal stops between shards; nothing is left under a final name half-written
  std::string note;
  const int shards = export_hf(a.positionals[0], a.positionals[1], opt, &note);
  std::cout << "wrote " << a.positionals[1] << " (" << shards << " shard" << (shards == 1 ? "" : "s") << ", "
            << opt.dtype << "); " << note << "\n";
  return 0;
}

const CommandSpec kImportHf{
    "import-hf",
    {"HF_DIR", "OUT_CHECKPOINT_DIR"},
    2,
    false,
    {},
    "Reads an OLMoE config.json and safetensors (single file or sharded; per-expert or fused experts;\n"
    "F32/BF16/F16) and writes OUT_CHECKPOINT_DIR/step_0 plus OUT_CHECKPOINT_DIR/config.toml.\n"
    "Continue training with: moecore train OUT_CHECKPOINT_DIR/config.toml --checkpoint.resume=OUT_CHECKPOINT_DIR\n"};

int cmd_import_hf(const ParsedArgs& a) {
  const StopSignals signals;  // the import's checkpoint is published atomically (or not at all)
  const std::string step_dir = import_hf(a.positionals[0], a.positionals[1]);
  std::cout << "wrote " << step_dir << " and " << a.positionals[1] << "/config.toml\n";
  return 0;
}

const CommandSpec kEval{
    "eval",
    {"CHECKPOINT_DIR"},
    1,
    true,
    {{"--config", "PATH", "a config file to use instead of the checkpoint's own (its model must match)"},
     {"--json", "", "print one JSON object instead of the text line"}},
    "Loads the checkpoint (any layout's, on this one rank) and runs the held-out evaluation the\n"
    "trainer runs: train.eval_batches batches of train.micro_batch sequences from data.eval_paths,\n"
    "or the embedded corpus's eval split for a run on it. The config is the checkpoint's run config\n"
    "(or --config), then the overrides: --data.eval_paths=a.npy,b.npy, --train.eval_batches=N,\n"
    "--train.device=cpu|cuda. Prints loss (mean next-token cross-entropy), perplexity and tokens\n"
    "counted; on the CPU the loss is bitwise the trainer's eval loss at the checkpoint's step.\n"};

int cmd_eval(const ParsedArgs& a) {
  const bool json = a.has("--json");
  const std::string dir = step_dir_of(a.positionals[0]);
  Config cfg;
  if (const std::optional<std::string> path = a.value("--config")) {
    if (path->empty()) usage_fail("--config needs a path, got an empty value");
    cfg = load_config(*path, a.overrides);
  } else {
    cfg = checkpoint_config(LoadedCheckpoint::open(dir));
    for (const std::string& o : a.overrides) apply_override(cfg, o);
    validate_config(cfg);
  }
  std::ostringstream lines;
  const EvalResult r = evaluate_checkpoint(dir, cfg, lines);
  const int64_t step = LoadedCheckpoint::open(dir).step();
  if (json) {
    nlohmann::json j = {{"checkpoint", dir}, {"step", step},          {"loss", r.loss()},
                        {"perplexity", r.perplexity()}, {"tokens", r.tokens}, {"batches", r.batches},
                        {"device", resolve_device(cfg.train)}};
    std::cout << j.dump() << "\n";
    return 0;
  }
  std::cout << lines.str();
  std::printf("eval %s step %lld: loss %.6f perplexity %.4f tokens %lld (%lld batches on %s)\n", dir.c_str(),
              (long long)step, r.loss(), r.perplexity(), (long long)r.tokens, (long long)r.batches,
              resolve_device(cfg.train).c_str());
  return 0;
}

const CommandSpec kLogits{
    "logits",
    {"CHECKPOINT_DIR"},
    1,
    false,
    {{"--tokens", "ID,ID,...", "the sequence: token ids in [0, model.vocab_size)", true},
     {"--out", "FILE", "write the logits [S, V] as little-endian float32"}},
    "Runs the checkpoint's model (FP32, CPU) on one sequence; prints the mean next-token loss and\n"
    "writes the logits [S, V] as little-endian float32 to FILE.\n"};

// "1,2,3" -> ids; every item an integer (range-checked against the model later).
std::vector<int64_t> parse_token_list(const std::string& text) {
  std::vector<int64_t> ids;
  size_t start = 0, item = 1;
  while (true) {
    const size_t comma = text.find(',', start);
    std::string tok = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    while (!tok.empty() && tok.front() == ' ') tok.erase(tok.begin());
    while (!tok.empty() && tok.back() == ' ') tok.pop_back();
    if (tok.empty()) usage_fail("--tokens: item ", item, " of '", text, "' is empty; expected ID,ID,...");
    ids.push_back(cli::parse_int("--tokens item " + std::to_string(item), tok));
    if (comma == std::string::npos) break;
    start = comma + 1;
    ++item;
  }
  return ids;
}

int cmd_logits(const ParsedArgs& a) {
  const std::vector<int64_t> tokens = parse_token_list(*a.value("--tokens"));
  const std::string out = a.value_or("--out", "");
  const std::string dir = step_dir_of(a.positionals[0]);
  const LoadedCheckpoint ck = LoadedCheckpoint::open(dir);
  const Config cfg = checkpoint_config(ck);
  validate_config(cfg);
  std::vector<int32_t> ids;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= cfg.model.vocab_size)
      usage_fail("--tokens: item ", i + 1, " is ", tokens[i], ", not a token id of this model: expected [0, ",
                 cfg.model.vocab_size, ") (model.vocab_size = ", cfg.model.vocab_size, ")");
    ids.push_back(static_cast<int32_t>(tokens[i]));
  }
  Model<float> model(cfg.model, cfg.moe);
  model.set_matmul_precision(cfg.train.precision, cfg.train.fp8_scaling);
  load_model_state(ck, model);
  std::vector<int32_t> targets(ids.size(), -1);
  for (size_t i = 0; i + 1 < ids.size(); ++i) targets[i] = ids[i + 1];
  const ForwardStats s = model.forward(ids.data(), targets.data(), 1, static_cast<int64_t>(ids.size()));
  std::printf("tokens %zu loss %.8f\n", ids.size(), s.num_targets ? s.ce_sum / double(s.num_targets) : 0.0);
  if (!out.empty()) {
    const auto& lg = model.logits();
    write_file_atomic(out, std::string_view(reinterpret_cast<const char*>(lg.data()), lg.size() * sizeof(float)));
  }
  return 0;
}

const CommandSpec kGenerate{
    "generate",
    {"CHECKPOINT_DIR"},
    1,
    false,
    {{"--prompt", "TEXT", "the text to continue", true},
     {"--tokenizer", "FILE", "a tokenizer.json (default: data.tokenizer or the run's data prepare summary; else bytes)"},
     {"--max-new-tokens", "N", "tokens to generate at most (default 64); an EOS ends sooner"},
     {"--temperature", "T", "0 (default): greedy; > 0: sample from softmax(logits / T)"},
     {"--top-p", "P", "sample from the smallest set of tokens holding probability P (default 1)"},
     {"--seed", "S", "the sampling seed (default 0): a seed gives the same text every run"},
     {"--logits-out", "FILE", "write the logits [new tokens, V] each token was chosen from (float32)"},
     {"--device", "auto|cpu|cuda", "where the model runs (default auto: cuda for a checkpoint trained in bf16 when a GPU is visible)"},
     {"--json", "", "print one JSON object: prompt ids, new ids, text"}},
    "Runs the checkpoint's model on the prompt once, then one position per new token with a KV\n"
    "cache (each MoE layer routes every new token on its own; dropless). --device cpu: the FP32\n"
    "reference model (train.precision = fp8 emulates the FP8 recipe, as in training); cuda: the GPU\n"
    "model in BF16 (the training GPU path's numerics). The prompt is encoded with the tokenizer:\n"
    "--tokenizer, else the run's recorded one (data.tokenizer, or summary.json beside its token\n"
    "files), else as bytes (id = byte value: the embedded corpus's byte-level vocabulary; id\n"
    "data.eos_id is EOS). Generation stops at data.eos_id. Prints the prompt and the continuation\n"
    "(ids the byte vocabulary has no byte for print as <|id|>) (docs/data.md).\n"};

// A finite number from flag `flag`.
double parse_number(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v))
    usage_fail(flag, ": expected a number, got '", text, "'");
  return v;
}

int cmd_generate(const ParsedArgs& a) {
  const std::string prompt = a.value_or("--prompt", "");
  if (prompt.empty()) usage_fail("--prompt needs some text, got an empty value");
  const int64_t max_new = a.int_or("--max-new-tokens", 64, 0, 1 << 20);
  SamplingOptions so;
  so.temperature = a.has("--temperature") ? parse_number("--temperature", *a.value("--temperature")) : 0.0;
  if (so.temperature < 0) usage_fail("--temperature: expected a number >= 0, got ", so.temperature);
  so.top_p = a.has("--top-p") ? parse_number("--top-p", *a.value("--top-p")) : 1.0;
  if (!(so.top_p > 0 && so.top_p <= 1)) usage_fail("--top-p: expected a number in (0, 1], got ", so.top_p);
  so.seed = static_cast<uint64_t>(a.int_or("--seed", 0, 0));
  const std::string logits_out = a.value_or("--logits-out", "");
  const std::string dir = step_dir_of(a.positionals[0]);
  const LoadedCheckpoint ck = LoadedCheckpoint::open(dir);
  const Config cfg = checkpoint_config(ck);
  validate_config(cfg);
  std::string tok_path = a.value_or("--tokenizer", "");
  if (a.has("--tokenizer") && tok_path.empty()) usage_fail("--tokenizer needs a tokenizer.json path, got an empty value");
  if (!a.has("--tokenizer")) tok_path = recorded_tokenizer(cfg);
  // The tokenizer's encode and decode (a build without PCRE2/ICU has none: refused naming the file).
  std::function<std::string(const std::vector<uint32_t>&)> decode_ids;
  std::vector<int32_t> ids;
  if (!tok_path.empty()) {
#if MOECORE_HAS_TOKENIZER
    auto tok = std::make_shared<Tokenizer>(Tokenizer::from_file(tok_path));
    MOE_CHECK(tok->vocab_size() <= cfg.model.vocab_size, "tokenizer '", tok_path, "' has ", tok->vocab_size(),
              " tokens but the model's vocabulary is model.vocab_size = ", cfg.model.vocab_size,
              ": expected the tokenizer the model was trained with");
    for (uint32_t id : tok->encode(prompt)) ids.push_back(static_cast<int32_t>(id));
    decode_ids = [tok](const std::vector<uint32_t>& u) { return tok->decode(u); };
#else
    MOE_CHECK(false, "tokenizer '", tok_path, "': this build has no tokenizer (PCRE2 and ICU were not found at ",
              "configure time); rebuild with them, or run without --tokenizer on a byte-level model");
#endif
  } else {
    MOE_CHECK(cfg.model.vocab_size >= kEmbeddedVocabSize, "without --tokenizer the prompt is bytes (ids 0..255), but ",
              "this model has model.vocab_size = ", cfg.model.vocab_size, "; give --tokenizer tokenizer.json");
    for (unsigned char c : prompt) ids.push_back(c);
  }
  MOE_CHECK(!ids.empty(), "--prompt '", prompt, "' encodes to no tokens");
  const std::string device = a.value_or("--device", "auto");
  if (device != "auto" && device != "cpu" && device != "cuda")
    usage_fail("--device: expected auto, cpu or cuda, got '", device, "'");
  const bool on_gpu = device == "cuda" || (device == "auto" && cfg.train.precision == "bf16" && gpu_available());
  Model<float> model(cfg.model, cfg.moe);
  model.set_matmul_precision(cfg.train.precision, cfg.train.fp8_scaling);
  load_model_state(ck, model);
  const DecodeStep decoder = on_gpu ? cuda_decoder(model) : DecodeStep();
  const auto t0 = std::chrono::steady_clock::now();
  const Generation g = on_gpu ? generate(decoder, cfg.model.vocab_size, ids, max_new, cfg.data.eos_id, so, !logits_out.empty())
                              : generate(model, ids, max_new, cfg.data.eos_id, so, !logits_out.empty());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string text;
  if (decode_ids) {
    std::vector<uint32_t> u(g.ids.begin(), g.ids.end());
    if (g.hit_eos) u.pop_back();
    text = decode_ids(u);
  } else {
    for (size_t i = 0; i < g.ids.size(); ++i) {
      if (g.hit_eos && i + 1 == g.ids.size()) break;
      if (g.ids[i] < 256) text += static_cast<char>(g.ids[i]);
      else text += "<|" + std::to_string(g.ids[i]) + "|>";
    }
  }
  if (!logits_out.empty())
    write_file_atomic(logits_out,
                      std::string_view(reinterpret_cast<const char*>(g.logits.data()), g.logits.size() * sizeof(float)));
  if (a.has("--json")) {
    const nlohmann::json j = {{"prompt_ids", ids}, {"ids", g.ids}, {"eos", g.hit_eos},
                              {"text", text}, {"tokenizer", tok_path.empty() ? "bytes" : tok_path},
                              {"device", on_gpu ? "cuda" : "cpu"}, {"seconds", seconds},
                              {"tokens_per_s", seconds > 0 ? double(g.ids.size()) / seconds : 0.0}};
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    return 0;
  }
  std::cout << prompt << text << "\n";
  return 0;
}

const CommandSpec kVersion{"version", {}, 0, false, {}, "Prints the version and the commit moecore was built from.\n"};

int cmd_version(const ParsedArgs&) {
  std::cout << version_text() << "\n";
  return 0;
}

struct Command {
  const CommandSpec* spec;
  std::function<int(const ParsedArgs&)> run;
};

std::vector<Command> commands(const std::string& invocation) {
  return {{&kTrain, cmd_train},
          {&kPlan, cmd_plan},
          {&kReport, cmd_report},
          {&kBench, [invocation](const ParsedArgs& a) { return cmd_bench(a, invocation); }},
          {&kSweep, [invocation](const ParsedArgs& a) { return cmd_sweep(a, invocation); }},
          {&kInspect, cmd_inspect},
          {&kExportHf, cmd_export_hf},
          {&kImportHf, cmd_import_hf},
          {&kEval, cmd_eval},
          {&kGenerate, cmd_generate},
          {&kLogits, cmd_logits},
          {&kTokenize, cmd_tokenize},
          {&kDataPrepare, cmd_data_prepare},
          {&kVersion, cmd_version}};
}

std::string help_of(const CommandSpec& spec) {
  std::string s = cli::help_text(spec);
  if (&spec == &kTrain) s += "\nKeys (type, default, meaning):\n" + config_help();
  return s;
}

// Prints the error; in a job of several ranks prefixes the rank and aborts every rank, so that
// no peer waits for this one in a collective.
int report_error(const char* what) {
  if (world_comm_started() && world_comm().size() > 1) {
    std::fprintf(stderr, "[rank %d] error: %s\n", world_comm().rank(), what);
    world_comm().abort(1);
  }
  std::fprintf(stderr, "error: %s\n", what);
  return 1;
}

int run_main(const std::vector<std::string>& argv) {
  std::vector<std::string> args(argv.begin() + 1, argv.end());
  if (args.empty()) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  std::string invocation = "moecore";
  for (const std::string& a : args) invocation += " " + a;
  const std::vector<Command> table = commands(invocation);
  auto find = [&](const std::string& name) -> const Command* {
    for (const Command& c : table)
      if (c.spec->name == name) return &c;
    return nullptr;
  };
  if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    if (args.size() > 1 && find(args[1])) {
      std::cout << help_of(*find(args[1])->spec);
      return 0;
    }
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (args[0] == "--version" || args[0] == "-V") {
    std::cout << version_text() << "\n";
    return 0;
  }
  // Two-word commands: "data prepare".
  if (args[0] == "data") {
    if (args.size() < 2 || args[1] == "--help" || args[1] == "-h") {
      std::fprintf(stderr, "error: 'moecore data' needs a subcommand: prepare\n%s\n", cli::usage_line(kDataPrepare).c_str());
      return args.size() < 2 ? 2 : 0;
    }
    if (args[1] != "prepare") {
      std::fprintf(stderr, "error: unknown command 'data %s'; expected 'data prepare'\n", args[1].c_str());
      return 2;
    }
    args[0] = "data prepare";
    args.erase(args.begin() + 1);
  }
  const Command* cmd = find(args[0]);
  if (!cmd) {
    std::string best;
    int best_d = INT_MAX;
    for (const Command& c : table)
      if (const int d = cli::edit_distance(args[0], c.spec->name); d < best_d) best_d = d, best = c.spec->name;
    std::fprintf(stderr, "error: unknown command '%s'%s\n\n%s", args[0].c_str(),
                 best_d <= 2 ? ("; did you mean '" + best + "'?").c_str() : "", kUsage);
    return 2;
  }
  args.erase(args.begin());
  try {
    const ParsedArgs parsed = cli::parse_args(*cmd->spec, args);
    if (parsed.help) {
      std::cout << help_of(*cmd->spec);
      return 0;
    }
    return cmd->run(parsed);
  } catch (const UsageError& e) {
    if (world_comm_started() && world_comm().size() > 1) return report_error(e.what());
    std::fprintf(stderr, "error: %s\n%s\n`moecore %s --help` for details.\n", e.what(),
                 cli::usage_line(*cmd->spec).c_str(), cmd->spec->name.c_str());
    return 1;
  } catch (const std::exception& e) {
    return report_error(e.what());
  }
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) { return moe::run_main(std::vector<std::string>(argv, argv + argc)); }
