// Dispatch map (counting sort), permute (gather) and unpermute (weighted combine) on CPU,
// forward and backward. Row indices are checked against their buffers; data moves are plain
// copies, so integer-valued data comes out bit-exact.
#include "cpu/dispatch.h"

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace moe::cpu {

void build_dispatch_map(const int32_t* topk_idx, int64_t num_tokens, int64_t top_k,
                        int64_t num_experts, int32_t* num_tokens_per_expert,
                        int32_t* expert_offsets, int32_t* sorted_route, int32_t* route_to_row) {
  MOE_CHECK(num_tokens >= 0, "build_dispatch_map: num_tokens must be >= 0, got ", num_tokens);
  MOE_CHECK(num_experts > 0, "build_dispatch_map: num_experts must be > 0, got ", num_experts);
  MOE_CHECK(top_k >= 1 && top_k <= num_experts, "build_dispatch_map: top_k must be in [1, num_experts=",
            num_experts, "], got top_k=", top_k);
  const int64_t routes = num_tokens * top_k;
  MOE_CHECK(routes <= INT32_MAX, "build_dispatch_map: T*k = ", routes,
            " routes do not fit int32 row indices");
  std::fill(num_tokens_per_expert, num_tokens_per_expert + num_experts, 0);
  for (int64_t r = 0; r < routes; ++r) {
    const int32_t e = topk_idx[r];
    MOE_CHECK(e >= 0 && e < num_experts, "build_dispatch_map: expert index must be in [0, ",
              num_experts, "), got ", e, " at token ", r / top_k, " slot ", r % top_k);
    ++num_tokens_per_expert[e];
  }
  expert_offsets[0] = 0;
  for (int64_t e = 0; e < num_experts; ++e)
    expert_offsets[e + 1] = expert_offsets[e] + num_tokens_per_expert[e];
  // Scatter in increasing route id: each expert's rows keep route order (stable).
  for (int64_t e = 0; e < num_experts; ++e) num_tokens_per_expert[e] = 0;
  for (int64_t r = 0; r < routes; ++r) {
    const int32_t e = topk_idx[r];
    const int32_t row = expert_offsets[e] + num_tokens_per_expert[e]++;
    sorted_route[row] = static_cast<int32_t>(r);
    route_to_row[r] = row;
  }
}

template <typename T>
void permute_forward(const T* x, const int32_t* sorted_route, int64_t rows, int64_t top_k, int64_t d,
                     T* x_sorted) {
  MOE_CHECK(top_k >= 1, "permute_forward: top_k must be >= 1, got ", top_k);
  for (int64_t row = 0; row < rows; ++row) {
    const int32_t r = sorted_route[row];
    MOE_CHECK(r >= -1, "permute_forward: route id must be >= 0 (or -1 for padding), got ", r,
              " at row ", row);
    T* dst = x_sorted + row * d;
    if (r < 0) {
      std::fill(dst, dst + d, T(0));
    } else {
      const T* src = x + (r / top_k) * d;
      std::copy(src, src + d, dst);
    }
  }
}

template <typename T>
void permute_backward(const T* dx_sorted, const int32_t* sorted_route, int64_t rows, int64_t top_k,
                      int64_t d, T* dx) {
  MOE_CHECK(top_k >= 1, "permute_backward: top_k must be >= 1, got ", top_k);
  for (int64_t row = 0; row < rows; ++row) {
    const int32_t r = sorted_route[row];
    MOE_CHECK(r >= -1, "permute_backward: route id must be >= 0 (or -1 for padding), got ", r,
              " at row ", row);
    if (r < 0) continue;
    const T* src = dx_sorted + row * d;
    T* dst = dx + (r / top_k) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] += src[i];
  }
}

template <typename T>
void unpermute_forward(const T* y_sorted, const int32_t* route_to_row, const T* topk_w,
                       int64_t num_tokens, int64_t top_k, int64_t d, T* out) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    T* o = out + t * d;
    std::fill(o, o + d, T(0));
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t row = route_to_row[t * top_k + j];
      MOE_CHECK(row >= -1, "unpermute_forward: row must be >= 0 (or -1 for dropped), got ", row,
                " at token ", t, " slot ", j);
      if (row < 0) continue;
      const T w = topk_w[t * top_k + j];
      const T* y = y_sorted + static_cast<int64_t>(row) * d;
      for (int64_t i = 0; i < d; ++i) o[i] += w * y[i];
    }
  }
}

template <typename T>
void unpermute_forward_add(const T* y_sorted, const int32_t* route_to_row, const T* topk_w,
                           int64_t num_tokens, int64_t top_k, int64_t d, T* acc) {
  std::vector<T> out(static_cast<size_t>(num_tokens * d));
  unpermute_forward(y_sorted, route_to_row, topk_w, num_tokens, top_k, d, out.data());
  for (size_t i = 0; i < out.size(); ++i) acc[i] += out[i];
}

template <typename T>
void unpermute_backward(const T* dout, const T* y_sorted, const int32_t* route_to_row,
                        const T* topk_w, int64_t num_tokens, int64_t top_k, int64_t d, int64_t rows,
                        T* dy_sorted, T* dtopk_w) {
  std::fill(dy_sorted, dy_sorted + rows * d, T(0));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* g = dout + t * d;
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t row = route_to_row[t * top_k + j];
      MOE_CHECK(row >= -1 && row < rows, "unpermute_backward: row must be in [0, rows=", rows,
                ") or -1 for dropped, got ", row, " at token ", t, " slot ", j);
      if (row < 0) {
        dtopk_w[t * top_k + j] = T(0);
        continue;
      }
      const T w = topk_w[t * top_k + j];
      const T* y = y_sorted + static_cast<int64_t>(row) * d;
      T* dy = dy_sorted + static_cast<int64_t>(row) * d;
      T acc = 0;
      for (int64_t i = 0; i < d; ++i) {
        dy[i] += w * g[i];
        acc += g[i] * y[i];
      }
      dtopk_w[t * top_k + j] = acc;
    }
  }
}

#define MOE_INSTANTIATE_DISPATCH(T)                                                              \
  template void permute_forward<T>(const T*, const int32_t*, int64_t, int64_t, int64_t, T*);      \
  template void permute_backward<T>(const T*, const int32_t*, int64_t, int64_t, int64_t, T*);     \
  template void unpermute_forward<T>(const T*, const int32_t*, const T*, int64_t, int64_t,        \
                                     int64_t, T*);                                               \
  template void unpermute_forward_add<T>(const T*, const int32_t*, const T*, int64_t, int64_t,    \
                                         int64_t, T*);                                           \
  template void unpermute_backward<T>(const T*, const T*, const int32_t*, const T*, int64_t,      \
                                      int64_t, int64_t, int64_t, T*, T*);
MOE_INSTANTIATE_DISPATCH(float)
MOE_INSTANTIATE_DISPATCH(double)
#undef MOE_INSTANTIATE_DISPATCH

}  // namespace moe::cpu
