// Trainer: the CPU training loop with gradient accumulation, clipping, skip-on-non-finite,
// eval, metrics and atomic checkpoints that resume bit-exactly; on the CUDA backend the same
// loop around CudaStepRunner (sync-free steps, statistics logged one step late). Data-parallel
// over MPI or TCP ranks (CPU): each rank runs its slice of the global batch with loss scales of the
// global batch, gradients are summed over ranks (ZeRO-1 reduce-scatter, or all-reduce), metrics
// are all-reduced, rank 0 prints and writes files, and every rank writes checkpoint slices. With
// parallel.ep > 1 (CPU) the model holds this rank's experts and exchanges token rows over its ep
// group; expert gradients are summed (and ZeRO-sharded) over the ep-dp group.
// Data-parallel on GPUs: one GPU per rank, gradients and statistics summed over NCCL inside the
// step, replicated AdamW, rank 0 writes single-file checkpoints. Expert-parallel on GPUs
// (parallel.ep > 1, device cuda): NCCL groups over ep and ep-dp, each GPU holds its experts,
// every rank writes its slices of a sliced checkpoint.
#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <ostream>

#include "checkpoint/checkpoint.h"
#include "core/config_io.h"
#include "core/error.h"
#include "data/dataset.h"
#include "data/embedded.h"
#include "data/token_file.h"
#include "model/layout.h"
#include "model/model.h"
#include "optim/adamw.h"
#include "optim/zero1.h"
#include "parallel/comm.h"
#include "parallel/expert_parallel.h"
#include "parallel/topology.h"
#include "train/device.h"
#include "train/gpu_bench.h"
#include "train/metrics.h"
#include "train/model_state.h"
#include "train/routing_seed.h"

#ifdef MOECORE_HAS_CUDA
#include <deque>

#include "cuda/ops/memory.h"
#include "cuda/ops/nccl.h"
#include "parallel/nccl_comm.h"
#include "train/cuda_step.h"
#endif

