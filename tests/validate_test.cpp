// strata validate: the arithmetic (Spearman, median, errors per term), the choice of plans
// (the K best plus one plan per mechanism), and a short run end to end on 2 MPI ranks whose
// report files must exist and parse. Accuracy itself is a benchmark (README), not asserted.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "costmodel/estimate.h"
#include "executor/train.h"
#include "costmodel/stack.h"
#include "planner/validation.h"
#include "train_runner.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

using strata_test::slurp;

TEST(Validation, SpearmanAndMedian) {
  EXPECT_DOUBLE_EQ(spearman({1, 2, 3, 4}, {10, 20, 30, 40}), 1.0);
  EXPECT_DOUBLE_EQ(spearman({1, 2, 3, 4}, {4, 3, 2, 1}), -1.0);
  // Monotone but not linear: still 1.
  EXPECT_DOUBLE_EQ(spearman({1, 2, 3, 4, 5}, {1, 4, 9, 16, 1000}), 1.0);
  // Hand-computed with ties: ranks a = (1, 2.5, 2.5, 4), b = (1, 2, 3, 4): r = 4.5 / sqrt(4.5 * 5).
  EXPECT_NEAR(spearman({1, 2, 2, 3}, {1, 2, 3, 4}), 4.5 / std::sqrt(4.5 * 5.0), 1e-12);
  EXPECT_TRUE(std::isnan(spearman({1}, {2})));
  EXPECT_DOUBLE_EQ(median({3, 1, 2}), 2.0);
  EXPECT_DOUBLE_EQ(median({4, 1, 3, 2}), 2.5);
  EXPECT_DOUBLE_EQ(median({NAN, 5, 1}), 3.0);  // NaN (a term a run did not have) is left out
  EXPECT_DOUBLE_EQ(relative_error(90, 100), -0.1);
  EXPECT_TRUE(std::isnan(relative_error(1, 0)));
}

TEST(Validation, CompareRunMatchesTermsByName) {
  const ModelSpec m = load_model("tiny-gpt");
  const Cluster cl = load_cluster("local-cpu");
  Plan p = load_plan("dp=2,mbs=2,gbs=8,precision=fp32");
  const Estimate e = estimate(m, cl, p);
  ASSERT_TRUE(e.valid);
  Json meas;
  meas["median_step_time_s"] = e.step_time_s * 2;
  meas["time_s"] = {{"forward", e.time.forward * 2}, {"backward", e.time.backward}, {"dp_comm_in_flight", 1.0}};
  meas["peak_memory_bytes"] = {{"weights", e.memory.weights}, {"activations", e.memory.activations / 2},
                               {"total", e.memory.peak - e.memory.framework_overhead}};
  const RunComparison c = compare_run(e, meas);
  EXPECT_DOUBLE_EQ(c.step_time_error, -0.5);
  ASSERT_EQ(c.time.size(), 2u);  // only the terms both sides have
  EXPECT_EQ(c.time[0].term, "forward");
  EXPECT_DOUBLE_EQ(c.time[0].error, -0.5);
  EXPECT_NEAR(c.time[1].error, 0.0, 1e-12);
  ASSERT_EQ(c.memory.size(), 3u);
  EXPECT_EQ(c.memory[1].term, "activations");
  EXPECT_NEAR(c.memory[1].error, 1.0, 1e-12);
  EXPECT_EQ(c.memory[2].term, "peak");  // without the framework overhead, which is no tensor
  EXPECT_NEAR(c.memory_error, 0.0, 1e-12);
}

