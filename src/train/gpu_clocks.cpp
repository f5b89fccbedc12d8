// GpuClockSampler: NVML through dlopen/dlsym (the documented C entry points, declared here with
// their ABI: nvmlReturn_t is an int enum, 0 success; nvmlDevice_t an opaque pointer; clocks in MHz,
// power in milliwatts), polled on one thread.
#include "train/gpu_clocks.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace moe {

namespace {

constexpr int kNvmlClockSm = 1;  // NVML_CLOCK_SM
constexpr uint64_t kPowerCap = 0x4 | 0x80;   // software power cap, hardware power brake
constexpr uint64_t kThermal = 0x20 | 0x40;   // software, hardware thermal slowdown
constexpr uint64_t kHwSlowdown = 0x8;

template <typename Fn>
Fn symbol(void* library, const char* name) {
  return reinterpret_cast<Fn>(dlsym(library, name));
}

}  // namespace

nlohmann::json summarize_gpu_clocks(const std::vector<GpuClockSample>& samples, int period_ms,
                                    const std::string& reason) {
  if (samples.empty()) return {{"available", false}, {"reason", reason.empty() ? "no samples" : reason}};
  double mhz_sum = 0.0, watt_sum = 0.0, mhz_min = samples[0].sm_mhz, mhz_max = samples[0].sm_mhz, watt_max = 0.0;
  int64_t capped = 0, thermal = 0, slowdown = 0;
  for (const GpuClockSample& s : samples) {
    mhz_sum += s.sm_mhz;
    watt_sum += s.power_w;
    mhz_min = std::min(mhz_min, s.sm_mhz);
    mhz_max = std::max(mhz_max, s.sm_mhz);
    watt_max = std::max(watt_max, s.power_w);
    capped += (s.reasons & kPowerCap) != 0 ? 1 : 0;
    thermal += (s.reasons & kThermal) != 0 ? 1 : 0;
    slowdown += (s.reasons & kHwSlowdown) != 0 ? 1 : 0;
  }
  const double n = static_cast<double>(samples.size());
  return {{"available", true},
          {"samples", samples.size()},
          {"period_ms", period_ms},
          {"sm_mhz", {{"mean", mhz_sum / n}, {"min", mhz_min}, {"max", mhz_max}}},
          {"power_w", {{"mean", watt_sum / n}, {"max", watt_max}}},
          {"power_capped", double(capped) / n},
          {"thermal", double(thermal) / n},
          {"hw_slowdown", double(slowdown) / n}};
}

std::string gpu_clocks_line(const nlohmann::json& summary) {
  char buf[256];
  if (!summary.value("available", false)) {
    std::snprintf(buf, sizeof buf, "GPU clocks while timed: not sampled (%s)\n",
                  summary.value("reason", std::string("no samples")).c_str());
    return buf;
  }
  const nlohmann::json& mhz = summary.at("sm_mhz");
  std::snprintf(buf, sizeof buf,
                "GPU clocks while timed: SM %.0f MHz (%.0f-%.0f), %.0f W; power cap in %.0f%% of %lld samples, "
                "thermal %.0f%%\n",
                mhz.at("mean").get<double>(), mhz.at("min").get<double>(), mhz.at("max").get<double>(),
                summary.at("power_w").at("mean").get<double>(), 100.0 * summary.at("power_capped").get<double>(),
                static_cast<long long>(summary.at("samples").get<int64_t>()),
                100.0 * summary.at("thermal").get<double>());
  return buf;
}

GpuClockSampler::GpuClockSampler(const std::string& pci_bus_id, int period_ms) : period_ms_(std::max(1, period_ms)) {
  if (pci_bus_id.empty()) {
    reason_ = "the CUDA runtime gave no PCI bus id for the GPU";
    return;
  }
  library_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library_ == nullptr) {
    const char* why = dlerror();
    reason_ = std::string("NVML not loaded: ") + (why != nullptr ? why : "libnvidia-ml.so.1 not found");
    return;
  }
  const auto fail = [&](std::string why) {
    reason_ = std::move(why);
    release();
  };
  auto init = symbol<int (*)()>(library_, "nvmlInit_v2");
  auto by_bus = symbol<int (*)(const char*, void**)>(library_, "nvmlDeviceGetHandleByPciBusId_v2");
  shutdown_ = symbol<int (*)()>(library_, "nvmlShutdown");
  clock_ = symbol<int (*)(void*, int, unsigned*)>(library_, "nvmlDeviceGetClockInfo");
  power_ = symbol<int (*)(void*, unsigned*)>(library_, "nvmlDeviceGetPowerUsage");
  reasons_ = symbol<int (*)(void*, unsigned long long*)>(library_, "nvmlDeviceGetCurrentClocksEventReasons");
  if (reasons_ == nullptr)  // drivers before 535 name it for throttling
    reasons_ = symbol<int (*)(void*, unsigned long long*)>(library_, "nvmlDeviceGetCurrentClocksThrottleReasons");
  if (init == nullptr || by_bus == nullptr || shutdown_ == nullptr || clock_ == nullptr || power_ == nullptr) {
    fail("NVML lacks the entry points this needs");
    return;
  }
  if (const int rc = init(); rc != 0) {
    fail("nvmlInit_v2 returned " + std::to_string(rc));
    return;
  }
  nvml_up_ = true;
  if (const int rc = by_bus(pci_bus_id.c_str(), &device_); rc != 0) {
    fail("NVML has no device at PCI bus id \"" + pci_bus_id + "\" (error " + std::to_string(rc) + ")");
    return;
  }
  thread_ = std::thread([this] { run(); });
}

GpuClockSampler::~GpuClockSampler() {
  stop();
  release();
}

void GpuClockSampler::release() {
  if (nvml_up_) shutdown_();
  nvml_up_ = false;
  if (library_ != nullptr) dlclose(library_);
  library_ = nullptr;
}

void GpuClockSampler::stop() {
  {
    const std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void GpuClockSampler::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    lock.unlock();
    GpuClockSample s;
    unsigned mhz = 0, milliwatts = 0;
    unsigned long long reasons = 0;
    const bool ok = clock_(device_, kNvmlClockSm, &mhz) == 0 && power_(device_, &milliwatts) == 0;
    if (reasons_ != nullptr && reasons_(device_, &reasons) != 0) reasons = 0;
    s.sm_mhz = mhz;
    s.power_w = milliwatts / 1000.0;
    s.reasons = reasons;
    lock.lock();
    if (ok) {
      samples_.push_back(s);
    } else if (samples_.empty()) {
      reason_ = "NVML could not read the SM clock or the power draw";
    }
    wake_.wait_for(lock, std::chrono::milliseconds(period_ms_), [this] { return stopping_; });
  }
}

nlohmann::json GpuClockSampler::summary() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return summarize_gpu_clocks(samples_, period_ms_, reason_);
}

}  // namespace moe
