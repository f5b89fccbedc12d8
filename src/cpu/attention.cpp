// Causal GQA attention on CPU, one (batch, kv head) pair per work item. Query rows go in
// tiles of kQueryTile; tile [r0, r1) only scores keys [0, r1), through cpu::gemm (OpenBLAS
// for float, plain loops for double). Forward: P = softmax(scale q k^T) (masked), out = P v.
// Backward per tile: P = exp(scale q k^T - lse) (masked), dP = dout v^T,
// dS = scale P (dP - D), D_i = dout_i . out_i; dq = dS k, dk += dS^T q, dv += P^T dout.
#include "cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "core/error.h"
#include "cpu/linear.h"

namespace moe::cpu {
namespace {

constexpr int64_t kQueryTile = 64;
constexpr int64_t kMaxThreads = 16;
constexpr int64_t kMinWorkPerThread = int64_t{1} << 18;  // q.k multiply-adds; below it, one thread

struct AttentionShape {
  int64_t batch, seq, q_heads, kv_heads, head_dim;
  int64_t group() const { return q_heads / kv_heads; }
  int64_t q_stride() const { return q_heads * head_dim; }  // between positions of q / out
  int64_t kv_stride() const { return kv_heads * head_dim; }
};

void check_shape(const char* op, const AttentionShape& s) {
  MOE_CHECK(s.batch >= 0 && s.seq >= 0, op, ": expected batch >= 0 and seq >= 0, got batch=",
            s.batch, " seq=", s.seq);
  MOE_CHECK(s.head_dim > 0, op, ": expected head_dim > 0, got ", s.head_dim);
  MOE_CHECK(s.kv_heads > 0 && s.q_heads > 0 && s.q_heads % s.kv_heads == 0, op,
            ": q_heads must be a positive multiple of kv_heads, got q_heads=", s.q_heads,
            " kv_heads=", s.kv_heads);
}

// Runs fn(b, kv_head) for every pair, spread over threads with a fixed assignment. Every
// output element belongs to exactly one pair and each pair runs the same code on any thread,
// so results do not depend on the thread count.
template <typename Fn>
void for_each_batch_kv_head(const AttentionShape& s, Fn fn) {
  const int64_t items = s.batch * s.kv_heads;
  const int64_t work = items * s.group() * s.seq * s.seq * s.head_dim;
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t threads =
      std::clamp<int64_t>(work / kMinWorkPerThread, 1, std::max<int64_t>(1, std::min({items, hw, kMaxThreads})));
  auto run = [&](int64_t t) {
    for (int64_t it = t; it < items; it += threads) fn(it / s.kv_heads, it % s.kv_heads);
  };
  if (threads <= 1) {
    run(0);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(run, t);
  run(0);
  for (auto& th : pool) th.join();
}

}  // namespace

template <typename T>
void attention_forward(const T* q, const T* k, const T* v, T* out, T* lse, int64_t batch,
                       int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim) {
  const AttentionShape s{batch, seq, q_heads, kv_heads, head_dim};
  check_shape("attention_forward", s);
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  const int64_t qs = s.q_stride(), kvs = s.kv_stride();
  const int64_t tile = std::min(seq, kQueryTile);

  for_each_batch_kv_head(s, [&](int64_t b, int64_t kvh) {
    std::vector<T> p(static_cast<size_t>(tile * seq));  // [rows, keys] of one tile
    const T* kh = k + b * seq * kvs + kvh * head_dim;
    const T* vh = v + b * seq * kvs + kvh * head_dim;
    for (int64_t h = kvh * s.group(); h < (kvh + 1) * s.group(); ++h) {
      const T* qh = q + b * seq * qs + h * head_dim;
      T* oh = out + b * seq * qs + h * head_dim;
      T* lh = lse + (b * q_heads + h) * seq;
      for (int64_t r0 = 0; r0 < seq; r0 += kQueryTile) {
        const int64_t r1 = std::min(seq, r0 + kQueryTile), rows = r1 - r0, keys = r1;
        gemm<T>(false, true, rows, keys, head_dim, scale, qh + r0 * qs, qs, kh, kvs, T(0), p.data(),
                keys);
        for (int64_t r = 0; r < rows; ++r) {
          T* pr = p.data() + r * keys;
          const int64_t visible = r0 + r + 1;  // query i sees keys 0..i
          const T m = *std::max_element(pr, pr + visible);
          double sum = 0.0;
          for (int64_t j = 0; j < visible; ++j) {
            pr[j] = std::exp(pr[j] - m);
            sum += static_cast<double>(pr[j]);
          }
          const T inv = static_cast<T>(1.0 / sum);
          for (int64_t j = 0; j < visible; ++j) pr[j] *= inv;
          std::fill(pr + visible, pr + keys, T(0));
          lh[r0 + r] = static_cast<T>(static_cast<double>(m) + std::log(sum));
        }
        gemm<T>(false, false, rows, head_dim, keys, T(1), p.data(), keys, vh, kvs, T(0),
                oh + r0 * qs, qs);
      }
    }
  });
}

template <typename T>
void attention_decode(const T* q, const T* k, const T* v, T* out, int64_t n, int64_t pos0, int64_t q_heads,
                      int64_t kv_heads, int64_t head_dim) {
  MOE_CHECK(n >= 0 && pos0 >= 0 && head_dim > 0 && kv_heads > 0 && q_heads % kv_heads == 0, "attention_decode: ",
            "expected n >= 0, pos0 >= 0, head_dim > 0 and kv_heads dividing q_heads, got n=", n, " pos0=", pos0,
            " q_heads=", q_heads, " kv_heads=", kv_heads, " head_dim=", head_dim);
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  const int64_t qs = q_heads * head_dim, kvs = kv_heads * head_dim, group = q_heads / kv_heads;
  std::vector<T> p(static_cast<size_t>(pos0 + n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t visible = pos0 + i + 1;
    for (int64_t h = 0; h < q_heads; ++h) {
      const T* qh = q + i * qs + h * head_dim;
      const T* kh = k + (h / group) * head_dim;
      const T* vh = v + (h / group) * head_dim;
      for (int64_t j = 0; j < visible; ++j) {
        T dot = T(0);
        for (int64_t e = 0; e < head_dim; ++e) dot += qh[e] * kh[j * kvs + e];
        p[j] = scale * dot;
      }
      const T m = *std::max_element(p.begin(), p.begin() + visible);
      double sum = 0.0;
      for (int64_t j = 0; j < visible; ++j) {
        p[j] = std::exp(p[j] - m);
        sum += static_cast<double>(p[j]);
      }
      const T inv = static_cast<T>(1.0 / sum);
      T* oh = out + i * qs + h * head_dim;
      std::fill(oh, oh + head_dim, T(0));
      for (int64_t j = 0; j < visible; ++j) {
        const T pj = p[j] * inv;
        for (int64_t e = 0; e < head_dim; ++e) oh[e] += pj * vh[j * kvs + e];
      }
    }
  }
}

template <typename T>
void attention_backward(const T* q, const T* k, const T* v, const T* out, const T* lse,
                        const T* dout, T* dq, T* dk, T* dv, int64_t batch, int64_t seq,
                        int64_t q_heads, int64_t kv_heads, int64_t head_dim) {
  const AttentionShape s{batch, seq, q_heads, kv_heads, head_dim};
  check_shape("attention_backward", s);
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  const int64_t qs = s.q_stride(), kvs = s.kv_stride();
  const int64_t tile = std::min(seq, kQueryTile);

  for_each_batch_kv_head(s, [&](int64_t b, int64_t kvh) {
    std::vector<T> p(static_cast<size_t>(tile * seq)), ds(static_cast<size_t>(tile * seq));
    const T* kh = k + b * seq * kvs + kvh * head_dim;
    const T* vh = v + b * seq * kvs + kvh * head_dim;
    T* dkh = dk + b * seq * kvs + kvh * head_dim;
    T* dvh = dv + b * seq * kvs + kvh * head_dim;
    for (int64_t j = 0; j < seq; ++j) {
      std::fill(dkh + j * kvs, dkh + j * kvs + head_dim, T(0));
      std::fill(dvh + j * kvs, dvh + j * kvs + head_dim, T(0));
    }
    for (int64_t h = kvh * s.group(); h < (kvh + 1) * s.group(); ++h) {
      const T* qh = q + b * seq * qs + h * head_dim;
      const T* oh = out + b * seq * qs + h * head_dim;
      const T* doh = dout + b * seq * qs + h * head_dim;
      const T* lh = lse + (b * q_heads + h) * seq;
      T* dqh = dq + b * seq * qs + h * head_dim;
      for (int64_t r0 = 0; r0 < seq; r0 += kQueryTile) {
        const int64_t r1 = std::min(seq, r0 + kQueryTile), rows = r1 - r0, keys = r1;
        gemm<T>(false, true, rows, keys, head_dim, scale, qh + r0 * qs, qs, kh, kvs, T(0), p.data(),
                keys);
        gemm<T>(false, true, rows, keys, head_dim, T(1), doh + r0 * qs, qs, vh, kvs, T(0),
                ds.data(), keys);  // dP
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = r0 + r, visible = i + 1;
          T* pr = p.data() + r * keys;
          T* dsr = ds.data() + r * keys;
          double di = 0.0;  // D_i = dout_i . out_i (= sum_j P_ij dP_ij)
          for (int64_t c = 0; c < head_dim; ++c)
            di += static_cast<double>(doh[i * qs + c]) * static_cast<double>(oh[i * qs + c]);
          const T d = static_cast<T>(di), l = lh[i];
          for (int64_t j = 0; j < visible; ++j) {
            pr[j] = std::exp(pr[j] - l);
            dsr[j] = scale * pr[j] * (dsr[j] - d);
          }
          std::fill(pr + visible, pr + keys, T(0));
          std::fill(dsr + visible, dsr + keys, T(0));
        }
        gemm<T>(true, false, keys, head_dim, rows, T(1), p.data(), keys, doh + r0 * qs, qs, T(1),
                dvh, kvs);
        gemm<T>(false, false, rows, head_dim, keys, T(1), ds.data(), keys, kh, kvs, T(0),
                dqh + r0 * qs, qs);
        gemm<T>(true, false, keys, head_dim, rows, T(1), ds.data(), keys, qh + r0 * qs, qs, T(1),
                dkh, kvs);
      }
    }
  });
}

template void attention_forward<float>(const float*, const float*, const float*, float*, float*, int64_t,
                                       int64_t, int64_t, int64_t, int64_t);
template void attention_forward<double>(const double*, const double*, const double*, double*, double*,
                                        int64_t, int64_t, int64_t, int64_t, int64_t);
template void attention_decode<float>(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t,
                                      int64_t, int64_t);
template void attention_decode<double>(const double*, const double*, const double*, double*, int64_t, int64_t,
                                       int64_t, int64_t, int64_t);
template void attention_backward<float>(const float*, const float*, const float*, const float*,
                                        const float*, const float*, float*, float*, float*, int64_t,
                                        int64_t, int64_t, int64_t, int64_t);
template void attention_backward<double>(const double*, const double*, const double*, const double*,
                                         const double*, const double*, double*, double*, double*,
                                         int64_t, int64_t, int64_t, int64_t, int64_t);

}  // namespace moe::cpu