// Communication is compared net of the skew the executor measured in it (the wait before
// the last peer reached the collective), and the skew is a term of its own, so the measured
// terms still add up: tp 30 ms of which 20 skew -> 10; dp 8 of which 3 -> 5; cp has no
// skew recorded -> as measured; the pipeline bubble 40 ms of which 15 the schedule does not
// imply (pp_skew) -> 25; skew 20 + 3 + 15 = 38 ms against 0 predicted (error -100 %).
// A skew larger than its wait (not possible from one rank, but the two are maxima over
// ranks) is capped at the wait.
TEST(Validation, CompareRunNetsOutSkew) {
  const ModelSpec m = load_model("tiny-gpt");
  const Cluster cl = load_cluster("local-cpu");
  const Estimate e = estimate(m, cl, load_plan("tp=2,mbs=2,gbs=8,precision=fp32"));
  ASSERT_TRUE(e.valid);
  Json meas;
  meas["median_step_time_s"] = e.step_time_s;
  meas["time_s"] = {{"forward", 0.1}, {"tp_comm", 0.030}, {"tp_skew", 0.020}, {"dp_comm", 0.008},
                    {"dp_skew", 0.003}, {"cp_comm", 0.004}, {"pp_comm", 0.001}, {"pipeline_bubble", 0.040},
                    {"pp_skew", 0.015}};
  meas["peak_memory_bytes"] = Json::object();
  const RunComparison c = compare_run(e, meas);
  std::map<std::string, double> got;
  for (const TermError& t : c.time) got[t.term] = t.measured;
  EXPECT_DOUBLE_EQ(got.at("forward"), 0.1);
  EXPECT_NEAR(got.at("tp_comm"), 0.010, 1e-15);
  EXPECT_NEAR(got.at("dp_comm"), 0.005, 1e-15);
  EXPECT_DOUBLE_EQ(got.at("cp_comm"), 0.004);
  EXPECT_DOUBLE_EQ(got.at("pp_comm"), 0.001);  // no skew is taken out of pipeline sends
  EXPECT_NEAR(got.at("pipeline_bubble"), 0.025, 1e-15);
  ASSERT_EQ(c.time.back().term, "skew");
  EXPECT_NEAR(c.time.back().measured, 0.038, 1e-15);
  EXPECT_DOUBLE_EQ(c.time.back().predicted, 0.0);
  EXPECT_DOUBLE_EQ(c.time.back().error, -1.0);
  meas["time_s"]["tp_skew"] = 0.5;
  const RunComparison capped = compare_run(e, meas);
  for (const TermError& t : capped.time) {
    if (t.term == "tp_comm") {
      EXPECT_DOUBLE_EQ(t.measured, 0.0);
    }
  }
  EXPECT_NEAR(capped.time.back().measured, 0.048, 1e-15);
}

TEST(Validation, ChoiceHasTheBestThenEveryMechanism) {
  const ModelSpec m = load_model("tiny-gpt");
  const Cluster cl = load_cluster("local-cpu");
  ValidationChoiceOptions o;
  o.ranks = 2;
  o.gbs = 16;
  o.best = 3;
  o.runnable = [&](const Plan& p) {
    try {
      validate_train_plan(m, p, 2);
      return std::string();
    } catch (const InputError& e) {
      return std::string(e.what());
    }
  };
  const std::vector<ValidationPlan> v = choose_validation_plans(m, cl, o);
  ASSERT_GE(v.size(), 6u);
  for (int i = 0; i + 1 < 3; ++i) EXPECT_LE(v[i].predicted.step_time_s, v[i + 1].predicted.step_time_s);
  for (const Mechanism& mech : validation_mechanisms()) {
    bool used = false;
    for (const ValidationPlan& x : v) used = used || mech.uses(x.plan);
    EXPECT_TRUE(used) << mech.name << " is exercised by no chosen plan";
  }
  std::set<std::string> distinct;
  for (const ValidationPlan& x : v) distinct.insert(plan_to_inline(x.plan));
  EXPECT_EQ(distinct.size(), v.size());
}

