// Expert-parallel token exchange on Comm::all_to_all / all_to_all_v. Counts first (L per peer),
// then rows: the send buffer is the dispatch-sorted buffer itself (peer p's rows are the
// contiguous block of experts [p*L, (p+1)*L)); the receive buffer (peer-major) is regrouped
// local-expert-major by one gather, and combine scatters back before the inverse exchange.
#include "parallel/expert_parallel.h"

#include <algorithm>
#include <climits>

#include "core/error.h"

namespace moe {

ExpertParallel make_expert_parallel(Comm& group, int64_t num_experts) {
  MOE_CHECK(num_experts > 0, "expert parallelism: num_experts must be > 0, got ", num_experts);
  MOE_CHECK(num_experts % group.size() == 0, "expert parallelism: parallel.ep = ", group.size(),
            " must divide moe.num_experts = ", num_experts);
  return ExpertParallel{&group, num_experts};
}

EpHandle ep_exchange_counts(const ExpertParallel& ep, const int32_t* counts_E) {
  MOE_CHECK(ep.group != nullptr, "expert parallelism: no EP group communicator");
  const int64_t peers = ep.size(), local = ep.local_experts();
  EpHandle h;
  std::vector<int64_t> send(peers * local);
  for (int64_t e = 0; e < ep.num_experts; ++e) {
    MOE_CHECK(counts_E[e] >= 0, "expert parallelism: negative row count ", counts_E[e], " for expert ", e);
    send[e] = counts_E[e];
  }
  h.num_recv_tokens_per_expert.assign(peers * local, 0);
  ep.group->all_to_all(send.data(), h.num_recv_tokens_per_expert.data(), local);

  h.num_rows_per_rank.assign(peers, 0);
  h.num_recv_rows_per_rank.assign(peers, 0);
  for (int64_t p = 0; p < peers; ++p) {
    for (int64_t j = 0; j < local; ++j) {
      h.num_rows_per_rank[p] += send[p * local + j];
      const int64_t c = h.num_recv_tokens_per_expert[p * local + j];
      MOE_CHECK(c >= 0, "expert parallelism: rank ", p, " announced ", c, " rows for local expert ", j);
      h.num_recv_rows_per_rank[p] += c;
    }
    h.num_rows += h.num_rows_per_rank[p];
    h.num_recv_rows += h.num_recv_rows_per_rank[p];
  }
  MOE_CHECK(h.num_recv_rows <= INT32_MAX, "expert parallelism: ", h.num_recv_rows,
            " received rows do not fit int32 row indices");

  // Grouped layout: expert j major, peer p minor. recv_start[p][j]: row of (p, j)'s first row in
  // the peer-major receive buffer.
  std::vector<int64_t> recv_start(peers * local);
  int64_t row = 0;
  for (int64_t p = 0; p < peers; ++p)
    for (int64_t j = 0; j < local; ++j) {
      recv_start[p * local + j] = row;
      row += h.num_recv_tokens_per_expert[p * local + j];
    }
  h.local_offsets.assign(local + 1, 0);
  h.grouped_to_recv.resize(h.num_recv_rows);
  int64_t g = 0;
  for (int64_t j = 0; j < local; ++j) {
    for (int64_t p = 0; p < peers; ++p) {
      const int64_t c = h.num_recv_tokens_per_expert[p * local + j], start = recv_start[p * local + j];
      for (int64_t i = 0; i < c; ++i) h.grouped_to_recv[g++] = static_cast<int32_t>(start + i);
    }
    h.local_offsets[j + 1] = static_cast<int32_t>(g);
  }
  return h;
}

namespace {

std::vector<int64_t> scaled(const std::vector<int64_t>& rows, int64_t d) {
  std::vector<int64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * d;
  return out;
}

void check_handle(const char* op, const ExpertParallel& ep, const EpHandle& h, int64_t d) {
  MOE_CHECK(ep.group != nullptr, op, ": no EP group communicator");
  MOE_CHECK(d > 0, op, ": row width must be > 0, got ", d);
  MOE_CHECK(static_cast<int64_t>(h.num_rows_per_rank.size()) == ep.size() &&
                static_cast<int64_t>(h.num_recv_rows_per_rank.size()) == ep.size(),
            op, ": handle built for ", h.num_rows_per_rank.size(), " ranks, EP group has ", ep.size());
}

}  // namespace

void ep_dispatch(const ExpertParallel& ep, const EpHandle& h, const float* x_sorted, int64_t d, float* x_grouped) {
  check_handle("ep_dispatch", ep, h, d);
  const std::vector<int64_t> send = scaled(h.num_rows_per_rank, d), recv = scaled(h.num_recv_rows_per_rank, d);
  std::vector<float> x_recv(h.num_recv_rows * d);
  ep.group->all_to_all_v(x_sorted, send.data(), x_recv.data(), recv.data());
  for (int64_t g = 0; g < h.num_recv_rows; ++g) {
    const float* src = x_recv.data() + static_cast<int64_t>(h.grouped_to_recv[g]) * d;
    std::copy(src, src + d, x_grouped + g * d);
  }
}

void ep_combine(const ExpertParallel& ep, const EpHandle& h, const float* y_grouped, int64_t d, float* y_sorted) {
  check_handle("ep_combine", ep, h, d);
  const std::vector<int64_t> send = scaled(h.num_recv_rows_per_rank, d), recv = scaled(h.num_rows_per_rank, d);
  std::vector<float> y_send(h.num_recv_rows * d);
  for (int64_t g = 0; g < h.num_recv_rows; ++g) {
    const float* src = y_grouped + g * d;
    std::copy(src, src + d, y_send.data() + static_cast<int64_t>(h.grouped_to_recv[g]) * d);
  }
  ep.group->all_to_all_v(y_send.data(), send.data(), y_sorted, recv.data());
}

}  // namespace moe
