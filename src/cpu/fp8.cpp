// Block-scaled FP8 quantisation, MX quantisation and the block-scaled FP8 GEMM of fp8.h.
#include "cpu/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "cpu/linear.h"

namespace moe::cpu {

float fp8_max(Fp8Format f) { return fp8_max_of(f); }
int fp8_emax(Fp8Format f) { return fp8_emax_of(f); }

uint8_t fp8_encode(float x, Fp8Format f) {
  return f == Fp8Format::kE4M3 ? f32_to_fp8_e4m3(x, true) : f32_to_fp8_e5m2(x, true);
}

float fp8_decode(uint8_t q, Fp8Format f) { return f == Fp8Format::kE4M3 ? fp8_e4m3_to_f32(q) : fp8_e5m2_to_f32(q); }

int64_t fp8_scale_rows(int64_t rows, Fp8Block block) { return (rows + block.rows - 1) / block.rows; }
int64_t fp8_scale_cols(int64_t cols, Fp8Block block) { return (cols + block.cols - 1) / block.cols; }

namespace {

void check_shape(const char* op, int64_t rows, int64_t cols, Fp8Block block) {
  MOE_CHECK(rows >= 0 && cols >= 0, op, ": rows and cols must be >= 0, got ", rows, " x ", cols);
  MOE_CHECK(block.rows > 0 && block.cols > 0, op, ": block must be positive, got ", block.rows, " x ", block.cols);
}

float checked_abs(const char* op, float v, int64_t r, int64_t c) {
  MOE_CHECK(std::isfinite(v), op, ": element [", r, ", ", c, "] is ", v, "; FP8 quantisation takes finite values");
  return std::fabs(v);
}

}  // namespace

void fp8_quantize_blocks(const float* x, int64_t rows, int64_t cols, Fp8Block block, Fp8Format f, uint8_t* q,
                         float* scales) {
  const char* op = "cpu::fp8_quantize_blocks";
  check_shape(op, rows, cols, block);
  const int64_t sr = fp8_scale_rows(rows, block), sc = fp8_scale_cols(cols, block);
  const float fmax = fp8_max(f);
  for (int64_t br = 0; br < sr; ++br) {
    for (int64_t bc = 0; bc < sc; ++bc) {
      const int64_t r0 = br * block.rows, r1 = std::min(rows, r0 + block.rows);
      const int64_t c0 = bc * block.cols, c1 = std::min(cols, c0 + block.cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, checked_abs(op, x[r * cols + c], r, c));
      float s = amax / fmax;
      if (!(s > 0.0f)) s = 1.0f;  // an all-zero block (or one below FP32's range once divided)
      scales[br * sc + bc] = s;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = fp8_encode(x[r * cols + c] / s, f);
    }
  }
}

void fp8_quantize_expert_columns(const float* x, const int32_t* offsets, int64_t max_rows, int64_t experts,
                                 int64_t width, int64_t capacity, Fp8Format f, uint8_t* q_t, float* scales_t,
                                 int32_t* padded) {
  const char* op = "cpu::fp8_quantize_expert_columns";
  MOE_CHECK(max_rows >= 0 && experts > 0 && width > 0, op, ": expected max_rows >= 0, experts > 0 and width > 0, got ",
            max_rows, ", ", experts, " and ", width);
  const auto rows_of = [&](int64_t e) {
    const int64_t start = std::clamp<int64_t>(offsets[e], 0, max_rows);
    return std::pair<int64_t, int64_t>{start, std::clamp<int64_t>(offsets[e + 1], start, max_rows)};
  };
  int64_t at = 0;
  for (int64_t e = 0; e < experts; ++e) {
    padded[e] = static_cast<int32_t>(at);
    const auto [start, end] = rows_of(e);
    at += (end - start + 127) / 128 * 128;
  }
  padded[experts] = static_cast<int32_t>(at);
  MOE_CHECK(at <= capacity, op, ": the experts' padded rows need ", at, " columns, capacity is ", capacity);
  std::vector<float> seg, sc;
  std::vector<uint8_t> q;
  for (int64_t e = 0; e < experts; ++e) {
    const auto [start, end] = rows_of(e);
    const int64_t pr = padded[e + 1] - padded[e];
    if (pr == 0) continue;
    seg.assign(static_cast<size_t>(width * pr), 0.0f);  // x_e^T, zero-padded to whole blocks
    for (int64_t r = 0; r < end - start; ++r)
      for (int64_t j = 0; j < width; ++j) seg[static_cast<size_t>(j * pr + r)] = x[(start + r) * width + j];
    q.resize(seg.size());
    sc.resize(static_cast<size_t>(width * (pr / 128)));
    fp8_quantize_blocks(seg.data(), width, pr, kFp8ActivationBlock, f, q.data(), sc.data());
    for (int64_t j = 0; j < width; ++j) {
      std::copy_n(q.data() + j * pr, pr, q_t + j * capacity + padded[e]);
      for (int64_t b = 0; b < pr / 128; ++b)
        scales_t[(padded[e] / 128 + b) * width + j] = sc[static_cast<size_t>(j * (pr / 128) + b)];
    }
  }
}

void fp8_dequantize_blocks(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, Fp8Block block,
                           Fp8Format f, float* x) {
  check_shape("cpu::fp8_dequantize_blocks", rows, cols, block);
  const int64_t sc = fp8_scale_cols(cols, block);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      x[r * cols + c] = fp8_decode(q[r * cols + c], f) * scales[(r / block.rows) * sc + c / block.cols];
}

int mx_scale_exponent(float amax, Fp8Format f, MxScale rule) {
  MOE_CHECK(std::isfinite(amax) && amax >= 0.0f, "cpu::mx_scale_exponent: amax must be finite and >= 0, got ", amax);
  if (amax == 0.0f) return -127;
  int ex = 0;
  std::frexp(amax, &ex);  // amax = m 2^ex, m in [0.5, 1): floor(log2 amax) = ex - 1
  int e = ex - 1 - fp8_emax(f);
  if (rule == MxScale::kNoSaturation && std::ldexp(amax, -e) > fp8_max(f)) e += 1;
  return std::clamp(e, -127, 127);
}

void mx_quantize(const float* x, int64_t rows, int64_t cols, Fp8Format f, MxScale rule, uint8_t* q,
                 uint8_t* scales_e8m0) {
  const char* op = "cpu::mx_quantize";
  check_shape(op, rows, cols, {1, kMxBlock});
  const int64_t sc = fp8_scale_cols(cols, {1, kMxBlock});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < sc; ++b) {
      const int64_t c0 = b * kMxBlock, c1 = std::min(cols, c0 + kMxBlock);
      float amax = 0.0f;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, checked_abs(op, x[r * cols + c], r, c));
      const int e = mx_scale_exponent(amax, f, rule);
      scales_e8m0[r * sc + b] = static_cast<uint8_t>(e + 127);
      // x / 2^e is exact in FP32 (a power of two), up to underflow below FP32's subnormals.
      for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = fp8_encode(std::ldexp(x[r * cols + c], -e), f);
    }
  }
}

