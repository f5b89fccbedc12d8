// SwiGLU MLP forward/backward on CPU GEMMs (strided writes into the fused [N, 2F] buffer), and
// the dense block around it (mlp_norm, residual).
#include "model/mlp.h"

#include "cpu/linear.h"
#include "cpu/rmsnorm.h"
#include "cpu/swiglu.h"

namespace moe {

template <typename T>
void mlp_forward(const T* x, const T* wg, const T* wu, const T* wd, int64_t n, int64_t d, int64_t f,
                 MlpSaved<T>& s, T* out, bool accumulate) {
  s.gate_up_N2F.resize(n * 2 * f);
  s.h_NF.resize(n * f);
  T* gu = s.gate_up_N2F.data();
  cpu::gemm<T>(false, true, n, f, d, T(1), x, d, wg, d, T(0), gu, 2 * f);
  cpu::gemm<T>(false, true, n, f, d, T(1), x, d, wu, d, T(0), gu + f, 2 * f);
  cpu::swiglu_forward(gu, s.h_NF.data(), n, f);
  cpu::gemm<T>(false, true, n, d, f, T(1), s.h_NF.data(), f, wd, f, accumulate ? T(1) : T(0), out, d);
}

template <typename T>
void mlp_backward(const T* x, const T* wg, const T* wu, const T* wd, const MlpSaved<T>& s,
                  const T* dout, int64_t n, int64_t d, int64_t f, T* dx, T* dwg, T* dwu, T* dwd) {
  std::vector<T> dh(n * f), dgu(n * 2 * f);
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
                       MlpBlockSaved<T>& s, PhaseTimer* timer) {
  if (timer) timer->lap(Phase::kMlp);
  s.num_tokens = n;
  s.x_in_ND.assign(x, x + n * d);
  s.norm_ND.resize(n * d);
  s.rstd_N.resize(n);
  cpu::rmsnorm_forward(x, w.mlp_norm, s.norm_ND.data(), s.rstd_N.data(), n, d, eps);
  mlp_forward(s.norm_ND.data(), w.mlp_gate, w.mlp_up, w.mlp_down, n, d, f, s.mlp, x, /*accumulate=*/true);
}

template <typename T>
void mlp_block_backward(const MlpTensors<const T*>& w, const MlpBlockSaved<T>& s, int64_t d, int64_t f, T* dx,
                        const MlpTensors<T*>& dw, PhaseTimer* timer) {
  const int64_t n = s.num_tokens;
  if (timer) timer->lap(Phase::kMlp);
  std::vector<T> dnorm(n * d), dtmp(n * d);  // dnorm accumulates from zero
  mlp_backward(s.norm_ND.data(), w.mlp_gate, w.mlp_up, w.mlp_down, s.mlp, dx, n, d, f, dnorm.data(), dw.mlp_gate,
               dw.mlp_up, dw.mlp_down);
  cpu::rmsnorm_backward(s.x_in_ND.data(), w.mlp_norm, s.rstd_N.data(), dnorm.data(), dtmp.data(), dw.mlp_norm, n, d);
  for (int64_t i = 0; i < n * d; ++i) dx[i] += dtmp[i];
}

template void mlp_forward<float>(const float*, const float*, const float*, const float*, int64_t,
                                 int64_t, int64_t, MlpSaved<float>&, float*, bool);
template void mlp_forward<double>(const double*, const double*, const double*, const double*,
                                  int64_t, int64_t, int64_t, MlpSaved<double>&, double*, bool);
template void mlp_backward<float>(const float*, const float*, const float*, const float*,
                                  const MlpSaved<float>&, const float*, int64_t, int64_t, int64_t,
                                  float*, float*, float*, float*);
template void mlp_backward<double>(const double*, const double*, const double*, const double*,
                                   const MlpSaved<double>&, const double*, int64_t, int64_t, int64_t,
                                   double*, double*, double*, double*);
template void mlp_block_forward<float>(const MlpTensors<const float*>&, int64_t, int64_t, int64_t, double, float*,
                                       MlpBlockSaved<float>&, PhaseTimer*);
template void mlp_block_forward<double>(const MlpTensors<const double*>&, int64_t, int64_t, int64_t, double,
                                        double*, MlpBlockSaved<double>&, PhaseTimer*);
template void mlp_block_backward<float>(const MlpTensors<const float*>&, const MlpBlockSaved<float>&, int64_t,
                                        int64_t, float*, const MlpTensors<float*>&, PhaseTimer*);
template void mlp_block_backward<double>(const MlpTensors<const double*>&, const MlpBlockSaved<double>&, int64_t,
                                         int64_t, double*, const MlpTensors<double*>&, PhaseTimer*);

}  // namespace moe
