// Non-owning tensor views: pointer, dtype, device, shape and strides (in elements, row-major
// by default). Views never allocate; storage lives in planned arenas (core/arena.h).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace moe {

enum class Device : uint8_t { kCPU, kCUDA };

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::kF32; }
template <> constexpr DType dtype_of<double>() { return DType::kF64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::kI32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::kI64; }
template <> constexpr DType dtype_of<uint16_t>() { return DType::kU16; }
template <> constexpr DType dtype_of<uint32_t>() { return DType::kU32; }

using Shape = std::vector<int64_t>;

int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);

struct Tensor {
  static constexpr int kMaxDims = 6;

  void* data = nullptr;
  DType dtype = DType::kF32;
  Device device = Device::kCPU;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};

  Tensor() = default;
  Tensor(void* p, DType t, const Shape& s, Device d = Device::kCPU);

  int64_t numel() const;
  int64_t size(int dim) const;
  bool is_contiguous() const;
  Shape dims() const { return Shape(shape.begin(), shape.begin() + ndim); }

  template <typename T>
  T* ptr() const {
    MOE_CHECK(dtype == dtype_of<T>(), "tensor dtype mismatch: expected ", dtype_name(dtype_of<T>()),
              ", got ", dtype_name(dtype));
    return static_cast<T*>(data);
  }
  // A view of rows [begin, end) along dim 0 (contiguous tensors only).
  Tensor slice_rows(int64_t begin, int64_t end) const;
};

}  // namespace moe
