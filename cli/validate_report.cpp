// Report files of `strata validate`; see validate_report.h. The SVGs are written by hand
// (a few rectangles, lines and labels), so they open in any browser with no dependency.
#include "cli/validate_report.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace strata {
namespace {

Json num(double x) { return std::isfinite(x) ? Json(x) : Json(nullptr); }

std::string pct(double x) { return std::isfinite(x) ? fmt::format("{:+.1f}%", 100.0 * x) : "n/a"; }
// An absolute error (median, max): no sign.
std::string apct(double x) { return std::isfinite(x) ? fmt::format("{:.1f}%", 100.0 * x) : "n/a"; }

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else o += c;
  }
  return o;
}

std::string mib(double b) { return fmt::format("{:.1f}", b / (1024.0 * 1024.0)); }

const char* kColors[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                         "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};

// One pair of stacked bars (predicted, measured) per run, `terms` stacked in order.
std::string svg_stacked(const ValidationSummary& s, const std::string& title, const std::string& unit,
                        const std::vector<std::string>& terms, double scale,
                        const std::vector<TermError> RunComparison::*which) {
  std::vector<const ValidatedRun*> runs;
  for (const ValidatedRun& r : s.runs)
    if (r.ok) runs.push_back(&r);
  const double W = std::max<double>(480, 90.0 * static_cast<double>(runs.size()) + 160), Hc = 300, left = 60,
               top = 40, bottom = 50;
  auto value = [&](const ValidatedRun& r, const std::string& term, bool pred) {
    for (const TermError& t : r.cmp.*which)
      if (t.term == term) return (pred ? t.predicted : t.measured) * scale;
    return 0.0;
  };
  double ymax = 0;
  for (const ValidatedRun* r : runs)
    for (bool pred : {true, false}) {
      double sum = 0;
      for (const std::string& t : terms) sum += std::max(0.0, value(*r, t, pred));
      ymax = std::max(ymax, sum);
    }
  if (ymax <= 0) ymax = 1;
  ymax *= 1.1;
  std::string o = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" font-family=\"sans-serif\" "
      "font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{:.0f}\" y=\"20\" font-size=\"14\">{}</text>\n",
      W, Hc + top + bottom, left, esc(title));
  const double y0 = top + Hc;
  o += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"black\"/>\n", left, top, y0);
  for (int i = 0; i <= 4; ++i) {
    const double v = ymax * i / 4.0, y = y0 - Hc * i / 4.0;
    o += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{:.0f}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>"
                     "<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.3g}</text>\n",
                     left, y, W - 150, y, left - 4, y + 4, v);
  }
  o += fmt::format("<text x=\"12\" y=\"{:.0f}\" transform=\"rotate(-90 12 {:.0f})\" text-anchor=\"middle\">{}</text>\n",
                   top + Hc / 2, top + Hc / 2, esc(unit));
  double x = left + 15;
  for (size_t i = 0; i < runs.size(); ++i) {
    for (bool pred : {true, false}) {
      double y = y0;
      for (size_t k = 0; k < terms.size(); ++k) {
        const double h = std::max(0.0, value(*runs[i], terms[k], pred)) / ymax * Hc;
        if (h <= 0) continue;
        y -= h;
        o += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"30\" height=\"{:.1f}\" fill=\"{}\"><title>{} {} {}: "
                         "{:.4g} {}</title></rect>\n",
                         x, y, h, kColors[k % 10], i + 1, pred ? "predicted" : "measured", terms[k],
                         value(*runs[i], terms[k], pred), esc(unit));
      }
      o += fmt::format("<text x=\"{:.1f}\" y=\"{:.0f}\" text-anchor=\"middle\">{}</text>\n", x + 15, y0 + 14,
                       pred ? "P" : "M");
      x += 32;
    }
    o += fmt::format("<text x=\"{:.1f}\" y=\"{:.0f}\" text-anchor=\"middle\">#{}</text>\n", x - 32, y0 + 30, i + 1);
    x += 26;
  }
  for (size_t k = 0; k < terms.size(); ++k)
    o += fmt::format("<rect x=\"{:.0f}\" y=\"{:.0f}\" width=\"12\" height=\"12\" fill=\"{}\"/>"
                     "<text x=\"{:.0f}\" y=\"{:.0f}\">{}</text>\n",
                     W - 140, top + 18.0 * static_cast<double>(k), kColors[k % 10], W - 122,
                     top + 10 + 18.0 * static_cast<double>(k), terms[k]);
  o += fmt::format("<text x=\"{}\" y=\"{:.0f}\">P = predicted, M = measured; #n = plan n of report.md</text>\n", left,
                   y0 + 46);
  return o + "</svg>\n";
}

}  // namespace