void mx_dequantize(const uint8_t* q, const uint8_t* scales_e8m0, int64_t rows, int64_t cols, Fp8Format f, float* x) {
  check_shape("cpu::mx_dequantize", rows, cols, {1, kMxBlock});
  const int64_t sc = fp8_scale_cols(cols, {1, kMxBlock});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t code = scales_e8m0[r * sc + c / kMxBlock];
      MOE_CHECK(code != 0xFF, "cpu::mx_dequantize: scale [", r, ", ", c / kMxBlock, "] is the E8M0 NaN code 0xFF");
      x[r * cols + c] = std::ldexp(fp8_decode(q[r * cols + c], f), int(code) - 127);
    }
  }
}

namespace {

// C = A B^T over K blocks of kb, A's scale of (row i, K block t) from a_scale(i, t, kblocks), B's
// of (row j, K block t) from b_scale(j, t, kblocks).
template <typename AScale, typename BScale>
void gemm_k_blocks(const char* op, const uint8_t* qa, AScale a_scale, Fp8Format fa, const uint8_t* qb, Fp8Format fb,
                   int64_t m, int64_t n, int64_t k, float* c, bool accumulate, BScale b_scale, int64_t kb = 128) {
  MOE_CHECK(m >= 0 && n >= 0 && k >= 0, op, ": m, n, k must be >= 0, got ", m, ", ", n, ", ", k);
  const int64_t kblocks = (k + kb - 1) / kb;
  std::vector<float> a(static_cast<size_t>(m * k)), b(static_cast<size_t>(n * k));
  for (int64_t i = 0; i < m * k; ++i) a[size_t(i)] = fp8_decode(qa[i], fa);
  for (int64_t i = 0; i < n * k; ++i) b[size_t(i)] = fp8_decode(qb[i], fb);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float acc = accumulate ? c[i * n + j] : 0.0f;
      for (int64_t t = 0; t < kblocks; ++t) {
        const int64_t k0 = t * kb, k1 = std::min(k, k0 + kb);
        float partial = 0.0f;
        for (int64_t p = k0; p < k1; ++p) partial += a[size_t(i * k + p)] * b[size_t(j * k + p)];
        acc += partial * a_scale(i, t, kblocks) * b_scale(j, t, kblocks);
      }
      c[i * n + j] = acc;
    }
  }
}

