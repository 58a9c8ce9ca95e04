// Cluster loading and curves; see hardware.h and hw_profiles/README.md for the schema.
#include "costmodel/hardware.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace strata {

const char* to_string(Precision p) {
  switch (p) {
    case Precision::fp32: return "fp32";
    case Precision::bf16: return "bf16";
    case Precision::fp16: return "fp16";
    case Precision::fp8: return "fp8";
  }
  return "?";
}

const char* to_string(Collective c) {
  switch (c) {
    case Collective::all_reduce: return "all_reduce";
    case Collective::all_gather: return "all_gather";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::send_recv: return "send_recv";
    case Collective::all_to_all: return "all_to_all";
  }
  return "?";
}

const char* to_string(AttentionKernel a) { return a == AttentionKernel::flash ? "flash" : "unfused"; }

int bytes_of(Precision p) { return p == Precision::fp32 ? 4 : 2; }

thread_local Curve::ValueCache Curve::value_cache;

namespace {

// Every object of a cluster JSON takes notes: "description" and "_source" (README's schema).
void reject_unknown_but_notes(Fields& f) {
  f.ignore("description");
  f.ignore("_source");
  f.reject_unknown();
}
std::atomic<uint64_t> curves_made{0};
}

Curve::Curve(std::vector<std::pair<double, double>> points) : id_(++curves_made), points_(std::move(points)) {
  log_x_.reserve(points_.size());
  for (const auto& p : points_) log_x_.push_back(std::log(p.first));
  slope_.assign(points_.size(), 0.0);
  for (size_t i = 1; i < points_.size(); ++i)
    if (log_x_[i] > log_x_[i - 1])
      slope_[i] = (points_[i].second - points_[i - 1].second) / (log_x_[i] - log_x_[i - 1]);
}

double Curve::interpolate(size_t i, double x) const {
  return points_[i - 1].second + (std::log(x) - log_x_[i - 1]) * slope_[i];
}

double Curve::remember(ValueCache::Entry& e, uint64_t bits, double x) const {
  e.id = id_;
  e.bits = bits;
  return e.y = interpolate(segment(x), x);
}

double Device::peak_flops(Precision p) const {
  switch (p) {
    case Precision::fp32: return peak_fp32_flops;
    case Precision::bf16: return peak_bf16_flops;
    case Precision::fp16: return peak_fp16_flops;
    case Precision::fp8: return peak_fp8_flops;
  }
  return 0;
}

double Device::gemm_peak(Precision p) const {
  if (p != Precision::fp8 || fp8_gemm_speedup <= 0) return peak_flops(p);
  return std::min(peak_fp8_flops, peak_bf16_flops * fp8_gemm_speedup);
}

namespace {

Curve read_curve(Fields& f, const std::string& key, double max_y) {
  const Json& a = f.array(key);
  std::vector<std::pair<double, double>> c;
  const std::string field = f.path_of(key);
  if (a.empty() || a.size() > 64) fail_field(field, show_value(a), "must hold 1 to 64 [size, efficiency] pairs");
  for (size_t i = 0; i < a.size(); ++i) {
    const Json& p = a[i];
    const std::string fi = fmt::format("{}[{}]", field, i);
    if (!p.is_array() || p.size() != 2 || !p[0].is_number() || !p[1].is_number())
      fail_field(fi, show_value(p), "must be a pair [size, efficiency] of numbers");
    const double x = p[0].get<double>(), y = p[1].get<double>();
    if (!std::isfinite(x) || x <= 0) fail_field(fi, show_value(p), "size must be a positive number");
    // (A floor: below it a rate underflows toward 0 and times toward infinity.)
    if (!std::isfinite(y) || y < kMinCurveEfficiency || y > max_y)
      fail_field(fi, show_value(p), fmt::format("efficiency must be in [{:g}, {}]", kMinCurveEfficiency, max_y));
    if (!c.empty() && x <= c.back().first) fail_field(fi, show_value(p), "sizes must increase strictly");
    c.emplace_back(x, y);
  }
  return Curve(std::move(c));
}

LinkTier read_link(const Json& j, const std::string& path) {
  Fields f(j, path);
  LinkTier l;
  l.bandwidth_bytes_per_s = f.real("bandwidth_gbps", 1e-6, 1e6) * 1e9;
  l.latency_s = f.real("latency_us", 0, 1e6) * 1e-6;
  Fields e(f.object("efficiency"), f.path_of("efficiency"));
  l.eff_all_reduce = e.real("all_reduce", 1e-3, 1.0);
  l.eff_all_gather = e.real("all_gather", 1e-3, 1.0);
  l.eff_reduce_scatter = e.real("reduce_scatter", 1e-3, 1.0);
  l.eff_send_recv = e.real("send_recv", 1e-3, 1.0);
  // (Context parallelism's all-to-all; clusters written before it have none: the
  // all-gather's, the same bytes per rank over the same links.)
  l.eff_all_to_all = e.real_or("all_to_all", l.eff_all_gather, 1e-3, 1.0);
  reject_unknown_but_notes(e);
  reject_unknown_but_notes(f);
  return l;
}

}  // namespace