void summarise(ValidationSummary& s) {
  std::vector<double> abs_err, net_err, pred, meas, mem_err;
  double max_term = 0;
  for (const ValidatedRun& r : s.runs) {
    if (!r.ok) continue;
    abs_err.push_back(std::fabs(r.cmp.step_time_error));
    double skew = 0;
    for (const TermError& t : r.cmp.time)
      if (t.term == "skew") skew = t.measured;
    net_err.push_back(std::fabs(relative_error(r.cmp.predicted_step_s, r.cmp.measured_step_s - skew)));
    pred.push_back(r.cmp.predicted_step_s);
    meas.push_back(r.cmp.measured_step_s);
    mem_err.push_back(std::fabs(r.cmp.memory_error));
    for (const TermError& t : r.cmp.memory)
      if (std::isfinite(t.error)) max_term = std::max(max_term, std::fabs(t.error));
  }
  s.median_abs_step_error = median(abs_err);
  s.max_abs_step_error = abs_err.empty() ? NAN : *std::max_element(abs_err.begin(), abs_err.end());
  s.median_abs_step_error_net_skew = median(net_err);
  s.max_abs_step_error_net_skew = net_err.empty() ? NAN : *std::max_element(net_err.begin(), net_err.end());
  s.spearman_step_time = spearman(pred, meas);
  s.median_abs_memory_error = median(mem_err);
  s.max_abs_memory_term_error = max_term;
  std::vector<double> probe_err, drifts;
  for (const ValidatedRun& r : s.runs)
    if (r.ok && r.drift > 0) {
      probe_err.push_back(std::fabs(r.error_at_probe));
      drifts.push_back(r.drift);
    }
  s.probed = static_cast<int64_t>(drifts.size());
  if (!drifts.empty()) {
    s.median_abs_error_at_probe = median(probe_err);
    s.max_abs_error_at_probe = *std::max_element(probe_err.begin(), probe_err.end());
    s.min_drift = *std::min_element(drifts.begin(), drifts.end());
    s.max_drift = *std::max_element(drifts.begin(), drifts.end());
  }
}

void calibrate(ValidationSummary& s, const ModelSpec& m, const Cluster& cl) {
  std::vector<MeasuredRun> runs;
  std::vector<double> before;
  for (const ValidatedRun& r : s.runs) {
    if (!r.ok) continue;
    const Json& t = r.measured.at("time_s");
    runs.push_back({r.choice.plan, r.cmp.measured_step_s,
                    t.value("forward", 0.0) + t.value("backward", 0.0) + t.value("recompute", 0.0)});
    before.push_back(std::fabs(r.cmp.step_time_error));
  }
  s.calibrated = true;
  s.calibration = fit_calibration(m, cl, runs);
  s.held_out_error = held_out_errors(m, cl, runs);
  std::vector<double> after;
  for (double e : s.held_out_error) after.push_back(std::fabs(e));
  s.median_abs_before = median(before);
  s.median_abs_after = median(after);
  s.max_abs_before = before.empty() ? NAN : *std::max_element(before.begin(), before.end());
  s.max_abs_after = after.empty() ? NAN : *std::max_element(after.begin(), after.end());
}

