// The bench's GPU clock summary (train/gpu_clocks.h): the statistics and clock-event fractions of a
// set of samples, the console line, and a sampler that cannot sample (no NVML on the machine, or no
// device at the bus id) reporting why instead of failing.
#include "train/gpu_clocks.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace moe::testing {
namespace {

TEST(GpuClocks, SummaryAveragesSamplesAndCountsClockEvents) {
  const std::vector<GpuClockSample> samples = {
      {1980.0, 120.0, 0x0},    // idle-clocked, no event
      {1700.0, 690.0, 0x4},    // software power cap
      {1650.0, 700.0, 0x84},   // power cap and power brake: one capped sample
      {1600.0, 650.0, 0x28}};  // hardware slowdown and software thermal slowdown
  const nlohmann::json s = summarize_gpu_clocks(samples, 100);
  ASSERT_TRUE(s.at("available").get<bool>());
  EXPECT_EQ(s.at("samples").get<int64_t>(), 4);
  EXPECT_EQ(s.at("period_ms").get<int>(), 100);
  EXPECT_DOUBLE_EQ(s.at("sm_mhz").at("mean").get<double>(), (1980.0 + 1700.0 + 1650.0 + 1600.0) / 4);
  EXPECT_DOUBLE_EQ(s.at("sm_mhz").at("min").get<double>(), 1600.0);
  EXPECT_DOUBLE_EQ(s.at("sm_mhz").at("max").get<double>(), 1980.0);
  EXPECT_DOUBLE_EQ(s.at("power_w").at("mean").get<double>(), (120.0 + 690.0 + 700.0 + 650.0) / 4);
  EXPECT_DOUBLE_EQ(s.at("power_w").at("max").get<double>(), 700.0);
  EXPECT_DOUBLE_EQ(s.at("power_capped").get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(s.at("thermal").get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(s.at("hw_slowdown").get<double>(), 0.25);
  EXPECT_EQ(gpu_clocks_line(s),
            "GPU clocks while timed: SM 1732 MHz (1600-1980), 540 W; power cap in 50% of 4 samples, thermal 25%\n");
}

TEST(GpuClocks, NoSamplesSayWhy) {
  const nlohmann::json s = summarize_gpu_clocks({}, 100, "NVML not loaded: libnvidia-ml.so.1 missing");
  EXPECT_FALSE(s.at("available").get<bool>());
  EXPECT_EQ(s.at("reason").get<std::string>(), "NVML not loaded: libnvidia-ml.so.1 missing");
  EXPECT_EQ(gpu_clocks_line(s), "GPU clocks while timed: not sampled (NVML not loaded: libnvidia-ml.so.1 missing)\n");
  EXPECT_EQ(summarize_gpu_clocks({}, 100).at("reason").get<std::string>(), "no samples");
}

// No device has this bus id: without the driver's library the reason names NVML, with it the bus
// id; either way the sampler constructs, stops and summarises without throwing.
TEST(GpuClocks, SamplerWithoutADeviceReportsTheReason) {
  GpuClockSampler sampler("ffff:ff:1f.7", 10);
  sampler.stop();
  sampler.stop();  // idempotent
  const nlohmann::json s = sampler.summary();
  EXPECT_FALSE(s.at("available").get<bool>());
  const std::string reason = s.at("reason").get<std::string>();
  EXPECT_TRUE(reason.find("NVML") != std::string::npos || reason.find("ffff:ff:1f.7") != std::string::npos)
      << reason;
  GpuClockSampler no_id("", 10);
  EXPECT_EQ(no_id.summary().at("reason").get<std::string>(), "the CUDA runtime gave no PCI bus id for the GPU");
}

}  // namespace
}  // namespace moe::testing