// [rows, cols] -> [cols, rows].
template <typename T>
std::vector<T> transposed(const T* x, int64_t rows, int64_t cols) {
  std::vector<T> t(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = x[r * cols + c];
  return t;
}

// A tensor's FP8 codes and its scales: FP32 (block scaling) or E8M0 codes (MX).
template <typename Scale>
struct Codes {
  std::vector<uint8_t> q;
  std::vector<Scale> s;
  Codes(int64_t rows, int64_t cols, int64_t scales) : q(size_t(rows * cols)), s(size_t(scales)) {}
};
using Quantised = Codes<float>;
using MxQuantised = Codes<uint8_t>;

Quantised quantise(const float* x, int64_t rows, int64_t cols, Fp8Block block, Fp8Format f) {
  Quantised out(rows, cols, fp8_scale_rows(rows, block) * fp8_scale_cols(cols, block));
  fp8_quantize_blocks(x, rows, cols, block, f, out.q.data(), out.s.data());
  return out;
}

// x [rows, cols] in 1 x 32 blocks along its rows, E8M0 scales [rows, ceil(cols / 32)].
MxQuantised mx_quantised(const float* x, int64_t rows, int64_t cols, Fp8Format f, MxScale rule) {
  MxQuantised out(rows, cols, rows * fp8_scale_cols(cols, {1, kMxBlock}));
  mx_quantize(x, rows, cols, f, rule, out.q.data(), out.s.data());
  return out;
}

}  // namespace

void fp8_gemm_rowwise_scaled(const uint8_t* qa, const float* sa, Fp8Format fa, const uint8_t* qb, const float* sb,
                             Fp8Format fb, int64_t m, int64_t n, int64_t k, float* c, bool accumulate) {
  gemm_k_blocks("cpu::fp8_gemm_rowwise_scaled", qa, [sa](int64_t i, int64_t t, int64_t kb) { return sa[i * kb + t]; },
                fa, qb, fb, m, n, k, c, accumulate,
                [sb](int64_t j, int64_t t, int64_t kblocks) { return sb[j * kblocks + t]; });
}

Fp8Recipe fp8_recipe_named(const std::string& scaling) {
  Fp8Recipe r;
  if (scaling == "blocks") return r;
  MOE_CHECK(scaling == "mx" || scaling == "mx_no_saturation", "train.fp8_scaling: expected \"blocks\", \"mx\" or ",
            "\"mx_no_saturation\", got \"", scaling, "\"");
  r.scaling = Fp8Scaling::kMx;
  r.mx_rule = scaling == "mx" ? MxScale::kOcp : MxScale::kNoSaturation;
  return r;
}

Fp8Rule fp8_rule_named(const std::string& scaling) {
  const Fp8Recipe r = fp8_recipe_named(scaling);
  if (r.scaling == Fp8Scaling::kBlocks) return Fp8Rule::kBlocks;
  return r.mx_rule == MxScale::kOcp ? Fp8Rule::kMx : Fp8Rule::kMxNoSaturation;
}

