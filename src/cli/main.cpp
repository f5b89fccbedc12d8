// moecore command-line entry point: train (and --dry-run), inspect, tokenize.
// Every error reaches the user as one "error: ..." line and exit status 1; in a multi-process
// job as "[rank r] error: ..." followed by an abort of every rank (MPI_Abort; over TCP the rank
// exits and its peers fail on the closed connections).
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf.h"
#include "core/config_io.h"
#include "core/error.h"
#include "core/signals.h"
#include "data/embedded.h"
#include "model/layout.h"
#include "model/model.h"
#include "parallel/comm.h"
#include "train/bench.h"
#include "train/run_plan.h"
#include "train/device.h"
#include "train/model_state.h"
#include "train/trainer.h"

namespace moe {
namespace {

constexpr const char* kUsage =
    "usage: moecore <command> [options]\n"
    "\n"
    "commands:\n"
    "  train [CONFIG.toml] [--section.key=value ...]   train a model (no CONFIG: the embedded default)\n"
    "  train --dry-run [--world N] ...                 print the resolved config and the run plan: layout,\n"
    "                                                  batch arithmetic, FLOPs, memory per rank (N ranks)\n"
    "  bench [CONFIG.toml] [--warmup N] [--steps N] [--out DIR | --json PATH] [--section.key=value ...]\n"
    "                                                  time warm training steps: tokens/s, TFLOP/s, phases, memory\n"
    "  inspect CHECKPOINT_DIR                          print a checkpoint's step, config and tensors\n"
    "  export-hf CHECKPOINT_DIR OUT_DIR [--dtype bf16|fp32]\n"
    "                                                  write a Hugging Face OLMoE model (config.json + safetensors)\n"
    "  import-hf HF_DIR OUT_CHECKPOINT_DIR             turn an HF OLMoE model into a moecore checkpoint\n"
    "  logits CHECKPOINT_DIR --tokens ID,ID,... [--out FILE]\n"
    "                                                  run one sequence, print its loss, write FP32 logits\n"
    "  tokenize --out FILE [--dtype uint16|uint32] [--eos ID] TEXT_FILE...\n"
    "                                                  byte-level tokenizer: one document per file\n"
    "\n"
    "`moecore <command> --help` for details.\n";

// The value after `flag` at args[i] (advancing i), with an error naming the flag when absent.
const std::string& flag_value(const std::vector<std::string>& args, size_t& i) {
  MOE_CHECK(i + 1 < args.size(), args[i], " needs a value");
  return args[++i];
}

// `text` as an integer; anything else is refused naming `what`.
int64_t parse_int(const std::string& what, const std::string& text) {
  size_t used = 0;
  int64_t out = 0;
  try {
    out = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  MOE_CHECK(!text.empty() && used == text.size(), what, ": expected an integer, got '", text, "'");
  return out;
}

// An integer flag value (see flag_value).
int64_t flag_int(const std::vector<std::string>& args, size_t& i) {
  const std::string flag = args[i];
  return parse_int(flag, flag_value(args, i));
}

bool has_flag(std::vector<std::string>& args, const std::string& flag) {
  for (auto it = args.begin(); it != args.end(); ++it) {
    if (*it == flag) {
      args.erase(it);
      return true;
    }
  }
  return false;
}

// The resolved config and the run plan of `world` ranks (rank 0's figures are every rank's:
// ranks differ only in which experts and shards they hold, not in how many).
void print_dry_run(const Config& cfg, int64_t world) {
  std::cout << config_to_toml(cfg) << "\n";
  const std::string device = resolve_device(cfg.train);
  std::cout << describe_run_plan(make_run_plan(cfg, world, device));
  if (device == "cpu") {  // what the same run needs on the CUDA backend
    Config gpu = cfg;
    gpu.train.device = "cuda";
    gpu.train.precision = "bf16";
    std::cout << "# on cuda (bf16):\n" << describe_run_plan(make_run_plan(gpu, world, "cuda"));
  }
}

int cmd_train(std::vector<std::string> args) {
  if (has_flag(args, "--help") || has_flag(args, "-h")) {
    std::cout << "usage: moecore train [CONFIG.toml] [--dry-run [--world N]] [--section.key=value ...]\n\n"
                 "Without CONFIG the embedded default (configs/tiny.toml) trains on the built-in corpus.\n"
                 "Keys (type, default, meaning):\n"
              << config_help();
    return 0;
  }
  const bool dry = has_flag(args, "--dry-run");
  std::string path;
  std::vector<std::string> overrides;
  int64_t dry_world = 0;  // --world N: the dry run's plan for N ranks without launching them
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--dry-run") continue;
    if (a == "--world" || a.rfind("--world=", 0) == 0) {
      dry_world = parse_int("--world", a == "--world" ? flag_value(args, i) : a.substr(8));
      MOE_CHECK(dry && dry_world >= 1, "--world N goes with --dry-run and needs N >= 1, got ", dry_world);
    } else if (a.rfind("--", 0) == 0) {
      overrides.push_back(a);
    } else if (path.empty()) {
      path = a;
    } else {
      MOE_FAIL("unexpected argument '", a, "': give one CONFIG.toml and --section.key=value overrides");
    }
  }
  // Join the job first (MPI or TCP when a launcher started us), so that every later error is reported
  // with its rank and ends all ranks. A dry run joins only to learn the world size.
  Comm* world = dry && dry_world > 0 ? nullptr : &world_comm();
  const Config cfg = load_config(path, overrides);
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
  std::printf(", %.1f s; checkpoint %s\n", s.wall_s, s.last_checkpoint.c_str());
  return 0;
}

int cmd_bench(std::vector<std::string> args, const std::string& command) {
  if (has_flag(args, "--help") || has_flag(args, "-h")) {
    std::cout << "usage: moecore bench [CONFIG.toml] [--warmup N] [--steps N] [--out DIR | --json PATH]\n"
                 "                     [--section.key=value ...]       (flags also as --flag=value)\n\n"
                 "Runs warm training steps on random tokens and prints tokens/s, TFLOP/s (FLOPs per token from\n"
                 "docs/architecture.md), MFU, step time by phase and peak memory; writes the same as JSON under\n"
                 "DIR (default bench/results; --out= for none) or to PATH. train.device and train.precision pick\n"
                 "the backend as for train: cuda runs one GPU (CUDA graph, device-side initialisation), cpu the\n"
                 "reference. `mpirun -np N moecore bench ...` (cuda) runs data parallel over N GPUs (NCCL), each\n"
                 "GPU with the one-GPU step's micro-batches (global batch x N), and reports figures per GPU and the\n"
                 "gradient all-reduce. See docs/benchmarks.md for what each figure means.\n";
    return 0;
  }
  // Join the job first (MPI or TCP when a launcher started us), so that every later error is reported
  // with its rank and ends all ranks.
  Comm& world = world_comm();
  BenchOptions opt;
  opt.command = command;
  std::string path;
  std::vector<std::string> overrides;
  // `--name VALUE` or `--name=VALUE`; true when args[i] is that flag (i advanced past a separate value).
  auto flag = [&](const char* name, size_t& i, std::string& value) {
    const std::string eq = std::string(name) + "=";
    if (args[i] == name) {
      value = flag_value(args, i);
      return true;
    }
    if (args[i].rfind(eq, 0) == 0) {
      value = args[i].substr(eq.size());
      return true;
    }
    return false;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    std::string value;
    if (flag("--warmup", i, value)) opt.warmup = parse_int("--warmup", value);
    else if (flag("--steps", i, value)) opt.steps = parse_int("--steps", value);
    else if (flag("--out", i, value)) opt.out_dir = value;
    else if (flag("--json", i, value)) opt.json_path = value;
    else if (args[i].rfind("--", 0) == 0) overrides.push_back(args[i]);
    else if (path.empty()) path = args[i];
    else MOE_FAIL("unexpected argument '", args[i], "'");
  }
  if (!path.empty()) opt.config_name = std::filesystem::path(path).stem().string();
  const Config cfg = load_config(path, overrides);
  run_bench(cfg, opt, std::cout, world);
  return 0;
}

int cmd_inspect(std::vector<std::string> args) {
  const bool help = has_flag(args, "--help") || has_flag(args, "-h");
  if (help || args.empty()) {
    std::cout << "usage: moecore inspect CHECKPOINT_DIR\n\n"
                 "CHECKPOINT_DIR is a step_<N> directory or a checkpoint directory (its latest step is shown).\n";
    return help ? 0 : 2;
  }
  MOE_CHECK(args.size() == 1, "inspect takes one CHECKPOINT_DIR, got ", args.size(), " arguments");
  const auto dir = resolve_checkpoint(args[0]);
  MOE_CHECK(dir.has_value(), "no complete checkpoint at '", args[0], "'");
  const LoadedCheckpoint ck = LoadedCheckpoint::open(*dir);
  std::cout << "checkpoint " << *dir << "\nstep " << ck.step() << "\n";
  const nlohmann::json& st = ck.train_state();
  for (auto it = st.begin(); it != st.end(); ++it)
    if (it.key() != "config") std::cout << it.key() << " " << it.value().dump() << "\n";
  if (st.contains("config")) std::cout << "\n[config]\n" << st["config"].get<std::string>() << "\n";
  auto list = [](const char* file, const SafetensorsFile& f) {
    int64_t bytes = 0;
    for (const auto& t : f.tensors()) bytes += int64_t(t.end - t.begin);
    std::printf("%s: %zu tensors, %.2f MiB\n", file, f.tensors().size(), double(bytes) / (1 << 20));
    for (const auto& t : f.tensors())
      std::printf("  %-60s %-5s %s\n", t.name.c_str(), t.dtype_name.c_str(),
                  shape_str(t.shape).c_str());
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

int cmd_tokenize(std::vector<std::string> args) {
  std::string out, dtype = "uint16";
  int64_t eos = 0;
  std::vector<std::string> inputs;
  const bool help = has_flag(args, "--help") || has_flag(args, "-h");
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--out") out = flag_value(args, i);
    else if (args[i] == "--dtype") dtype = flag_value(args, i);
    else if (args[i] == "--eos") eos = flag_int(args, i);
    else inputs.push_back(args[i]);
  }
  if (help || out.empty() || inputs.empty()) {
    std::cout << "usage: moecore tokenize --out FILE [--dtype uint16|uint32] [--eos ID] TEXT_FILE...\n\n"
                 "Writes a headerless token file (ids = bytes, EOS after each file) for data.source = \"tokens\".\n";
    return help ? 0 : 2;
  }
  const StopSignals signals;  // a signal ends the write cleanly, without a partial file
  tokenize_text_files(inputs, out, dtype, eos);
  std::cout << "wrote " << out << "\n";
  return 0;
}

int cmd_export_hf(std::vector<std::string> args) {
  const bool help = has_flag(args, "--help") || has_flag(args, "-h");
  HfExportOptions opt;
  std::vector<std::string> pos;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--dtype") {
      opt.dtype = flag_value(args, i);
    } else if (args[i].rfind("--dtype=", 0) == 0) {
      opt.dtype = args[i].substr(8);
    } else if (args[i].rfind("--max-shard-bytes=", 0) == 0) {
      opt.max_shard_bytes = parse_int("--max-shard-bytes", args[i].substr(18));
    } else {
      pos.push_back(args[i]);
    }
  }
  if (help || pos.size() != 2) {
    std::cout << "usage: moecore export-hf CHECKPOINT_DIR OUT_DIR [--dtype bf16|fp32] [--max-shard-bytes=N]\n\n"
                 "Writes config.json (OlmoeForCausalLM), model-*.safetensors shards with per-expert names and\n"
                 "model.safetensors.index.json. Models OLMoE cannot express are refused.\n";
    return help ? 0 : 2;
  }
  const int shards = export_hf(pos[0], pos[1], opt);
  std::cout << "wrote " << pos[1] << " (" << shards << " shard" << (shards == 1 ? "" : "s") << ", " << opt.dtype << ")\n";
  return 0;
}

int cmd_import_hf(std::vector<std::string> args) {
  const bool help = has_flag(args, "--help") || has_flag(args, "-h");
  if (help || args.size() != 2) {
    std::cout << "usage: moecore import-hf HF_DIR OUT_CHECKPOINT_DIR\n\n"
                 "Reads an OLMoE config.json and safetensors (single file or sharded; per-expert or fused experts;\n"
                 "F32/BF16/F16) and writes OUT_CHECKPOINT_DIR/step_0 plus OUT_CHECKPOINT_DIR/config.toml.\n"
                 "Continue training with: moecore train OUT_CHECKPOINT_DIR/config.toml --checkpoint.resume=OUT_CHECKPOINT_DIR\n";
    return help ? 0 : 2;
  }
  const std::string step_dir = import_hf(args[0], args[1]);
  std::cout << "wrote " << step_dir << " and " << args[1] << "/config.toml\n";
  return 0;
}

int cmd_logits(std::vector<std::string> args) {
  const bool help = has_flag(args, "--help") || has_flag(args, "-h");
  std::string tokens_arg, out;
  std::vector<std::string> pos;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--tokens") tokens_arg = flag_value(args, i);
    else if (args[i] == "--out") out = flag_value(args, i);
    else pos.push_back(args[i]);
  }
  if (help || pos.size() != 1 || tokens_arg.empty()) {
    std::cout << "usage: moecore logits CHECKPOINT_DIR --tokens ID,ID,... [--out FILE]\n\n"
                 "Runs the checkpoint's model (FP32, CPU) on one sequence; prints the mean next-token loss and\n"
                 "writes the logits [S, V] as little-endian float32 to FILE.\n";
    return help ? 0 : 2;
  }
  const auto dir = resolve_checkpoint(pos[0]);
  MOE_CHECK(dir.has_value(), "no complete checkpoint at '", pos[0], "'");
  const LoadedCheckpoint ck = LoadedCheckpoint::open(*dir);
  const Config cfg = parse_config_toml(ck.train_state().at("config").get<std::string>(), *dir + "/train_state.json");
  Model<float> model(cfg.model, cfg.moe);
  load_model_state(ck, model);
  std::vector<int32_t> ids;
  size_t start = 0;
  while (start <= tokens_arg.size()) {
    const size_t comma = tokens_arg.find(',', start);
    const std::string tok = tokens_arg.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!tok.empty()) ids.push_back(static_cast<int32_t>(parse_int("--tokens", tok)));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  MOE_CHECK(!ids.empty(), "--tokens: expected a comma-separated list of token ids");
  std::vector<int32_t> targets(ids.size(), -1);
  for (size_t i = 0; i + 1 < ids.size(); ++i) targets[i] = ids[i + 1];
  const ForwardStats s = model.forward(ids.data(), targets.data(), 1, static_cast<int64_t>(ids.size()));
  std::printf("tokens %zu loss %.8f\n", ids.size(), s.num_targets ? s.ce_sum / double(s.num_targets) : 0.0);
  if (!out.empty()) {
    FILE* f = std::fopen(out.c_str(), "wb");
    MOE_CHECK(f, "cannot write ", out);
    const auto& lg = model.logits();
    const size_t n = std::fwrite(lg.data(), sizeof(float), lg.size(), f);
    MOE_CHECK(std::fclose(f) == 0 && n == lg.size(), "writing ", out, " failed");
  }
  return 0;
}

}  // namespace

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

}  // namespace moe

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::fputs(moe::kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string cmd = args[0];
  args.erase(args.begin());
  try {
    if (cmd == "train") return moe::cmd_train(args);
    if (cmd == "inspect") return moe::cmd_inspect(args);
    if (cmd == "bench") {
      std::string command = "moecore";
      for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
      return moe::cmd_bench(args, command);
    }
    if (cmd == "tokenize") return moe::cmd_tokenize(args);
    if (cmd == "logits") return moe::cmd_logits(args);
    if (cmd == "export-hf") return moe::cmd_export_hf(args);
    if (cmd == "import-hf") return moe::cmd_import_hf(args);
    std::fprintf(stderr, "error: unknown command '%s'\n\n%s", cmd.c_str(), moe::kUsage);
    return 2;
  } catch (const std::exception& e) {
    return moe::report_error(e.what());
  }
}
