// Helpers for the GPU parity suite: skip without a GPU, a test stream, BF16 test data, and
// device buffers with 256 guard bytes on each side (pattern kGuardByte) whose data region starts
// filled with 0xFF bytes (NaN in BF16 and FP32, so an output the op forgot to write fails parity).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "data/dataset.h"
#include "cuda/common.h"

#define MOE_SKIP_WITHOUT_GPU()                                                           \
  do {                                                                                   \
    if (::moe::cuda::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

namespace moe::testing {

constexpr size_t kGuardBytes = 256;
constexpr uint8_t kGuardByte = 0xA7;
constexpr uint8_t kUnwrittenByte = 0xFF;

// A device array of n elements of T between two guard zones. `misalign_bytes` shifts the data
// start off the 256-byte allocation boundary (to reach the scalar fallback paths).
template <typename T>
class GuardedBuffer {
 public:
  explicit GuardedBuffer(int64_t n, size_t misalign_bytes = 0) : n_(n), shift_(misalign_bytes) {
    total_ = kGuardBytes + shift_ + bytes() + kGuardBytes;
    MOE_CUDA_CHECK(cudaMalloc(&base_, total_));
    MOE_CUDA_CHECK(cudaMemset(base_, kGuardByte, total_));
    MOE_CUDA_CHECK(cudaMemset(base_ + kGuardBytes + shift_, kUnwrittenByte, bytes()));
    // cudaMemset is asynchronous and the tests' streams do not wait for the legacy default stream:
    // without this a kernel could run before the fill and have its output overwritten.
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  GuardedBuffer(const std::vector<T>& host, size_t misalign_bytes = 0)
      : GuardedBuffer(static_cast<int64_t>(host.size()), misalign_bytes) {
    upload(host);
  }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;
  ~GuardedBuffer() { cudaFree(base_); }

  T* data() { return reinterpret_cast<T*>(base_ + kGuardBytes + shift_); }
  const T* data() const { return reinterpret_cast<const T*>(base_ + kGuardBytes + shift_); }
  int64_t size() const { return n_; }
  size_t bytes() const { return static_cast<size_t>(n_) * sizeof(T); }

  void upload(const std::vector<T>& host) {
    ASSERT_EQ(static_cast<int64_t>(host.size()), n_);
    MOE_CUDA_CHECK(cudaMemcpy(data(), host.data(), bytes(), cudaMemcpyHostToDevice));
    // From pageable memory cudaMemcpy may return before the DMA into the buffer is done, and the
    // tests' non-blocking streams do not wait for it: a kernel could read the old bytes (seen
    // under a loaded GPU with the suite run in parallel).
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::vector<T> download() const {
    std::vector<T> host(static_cast<size_t>(n_));
    MOE_CUDA_CHECK(cudaMemcpy(host.data(), data(), bytes(), cudaMemcpyDeviceToHost));
    return host;
  }

  // Both guard zones still hold kGuardByte; the failure names the buffer and the first damaged byte.
  void expect_guards_intact(const std::string& what) const {
    std::vector<uint8_t> host(total_);
    MOE_CUDA_CHECK(cudaMemcpy(host.data(), base_, total_, cudaMemcpyDeviceToHost));
    const size_t data_begin = kGuardBytes + shift_, data_end = data_begin + bytes();
    for (size_t i = 0; i < total_; ++i) {
      if (i >= data_begin && i < data_end) continue;
      if (host[i] != kGuardByte) {
        const long long off = i < data_begin ? static_cast<long long>(i) - static_cast<long long>(data_begin)
                                             : static_cast<long long>(i - data_end);
        ADD_FAILURE() << what << ": guard byte " << (i < data_begin ? "before" : "after") << " the data, at offset "
                      << off << ", was overwritten (0x" << std::hex << int{host[i]} << ")";
        return;
      }
    }
  }

 private:
  int64_t n_;
  size_t shift_;
  size_t total_ = 0;
  uint8_t* base_ = nullptr;
};

// A non-default stream, so the ops' stream argument is exercised.
class TestStream {
 public:
  TestStream() { MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~TestStream() { cudaStreamDestroy(s_); }
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
  cudaStream_t get() const { return s_; }
  void sync() const { MOE_CUDA_CHECK(cudaStreamSynchronize(s_)); }

 private:
  cudaStream_t s_ = nullptr;
};

// n draws of N(mean, scale^2), each stored as convert(draw). The first kDrawChunk draws are those
// of one std::mt19937_64(seed) stream; every further chunk c of kDrawChunk draws comes from a
// stream of its own (mix_seed(seed, c), data/dataset.h), so the largest inputs (10^8 - 10^9
// elements, whose draws took much of the suite's time on one core) are drawn by several threads,
// and the values depend on (n, seed) alone, never on the thread count.
constexpr int64_t kDrawChunk = int64_t{1} << 24;

template <typename T, typename Convert>
std::vector<T> normal_draws(int64_t n, uint64_t seed, float mean, float scale, Convert convert) {
  std::vector<T> v(static_cast<size_t>(n));
  const int64_t chunks = (n + kDrawChunk - 1) / kDrawChunk;
  auto draw_chunk = [&](int64_t c) {
    std::mt19937_64 gen(c == 0 ? seed : mix_seed(seed, static_cast<uint64_t>(c)));
    std::normal_distribution<float> dist(mean, scale);
    const int64_t end = std::min(n, (c + 1) * kDrawChunk);
    for (int64_t i = c * kDrawChunk; i < end; ++i) v[static_cast<size_t>(i)] = convert(dist(gen));
  };
  const int64_t workers =
      std::min<int64_t>({chunks, 8, std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()))});
  if (workers <= 1) {
    for (int64_t c = 0; c < chunks; ++c) draw_chunk(c);
    return v;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(workers));
  for (int64_t w = 0; w < workers; ++w) {
    pool.emplace_back([&, w] {
      for (int64_t c = w; c < chunks; c += workers) draw_chunk(c);
    });
  }
  for (auto& t : pool) t.join();
  return v;
}

// n normal values (mean `mean`, std `scale`) rounded to BF16 bit patterns; fixed seed.
inline std::vector<uint16_t> random_bf16(int64_t n, uint64_t seed, float scale = 1.0f, float mean = 0.0f) {
  return normal_draws<uint16_t>(n, seed, mean, scale, [](float x) { return f32_to_bf16(x); });
}

inline std::vector<float> random_f32(int64_t n, uint64_t seed, float scale = 1.0f) {
  return normal_draws<float>(n, seed, 0.0f, scale, [](float x) { return x; });
}

inline std::vector<float> bf16_to_f32(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = moe::bf16_to_f32(b[i]);
  return f;
}

// Test-parameter names such as "n16384_d2048" (streamed: GCC 12 at -O3 warns on literal + string).
template <typename... Parts>
std::string param_name(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

// Same size and the same bytes (BF16 bit patterns, FP8 codes, FP32 scales: NaNs and signed zeros too).
template <typename T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// bitwise_equal as a test expectation that says how many elements differ and the first of them.
template <typename T>
void expect_equal(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " differ, first at " << first;
}

}  // namespace moe::testing
