// Accuracy on published training runs (tests/data/published_runs.csv): every usable row
// through estimate(), a per-row table, and the targets of issue 2: median |step-time
// error| <= 5 %, every row <= 15 %, BLOOM memory median <= 10 %, OOM rows predicted not to
// fit and every other row predicted to fit. The same presets serve every row.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <unistd.h>
#include <map>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "costmodel/estimate.h"
#include "published_runs.h"

namespace strata {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// One row of a published-runs CSV of NVIDIA's tables (hopper_runs.csv, moe_runs.csv)
// through estimate() as the harness would give it: measured step = global batch x sequence
// / (tokens per second per GPU x GPUs).
struct PublishedRun {
  ModelSpec m;
  Plan p;
  Estimate e;
  double measured = 0, err = 0;
};
PublishedRun run_published(const std::map<std::string, std::string>& r, const std::string& dir) {
  PublishedRun x;
  const std::string model = r.at("model").find('/') != std::string::npos ? dir + r.at("model") : r.at("model");
  x.m = load_model(model, std::stoll(r.at("seq_length")));
  const Cluster cl = load_cluster(r.at("cluster"));
  x.p = load_plan(r.at("plan") + ",gbs=" + r.at("global_batch_size"));
  const double gpus = std::stod(r.at("gpus"));
  EXPECT_EQ(static_cast<double>(x.p.world_size()), gpus) << r.at("label") << " " << r.at("plan");
  x.measured = std::stod(r.at("global_batch_size")) * static_cast<double>(x.m.S) / (std::stod(r.at("tokens_per_s_per_gpu")) * gpus);
  x.e = estimate(x.m, cl, x.p);
  EXPECT_TRUE(x.e.valid) << r.at("label") << ": " << (x.e.reasons.empty() ? "" : x.e.reasons[0].message);
  x.err = x.e.step_time_s / x.measured - 1;
  return x;
}

// The table of a published-runs CSV: the header, then a row per run (column widths: the
// group's, the model label's and the plan's).
struct RunTable {
  int group_w, label_w, plan_w;
  void header() const {
    fmt::print("{:<{}} {:<{}} {:<14} {:>5} {:>5} {:<{}} {:>8} {:>8} {:>7} {:>7} {:>4}\n", "group", group_w, "model",
               label_w, "cluster", "gpus", "gbs", "plan", plan_w, "meas_s", "pred_s", "err%", "memGiB", "fits");
  }
  void row(const std::map<std::string, std::string>& r, const PublishedRun& x) const {
    fmt::print("{:<{}} {:<{}} {:<14} {:>5} {:>5} {:<{}} {:>8.2f} {:>8.2f} {:>+7.1f} {:>7.1f} {:>4}\n", r.at("group"),
               group_w, r.at("label"), label_w, r.at("cluster"), r.at("gpus"), r.at("global_batch_size"), r.at("plan"),
               plan_w, x.measured, x.e.step_time_s, 100 * x.err, x.e.memory.peak / 1073741824.0,
               x.e.fits ? "yes" : "NO");
  }
};

// Each group's runs (median and max |error|, the median held to the group's bound), then
// all of them, the group column w wide; returns every run's |error|.
std::vector<double> group_medians(const std::map<std::string, std::vector<double>>& by_group,
                                  const std::map<std::string, double>& median_bound, int w) {
  std::vector<double> all;
  for (const auto& [g, v] : by_group) {
    fmt::print("  {:<{}} {:>2} runs  median |error| {:>5.1f}%  max {:>5.1f}%\n", g, w, v.size(), 100 * median(v),
               100 * *std::max_element(v.begin(), v.end()));
    EXPECT_LE(median(v), median_bound.at(g)) << g;
    all.insert(all.end(), v.begin(), v.end());
  }
  fmt::print("  {:<{}} {:>2} runs  median |error| {:>5.1f}%\n", "all", w, all.size(), 100 * median(all));
  return all;
}

struct Scored {
  testing::Case c;
  Estimate e;
  double step_err = 0, mem_err = 0;
};

std::vector<Scored> score_all() {
  std::vector<Scored> out;
  for (const auto& c : testing::published_cases(std::string(STRATA_SOURCE_DIR) + "/tests/data/published_runs.csv")) {
    const ModelSpec m = model_from_json(c.model, "model");
    const Cluster cl = load_cluster(c.cluster);
    const Plan p = plan_from_json(c.plan, "plan");
    Scored s{c, estimate(m, cl, p)};
    if (s.e.valid && c.measured_step_s > 0) s.step_err = (s.e.step_time_s - c.measured_step_s) / c.measured_step_s;
    if (s.e.valid && c.measured_memory_bytes > 0)
      s.mem_err = (s.e.memory.peak - c.measured_memory_bytes) / c.measured_memory_bytes;
    out.push_back(s);
  }
  return out;
}

TEST(Calibration, PublishedRuns) {
  const auto rows = score_all();
  ASSERT_EQ(rows.size(), 51u) << "57 rows less the 6 the harness skips";
  fmt::print("{:>4} {:<26} {:<12} {:>4} {:>3} {:>4} {:>2} {:>3} {:>5} {:<9} {:>9} {:>9} {:>7} {:>7} {:>7} {:>6} {:>4}\n",
             "row", "source", "model", "tp", "pp", "dp", "vp", "mbs", "zero", "recompute", "meas_s", "pred_s", "err%",
             "memGB", "predGB", "err%", "fits");
  std::vector<double> all, bloom_mem;
  std::map<std::string, std::vector<double>> by_source;
  double worst = 0, signed_sum = 0;
  std::string worst_row;
  for (const auto& s : rows) {
    const Plan& p = s.e.plan;
    ASSERT_TRUE(s.e.valid) << "row " << s.c.row_id << ": " << (s.e.reasons.empty() ? "" : s.e.reasons[0].message);
    fmt::print("{:>4} {:<26} {:<12.12} {:>4} {:>3} {:>4} {:>2} {:>3} {:>5} {:<9} {:>9.3f} {:>9.3f} {:>+7.1f} {:>7.1f} "
               "{:>7.1f} {:>+6.1f} {:>4}\n",
               s.c.row_id, s.c.source, s.c.model_label, p.t, p.p, p.d, p.v, p.mbs, p.zero, to_string(p.recompute),
               s.c.measured_step_s, s.e.step_time_s, 100 * s.step_err, s.c.measured_memory_bytes / 1e9,
               s.e.memory.peak / 1e9, 100 * s.mem_err, s.e.fits ? "yes" : "NO");
    if (s.c.measured_step_s > 0) {
      all.push_back(std::fabs(s.step_err));
      by_source[s.c.source].push_back(std::fabs(s.step_err));
      signed_sum += s.step_err;
      if (std::fabs(s.step_err) > worst) worst = std::fabs(s.step_err), worst_row = s.c.row_id;
    }
    if (s.c.measured_memory_bytes > 0) bloom_mem.push_back(std::fabs(s.mem_err));
  }
  fmt::print("\nstep time: {} rows, median |error| {:.1f}%, max {:.1f}% (row {}), mean signed {:+.1f}%\n", all.size(),
             100 * median(all), 100 * worst, worst_row, 100 * signed_sum / static_cast<double>(all.size()));
  for (const auto& [src, v] : by_source)
    fmt::print("  {:<30} {:>3} rows  median {:>5.1f}%  max {:>5.1f}%\n", src, v.size(), 100 * median(v),
               100 * *std::max_element(v.begin(), v.end()));
  fmt::print("BLOOM memory: {} rows, median |error| {:.1f}%, max {:.1f}%\n", bloom_mem.size(), 100 * median(bloom_mem),
             100 * *std::max_element(bloom_mem.begin(), bloom_mem.end()));

  EXPECT_LE(median(all), 0.05);
  EXPECT_LE(median(bloom_mem), 0.10);
  // Rows no mechanism of the model explains, named here and in README rather than absorbed
  // by a per-row fudge. They must stay within 25 %; every other row within 15 %. Each is
  // checked against sibling rows of the same table that differ from it in one setting: the
  // measurements are at least 10 % apart, the predictions at most 5 % (the model has no
  // mechanism that separates them, so it cannot fit both). Should the predictions part,
  // the test says so and the miss must be looked at again.
  struct KnownMiss {
    std::vector<std::string> siblings;
    std::string why;
  };
  const std::map<std::string, KnownMiss> known_misses = {
      {"441", {{"442"}, "BLOOM TP8 PP6 MBS2 measured 15% slower than the same run with MBS4 (row 442); the model gives "
                        "both alike"}},
      {"445", {{"444", "446"}, "BLOOM 178B with 104 heads measured 18% slower than 64 and 128 heads (rows 444, 446); "
                               "no head-count mechanism explains it"}},
      {"449", {{"450"}, "BLOOM TP8 measured 19% slower than TP4 for the same model (row 450); Jean Zay's TP=8 costs "
                        "more than the dgx-a100-80g preset's NVSwitch"}},
  };
  std::map<std::string, const Scored*> by_row;
  for (const auto& s : rows) by_row[s.c.row_id] = &s;
  for (const auto& [row, miss] : known_misses) {
    const Scored& r = *by_row.at(row);
    for (const auto& sib : miss.siblings) {
      const Scored& o = *by_row.at(sib);
      const double measured_apart = r.c.measured_step_s / o.c.measured_step_s - 1;
      const double predicted_apart = r.e.step_time_s / o.e.step_time_s - 1;
      fmt::print("row {} vs row {}: measured {:+.1f}%, predicted {:+.1f}%\n", row, sib, 100 * measured_apart,
                 100 * predicted_apart);
      EXPECT_GE(measured_apart, 0.10) << "row " << row << " vs " << sib;
      EXPECT_LE(std::fabs(predicted_apart), 0.05) << "rows " << row << " and " << sib
                                                  << " no longer predicted alike: recheck the known miss";
    }
  }
  for (const auto& s : rows) {
    if (s.c.measured_step_s <= 0) continue;
    const bool known = known_misses.count(s.c.row_id) > 0;
    EXPECT_LE(std::fabs(s.step_err), known ? 0.25 : 0.15) << "row " << s.c.row_id;
    if (known) fmt::print("known miss: row {} {:+.1f}%: {}\n", s.c.row_id, 100 * s.step_err, known_misses.at(s.c.row_id).why);
  }
  // Out of memory: every row that ran must fit; rows 439 and 440 ran out of memory and must
  // not fit. Row 454 (206B: h 14336, 82 layers, 7 slots per stage) also ran out of memory,
  // but row 448 (203B: h 13312, 94 layers, 8 slots per stage) ran the same plan at a
  // measured 67 GB, and per GPU row 454 holds 1 % more parameters and 5 % fewer activations:
  // no model consistent with row 448 predicts row 454 out of memory. So row 454 is reported,
  // not asserted, and what is asserted is that reason: the two predictions agree.
  const Scored* r448 = by_row.at("448");
  for (const auto& s : rows) {
    if (s.c.row_id == "454") {
      const double apart = s.e.memory.peak / r448->e.memory.peak - 1;
      fmt::print("known miss: row 454 ran out of memory; predicted {:.1f} GB of {:.1f} ({}), {:+.1f}% of row 448's "
                 "prediction (row 448 ran at a measured {:.0f} GB)\n",
                 s.e.memory.peak / 1e9, load_cluster(s.c.cluster).device.memory_bytes / 1e9,
                 s.e.fits ? "fits" : "does not fit", 100 * apart, r448->c.measured_memory_bytes / 1e9);
      EXPECT_LE(std::fabs(apart), 0.02) << "rows 448 and 454 no longer predicted alike: recheck the known miss";
      continue;
    }
    if (s.c.oom) EXPECT_FALSE(s.e.fits) << "row " << s.c.row_id << " ran out of memory but is predicted to fit";
    else EXPECT_TRUE(s.e.fits) << "row " << s.c.row_id << " ran but is predicted not to fit";
  }
}

// The harness's own path: model JSON and plan JSON files through `strata estimate --json`.
TEST(Calibration, EveryRowThroughTheBinary) {
  const auto rows = score_all();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("strata_cal_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  for (const auto& s : rows) {
    const auto model = dir / ("row" + s.c.row_id + "_model.json"), plan = dir / ("row" + s.c.row_id + "_plan.json");
    std::ofstream(model) << s.c.model.dump(2);
    std::ofstream(plan) << s.c.plan.dump(2);
    const std::string cmd = std::string(STRATA_BINARY) + " estimate --model " + model.string() + " --cluster " +
                            s.c.cluster + " --plan " + plan.string() + " --json";
    FILE* f = popen(cmd.c_str(), "r");
    ASSERT_NE(f, nullptr);
    std::string out;
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof buf, f)) out.append(buf, n);
    ASSERT_EQ(pclose(f), 0) << cmd;
    const Json j = Json::parse(out);
    EXPECT_DOUBLE_EQ(j["step_time_s"].get<double>(), s.e.step_time_s) << "row " << s.c.row_id;
    // Whole bytes in the JSON: six terms rounded, each within half a byte.
    EXPECT_TRUE(j["memory_bytes"]["peak"].is_number_integer()) << "row " << s.c.row_id;
    EXPECT_NEAR(j["memory_bytes"]["peak"].get<double>(), s.e.memory.peak, 3.0) << "row " << s.c.row_id;
    EXPECT_EQ(j["fits"].get<bool>(), s.e.fits) << "row " << s.c.row_id;
  }
  std::filesystem::remove_all(dir);
}