namespace moe {

namespace fs = std::filesystem;

std::string checkpoint_dir(const Config& cfg) {
  return cfg.checkpoint.dir.empty() ? (fs::path(cfg.run.dir) / "checkpoints").string() : cfg.checkpoint.dir;
}

namespace {

using Clock = std::chrono::steady_clock;

std::string fmt_duration(double s) {
  char buf[32];
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", (long long)(t / 3600), (long long)(t / 60 % 60), (long long)(t % 60));
  else
    std::snprintf(buf, sizeof buf, "%02lld:%02lld", (long long)(t / 60), (long long)(t % 60));
  return buf;
}

std::string fmt_rate(double tokens_per_s) {
  char buf[32];
  if (tokens_per_s >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", tokens_per_s / 1e6);
  else if (tokens_per_s >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", tokens_per_s / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", tokens_per_s);
  return buf;
}

struct DataSources {
  std::optional<TokenSource> train, eval;
};

DataSources open_data(const Config& cfg) {
  DataSources d;
  const int64_t inst = cfg.train.seq_len + 1;
  if (cfg.data.source == "embedded") {
    MOE_CHECK(cfg.model.vocab_size >= 256, "data.source = \"embedded\" is a byte-level corpus: model.vocab_size must be >= 256, got ",
              cfg.model.vocab_size);
    const int64_t need = (cfg.train.steps + 1) * cfg.train.global_batch * inst;
    d.train = TokenSource::from_memory(embedded_corpus("train", need, cfg.train.seed), "embedded:train",
                                       cfg.model.vocab_size);
    const int64_t eval_need = std::max<int64_t>(1, cfg.train.eval_batches) * cfg.train.micro_batch * inst;
    d.eval = TokenSource::from_memory(embedded_corpus("eval", eval_need, cfg.train.seed), "embedded:eval",
                                      cfg.model.vocab_size);
  } else {
    d.train = TokenSource::open(cfg.data.paths, cfg.data.token_dtype, cfg.model.vocab_size);
    if (!cfg.data.eval_paths.empty())
      d.eval = TokenSource::open(cfg.data.eval_paths, cfg.data.token_dtype, cfg.model.vocab_size);
  }
  return d;
}

// One forward of an evaluation batch on either backend (CPU model or GPU step runner).
using EvalForward = std::function<ForwardStats(const Batch&, uint64_t routing_seed)>;

// Eval batches are dealt round-robin over the ranks of `comm` (batch i to rank i % W); sums are
// all-reduced. When forward is a collective (expert parallelism), every rank runs the same number
// of forwards: in the last round a rank without a batch of its own runs one again (i % nb) and
// discards the result.
double evaluate(const DataLoader& eval, const Config& cfg, Comm& comm, bool collective, const EvalForward& forward) {
  const int64_t seqs = cfg.train.micro_batch;
  const int64_t nb = std::min<int64_t>(cfg.train.eval_batches, eval.num_eval_batches(seqs));
  const int64_t w = comm.size(), rounds = (nb + w - 1) / w;
  double ce = 0;
  int64_t count = 0;
  for (int64_t round = 0; round < rounds; ++round) {
    const int64_t i = round * w + comm.rank();
    if (i >= nb && !collective) continue;
    const ForwardStats s = forward(eval.eval_batch(i % nb, seqs), routing_seed(cfg.train.seed, -1, i % nb));
    if (i >= nb) continue;
    ce += s.ce_sum;
    count += s.num_targets;
  }
  if (comm.size() > 1) {
    comm.all_reduce(&ce, 1, ReduceOp::kSum);
    comm.all_reduce(&count, 1, ReduceOp::kSum);
  }
  return count ? ce / double(count) : std::nan("");
}

double evaluate(Model<float>& model, const DataLoader& eval, const Config& cfg, Comm& comm) {
  return evaluate(eval, cfg, comm, model.expert_parallel() != nullptr, [&](const Batch& b, uint64_t seed) {
    return model.forward(b.inputs.data(), b.targets.data(), b.num_sequences(), b.seq_len, seed);
  });
}

std::vector<TensorRef> tensor_refs(const ParamLayout& layout, const float* base, const std::string& suffix) {
  std::vector<TensorRef> refs;
  for (const ParamEntry& e : layout.entries())
    refs.push_back({e.name + suffix, DType::kF32, e.shape, base + e.offset});
  return refs;
}

// train_state.json of a checkpoint (docs/checkpoints.md).
nlohmann::json train_state_json(const Config& cfg, int64_t done, int64_t data_position, int64_t optimizer_steps) {
  return {{"step", done},
          {"data_position", data_position},
          {"optimizer_steps", optimizer_steps},
          {"rng", {{"kind", "counter-based"}, {"seed", cfg.train.seed}, {"step", done}}},
          {"config", config_to_toml(cfg)}};
}

// The one-rank checkpoint: global FP32 parameters (and expert biases) and both AdamW moments.
CheckpointFiles replicated_checkpoint_files(Model<float>& model, AdamW& opt, nlohmann::json train_state) {
  CheckpointFiles files;
  files.model = model_state_refs(model);
  files.optim = tensor_refs(model.layout(), opt.exp_avg().data(), ".exp_avg");
  auto avg_sq = tensor_refs(model.layout(), opt.exp_avg_sq().data(), ".exp_avg_sq");
  files.optim.insert(files.optim.end(), avg_sq.begin(), avg_sq.end());
  files.train_state = std::move(train_state);
  return files;
}

// GPU figures of a logged interval (the CPU loop has none).
struct GpuFigures {
  double tflops_per_gpu = 0;
  double mem_peak_gib = 0;
  double mem_used_gib = 0;
  int64_t num_gpus = 1;
};

// Console lines and metrics.jsonl records of the training loops (CPU and GPU): step figures
// averaged over each log interval, eval losses, skipped steps, the live line on a terminal.
class RunLog {
 public:
  RunLog(const Config& cfg, std::ostream& out, MetricsWriter* metrics, bool tty, int64_t start_step)
      : cfg_(cfg), out_(out), metrics_(metrics), tty_(tty), start_(start_step), t_start_(Clock::now()) {}

  // The clock of elapsed time, ETA and wall time starts here (after the initial eval).
  void start_clock() { t_start_ = Clock::now(); }
  Clock::time_point start_time() const { return t_start_; }
  const char* clear() const { return tty_ ? "\r\033[K" : ""; }

  void eval(int64_t step, double loss) {
    if (metrics_) metrics_->write({{"step", step}, {"eval_loss", loss}});
    char buf[96];
    std::snprintf(buf, sizeof buf, "%sstep %lld | eval_loss %.4f\n", step ? clear() : "", (long long)step, loss);
    out_ << buf << std::flush;
  }

  void skipped(int64_t step, double loss, double grad_norm) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "step %lld skipped: non-finite %s (loss %g, grad norm %g)\n", (long long)step,
                  std::isfinite(loss) ? "grad norm" : "loss", loss, grad_norm);
    out_ << buf << std::flush;
    ++skipped_;
  }

  void saved(const std::string& path, bool last) {
    if (!last || cfg_.checkpoint.interval > 0) out_ << clear() << "saved checkpoint " << path << "\n" << std::flush;
  }