TEST(Validation, CalibrationRecoversAKnownSlowdown) {
  // "Measured" runs made by the cost model itself on a machine whose GEMMs run at 0.8 of
  // the profile's curve and whose memory-bound kernels at 0.7: the fit must find them and
  // predict held-out runs from the others.
  const ModelSpec m = model_on_stack(load_model("tiny-gpt"), load_cluster("local-cpu"));
  const Cluster cl = load_cluster("local-cpu");
  Calibration truth;
  truth.gemm = 0.8;
  truth.memory = 0.7;
  const Cluster slow = apply_calibration(cl, truth);
  std::vector<MeasuredRun> runs;
  for (const char* p : {"dp=2,mbs=4,gbs=16", "tp=2,mbs=8,gbs=16", "pp=2,mbs=2,gbs=16", "dp=2,mbs=2,gbs=16,zero=3",
                        "tp=2,sp=1,mbs=4,gbs=16,recompute=full", "dp=2,mbs=8,gbs=16,zero=1"}) {
    Plan plan = load_plan(std::string(p) + ",precision=fp32");
    const Estimate e = estimate(m, slow, plan);
    runs.push_back({plan, e.step_time_s, e.time.forward + e.time.backward + e.time.recompute});
  }
  const Calibration fit = fit_calibration(m, cl, runs);
  EXPECT_NEAR(fit.gemm, 0.8, 0.04);
  // Memory-bound kernels are a small part of these steps, so the weak prior towards 1
  // holds the factor back from 0.7; it must still move towards it.
  EXPECT_GT(fit.memory, 0.6);
  EXPECT_LT(fit.memory, 0.95);
  EXPECT_LT(fit.overhead_s, 0.01 * runs[0].step_s);
  const std::vector<double> held = held_out_errors(m, cl, runs);
  ASSERT_EQ(held.size(), runs.size());
  for (double e : held) EXPECT_LT(std::fabs(e), 0.02);
  // Uncalibrated, the same runs are off by more than 10%.
  EXPECT_GT(std::fabs(relative_error(estimate(m, cl, runs[0].plan).step_time_s, runs[0].step_s)), 0.1);
  // A calibrated profile is a valid cluster (efficiencies stay within (0, 1]).
  Calibration up;
  up.gemm = 3.0;
  EXPECT_NO_THROW(cluster_from_json(cluster_to_json(apply_calibration(cl, up)), "calibrated"));
  // The factor moves into the peaks there, which the fused attention is charged against
  // too: its rate (peak x efficiency) stays as profiled.
  const Cluster fast = apply_calibration(cl, up);
  for (auto eff : {&Device::flash_fwd_efficiency, &Device::flash_bwd_efficiency})
    EXPECT_NEAR(fast.device.peak_fp32_flops * (fast.device.*eff), cl.device.peak_fp32_flops * (cl.device.*eff),
                1e-12 * cl.device.peak_fp32_flops * (cl.device.*eff));
}

// gemm_drift: the probe's GEMMs at the profile's rate over their time. A flat curve at 0.5
// of 100 GFLOP/s gives 50 GFLOP/s at every size; a probe of 1 GFLOP at 40 GFLOP/s and 3 at
// 60: the profile's 0.02 + 0.06 = 0.08 s against 0.025 + 0.05 = 0.075 s, drift 16/15.
// Points that measured nothing are skipped; no points, no drift (0).
TEST(Validation, GemmDriftIsTheProfilesTimeOverTheProbes) {
  Cluster cl = load_cluster("local-cpu");
  cl.device.peak_bf16_flops = 100e9;
  cl.device.gemm_efficiency = Curve({{1.0, 0.5}});
  EXPECT_NEAR(gemm_drift(cl, {{1e9, 40e9}, {3e9, 60e9}}), 0.08 / 0.075, 1e-12);
  EXPECT_NEAR(gemm_drift(cl, {{1e9, 40e9}, {3e9, 60e9}, {0.0, 5e9}, {2e9, 0.0}}), 0.08 / 0.075, 1e-12);
  EXPECT_EQ(gemm_drift(cl, {}), 0.0);
  EXPECT_NEAR(gemm_drift(cl, {{1e9, 50e9}}), 1.0, 1e-12);  // as profiled
}

