// The run configuration: one struct per TOML section, with the defaults of the embedded
// `tiny` run. Parsing, overrides, validation and serialisation live in core/config_io.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe {

struct ModelConfig {
  int64_t vocab_size = 256;
  int64_t d_model = 128;
  int64_t n_layers = 4;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 2;
  bool qk_norm = true;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  std::vector<int64_t> dense_layers = {0};  // layer indices with a dense MLP instead of MoE
  int64_t dense_hidden = 512;
  double init_std = 0.02;

  int64_t head_dim() const { return d_model / n_heads; }
};

struct MoeConfig {
  int64_t num_experts = 8;
  int64_t top_k = 2;
  int64_t expert_hidden = 128;
  int64_t shared_experts = 0;       // shared expert MLP of hidden shared_experts * expert_hidden
  std::string router = "softmax";   // "softmax" | "sigmoid"
  bool norm_topk_prob = false;
  double lb_loss_weight = 0.01;
  double z_loss_weight = 0.001;
  double bias_update_rate = 0.0;    // aux-loss-free expert bias; 0 disables
  double capacity_factor = 0.0;     // 0 = dropless
  std::string routing = "learned";  // "learned" | "random" | "uniform"
};

struct TrainConfig {
  int64_t seq_len = 128;
  int64_t micro_batch = 8;    // sequences per rank per micro-step
  int64_t global_batch = 16;  // sequences per optimizer step
  int64_t steps = 100;
  uint64_t seed = 1234;
  std::string precision = "fp32";  // "fp32" | "bf16" | "fp8"
  std::string fp8_scaling = "blocks";  // "blocks" | "mx" | "mx_no_saturation" (precision "fp8")
  std::string recompute = "none";  // "none" | "selective" | "full"
  std::string device = "auto";     // "auto" | "cpu" | "cuda"
  int64_t eval_interval = 25;
  int64_t eval_batches = 4;
};

struct OptimConfig {
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_steps = 10;
  std::string schedule = "cosine";  // "cosine" | "linear" | "constant"
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;
  // "fp32" | "bf16": how the two AdamW moments are stored. The update computes in FP32 either way;
  // bf16 stores each moment rounded to nearest even (half their memory and bytes a step).
  std::string moment_dtype = "fp32";
  // GPU: apply each step's AdamW update during the next step, each block's on a second stream
  // just before that block's forward (the same values; not with ZeRO-1, not on the CPU backend).
  bool deferred_update = false;
  // With deferred_update: the multiprocessors the update of the blocks runs on, which the forward's
  // GEMMs beside it leave free; 0: the update takes every multiprocessor it can (no reserve).
  int64_t deferred_update_sms = 0;
};

// The largest optim.beta2 accepted with optim.moment_dtype = "bf16" (config_io.cpp says why).
inline constexpr double kMaxBeta2WithBf16Moments = 0.99;

// One source of a weighted mix ([[data.sources]]): its token files, concatenated, and its share
// of the instances, weight / (sum of the weights).
struct DataSourceConfig {
  std::vector<std::string> paths;
  double weight = 1.0;
  bool operator==(const DataSourceConfig&) const = default;
};

struct DataConfig {
  std::string source = "embedded";  // "embedded" | "tokens"
  std::vector<std::string> paths;    // one source of weight 1 (or use `sources`, not both)
  std::string token_dtype = "uint16";  // "uint16" | "uint32"
  int64_t eos_id = 0;
  std::vector<std::string> eval_paths;
  std::vector<DataSourceConfig> sources{};  // a weighted mix ([[data.sources]]), instead of paths
  std::string tokenizer;  // tokenizer.json the token files were made with ("": none recorded)
};

struct ParallelConfig {
  int64_t dp = 0;  // 0: world_size / pp
  int64_t ep = 1;
  int64_t pp = 1;
  int64_t virtual_stages = 1;        // model chunks per pipeline rank (> 1: interleaved 1F1B)
  std::vector<int64_t> pp_layers{};  // layers per model stage (pp x virtual_stages entries); empty: even split
  std::string ep_backend = "alltoall";  // "alltoall" | "rowwise"
  double ep_capacity_factor = 0.0;      // rowwise: rows per expert <= ceil(cf x rows of the ep group / E); 0: dropless
  bool zero = true;          // ZeRO-1: AdamW moments sharded over data-parallel ranks (dp > 1)
  double timeout_s = 300.0;  // a collective waiting longer fails the job
  bool overlap_grad_reduce = true;  // GPU data parallel: all-reduce each block's gradients during backward
  std::string grad_reduce_dtype = "fp32";  // GPU data parallel: gradient sums in "fp32" | "bf16"
};

struct CheckpointConfig {
  std::string dir;        // empty: <run.dir>/checkpoints
  bool enabled = true;    // false: no checkpoint is written (benchmark and trace runs)
  int64_t interval = 0;   // 0: only at the end
  int64_t keep_last = 2;
  std::string resume = "none";  // "auto" | "none" | PATH
};

struct RunConfig {
  std::string dir = "runs/default";
};

struct LogConfig {
  int64_t interval = 10;
  std::string trace;         // "A:B" or "N": steps whose phases go to RUN_DIR/trace.json; "": none
  bool phase_times = false;  // GPU: time the phases of the last step of every log interval (eager)
};

struct Config {
  ModelConfig model;
  MoeConfig moe;
  TrainConfig train;
  OptimConfig optim;
  DataConfig data;
  ParallelConfig parallel;
  CheckpointConfig checkpoint;
  RunConfig run;
  LogConfig log;
};

}  // namespace moe
