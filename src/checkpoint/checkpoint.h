// Checkpoint directory store. CKPT_DIR/step_<N>/ holds model.safetensors (parameters),
// optim.safetensors (AdamW moments "<param>.exp_avg" / "<param>.exp_avg_sq"), both global FP32,
// train_state.json and manifest.json (byte size and SHA-256 per file, written last).
// A multi-rank run writes a sliced step instead (manifest version 2): each rank writes the flat
// ranges of global tensors it owns to model-<r>-of-<W> / optim-<r>-of-<W>.safetensors and the
// manifest maps every global tensor to its slices (file, flat offset, numel); readers reassemble
// any range, so a run resumes on any layout. CKPT_DIR/latest holds "step_<N>\n". A step
// directory appears only by an atomic rename of a fully written and fsynced temporary directory
// (after every rank has finished its files); one job writes a CKPT_DIR at a time.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "core/config.h"

namespace moe {

inline constexpr const char* kCheckpointFormat = "moecore-checkpoint";
inline constexpr int kCheckpointVersion = 1;        // one model.safetensors + optim.safetensors
inline constexpr int kSlicedCheckpointVersion = 2;  // slices written by several ranks

class Comm;

struct CheckpointFiles {
  std::vector<TensorRef> model;
  std::vector<TensorRef> optim;  // empty: no optim.safetensors is written
  nlohmann::json train_state;    // an object (or null); "step" is added, or must equal the step
};

// A flat range of a global FP32 tensor held by this rank: elements [offset, offset + numel) of
// the row-major tensor `name` of shape global_shape, at `data`.
struct TensorSlice {
  std::string name;
  Shape global_shape;
  int64_t offset = 0, numel = 0;
  const float* data = nullptr;
};

struct SlicedCheckpointFiles {
  std::vector<TensorSlice> model;  // parameters (and expert biases)
  std::vector<TensorSlice> optim;  // AdamW moments
  nlohmann::json train_state;      // used on rank 0 only
};

// "step_<N>" (no zero padding).
std::string step_dir_name(int64_t step);

// Writes CKPT_DIR/step_<N> atomically (temporary directory, fsyncs, manifest last, rename,
// replacing an existing step_<N>), then points CKPT_DIR/latest at it, then prunes so that the
// new step plus the keep_last - 1 highest other complete steps remain (keep_last <= 0: keep
// all). Leftover ".tmp-*" entries from interrupted saves are removed first. Returns the path.
std::string save_checkpoint(const std::string& ckpt_dir, int64_t step, const CheckpointFiles& files,
                            int64_t keep_last);

// Collective over `comm`: every rank writes its slices into the same temporary step directory
// (a shared filesystem), then rank 0 checks that the slices of all ranks tile every global
// tensor exactly, writes train_state.json and the version-2 manifest, and publishes the step as
// save_checkpoint does. A failure on any rank fails the save on every rank and nothing is
// published. Returns the step directory on every rank.
std::string save_checkpoint_sliced(Comm& comm, const std::string& ckpt_dir, int64_t step,
                                   const SlicedCheckpointFiles& mine, int64_t keep_last);

// Steps of CKPT_DIR with a complete step directory (one holding manifest.json), ascending.
// A missing CKPT_DIR gives an empty list.
std::vector<int64_t> list_steps(const std::string& ckpt_dir);

// Removes what interrupted saves and prunes left in CKPT_DIR (".tmp-*" entries, latest.tmp);
// nothing when the directory does not exist. Every save does it too; a run does it at start.
void remove_stale_temporaries(const std::string& ckpt_dir);

// Resolves a resume target to a step directory. A directory holding manifest.json is itself
// the answer; otherwise it is read as a CKPT_DIR: the step named by its `latest`, or without
// `latest` its highest complete step. Nothing there (or no such path) -> nullopt. Throws when
// `latest` is malformed or names a step that is not complete.
std::optional<std::string> resolve_checkpoint(const std::string& ckpt_dir_or_path);

// A global tensor of a checkpoint (as stored, or reassembled from slices).
struct GlobalTensorInfo {
  std::string name;
  std::string dtype_name;  // stored dtype ("F32" for sliced checkpoints)
  Shape shape;             // global shape
  int64_t bytes = 0;       // stored bytes over all slices
  int num_slices = 1;
};

class LoadedCheckpoint {
 public:
  // Reads manifest.json and verifies it: format and version, every listed file present with
  // the listed size and SHA-256 (errors name the file, expected and actual). Then opens the
  // safetensors files (for a sliced checkpoint: checks that the slices of every tensor tile it
  // exactly) and parses train_state.json.
  static LoadedCheckpoint open(const std::string& step_dir);