void fp8_linear_forward(const float* x, const float* w, int64_t m, int64_t n, int64_t k, const Fp8Recipe& r, float* y) {
  if (r.scaling == Fp8Scaling::kMx) {
    const MxQuantised qx = mx_quantised(x, m, k, r.forward, r.mx_rule);
    const MxQuantised qw = mx_quantised(w, n, k, r.forward, r.mx_rule);
    return mx_gemm(qx.q.data(), qx.s.data(), r.forward, qw.q.data(), qw.s.data(), r.forward, m, n, k, y, false);
  }
  const Quantised qx = quantise(x, m, k, kFp8ActivationBlock, r.forward);
  const Quantised qw = quantise(w, n, k, kFp8WeightBlock, r.forward);
  fp8_gemm_block_scaled(qx.q.data(), qx.s.data(), r.forward, qw.q.data(), qw.s.data(), r.forward, m, n, k, y, false);
}

void fp8_linear_dgrad(const float* dy, const float* w, int64_t m, int64_t n, int64_t k, const Fp8Recipe& r,
                      float* dx) {
  if (r.scaling == Fp8Scaling::kMx) {
    // W's column-wise copy: 1 x 32 blocks along N, the contraction dimension of dx = dy W.
    const std::vector<float> wt = transposed(w, n, k);
    const MxQuantised qdy = mx_quantised(dy, m, n, r.grad, r.mx_rule);
    const MxQuantised qwt = mx_quantised(wt.data(), k, n, r.forward, r.mx_rule);
    return mx_gemm(qdy.q.data(), qdy.s.data(), r.grad, qwt.q.data(), qwt.s.data(), r.forward, m, k, n, dx, false);
  }
  const Quantised qdy = quantise(dy, m, n, kFp8ActivationBlock, r.grad);
  // W's own 128 x 128 blocks (as the forward quantised them), codes and scale grid transposed.
  const Quantised qw = quantise(w, n, k, kFp8WeightBlock, r.forward);
  const std::vector<uint8_t> qwt = transposed(qw.q.data(), n, k);
  const std::vector<float> swt =
      transposed(qw.s.data(), fp8_scale_rows(n, kFp8WeightBlock), fp8_scale_cols(k, kFp8WeightBlock));
  fp8_gemm_block_scaled(qdy.q.data(), qdy.s.data(), r.grad, qwt.data(), swt.data(), r.forward, m, k, n, dx, false);
}

void fp8_linear_wgrad(const float* dy, const float* x, int64_t m, int64_t n, int64_t k, const Fp8Recipe& r,
                      float* dw) {
  const std::vector<float> dyt = transposed(dy, m, n), xt = transposed(x, m, k);
  if (r.scaling == Fp8Scaling::kMx) {
    const MxQuantised qdyt = mx_quantised(dyt.data(), n, m, r.grad, r.mx_rule);
    const MxQuantised qxt = mx_quantised(xt.data(), k, m, r.forward, r.mx_rule);
    return mx_gemm(qdyt.q.data(), qdyt.s.data(), r.grad, qxt.q.data(), qxt.s.data(), r.forward, n, k, m, dw, true);
  }
  const Quantised qdyt = quantise(dyt.data(), n, m, kFp8ActivationBlock, r.grad);
  const Quantised qxt = quantise(xt.data(), k, m, kFp8ActivationBlock, r.forward);
  fp8_gemm_rowwise_scaled(qdyt.q.data(), qdyt.s.data(), r.grad, qxt.q.data(), qxt.s.data(), r.forward, n, k, m, dw,
                          true);
}

void fp8_gemm_block_scaled(const uint8_t* qa, const float* sa, Fp8Format fa, const uint8_t* qb, const float* sb,
                           Fp8Format fb, int64_t m, int64_t n, int64_t k, float* c, bool accumulate) {
  // B's 128 x 128 blocks: row j's scale in K block t is its row block's.
  gemm_k_blocks("cpu::fp8_gemm_block_scaled", qa, [sa](int64_t i, int64_t t, int64_t kb) { return sa[i * kb + t]; },
                fa, qb, fb, m, n, k, c, accumulate,
                [sb](int64_t j, int64_t t, int64_t kblocks) { return sb[(j / 128) * kblocks + t]; });
}

