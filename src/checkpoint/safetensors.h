// safetensors files: 8-byte little-endian header length N, N bytes of JSON
// {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {str: str}} padded with
// spaces to a multiple of 8, then the data area. Offsets are bytes relative to the data area;
// the tensors, sorted by begin, tile it exactly. Tensors are contiguous, row-major, little-endian.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace moe {

// Largest header accepted on open (the safetensors reference limit).
inline constexpr int64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// A tensor to write: numel(shape) contiguous elements of `dtype` at `data` (null only when empty).
struct TensorRef {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  const void* data = nullptr;
};

// One tensor of an opened file. [begin, end) are byte offsets into the data area.
struct TensorInfo {
  std::string name;
  std::string dtype_name;      // as stored: "F32", "BF16", "F16", "I64", "F8_E4M3", ...
  std::optional<DType> dtype;  // moecore's DType; none for F16, BOOL, U8, I8, I16, U64
  Shape shape;
  int64_t begin = 0;
  int64_t end = 0;

  int64_t numel() const { return shape_numel(shape); }
  int64_t bytes() const { return end - begin; }
};

// Writes `tensors` in the given order (they tile the data area in that order) with a header
// whose "__metadata__" holds `metadata` plus {"format": "pt"}, then fsyncs the file. Names must
// be unique and not "__metadata__". Throws moe::Error naming the path on I/O errors.
void write_safetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                       const std::map<std::string, std::string>& metadata);

// A validated, read-only, memory-mapped safetensors file. Copies share the mapping.
class SafetensorsFile {
 public:
  // Maps and validates the file: header length and JSON, every tensor's dtype, shape and
  // offsets, exact tiling of the data area, unique names. Errors name the file and the field.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  // In data order (ascending begin).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // nullptr when absent.
  const TensorInfo* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  int64_t data_size() const { return data_size_; }
  // The tensor's bytes inside the mapping; may be unaligned (read with memcpy).
  const void* data(const TensorInfo& t) const;

  // Converts a tensor to f32 into `out` (F32, F64, BF16, F16, F8_E4M3, F8_E5M2, F8_E8M0).
  // Throws when the tensor is missing, its element count differs from `expected_numel`, or its
  // dtype is not a floating type.
  void read_f32(const std::string& name, float* out, int64_t expected_numel) const;

 private:
  struct Mapping;

  SafetensorsFile() = default;

  std::string path_;
  std::shared_ptr<const Mapping> mapping_;
  const uint8_t* data_ = nullptr;  // start of the data area
  int64_t data_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// Decoders from stored bit patterns to f32 (exact; NaN and inf preserved).
float f16_bits_to_f32(uint16_t h);
// Converts `n` elements stored as safetensors dtype `dtype_name` at `src` (any alignment) to f32.
void safetensors_to_f32(const void* src, const std::string& dtype_name, float* dst, int64_t n);

}  // namespace moe
