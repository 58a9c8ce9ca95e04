// Plan choice and predicted-vs-measured arithmetic for `strata validate`; see validation.h.
#include "planner/validation.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>

#include <nlohmann/json.hpp>

#include "costmodel/compute.h"
#include "planner/search.h"

namespace strata {

const std::vector<Mechanism>& validation_mechanisms() {
  static const std::vector<Mechanism> mechs = {
      {"dp", [](const Plan& p) { return p.d > 1; }},
      {"tp", [](const Plan& p) { return p.t > 1 && !p.sp; }},
      {"sp", [](const Plan& p) { return p.t > 1 && p.sp; }},
      {"pp gpipe", [](const Plan& p) { return p.p > 1 && p.schedule() == ScheduleKind::gpipe; }},
      {"pp 1f1b", [](const Plan& p) { return p.p > 1 && p.schedule() == ScheduleKind::one_f_one_b; }},
      {"pp interleaved", [](const Plan& p) { return p.p > 1 && p.schedule() == ScheduleKind::interleaved; }},
      {"zero1", [](const Plan& p) { return p.d > 1 && p.zero == 1; }},
      {"zero2", [](const Plan& p) { return p.d > 1 && p.zero == 2; }},
      {"zero3", [](const Plan& p) { return p.d > 1 && p.zero == 3; }},
      {"recompute selective", [](const Plan& p) { return p.recompute == Recompute::selective; }},
      {"recompute full", [](const Plan& p) { return p.recompute == Recompute::full; }},
      {"accumulation", [](const Plan& p) { return p.microbatches() > 1; }},
      {"cp", [](const Plan& p) { return p.c > 1; }},
  };
  return mechs;
}

std::vector<ValidationPlan> choose_validation_plans(const ModelSpec& m, const Cluster& cl,
                                                    const ValidationChoiceOptions& o,
                                                    std::map<std::string, int64_t>* rejected) {
  SearchOptions so;
  so.gpus = o.ranks;
  so.gbs = o.gbs;
  so.precision = o.precision;
  so.top_k = std::numeric_limits<int>::max();  // every feasible plan, ranked
  const SearchResult r = search(m, cl, so);
  std::vector<const Estimate*> ok;
  int64_t not_runnable = 0;
  for (const Estimate& e : r.plans) {
    if (!o.runnable || o.runnable(e.plan).empty()) ok.push_back(&e);
    else ++not_runnable;
  }
  if (rejected) {
    *rejected = r.rejected;
    if (not_runnable > 0) (*rejected)["executor"] += not_runnable;
    (*rejected)[""] = r.candidates_evaluated;
  }
  std::vector<ValidationPlan> out;
  std::vector<bool> taken(ok.size(), false);
  for (size_t i = 0; i < ok.size() && static_cast<int>(out.size()) < o.best; ++i) {
    out.push_back({ok[i]->plan, *ok[i], "best " + std::to_string(i + 1)});
    taken[i] = true;
  }
  if (!o.spread) return out;
  for (const Mechanism& mech : validation_mechanisms()) {
    bool covered = false;
    for (const ValidationPlan& v : out) covered = covered || mech.uses(v.plan);
    if (covered) continue;
    // The best-ranked plan that uses it; prefer one that differs from the chosen ones in
    // this mechanism only where possible (the ranking already favours simple plans).
    for (size_t i = 0; i < ok.size(); ++i) {
      if (taken[i] || !mech.uses(ok[i]->plan)) continue;
      out.push_back({ok[i]->plan, *ok[i], std::string("exercises ") + mech.name});
      taken[i] = true;
      break;
    }
  }
  // The best plans lie within a few percent of each other; a ranking is only tested by
  // plans that differ, so the spread also takes the slowest feasible plan and the one at
  // the 75th percentile of predicted step time.
  for (const auto& [at, why] : {std::pair<double, const char*>{1.0, "range: slowest"}, {0.75, "range: 75th percentile"}}) {
    if (ok.empty()) break;
    const size_t i = std::min(ok.size() - 1, static_cast<size_t>(at * static_cast<double>(ok.size() - 1)));
    if (taken[i]) continue;
    out.push_back({ok[i]->plan, *ok[i], why});
    taken[i] = true;
  }
  return out;
}

double gemm_drift(const Cluster& cl, const std::vector<std::pair<double, double>>& probe) {
  const Device& dev = cl.device;
  const double peak = dev.peak_bf16_flops > 0 ? dev.peak_bf16_flops : dev.peak_fp32_flops;
  double profiled = 0, now = 0;
  for (const auto& [flops, rate] : probe) {
    if (!(flops > 0) || !(rate > 0) || !std::isfinite(rate)) continue;
    profiled += flops / (peak * gemm_efficiency(dev, peak, flops));
    now += flops / rate;
  }
  return now > 0 && std::isfinite(profiled) ? profiled / now : 0.0;
}

Cluster apply_calibration(const Cluster& cl, const Calibration& c) {
  Cluster r = cl;
  // Scales curves by k; what would exceed 1 (not a valid efficiency) moves into the peak,
  // which the curves share (the memory-bound kernels', generic and by kind).
  auto scaled = [](std::vector<Curve*> cvs, double k, double* peak_factor) {
    std::vector<std::vector<std::pair<double, double>>> pts;
    double top = 0;
    for (Curve* cv : cvs) {
      pts.push_back(cv->points());
      for (auto& pt : pts.back()) top = std::max(top, pt.second *= k);
    }
    *peak_factor = std::max(1.0, top);
    for (size_t i = 0; i < cvs.size(); ++i) {
      if (pts[i].empty()) continue;  // (an absent curve stays absent)
      for (auto& pt : pts[i]) pt.second /= *peak_factor;
      *cvs[i] = Curve(pts[i]);
    }
  };
  double fg = 1, fm = 1;
  scaled({&r.device.gemm_efficiency}, c.gemm, &fg);
  std::vector<Curve*> memory_curves = {&r.device.memory_efficiency};
  for (Curve& k : r.device.kernel_efficiency) memory_curves.push_back(&k);
  scaled(memory_curves, c.memory, &fm);
  for (double* peak : {&r.device.peak_fp32_flops, &r.device.peak_tf32_flops, &r.device.peak_bf16_flops,
                       &r.device.peak_fp16_flops, &r.device.peak_fp8_flops})
    *peak *= fg;
  // The fused attention is charged against a peak too (compute.cpp) but measured on its
  // own: a GEMM factor moved into the peaks leaves its time as it was.
  r.device.flash_fwd_efficiency = std::clamp(r.device.flash_fwd_efficiency / fg, 1e-3, 1.0);
  r.device.flash_bwd_efficiency = std::clamp(r.device.flash_bwd_efficiency / fg, 1e-3, 1.0);
  r.device.memory_bandwidth_bytes_per_s *= fm;
  // The links a run on one machine measured: the intra-node tier only.
  r.intra.bandwidth_bytes_per_s *= c.link;
  r.intra.latency_s /= c.link;
  r.step_overhead_s += c.overhead_s;
  r.name = cl.name + "-calibrated";
  return r;
}

namespace {

double calibration_loss(const ModelSpec& m, const Cluster& cl, const std::vector<MeasuredRun>& runs,
                        const Calibration& c, double overhead_scale_s) {
  const Cluster k = apply_calibration(cl, c);
  double sum = 0;
  for (const MeasuredRun& r : runs) {
    const Estimate e = estimate(m, k, r.plan);
    if (!e.valid || e.step_time_s <= 0 || r.step_s <= 0) return std::numeric_limits<double>::infinity();
    const double l = std::log(e.step_time_s / r.step_s);
    sum += l * l;
    const double comp = e.time.forward + e.time.backward + e.time.recompute;
    if (r.compute_s > 0 && comp > 0) {
      const double lc = std::log(comp / r.compute_s);
      sum += lc * lc;
    }
  }
  sum /= static_cast<double>(std::max<size_t>(runs.size(), 1));
  // The prior: a factor of 2 (or an overhead of 10% of a step) costs as much as a 1.4%
  // error on every run.
  constexpr double kPrior = 4e-4;
  const double o = c.overhead_s / overhead_scale_s;
  return sum + kPrior * (std::pow(std::log(c.gemm) / std::log(2.0), 2) + std::pow(std::log(c.memory) / std::log(2.0), 2) +
                         std::pow(std::log(c.link) / std::log(2.0), 2) + o * o);
}

}  // namespace

Calibration fit_calibration(const ModelSpec& m, const Cluster& cl, const std::vector<MeasuredRun>& runs) {
  if (runs.empty()) return Calibration{};
  std::vector<double> meas;
  for (const MeasuredRun& r : runs) meas.push_back(r.step_s);
  const double overhead_unit = 0.01 * median(meas);  // overhead in units of 1% of a step
  // x = (log gemm, log memory, log link, overhead / unit), bounded; Nelder-Mead on the loss.
  auto decode = [&](const std::array<double, 4>& x) {
    Calibration c;
    c.gemm = std::exp(std::clamp(x[0], -1.5, 1.5));
    c.memory = std::exp(std::clamp(x[1], -1.5, 1.5));
    c.link = std::exp(std::clamp(x[2], -2.5, 2.5));
    c.overhead_s = overhead_unit * std::clamp(x[3], 0.0, 30.0);
    return c;
  };
  auto f = [&](const std::array<double, 4>& x) { return calibration_loss(m, cl, runs, decode(x), 10.0 * overhead_unit); };
  std::array<std::array<double, 4>, 5> v{};
  for (int k = 0; k < 4; ++k) v[static_cast<size_t>(k + 1)][static_cast<size_t>(k)] = k == 3 ? 2.0 : 0.2;
  std::array<double, 5> fv{};
  for (size_t k = 0; k < 5; ++k) fv[k] = f(v[k]);
  for (int iter = 0; iter < 400; ++iter) {
    std::array<size_t, 5> o{0, 1, 2, 3, 4};
    std::sort(o.begin(), o.end(), [&](size_t a, size_t b) { return fv[a] < fv[b]; });
    const size_t best = o[0], worst = o[4], second = o[3];
    if (fv[worst] - fv[best] < 1e-14) break;
    std::array<double, 4> cen{};
    for (size_t k : {o[0], o[1], o[2], o[3]})
      for (size_t d = 0; d < 4; ++d) cen[d] += v[k][d] / 4.0;
    auto along = [&](double t) {
      std::array<double, 4> x{};
      for (size_t d = 0; d < 4; ++d) x[d] = cen[d] + t * (v[worst][d] - cen[d]);
      return x;
    };
    const std::array<double, 4> xr = along(-1.0);
    const double fr = f(xr);
    if (fr < fv[best]) {
      const std::array<double, 4> xe = along(-2.0);
      const double fe = f(xe);
      if (fe < fr) v[worst] = xe, fv[worst] = fe;
      else v[worst] = xr, fv[worst] = fr;
    } else if (fr < fv[second]) {
      v[worst] = xr, fv[worst] = fr;
    } else {
      const std::array<double, 4> xc = along(0.5);
      const double fc = f(xc);
      if (fc < fv[worst]) {
        v[worst] = xc, fv[worst] = fc;
      } else {  // shrink towards the best
        for (size_t k = 0; k < 5; ++k) {
          if (k == best) continue;
          for (size_t d = 0; d < 4; ++d) v[k][d] = v[best][d] + 0.5 * (v[k][d] - v[best][d]);
          fv[k] = f(v[k]);
        }
      }
    }
  }
  size_t b = 0;
  for (size_t k = 1; k < 5; ++k)
    if (fv[k] < fv[b]) b = k;
  return decode(v[b]);
}

std::vector<double> held_out_errors(const ModelSpec& m, const Cluster& cl, const std::vector<MeasuredRun>& runs) {
  std::vector<double> out;
  for (size_t i = 0; i < runs.size(); ++i) {
    std::vector<MeasuredRun> rest;
    for (size_t j = 0; j < runs.size(); ++j)
      if (j != i) rest.push_back(runs[j]);
    const Cluster k = apply_calibration(cl, fit_calibration(m, cl, rest));
    out.push_back(relative_error(estimate(m, k, runs[i].plan).step_time_s, runs[i].step_s));
  }
  return out;
}

Json calibration_to_json(const Calibration& c) {
  return Json{{"gemm_efficiency_factor", c.gemm},
              {"memory_efficiency_factor", c.memory},
              {"link_bandwidth_factor", c.link},
              {"step_overhead_s", c.overhead_s}};
}

double relative_error(double predicted, double measured) {
  if (measured == 0) return std::numeric_limits<double>::quiet_NaN();
  return (predicted - measured) / measured;
}

double median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return std::isnan(x); }), v.end());
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