Cluster cluster_from_json(const Json& j, const std::string& source) {
  Fields f(j, source);
  Cluster c;
  c.name = f.string_or("name", std::filesystem::path(source).stem().string());
  c.description = f.string_or("description", "");
  {
    Fields d(f.object("device"), f.path_of("device"));
    c.device.name = d.string("name");
    c.device.memory_bytes = d.real("memory_bytes", 1e6, 1e15);
    Fields p(d.object("peak_tflops"), d.path_of("peak_tflops"));
    c.device.peak_fp32_flops = p.real("fp32", 1e-6, 1e6) * 1e12;
    c.device.peak_tf32_flops = p.real_or("tf32", c.device.peak_fp32_flops / 1e12, 1e-6, 1e6) * 1e12;
    c.device.peak_bf16_flops = p.real("bf16", 0, 1e6) * 1e12;  // 0: not supported (V100)
    c.device.peak_fp16_flops = p.real("fp16", 0, 1e6) * 1e12;
    c.device.peak_fp8_flops = p.real_or("fp8", 0, 0, 1e6) * 1e12;
    reject_unknown_but_notes(p);
    c.device.memory_bandwidth_bytes_per_s = d.real("memory_bandwidth_gbps", 1e-3, 1e6) * 1e9;
    c.device.gemm_efficiency = read_curve(d, "gemm_efficiency", 1.0);
    c.device.memory_efficiency = read_curve(d, "memory_efficiency", 1.0);
    if (d.peek("kernel_efficiency")) {  // (present, even as null: then the type error names it)
      Fields k(d.object("kernel_efficiency"), d.path_of("kernel_efficiency"));
      for (int i = 1; i < kMemKinds; ++i) {
        const char* kind = to_string(static_cast<MemKind>(i));
        if (k.peek(kind)) c.device.kernel_efficiency[i] = read_curve(k, kind, 1.0);
      }
      reject_unknown_but_notes(k);
    }
    Fields fa(d.object("flash_attention_efficiency"), d.path_of("flash_attention_efficiency"));
    c.device.flash_fwd_efficiency = fa.real("forward", 1e-3, 1.0);
    c.device.flash_bwd_efficiency = fa.real("backward", 1e-3, 1.0);
    reject_unknown_but_notes(fa);
    c.device.kernel_launch_s = d.real_or("kernel_launch_us", 0, 0, 1e5) * 1e-6;
    if (d.peek("fp8_gemm_speedup")) {
      c.device.fp8_gemm_speedup = d.real("fp8_gemm_speedup", 1e-3, 100);
      const double most = c.device.peak_bf16_flops > 0 ? c.device.peak_fp8_flops / c.device.peak_bf16_flops : 0;
      if (!(most > 0))
        fail_field(d.path_of("fp8_gemm_speedup"), fmt::format("{}", c.device.fp8_gemm_speedup),
                   "the device needs peak_tflops.fp8 and .bf16 for it");
      if (c.device.fp8_gemm_speedup > most * (1 + 1e-9))
        fail_field(d.path_of("fp8_gemm_speedup"), fmt::format("{}", c.device.fp8_gemm_speedup),
                   fmt::format("at most peak_tflops.fp8 / peak_tflops.bf16 = {:.4g}", most));
    }
    c.device.batched_gemm_per_matrix = d.choice_or("batched_gemm", "batched", {"batched", "per_matrix"}) == "per_matrix";
    // (Absent: as stored, but in a profile of batches run matrix by matrix: the CPU
    // backend's, written before the field was.)
    c.device.gemm_reads_16bit =
        d.choice_or("gemm_16bit_operands", c.device.batched_gemm_per_matrix ? "unpacked" : "as_stored",
                    {"as_stored", "unpacked"}) == "as_stored";
    // (Absent: one pass, but two in a profile of the CPU backend's: as above.)
    c.device.cross_entropy_one_pass =
        d.integer_or("cross_entropy_passes", c.device.batched_gemm_per_matrix ? 2 : 1, 1, 2) == 1;
    reject_unknown_but_notes(d);
  }
  c.devices_per_node = f.integer("devices_per_node", 1, 1 << 16);
  c.processors_per_node = f.integer_or("processors_per_node", 0, 1, 1 << 16);
  {
    Fields l(f.object("links"), f.path_of("links"));
    c.intra = read_link(l.object("intra_node"), l.path_of("intra_node"));
    c.inter = read_link(l.object("inter_node"), l.path_of("inter_node"));
    reject_unknown_but_notes(l);
  }
  if (const Json* h = f.peek("host"); h && !h->is_null()) {
    Fields o(f.object("host"), f.path_of("host"));
    c.host.memory_bytes = o.real("memory_bytes", 1e6, 1e18);
    c.host.memory_bandwidth_bytes_per_s = o.real("memory_bandwidth_gbps", 1e-3, 1e6) * 1e9;
    c.host.memory_efficiency = o.real("memory_efficiency", 1e-3, 1.0);
    c.host.pcie_bandwidth_bytes_per_s = o.real("pcie_bandwidth_gbps", 1e-3, 1e6) * 1e9;
    c.host.pcie_efficiency = o.real("pcie_efficiency", 1e-3, 1.0);
    reject_unknown_but_notes(o);
  } else {
    f.ignore("host");
  }
  {
    Fields w(f.object("framework"), f.path_of("framework"));
    c.framework_overhead_bytes = w.real("overhead_bytes", 0, 1e15);
    c.allocator_fragmentation = w.real("allocator_fragmentation", 0, 10);
    // (A cluster file without it keeps one fraction for both, as before the split.)
    c.allocator_fragmentation_saved =
        w.real_or("allocator_fragmentation_saved", c.allocator_fragmentation, 0, 10);
    c.step_overhead_s = w.real_or("step_overhead_s", 0, 0, 1e4);
    c.overlap_slowdown = w.real_or("overlap_slowdown", 0, 0, 1);
    const std::string stack = w.choice_or("software_stack", "modern", {"modern", "legacy", "strata"});
    c.modern_stack = stack == "modern";
    c.strata_stack = stack == "strata";
    reject_unknown_but_notes(w);
  }
  reject_unknown_but_notes(f);
  if (c.device.peak_fp8_flops <= 0) c.device.peak_fp8_flops = 0;
  return c;
}