std::string format_calibration(const ValidationSummary& s) {
  if (!s.calibrated) return "";
  const Calibration& c = s.calibration;
  std::string o = fmt::format(
      "calibration (fitted to all {} runs): GEMM efficiency x{:.3f}, memory-bound kernels x{:.3f}, link bandwidth "
      "x{:.3f}, step overhead +{:.2f} ms\n",
      s.held_out_error.size(), c.gemm, c.memory, c.link, 1e3 * c.overhead_s);
  o += fmt::format("held out (each run predicted by a profile fitted to the others): median |error| {} -> {}, max "
                   "|error| {} -> {}\n",
                   apct(s.median_abs_before), apct(s.median_abs_after), apct(s.max_abs_before), apct(s.max_abs_after));
  if (!s.calibrated_cluster_file.empty()) o += "calibrated cluster written to " + s.calibrated_cluster_file + "\n";
  return o;
}

Json validation_to_json(const ValidationSummary& s) {
  Json j;
  j["cluster"] = s.cluster;
  j["model"] = s.model;
  j["ranks"] = s.ranks;
  j["steps"] = s.steps;
  Json runs = Json::array();
  for (const ValidatedRun& r : s.runs) {
    Json x;
    x["plan"] = plan_to_json(r.choice.plan);
    x["why"] = r.choice.why;
    x["report_dir"] = r.dir;
    x["predicted"] = estimate_to_json(r.choice.predicted);
    x["ok"] = r.ok;
    if (!r.ok) {
      x["failure"] = r.failure;
      runs.push_back(x);
      continue;
    }
    x["measured"] = r.measured;
    x["step_time_error"] = num(r.cmp.step_time_error);
    x["memory_error"] = num(r.cmp.memory_error);
    if (!r.probe_error.empty()) x["gemm_probe_error"] = r.probe_error;
    if (r.drift > 0) {
      x["gemm_drift"] = num(r.drift);
      x["predicted_at_probe_step_s"] = num(r.predicted_at_probe_s);
      x["step_time_error_at_probe"] = num(r.error_at_probe);
    }
    Json te = Json::object(), me = Json::object();
    for (const TermError& t : r.cmp.time) te[t.term] = {{"predicted", t.predicted}, {"measured", t.measured}, {"error", num(t.error)}};
    for (const TermError& t : r.cmp.memory) me[t.term] = {{"predicted", t.predicted}, {"measured", t.measured}, {"error", num(t.error)}};
    x["time_terms_s"] = te;
    x["memory_terms_bytes"] = me;
    runs.push_back(x);
  }
  j["runs"] = runs;
  j["median_abs_step_time_error"] = num(s.median_abs_step_error);
  j["max_abs_step_time_error"] = num(s.max_abs_step_error);
  j["median_abs_step_time_error_net_of_skew"] = num(s.median_abs_step_error_net_skew);
  j["max_abs_step_time_error_net_of_skew"] = num(s.max_abs_step_error_net_skew);
  j["spearman_step_time"] = num(s.spearman_step_time);
  j["median_abs_memory_error"] = num(s.median_abs_memory_error);
  j["max_abs_memory_term_error"] = num(s.max_abs_memory_term_error);
  if (s.probed > 0)
    j["gemm_probe"] = {{"runs", s.probed},
                       {"min_drift", num(s.min_drift)},
                       {"max_drift", num(s.max_drift)},
                       {"median_abs_step_time_error", num(s.median_abs_error_at_probe)},
                       {"max_abs_step_time_error", num(s.max_abs_error_at_probe)}};
  if (s.calibrated) {
    Json c = calibration_to_json(s.calibration);
    Json held = Json::array();
    for (double e : s.held_out_error) held.push_back(num(e));
    j["calibration"] = {{"factors", c},
                        {"held_out_step_time_error", held},
                        {"median_abs_step_time_error_before", num(s.median_abs_before)},
                        {"median_abs_step_time_error_after", num(s.median_abs_after)},
                        {"max_abs_step_time_error_before", num(s.max_abs_before)},
                        {"max_abs_step_time_error_after", num(s.max_abs_after)},
                        {"cluster_file", s.calibrated_cluster_file}};
  }
  return j;
}