int run_strata(const std::string& args, std::string* err) {
  const fs::path e = fs::temp_directory_path() / ("strata_validate_err_" + std::to_string(::getpid()));
  const std::string cmd = std::string("ASAN_OPTIONS=detect_leaks=0 ") + STRATA_BINARY + " " + args + " >/dev/null 2>" + e.string();
  const int st = std::system(cmd.c_str());
  *err = slurp(e);
  fs::remove(e);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

TEST(Validation, EndToEndOnTwoRanksWritesAReportThatParses) {
  const fs::path dir = fs::temp_directory_path() / ("strata_validate_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::string err;
  // Two best plans and one per mechanism, 2 steps each, on a 32-token sequence: short.
  const int rc = run_strata("validate --model tiny-gpt --cluster local-cpu --ranks 2 --plans 2 --steps 2 "
                            "--seq-length 32 --global-batch-size 8 --calibrate --report " + dir.string(),
                            &err);
  ASSERT_EQ(rc, 0) << err;
  const Json v = Json::parse(slurp(dir / "validation.json"));
  EXPECT_EQ(v.at("model"), "tiny-gpt");
  EXPECT_EQ(v.at("ranks"), 2);
  const Json& runs = v.at("runs");
  ASSERT_GE(runs.size(), 6u);
  for (const Json& r : runs) {
    ASSERT_TRUE(r.at("ok").get<bool>()) << r.dump();
    EXPECT_GT(r.at("measured").at("median_step_time_s").get<double>(), 0);
    EXPECT_GT(r.at("predicted").at("step_time_s").get<double>(), 0);
    EXPECT_TRUE(r.at("step_time_error").is_number());
    EXPECT_TRUE(r.at("time_terms_s").contains("forward"));
    EXPECT_TRUE(r.at("memory_terms_bytes").contains("weights"));
    const fs::path pd = dir / r.at("report_dir").get<std::string>();
    for (const char* f : {"plan.json", "predicted.json", "measured.json", "predicted.trace.json", "measured.trace.json"}) {
      ASSERT_TRUE(fs::exists(pd / f)) << (pd / f);
      const Json j = Json::parse(slurp(pd / f));  // throws (fails the test) when malformed
      if (std::string(f).find("trace") != std::string::npos) {
        EXPECT_GT(j.at("traceEvents").size(), 2u) << f;
      }
    }
  }
  EXPECT_TRUE(v.at("spearman_step_time").is_number());
  // --calibrate: factors, held-out errors per run, and a refined cluster that loads.
  ASSERT_TRUE(v.contains("calibration"));
  EXPECT_EQ(v.at("calibration").at("held_out_step_time_error").size(), runs.size());
  EXPECT_GT(v.at("calibration").at("factors").at("gemm_efficiency_factor").get<double>(), 0);
  EXPECT_NO_THROW(load_cluster((dir / "calibrated.json").string()));
  EXPECT_TRUE(v.at("median_abs_step_time_error").is_number());
  EXPECT_TRUE(v.at("median_abs_step_time_error_net_of_skew").is_number());
  for (const char* f : {"step_time.svg", "time_breakdown.svg", "memory.svg"}) {
    const std::string s = slurp(dir / f);
    EXPECT_EQ(s.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u) << f;
    EXPECT_NE(s.find("</svg>"), std::string::npos) << f;
    EXPECT_GE(std::count(s.begin(), s.end(), '<'), 20) << f;  // drew something
  }
  EXPECT_NE(slurp(dir / "step_time.svg").find("<circle"), std::string::npos);
  const std::string md = slurp(dir / "report.md");
  EXPECT_NE(md.find("| # | plan |"), std::string::npos);
  EXPECT_NE(md.find("step_time.svg"), std::string::npos);
  fs::remove_all(dir);
}

// With the profile measured in the run, a GEMM probe before each plan: its drift, the step
// predicted at the probe's rate and that prediction's error, in the JSON and the table.
TEST(Validation, GemmProbeBeforeEachRunOnAMeasuredProfile) {
  const fs::path dir = fs::temp_directory_path() / ("strata_validate_probe_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::string err;
  const int rc = run_strata("validate --model tiny-gpt --cluster measure --quick-profile --ranks 2 --plans 1 "
                            "--no-spread --steps 2 --seq-length 32 --global-batch-size 8 --report " + dir.string(),
                            &err);
  ASSERT_EQ(rc, 0) << err;
  const Json v = Json::parse(slurp(dir / "validation.json"));
  const Json& runs = v.at("runs");
  ASSERT_EQ(runs.size(), 1u);
  const Json& r = runs.at(0);
  ASSERT_TRUE(r.at("ok").get<bool>()) << r.dump();
  const double drift = r.at("gemm_drift").get<double>();
  EXPECT_GT(drift, 0.05) << "a probe within 20x of its profile, minutes apart";
  EXPECT_LT(drift, 20.0);
  const double at_probe = r.at("predicted_at_probe_step_s").get<double>();
  const double measured = r.at("measured").at("median_step_time_s").get<double>();
  EXPECT_NEAR(r.at("step_time_error_at_probe").get<double>(), (at_probe - measured) / measured, 1e-12);
  // The profile at the probe's rate is the measured cluster with its GEMMs scaled by the drift.
  Calibration k;
  k.gemm = drift;
  const Cluster cl = load_cluster((dir / "cluster.json").string());
  const ModelSpec m = model_on_stack(load_model("tiny-gpt", 32), cl);
  EXPECT_NEAR(estimate(m, apply_calibration(cl, k), load_plan((dir / r.at("report_dir").get<std::string>() / "plan.json").string())).step_time_s, at_probe, 1e-12 * at_probe);
  EXPECT_EQ(v.at("gemm_probe").at("runs").get<int>(), 1);
  EXPECT_TRUE(fs::exists(dir / r.at("report_dir").get<std::string>() / "probe.json"));
  EXPECT_NE(slurp(dir / "report.md").find("host drift"), std::string::npos);
  // A probe needs the model whose GEMMs it times.
  EXPECT_EQ(run_strata("profile --gemm-probe", &err), 2);
  EXPECT_NE(err.find("--gemm-probe"), std::string::npos) << err;
  fs::remove_all(dir);
}

TEST(Validation, BadInputExitsTwo) {
  std::string err;
  EXPECT_EQ(run_strata("validate --model tiny-gpt --cluster local-cpu", &err), 2);
  EXPECT_NE(err.find("--ranks"), std::string::npos) << err;
  EXPECT_EQ(run_strata("validate --model tiny-gpt --cluster local-cpu --ranks 2 --precision fp8", &err), 2);
  EXPECT_NE(err.find("--precision"), std::string::npos) << err;
  EXPECT_EQ(run_strata("validate --model nope --cluster local-cpu --ranks 2", &err), 2);
  EXPECT_EQ(run_strata("validate --model tiny-gpt --cluster local-cpu --ranks 2 --steps 1", &err), 2);
  EXPECT_NE(err.find("--steps"), std::string::npos) << err;
  EXPECT_EQ(run_strata("validate --model tiny-gpt --cluster no-such-cluster --ranks 2", &err), 2);
  // A launcher that is not there, said before anything runs (not exit 1 from each run)
  EXPECT_EQ(run_strata("validate --model tiny-gpt --cluster local-cpu --ranks 2 --mpirun /nonexistent/mpirun", &err), 2);
  EXPECT_NE(err.find("--mpirun: '/nonexistent/mpirun' is invalid: is not an executable file"), std::string::npos) << err;
  // A launcher that runs but fails without a word: the failure says so and where its log is
  // (it ended in "exit 1: " and nothing).
  const std::string report = ::testing::TempDir() + "validate_silent_launcher";
  EXPECT_EQ(run_strata("validate --model tiny-gpt --cluster measure --ranks 2 --mpirun /bin/false --report " + report, &err), 1);
  EXPECT_NE(err.find("strata profile failed (exit 1): no output (log: " + report + "/profile.log)"), std::string::npos)
      << err;
}

}  // namespace
}  // namespace strata
