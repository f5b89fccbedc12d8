// SwiGLU MLP forward/backward on CPU GEMMs (strided writes into the fused [N, 2F] buffer), and
// the dense block around it (mlp_norm, residual); recomputation reruns the same calls short of the
// down projection.
#include "model/mlp.h"

#include "core/error.h"
#include "cpu/linear.h"
#include "cpu/linear_precision.h"
#include "cpu/rmsnorm.h"
#include "cpu/swiglu.h"

namespace moe {

namespace {

// [n, f] columns of a [n, 2f] buffer from / into a contiguous [n, f] one.
template <typename T>
void put_half(const T* src, T* gu, int64_t n, int64_t f, int64_t half) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < f; ++j) gu[i * 2 * f + half * f + j] = src[i * f + j];
}
template <typename T>
std::vector<T> take_half(const T* gu, int64_t n, int64_t f, int64_t half) {
  std::vector<T> out(size_t(n * f));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < f; ++j) out[size_t(i * f + j)] = gu[i * 2 * f + half * f + j];
  return out;
}

}  // namespace

template <typename T>
void mlp_recompute(const T* x, const T* wg, const T* wu, int64_t n, int64_t d, int64_t f, bool gate_up_kept,
                   MlpSaved<T>& s, const cpu::Fp8Recipe* fp8) {
  if (!gate_up_kept) {
    s.gate_up_N2F.resize(n * 2 * f);
    T* gu = s.gate_up_N2F.data();
    if (fp8 == nullptr) {
      cpu::gemm<T>(false, true, n, f, d, T(1), x, d, wg, d, T(0), gu, 2 * f);
      cpu::gemm<T>(false, true, n, f, d, T(1), x, d, wu, d, T(0), gu + f, 2 * f);
    } else {
      std::vector<T> half(size_t(n * f));
      cpu::linear_forward_at(fp8, x, wg, half.data(), n, d, f);
      put_half(half.data(), gu, n, f, 0);
      cpu::linear_forward_at(fp8, x, wu, half.data(), n, d, f);
      put_half(half.data(), gu, n, f, 1);
    }
  }
  MOE_CHECK(static_cast<int64_t>(s.gate_up_N2F.size()) == n * 2 * f, "mlp_recompute: the gate/up projection holds ",
            s.gate_up_N2F.size(), " values, expected ", n * 2 * f, " (forward not run?)");
  s.h_NF.resize(n * f);
  cpu::swiglu_forward(s.gate_up_N2F.data(), s.h_NF.data(), n, f);
}

template <typename T>
void mlp_forward(const T* x, const T* wg, const T* wu, const T* wd, int64_t n, int64_t d, int64_t f,
                 MlpSaved<T>& s, T* out, bool accumulate, const cpu::Fp8Recipe* fp8) {
  mlp_recompute(x, wg, wu, n, d, f, /*gate_up_kept=*/false, s, fp8);
  if (fp8 != nullptr) return cpu::linear_forward_at(fp8, s.h_NF.data(), wd, out, n, f, d, accumulate);
  cpu::gemm<T>(false, true, n, d, f, T(1), s.h_NF.data(), f, wd, f, accumulate ? T(1) : T(0), out, d);
}

