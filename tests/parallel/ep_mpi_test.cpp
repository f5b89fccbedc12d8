// Expert parallelism over MPI: every case of ep_cases.h on the job's world communicator, for
// each EP size (2 and 4) that divides the world size; run with mpirun -np 2 and -np 4. On a
// one-rank world the tests skip (the thread-rank variant, ep_thread_test.cpp, runs instead). With
// train.recompute selective and full the gradients on each rank equal those of none bitwise.
// Every rank runs the same collectives in the same order whatever its checks find, so a failure
// shows as a failed test on that rank, never as a hang.
#include "ep_cases.h"
#include "parallel/comm.h"

namespace moe::testing {
namespace {

bool world_fits(int64_t ep) {
  const int w = world_comm().size();
  return w >= 2 && w % ep == 0;
}

class EpMpi : public ::testing::TestWithParam<int64_t> {};  // ep

TEST_P(EpMpi, LayerMatchesSingleProcess) {
  const int64_t ep = GetParam();
  if (!world_fits(ep)) GTEST_SKIP() << "needs an MPI world whose size ep = " << ep << " divides (mpirun -np 2 or 4)";
  Comm& world = world_comm();
  for (const LayerCase& c : layer_cases(ep)) {
    const EpHandle h = check_layer_case(world, c);
    expect_layer_scenario(c, h, world.rank());
  }
}

TEST_P(EpMpi, ModelMatchesSingleProcess) {
  const int64_t ep = GetParam();
  if (!world_fits(ep)) GTEST_SKIP() << "needs an MPI world whose size ep = " << ep << " divides (mpirun -np 2 or 4)";
  Comm& world = world_comm();
  for (const ModelCase& c : model_cases(ep)) {
    const ModelCheck r = check_model_case(world, c);
    expect_model_scenario(world, c, r);
  }
}

TEST_P(EpMpi, RecomputeGradientsBitwiseEqualToNone) {
  const int64_t ep = GetParam();
  if (!world_fits(ep)) GTEST_SKIP() << "needs an MPI world whose size ep = " << ep << " divides (mpirun -np 2 or 4)";
  for (const ModelCase& c : model_cases(ep)) check_model_recompute_case(world_comm(), c);
}

// The FP8 recipe under expert parallelism (block and MX scaling): x_sorted and dy travel as FP8
// payloads; layer, model and recomputation as above, the experts' weight gradients within FP8
// rounding where the reference's blocks of an expert's rows differ (ep_check.h).
TEST_P(EpMpi, Fp8RecipeMatchesSingleProcess) {
  const int64_t ep = GetParam();
  if (!world_fits(ep)) GTEST_SKIP() << "needs an MPI world whose size ep = " << ep << " divides (mpirun -np 2 or 4)";
  Comm& world = world_comm();
  for (const char* scaling : {"blocks", "mx"}) {
    const cpu::Fp8Recipe r = cpu::fp8_recipe_named(scaling);
    for (const LayerCase& c : layer_cases(ep)) check_layer_case(world, c, &r);
    for (const ModelCase& c : model_cases(ep)) {
      check_model_case(world, c, &r);
      check_model_recompute_case(world, c, &r);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ep, EpMpi, ::testing::Values(int64_t{2}, int64_t{4}),
                         [](const auto& info) { return "ep" + std::to_string(info.param); });

}  // namespace
}  // namespace moe::testing
