// Parameter names follow Hugging Face conventions (OLMoE / Qwen2-MoE / transformers 5 fused
// experts): experts are stacked, gate_up_proj [E, 2I, D] with gate rows first, down_proj [E, D, I].
#include "model/layout.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace moe {

bool is_dense_layer(const ModelConfig& m, int64_t l) {
  return std::find(m.dense_layers.begin(), m.dense_layers.end(), l) != m.dense_layers.end();
}

int64_t num_moe_layers(const ModelConfig& m) {
  int64_t n = 0;
  for (int64_t l = 0; l < m.n_layers; ++l) n += is_dense_layer(m, l) ? 0 : 1;
  return n;
}

std::string layer_prefix(int64_t l) { return "model.layers." + std::to_string(l) + "."; }

bool LayoutPart::whole() const {
  return embed && head && std::all_of(layers.begin(), layers.end(), [](char c) { return c != 0; });
}

ParamLayout build_param_layout(const ModelConfig& m, const MoeConfig& e, const ExpertSlice& slice,
                               const LayoutPart& part) {
  MOE_CHECK(part.layers.empty() || int64_t(part.layers.size()) == m.n_layers, "layout part: ", part.layers.size(),
            " layer flags for model.n_layers = ", m.n_layers);
  MOE_CHECK(slice.count >= 0 && slice.first >= 0 && slice.first + slice.count <= e.num_experts,
            "expert slice must lie in [0, num_experts=", e.num_experts, "), got first=", slice.first,
            " count=", slice.count);
  const int64_t local_experts = slice.count > 0 ? slice.count : e.num_experts;
  const int64_t d = m.d_model, hd = m.head_dim();
  const int64_t q = m.n_heads * hd, kv = m.n_kv_heads * hd;
  const bool kNoDecay = false;
  ParamLayout p;
  if (part.embed) p.add("model.embed_tokens.weight", {m.vocab_size, d});
  for (int64_t l = 0; l < m.n_layers; ++l) {
    if (!part.holds(l)) continue;
    const std::string pre = layer_prefix(l);
    p.add(pre + "input_layernorm.weight", {d}, kNoDecay);
    p.add(pre + "self_attn.q_proj.weight", {q, d});
    p.add(pre + "self_attn.k_proj.weight", {kv, d});
    p.add(pre + "self_attn.v_proj.weight", {kv, d});
    p.add(pre + "self_attn.o_proj.weight", {d, q});
    if (m.qk_norm) {
      p.add(pre + "self_attn.q_norm.weight", {q}, kNoDecay);
      p.add(pre + "self_attn.k_norm.weight", {kv}, kNoDecay);
    }
    p.add(pre + "post_attention_layernorm.weight", {d}, kNoDecay);
    if (is_dense_layer(m, l)) {
      p.add(pre + "mlp.gate_proj.weight", {m.dense_hidden, d});
      p.add(pre + "mlp.up_proj.weight", {m.dense_hidden, d});
      p.add(pre + "mlp.down_proj.weight", {d, m.dense_hidden});
    } else {
      p.add(pre + "mlp.gate.weight", {e.num_experts, d});
      p.add(pre + "mlp.experts.gate_up_proj", {local_experts, 2 * e.expert_hidden, d}, true, true);
      p.add(pre + "mlp.experts.down_proj", {local_experts, d, e.expert_hidden}, true, true);
      if (e.shared_experts > 0) {
        const int64_t sh = e.shared_experts * e.expert_hidden;
        p.add(pre + "mlp.shared_expert.gate_proj.weight", {sh, d});
        p.add(pre + "mlp.shared_expert.up_proj.weight", {sh, d});
        p.add(pre + "mlp.shared_expert.down_proj.weight", {d, sh});
      }
    }
  }
  if (part.head) {
    p.add("model.norm.weight", {d}, kNoDecay);
    p.add("lm_head.weight", {m.vocab_size, d});
  }
  return p;
}

ModelCounts count_model(const ModelConfig& m, const MoeConfig& e, int64_t seq_len) {
  ModelCounts c;
  const ParamLayout layout = build_param_layout(m, e);
  c.total_params = layout.param_count();
  const int64_t d = m.d_model, hd = m.head_dim();
  const double attn_proj = double(d) * (m.n_heads * hd) + 2.0 * d * (m.n_kv_heads * hd) +
                           double(m.n_heads * hd) * d;
  const double attn_scores = 6.0 * m.n_heads * hd * seq_len;  // causal: 12 * H * hd * S / 2
  const double moe_mm = double(d) * e.num_experts + e.top_k * 3.0 * d * e.expert_hidden +
                        e.shared_experts * 3.0 * d * e.expert_hidden;
  const double dense_mm = 3.0 * d * m.dense_hidden;
  double matmul = 0, attn = 0;
  for (int64_t l = 0; l < m.n_layers; ++l) {
    matmul += attn_proj + (is_dense_layer(m, l) ? dense_mm : moe_mm);
    attn += attn_scores;
  }
  matmul += double(d) * m.vocab_size;  // LM head
  c.flops_per_token = 6.0 * matmul + attn;
  // Active: everything except the (E - top_k) experts a token does not visit.
  const int64_t per_expert = 3 * d * e.expert_hidden;
  c.active_params = c.total_params - num_moe_layers(m) * (e.num_experts - e.top_k) * per_expert;
  return c;
}

}  // namespace moe

