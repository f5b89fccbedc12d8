// Greedy and nucleus sampling over the decode path (see the header).
#include "model/generate.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"

#ifdef MOECORE_HAS_CUDA
#include "cuda/device.h"
#include "model/cuda_model.h"
#endif

namespace moe {

int32_t sample_token(const float* logits, int64_t v, const SamplingOptions& o, int64_t draw) {
  MOE_CHECK(v > 0, "sample_token: empty vocabulary");
  MOE_CHECK(std::isfinite(o.temperature) && o.temperature >= 0, "--temperature must be a finite number >= 0, got ",
            o.temperature);
  MOE_CHECK(o.top_p > 0 && o.top_p <= 1, "--top-p must be in (0, 1], got ", o.top_p);
  for (int64_t i = 0; i < v; ++i)
    MOE_CHECK(std::isfinite(logits[i]), "generate: logit ", i, " is ", logits[i], " (the model produced a non-finite ",
              "value)");
  if (o.temperature == 0) return static_cast<int32_t>(std::max_element(logits, logits + v) - logits);
  const double m = *std::max_element(logits, logits + v);
  std::vector<double> p(v);
  double sum = 0;
  for (int64_t i = 0; i < v; ++i) sum += p[i] = std::exp((double(logits[i]) - m) / o.temperature);
  std::vector<int32_t> order(v);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
  // The nucleus: the shortest prefix of `order` holding top_p of the probability.
  int64_t keep = 0;
  double mass = 0;
  while (keep < v) {
    mass += p[order[keep++]] / sum;
    if (mass >= o.top_p) break;
  }
  double kept = 0;
  for (int64_t i = 0; i < keep; ++i) kept += p[order[i]];
  const uint64_t hi = bits_at(o.seed, 0, uint64_t(2 * draw)), lo = bits_at(o.seed, 0, uint64_t(2 * draw + 1));
  const double u = double(((hi << 32) | lo) >> 11) * 0x1.0p-53;  // [0, 1)
  double acc = 0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += p[order[i]] / kept;
    if (u < acc) return order[i];
  }
  return order[keep - 1];  // u within rounding of 1
}

Generation generate(const DecodeStep& step, int64_t v, const std::vector<int32_t>& prompt, int64_t max_new,
                    int64_t eos_id, const SamplingOptions& o, bool keep_logits) {
  MOE_CHECK(!prompt.empty(), "generate: the prompt has no tokens; give at least one");
  MOE_CHECK(max_new >= 0, "--max-new-tokens must be >= 0, got ", max_new);
  Generation g;
  if (max_new == 0) return g;
  std::vector<float> logits = step(prompt.data(), int64_t(prompt.size()));
  for (int64_t k = 0; k < max_new; ++k) {
    MOE_CHECK(int64_t(logits.size()) == v, "generate: the decoder returned ", logits.size(), " logits, expected ", v);
    const int32_t id = sample_token(logits.data(), v, o, k);
    g.ids.push_back(id);
    if (keep_logits) g.logits.insert(g.logits.end(), logits.begin(), logits.end());
    if (id == eos_id) {
      g.hit_eos = true;
      break;
    }
    if (k + 1 < max_new) logits = step(&id, 1);
  }
  return g;
}

DecodeStep cuda_decoder(const Model<float>& model) {
#ifdef MOECORE_HAS_CUDA
  MOE_CHECK(cuda::cuda_device_count() > 0, "generate on the GPU: no CUDA device is visible; use the CPU (--device cpu)");
  MOE_CHECK(model.expert_parallel() == nullptr, "generate on the GPU: the model must hold every expert");
  struct State {
    std::unique_ptr<CudaModel> gpu;
    CudaKvCache cache;
  };
  auto st = std::make_shared<State>();
  st->gpu = std::make_unique<CudaModel>(model.model_config(), model.moe_config());
  st->gpu->load_params(model.params());
  if (st->gpu->num_moe_layers() > 0) st->gpu->load_expert_bias(model.expert_bias());
  return [st](const int32_t* tokens, int64_t n) { return st->gpu->decode(tokens, n, st->cache); };
#else
  (void)model;
  MOE_FAIL("generate on the GPU: this build has no CUDA backend; use the CPU (--device cpu)");
#endif
}

Generation generate(Model<float>& model, const std::vector<int32_t>& prompt, int64_t max_new, int64_t eos_id,
                    const SamplingOptions& o, bool keep_logits) {
  const int64_t v = model.model_config().vocab_size;
  auto cache = std::make_shared<KvCache<float>>();
  const DecodeStep step = [&model, cache, v](const int32_t* tokens, int64_t n) {
    std::vector<float> all = model.decode(tokens, n, *cache);
    return std::vector<float>(all.end() - v, all.end());
  };
  return generate(step, v, prompt, max_new, eos_id, o, keep_logits);
}

}  // namespace moe
