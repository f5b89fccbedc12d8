// HostState, resume and the checkpoint writers of the training loop (both backends): the
// replicated single-file checkpoint, the sliced one (each rank's shard-plan ranges of parameters
// and moments, expert biases from rank 0), train_state.json, and resuming any layout's moments
// into the ranges this rank keeps.
#include "train/checkpointing.h"

#include <filesystem>
#include <ostream>

#include "checkpoint/checkpoint.h"
#include "core/config_io.h"
#include "core/error.h"
#include "data/dataset.h"
#include "parallel/topology.h"
#include "train/model_state.h"
#include "train/run_plan.h"
#include "train/trainer.h"

namespace moe {

namespace fs = std::filesystem;

std::string checkpoint_dir(const Config& cfg) {
  return cfg.checkpoint.dir.empty() ? (fs::path(cfg.run.dir) / "checkpoints").string() : cfg.checkpoint.dir;
}

namespace {

std::optional<ExpertParallel> expert_parallel_of(const Config& cfg, const RunPlan& plan, const Topology& topo) {
  if (topo.sizes.ep <= 1) return std::nullopt;
  ExpertParallel ep = make_expert_parallel(*topo.ep_comm, cfg.moe.num_experts);
  ep.rowwise = cfg.parallel.ep_backend == "rowwise";
  ep.capacity_factor = cfg.parallel.ep_capacity_factor;
  return ep;
}

std::vector<TensorRef> tensor_refs(const ParamLayout& layout, const float* base, const std::string& suffix) {
  std::vector<TensorRef> refs;
  for (const ParamEntry& e : layout.entries()) refs.push_back({e.name + suffix, DType::kF32, e.shape, base + e.offset});
  return refs;
}

// train_state.json of a checkpoint (docs/checkpoints.md).
nlohmann::json train_state_json(const Config& cfg, int64_t done, const DataLoader& loader, int64_t optimizer_steps) {
  nlohmann::json st = {{"step", done},
                       {"data_position", loader.position()},
                       {"optimizer_steps", optimizer_steps},
                       {"rng", {{"kind", "counter-based"}, {"seed", cfg.train.seed}, {"step", done}}},
                       {"config", config_to_toml(cfg)}};
  if (loader.num_sources() > 1) {
    nlohmann::json sources = nlohmann::json::array();
    for (int64_t s = 0; s < loader.num_sources(); ++s)
      sources.push_back({{"draws", loader.source_draws()[size_t(s)]},
                         {"weight", loader.source(s).weight},
                         {"tokens", loader.source(s).source.num_tokens()},
                         {"instances", loader.source_instances(s)}});
    st["data_mix"] = {{"seq_len", loader.seq_len()}, {"global_batch", loader.global_batch()}, {"sources", sources}};
  }
  return st;
}

// The checkpoint's mix against the loader's: every difference named, or the draws to resume from.
std::vector<int64_t> resume_mix(const LoadedCheckpoint& ck, const DataLoader& loader) {
  const std::string file = (fs::path(ck.dir()) / "train_state.json").string();
  const nlohmann::json& st = ck.train_state();
  const int64_t now = loader.num_sources();
  if (!st.contains("data_mix")) {
    MOE_CHECK(now == 1, "the checkpoint '", ck.dir(), "' was trained on one data source (data.paths), but this run ",
              "mixes ", now, " data.sources; resume with the checkpoint's data.paths, or start a new run (another ",
              "--run.dir)");
    return {};
  }
  std::vector<std::string> diffs;
  const nlohmann::json& mix = st["data_mix"];
  MOE_CHECK(mix.is_object() && mix.contains("sources") && mix["sources"].is_array(), "'", file,
            "': 'data_mix' must be an object with a 'sources' array");
  const nlohmann::json& saved = mix["sources"];
  auto num = [&](const nlohmann::json& o, const char* key, size_t i) {
    MOE_CHECK(o.is_object() && o.contains(key) && o[key].is_number(), "'", file, "': data_mix.sources[", i, "].", key,
              " must be a number");
    return o[key];
  };
  if (int64_t(saved.size()) != now) {
    diffs.push_back("the checkpoint mixes " + std::to_string(saved.size()) + " data.sources, this run " +
                    (now == 1 ? std::string("has one source") : std::to_string(now)));
  } else {
    for (size_t i = 0; i < saved.size(); ++i) {
      const double w = num(saved[i], "weight", i).get<double>();
      if (w != loader.source(int64_t(i)).weight)
        diffs.push_back(detail::concat("data.sources[", i, "].weight is ", w, " in the checkpoint, ",
                                       loader.source(int64_t(i)).weight, " in this run"));
      const int64_t t = num(saved[i], "tokens", i).get<int64_t>();
      if (t != loader.source(int64_t(i)).source.num_tokens())
        diffs.push_back(detail::concat("data.sources[", i, "] holds ", t, " tokens in the checkpoint's run, ",
                                       loader.source(int64_t(i)).source.num_tokens(), " in this one (other paths?)"));
    }
  }
  if (mix.contains("seq_len") && mix["seq_len"] != loader.seq_len())
    diffs.push_back(detail::concat("train.seq_len is ", mix["seq_len"].dump(), " in the checkpoint, ", loader.seq_len(),
                                   " in this run (other instances)"));
  if (mix.contains("global_batch") && mix["global_batch"] != loader.global_batch())
    diffs.push_back(detail::concat("train.global_batch is ", mix["global_batch"].dump(), " in the checkpoint, ",
                                   loader.global_batch(), " in this run"));
  if (!diffs.empty()) {
    std::string msg;
    for (const std::string& d : diffs) msg += "\n  " + d;
    MOE_FAIL("cannot resume '", ck.dir(), "' with another data mix:", msg,
             "\nresume with the checkpoint's data.sources, or start a new run (another --run.dir)");
  }
  std::vector<int64_t> draws;
  for (size_t i = 0; i < saved.size(); ++i) draws.push_back(num(saved[i], "draws", i).get<int64_t>());
  return draws;
}

// The one-rank checkpoint: global FP32 parameters (and expert biases) and both AdamW moments.
CheckpointFiles replicated_files(HostState& s, nlohmann::json train_state) {
  CheckpointFiles files;
  files.model = model_state_refs(s.model);
  files.optim = tensor_refs(s.model.layout(), s.opt.exp_avg().data(), ".exp_avg");
  auto avg_sq = tensor_refs(s.model.layout(), s.opt.exp_avg_sq().data(), ".exp_avg_sq");
  files.optim.insert(files.optim.end(), avg_sq.begin(), avg_sq.end());
  files.train_state = std::move(train_state);
  return files;
}

// This rank's checkpoint slices: the ranges its shard plans own (parameters and moments, the
// moments from the ZeRO shards or from the replicated AdamW), plus the expert biases on rank 0.
SlicedCheckpointFiles sliced_files(HostState& s, const Topology& topo) {
  SlicedCheckpointFiles f;
  Model<float>& model = s.model;
  const ParamLayout& layout = model.layout();
  for (size_t gi = 0; gi < s.owned.size(); ++gi) {
    for (const ShardPiece& p : s.owned[gi].plan.my_pieces()) {
      const ParamEntry& e = layout.at(p.entry);
      const GlobalPlacement& g = model.placements()[size_t(p.entry)];
      const int64_t at = g.offset + p.entry_offset;
      const float* m = s.zero ? s.zero->groups()[gi].m.data() + p.shard_offset
                              : s.opt.exp_avg().data() + e.offset + p.entry_offset;
      const float* v = s.zero ? s.zero->groups()[gi].v.data() + p.shard_offset
                              : s.opt.exp_avg_sq().data() + e.offset + p.entry_offset;
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

// The tensors of this rank's pipeline stage (every tensor without pipeline parallelism).
LayoutPart stage_part(const ModelConfig& m, const Topology& topo) {
  LayoutPart part;
  if (topo.sizes.pp <= 1) return part;
  part.layers.assign(size_t(m.n_layers), 0);
  for (int64_t l = 0; l < m.n_layers; ++l) part.layers[size_t(l)] = topo.stage.holds_layer(l) ? 1 : 0;
  part.embed = topo.stage.embed;
  part.head = topo.stage.head;
  return part;
}

}  // namespace

HostState::HostState(const Config& cfg, const RunPlan& plan, const Topology& topo, bool init)
    : ep(expert_parallel_of(cfg, plan, topo)),
      model(cfg.model, cfg.moe, ep ? &*ep : nullptr, stage_part(cfg.model, topo)),
      opt(model.layout(), cfg.optim) {
  if (init) model.init_params(cfg.train.seed);
  initialised = init;
  // The GPU step keeps the gradients on the device: the host mirror holds weights and moments.
  if (plan.device == "cuda") model.release_grads();
  // Gradients of dense tensors are summed over dp, of expert tensors over ep-dp (with ep = 1: also
  // dp); ZeRO-1 shards them over the same groups.
  // A pipeline stage owns its tensors (one dp rank) or its shard of them (checkpoint slices, norms).
  if (plan.sizes.dp > 1 || plan.sizes.pp > 1) {
    Comm* expert_comm = plan.sizes.ep > 1 ? topo.ep_dp_comm.get() : nullptr;
    owned = make_shard_groups(model.layout(), *topo.dp_comm, expert_comm);
    // The GPU step shards on the device and downloads whole moments: its mirror stays replicated.
    if (plan.zero && plan.device == "cpu" && plan.sizes.dp > 1) {
      zero = std::make_unique<DistOptimizer>(model.layout(), cfg.optim, *topo.dp_comm, expert_comm);
      // ZeRO-1 keeps the moments only for this rank's shards: release the replicated ones.
      std::vector<float>().swap(opt.exp_avg());
      std::vector<float>().swap(opt.exp_avg_sq());
    }
  }
}

int64_t resume_run(const Config& cfg, HostState& s, DataLoader& loader, std::ostream& out) {
  if (cfg.checkpoint.resume == "none") return 0;
  const std::string target = cfg.checkpoint.resume == "auto" ? checkpoint_dir(cfg) : cfg.checkpoint.resume;
  const std::optional<std::string> step_dir = resolve_checkpoint(target);
  MOE_CHECK(step_dir || cfg.checkpoint.resume == "auto", "checkpoint.resume: no complete checkpoint found at '", target,
            "'");
  if (!step_dir) return 0;
  LoadedCheckpoint ck = LoadedCheckpoint::open(*step_dir);
  const TrainState st = read_train_state(ck);  // typed and range-checked
  check_resume_config(ck, cfg);                // every model.* and moe.* key as the checkpoint's
  load_model_state(ck, s.model);
  s.initialised = true;
  const int64_t start = st.step;
  const ParamLayout& layout = s.model.layout();
  if (ck.has_optim()) {
    // Moments of any layout: the ranges this rank keeps (its ZeRO shards, or every tensor).
    auto read = [&](const ParamEntry& e, const GlobalPlacement& gp, int64_t entry_offset, int64_t numel, float* m,
                    float* v) {
      ck.read_optim_range(e.name + ".exp_avg", gp.global_shape, gp.offset + entry_offset, numel, m);
      ck.read_optim_range(e.name + ".exp_avg_sq", gp.global_shape, gp.offset + entry_offset, numel, v);
    };
    if (s.zero) {
      for (DistOptimizer::Group& g : s.zero->groups())
        for (const ShardPiece& p : g.plan.my_pieces())
          read(layout.at(p.entry), s.model.placements()[size_t(p.entry)], p.entry_offset, p.numel,
               g.m.data() + p.shard_offset, g.v.data() + p.shard_offset);
    } else {
      for (size_t i = 0; i < layout.entries().size(); ++i) {
        const ParamEntry& e = layout.entries()[i];
        read(e, s.model.placements()[i], 0, e.numel, s.opt.exp_avg().data() + e.offset,
             s.opt.exp_avg_sq().data() + e.offset);
      }
    }
    s.opt.set_steps_taken(st.optimizer_steps);
    if (s.zero) s.zero->set_steps_taken(s.opt.steps_taken());
  }
  const std::vector<int64_t> draws = resume_mix(ck, loader);
  if (draws.empty())
    loader.set_position(st.data_position);
  else
    loader.set_state(st.data_position, draws);
  out << "resumed from " << *step_dir << " at step " << start << "\n";
  return start;
}

bool writes_replicated_checkpoint(const RunPlan& plan) {
  return plan.sizes.world == 1 || (plan.device == "cuda" && plan.sizes.ep == 1);
}

std::string save_run_checkpoint(const Config& cfg, const RunPlan& plan, const Topology& topo, HostState& s,
                                int64_t done, const DataLoader& loader) {
  Comm& world = *topo.world;
  const std::string dir = checkpoint_dir(cfg);
  nlohmann::json train_state = train_state_json(cfg, done, loader, s.opt.steps_taken());
  if (!writes_replicated_checkpoint(plan)) {
    SlicedCheckpointFiles sliced = sliced_files(s, topo);
    sliced.train_state = std::move(train_state);
    return save_checkpoint_sliced(world, dir, done, sliced, cfg.checkpoint.keep_last);
  }
  if (world.size() == 1) return save_checkpoint(dir, done, replicated_files(s, std::move(train_state)), cfg.checkpoint.keep_last);
  // Replicated state on several ranks: rank 0 writes the global tensors; the others wait for its
  // verdict, so that a failed save stops every rank with the same error.
  std::string failure, path = (fs::path(dir) / step_dir_name(done)).string();
  if (world.rank() == 0) {
    try {
      path = save_checkpoint(dir, done, replicated_files(s, std::move(train_state)), cfg.checkpoint.keep_last);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  int64_t failed = failure.empty() ? 0 : 1;
  world.broadcast(&failed, 1, 0);
  MOE_CHECK(failed == 0, "saving the checkpoint of step ", done, " failed on rank 0",
            failure.empty() ? std::string(" (see its error)") : ": " + failure);
  return path;
}

}  // namespace moe