namespace {
// The GEMM probes' line: how far the host's GEMM rate moved from the profile's before the
// runs, and the step-time error with each run predicted at its probe's rate.
std::string probe_line(const ValidationSummary& s) {
  if (s.probed == 0) return "";
  return fmt::format("host drift: GEMMs at x{:.2f} to x{:.2f} of the profile's rate just before the runs ({} probes); "
                     "predicted at the probe's rate: median |error| {}, max |error| {}\n",
                     s.min_drift, s.max_drift, s.probed, apct(s.median_abs_error_at_probe),
                     apct(s.max_abs_error_at_probe));
}
}  // namespace

std::string format_validation_table(const ValidationSummary& s) {
  const bool probed = s.probed > 0;
  std::string o = fmt::format("{:>3}  {:<46} {:<24} {:>10} {:>10} {:>8} {:>9} {:>9} {:>8}{}\n", "#", "plan", "why",
                              "pred ms", "meas ms", "error", "pred MiB", "meas MiB", "error",
                              probed ? fmt::format(" {:>6} {:>10}", "drift", "err@probe") : "");
  for (size_t i = 0; i < s.runs.size(); ++i) {
    const ValidatedRun& r = s.runs[i];
    const std::string plan = plan_to_inline(r.choice.plan);
    if (!r.ok) {
      o += fmt::format("{:>3}  {:<46} {:<24} {:>10.1f}  failed: {}\n", i + 1, plan, r.choice.why,
                       1e3 * r.choice.predicted.step_time_s, r.failure);
      continue;
    }
    const std::string at_probe = !probed       ? ""
                                 : r.drift > 0 ? fmt::format(" {:>6.2f} {:>10}", r.drift, pct(r.error_at_probe))
                                               : fmt::format(" {:>6} {:>10}", "-", "-");
    o += fmt::format("{:>3}  {:<46} {:<24} {:>10.1f} {:>10.1f} {:>8} {:>9} {:>9} {:>8}{}\n", i + 1, plan, r.choice.why,
                     1e3 * r.cmp.predicted_step_s, 1e3 * r.cmp.measured_step_s, pct(r.cmp.step_time_error),
                     mib(r.cmp.predicted_memory_bytes), mib(r.cmp.measured_memory_bytes), pct(r.cmp.memory_error),
                     at_probe);
  }
  o += fmt::format("\nstep time: median |error| {}, max |error| {}, Spearman rank correlation {:.2f}\n",
                   apct(s.median_abs_step_error), apct(s.max_abs_step_error), s.spearman_step_time);
  o += fmt::format("step time less the measured skew (waits for a later peer): median |error| {}, max |error| {}\n",
                   apct(s.median_abs_step_error_net_skew), apct(s.max_abs_step_error_net_skew));
  o += fmt::format("memory (tracked peak): median |error| {}; largest |error| of any memory term {}\n",
                   apct(s.median_abs_memory_error), apct(s.max_abs_memory_term_error));
  o += probe_line(s);
  return o;
}