// Runs on newer GPUs that no parameter was fitted to (tests/data/hopper_runs.csv: NVIDIA's
// published NeMo and Megatron-Bridge pre-training tables, H100 and B200, mostly FP8, with
// context parallelism and FSDP; one BF16 FSDP2 run of NeMo AutoModel; 26 MLPerf Training
// results on H100, H200 and B200), each through
// estimate() as the harness would give it. Measured step = global batch x sequence /
// (tokens per second per GPU x GPUs). A guard, not a fit: the presets stay datasheet-scaled,
// and these bounds say how far each software generation has been from them, so a change to
// the model that moves these runs shows here. Megatron-Bridge (containers 25.09-26.04.01:
// the last two rows are 26.04.01's Llama 3 70B and 405B H100 plans, which ran 2.7 % and
// 5.5 % faster than 26.02's two rows before them) and NeMo AutoModel are held to 15 % per
// run; the older NeMo 24.12 and 25.02 containers ran up to 16 % slower than predicted (later
// containers ran the same models 5-18 % faster: GPT-3 175B on 512 H100s 825 -> 866 tokens/s
// per GPU, Llama 3 8B on 8 B200s 26,006 -> 30,624) and are held to 12 % and 20 % (fp8 GEMMs
// at the presets' measured 1.6x of bf16 and user buffers under "auto", 2026-12-07; before,
// at the datasheet's 2x without them, up to 24 % and held to 30 %). Each group's median is held near its value
// today as well, so a run well inside its bound cannot drift unseen. Every run ran, so
// every one must fit. The Bridge plans reduce gradients in bf16 (grad_reduce_in_fp32=0),
// as every Megatron-Bridge performance recipe of Llama 3 sets it; NeMo 24.12 and 25.02's
// scripts kept fp32 (NeMo set it off for FP8 from 2025-04). The mlperf rows are MLPerf Training
// results run with NVIDIA's NeMo code (mlcommons/training_results_v5.1, v5.0 and v4.1; each the
// median of the train_step_time its result logs give, over every logged step (every 32nd in the
// v5.1 8B configs) of its 3 or 10 runs; bf16 gradients and fp8 parameter gathers as the logs' or
// configs' DDP settings say; the label names the submitter and the nodes): Llama 3.1 405B on 512
// and 1024 H200s (Nebius, v5.1 and v5.0), on 256 and 448 B200s (University of Florida, v5.1, whose
// config leaves the user buffers off: tp_comm_overlap=0) and on 512-8192 H100s (NVIDIA, v5.0),
// GPT-3 175B on 256-3072 H100s (NVIDIA and Oracle, v4.1): held to 15 % per run and a median of 7 %.
// The mlperf-8b rows are Llama 3.1 8B (v5.1): HPE's 64 H200s, the FP8 B200 results (University of
// Florida 1-32 nodes, Dell, Oracle, Verda; the FP4 results left out) and Cisco's 8 and 16 H100
// nodes, every one a single micro-batch a GPU a step. Those are a known miss, held to 35 % and a
// median of 25 % as a guard: on one node within 1 %, with data parallelism across nodes 6-34 % fast
// (README, Accuracy). The three nemo-24.07 rows are the Nemotron models of NeMo 24.07's table
// (NVIDIA/NeMo docs/source/performance/performance_summary.md at 9c5c5e9709; its GPT-3 and Llama
// rows are the nemo-24.12 rows' numbers): squared-ReLU MLPs, their model JSONs in tests/data/models
// from NeMo's NemotronConfig (Nemotron3 8B and 22B, Nemotron4 340B: LayerNorm, rope, untied, no
// biases, 256,000 tokens); the 340B as NeMo-Framework-Launcher's nemotron_340b.yaml trains it
// (selective recompute, distributed_fused_adam with grad_sync_dtype bf16: grad_reduce_in_fp32=0;
// with fp32 gradients it would need 83.6 GiB). Held to 15 % per run.
TEST(Calibration, HopperAndBlackwellRuns) {
  const std::string dir = std::string(STRATA_SOURCE_DIR) + "/tests/data/";
  const auto rows = testing::read_csv(dir + "hopper_runs.csv");
  ASSERT_EQ(rows.size(), 53u);
  // Per run and for the group's median |error| (4.8 %, 10.2 %, 6.3 % and 11.9 % today,
  // nemo-24.07's 2.6 %, mlperf's 5.2 % and mlperf-8b's 21.4 %;
  // with fp8 GEMMs at the measured 1.6x of bf16 and "auto" user buffers; 7.3 %, 10.2 %,
  // 13.8 %, 12.2 % and 2.8 % before, by cancellation: see the README).
  const std::map<std::string, double> bound = {{"megatron-bridge", 0.15},
                                               {"nemo-automodel", 0.15},
                                               {"nemo-24.07", 0.15},
                                               {"nemo-24.12", 0.12},
                                               {"nemo-25.02", 0.20},
                                               {"mlperf", 0.15},
                                               {"mlperf-8b", 0.35}};
  const std::map<std::string, double> median_bound = {{"megatron-bridge", 0.07},
                                                      {"nemo-automodel", 0.15},
                                                      {"nemo-24.07", 0.07},
                                                      {"nemo-24.12", 0.09},
                                                      {"nemo-25.02", 0.15},
                                                      {"mlperf", 0.07},
                                                      {"mlperf-8b", 0.25}};
  std::map<std::string, std::vector<double>> by_group;
  const RunTable table{16, 24, 52};
  table.header();
  for (const auto& r : rows) {
    const PublishedRun x = run_published(r, dir);
    const Estimate& e = x.e;
    const double err = x.err;
    if (!e.valid) continue;
    const std::string run = r.at("group") + " " + r.at("label") + " on " + r.at("gpus") + " x " + r.at("cluster") +
                            ", gbs " + r.at("global_batch_size") + ", " + r.at("plan");
    table.row(r, x);
    by_group[r.at("group")].push_back(std::fabs(err));
    EXPECT_LE(std::fabs(err), bound.at(r.at("group"))) << run;
    EXPECT_TRUE(e.fits) << run << ": ran but is predicted not to fit";
  }
  EXPECT_LE(median(group_medians(by_group, median_bound, 16)), 0.08);  // 6.3 % today
}

