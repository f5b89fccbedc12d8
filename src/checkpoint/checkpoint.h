// Checkpoint directory store. CKPT_DIR/step_<N>/ holds model.safetensors (parameters),
// optim.safetensors (AdamW moments "<param>.exp_avg" / "<param>.exp_avg_sq"), both global FP32,
// train_state.json and manifest.json (byte size and SHA-256 per file, written last).
// CKPT_DIR/latest holds "step_<N>\n". A step directory appears only by an atomic rename of a
// fully written and fsynced temporary directory; one process writes a CKPT_DIR at a time.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"

namespace moe {

inline constexpr const char* kCheckpointFormat = "moecore-checkpoint";
inline constexpr int kCheckpointVersion = 1;

struct CheckpointFiles {
  std::vector<TensorRef> model;
  std::vector<TensorRef> optim;  // empty: no optim.safetensors is written
  nlohmann::json train_state;    // an object (or null); "step" is added, or must equal the step
};

// "step_<N>" (no zero padding).
std::string step_dir_name(int64_t step);

// Writes CKPT_DIR/step_<N> atomically (temporary directory, fsyncs, manifest last, rename,
// replacing an existing step_<N>), then points CKPT_DIR/latest at it, then prunes so that the
// new step plus the keep_last - 1 highest other complete steps remain (keep_last <= 0: keep
// all). Leftover ".tmp-*" entries from interrupted saves are removed first. Returns the path.
std::string save_checkpoint(const std::string& ckpt_dir, int64_t step, const CheckpointFiles& files,
                            int64_t keep_last);

// Steps of CKPT_DIR with a complete step directory (one holding manifest.json), ascending.
// A missing CKPT_DIR gives an empty list.
std::vector<int64_t> list_steps(const std::string& ckpt_dir);

// Resolves a resume target to a step directory. A directory holding manifest.json is itself
// the answer; otherwise it is read as a CKPT_DIR: the step named by its `latest`, or without
// `latest` its highest complete step. Nothing there (or no such path) -> nullopt. Throws when
// `latest` is malformed or names a step that is not complete.
std::optional<std::string> resolve_checkpoint(const std::string& ckpt_dir_or_path);

class LoadedCheckpoint {
 public:
  // Reads manifest.json and verifies it: format and version, every listed file present with
  // the listed size and SHA-256 (errors name the file, expected and actual). Then opens the
  // safetensors files and parses train_state.json.
  static LoadedCheckpoint open(const std::string& step_dir);

  const std::string& dir() const { return dir_; }
  int64_t step() const { return step_; }
  const nlohmann::json& train_state() const { return train_state_; }
  const SafetensorsFile& model() const { return model_; }
  bool has_optim() const { return optim_.has_value(); }
  const SafetensorsFile& optim() const;  // throws when the checkpoint has no optimizer state

  // Copies a tensor, converted to f32, into `out` after checking that it exists and its shape
  // equals `shape` (errors name the tensor, both shapes and the file).
  void read_model(const std::string& name, const Shape& shape, float* out) const;
  void read_optim(const std::string& name, const Shape& shape, float* out) const;

 private:
  LoadedCheckpoint(std::string dir, int64_t step, nlohmann::json train_state, SafetensorsFile model,
                   std::optional<SafetensorsFile> optim)
      : dir_(std::move(dir)), step_(step), train_state_(std::move(train_state)), model_(std::move(model)),
        optim_(std::move(optim)) {}

  std::string dir_;
  int64_t step_ = 0;
  nlohmann::json train_state_;
  SafetensorsFile model_;
  std::optional<SafetensorsFile> optim_;
};

}  // namespace moe
