// Sliced checkpoints written by every rank of the suite's world: ranges reassembled from the
// slices of all ranks, the tiling check at save (nothing published when it fails) and at load.
#include <gtest/gtest.h>

#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "parallel/comm.h"
#include "parallel/mpi_test_util.h"
#include "support/test_util.h"

namespace moe::testing {
namespace {

namespace fs = std::filesystem;

// Rank r of n owns [r * ceil(35 / n), ...) of tensor "w" [5, 7] (valued by flat index) and of
// its moment "w.exp_avg" (valued minus the index); rank 0 also writes "bias" [3] whole.
struct Slices {
  std::vector<float> w, m, bias = {7.f, 8.f, 9.f};
  SlicedCheckpointFiles files;
  Slices(int r, int n, int64_t shrink = 0) {
    const int64_t per = (35 + n - 1) / n, lo = std::min<int64_t>(35, r * per), hi = std::min<int64_t>(35, lo + per);
    for (int64_t i = lo; i < hi; ++i) {
      w.push_back(float(i));
      m.push_back(-float(i));
    }
    if (hi > lo) {
      files.model.push_back({"w", {5, 7}, lo, hi - lo - shrink, w.data()});
      files.optim.push_back({"w.exp_avg", {5, 7}, lo, hi - lo, m.data()});
    }
    if (r == 0) files.model.push_back({"bias", {3}, 0, 3, bias.data()});
    files.train_state = {{"note", "sliced"}};
  }
};

TEST(SlicedCheckpoint, RangesReassembleFromEveryRank) {
  Comm& w = world_comm();
  const SharedDir dir(w, "sliced");
  const Slices mine(w.rank(), w.size());
  const std::string step = save_checkpoint_sliced(w, (dir / "ckpt").string(), 3, mine.files, 0);
  EXPECT_EQ(step, (dir / "ckpt" / "step_3").string());
  const LoadedCheckpoint ck = LoadedCheckpoint::open(step);
  EXPECT_TRUE(ck.sliced());
  EXPECT_EQ(ck.world_size(), w.size());
  EXPECT_EQ(ck.step(), 3);
  EXPECT_EQ(ck.train_state().at("note"), "sliced");
  std::vector<float> full(35), part(20), bias(3);
  ck.read_model("w", {5, 7}, full.data());
  for (int i = 0; i < 35; ++i) EXPECT_EQ(full[size_t(i)], float(i));
  ck.read_optim_range("w.exp_avg", {5, 7}, 10, 20, part.data());
  for (int i = 0; i < 20; ++i) EXPECT_EQ(part[size_t(i)], -float(10 + i));
  ck.read_model("bias", {3}, bias.data());
  EXPECT_EQ(bias, mine.bias);
  ASSERT_EQ(ck.model_tensors().size(), 2u);
  EXPECT_EQ(ck.model_tensors()[0].num_slices + ck.model_tensors()[1].num_slices, w.size() + 1);
  EXPECT_TRUE(ck.has_model("bias"));
  EXPECT_CONTAINS(error_of([&] { ck.model(); }), "sliced over");
  EXPECT_CONTAINS(error_of([&] { ck.read_model("w", {7, 5}, full.data()); }), "has shape [5, 7], expected [7, 5]");
  w.barrier();

  // A manifest whose slices leave a gap is refused on load.
  if (w.rank() == 0) {
    const std::string mpath = step + "/manifest.json";
    nlohmann::json m = nlohmann::json::parse(std::ifstream(mpath));
    m["tensors"]["model"]["w"]["slices"][0]["offset"] = 1;
    std::ofstream(mpath, std::ios::trunc) << m.dump();
    EXPECT_CONTAINS(error_of([&] { LoadedCheckpoint::open(step); }), "the slices of tensor 'w' do not tile it");
  }
}

TEST(SlicedCheckpoint, SlicesThatDoNotTileFailTheSaveEverywhere) {
  Comm& w = world_comm();
  const SharedDir dir(w, "sliced_gap");
  const Slices short_by_one(w.rank(), w.size(), /*shrink=*/w.rank() == 0 ? 1 : 0);
  const std::string msg =
      error_of([&] { save_checkpoint_sliced(w, (dir / "ckpt").string(), 4, short_by_one.files, 0); });
  EXPECT_CONTAINS(msg, "checkpoint save of step 4 failed while publishing the step");
  if (w.rank() == 0) {
    EXPECT_CONTAINS(msg, "the slices of tensor 'w' ");  // a gap (several ranks) or a short cover (one)
  }
  w.barrier();
  EXPECT_FALSE(fs::exists(dir / "ckpt" / "step_4"));
  EXPECT_FALSE(fs::exists(dir / "ckpt" / "latest"));
  EXPECT_TRUE(list_steps((dir / "ckpt").string()).empty());
}

}  // namespace
}  // namespace moe::testing