std::string validation_markdown(const ValidationSummary& s) {
  std::string o = fmt::format("# strata validate: {} on {} rank(s)\n\n", s.model, s.ranks);
  o += fmt::format("Cluster profile: `{}` ({}). Each plan trained {} steps under mpirun; measured step time is the "
                   "median step, terms are means per step after the first. Errors are (predicted - measured) / "
                   "measured. Communication terms are measured net of skew: the part of a wait spent before the "
                   "last peer reached the collective (load imbalance, a slower core), shown as its own term. The "
                   "pipeline bubble likewise: the measured bubble less what replaying the step's schedule at the "
                   "stages' measured mean compute implies (steps of unequal length, a slower peer).\n\n",
                   s.cluster, s.cluster_description, s.steps);
  o += fmt::format("- step time: median |error| **{}**, max |error| **{}**, Spearman rank correlation **{:.2f}**\n",
                   apct(s.median_abs_step_error), apct(s.max_abs_step_error), s.spearman_step_time);
  o += fmt::format("- step time less the measured skew (waits for a peer that reached a collective later): median "
                   "|error| **{}**, max |error| **{}**\n",
                   apct(s.median_abs_step_error_net_skew), apct(s.max_abs_step_error_net_skew));
  o += fmt::format("- memory (tracked peak, without the framework overhead): median |error| **{}**; largest |error| "
                   "of any memory term **{}**\n\n",
                   apct(s.median_abs_memory_error), apct(s.max_abs_memory_term_error));
  if (s.probed > 0) o += "- " + probe_line(s) + "\n";
  if (s.calibrated) o += "## Calibration\n\n```\n" + format_calibration(s) + "```\n\n";
  o += "![predicted against measured step time](step_time.svg)\n\n![time by term](time_breakdown.svg)\n\n"
       "![memory by term](memory.svg)\n\n";
  o += "| # | plan | why | predicted ms | measured ms | error | predicted MiB | measured MiB | error |\n"
       "|---|---|---|---:|---:|---:|---:|---:|---:|\n";
  for (size_t i = 0; i < s.runs.size(); ++i) {
    const ValidatedRun& r = s.runs[i];
    if (!r.ok) {
      o += fmt::format("| {} | `{}` | {} | {:.1f} | failed | {} | | | |\n", i + 1, plan_to_inline(r.choice.plan),
                       r.choice.why, 1e3 * r.choice.predicted.step_time_s, esc(r.failure));
      continue;
    }
    o += fmt::format("| {} | `{}` | {} | {:.1f} | {:.1f} | {} | {} | {} | {} |\n", i + 1, plan_to_inline(r.choice.plan),
                     r.choice.why, 1e3 * r.cmp.predicted_step_s, 1e3 * r.cmp.measured_step_s,
                     pct(r.cmp.step_time_error), mib(r.cmp.predicted_memory_bytes), mib(r.cmp.measured_memory_bytes),
                     pct(r.cmp.memory_error));
  }
  for (size_t i = 0; i < s.runs.size(); ++i) {
    const ValidatedRun& r = s.runs[i];
    o += fmt::format("\n## {}. `{}` ({})\n\n", i + 1, plan_to_inline(r.choice.plan), r.choice.why);
    o += fmt::format("Files: [plan]({0}/plan.json), [predicted]({0}/predicted.json), [measured]({0}/measured.json), "
                     "traces [predicted]({0}/predicted.trace.json) and [measured]({0}/measured.trace.json) (open both "
                     "in Perfetto or chrome://tracing), [log]({0}/train.log).\n\n",
                     r.dir);
    if (!r.ok) {
      o += "Training failed: " + esc(r.failure) + "\n";
      continue;
    }
    o += "| time term | predicted ms | measured ms | error |\n|---|---:|---:|---:|\n";
    for (const TermError& t : r.cmp.time)
      if (t.predicted != 0 || t.measured != 0)
        o += fmt::format("| {} | {:.2f} | {:.2f} | {} |\n", t.term, 1e3 * t.predicted, 1e3 * t.measured, pct(t.error));
    o += "\n| memory term | predicted MiB | measured MiB | error |\n|---|---:|---:|---:|\n";
    for (const TermError& t : r.cmp.memory)
      o += fmt::format("| {} | {} | {} | {} |\n", t.term, mib(t.predicted), mib(t.measured), pct(t.error));
  }
  return o;
}