namespace {

std::vector<double> ranks_of(const std::vector<double>& x) {
  std::vector<size_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return x[a] < x[b]; });
  std::vector<double> r(x.size());
  for (size_t i = 0; i < idx.size();) {
    size_t j = i;
    while (j + 1 < idx.size() && x[idx[j + 1]] == x[idx[i]]) ++j;
    const double avg = 0.5 * static_cast<double>(i + j) + 1.0;  // ties share the mean rank
    for (size_t k = i; k <= j; ++k) r[idx[k]] = avg;
    i = j + 1;
  }
  return r;
}

}  // namespace

double spearman(const std::vector<double>& a, const std::vector<double>& b) {
  const size_t n = std::min(a.size(), b.size());
  if (n < 2) return std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> ra = ranks_of(std::vector<double>(a.begin(), a.begin() + static_cast<long>(n)));
  const std::vector<double> rb = ranks_of(std::vector<double>(b.begin(), b.begin() + static_cast<long>(n)));
  // Pearson correlation of the ranks (exact with ties, unlike 1 - 6 sum d^2 / ...).
  const double ma = std::accumulate(ra.begin(), ra.end(), 0.0) / static_cast<double>(n);
  const double mb = std::accumulate(rb.begin(), rb.end(), 0.0) / static_cast<double>(n);
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < n; ++i) {
    sab += (ra[i] - ma) * (rb[i] - mb);
    saa += (ra[i] - ma) * (ra[i] - ma);
    sbb += (rb[i] - mb) * (rb[i] - mb);
  }
  if (saa == 0 || sbb == 0) return std::numeric_limits<double>::quiet_NaN();
  return sab / std::sqrt(saa * sbb);
}