void fp8_quantize_weights(const float* w, int64_t experts, int64_t n, int64_t k, Fp8Format f, uint8_t* q, float* s,
                          uint8_t* qt, float* st, Fp8Rule rule) {
  const char* op = "cpu::fp8_quantize_weights";
  MOE_CHECK(experts >= 0, op, ": experts must be >= 0, got ", experts);
  check_shape(op, n, k, kFp8WeightBlock);
  const int64_t nb = fp8_scale_rows(n, kFp8WeightBlock), kb = fp8_scale_cols(k, kFp8WeightBlock);
  for (int64_t e = 0; e < experts; ++e) {
    uint8_t* qe = q + e * n * k;
    float* se = s + e * nb * kb;
    const float* we = w + e * n * k;
    fp8_quantize_blocks(we, n, k, kFp8WeightBlock, f, rule, qe, se);
    if (qt == nullptr) continue;
    if (rule != Fp8Rule::kBlocks) {  // the column copy quantised along w's columns
      std::vector<float> wt(size_t(n * k));
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < k; ++c) wt[size_t(c * n + r)] = we[r * k + c];
      fp8_quantize_blocks(wt.data(), k, n, kFp8WeightBlock, f, rule, qt + e * n * k, st + e * nb * kb);
      continue;
    }
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c) qt[e * n * k + c * n + r] = qe[r * k + c];
    for (int64_t i = 0; i < nb; ++i)
      for (int64_t j = 0; j < kb; ++j) st[e * nb * kb + j * nb + i] = se[i * kb + j];
  }
}

void fp8_quantize_weights_bf16_rounded(const float* w, int64_t experts, int64_t n, int64_t k, Fp8Format f, uint8_t* q,
                                       float* s, uint8_t* qt, float* st, Fp8Rule rule) {
  MOE_CHECK(experts >= 0 && n >= 0 && k >= 0, "cpu::fp8_quantize_weights_bf16_rounded: experts, n and k must be >= 0, ",
            "got ", experts, ", ", n, ", ", k);
  const int64_t numel = experts * n * k;
  std::vector<float> w16(static_cast<size_t>(numel));
  for (int64_t i = 0; i < numel; ++i) w16[size_t(i)] = bf16_to_f32(f32_to_bf16(w[i]));
  fp8_quantize_weights(w16.data(), experts, n, k, f, q, s, qt, st, rule);
}

void fp8_grouped_gemm_block_scaled(const uint8_t* qa, const float* sa, Fp8Format fa, const uint8_t* qb,
                                   const float* sb, Fp8Format fb, const int32_t* offsets, int64_t max_rows,
                                   int64_t experts, int64_t n, int64_t k, float* c) {
  const int64_t kb = fp8_scale_cols(k, kFp8WeightBlock), nb = fp8_scale_rows(n, kFp8WeightBlock);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t start = std::clamp<int64_t>(offsets[e], 0, max_rows);
    const int64_t end = std::clamp<int64_t>(offsets[e + 1], start, max_rows);
    if (end == start) continue;
    fp8_gemm_block_scaled(qa + start * k, sa + start * kb, fa, qb + e * n * k, sb + e * nb * kb, fb, end - start, n,
                          k, c + start * n, false);
  }
}

namespace {
// 2^(code - 127) of an E8M0 scale code; the NaN code is refused.
float e8m0_value(const char* op, uint8_t code) {
  MOE_CHECK(code != 0xFF, op, ": an E8M0 scale holds the NaN code 0xFF");
  return std::ldexp(1.0f, int(code) - 127);
}
}  // namespace

void mx_gemm(const uint8_t* qa, const uint8_t* sa_e8m0, Fp8Format fa, const uint8_t* qb, const uint8_t* sb_e8m0,
             Fp8Format fb, int64_t m, int64_t n, int64_t k, float* c, bool accumulate) {
  const char* op = "cpu::mx_gemm";
  gemm_k_blocks(op, qa, [=](int64_t i, int64_t t, int64_t kb) { return e8m0_value(op, sa_e8m0[i * kb + t]); }, fa, qb,
                fb, m, n, k, c, accumulate,
                [=](int64_t j, int64_t t, int64_t kb) { return e8m0_value(op, sb_e8m0[j * kb + t]); }, kMxBlock);
}

