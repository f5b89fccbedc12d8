// Element types and scalar conversions. Float conversions round to nearest, ties to even;
// fp8 e4m3 (OCP "fn": no inf, max 448) and e5m2 (IEEE-like, has inf) saturate to the
// largest finite value when `saturate` is true, else overflow gives NaN (e4m3) / inf (e5m2).
// e8m0 is an unsigned power-of-two exponent (bias 127, 0xFF = NaN) used for MX block scales.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace moe {

enum class DType : uint8_t { kF32, kF64, kBF16, kF8E4M3, kF8E5M2, kE8M0, kI32, kI64, kU16, kU32 };

// Bytes per element.
int64_t dtype_size(DType t);
// Short lowercase name ("f32", "bf16", "fp8_e4m3", ...).
std::string_view dtype_name(DType t);
// safetensors name ("F32", "BF16", "F8_E4M3", "F8_E8M0", "U16", ...).
std::string_view dtype_safetensors_name(DType t);
// Parses either kind of name; throws moe::Error naming the value and the accepted names.
DType parse_dtype(std::string_view name);

// Scalar conversions (host). Bit patterns travel as unsigned integers.
uint16_t f32_to_bf16(float x);
float bf16_to_f32(uint16_t b);
uint8_t f32_to_fp8_e4m3(float x, bool saturate = true);
float fp8_e4m3_to_f32(uint8_t b);
uint8_t f32_to_fp8_e5m2(float x, bool saturate = true);
float fp8_e5m2_to_f32(uint8_t b);
// e8m0: the exponent of a power of two; f32_to_e8m0 rounds the exponent up (the smallest
// power of two >= |x|), as used to pick a block scale that never overflows.
uint8_t f32_to_e8m0(float x);
float e8m0_to_f32(uint8_t b);

// Bulk conversions between f32 and a storage dtype (bf16, fp8, f32); `src`/`dst` are raw bytes.
void convert_from_f32(const float* src, void* dst, DType dst_type, int64_t n);
void convert_to_f32(const void* src, DType src_type, float* dst, int64_t n);

}  // namespace moe