// PyTorch FSDP2 runs on A100s (tests/data/fsdp_runs.csv): torchtitan's published Llama 2
// and Llama 3 table (docs/performance.md as of 2024, commit 0413364: 64 A100 80GB, FSDP2
// over all 64, bf16 parameters with fp32 gradient reduction, local batch 1 or 2), a stack
// of its own (eager PyTorch, not Megatron-core) that no parameter was fitted to. Its
// "selective layer" checkpointing wraps every second block (full recompute of half the
// layers: recompute_num_layers L/2); its "selective op" rows are its op policy
// (selective_ac_option op). The model's output is cast to fp32 before F.cross_entropy
// (model.py and train.py at 0413364): cross_entropy_loss_fusion=0. Today the 8B and 13B runs
// are predicted 6-9 % fast, the 70B ones within 0.5 % but the 70B's op row 13 % fast (the
// op policy costs 11 % over none, full recompute 32 %: measured, the op row at batch 1 ran
// as fast as full recompute at batch 2); the bounds hold them there (12 % a row, the op
// rows 15 %). The page's footnote: Llama 2 70B at local batch 2 with the op policy ran out
// of memory (batch 1 ran).
TEST(Calibration, TorchtitanFsdpRuns) {
  const std::string dir = std::string(STRATA_SOURCE_DIR) + "/tests/data/";
  const auto rows = testing::read_csv(dir + "fsdp_runs.csv");
  ASSERT_EQ(rows.size(), 8u);
  std::vector<double> errs;
  const RunTable table{16, 12, 74};
  table.header();
  for (const auto& r : rows) {
    const PublishedRun x = run_published(r, dir);
    const Estimate& e = x.e;
    if (!e.valid) continue;
    table.row(r, x);
    errs.push_back(std::fabs(x.err));
    EXPECT_LE(std::fabs(x.err), x.p.op_sac() ? 0.15 : 0.12) << r.at("label") << " " << r.at("plan");
    EXPECT_TRUE(e.fits) << r.at("label") << " " << r.at("plan") << ": ran but is predicted not to fit";
  }
  fmt::print("  {:>2} runs  median |error| {:>5.1f}%  max {:>5.1f}%\n", errs.size(), 100 * median(errs),
             100 * *std::max_element(errs.begin(), errs.end()));
  EXPECT_EQ(errs.size(), rows.size());
  EXPECT_LE(median(errs), 0.08);
  // The footnote's out-of-memory run: Llama 2 70B, local batch 2, the op policy.
  const Estimate oom = estimate(load_model("llama2-70b", 4096), load_cluster("dgx-a100-80g"),
                                load_plan("dp=64,mbs=2,gbs=128,zero=3,selective_ac_option=op,precision=bf16,"
                                          "cross_entropy_loss_fusion=0"));
  ASSERT_TRUE(oom.valid);
  EXPECT_FALSE(oom.fits) << oom.memory.peak / 1073741824.0 << " GiB";
  fmt::print("  Llama 2 70B, batch 2, op policy (ran out of memory): predicted {:.1f} GiB of 80, does not fit\n",
             oom.memory.peak / 1073741824.0);
}