std::vector<uint8_t> mx_scales_tiled(const uint8_t* scales_e8m0, int64_t rows, int64_t cols) {
  MOE_CHECK(rows >= 0 && cols >= 0, "cpu::mx_scales_tiled: expected rows, cols >= 0, got ", rows, " x ", cols);
  std::vector<uint8_t> out(size_t(mx_scales_tiled_bytes(rows, cols)), uint8_t{127});
  const int64_t col_tiles = (cols + 3) / 4;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t tile = (r / 128) * col_tiles + c / 4, in = r % 128;
      out[size_t(tile * 512 + (in % 32) * 16 + (in / 32) * 4 + c % 4)] = scales_e8m0[r * cols + c];
    }
  return out;
}

int64_t mx_to_blocks(const uint8_t* q, const uint8_t* scales_e8m0, int64_t rows, int64_t cols, Fp8Format f,
                     Fp8Block block, uint8_t* q_out, float* scales_out) {
  const char* op = "cpu::mx_to_blocks";
  MOE_CHECK(rows >= 0 && cols >= 0, op, ": rows and cols must be >= 0, got ", rows, " x ", cols);
  MOE_CHECK(block.rows >= 1 && block.cols >= kMxBlock && block.cols % kMxBlock == 0, op, ": block ", block.rows,
            " x ", block.cols, " must be at least one row of whole ", kMxBlock, "-wide MX sub-blocks");
  const int64_t mx_cols = fp8_scale_cols(cols, {1, kMxBlock});
  const int64_t out_rows = fp8_scale_rows(rows, block), out_cols = fp8_scale_cols(cols, block);
  int64_t changed = 0;
  for (int64_t br = 0; br < out_rows; ++br) {
    const int64_t r0 = br * block.rows, r1 = std::min(rows, r0 + block.rows);
    for (int64_t b = 0; b < out_cols; ++b) {
      const int64_t c0 = b * block.cols, c1 = std::min(cols, c0 + block.cols);
      int top = 0;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; c += kMxBlock) {
          const uint8_t code = scales_e8m0[r * mx_cols + c / kMxBlock];
          MOE_CHECK(code != 0xFF, op, ": scale [", r, ", ", c / kMxBlock, "] is the E8M0 NaN code 0xFF");
          top = std::max(top, int(code));
        }
      }
      scales_out[br * out_cols + b] = std::ldexp(1.0f, top - 127);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const int shift = int(scales_e8m0[r * mx_cols + c / kMxBlock]) - top;  // <= 0
          const double v = std::ldexp(double(fp8_decode(q[r * cols + c], f)), shift);  // exact in FP64
          // FP32 is exact for every v the format can hold; smaller ones encode to 0 either way.
          const uint8_t code = fp8_encode(float(v), f);
          q_out[r * cols + c] = code;
          changed += double(fp8_decode(code, f)) != v;
        }
      }
    }
  }
  return changed;
}

int64_t mx_to_blocks128(const uint8_t* q, const uint8_t* scales_e8m0, int64_t rows, int64_t cols, Fp8Format f,
                        uint8_t* q_out, float* scales_out) {
  return mx_to_blocks(q, scales_e8m0, rows, cols, f, kFp8ActivationBlock, q_out, scales_out);
}

int64_t fp8_quantize_blocks(const float* x, int64_t rows, int64_t cols, Fp8Block block, Fp8Format f, Fp8Rule rule,
                            uint8_t* q, float* scales) {
  if (rule == Fp8Rule::kBlocks) {
    fp8_quantize_blocks(x, rows, cols, block, f, q, scales);
    return 0;
  }
  std::vector<uint8_t> mx_q(size_t(rows * cols)), mx_s(size_t(rows * fp8_scale_cols(cols, {1, kMxBlock})));
  mx_quantize(x, rows, cols, f, mx_rule_of(rule), mx_q.data(), mx_s.data());
  return mx_to_blocks(mx_q.data(), mx_s.data(), rows, cols, f, block, q, scales);
}