std::string svg_step_time(const ValidationSummary& s) {
  double vmax = 0;
  for (const ValidatedRun& r : s.runs)
    if (r.ok) vmax = std::max({vmax, r.cmp.predicted_step_s, r.cmp.measured_step_s});
  if (vmax <= 0) vmax = 1;
  vmax *= 1.15e3;  // ms, with room
  const double S = 360, left = 60, top = 40;
  auto px = [&](double ms) { return left + ms / vmax * S; };
  auto py = [&](double ms) { return top + S - ms / vmax * S; };
  std::string o = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" font-family=\"sans-serif\" "
      "font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"20\" font-size=\"14\">Step time: predicted against measured ({}, {} ranks)</text>\n",
      left + S + 40, top + S + 50, left, esc(s.model), s.ranks);
  o += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"black\"/>\n", left, top, S, S);
  for (int i = 1; i <= 4; ++i) {
    const double v = vmax * i / 4.0;
    o += fmt::format("<text x=\"{:.1f}\" y=\"{:.0f}\" text-anchor=\"middle\">{:.3g}</text>"
                     "<text x=\"{:.0f}\" y=\"{:.1f}\" text-anchor=\"end\">{:.3g}</text>\n",
                     px(v), top + S + 14, v, left - 4, py(v) + 4, v);
  }
  // y = x, and the +-15% band of the accuracy target.
  o += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"black\"/>\n", px(0), py(0),
                   px(vmax), py(vmax));
  for (double k : {0.85, 1.15})
    o += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#999\" "
                     "stroke-dasharray=\"4 3\"/>\n",
                     px(0), py(0), px(std::min(vmax, vmax / k)), py(std::min(vmax * k, vmax)));
  for (size_t i = 0; i < s.runs.size(); ++i) {
    const ValidatedRun& r = s.runs[i];
    if (!r.ok) continue;
    const double x = px(1e3 * r.cmp.measured_step_s), y = py(1e3 * r.cmp.predicted_step_s);
    o += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4\" fill=\"{}\"><title>#{} {}: predicted {:.1f} ms, "
                     "measured {:.1f} ms ({})</title></circle><text x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n",
                     x, y, kColors[0], i + 1, plan_to_inline(r.choice.plan), 1e3 * r.cmp.predicted_step_s,
                     1e3 * r.cmp.measured_step_s, pct(r.cmp.step_time_error), x + 6, y - 4, i + 1);
  }
  o += fmt::format("<text x=\"{:.0f}\" y=\"{:.0f}\" text-anchor=\"middle\">measured step time (ms)</text>\n",
                   left + S / 2, top + S + 32);
  o += fmt::format("<text x=\"14\" y=\"{0:.0f}\" transform=\"rotate(-90 14 {0:.0f})\" text-anchor=\"middle\">predicted "
                   "step time (ms)</text>\n",
                   top + S / 2);
  o += fmt::format("<text x=\"{:.0f}\" y=\"{:.0f}\">solid: y = x; dashed: +-15%</text>\n", left, top + S + 46);
  return o + "</svg>\n";
}

std::string svg_time_breakdown(const ValidationSummary& s) {
  return svg_stacked(s, "Time per step by term: predicted (P) beside measured (M)", "ms",
                     {"forward", "backward", "recompute", "tp_comm", "cp_comm", "pp_comm", "dp_comm", "pipeline_bubble",
                      "optimizer", "skew"},
                     1e3, &RunComparison::time);
}

std::string svg_memory(const ValidationSummary& s) {
  return svg_stacked(s, "Peak memory by term (most loaded rank): predicted (P) beside measured (M)", "MiB",
                     {"weights", "gradients", "optimizer_states", "activations", "comm_buffers"}, 1.0 / (1024.0 * 1024.0),
                     &RunComparison::memory);
}

}  // namespace strata