template <typename T>
void mlp_backward(const T* x, const T* wg, const T* wu, const T* wd, const MlpSaved<T>& s,
                  const T* dout, int64_t n, int64_t d, int64_t f, T* dx, T* dwg, T* dwu, T* dwd,
                  const cpu::Fp8Recipe* fp8) {
  std::vector<T> dh(n * f), dgu(n * 2 * f);
  if (fp8 != nullptr) {
    cpu::linear_backward_at(fp8, s.h_NF.data(), wd, dout, dh.data(), dwd, n, f, d);
    cpu::swiglu_backward(s.gate_up_N2F.data(), dh.data(), dgu.data(), n, f);
    const std::vector<T> dg = take_half(dgu.data(), n, f, 0), du = take_half(dgu.data(), n, f, 1);
    cpu::linear_backward_at(fp8, x, wg, dg.data(), dx, dwg, n, d, f, /*accumulate_dx=*/true);
    cpu::linear_backward_at(fp8, x, wu, du.data(), dx, dwu, n, d, f, /*accumulate_dx=*/true);
    return;
  }
  cpu::gemm<T>(false, false, n, f, d, T(1), dout, d, wd, f, T(0), dh.data(), f);
  cpu::gemm<T>(true, false, d, f, n, T(1), dout, d, s.h_NF.data(), f, T(1), dwd, f);
  cpu::swiglu_backward(s.gate_up_N2F.data(), dh.data(), dgu.data(), n, f);
  cpu::gemm<T>(true, false, f, d, n, T(1), dgu.data(), 2 * f, x, d, T(1), dwg, d);
  cpu::gemm<T>(true, false, f, d, n, T(1), dgu.data() + f, 2 * f, x, d, T(1), dwu, d);
  cpu::gemm<T>(false, false, n, d, f, T(1), dgu.data(), 2 * f, wg, d, T(1), dx, d);
  cpu::gemm<T>(false, false, n, d, f, T(1), dgu.data() + f, 2 * f, wu, d, T(1), dx, d);
}

template <typename T>
void mlp_block_forward(const MlpTensors<const T*>& w, int64_t n, int64_t d, int64_t f, double eps, T* x,
                       MlpBlockSaved<T>& s, PhaseTimer* timer, const cpu::Fp8Recipe* fp8) {
  if (timer) timer->lap(Phase::kMlp);
  s.num_tokens = n;
  s.x_in_ND.assign(x, x + n * d);
  s.norm_ND.resize(n * d);
  s.rstd_N.resize(n);
  cpu::rmsnorm_forward(x, w.mlp_norm, s.norm_ND.data(), s.rstd_N.data(), n, d, eps);
  mlp_forward(s.norm_ND.data(), w.mlp_gate, w.mlp_up, w.mlp_down, n, d, f, s.mlp, x, /*accumulate=*/true, fp8);
}

template <typename T>
void mlp_block_backward(const MlpTensors<const T*>& w, const MlpBlockSaved<T>& s, int64_t d, int64_t f, T* dx,
                        const MlpTensors<T*>& dw, PhaseTimer* timer, const cpu::Fp8Recipe* fp8) {
  const int64_t n = s.num_tokens;
  if (timer) timer->lap(Phase::kMlp);
  std::vector<T> dnorm(n * d);  // accumulates from zero
  mlp_backward(s.norm_ND.data(), w.mlp_gate, w.mlp_up, w.mlp_down, s.mlp, dx, n, d, f, dnorm.data(), dw.mlp_gate,
               dw.mlp_up, dw.mlp_down, fp8);
  cpu::rmsnorm_backward_add(s.x_in_ND.data(), w.mlp_norm, s.rstd_N.data(), dnorm.data(), dx, dw.mlp_norm, n, d);
}

template <typename T>
void swap_recomputed(Recompute mode, MlpBlockSaved<T>& a, MlpBlockSaved<T>& b) {
  if (mode == Recompute::kNone) return;
  a.norm_ND.swap(b.norm_ND);
  a.mlp.h_NF.swap(b.mlp.h_NF);
  if (mode != Recompute::kFull) return;
  a.x_in_ND.swap(b.x_in_ND);
  a.rstd_N.swap(b.rstd_N);
  a.mlp.gate_up_N2F.swap(b.mlp.gate_up_N2F);
}