  // Adds step `done`; at the end of a log interval writes the record and the console line (with
  // the GPU figures when `gpu` is given: called with the interval's step count and seconds),
  // otherwise refreshes the live line on a terminal.
  void step(int64_t done, double loss, double lb, double z, double grad_norm, double lr, double step_s,
            double imbalance, double dropped_frac, const std::function<GpuFigures(int64_t, double)>& gpu) {
    loss_ += loss;
    lb_ += lb;
    z_ += z;
    s_ += step_s;
    imb_ += imbalance;
    dropped_ += dropped_frac;
    ++n_;
    if (done % cfg_.log.interval != 0 && done != cfg_.train.steps) {
      if (tty_) {
        char buf[128];
        std::snprintf(buf, sizeof buf, "\r\033[K  step %lld/%lld  loss %.4f  %.0f ms/step", (long long)done,
                      (long long)cfg_.train.steps, loss, step_s * 1e3);
        out_ << buf << std::flush;
      }
      return;
    }
    const double n = double(n_);
    const double elapsed = std::chrono::duration<double>(Clock::now() - t_start_).count();
    const double tps = double(cfg_.train.global_batch * cfg_.train.seq_len) * n / s_;
    const double eta = elapsed / double(done - start_) * double(cfg_.train.steps - done);
    nlohmann::json rec = {{"step", done},
                          {"loss", loss_ / n},
                          {"lb_loss", lb_ / n},
                          {"z_loss", z_ / n},
                          {"grad_norm", grad_norm},
                          {"lr", lr},
                          {"tokens_per_s", tps},
                          {"step_ms", 1e3 * s_ / n},
                          {"load_imbalance", imb_ / n},
                          {"dropped_frac", dropped_ / n},
                          {"skipped_steps", skipped_}};
    char gpu_part[128] = "";
    if (gpu) {
      const GpuFigures g = gpu(n_, s_);
      const double tflops = g.tflops_per_gpu;
      rec["tflops_per_gpu"] = tflops;
      rec["mfu"] = tflops / kGpuPeakTflops;
      rec["mem_peak_gib"] = g.mem_peak_gib;
      rec["mem_used_gib"] = g.mem_used_gib;
      if (g.num_gpus > 1) {
        rec["num_gpus"] = g.num_gpus;
        rec["tokens_per_s_per_gpu"] = tps / double(g.num_gpus);
      }
      std::snprintf(gpu_part, sizeof gpu_part, " | %.1f TFLOP/s (mfu %.1f%%) | mem %.2f GiB", tflops,
                    100.0 * tflops / kGpuPeakTflops, g.mem_peak_gib);
    }
    if (metrics_) metrics_->write(rec);
    char buf[400];
    std::snprintf(buf, sizeof buf,
                  "%sstep %*lld/%lld | loss %.4f | lb %.3f | z %.3f | gnorm %.3f | lr %.2e | %s tok/s%s | imb %.2f | "
                  "%s elapsed | ETA %s\n",
                  clear(), int(std::to_string(cfg_.train.steps).size()), (long long)done, (long long)cfg_.train.steps,
                  loss_ / n, lb_ / n, z_ / n, grad_norm, lr, fmt_rate(tps).c_str(), gpu_part, imb_ / n,
                  fmt_duration(elapsed).c_str(), fmt_duration(eta).c_str());
    out_ << buf << std::flush;
    loss_ = lb_ = z_ = s_ = imb_ = dropped_ = 0;
    n_ = skipped_ = 0;
  }

