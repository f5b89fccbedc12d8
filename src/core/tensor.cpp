// Tensor view helpers: shape arithmetic, contiguity and row slicing.
#include "core/tensor.h"

#include <sstream>

namespace moe {

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

Tensor::Tensor(void* p, DType t, const Shape& s, Device d) : data(p), dtype(t), device(d) {
  MOE_CHECK(s.size() <= static_cast<size_t>(kMaxDims), "tensor rank ", s.size(), " exceeds ", kMaxDims);
  ndim = static_cast<int>(s.size());
  int64_t stride = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    MOE_CHECK(s[i] >= 0, "negative dimension in shape ", shape_str(s));
    shape[i] = s[i];
    strides[i] = stride;
    stride *= s[i];
  }
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

int64_t Tensor::size(int dim) const {
  MOE_CHECK(dim >= 0 && dim < ndim, "dimension ", dim, " out of range for rank ", ndim);
  return shape[dim];
}

bool Tensor::is_contiguous() const {
  int64_t stride = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != stride) return false;
    stride *= shape[i];
  }
  return true;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  MOE_CHECK(ndim >= 1 && is_contiguous(), "slice_rows needs a contiguous tensor of rank >= 1");
  MOE_CHECK(0 <= begin && begin <= end && end <= shape[0], "row slice [", begin, ", ", end,
            ") out of range for ", shape[0], " rows");
  Tensor t = *this;
  t.data = static_cast<char*>(data) + begin * strides[0] * dtype_size(dtype);
  t.shape[0] = end - begin;
  return t;
}

}  // namespace moe