// torchtitan on Hopper (tests/data/torchtitan_hopper_runs.csv): its published benchmarks
// (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, torch of 2024-12-23,
// torchtitan 9dec370; benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md, torchtitan
// e7c0cae, 2025-06), FSDP2 over every GPU, each row's memory as torchtitan logs it (the
// caching allocator's peak reserved, GiB). Llama 3.1 8B at local batch 2 ran torchtitan's
// default selective recompute, its op policy (selective_ac_option op: the fused attention's
// and every other matrix multiplication's outputs kept), which Megatron's selective
// recompute (the attention core) over-counts by 29-59 % of the measured peak; with the
// policy costed these rows are within 11 %. The 2024 runs' loss was not compiled (train.py
// at 9dec370: F.cross_entropy on .float() logits, cross_entropy_loss_fusion=0); the 2025
// ones compile it (fused, the default). torch.compile is not modelled: the compiled rows run
// the eager plan. The H100s were 96 GB HBM2e parts capped at 500 W (the page says so), not
// the 700 W, 80 GB dgx-h100-80g: their step times are printed, not judged (predicted 28-52 %
// fast), nor whether they fit in 80 GB. The H200 rows (WhiteFiber, 4 and 8 nodes of 8, 400
// Gb/s a GPU; float8 with fp8 all-gathers, compiled) are judged on both. The long-context
// rows (full recompute, context parallel 1-8) measure ~84 GiB whatever the sequence and
// are predicted 14 % under: PyTorch's cross-entropy backward holds three fp32 copies of the
// logits where strata's unfused loss holds 10 bytes a logit, 8.4 GB at 32K tokens a rank,
// about 70 % of the gap; the rest not separated (the allocator's cache on a 96 GB part?).
TEST(Calibration, TorchtitanHopperRuns) {
  const std::string dir = std::string(STRATA_SOURCE_DIR) + "/tests/data/";
  const auto rows = testing::read_csv(dir + "torchtitan_hopper_runs.csv");
  ASSERT_EQ(rows.size(), 13u);
  std::vector<double> mem_errs;
  fmt::print("{:<21} {:<26} {:>5} {:>8} {:>8} {:>7} {:>8} {:>8} {:>7}  {}\n", "group", "run", "gpus", "meas_s", "pred_s",
             "err%", "memGiB", "predGiB", "err%", "plan");
  for (const auto& r : rows) {
    const PublishedRun x = run_published(r, dir);
    if (!x.e.valid) continue;
    const std::string run = r.at("label") + " " + r.at("plan");
    const double measured_gib = std::stod(r.at("memory_gib")), predicted_gib = x.e.memory.peak / 1073741824.0;
    const double mem_err = predicted_gib / measured_gib - 1;
    const bool judged = r.at("step_compared") == "1";
    fmt::print("{:<21} {:<26} {:>5} {:>8.2f} {:>8.2f} {:>+7.1f} {:>8.1f} {:>8.1f} {:>+7.1f}  {}{}\n", r.at("group"),
               r.at("label"), r.at("gpus"), x.measured, x.e.step_time_s, 100 * x.err, measured_gib, predicted_gib,
               100 * mem_err, r.at("plan"), judged ? "" : "  (step not judged: 500 W, 96 GB parts)");
    mem_errs.push_back(std::fabs(mem_err));
    EXPECT_LE(std::fabs(mem_err), 0.16) << run;
    if (judged) {
      EXPECT_LE(std::fabs(x.err), 0.20) << run;  // 15-17 % fast today
      EXPECT_TRUE(x.e.fits) << run;
    }
    // The op policy is what brings these peaks near: Megatron's selective recompute of the
    // same plan is further off (over) every time.
    if (x.p.op_sac()) {
      Plan megatron = x.p;
      megatron.selective_ac_op = false;
      const Estimate alt = estimate(x.m, load_cluster(r.at("cluster")), megatron);
      const double alt_err = alt.memory.peak / 1073741824.0 / measured_gib - 1;
      EXPECT_GT(alt_err, 0.25) << run;
      EXPECT_LT(std::fabs(mem_err), std::fabs(alt_err)) << run;
    }
  }
  ASSERT_EQ(mem_errs.size(), rows.size());
  fmt::print("  memory: {} runs, median |error| {:.1f}%, max {:.1f}%\n", mem_errs.size(), 100 * median(mem_errs),
             100 * *std::max_element(mem_errs.begin(), mem_errs.end()));
  EXPECT_LE(median(mem_errs), 0.08);  // 4.3 % today
}

