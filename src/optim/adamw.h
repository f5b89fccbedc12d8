// AdamW with decoupled weight decay on FP32 master weights, FP32 moments, and the learning-
// rate schedule. Update per element (t = step count after increment):
//   p -= lr * wd * p (decay tensors only);  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
//   p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).
// optim.moment_dtype = "bf16": the moments are kept as BF16 values (here in FP32 buffers, each
// rounded to nearest even after its update; the GPU stores the BF16 bits); the update reads the
// rounded moments and computes in FP32, so p's step uses the FP32 m and v before their rounding.
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena.h"
#include "core/config.h"
#include "core/fp8_types.h"

namespace moe {

// Linear warmup over warmup_steps to lr, then cosine or linear decay to min_lr at
// total_steps (constant stays at lr). `step` counts from 0.
double lr_at(const OptimConfig& o, int64_t step, int64_t total_steps);

// Global L2 norm of a flat gradient buffer (double accumulation; padding is zero).
double global_grad_norm(const float* grads, int64_t n);
// Multiplies grads by min(1, max_norm / (norm + 1e-6)); returns the factor. max_norm <= 0: no clip.
double clip_grads(float* grads, int64_t n, double norm, double max_norm);

// The coefficients of step t (count after increment) at learning rate lr, and the element
// update shared by AdamW and the distributed optimizer (optim/zero1.h), so that both
// run the same FP32 math. decay = false: no weight decay (norms).
struct AdamWCoefs {
  float b1 = 0, b2 = 0, step_size = 0, inv_sqrt_bc2 = 0, eps = 0, decay_factor = 1;
  bool bf16_moments = false;  // optim.moment_dtype = "bf16": m and v read and stored as BF16 values
};
AdamWCoefs adamw_coefs(const OptimConfig& cfg, int64_t t, double lr);
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWCoefs& c, bool decay);
// The CPU twin of cuda::adamw_apply_fp8_weights: adamw_update of the experts' weights p [experts,
// n, k] (n, k positive multiples of 128), then the FP8 codes of their BF16 rounding, as the GPU
// quantises its BF16 copy: cpu::fp8_quantize_weights of bf16(p) into q, s and the transposed qt, st.
void adamw_update_fp8_weights(float* p, const float* g, float* m, float* v, int64_t experts, int64_t n, int64_t k,
                              const AdamWCoefs& c, bool decay, Fp8Format f, uint8_t* q, float* s, uint8_t* qt,
                              float* st, Fp8Rule rule = Fp8Rule::kBlocks);

class AdamW {
 public:
  AdamW(const ParamLayout& layout, const OptimConfig& cfg);
  void step(float* params, const float* grads, double lr);

  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }
  std::vector<float>& exp_avg() { return m_; }
  std::vector<float>& exp_avg_sq() { return v_; }

 private:
  const ParamLayout& layout_;
  OptimConfig cfg_;
  std::vector<float> m_, v_;
  int64_t t_ = 0;
};

}  // namespace moe
