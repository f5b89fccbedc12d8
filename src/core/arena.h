// Planned flat buffers: a ParamLayout lists named tensors (HF-style names, global shapes)
// and gives each an offset in one flat buffer, aligned to kAlign elements so that slices
// stay vector- and DMA-friendly. Parameters, gradients and optimizer moments share a layout.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"

namespace moe {

struct ParamEntry {
  std::string name;
  Shape shape;
  int64_t offset = 0;   // in elements
  int64_t numel = 0;
  bool decay = true;    // weight decay applies (false for norms and biases)
  bool expert = false;  // an expert tensor (sharded over expert-parallel ranks later)
};

class ParamLayout {
 public:
  static constexpr int64_t kAlign = 64;

  // Appends a tensor; names are unique.
  int add(const std::string& name, const Shape& shape, bool decay = true, bool expert = false);
  const std::vector<ParamEntry>& entries() const { return entries_; }
  const ParamEntry& at(int index) const { return entries_.at(index); }
  // Throws naming the tensor when absent.
  const ParamEntry& find(const std::string& name) const;
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  int64_t total_numel() const { return total_; }   // including alignment padding
  int64_t param_count() const;                      // sum of numel, no padding

  template <typename T>
  T* ptr(T* base, const std::string& name) const { return base + find(name).offset; }
  template <typename T>
  Tensor view(T* base, const std::string& name) const {
    const ParamEntry& e = find(name);
    return Tensor(base + e.offset, dtype_of<T>(), e.shape);
  }

 private:
  std::vector<ParamEntry> entries_;
  std::unordered_map<std::string, int> index_;
  int64_t total_ = 0;
};

}  // namespace moe