  const std::string& dir() const { return dir_; }
  int64_t step() const { return step_; }
  const nlohmann::json& train_state() const { return train_state_; }
  // Ranks that wrote it: 1 for a single-file checkpoint.
  int world_size() const { return world_size_; }
  bool sliced() const { return version_ == kSlicedCheckpointVersion; }
  // The single files of a version-1 checkpoint (throw for a sliced one).
  const SafetensorsFile& model() const;
  bool has_optim() const { return optim_file_ >= 0 || !optim_order_.empty(); }
  const SafetensorsFile& optim() const;  // throws when the checkpoint has no optimizer state
  // Global tensors in stored order (first slice's file order for sliced checkpoints).
  std::vector<GlobalTensorInfo> model_tensors() const;
  std::vector<GlobalTensorInfo> optim_tensors() const;
  bool has_model(const std::string& name) const { return model_index_.count(name) != 0; }
  // Every data file of the step (safetensors), in manifest order.
  std::vector<std::string> data_files() const;

  // Copies a tensor, converted to f32, into `out` after checking that it exists and its shape
  // equals `shape` (errors name the tensor, both shapes and the file).
  void read_model(const std::string& name, const Shape& shape, float* out) const;
  void read_optim(const std::string& name, const Shape& shape, float* out) const;
  // Elements [offset, offset + numel) of the flat global tensor (same checks), from whichever
  // slices hold them.
  void read_model_range(const std::string& name, const Shape& shape, int64_t offset, int64_t numel,
                        float* out) const;
  void read_optim_range(const std::string& name, const Shape& shape, int64_t offset, int64_t numel,
                        float* out) const;

 private:
  struct Slice {
    int file = 0;        // index into files_
    size_t tensor = 0;   // index into files_[file].tensors()
    int64_t offset = 0;  // flat offset in the global tensor
    int64_t numel = 0;
  };
  struct Global {
    GlobalTensorInfo info;
    std::vector<Slice> slices;  // sorted by offset, tiling [0, numel)
  };
  using Index = std::map<std::string, Global>;

  LoadedCheckpoint() = default;
  void read_range(const Index& index, const char* kind, const std::string& name, const Shape& shape,
                  int64_t offset, int64_t numel, float* out) const;
  std::vector<GlobalTensorInfo> list(const Index& index, const std::vector<std::string>& order) const;

  std::string dir_;
  int64_t step_ = 0;
  int version_ = kCheckpointVersion;
  int world_size_ = 1;
  nlohmann::json train_state_;
  std::vector<SafetensorsFile> files_;
  int model_file_ = -1, optim_file_ = -1;  // version 1: indices into files_
  Index model_index_, optim_index_;
  std::vector<std::string> model_order_, optim_order_;
};

// train_state.json of a step, checked field by field (errors name the file and the field):
// step equals the manifest's step and is at most kMaxSteps (core/config_io.h); data_position
// is in [0, kMaxSteps]; optimizer_steps is in [0, step] (skipped steps take none). Absent,
// data_position and optimizer_steps default to step, as the first checkpoints wrote them.
struct TrainState {
  int64_t step = 0;
  int64_t data_position = 0;    // global batches consumed
  int64_t optimizer_steps = 0;  // AdamW steps taken
  std::optional<std::string> config;  // the run's resolved config as TOML text
};
TrainState read_train_state(const LoadedCheckpoint& ck);

// The model and run config stored in the checkpoint's train_state.json (parsed, not
// validated); refused naming the file when absent or not valid.
Config checkpoint_config(const LoadedCheckpoint& ck);

// Throws when `run` would not rebuild the checkpoint's model: every model.* and moe.* key
// whose value differs is listed with both values, and the message says how to proceed.
// model.dense_hidden is compared only where a dense layer uses it.
void check_resume_config(const LoadedCheckpoint& ck, const Config& run);

}  // namespace moe