 private:
  const Config& cfg_;
  std::ostream& out_;
  MetricsWriter* metrics_;
  bool tty_;
  int64_t start_;
  Clock::time_point t_start_;
  double loss_ = 0, lb_ = 0, z_ = 0, s_ = 0, imb_ = 0, dropped_ = 0;
  int64_t n_ = 0, skipped_ = 0;
};

// Test-only fault injection: MOECORE_FAULT_EXIT_RANK=r and MOECORE_FAULT_EXIT_STEP=n make rank r
// leave with _exit(3) when step n begins, as a crashed process would (no MPI_Finalize).
struct FaultInjection {
  int rank = -1;
  int64_t step = -1;
  static FaultInjection from_env() {
    FaultInjection f;
    const char* r = std::getenv("MOECORE_FAULT_EXIT_RANK");
    const char* n = std::getenv("MOECORE_FAULT_EXIT_STEP");
    if (r && n && *r && *n) {
      f.rank = std::atoi(r);
      f.step = std::atoll(n);
    }
    return f;
  }
  void maybe_exit(int rank_now, int64_t step_now) const {
    if (rank_now != rank || step_now != step) return;
    std::fprintf(stderr, "[rank %d] fault injection: exiting at step %lld (MOECORE_FAULT_EXIT_*)\n", rank_now,
                 (long long)step_now);
    std::fflush(nullptr);
    ::_exit(3);
  }
};

// This rank's checkpoint slices: the ranges its shard plans own (parameters and moments, the
// moments from the ZeRO shards or from the replicated AdamW), plus the expert biases on rank 0.
SlicedCheckpointFiles sliced_files(Model<float>& model, const std::vector<ShardGroup>& owned, DistOptimizer* dist,
                                   AdamW& opt, const Topology& topo) {
  SlicedCheckpointFiles f;
  const ParamLayout& layout = model.layout();
  for (size_t gi = 0; gi < owned.size(); ++gi) {
    for (const ShardPiece& p : owned[gi].plan.my_pieces()) {
      const ParamEntry& e = layout.at(p.entry);
      const GlobalPlacement& g = model.placements()[size_t(p.entry)];
      const int64_t at = g.offset + p.entry_offset;
      const float* m = dist ? dist->groups()[gi].m.data() + p.shard_offset : opt.exp_avg().data() + e.offset + p.entry_offset;
      const float* v = dist ? dist->groups()[gi].v.data() + p.shard_offset
                            : opt.exp_avg_sq().data() + e.offset + p.entry_offset;
      f.model.push_back({e.name, g.global_shape, at, p.numel, model.params() + e.offset + p.entry_offset});
      f.optim.push_back({e.name + ".exp_avg", g.global_shape, at, p.numel, m});
      f.optim.push_back({e.name + ".exp_avg_sq", g.global_shape, at, p.numel, v});
    }
  }
  if (topo.rank == 0) {
    const int64_t ne = model.moe_config().num_experts;
    for (int64_t m = 0; m < model.num_moe_layers(); ++m)
      f.model.push_back({expert_bias_name(model.model_config(), m), {ne}, 0, ne, model.expert_bias().data() + m * ne});
  }
  return f;
}

#ifdef MOECORE_HAS_CUDA

// Eval on the GPU: each rank's batches on its own GPU, the sums all-reduced over MPI. With expert
// parallelism forward is a collective of the ep group, so every rank runs the same number of forwards.
double evaluate_gpu(CudaStepRunner& runner, const DataLoader& eval, const Config& cfg, Comm& comm) {
  return evaluate(eval, cfg, comm, /*collective=*/runner.model().ep_size() > 1,
                  [&](const Batch& b, uint64_t seed) { return runner.evaluate(b, seed); });
}

// The training loop on the GPUs: step N is submitted, then step N - 1 is collected and logged, so
// the host stages the next step while the GPU runs; the queue is flushed before every eval,
// checkpoint and at the end. With dp > 1 every rank drives its own GPU (bound by local rank) on
// its slice of the global batch; the ranks sum their target counts over MPI before each submit
// (the CE scale of the global batch) and the step itself sums gradients and statistics over
// NCCL, so every rank holds the same replicated state. The host Model<float> and AdamW are the
// checkpoint mirror: rank 0 downloads the device state into them and writes the single-file
// checkpoint. Step time is the wall time from the later of the step's submission and the
// previous step's completion to this step's completion (rank 0's clock).
void train_on_gpu(const Config& cfg, std::ostream& out, TrainSummary& summary, DataLoader& loader,
                  const DataLoader* eval, Model<float>& model, AdamW& opt, const std::string& ckpt_dir,
                  MetricsWriter* metrics, const Topology& topo, const FaultInjection& fault,
                  const std::vector<ShardGroup>& owned) {
  const int64_t start = summary.start_step;
  const int64_t dp = topo.sizes.dp;
  Comm& dp_comm = *topo.dp_comm;
  Comm& world = *topo.world;
  // One GPU per rank, chosen before anything is allocated on a GPU.
  if (world.size() > 1) {
    LocalRank local;
    const int gpu = bind_local_gpu(world, &local);
    std::vector<int64_t> gpus(size_t(world.size()));
    const int64_t mine = gpu;
    world.all_gather(&mine, gpus.data(), 1);
    out << "GPUs: rank r -> GPU";
    for (size_t r = 0; r < gpus.size(); ++r) out << (r ? ", " : " ") << r << ":" << gpus[r];
    out << " (local rank from " << local.source << ")\n" << std::flush;
  }
  cuda::reset_device_peak_bytes();
  std::unique_ptr<cuda::NcclComm> nccl;
  if (dp > 1) {
    nccl = make_nccl_comm(dp_comm);
    const bool overlap = cfg.parallel.overlap_grad_reduce && topo.sizes.ep == 1;
    out << "data parallel over " << dp << " GPUs: NCCL " << cuda::nccl_version() << ", gradients all-reduced "
        << (overlap ? "block by block during the last backward (overlapped)" : "after the last backward")
        << ", replicated AdamW\n"
        << std::flush;
  }
  // Expert parallelism: NCCL groups over the ep ranks (token exchange) and, when dp > ep, the
  // ep-dp ranks (expert gradients); made in the same order on every rank.
  std::unique_ptr<cuda::NcclComm> nccl_ep, nccl_ep_dp;
  const int64_t ep = topo.sizes.ep;
  if (ep > 1) {
    nccl_ep = make_nccl_comm(*topo.ep_comm);
    if (topo.ep_dp_size > 1) nccl_ep_dp = make_nccl_comm(*topo.ep_dp_comm);
    out << "expert parallel over " << ep << " GPUs per group (" << cfg.moe.num_experts / ep
        << " experts each, ep-dp " << topo.ep_dp_size << "): NCCL all-to-all of token rows per MoE layer, "
        << "counts read on the host (no CUDA graph)\n"
        << std::flush;
  }
  CudaStepRunner runner(cfg, nccl.get(), nccl_ep.get(), nccl_ep_dp.get());
  runner.load_state(model.params(), opt.exp_avg().data(), opt.exp_avg_sq().data(), opt.steps_taken(),
                    model.expert_bias());
  // Open MPI hands ranks a pty even when mpirun's output goes to a file: no live line there.
  const bool tty = isatty(fileno(stdout)) && &out == &std::cout && world.size() == 1;
  RunLog log(cfg, out, metrics, tty, start);

  if (eval && start == 0) {
    summary.initial_eval_loss = evaluate_gpu(runner, *eval, cfg, dp_comm);
    log.eval(0, summary.initial_eval_loss);
  }
  log.start_clock();

  const int64_t tokens_per_step = cfg.train.global_batch * cfg.train.seq_len;
  const double flops_per_step = count_model(cfg.model, cfg.moe, cfg.train.seq_len).flops_per_token * double(tokens_per_step);
  bool first = true;
  std::deque<Clock::time_point> submitted;  // submission time of each pending step
  Clock::time_point last_done = log.start_time();

  auto log_step = [&](const StepStats& s) {
    const auto now = Clock::now();
    const double step_s = std::chrono::duration<double>(now - std::max(submitted.front(), last_done)).count();
    submitted.pop_front();
    last_done = now;
    const int64_t done = s.step;
    const double loss = s.ce_sum / double(std::max<int64_t>(1, s.num_targets));
    const double lr = lr_at(cfg.optim, done - 1, cfg.train.steps);
    if (s.skipped || !std::isfinite(loss)) log.skipped(done, loss, s.grad_norm);
    if (first) summary.first_loss = loss;
    first = false;
    summary.last_loss = loss;
    summary.steps_done = done;
    summary.losses.push_back(loss);
    log.step(done, loss, s.lb_loss, s.z_loss, s.grad_norm, lr, step_s, load_imbalance(s.tokens_per_expert), 0.0,
             [&](int64_t steps, double seconds) {
               GpuFigures g;
               g.tflops_per_gpu = flops_per_step * double(steps) / seconds / 1e12 / double(dp);  // per GPU
               g.mem_peak_gib = double(cuda::device_peak_bytes()) / double(1ull << 30);
               size_t free_bytes = 0, total_bytes = 0;
               cuda::device_mem_info(&free_bytes, &total_bytes);
               g.mem_used_gib = double(total_bytes - free_bytes) / double(1ull << 30);
               g.num_gpus = dp;
               return g;
             });
  };
  auto flush = [&] {
    while (runner.pending() > 0) log_step(runner.collect());
  };

  for (int64_t step = start; step < cfg.train.steps; ++step) {
    fault.maybe_exit(world.rank(), step + 1);
    const auto t0 = Clock::now();
    const std::vector<Batch> micro = loader.next();
    int64_t global_targets = 0;
    for (const Batch& b : micro)
      for (int32_t t : b.targets) global_targets += t >= 0;
    // Host counts only (the host never reads a device value inside a step).
    if (dp > 1) dp_comm.all_reduce(&global_targets, 1, ReduceOp::kSum);
    runner.submit(step + 1, micro, global_targets, lr_at(cfg.optim, step, cfg.train.steps), cfg.train.seed);
    submitted.push_back(t0);
    if (runner.pending() > 1) log_step(runner.collect());  // the previous step, while this one runs

    const int64_t done = step + 1;
    const bool last = done == cfg.train.steps;
    const bool do_eval = eval && ((cfg.train.eval_interval > 0 && done % cfg.train.eval_interval == 0) || last);
    const bool do_ckpt = (cfg.checkpoint.interval > 0 && done % cfg.checkpoint.interval == 0) || last;
    if (do_eval || do_ckpt) flush();
    if (do_eval) {
      summary.final_eval_loss = evaluate_gpu(runner, *eval, cfg, dp_comm);
      log.eval(done, summary.final_eval_loss);
    }
    if (do_ckpt && ep > 1) {
      // Expert parallelism: each rank holds other experts, so every rank downloads its state and
      // writes its slices (dense tensors cut over dp, its experts' rows cut over ep-dp) of a
      // sliced step, as the CPU trainer does without ZeRO.
      int64_t optimizer_steps = 0;
      runner.download_state(model.params(), opt.exp_avg().data(), opt.exp_avg_sq().data(), &optimizer_steps,
                            &model.expert_bias());
      opt.set_steps_taken(optimizer_steps);
      SlicedCheckpointFiles sliced = sliced_files(model, owned, nullptr, opt, topo);
      sliced.train_state = train_state_json(cfg, done, loader.position(), opt.steps_taken());
      summary.last_checkpoint = save_checkpoint_sliced(world, ckpt_dir, done, sliced, cfg.checkpoint.keep_last);
      log.saved(summary.last_checkpoint, last);
    } else if (do_ckpt) {
      // Replicated state: rank 0 writes the global tensors; the others wait for its verdict, so
      // that a failed save stops every rank with the same error.
      std::string failure;
      if (world.rank() == 0) {
        try {
          int64_t optimizer_steps = 0;
          runner.download_state(model.params(), opt.exp_avg().data(), opt.exp_avg_sq().data(), &optimizer_steps,
                                &model.expert_bias());
          opt.set_steps_taken(optimizer_steps);
          const CheckpointFiles files =
              replicated_checkpoint_files(model, opt, train_state_json(cfg, done, loader.position(), opt.steps_taken()));
          summary.last_checkpoint = save_checkpoint(ckpt_dir, done, files, cfg.checkpoint.keep_last);
        } catch (const std::exception& e) {
          if (world.size() == 1) throw;
          failure = e.what();
        }
      }
      if (world.size() > 1) {
        int64_t failed = failure.empty() ? 0 : 1;
        world.broadcast(&failed, 1, 0);
        MOE_CHECK(failed == 0, "saving the checkpoint of step ", done, " failed on rank 0",
                  failure.empty() ? std::string(" (see its error)") : ": " + failure);
        if (world.rank() != 0) summary.last_checkpoint = (fs::path(ckpt_dir) / step_dir_name(done)).string();
      }
      log.saved(summary.last_checkpoint, last);
    }
  }
  flush();
  summary.wall_s = std::chrono::duration<double>(Clock::now() - log.start_time()).count();
}

#endif  // MOECORE_HAS_CUDA

}  // namespace