// PyTorch FSDP runs of another stack (tests/data/mosaic_fsdp_runs.csv): the MPT training
// benchmarks of MosaicML's llm-foundry (scripts/train/benchmarking/README.md as of 8c8dd48,
// unchanged since 495218376; tables of 2023-05 to 2024-01: Composer on PyTorch FSDP, eager,
// llm-foundry's Triton FlashAttention kernel), 216 runs of nine MPT models (125M-70B) at
// 512-65,536 tokens on 8-512 GPUs: H100 80GB bf16 and fp8, A100 80GB and 40GB (eight 200 Gb/s
// NICs a node, as the A100 presets have). Each row as its table gives it: FULL_SHARD is
// zero=3, SHARD_GRAD_OP zero=2, activation checkpointing full recompute of every block, the
// "PURE" mixed precision (the rows of Composer's plain bf16) bf16 gradient reduction (the
// "DEFAULT" one, amp_bf16, reduces in fp32), amp_fp8 fp8, micro-batch and accumulation
// steps as listed (global batch = micro-batch x accumulation x GPUs, asserted); the step is
// global batch x sequence / the table's tokens per second (the csv's per-GPU figure, its
// total over the GPUs to 0.01). The models are GPT-style with biases, learned positions
// sized to the sequence, tied embeddings, GELU and no dropout (tests/data/models/mpt-*.json,
// from llm-foundry's mpt-*.yaml and MPTConfig's defaults); their parameter counts match the
// table's NumParams exactly, every row (a check of the GPT-style count, biases and
// positions included).
//
// No parameter was fitted to these rows, and today strata predicts most of them fast: A100
// median |error| 15-18 % (runs of 760M-70B at up to 4K tokens without recompute 8-12 % fast,
// with full recompute 2-12 % slow; the 125M and 350M models, whose heads are 64 wide, ~25 %
// fast; 8K-64K tokens ~24 % fast), H100 ~30 % fast (2023 software on H100; the presets follow
// NVIDIA's 2024-2026 runs). README "Accuracy" says what that shows. So this is a guard, not a
// claim of accuracy: each group's median (A100 20 % and 18 %, H100 bf16 33 %, fp8 40 %) and
// each run are held near where they are. Memory is asserted: every run ran, so every run
// must be predicted to fit at the micro-batch its table gives. With one allocator fraction,
// the 15 % fitted on BLOOM's full-recompute runs, 20 (all without recompute, 79-85 % of the
// GPU in activations alone) were predicted 1-6 % over; the presets' 5 % for tensors saved
// without recompute (allocator_fragmentation_saved) fits them all.
TEST(Calibration, MosaicFsdpRuns) {
  const std::string dir = std::string(STRATA_SOURCE_DIR) + "/tests/data/";
  const auto rows = testing::read_csv(dir + "mosaic_fsdp_runs.csv");
  ASSERT_EQ(rows.size(), 216u);
  const std::map<std::string, double> bound = {
      {"mosaic-a100-80g", 0.40}, {"mosaic-a100-40g", 0.42}, {"mosaic-h100-bf16", 0.52}, {"mosaic-h100-fp8", 0.52}};
  const std::map<std::string, double> median_bound = {
      {"mosaic-a100-80g", 0.20}, {"mosaic-a100-40g", 0.18}, {"mosaic-h100-bf16", 0.33}, {"mosaic-h100-fp8", 0.40}};
  std::map<std::string, std::vector<double>> by_group;
  std::map<std::string, std::vector<double>> signed_by_group;
  std::map<std::string, double> capacity;  // each cluster's device memory
  double least_headroom = 1;
  const RunTable table{16, 16, 72};
  table.header();
  for (const auto& r : rows) {
    const PublishedRun x = run_published(r, dir);
    if (!x.e.valid) continue;
    table.row(r, x);
    const std::string run = r.at("group") + " " + r.at("label") + " on " + r.at("gpus") + ", " + r.at("plan");
    EXPECT_EQ(x.p.mbs * std::stoll(r.at("grad_accum")) * x.p.d, x.p.gbs) << run;
    EXPECT_EQ(std::llround(x.m.total_params()), std::stoll(r.at("num_params"))) << run;
    by_group[r.at("group")].push_back(std::fabs(x.err));
    signed_by_group[r.at("group")].push_back(x.err);
    EXPECT_LE(std::fabs(x.err), bound.at(r.at("group"))) << run;
    if (!capacity.count(r.at("cluster")))
      capacity[r.at("cluster")] = load_cluster(r.at("cluster")).device.memory_bytes;
    const double share = x.e.memory.peak / capacity.at(r.at("cluster"));
    EXPECT_TRUE(x.e.fits) << run << ": ran, but is predicted " << 100 * (share - 1) << " % over";
    least_headroom = std::min(least_headroom, 1 - share);
  }
  const std::vector<double> all = group_medians(by_group, median_bound, 16);
  EXPECT_EQ(all.size(), rows.size());
  // Fast, not slow: the signed medians stay below zero (a change that turned them would be
  // news, whichever way it moved the absolute ones).
  for (const auto& [g, v] : signed_by_group) EXPECT_LT(median(v), 0.0) << g;
  fmt::print("  every run predicted to fit; the least headroom {:.1f} % of the GPU\n", 100 * least_headroom);
}

