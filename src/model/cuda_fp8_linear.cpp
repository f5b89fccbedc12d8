// The FP8 recipe's dense linears (contract in cuda_fp8_linear.h).
#ifdef MOECORE_HAS_CUDA

#include "model/cuda_fp8_linear.h"

#include "core/error.h"
#include "core/fp8_types.h"
#include "cuda/ops/fp8.h"
#include "cuda/ops/gemm.h"
#include "cuda/ops/rmsnorm.h"

namespace moe {
namespace {

int64_t pad4(int64_t x) { return (x + 3) / 4 * 4; }

}  // namespace

void CudaFp8Scratch::reserve(int64_t n, int64_t width, int64_t weight_elems, CudaBufferGrower& g) {
  const int64_t kb = (width + 127) / 128;
  g.grow<uint8_t>(q, n * width, "FP8 activation codes");
  g.grow<float>(s, n * kb, "FP8 activation scales");
  g.grow<float>(s_t, kb * n, "FP8 activation scales, K-block-major");
  // A refresh's block scales before their padding: both grids and one re-layout.
  g.grow<float>(w_tmp, 3 * (weight_elems / (128 * 128)), "FP8 weight scale scratch");
}

void CudaFp8Weight::reserve(int64_t r, int64_t c, CudaBufferGrower& g, const char* what) {
  MOE_CHECK(r > 0 && c > 0 && r % 128 == 0 && c % 128 == 0, "CudaFp8Weight (", what, "): rows (", r, ") and cols (", c,
            ") must be positive multiples of 128");
  rows = r;
  cols = c;
  const int64_t rb = r / 128, cb = c / 128;
  g.grow<uint8_t>(q, r * c, what);
  g.grow<float>(s, rb * pad4(cb), what);
  g.grow<uint8_t>(qt, c * r, what);
  g.grow<float>(st, cb * pad4(rb), what);
}

void CudaFp8Weight::quantize(const uint16_t* w, CudaFp8Scratch& sc, cuda::Stream stream) {
  const int64_t rb = rows / 128, cb = cols / 128;
  MOE_CHECK(sc.w_tmp.bytes() >= size_t(3 * rb * cb) * sizeof(float), "CudaFp8Weight::quantize: the scratch holds ",
            sc.w_tmp.bytes() / sizeof(float), " scale floats, a ", rows, " x ", cols, " weight needs ", 3 * rb * cb);
  const bool direct = cb % 4 == 0 && rb % 4 == 0;
  float* tmp = sc.w_tmp.as<float>();
  float* s_raw = direct ? s.as<float>() : tmp;             // [rb, cb]
  float* st_raw = direct ? st.as<float>() : tmp + rb * cb;  // [cb, rb]
  cuda::fp8_quantize_weights(w, 1, rows, cols, Fp8Format::kE4M3, q.as<uint8_t>(), s_raw, qt.as<uint8_t>(), st_raw,
                             nullptr, stream, sc.rule);
  if (direct) return;
  // Pad each row of block scales to a multiple of 4: [rb, cb] -> [cb, rb] -> [rb, pad4(cb)] through
  // two K-major re-layouts (bitwise copies, zeros in the padding); likewise the transposed grid.
  float* t = tmp + 2 * rb * cb;
  cuda::fp8_scales_k_major(s_raw, rb, cb, rb, t, stream);                   // t [cb, rb]
  cuda::fp8_scales_k_major(t, cb, rb, pad4(cb), s.as<float>(), stream);     // s [rb, pad4(cb)]
  cuda::fp8_scales_k_major(st_raw, cb, rb, cb, t, stream);                  // t [rb, cb]
  cuda::fp8_scales_k_major(t, rb, cb, pad4(rb), st.as<float>(), stream);    // st [cb, pad4(rb)]
}

void fp8_quantize_operand(const uint16_t* x, int64_t n, int64_t k, CudaFp8Scratch& sc, cuda::Stream st) {
  cuda::fp8_quantize_blocks(x, n, k, kFp8ActivationBlock, Fp8Format::kE4M3, sc.q.as<uint8_t>(), sc.s.as<float>(),
                            nullptr, st, sc.rule);
  cuda::fp8_scales_k_major(sc.s.as<float>(), n, k / 128, n, sc.s_t.as<float>(), st);
}

void fp8_rmsnorm_operand(const uint16_t* x, const uint16_t* w, uint16_t* y, float* rstd, int64_t n, int64_t k,
                         double eps, CudaFp8Scratch& sc, cuda::Stream st) {
  uint8_t* q = sc.q.as<uint8_t>();
  if (!cuda::rmsnorm_forward_fp8_fuses(x, w, y, q, k)) {
    cuda::rmsnorm_forward(x, w, y, rstd, n, k, eps, st);
    fp8_quantize_operand(y, n, k, sc, st);
    return;
  }
  cuda::rmsnorm_forward_fp8(x, w, y, rstd, q, sc.s.as<float>(), n, k, eps, st, sc.rule);
  cuda::fp8_scales_k_major(sc.s.as<float>(), n, k / 128, n, sc.s_t.as<float>(), st);
}

void fp8_quantize_operand_part(const uint16_t* x, int64_t n, int64_t k_part, int64_t ld, int64_t col,
                               CudaFp8Scratch& sc, cuda::Stream st) {
  MOE_CHECK(col >= 0 && col % 128 == 0 && k_part % 128 == 0 && col + k_part <= ld,
            "fp8_quantize_operand_part: columns [", col, ", ", col + k_part, ") of an operand ", ld,
            " wide must be whole 128 blocks inside it");
  cuda::fp8_quantize_rows_into(x, n, k_part, ld, Fp8Format::kE4M3, sc.q.as<uint8_t>() + col, sc.s.as<float>(),
                               nullptr, st, sc.rule);
  cuda::fp8_scales_k_major(sc.s.as<float>(), n, k_part / 128, n, sc.s_t.as<float>() + (col / 128) * n, st);
}

void fp8_linear(cuda::GemmHandle& g, const CudaFp8Scratch& sc, const CudaFp8Weight& w, bool transposed, int64_t r0,
                int64_t n, int64_t m, int64_t k, uint16_t* out, cuda::Stream st) {
  const int64_t wrows = transposed ? w.cols : w.rows, wcols = transposed ? w.rows : w.cols;
  MOE_CHECK(k == wcols && r0 >= 0 && r0 % 128 == 0 && r0 + m <= wrows, "fp8_linear: rows [", r0, ", ", r0 + m,
            ") of a ", wrows, " x ", wcols, " weight", transposed ? " (transposed)" : "", " against K = ", k);
  const int64_t lds = pad4(wcols / 128);
  const uint8_t* qb = (transposed ? w.qt : w.q).as<uint8_t>() + r0 * wcols;
  const float* sb = (transposed ? w.st : w.s).as<float>() + (r0 / 128) * lds;
  cuda::fp8_gemm(g, sc.q.as<uint8_t>(), sc.s_t.as<float>(), n, Fp8Format::kE4M3, qb, sb, lds, Fp8Format::kE4M3,
                 cuda::Fp8BScaling::kBlock128x128, n, m, k, out, st);
}

}  // namespace moe

#endif  // MOECORE_HAS_CUDA
