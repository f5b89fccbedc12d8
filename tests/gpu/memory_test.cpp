// cuda/ops/memory.h: the FP32 -> BF16 cast and the FP32 residual add with its BF16 copy against
// host arithmetic (bitwise: one FP32 add, round to nearest even), the BF16 -> FP32 cast against
// bf16_to_f32, the BF16 moments' rounding and widening copies, and the byte copies.
#include <cstring>
#include <iterator>

#include "core/dtype.h"
#include "cuda/ops/memory.h"
#include "gpu_test_util.h"

namespace moe::testing {
namespace {

TEST(CudaMemory, CastAndResidualAddMatchHostBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream s;
  // 1000 and 2^20: the 8-wide path; 1 and 1003: the scalar one (n not a multiple of 8).
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{1003}, int64_t{1} << 20}) {
    const std::vector<float> acc0 = random_f32(n, 11, 3.0f);
    const std::vector<uint16_t> add = random_bf16(n, 12, 2.0f);
    GuardedBuffer<float> acc{acc0};
    GuardedBuffer<uint16_t> add_d{add}, acc16{n}, cast16{n};
    cuda::cast_f32_to_bf16(acc.data(), cast16.data(), n, s.get());
    cuda::residual_add(acc.data(), add_d.data(), acc16.data(), n, s.get());
    s.sync();
    const std::vector<uint16_t> cast_got = cast16.download(), acc16_got = acc16.download();
    const std::vector<float> acc_got = acc.download();
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float want = acc0[i] + moe::bf16_to_f32(add[i]);
      bad += cast_got[i] != moe::f32_to_bf16(acc0[i]);
      bad += std::memcmp(&acc_got[i], &want, sizeof(float)) != 0;
      bad += acc16_got[i] != moe::f32_to_bf16(want);
    }
    EXPECT_EQ(bad, 0) << "n=" << n;
    acc.expect_guards_intact("acc");
    acc16.expect_guards_intact("acc_bf16");
    cast16.expect_guards_intact("cast");
  }
}

// The residual add without its BF16 copy, and on pointers one element past 16-byte alignment
// (the scalar path for a multiple-of-8 length): the same FP32 sums.
TEST(CudaMemory, ResidualAddWithoutCopyAndUnalignedMatchesHostBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream s;
  const int64_t n = 4096;
  const std::vector<float> acc0 = random_f32(n + 1, 21, 3.0f);
  const std::vector<uint16_t> add = random_bf16(n + 1, 22, 2.0f);
  for (int64_t shift : {int64_t{0}, int64_t{1}}) {
    GuardedBuffer<float> acc{acc0};
    GuardedBuffer<uint16_t> add_d{add}, acc16{n + 1};
    uint16_t* copy = shift == 0 ? nullptr : acc16.data() + shift;
    cuda::residual_add(acc.data() + shift, add_d.data() + shift, copy, n, s.get());
    s.sync();
    const std::vector<float> got = acc.download();
    const std::vector<uint16_t> got16 = acc16.download();
    int64_t bad = 0;
    for (int64_t i = 0; i < n + 1; ++i) {
      const bool in = i >= shift && i < shift + n;
      const float want = in ? acc0[size_t(i)] + moe::bf16_to_f32(add[size_t(i)]) : acc0[size_t(i)];
      bad += std::memcmp(&got[size_t(i)], &want, sizeof(float)) != 0;
      if (copy != nullptr && in) bad += got16[size_t(i)] != moe::f32_to_bf16(want);
    }
    EXPECT_EQ(bad, 0) << "shift " << shift;
    acc.expect_guards_intact("acc");
    acc16.expect_guards_intact("acc_bf16");
  }
}

