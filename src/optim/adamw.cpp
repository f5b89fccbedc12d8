// AdamW step, schedule and gradient-norm clipping on flat FP32 buffers.
#include "optim/adamw.h"

#include <cmath>
#include <numbers>

#include "core/dtype.h"
#include "core/error.h"
#include "cpu/fp8.h"

namespace moe {

double lr_at(const OptimConfig& o, int64_t step, int64_t total_steps) {
  if (o.warmup_steps > 0 && step < o.warmup_steps) return o.lr * double(step + 1) / double(o.warmup_steps);
  if (o.schedule == "constant") return o.lr;
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - o.warmup_steps);
  const double progress = std::min(1.0, double(step - o.warmup_steps) / double(decay_steps));
  if (o.schedule == "linear") return o.lr + (o.min_lr - o.lr) * progress;
  MOE_CHECK(o.schedule == "cosine", "optim.schedule: expected cosine, linear or constant, got '", o.schedule, "'");
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

double global_grad_norm(const float* grads, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += double(grads[i]) * double(grads[i]);
  return std::sqrt(s);
}

double clip_grads(float* grads, int64_t n, double norm, double max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return 1.0;
  const double f = max_norm / (norm + 1e-6);
  const float ff = static_cast<float>(f);
  for (int64_t i = 0; i < n; ++i) grads[i] *= ff;
  return f;
}

AdamW::AdamW(const ParamLayout& layout, const OptimConfig& cfg)
    : layout_(layout), cfg_(cfg), m_(layout.total_numel(), 0.f), v_(layout.total_numel(), 0.f) {}

AdamWCoefs adamw_coefs(const OptimConfig& cfg, int64_t t, double lr) {
  const double bc1 = 1.0 - std::pow(cfg.beta1, double(t));
  const double bc2 = 1.0 - std::pow(cfg.beta2, double(t));
  AdamWCoefs c;
  c.b1 = float(cfg.beta1);
  c.b2 = float(cfg.beta2);
  c.step_size = float(lr / bc1);
  c.inv_sqrt_bc2 = float(1.0 / std::sqrt(bc2));
  c.eps = float(cfg.eps);
  c.decay_factor = float(1.0 - lr * cfg.weight_decay);
  return c;
}

void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWCoefs& c, bool decay) {
  const float b1 = c.b1, b2 = c.b2, step_size = c.step_size, inv_sqrt_bc2 = c.inv_sqrt_bc2, eps = c.eps;
  const float d = decay ? c.decay_factor : 1.f;
  for (int64_t i = 0; i < n; ++i) {
    m[i] = b1 * m[i] + (1.f - b1) * g[i];
    v[i] = b2 * v[i] + (1.f - b2) * g[i] * g[i];
    p[i] = p[i] * d - step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + eps);
  }
}

void adamw_update_fp8_weights(float* p, const float* g, float* m, float* v, int64_t experts, int64_t n, int64_t k,
                              const AdamWCoefs& c, bool decay, Fp8Format f, uint8_t* q, float* s, uint8_t* qt,
                              float* st, Fp8Rule rule) {
  MOE_CHECK(experts > 0 && n > 0 && k > 0 && n % 128 == 0 && k % 128 == 0,
            "adamw_update_fp8_weights: expected experts > 0 and n, k positive multiples of 128, got experts ",
            experts, " n ", n, " k ", k);
  const int64_t numel = experts * n * k;
  adamw_update(p, g, m, v, numel, c, decay);
  cpu::fp8_quantize_weights_bf16_rounded(p, experts, n, k, f, q, s, qt, st, rule);
}

void AdamW::step(float* params, const float* grads, double lr) {
  ++t_;
  const AdamWCoefs c = adamw_coefs(cfg_, t_, lr);
  for (const ParamEntry& e : layout_.entries())
    adamw_update(params + e.offset, grads + e.offset, m_.data() + e.offset, v_.data() + e.offset, e.numel, c, e.decay);
}

}  // namespace moe