// Long sequences under context parallelism (tests/data/long_sequence_runs.csv): NeMo's
// "Long Sequence Performance" page (NVIDIA/NeMo docs/source/performance/
// performance_long_sequence.md, as of 19fadb67b0, 2025-05-08): Llama 2 7B on H100 (NeMo
// 24.03.01) at 4K-1M tokens, 4-1024 GPUs, and Llama 3 8B on B200 (NeMo 25.04.rc2) at 8K-1M
// tokens, 2-256 GPUs, FP8, each with its table's TP, PP, DP and CP and 4M tokens a step.
// The B200 rows' GPU counts are TP x CP x DP, as the page's first version of that table
// (14d427f575) gave them; the later one repeats the H100 table's counts, which its own
// parallel sizes do not multiply to. The page gives model TFLOP/s per GPU by NeMo's
// formula of its day (nemo/utils/flops_formulas.py llama2 and llama3 before 6251117f4c,
// 2025-08, which halved the attention term for causal masks): per token
// L H^2 (12 + 12 G/A + 18 F/H + 12 S/H + 6 V/(L H)), V unpadded. The csv carries that figure
// and tokens per second: the H100 rows' as measured (the same table in NeMo's
// performance_summary.md at 35029a0c84, "Long Input Sequences"), the B200 rows' from the
// formula; the test checks that the two agree (the H100 rows within 0.2 %, the TFLOP/s being
// rounded to three figures).
// Micro-batch 1, the distributed optimizer and sequence parallelism with TP (NeMo's
// defaults), nothing else. Attention is 14 % of the model FLOPs at 4K and 97 % at 1M, so these
// rows judge the fused attention's efficiency and the context-parallel ring: the H100
// runs of 2024 ran 10-13 % slower than the preset's 45 % / 35 % of peak gives from 16K
// on, the B200 ones of 2025 up to 12 % faster at 256K-1M. A guard as above, not a fit.
TEST(Calibration, LongSequenceContextParallelRuns) {
  const std::string dir = std::string(STRATA_SOURCE_DIR) + "/tests/data/";
  const auto rows = testing::read_csv(dir + "long_sequence_runs.csv");
  ASSERT_EQ(rows.size(), 17u);
  const std::map<std::string, double> median_bound = {{"nemo-24.03-cp", 0.13}, {"nemo-25.04-cp", 0.08}};
  std::map<std::string, std::vector<double>> by_group;
  const RunTable table{14, 16, 48};
  table.header();
  for (const auto& r : rows) {
    const PublishedRun x = run_published(r, dir);
    if (!x.e.valid) continue;
    // NeMo's count, from the model's own dimensions (V as given, before Megatron's padding).
    const ModelSpec& m = x.m;
    const double L = static_cast<double>(m.L), H = static_cast<double>(m.H);
    const double per_token = L * H * H *
                             (12.0 + 12.0 * static_cast<double>(m.G) / static_cast<double>(m.A) +
                              18.0 * static_cast<double>(m.F) / H + 12.0 * static_cast<double>(m.S) / H +
                              6.0 * static_cast<double>(m.V) / (L * H));
    EXPECT_NEAR(std::stod(r.at("model_tflops_per_gpu")) * 1e12 / per_token / std::stod(r.at("tokens_per_s_per_gpu")),
                1.0, 3e-3)
        << r.at("label");
    table.row(r, x);
    by_group[r.at("group")].push_back(std::fabs(x.err));
    EXPECT_LE(std::fabs(x.err), 0.15) << r.at("label") << " " << r.at("plan");
    EXPECT_TRUE(x.e.fits) << r.at("label") << " " << r.at("plan") << ": ran but is predicted not to fit";
  }
  const std::vector<double> all = group_medians(by_group, median_bound, 14);
  EXPECT_EQ(all.size(), rows.size());
  EXPECT_LE(median(all), 0.11);
}