Json cluster_to_json(const Cluster& c) {
  auto curve = [](const Curve& cv) {
    Json a = Json::array();
    for (const auto& [x, y] : cv.points()) a.push_back({x, y});
    return a;
  };
  auto link = [](const LinkTier& l) {
    return Json{{"bandwidth_gbps", l.bandwidth_bytes_per_s / 1e9},
                {"latency_us", l.latency_s * 1e6},
                {"efficiency",
                 {{"all_reduce", l.eff_all_reduce},
                  {"all_gather", l.eff_all_gather},
                  {"reduce_scatter", l.eff_reduce_scatter},
                  {"send_recv", l.eff_send_recv},
                  {"all_to_all", l.eff_all_to_all}}}};
  };
  const Device& d = c.device;
  Json j{
      {"name", c.name},
      {"description", c.description},
      {"device",
       {{"name", d.name},
        {"memory_bytes", d.memory_bytes},
        {"peak_tflops",
         {{"fp32", d.peak_fp32_flops / 1e12}, {"tf32", d.peak_tf32_flops / 1e12}, {"bf16", d.peak_bf16_flops / 1e12},
          {"fp16", d.peak_fp16_flops / 1e12}, {"fp8", d.peak_fp8_flops / 1e12}}},
        {"memory_bandwidth_gbps", d.memory_bandwidth_bytes_per_s / 1e9},
        {"gemm_efficiency", curve(d.gemm_efficiency)},
        {"memory_efficiency", curve(d.memory_efficiency)},
        {"flash_attention_efficiency", {{"forward", d.flash_fwd_efficiency}, {"backward", d.flash_bwd_efficiency}}},
        {"kernel_launch_us", d.kernel_launch_s * 1e6},
        {"batched_gemm", d.batched_gemm_per_matrix ? "per_matrix" : "batched"},
        {"gemm_16bit_operands", d.gemm_reads_16bit ? "as_stored" : "unpacked"},
        {"cross_entropy_passes", d.cross_entropy_one_pass ? 1 : 2}}},
      {"devices_per_node", c.devices_per_node},
      {"links", {{"intra_node", link(c.intra)}, {"inter_node", link(c.inter)}}},
      {"framework",
       {{"overhead_bytes", c.framework_overhead_bytes},
        {"allocator_fragmentation", c.allocator_fragmentation},
        {"allocator_fragmentation_saved", c.allocator_fragmentation_saved},
        {"step_overhead_s", c.step_overhead_s},
        {"overlap_slowdown", c.overlap_slowdown},
        {"software_stack", c.strata_stack ? "strata" : c.modern_stack ? "modern" : "legacy"}}}};
  if (c.processors_per_node > 0) j["processors_per_node"] = c.processors_per_node;
  if (d.fp8_gemm_speedup > 0) j["device"]["fp8_gemm_speedup"] = d.fp8_gemm_speedup;
  for (int i = 1; i < kMemKinds; ++i)
    if (!d.kernel_efficiency[i].empty())
      j["device"]["kernel_efficiency"][to_string(static_cast<MemKind>(i))] = curve(d.kernel_efficiency[i]);
  if (c.host.present())
    j["host"] = {{"memory_bytes", c.host.memory_bytes},
                 {"memory_bandwidth_gbps", c.host.memory_bandwidth_bytes_per_s / 1e9},
                 {"memory_efficiency", c.host.memory_efficiency},
                 {"pcie_bandwidth_gbps", c.host.pcie_bandwidth_bytes_per_s / 1e9},
                 {"pcie_efficiency", c.host.pcie_efficiency}};
  return j;
}

