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

namespace {

// The grouped layout of the received rows from h.num_recv_tokens_per_expert: local expert j major,
// peer p minor, into h.local_offsets [L + 1] and h.grouped_to_recv (each grouped row's row in the
// peer-major receive buffer).
void fill_grouped_layout(EpHandle& h, int64_t peers, int64_t local) {
  std::vector<int64_t> recv_start(peers * local);  // (p, j)'s first row in the receive buffer
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
}

}  // namespace

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

  fill_grouped_layout(h, peers, local);
  return h;
}

EpPlacement ep_rowwise_placement(const std::vector<int64_t>& counts_all, int64_t ep, int64_t rank,
                                 int64_t num_experts, int64_t capacity) {
  MOE_CHECK(ep > 0 && num_experts > 0 && num_experts % ep == 0, "ep_rowwise_placement: ep = ", ep,
            " must divide num_experts = ", num_experts);
  MOE_CHECK(rank >= 0 && rank < ep, "ep_rowwise_placement: rank ", rank, " outside the group of ", ep);
  MOE_CHECK(static_cast<int64_t>(counts_all.size()) == ep * num_experts, "ep_rowwise_placement: ",
            counts_all.size(), " counts, expected ep x num_experts = ", ep * num_experts);
  const int64_t local = num_experts / ep;
  EpPlacement pl;
  pl.kept.assign(ep * num_experts, 0);
  // start[p * E + e]: the row of (source p, expert e)'s first kept row in its expert rank's buffer.
  std::vector<int64_t> start(ep * num_experts, 0);
  for (int64_t q = 0; q < ep; ++q) {
    int64_t row = 0;
    for (int64_t j = 0; j < local; ++j) {
      const int64_t e = q * local + j;
      int64_t taken = 0;
      for (int64_t p = 0; p < ep; ++p) {
        const int64_t c = counts_all[p * num_experts + e];
        MOE_CHECK(c >= 0, "ep_rowwise_placement: rank ", p, " announced ", c, " rows for expert ", e);
        const int64_t k = capacity > 0 ? std::min(c, std::max<int64_t>(0, capacity - taken)) : c;
        pl.kept[p * num_experts + e] = k;
        start[p * num_experts + e] = row;
        row += k;
        taken += k;
      }
      if (q == rank) {
        if (j == 0) pl.local_offsets.assign(local + 1, 0);
        MOE_CHECK(row <= INT32_MAX, "ep_rowwise_placement: ", row, " received rows do not fit int32 row indices");
        pl.local_offsets[j + 1] = static_cast<int32_t>(row);
      }
    }
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t c = counts_all[rank * num_experts + e], k = pl.kept[rank * num_experts + e];
    for (int64_t i = 0; i < c; ++i) pl.dest_row.push_back(i < k ? static_cast<int32_t>(start[rank * num_experts + e] + i) : -1);
    pl.num_dropped += c - k;
  }
  return pl;
}

EpHandle ep_rowwise_handle(const ExpertParallel& ep, const int32_t* counts_E, int64_t capacity) {
  MOE_CHECK(ep.group != nullptr, "expert parallelism: no EP group communicator");
  const int64_t peers = ep.size(), local = ep.local_experts(), e_all = ep.num_experts, me = ep.rank();
  std::vector<int64_t> mine(e_all), all(peers * e_all);
  for (int64_t e = 0; e < e_all; ++e) {
    MOE_CHECK(counts_E[e] >= 0, "expert parallelism: negative row count ", counts_E[e], " for expert ", e);
    mine[e] = counts_E[e];
  }
  ep.group->all_gather(mine.data(), all.data(), e_all);
  const EpPlacement pl = ep_rowwise_placement(all, peers, me, e_all, capacity);
  // The all-to-all handle of the kept rows: the same grouped layout.
  EpHandle h;
  h.num_rows_per_rank.assign(peers, 0);
  h.num_recv_rows_per_rank.assign(peers, 0);
  h.num_recv_tokens_per_expert.assign(peers * local, 0);
  for (int64_t p = 0; p < peers; ++p)
    for (int64_t j = 0; j < local; ++j) {
      h.num_rows_per_rank[p] += pl.kept[me * e_all + p * local + j];
      const int64_t c = pl.kept[p * e_all + me * local + j];
      h.num_recv_tokens_per_expert[p * local + j] = c;
      h.num_recv_rows_per_rank[p] += c;
    }
  for (int64_t p = 0; p < peers; ++p) {
    h.num_rows += h.num_rows_per_rank[p];
    h.num_recv_rows += h.num_recv_rows_per_rank[p];
  }
  // Received peer-major (each peer's kept rows in its send order), grouped as the placement says.
  fill_grouped_layout(h, peers, local);
  h.num_dropped = pl.num_dropped;
  if (pl.num_dropped > 0)
    for (size_t r = 0; r < pl.dest_row.size(); ++r)
      if (pl.dest_row[r] >= 0) h.send_rows.push_back(static_cast<int32_t>(r));
  h.num_rows = static_cast<int64_t>(pl.dest_row.size());  // every row of x_sorted (kept or not)
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
  std::vector<float> x_kept;  // the rowwise backend's kept rows, when it dropped some
  if (h.num_dropped > 0) {
    x_kept.resize(h.send_rows.size() * size_t(d));
    for (size_t i = 0; i < h.send_rows.size(); ++i) {
      const float* src = x_sorted + static_cast<int64_t>(h.send_rows[i]) * d;
      std::copy(src, src + d, x_kept.data() + static_cast<int64_t>(i) * d);
    }
    x_sorted = x_kept.data();
  }
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
  if (h.num_dropped == 0) {
    ep.group->all_to_all_v(y_send.data(), send.data(), y_sorted, recv.data());
    return;
  }
  // Rowwise with drops: the kept rows come back compact; the dropped rows' outputs are 0.
  std::vector<float> y_kept(h.send_rows.size() * size_t(d));
  ep.group->all_to_all_v(y_send.data(), send.data(), y_kept.data(), recv.data());
  std::fill(y_sorted, y_sorted + h.num_rows * d, 0.0f);
  for (size_t i = 0; i < h.send_rows.size(); ++i) {
    const float* src = y_kept.data() + static_cast<int64_t>(i) * d;
    std::copy(src, src + d, y_sorted + static_cast<int64_t>(h.send_rows[i]) * d);
  }
}

}  // namespace moe
