// ParamLayout: offsets of named tensors in one flat buffer.
#include "core/arena.h"

namespace moe {

int ParamLayout::add(const std::string& name, const Shape& shape, bool decay, bool expert) {
  MOE_CHECK(!index_.count(name), "duplicate tensor name '", name, "' in parameter layout");
  ParamEntry e;
  e.name = name;
  e.shape = shape;
  e.numel = shape_numel(shape);
  e.offset = total_;
  e.decay = decay;
  e.expert = expert;
  total_ += (e.numel + kAlign - 1) / kAlign * kAlign;
  index_[name] = static_cast<int>(entries_.size());
  entries_.push_back(std::move(e));
  return static_cast<int>(entries_.size()) - 1;
}

const ParamEntry& ParamLayout::find(const std::string& name) const {
  auto it = index_.find(name);
  MOE_CHECK(it != index_.end(), "no tensor named '", name, "' in the parameter layout");
  return entries_[it->second];
}

int64_t ParamLayout::param_count() const {
  int64_t n = 0;
  for (const auto& e : entries_) n += e.numel;
  return n;
}

}  // namespace moe