std::vector<std::string> cluster_preset_names() {
  std::vector<std::string> names;
  for (const auto& p : embedded_profiles()) names.emplace_back(p.name);
  return names;
}

Cluster load_cluster(const std::string& name_or_path) {
  for (const auto& p : embedded_profiles()) {
    if (name_or_path == p.name) return cluster_from_json(parse_json_text(p.json, p.name), std::string("cluster ") + p.name);
  }
  std::error_code ec;
  if (!std::filesystem::is_regular_file(name_or_path, ec)) {
    std::string names;
    for (const auto& n : cluster_preset_names()) names += (names.empty() ? "" : ", ") + n;
    throw InputError(fmt::format("--cluster: '{}' is neither a preset ({}) nor a readable file", name_or_path, names));
  }
  const Json j = read_json_file(name_or_path, "--cluster");
  Cluster c = cluster_from_json(j, "cluster");
  if (!(j.is_object() && j.contains("name") && !j["name"].is_null()))
    c.name = std::filesystem::path(name_or_path).stem().string();  // (the file's)
  return c;
}

const char* to_string(MemKind k) {
  switch (k) {
    case MemKind::generic: return "generic";
    case MemKind::norm: return "norm";
    case MemKind::activation: return "activation";
    case MemKind::round16: return "round16";
  }
  return "generic";
}

}  // namespace strata