// Mixture-of-experts runs (tests/data/moe_runs.csv): Megatron-Bridge 26.04.01's Qwen3
// 30B-A3B, Qwen3 235B-A22B and GPT-OSS 120B rows on H100 and B200 and NeMo 25.02's Mixtral
// 8x7B on B200, all with the token load forced even over the experts (as their pages say),
// which is what the cost model assumes. A guard, not a claim of accuracy: the cost model's
// MoE layer (compute_moe.cpp) prices the router, the permutation, the all-to-alls and the
// grouped GEMMs from the same presets, and today it predicts the runs whose experts stay in
// a node 5-44 % fast and those whose all-to-alls cross nodes 11-19 % slow (README,
// "Mixture of experts"). The bounds hold those errors where they are, so a change that
// moves them shows here. The not_modelled column names what each recipe (Megatron-Bridge's
// scripts/performance configs) runs that strata does not model; the Bridge plans reduce
// their gradients in bf16 (grad_reduce_in_fp32=0), as those recipes set it.
TEST(Calibration, MixtureOfExpertsRuns) {
  const std::string dir = std::string(STRATA_SOURCE_DIR) + "/tests/data/";
  const auto rows = testing::read_csv(dir + "moe_runs.csv");
  ASSERT_EQ(rows.size(), 7u);
  std::vector<double> errs;
  const RunTable table{25, 16, 64};
  table.header();
  for (const auto& r : rows) {
    const PublishedRun x = run_published(r, dir);
    const Estimate& e = x.e;
    const double err = x.err;
    EXPECT_TRUE(x.m.moe()) << r.at("label");
    if (!e.valid) continue;
    table.row(r, x);
    errs.push_back(std::fabs(err));
    EXPECT_LE(std::fabs(err), 0.45) << r.at("label") << " on " << r.at("cluster");
    // (A run whose memory strata over-counts is predicted out of memory: its not_modelled
    // column says so, and the test holds it to that until a change makes it fit.)
    if (r.at("not_modelled").find("out of memory") == std::string::npos)
      EXPECT_TRUE(e.fits) << r.at("label") << " on " << r.at("cluster") << ": ran but is predicted not to fit";
    else
      EXPECT_FALSE(e.fits) << r.at("label") << " on " << r.at("cluster") << ": now fits; update not_modelled";
  }
  fmt::print("  {} runs  median |error| {:.1f}%  max {:.1f}%\n", errs.size(), 100 * median(errs),
             100 * *std::max_element(errs.begin(), errs.end()));
  EXPECT_LE(median(errs), 0.25);
}

TEST(Calibration, Gpt3On1024A100Within10Percent) {
  // Megatron-LM README: TP8 PP16 (DP8), MBS 1, GBS 1536, full recompute, fp16, ~32 s.
  const ModelSpec m = load_model("gpt3-175b");
  const Cluster cl = load_cluster("dgx-a100-80g");
  const Plan p = load_plan("tp=8,pp=16,dp=8,mbs=1,gbs=1536,recompute=full,precision=fp16");
  const Estimate e = estimate(m, cl, p);
  fmt::print("GPT-3 175B on 1024 A100: predicted {:.2f} s, published ~32 s ({:+.1f}%)\n", e.step_time_s,
             100 * (e.step_time_s / 32.0 - 1));
  EXPECT_NEAR(e.step_time_s, 32.0, 3.2);
  EXPECT_TRUE(e.fits);
}

}  // namespace
}  // namespace strata