namespace {

// x [rows, cols] quantised in `block` blocks of format f, dequantised.
std::vector<float> fake_quantised(const float* x, int64_t rows, int64_t cols, Fp8Block block, Fp8Format f) {
  const Quantised q = quantise(x, rows, cols, block, f);
  std::vector<float> d(size_t(rows * cols));
  fp8_dequantize_blocks(q.q.data(), q.s.data(), rows, cols, block, f, d.data());
  return d;
}

// The same in 1 x 128 blocks down the columns (128 rows of one column per block).
std::vector<float> fake_quantised_columns(const float* x, int64_t rows, int64_t cols, Fp8Format f) {
  const std::vector<float> t = transposed(x, rows, cols);
  const std::vector<float> tq = fake_quantised(t.data(), cols, rows, kFp8ActivationBlock, f);
  return transposed(tq.data(), cols, rows);
}


// x [rows, cols] in MX blocks (1 x 32 along each row), dequantised.
std::vector<float> fake_quantised_mx(const float* x, int64_t rows, int64_t cols, Fp8Format f, MxScale rule) {
  const MxQuantised q = mx_quantised(x, rows, cols, f, rule);
  std::vector<float> d(size_t(rows * cols));
  mx_dequantize(q.q.data(), q.s.data(), rows, cols, f, d.data());
  return d;
}

// The same in blocks of 32 down the columns.
std::vector<float> fake_quantised_mx_columns(const float* x, int64_t rows, int64_t cols, Fp8Format f, MxScale rule) {
  const std::vector<float> t = transposed(x, rows, cols);
  const std::vector<float> tq = fake_quantised_mx(t.data(), cols, rows, f, rule);
  return transposed(tq.data(), cols, rows);
}

// An operand quantised and dequantised as the recipe's scaling says, in blocks along its rows:
// `block` under block scaling (1 x 128 or 128 x 128), 1 x 32 under MX.
std::vector<float> fake_quantised_rows(const float* x, int64_t rows, int64_t cols, Fp8Block block, Fp8Format f,
                                       const Fp8Recipe& r) {
  return r.scaling == Fp8Scaling::kMx ? fake_quantised_mx(x, rows, cols, f, r.mx_rule)
                                      : fake_quantised(x, rows, cols, block, f);
}

// In blocks down the columns: 1 x 128 (block scaling) or 1 x 32 (MX) along the rows' dimension.
std::vector<float> fake_quantised_cols(const float* x, int64_t rows, int64_t cols, Fp8Format f, const Fp8Recipe& r) {
  return r.scaling == Fp8Scaling::kMx ? fake_quantised_mx_columns(x, rows, cols, f, r.mx_rule)
                                      : fake_quantised_columns(x, rows, cols, f);
}
}  // namespace

void fp8_emulated_linear_forward(const float* x, const float* w, float* y, int64_t n, int64_t k, int64_t m,
                                 bool accumulate, const Fp8Recipe& r) {
  const std::vector<float> xq = fake_quantised_rows(x, n, k, kFp8ActivationBlock, r.forward, r);
  const std::vector<float> wq = fake_quantised_rows(w, m, k, kFp8WeightBlock, r.forward, r);
  linear_forward(xq.data(), wq.data(), y, n, k, m, accumulate);
}

void fp8_emulated_linear_backward(const float* x, const float* w, const float* dy, float* dx, float* dw, int64_t n,
                                  int64_t k, int64_t m, bool accumulate_dx, const Fp8Recipe& r) {
  if (dx != nullptr) {
    const std::vector<float> dyq = fake_quantised_rows(dy, n, m, kFp8ActivationBlock, r.grad, r);
    // W's 128 x 128 blocks serve both passes; MX quantises a column-wise copy (along m) for dx.
    const std::vector<float> wq = r.scaling == Fp8Scaling::kMx ? fake_quantised_mx_columns(w, m, k, r.forward, r.mx_rule)
                                                               : fake_quantised(w, m, k, kFp8WeightBlock, r.forward);
    linear_backward(static_cast<const float*>(nullptr), wq.data(), dyq.data(), dx, static_cast<float*>(nullptr), n, k,
                    m, accumulate_dx);
  }
  if (dw != nullptr) {
    const std::vector<float> dyc = fake_quantised_cols(dy, n, m, r.grad, r);
    const std::vector<float> xc = fake_quantised_cols(x, n, k, r.forward, r);
    linear_backward(xc.data(), static_cast<const float*>(nullptr), dyc.data(), static_cast<float*>(nullptr), dw, n, k,
                    m, false);
  }
}

