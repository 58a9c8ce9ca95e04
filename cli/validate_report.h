// The files `strata validate` writes into its report folder: validation.json (SPEC.md
// "Validation output"), report.md, and three SVG charts (predicted against measured step
// time with the y = x line; time by term, predicted beside measured; memory by term).
// Formatting only: the numbers come from planner/validation.h.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>  // a run holds its measured JSON by value

#include "costmodel/json_input.h"
#include "planner/validation.h"

namespace strata {

struct ValidatedRun {
  ValidationPlan choice;
  std::string dir;        // relative to the report folder: plans/NN-...
  bool ok = false;        // the training run finished and its JSON parsed
  std::string failure;    // why not
  Json measured;          // strata train --json
  RunComparison cmp;
  // The GEMM probe just before the run (--cluster measure): gemm_drift, 0 where none ran;
  // the step predicted by the profile at the probe's rate, and its error.
  double drift = 0, predicted_at_probe_s = 0, error_at_probe = 0;
  std::string probe_error;  // why a probe that ran gave no drift; empty otherwise
};

struct ValidationSummary {
  std::string model, cluster, cluster_description;
  int64_t ranks = 0, steps = 0;
  std::vector<ValidatedRun> runs;
  double median_abs_step_error = 0, max_abs_step_error = 0, spearman_step_time = 0;
  // The same against the measured step less its skew (the "skew" term: waits for a peer
  // that reached a collective later), which no plan-level model predicts.
  double median_abs_step_error_net_skew = 0, max_abs_step_error_net_skew = 0;
  double median_abs_memory_error = 0, max_abs_memory_term_error = 0;
  // Over the runs with a probe: the step-time error at the probe's rate, and the drifts.
  int64_t probed = 0;
  double median_abs_error_at_probe = 0, max_abs_error_at_probe = 0, min_drift = 0, max_drift = 0;
  // --calibrate: factors fitted to every finished run, and each run's step-time error when
  // predicted by a profile fitted to the other runs only (leave-one-out).
  bool calibrated = false;
  Calibration calibration;
  std::vector<double> held_out_error;  // per finished run, in order
  double median_abs_before = 0, median_abs_after = 0, max_abs_before = 0, max_abs_after = 0;
  std::string calibrated_cluster_file;
};

// Fits the calibration (leave-one-out and on all runs) and fills the fields above.
void calibrate(ValidationSummary& s, const ModelSpec& m, const Cluster& cl);
std::string format_calibration(const ValidationSummary& s);

// Fills the summary statistics from the runs that finished.
void summarise(ValidationSummary& s);

Json validation_to_json(const ValidationSummary& s);
std::string format_validation_table(const ValidationSummary& s);  // the stdout table
std::string validation_markdown(const ValidationSummary& s);
std::string svg_step_time(const ValidationSummary& s);
std::string svg_time_breakdown(const ValidationSummary& s);
std::string svg_memory(const ValidationSummary& s);

}  // namespace strata