RunComparison compare_run(const Estimate& predicted, const Json& measured) {
  RunComparison c;
  c.predicted_step_s = predicted.step_time_s;
  c.measured_step_s = measured.at("median_step_time_s").get<double>();
  c.step_time_error = relative_error(c.predicted_step_s, c.measured_step_s);
  const Json& mt = measured.at("time_s");
  // A collective's wait also holds the time a rank waited for a peer that reached it later
  // (the executor's tp_skew / cp_skew / dp_skew: load imbalance, a slower core), which no
  // link model predicts: each communication term is compared net of it, and the skew is a
  // term of its own (predicted 0), so the measured terms still add up to the step. The
  // pipeline bubble likewise (pp_skew: what the replay of the step's schedule at the
  // measured mean compute does not imply -- steps of unequal length, a slower peer).
  double skew = 0;
  for (const auto& [name, value] : time_terms(predicted.time)) {
    if (!mt.contains(name)) continue;  // a term the executor does not have (overhead)
    double meas = mt.at(name).get<double>();
    const std::string n = name;
    if (n == "tp_comm" || n == "cp_comm" || n == "dp_comm" || n == "pipeline_bubble") {
      const std::string k = n == "pipeline_bubble" ? "pp_skew" : n.substr(0, 2) + "_skew";
      const double s = mt.contains(k) ? std::clamp(mt.at(k).get<double>(), 0.0, meas) : 0.0;
      meas -= s;
      skew += s;
    }
    c.time.push_back({name, value, meas, relative_error(value, meas)});
  }
  if (skew > 0) c.time.push_back({"skew", 0.0, skew, relative_error(0.0, skew)});
  const Json& mm = measured.at("peak_memory_bytes");
  // The executor tracks the bytes of live tensors by term; the framework overhead of a
  // profile (runtime, library buffers) is not a tensor, so the peaks compare without it.
  for (const auto& [name, value] : memory_terms(predicted.memory)) {
    const std::string key = std::string(name) == "peak" ? "total" : name;
    if (!mm.contains(key)) continue;
    const double pred = key == "total" ? value - predicted.memory.framework_overhead : value;
    const double meas = mm.at(key).get<double>();
    c.memory.push_back({key == "total" ? "peak" : name, pred, meas, relative_error(pred, meas)});
    if (key == "total") {
      c.predicted_memory_bytes = pred;
      c.measured_memory_bytes = meas;
      c.memory_error = relative_error(pred, meas);
    }
  }
  return c;
}

}  // namespace strata
