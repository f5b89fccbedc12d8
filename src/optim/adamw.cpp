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
  MOE_CHECK(cfg.moment_dtype == "fp32" || cfg.moment_dtype == "bf16",
            "optim.moment_dtype: expected fp32 or bf16, got '", cfg.moment_dtype, "'");
  c.bf16_moments = cfg.moment_dtype == "bf16";
  return c;
}

namespace {

float round_to_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

template <bool kBf16>
void adamw_update_as(float* p, const float* g, float* m, float* v, int64_t n, const AdamWCoefs& c, bool decay) {
  const float b1 = c.b1, b2 = c.b2, step_size = c.step_size, inv_sqrt_bc2 = c.inv_sqrt_bc2, eps = c.eps;
  const float d = decay ? c.decay_factor : 1.f;
  for (int64_t i = 0; i < n; ++i) {
    // BF16 moments: what the buffers hold is read as its BF16 value (a no-op after the first
    // update; the moments a checkpoint restored are rounded here, as the GPU rounds them on load).
    const float mi = kBf16 ? round_to_bf16(m[i]) : m[i], vi = kBf16 ? round_to_bf16(v[i]) : v[i];
    const float mn = b1 * mi + (1.f - b1) * g[i];
    const float vn = b2 * vi + (1.f - b2) * g[i] * g[i];
    p[i] = p[i] * d - step_size * mn / (std::sqrt(vn) * inv_sqrt_bc2 + eps);
    m[i] = kBf16 ? round_to_bf16(mn) : mn;
    v[i] = kBf16 ? round_to_bf16(vn) : vn;
  }
}

}  // namespace

void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWCoefs& c, bool decay) {
  if (c.bf16_moments) {
    adamw_update_as<true>(p, g, m, v, n, c, decay);
  } else {
    adamw_update_as<false>(p, g, m, v, n, c, decay);
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