namespace moe {
std::vector<LayerParams> layer_params(const ParamLayout& layout, const ModelConfig& m, const MoeConfig& e) {
  std::vector<LayerParams> out;
  int64_t moe_index = 0;
  for (int64_t l = 0; l < m.n_layers; ++l) {
    const std::string pre = layer_prefix(l);
    auto off = [&](const std::string& n) { return layout.find(pre + n).offset; };
    LayerParams p;
    if (!layout.contains(pre + "input_layernorm.weight")) {  // another pipeline stage's layer
      p.attn_norm = p.q_proj = p.k_proj = p.v_proj = p.o_proj = p.mlp_norm = -1;
      p.present = false;
      p.dense = is_dense_layer(m, l);
      if (!p.dense) p.moe_index = moe_index++;
      out.push_back(p);
      continue;
    }
    p.attn_norm = off("input_layernorm.weight");
    p.q_proj = off("self_attn.q_proj.weight");
    p.k_proj = off("self_attn.k_proj.weight");
    p.v_proj = off("self_attn.v_proj.weight");
    p.o_proj = off("self_attn.o_proj.weight");
    if (m.qk_norm) {
      p.q_norm = off("self_attn.q_norm.weight");
      p.k_norm = off("self_attn.k_norm.weight");
    }
    p.mlp_norm = off("post_attention_layernorm.weight");
    p.dense = is_dense_layer(m, l);
    if (p.dense) {
      p.mlp_gate = off("mlp.gate_proj.weight");
      p.mlp_up = off("mlp.up_proj.weight");
      p.mlp_down = off("mlp.down_proj.weight");
      p.mlp_hidden = m.dense_hidden;
    } else {
      p.moe_index = moe_index++;
      p.router = off("mlp.gate.weight");
      p.experts_gate_up = off("mlp.experts.gate_up_proj");
      p.experts_down = off("mlp.experts.down_proj");
      p.shared = e.shared_experts > 0;
      if (p.shared) {
        p.mlp_gate = off("mlp.shared_expert.gate_proj.weight");
        p.mlp_up = off("mlp.shared_expert.up_proj.weight");
        p.mlp_down = off("mlp.shared_expert.down_proj.weight");
        p.mlp_hidden = e.shared_experts * e.expert_hidden;
      }
    }
    out.push_back(p);
  }
  return out;
}
}  // namespace moe

namespace moe {
std::vector<FlatRange> flat_ranges(const ParamLayout& layout, bool expert) {
  std::vector<FlatRange> out;
  const auto& entries = layout.entries();
  for (size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].expert != expert) continue;
    const int64_t begin = entries[i].offset;
    const int64_t end = i + 1 < entries.size() ? entries[i + 1].offset : layout.total_numel();
    if (!out.empty() && out.back().end == begin) {
      out.back().end = end;
    } else {
      out.push_back({begin, end});
    }
  }
  return out;
}

std::vector<int64_t> grad_group_starts(const ParamLayout& layout, int64_t n_layers) {
  const std::string block = "model.layers.";
  std::vector<int64_t> start(size_t(n_layers + 2), -1);
  int64_t prev = 0;
  for (const ParamEntry& e : layout.entries()) {
    int64_t g = n_layers + 1;  // final norm, LM head
    if (e.name.rfind("model.embed_tokens.", 0) == 0) {
      g = 0;
    } else if (e.name.rfind(block, 0) == 0) {
      g = 1 + std::stoll(e.name.substr(block.size()));
    }
    MOE_CHECK(g >= prev && g <= n_layers + 1, "grad_group_starts: tensor ", e.name, " is out of the order embedding, "
              "blocks 0..", n_layers - 1, ", final norm and LM head");
    if (start[size_t(g)] < 0) start[size_t(g)] = e.offset;
    prev = g;
  }
  for (size_t g = 0; g < start.size(); ++g)
    MOE_CHECK(start[g] >= 0, "grad_group_starts: group ", g, " (0: embedding, l + 1: block l, ", n_layers + 1,
              ": final norm and LM head) has no tensor");
  MOE_CHECK(start[0] == 0, "grad_group_starts: the embedding must open the layout");
  return start;
}
}  // namespace moe