void fp8_quantised_rows(const float* x, int64_t rows, int64_t cols, Fp8Format f, const Fp8Recipe& r, float* out) {
  MOE_CHECK(rows >= 0 && cols >= 0, "cpu::fp8_quantised_rows: rows and cols must be >= 0, got ", rows, " x ", cols);
  if (rows == 0 || cols == 0) return;
  const std::vector<float> q = fake_quantised_rows(x, rows, cols, kFp8ActivationBlock, f, r);
  std::copy(q.begin(), q.end(), out);
}

namespace {

int64_t row_scale_bytes(int64_t cols, const Fp8Recipe& r) {
  return r.scaling == Fp8Scaling::kMx ? fp8_scale_cols(cols, {1, kMxBlock})
                                      : fp8_scale_cols(cols, kFp8ActivationBlock) * int64_t{sizeof(float)};
}

}  // namespace

int64_t fp8_row_payload_bytes(int64_t cols, const Fp8Recipe& r) {
  MOE_CHECK(cols >= 0, "cpu::fp8_row_payload_bytes: cols must be >= 0, got ", cols);
  return (cols + row_scale_bytes(cols, r) + 3) / 4 * 4;
}

void fp8_pack_rows(const float* x, int64_t rows, int64_t cols, Fp8Format f, const Fp8Recipe& r, uint8_t* payload) {
  MOE_CHECK(rows >= 0 && cols >= 0, "cpu::fp8_pack_rows: rows and cols must be >= 0, got ", rows, " x ", cols);
  const int64_t per = fp8_row_payload_bytes(cols, r), sb = row_scale_bytes(cols, r);
  if (rows == 0 || cols == 0) return;
  std::fill(payload, payload + rows * per, uint8_t{0});
  // The quantiser's codes and scales, as bytes: row i's codes, then its scales' bytes.
  std::vector<uint8_t> codes, scales;
  if (r.scaling == Fp8Scaling::kMx) {
    MxQuantised q = mx_quantised(x, rows, cols, f, r.mx_rule);
    codes = std::move(q.q);
    scales = std::move(q.s);
  } else {
    const Quantised q = quantise(x, rows, cols, kFp8ActivationBlock, f);
    codes = q.q;
    scales.resize(q.s.size() * sizeof(float));
    std::memcpy(scales.data(), q.s.data(), scales.size());
  }
  for (int64_t i = 0; i < rows; ++i) {
    std::copy(codes.begin() + i * cols, codes.begin() + (i + 1) * cols, payload + i * per);
    std::copy(scales.begin() + i * sb, scales.begin() + (i + 1) * sb, payload + i * per + cols);
  }
}

void fp8_unpack_rows(const uint8_t* payload, int64_t rows, int64_t cols, Fp8Format f, const Fp8Recipe& r, float* out) {
  MOE_CHECK(rows >= 0 && cols >= 0, "cpu::fp8_unpack_rows: rows and cols must be >= 0, got ", rows, " x ", cols);
  const int64_t per = fp8_row_payload_bytes(cols, r), sb = row_scale_bytes(cols, r);
  if (rows == 0 || cols == 0) return;
  std::vector<float> block_scales(static_cast<size_t>(sb) / sizeof(float));  // aligned copies
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* codes = payload + i * per;
    if (r.scaling == Fp8Scaling::kMx) {
      mx_dequantize(codes, codes + cols, 1, cols, f, out + i * cols);
    } else {
      std::memcpy(block_scales.data(), codes + cols, static_cast<size_t>(sb));
      fp8_dequantize_blocks(codes, block_scales.data(), 1, cols, kFp8ActivationBlock, f, out + i * cols);
    }
  }
}

}  // namespace moe::cpu
