// What `strata validate` decides and computes without running anything: which plans to
// train (the K best feasible ones, then a spread that exercises every mechanism the
// executor has at least once) and how predicted and measured compare (relative errors per
// time and memory term, median / max, Spearman rank correlation). Pure; the running and
// the report files live in cli/.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "costmodel/estimate.h"

namespace strata {

struct ValidationPlan {
  Plan plan;
  Estimate predicted;
  std::string why;  // "best 1", "exercises zero3", ...
};

struct ValidationChoiceOptions {
  int64_t ranks = 2;
  int64_t gbs = 16;
  Precision precision = Precision::fp32;
  int best = 3;         // the K best feasible plans
  bool spread = true;   // then one plan per mechanism not yet exercised
  // The executor's own rules (beyond the cost model's): empty string when it can run p.
  std::function<std::string(const Plan&)> runnable;
};

// The mechanisms the spread covers, in order, with the predicate that says a plan uses it.
struct Mechanism {
  const char* name;
  std::function<bool(const Plan&)> uses;
};
const std::vector<Mechanism>& validation_mechanisms();

// Feasible plans ranked by predicted step time, then the spread (one per mechanism, then
// the slowest plan and the 75th percentile, so the set spans the range). Deterministic.
// `rejected`, if given, receives the search's rejections by reason, the plans the
// executor cannot run under "executor", and the number of candidates searched under "".
std::vector<ValidationPlan> choose_validation_plans(const ModelSpec& m, const Cluster& cl,
                                                    const ValidationChoiceOptions& o,
                                                    std::map<std::string, int64_t>* rejected = nullptr);

// Predicted against measured for one run. Errors are (predicted - measured) / measured;
// NaN where the measured value is zero (a term the run did not have).
struct TermError {
  std::string term;
  double predicted = 0, measured = 0, error = 0;
};
struct RunComparison {
  double predicted_step_s = 0, measured_step_s = 0, step_time_error = 0;
  double predicted_memory_bytes = 0, measured_memory_bytes = 0, memory_error = 0;  // peak, tracked terms
  std::vector<TermError> time, memory;
};
// `measured` is the JSON `strata train --json` writes.
RunComparison compare_run(const Estimate& predicted, const Json& measured);

// Host drift: a GEMM probe's points (FLOPs of one GEMM, FLOP/s; strata profile
// --gemm-probe, run just before a validation run) against the cluster's GEMM curve: the
// time the curve gives those GEMMs over the time they took (1: as profiled, 0.8: the host
// runs them at four fifths of the profile's rate now). Calibration{gemm = drift} is the
// profile at the probe's rate.
double gemm_drift(const Cluster& cl, const std::vector<std::pair<double, double>>& probe);

// --calibrate: the profile's free parameters, as factors on what it measured. Fitted to
// measured runs (Nelder-Mead) minimising the mean squared log ratio of predicted to
// measured step time and compute time, plus a weak pull of every factor towards 1 (no
// overhead) so that what the data cannot tell apart stays as measured.
struct Calibration {
  double gemm = 1;         // x the GEMM efficiency curve
  double memory = 1;       // x the memory-bound kernels' efficiency curve
  double link = 1;         // x the intra-node link bandwidth (latency / link)
  double overhead_s = 0;   // + per step
};
Cluster apply_calibration(const Cluster& cl, const Calibration& c);
struct MeasuredRun {
  Plan plan;
  double step_s = 0;
  double compute_s = 0;  // forward + backward + recompute per step; 0: not known
};
Calibration fit_calibration(const ModelSpec& m, const Cluster& cl, const std::vector<MeasuredRun>& runs);
// Leave-one-out: each run predicted by the profile fitted to all the others. Returns the
// held-out relative errors, in the order of `runs`.
std::vector<double> held_out_errors(const ModelSpec& m, const Cluster& cl, const std::vector<MeasuredRun>& runs);
Json calibration_to_json(const Calibration& c);

double relative_error(double predicted, double measured);
double median(std::vector<double> v);
// Spearman's rank correlation (average ranks for ties); NaN for fewer than 2 points.
double spearman(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace strata
