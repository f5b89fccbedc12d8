// The GPU's clocks and power while a bench times its steps. A step's time depends on the clock the
// GPU holds, which its power cap and thermal limits lower under a sustained load (an H100 SXM at
// its 700 W cap ran olmoe-8l's steps at 1636-1734 MHz against 1980 MHz idle), so `moecore bench`
// reports them beside its figures. The samples come from NVML, the driver's management library
// (libnvidia-ml.so.1, the one nvidia-smi uses), loaded at run time so that no build links it and a
// machine without the driver runs on: the sampler then reports why it has no samples.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

namespace moe {

// One sample: the SM clock, the board's power draw, and NVML's clock-event reasons (the bits of
// nvmlClocksEventReasons: 0x4 the software power cap, 0x8 hardware slowdown, 0x20 / 0x40 software /
// hardware thermal slowdown, 0x80 the hardware power brake).
struct GpuClockSample {
  double sm_mhz = 0.0;
  double power_w = 0.0;
  uint64_t reasons = 0;
};

// {"available": true, "samples", "period_ms", "sm_mhz": {"mean", "min", "max"}, "power_w": {"mean",
// "max"}, "power_capped", "thermal", "hw_slowdown"} (the last three: the fraction of samples with
// the power cap or power brake, a thermal slowdown, a hardware slowdown); with no samples,
// {"available": false, "reason"} (`reason` when given, else "no samples").
nlohmann::json summarize_gpu_clocks(const std::vector<GpuClockSample>& samples, int period_ms,
                                    const std::string& reason = "");

// One line for the bench's output: "GPU clocks while timed: SM 1705 MHz (1636-1734), 590 W; power cap
// in 91% of 57 samples, thermal 0%" or "GPU clocks while timed: not sampled (reason)".
std::string gpu_clocks_line(const nlohmann::json& summary);

// Samples the GPU at `pci_bus_id` every `period_ms` on a background thread from construction to
// stop() (or destruction). Never throws for a missing library or device: summary() then says why.
class GpuClockSampler {
 public:
  GpuClockSampler(const std::string& pci_bus_id, int period_ms);
  ~GpuClockSampler();
  GpuClockSampler(const GpuClockSampler&) = delete;
  GpuClockSampler& operator=(const GpuClockSampler&) = delete;

  // Ends sampling (idempotent).
  void stop();
  // summarize_gpu_clocks of the samples taken so far.
  nlohmann::json summary() const;

 private:
  void run();
  // nvmlShutdown after a successful init, then the library closed (idempotent).
  void release();

  int period_ms_;
  std::string reason_;  // why there are no samples, when there are none
  void* library_ = nullptr;
  bool nvml_up_ = false;  // nvmlInit_v2 succeeded
  void* device_ = nullptr;
  // NVML entry points (nvmlReturn_t is an int; 0 is success).
  int (*shutdown_)() = nullptr;
  int (*clock_)(void*, int, unsigned*) = nullptr;
  int (*power_)(void*, unsigned*) = nullptr;
  int (*reasons_)(void*, unsigned long long*) = nullptr;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::vector<GpuClockSample> samples_;
  std::thread thread_;
};

}  // namespace moe