template <typename T>
void mlp_block_recompute(const MlpTensors<const T*>& w, Recompute mode, int64_t d, int64_t f, double eps,
                         MlpBlockSaved<T>& s, PhaseTimer* timer, const cpu::Fp8Recipe* fp8) {
  const int64_t n = s.num_tokens;
  MOE_CHECK(mode != Recompute::kNone, "mlp_block_recompute: mode none recomputes nothing");
  MOE_CHECK(n > 0 && static_cast<int64_t>(s.x_in_ND.size()) == n * d, "mlp_block_recompute: the block input holds ",
            s.x_in_ND.size(), " values, expected ", n * d, " (forward not run?)");
  if (timer) timer->lap(Phase::kMlp);
  s.norm_ND.resize(n * d);
  if (mode == Recompute::kFull) {
    s.rstd_N.resize(n);
    cpu::rmsnorm_forward(s.x_in_ND.data(), w.mlp_norm, s.norm_ND.data(), s.rstd_N.data(), n, d, eps);
  } else {
    cpu::rmsnorm_apply(s.x_in_ND.data(), w.mlp_norm, s.rstd_N.data(), s.norm_ND.data(), n, d);
  }
  mlp_recompute(s.norm_ND.data(), w.mlp_gate, w.mlp_up, n, d, f, /*gate_up_kept=*/mode == Recompute::kSelective,
                s.mlp, fp8);
}

#define MOE_INSTANTIATE_MLP_RECOMPUTE(T)                                                                           \
  template void mlp_recompute<T>(const T*, const T*, const T*, int64_t, int64_t, int64_t, bool, MlpSaved<T>&,  \
                                 const cpu::Fp8Recipe*);                                                        \
  template void swap_recomputed<T>(Recompute, MlpBlockSaved<T>&, MlpBlockSaved<T>&);                           \
  template void mlp_block_recompute<T>(const MlpTensors<const T*>&, Recompute, int64_t, int64_t, double,       \
                                       MlpBlockSaved<T>&, PhaseTimer*, const cpu::Fp8Recipe*);
MOE_INSTANTIATE_MLP_RECOMPUTE(float)
MOE_INSTANTIATE_MLP_RECOMPUTE(double)
#undef MOE_INSTANTIATE_MLP_RECOMPUTE

template void mlp_forward<float>(const float*, const float*, const float*, const float*, int64_t,
                                 int64_t, int64_t, MlpSaved<float>&, float*, bool, const cpu::Fp8Recipe*);
template void mlp_forward<double>(const double*, const double*, const double*, const double*,
                                  int64_t, int64_t, int64_t, MlpSaved<double>&, double*, bool, const cpu::Fp8Recipe*);
template void mlp_backward<float>(const float*, const float*, const float*, const float*,
                                  const MlpSaved<float>&, const float*, int64_t, int64_t, int64_t,
                                  float*, float*, float*, float*, const cpu::Fp8Recipe*);
template void mlp_backward<double>(const double*, const double*, const double*, const double*,
                                   const MlpSaved<double>&, const double*, int64_t, int64_t, int64_t,
                                   double*, double*, double*, double*, const cpu::Fp8Recipe*);
template void mlp_block_forward<float>(const MlpTensors<const float*>&, int64_t, int64_t, int64_t, double, float*,
                                       MlpBlockSaved<float>&, PhaseTimer*, const cpu::Fp8Recipe*);
template void mlp_block_forward<double>(const MlpTensors<const double*>&, int64_t, int64_t, int64_t, double,
                                        double*, MlpBlockSaved<double>&, PhaseTimer*, const cpu::Fp8Recipe*);
template void mlp_block_backward<float>(const MlpTensors<const float*>&, const MlpBlockSaved<float>&, int64_t,
                                        int64_t, float*, const MlpTensors<float*>&, PhaseTimer*,
                                        const cpu::Fp8Recipe*);
template void mlp_block_backward<double>(const MlpTensors<const double*>&, const MlpBlockSaved<double>&, int64_t,
                                         int64_t, double*, const MlpTensors<double*>&, PhaseTimer*,
                                         const cpu::Fp8Recipe*);

}  // namespace moe
