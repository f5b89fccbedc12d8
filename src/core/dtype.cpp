// DType metadata: sizes and names (scalar conversions live in dtype_convert.cpp).
#include "core/dtype.h"

#include "core/error.h"

namespace moe {

namespace {
struct DTypeInfo {
  DType type;
  int64_t size;
  std::string_view name;
  std::string_view st_name;
};
constexpr DTypeInfo kInfo[] = {
    {DType::kF32, 4, "f32", "F32"},          {DType::kF64, 8, "f64", "F64"},
    {DType::kBF16, 2, "bf16", "BF16"},       {DType::kF8E4M3, 1, "fp8_e4m3", "F8_E4M3"},
    {DType::kF8E5M2, 1, "fp8_e5m2", "F8_E5M2"}, {DType::kE8M0, 1, "e8m0", "F8_E8M0"},
    {DType::kI32, 4, "i32", "I32"},          {DType::kI64, 8, "i64", "I64"},
    {DType::kU16, 2, "u16", "U16"},          {DType::kU32, 4, "u32", "U32"},
};
const DTypeInfo& info(DType t) {
  for (const auto& i : kInfo)
    if (i.type == t) return i;
  MOE_FAIL("unknown dtype code ", static_cast<int>(t));
}
}  // namespace

int64_t dtype_size(DType t) { return info(t).size; }
std::string_view dtype_name(DType t) { return info(t).name; }
std::string_view dtype_safetensors_name(DType t) { return info(t).st_name; }

DType parse_dtype(std::string_view name) {
  std::string accepted;
  for (const auto& i : kInfo) {
    if (name == i.name || name == i.st_name) return i.type;
    accepted += (accepted.empty() ? "" : ", ") + std::string(i.name);
  }
  MOE_FAIL("unknown dtype '", name, "': expected one of ", accepted);
}

}  // namespace moe