TrainSummary train(const Config& cfg, std::ostream& out) { return train(cfg, out, world_comm()); }

TrainSummary train(const Config& cfg, std::ostream& console, Comm& world) {
  world.set_timeout_s(cfg.parallel.timeout_s);
  const Topology topo = make_topology(cfg, world);
  const int64_t dp = topo.sizes.dp;
  const bool lead = world.rank() == 0;
  std::ostream null_out(nullptr);  // ranks other than 0 print nothing
  std::ostream& out = lead ? console : null_out;
  const FaultInjection fault = FaultInjection::from_env();

  TrainSummary summary;
  summary.run_dir = cfg.run.dir;
  if (lead) {
    fs::create_directories(cfg.run.dir);
    std::ofstream f(fs::path(cfg.run.dir) / "config.toml");
    f << config_to_toml(cfg);
    MOE_CHECK(f.good(), "cannot write ", (fs::path(cfg.run.dir) / "config.toml").string());
  }

  // Device and memory first, so that a run that cannot fit fails before allocating.
  const std::string device = resolve_device(cfg.train);
  {
    const ModelCounts c = count_model(cfg.model, cfg.moe, cfg.train.seq_len);
    const double need = double(c.total_params) * 16.0 +
                        4.0 * double(activation_elements(cfg.model, cfg.moe, cfg.train.micro_batch * cfg.train.seq_len));
    const double have = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
    MOE_CHECK(have <= 0 || need < 0.9 * have, "this model needs about ", need / double(1ull << 30),
              " GiB of host memory (FP32 weights, gradients, AdamW moments and activations; see moecore train "
              "--dry-run) but the machine has ", have / double(1ull << 30), " GiB");
  }
  DataSources data = open_data(cfg);
  DataLoader loader(*data.train, cfg.train.seq_len, cfg.train.global_batch, cfg.train.micro_batch, cfg.train.seed,
                    topo.dp_rank, dp);
  std::optional<DataLoader> eval;
  if (data.eval) eval.emplace(*data.eval, cfg.train.seq_len, cfg.train.micro_batch, cfg.train.micro_batch, cfg.train.seed, 0, 1);

  // Expert parallelism: this rank holds experts [ep_rank * E / ep, (ep_rank + 1) * E / ep) of
  // every MoE layer and exchanges token rows with the ranks of its ep group (Topology::ep_comm).
  std::optional<ExpertParallel> ep_context;
  if (topo.sizes.ep > 1) {
    MOE_CHECK(cfg.parallel.ep_backend == "alltoall", "parallel.ep_backend = \"", cfg.parallel.ep_backend,
              "\": the CPU trainer exchanges tokens by all-to-all; set parallel.ep_backend = \"alltoall\"");
    ep_context = make_expert_parallel(*topo.ep_comm, cfg.moe.num_experts);
  }
  Model<float> model(cfg.model, cfg.moe, ep_context ? &*ep_context : nullptr);
  model.init_params(cfg.train.seed);
  const ParamLayout& layout = model.layout();
  const int64_t total = layout.total_numel();
  AdamW opt(layout, cfg.optim);

  // Distributed state: gradients of dense tensors are summed over dp, of expert tensors over
  // ep-dp (with ep = 1: also dp); ZeRO-1 shards them over the same groups.
  Comm* expert_comm = topo.sizes.ep > 1 ? topo.ep_dp_comm.get() : nullptr;
  std::vector<ShardGroup> owned;
  std::unique_ptr<DistOptimizer> dist;
  if (dp > 1) {
    owned = make_shard_groups(layout, *topo.dp_comm, expert_comm);
    if (cfg.parallel.zero && device == "cpu") {  // GPU runs keep replicated moments (no ZeRO on GPU yet)
      dist = std::make_unique<DistOptimizer>(layout, cfg.optim, *topo.dp_comm, expert_comm);
      // ZeRO-1 keeps the moments only for this rank's shards: release the replicated ones.
      std::vector<float>().swap(opt.exp_avg());
      std::vector<float>().swap(opt.exp_avg_sq());
    }
  }

  // Resume.
  int64_t start = 0;
  const std::string ckpt_dir = checkpoint_dir(cfg);
  if (cfg.checkpoint.resume != "none") {
    const std::string target = cfg.checkpoint.resume == "auto" ? ckpt_dir : cfg.checkpoint.resume;
    std::optional<std::string> step_dir = resolve_checkpoint(target);
    MOE_CHECK(step_dir || cfg.checkpoint.resume == "auto", "checkpoint.resume: no complete checkpoint found at '",
              target, "'");
    if (step_dir) {
      LoadedCheckpoint ck = LoadedCheckpoint::open(*step_dir);
      load_model_state(ck, model);
      const nlohmann::json& st = ck.train_state();
      start = st.at("step").get<int64_t>();
      if (ck.has_optim()) {
        // Moments of any layout: the ranges this rank keeps (its ZeRO shards, or every tensor).
        for (size_t gi = 0; dist && gi < dist->groups().size(); ++gi) {
          DistOptimizer::Group& g = dist->groups()[gi];
          for (const ShardPiece& p : g.plan.my_pieces()) {
            const ParamEntry& e = layout.at(p.entry);
            const GlobalPlacement& gp = model.placements()[size_t(p.entry)];
            ck.read_optim_range(e.name + ".exp_avg", gp.global_shape, gp.offset + p.entry_offset, p.numel,
                                g.m.data() + p.shard_offset);
            ck.read_optim_range(e.name + ".exp_avg_sq", gp.global_shape, gp.offset + p.entry_offset, p.numel,
                                g.v.data() + p.shard_offset);
          }
        }
        if (!dist)
          for (size_t i = 0; i < layout.entries().size(); ++i) {
            const ParamEntry& e = layout.entries()[i];
            const GlobalPlacement& gp = model.placements()[i];
            ck.read_optim_range(e.name + ".exp_avg", gp.global_shape, gp.offset, e.numel,
                                opt.exp_avg().data() + e.offset);
            ck.read_optim_range(e.name + ".exp_avg_sq", gp.global_shape, gp.offset, e.numel,
                                opt.exp_avg_sq().data() + e.offset);
          }
        opt.set_steps_taken(st.value("optimizer_steps", start));
        if (dist) dist->set_steps_taken(opt.steps_taken());
      }
      loader.set_position(st.value("data_position", start));
      out << "resumed from " << *step_dir << " at step " << start << "\n";
    }
  }
  summary.start_step = start;
  MOE_CHECK(start <= cfg.train.steps, "checkpoint step ", start, " is beyond train.steps = ", cfg.train.steps);

  std::optional<MetricsWriter> metrics;  // rank 0 writes metrics.jsonl
  if (lead) metrics.emplace((fs::path(cfg.run.dir) / "metrics.jsonl").string(), /*append=*/start > 0);
  const ModelCounts counts = count_model(cfg.model, cfg.moe, cfg.train.seq_len);
  char head[256];
  std::snprintf(head, sizeof head, "moecore train: %.2fM params (%.2fM active), %lld steps x %lld tokens on %s (%s), run dir %s\n",
                counts.total_params / 1e6, counts.active_params / 1e6, (long long)cfg.train.steps,
                (long long)(cfg.train.global_batch * cfg.train.seq_len), device.c_str(), cfg.train.precision.c_str(),
                cfg.run.dir.c_str());
  out << head << std::flush;
  if (world.size() > 1)
    out << "parallel: " << world.size() << " ranks (" << world.backend() << "), dp " << dp << ", ep " << topo.sizes.ep
        << ", ZeRO-1 " << (dist ? "on" : "off") << ", collective timeout " << world.timeout_s() << " s\n"
        << std::flush;
#ifdef MOECORE_HAS_CUDA
  if (device == "cuda") {
    train_on_gpu(cfg, out, summary, loader, eval ? &*eval : nullptr, model, opt, ckpt_dir, metrics ? &*metrics : nullptr,
                 topo, fault, owned);
    return summary;
  }
#endif

  // Open MPI hands ranks a pty even when mpirun's output goes to a file: no live line there.
  const bool tty = isatty(fileno(stdout)) && &out == &std::cout && world.size() == 1;
  RunLog log(cfg, out, metrics ? &*metrics : nullptr, tty, start);
  if (eval && start == 0) {
    summary.initial_eval_loss = evaluate(model, *eval, cfg, *topo.dp_comm);
    log.eval(0, summary.initial_eval_loss);
  }
  log.start_clock();

  const int64_t micro_steps = loader.micro_steps_per_batch();
  const double micro_total = double(micro_steps * dp);  // micro-batches of the global batch
  bool first = true;

  for (int64_t step = start; step < cfg.train.steps; ++step) {
    fault.maybe_exit(world.rank(), step + 1);
    const auto t0 = Clock::now();
    const std::vector<Batch> micro = loader.next();
    model.zero_grads();
    int64_t global_targets = 0;
    for (const Batch& b : micro)
      for (int32_t t : b.targets) global_targets += t >= 0;
    if (dp > 1) topo.dp_comm->all_reduce(&global_targets, 1, ReduceOp::kSum);
    // Scales of the global batch, so that the gradients summed over ranks are the 1-rank ones.
    const LossScales scales{1.0 / double(std::max<int64_t>(1, global_targets)),
                            cfg.moe.lb_loss_weight / micro_total, cfg.moe.z_loss_weight / micro_total};
    double ce = 0, lb = 0, z = 0;
    int64_t routes = 0, dropped = 0;
    std::vector<std::vector<int64_t>> expert_counts(model.num_moe_layers(),
                                                    std::vector<int64_t>(cfg.moe.num_experts, 0));
    for (int64_t m = 0; m < static_cast<int64_t>(micro.size()); ++m) {
      const Batch& b = micro[m];
      // The micro-batch's index in the global batch, so random routing does not depend on dp.
      const uint64_t seed = routing_seed(cfg.train.seed, step, topo.dp_rank * micro_steps + m);
      const ForwardStats s = model.forward(b.inputs.data(), b.targets.data(), b.num_sequences(), b.seq_len, seed);
      model.backward(scales);
      ce += s.ce_sum;
      lb += s.lb_loss / micro_total;
      z += s.z_loss / micro_total;
      routes += s.num_routes;
      dropped += s.num_dropped;
      for (size_t l = 0; l < s.tokens_per_expert.size(); ++l)
        for (size_t e = 0; e < s.tokens_per_expert[l].size(); ++e) expert_counts[l][e] += s.tokens_per_expert[l][e];
    }
    if (dp > 1) {  // global figures on every rank, so that every rank takes the same decisions
      double sums[3] = {ce, lb, z};
      topo.dp_comm->all_reduce(sums, 3, ReduceOp::kSum);
      ce = sums[0], lb = sums[1], z = sums[2];
      std::vector<int64_t> ints = {routes, dropped};
      for (const auto& layer : expert_counts) ints.insert(ints.end(), layer.begin(), layer.end());
      topo.dp_comm->all_reduce(ints.data(), int64_t(ints.size()), ReduceOp::kSum);
      routes = ints[0], dropped = ints[1];
      size_t at = 2;
      for (auto& layer : expert_counts)
        for (int64_t& c : layer) c = ints[at++];
    }
    const double loss = ce / double(std::max<int64_t>(1, global_targets));
    const double lr = lr_at(cfg.optim, step, cfg.train.steps);
    double gnorm = 0;
    if (dp > 1) {
      // Sum the gradients; the squared norm is summed over the elements each rank owns.
      double sq = 0;
      if (dist) {
        dist->reduce_gradients(model.grads());
        sq = dist->local_sum_squares();
      } else {
        all_reduce_gradients(layout, model.grads(), *topo.dp_comm, expert_comm);
        for (const ShardGroup& g : owned) sq += owned_sum_squares(g.plan, layout, model.grads());
      }
      topo.dp_comm->all_reduce(&sq, 1, ReduceOp::kSum);
      gnorm = std::sqrt(sq);
    } else {
      gnorm = global_grad_norm(model.grads(), total);
    }
    const bool skip = !std::isfinite(loss) || !std::isfinite(gnorm);
    if (skip) {
      log.skipped(step + 1, loss, gnorm);
    } else {
      if (dist) {
        dist->step(model.params(), lr, gnorm);
        opt.set_steps_taken(dist->steps_taken());
      } else {
        clip_grads(model.grads(), total, gnorm, cfg.optim.grad_clip);
        opt.step(model.params(), model.grads(), lr);
      }
      if (cfg.moe.bias_update_rate > 0) model.update_expert_bias(expert_counts, cfg.moe.bias_update_rate);
    }
    const double step_s = std::chrono::duration<double>(Clock::now() - t0).count();
    const int64_t done = step + 1;
    if (first) summary.first_loss = loss;
    first = false;
    summary.last_loss = loss;
    summary.steps_done = done;
    summary.losses.push_back(loss);
    log.step(done, loss, lb, z, gnorm, lr, step_s, load_imbalance(expert_counts),
             routes ? double(dropped) / double(routes) : 0.0, nullptr);

    const bool last = done == cfg.train.steps;
    if (eval && ((cfg.train.eval_interval > 0 && done % cfg.train.eval_interval == 0) || last)) {
      summary.final_eval_loss = evaluate(model, *eval, cfg, *topo.dp_comm);
      log.eval(done, summary.final_eval_loss);
    }
    if ((cfg.checkpoint.interval > 0 && done % cfg.checkpoint.interval == 0) || last) {
      nlohmann::json train_state = train_state_json(cfg, done, loader.position(), opt.steps_taken());
      if (world.size() > 1) {
        SlicedCheckpointFiles sliced = sliced_files(model, owned, dist.get(), opt, topo);
        sliced.train_state = std::move(train_state);
        summary.last_checkpoint = save_checkpoint_sliced(world, ckpt_dir, done, sliced, cfg.checkpoint.keep_last);
      } else {
        summary.last_checkpoint =
            save_checkpoint(ckpt_dir, done, replicated_checkpoint_files(model, opt, std::move(train_state)),
                            cfg.checkpoint.keep_last);
      }
      log.saved(summary.last_checkpoint, last);
    }
  }
  summary.wall_s = std::chrono::duration<double>(Clock::now() - log.start_time()).count();
  return summary;
}

}  // namespace moe
