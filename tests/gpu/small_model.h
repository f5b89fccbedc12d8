// The small MoE model the CUDA model tests share: 3 layers of width 256 (4 query and 2 kv heads,
// head_dim 64, QK-norm), a dense first layer, then MoE layers of 8 experts, top-2, one shared
// expert, with the router's lb and z losses on. Tests change what they exercise on a copy.
#pragma once

#include "core/config.h"

namespace moe::testing {

inline ModelConfig small_gpu_model_config() {
  ModelConfig m;
  m.vocab_size = 256;
  m.d_model = 256;
  m.n_layers = 3;
  m.n_heads = 4;  // head_dim 64
  m.n_kv_heads = 2;
  m.qk_norm = true;
  m.dense_layers = {0};
  m.dense_hidden = 256;
  m.init_std = 0.02;
  return m;
}

inline MoeConfig small_gpu_moe_config() {
  MoeConfig e;
  e.num_experts = 8;
  e.top_k = 2;
  e.expert_hidden = 128;
  e.shared_experts = 1;
  e.lb_loss_weight = 0.01;
  e.z_loss_weight = 0.001;
  return e;
}

}  // namespace moe::testing
