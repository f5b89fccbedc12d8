// AdamW step, schedule and gradient-norm clipping on flat FP32 buffers.
#include "optim/adamw.h"

#include <cmath>
#include <numbers>

#include "core/error.h"

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

void AdamW::step(float* params, const float* grads, double lr) {
  ++t_;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, double(t_));
  const double bc2 = 1.0 - std::pow(cfg_.beta2, double(t_));
  const float b1 = float(cfg_.beta1), b2 = float(cfg_.beta2);
  const float step_size = float(lr / bc1);
  const float inv_sqrt_bc2 = float(1.0 / std::sqrt(bc2));
  const float eps = float(cfg_.eps);
  for (const ParamEntry& e : layout_.entries()) {
    float* p = params + e.offset;
    const float* g = grads + e.offset;
    float* m = m_.data() + e.offset;
    float* v = v_.data() + e.offset;
    const float decay = e.decay ? float(1.0 - lr * cfg_.weight_decay) : 1.f;
    for (int64_t i = 0; i < e.numel; ++i) {
      m[i] = b1 * m[i] + (1.f - b1) * g[i];
      v[i] = b2 * v[i] + (1.f - b2) * g[i] * g[i];
      p[i] = p[i] * decay - step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + eps);
    }
  }
}

}  // namespace moe