// BF16 -> FP32 (the BF16 gradient reduction's way back) against bf16_to_f32: exact, every code
// (the 65536 patterns, NaNs included, compared as bits) and a large random buffer.
TEST(CudaMemory, CastBf16ToF32MatchesHostBitwise) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream s;
  std::vector<uint16_t> every(65536);
  for (size_t i = 0; i < every.size(); ++i) every[i] = uint16_t(i);
  for (const std::vector<uint16_t>& src : {every, random_bf16((int64_t{1} << 20) + 3, 13, 5.0f)}) {
    const int64_t n = int64_t(src.size());
    GuardedBuffer<uint16_t> in{src};
    GuardedBuffer<float> out{n};
    cuda::cast_bf16_to_f32(in.data(), out.data(), n, s.get());
    s.sync();
    const std::vector<float> got = out.download();
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float want = moe::bf16_to_f32(src[size_t(i)]);
      bad += std::memcmp(&got[size_t(i)], &want, sizeof(float)) != 0;
    }
    EXPECT_EQ(bad, 0) << "n=" << n;
    out.expect_guards_intact("cast_bf16_to_f32 output");
  }
}

// copy_h2d_f32_as_bf16 / copy_d2h_bf16_as_f32 (the BF16 AdamW moments' load and download): across
// their 4 Mi-element staging chunks, the device holds f32_to_bf16 of every host value (NaN, Inf,
// subnormals and the rounding ties included) and the host gets bf16_to_f32 of every device value.
TEST(CudaMemory, Bf16MomentCopiesRoundAndWidenLikeTheHost) {
  MOE_SKIP_WITHOUT_GPU();
  TestStream s;
  const int64_t n = (int64_t{1} << 23) + 5;  // two full chunks and a partial one
  std::vector<float> host = random_f32(n, 17, 3.0f);
  const uint32_t specials[] = {0x7fc00000u, 0xff800000u, 0x7f800000u, 0x00000001u, 0x80008000u, 0x3f808000u,
                               0x3f818000u, 0x7f7fffffu};
  for (size_t i = 0; i < std::size(specials); ++i) std::memcpy(&host[size_t(i) * 1000003], &specials[i], 4);
  GuardedBuffer<uint16_t> dev{n};
  cuda::copy_h2d_f32_as_bf16(dev.data(), host.data(), n, s.get());
  s.sync();
  const std::vector<uint16_t> bits = dev.download();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += bits[size_t(i)] != moe::f32_to_bf16(host[size_t(i)]);
  EXPECT_EQ(bad, 0) << "values not rounded as f32_to_bf16 rounds them";
  std::vector<float> back(size_t(n), -1.0f);
  cuda::copy_d2h_bf16_as_f32(back.data(), dev.data(), n, s.get());
  bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float want = moe::bf16_to_f32(bits[size_t(i)]);
    bad += std::memcmp(&back[size_t(i)], &want, sizeof(float)) != 0;
  }
  EXPECT_EQ(bad, 0) << "values not widened as bf16_to_f32 widens them";
  dev.expect_guards_intact("BF16 moments");
  cuda::copy_h2d_f32_as_bf16(dev.data(), host.data(), 0, s.get());  // nothing to copy
  EXPECT_THROW(cuda::copy_d2h_bf16_as_f32(back.data(), dev.data(), -1, s.get()), Error);
}

TEST(CudaMemory, CopiesMemsetAndBufferGrowth) {
  MOE_SKIP_WITHOUT_GPU();
  cuda::Stream st = cuda::stream_create();
  cuda::DeviceBuffer a(64), b;
  EXPECT_EQ(b.data(), nullptr);
  b.reserve(128);
  EXPECT_GE(b.bytes(), 128u);
  std::vector<int32_t> host(16), back(16, -1);
  for (int i = 0; i < 16; ++i) host[i] = i * 7 - 3;
  cuda::copy_h2d(a.data(), host.data(), 64, st);
  cuda::copy_d2d(b.data(), a.data(), 64, st);
  cuda::copy_d2h(back.data(), b.data(), 64, st);
  EXPECT_EQ(back, host);
  cuda::device_memset(b.data(), 0, 64, st);
  cuda::copy_d2h(back.data(), b.data(), 64, st);
  EXPECT_EQ(back, std::vector<int32_t>(16, 0));
  cuda::DeviceBuffer c(std::move(a));
  EXPECT_EQ(a.data(), nullptr);
  cuda::copy_d2h(back.data(), c.data(), 64, st);
  EXPECT_EQ(back, host);
  cuda::stream_sync(st);
  cuda::stream_destroy(st);
}

}  // namespace
}  // namespace moe::testing
