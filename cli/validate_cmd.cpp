// `strata validate`: the closed loop. Chooses plans (planner/validation.h), predicts each,
// trains each for real under `mpirun -np N strata train`, and writes predicted against
// measured (step time, time and memory per term) as a table, a report folder (Markdown,
// SVG charts, both Chrome traces per plan) and, with --json, the SPEC validation JSON.
// Runs outside mpirun itself; with --cluster measure it first runs `strata profile`.
#include <sys/stat.h>
#include <csignal>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/progress.h"
#include "cli/validate_report.h"
#include "costmodel/report.h"
#include "executor/train.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

std::string quote(const std::string& s) {
  std::string o = "'";
  for (char c : s) {
    if (c == '\'') o.append("'\\''");
    else o.push_back(c);
  }
  return o + "'";
}

std::string self_path() {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("strata") : p.string();
}

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  f.close();
  if (!f) throw InputError("--report: cannot write '" + path.string() + "'");
}

// The last line of a run's log (it says why), and where the whole log is; a run that wrote
// nothing (killed, or its mpirun failed before it started) says so.
std::string tail_of(const fs::path& path, size_t max_chars) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  if (s.size() > max_chars) s = s.substr(s.size() - max_chars);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  const size_t nl = s.rfind('\n');
  if (nl != std::string::npos) s = s.substr(nl + 1);
  return (s.empty() ? std::string("no output") : s) + " (log: " + path.string() + ")";
}

struct Launcher {
  std::string mpirun, self;
  int64_t ranks;
  // Runs `strata <args>` on `ranks` ranks, stdout and stderr into `log`; the exit status.
  int run(const std::string& args, const fs::path& log) const {
    std::string cmd;
    // --foreground keeps mpirun in our process group, so Ctrl-C reaches it and its ranks.
    if (access("/usr/bin/timeout", X_OK) == 0) cmd += "/usr/bin/timeout --foreground -s TERM -k 30 1800 ";
    cmd += quote(mpirun) + " -np " + std::to_string(ranks);
    if (ranks > static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()))) cmd += " --oversubscribe";
    cmd += fmt::format(" {} {} > {} 2>&1", quote(self), args, quote(log.string()));
    const int st = std::system(cmd.c_str());
    return st == -1 ? -1 : WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  }
};

std::string slug(const std::string& why) {
  std::string o;
  for (char c : why) o += std::isalnum(static_cast<unsigned char>(c)) ? c : '-';
  return o;
}

}  // namespace

int cmd_validate(const std::vector<std::string>& argv) {
  const Args a(argv, "validate",
               {"model", "cluster", "ranks", "plans", "steps", "report", "global-batch-size", "precision", "seq-length",
                "mpirun"},
               {"json", "no-spread", "quick-profile", "calibrate", "no-gemm-probe"});
  const std::string model_arg = a.required("model", "a preset, model JSON or config.json");
  const int64_t seq = a.integer("seq-length", 0, 0, 1 << 20);
  const ModelSpec model = load_model(model_arg, seq);
  check_trainable_model(model);  // before profiling: no plan of such a model can run
  const std::string cluster_arg = a.required("cluster", "a preset, a cluster JSON or 'measure'");
  const int64_t ranks = a.integer("ranks", 0, 1, 64);
  if (!a.has("ranks")) fail_field("--ranks", "(missing)", "is required: the number of MPI ranks to train on");
  const int best = static_cast<int>(a.integer("plans", 3, 1, 100));
  const int64_t steps = a.integer("steps", 8, 2, 100000);
  const fs::path report = a.get("report", "strata-report");
  const int64_t gbs = a.integer("global-batch-size", 16, 1, 1 << 20);
  const Precision prec = parse_precision(a.get("precision", "fp32"), false);
  const bool json = a.has("json");
  const std::string mpirun = a.get("mpirun", "mpirun");
  {  // a launcher that is not there fails every run: said now, as bad input
    bool found = false;
    if (mpirun.find('/') != std::string::npos) {
      std::error_code ec;
      found = access(mpirun.c_str(), X_OK) == 0 && fs::is_regular_file(mpirun, ec);
    } else if (const char* path = std::getenv("PATH")) {
      std::stringstream dirs(path);
      for (std::string d; !found && std::getline(dirs, d, ':');)  // (an empty entry: this folder)
        found = access((fs::path(d.empty() ? "." : d) / mpirun).c_str(), X_OK) == 0;
    } else {
      found = true;  // no PATH: the shell's default search, left to it
    }
    if (!found)
      fail_field("--mpirun", "'" + mpirun + "'", mpirun.find('/') != std::string::npos
                                                     ? "is not an executable file"
                                                     : "is not on PATH (Open MPI: apt-get install openmpi-bin)");
  }
  std::error_code ec;
  fs::create_directories(report / "plans", ec);
  if (ec) throw InputError("--report: cannot create '" + report.string() + "': " + ec.message());
  const Launcher run{mpirun, self_path(), ranks};
  if (geteuid() == 0) {  // Open MPI refuses root unless told twice
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
  }
  const std::string model_flags =
      "--model " + quote(model_arg) + (seq > 0 ? " --seq-length " + std::to_string(seq) : std::string());

  std::string cluster_path = cluster_arg;
  if (cluster_arg == "measure") {  // the profile of this machine, measured in this run
    cluster_path = (report / "cluster.json").string();
    if (!json) fmt::print(stderr, "profiling this machine on {} ranks (log: {})\n", ranks, (report / "profile.log").string());
    const int rc = run.run("profile " + model_flags + " --out " + quote(cluster_path) +
                               (a.has("quick-profile") ? " --quick" : ""),
                           report / "profile.log");
    if (rc != 0)
      throw std::runtime_error(fmt::format("strata profile failed (exit {}): {}", rc, tail_of(report / "profile.log", 600)));
  }
  const Cluster cl = load_cluster(cluster_path);
  if (a.has("precision")) check_precision_on(cl, prec);
  const ModelSpec m = model_on_stack(model, cl);  // as the executor trains it

  ValidationChoiceOptions vo;
  vo.ranks = ranks;
  vo.gbs = gbs;
  vo.precision = prec;
  vo.best = best;
  vo.spread = !a.has("no-spread");
  vo.runnable = [&](const Plan& p) {
    try {
      validate_train_plan(m, p, static_cast<int>(ranks));
      return std::string();
    } catch (const InputError& e) {
      return std::string(e.what());
    }
  };
  std::map<std::string, int64_t> rejected;
  const std::vector<ValidationPlan> chosen = choose_validation_plans(m, cl, vo, &rejected);
  if (chosen.empty()) {  // nothing feasible: exit 3, the rejections counted by reason (as plan does)
    std::string why;
    for (const auto& [k, v] : rejected)
      if (!k.empty()) why += fmt::format("{}{} {}", why.empty() ? "" : ", ", k, v);
    fmt::print(stderr,
               "strata validate: no plan of {} on {} ranks with global batch {} fits and runs on this executor, "
               "among {} candidates on {}; rejected: {} (try another --global-batch-size or --ranks)\n",
               m.name, ranks, gbs, rejected[""], cl.name, why.empty() ? "none" : why);
    return 3;
  }

  ValidationSummary sum;
  sum.model = m.name;
  sum.cluster = cl.name;
  sum.cluster_description = cl.device.name;
  sum.ranks = ranks;
  sum.steps = steps;
  // A report folder written before for other plans keeps none of their folders (plans/NN-why,
  // this command's own naming): the report lists exactly the plans it ran.
  {
    std::set<std::string> ours;
    for (size_t i = 0; i < chosen.size(); ++i) ours.insert(fmt::format("{:02d}-{}", i + 1, slug(chosen[i].why)));
    std::vector<fs::path> stale;
    for (const auto& e : fs::directory_iterator(report / "plans", ec)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && n.size() > 3 && std::isdigit(static_cast<unsigned char>(n[0])) &&
          std::isdigit(static_cast<unsigned char>(n[1])) && n[2] == '-' && !ours.count(n))
        stale.push_back(e.path());
    }
    for (const fs::path& d : stale) fs::remove_all(d, ec);
  }
  const bool probe = cluster_arg == "measure" && !a.has("no-gemm-probe");
  Progress bar("validate", static_cast<int64_t>(chosen.size()));
  for (size_t i = 0; i < chosen.size(); ++i) {
    ValidatedRun r;
    r.choice = chosen[i];
    r.dir = fmt::format("plans/{:02d}-{}", i + 1, slug(chosen[i].why));
    const fs::path dir = report / r.dir;
    fs::create_directories(dir, ec);
    if (ec) throw InputError("--report: cannot create '" + dir.string() + "': " + ec.message());
    const Plan& p = r.choice.plan;
    write_file(dir / "plan.json", plan_to_json(p).dump(2) + "\n");
    write_file(dir / "predicted.json", estimate_to_json(r.choice.predicted).dump(2) + "\n");
    if (2.0 * static_cast<double>(p.microbatches() * p.p * p.v) <= static_cast<double>(kMaxTraceSteps)) {
      EstimateOptions eo;
      eo.record_events = true;
      EstimateDetail d;
      const Estimate e = estimate(m, cl, p, eo, &d);
      std::ofstream f(dir / "predicted.trace.json");
      write_trace(f, m, e, d);
      f.close();
      if (!f) throw InputError("--report: cannot write '" + (dir / "predicted.trace.json").string() + "'");
    }
    // With the profile measured in this run, a GEMM probe first (the model's GEMM shapes at
    // the plan's tensor-parallel size, every rank at once, a few seconds): on a shared host
    // the rate moves between the profile and the runs, and the probe says by how much.
    fs::remove(dir / "probe.json", ec);  // (a report folder used before: no stale probe read)
    if (probe) {
      bar.update(static_cast<int64_t>(i), fmt::format("GEMM probe before {}", plan_to_inline(p)));
      const int prc = run.run(fmt::format("profile --gemm-probe {} --tp {} --out {}", model_flags, p.t,
                                          quote((dir / "probe.json").string())),
                              dir / "probe.log");
      if (prc == 130 || prc == 128 + SIGINT) throw std::runtime_error("interrupted (Ctrl-C); the report is incomplete");
      try {
        if (prc != 0) throw std::runtime_error(fmt::format("exit {}", prc));
        std::ifstream f(dir / "probe.json");
        const Json pj = Json::parse(f);
        std::vector<std::pair<double, double>> pts;
        for (const Json& pt : pj.at("gemm")) pts.push_back({pt.at(0).get<double>(), pt.at(1).get<double>()});
        r.drift = gemm_drift(cl, pts);
      } catch (const std::exception& e) {  // the run goes on, its row without a probe
        r.probe_error = fmt::format("{}; see {}", e.what(), (dir / "probe.log").string());
        fmt::print(stderr, "\nstrata: warning: GEMM probe before plan {} failed ({})\n", plan_to_inline(p), r.probe_error);
        r.drift = 0;
      }
      if (r.drift > 0) {
        Calibration k;
        k.gemm = r.drift;
        r.predicted_at_probe_s = estimate(m, apply_calibration(cl, k), p).step_time_s;
      }
    }
    bar.update(static_cast<int64_t>(i), fmt::format("training {} ({})", plan_to_inline(p), r.choice.why));
    const int rc = run.run(fmt::format("train {} --plan {} --steps {} --quiet --json {} --trace {}", model_flags,
                                       quote((dir / "plan.json").string()), steps,
                                       quote((dir / "measured.json").string()),
                                       quote((dir / "measured.trace.json").string())),
                           dir / "train.log");
    if (rc == 130 || rc == 128 + SIGINT) throw std::runtime_error("interrupted (Ctrl-C); the report is incomplete");
    if (rc != 0) {
      r.failure = fmt::format("exit {}: {}", rc, tail_of(dir / "train.log", 600));
    } else {
      try {
        std::ifstream f(dir / "measured.json");
        r.measured = Json::parse(f);
        r.cmp = compare_run(r.choice.predicted, r.measured);
        if (r.drift > 0) r.error_at_probe = relative_error(r.predicted_at_probe_s, r.cmp.measured_step_s);
        r.ok = true;
      } catch (const std::exception& e) {
        r.failure = std::string("measured.json: ") + e.what();
      }
    }
    sum.runs.push_back(std::move(r));
  }
  bar.update(static_cast<int64_t>(chosen.size()), "done");
  bar.finish();
  summarise(sum);
  if (a.has("calibrate")) {  // fit the profile to these runs; held-out errors before and after
    calibrate(sum, m, cl);
    sum.calibrated_cluster_file = (report / "calibrated.json").string();
    write_file(report / "calibrated.json", cluster_to_json(apply_calibration(cl, sum.calibration)).dump(2) + "\n");
  }
  const Json j = validation_to_json(sum);
  write_file(report / "validation.json", j.dump(2) + "\n");
  write_file(report / "report.md", validation_markdown(sum));
  write_file(report / "step_time.svg", svg_step_time(sum));
  write_file(report / "time_breakdown.svg", svg_time_breakdown(sum));
  write_file(report / "memory.svg", svg_memory(sum));
  if (json) {
    std::cout << j.dump(2) << "\n";
  } else {
    fmt::print("strata validate: {} on {} rank(s), cluster {}, {} steps per plan\n\n", m.name, ranks, cl.name, steps);
    fmt::print("{}", format_validation_table(sum));
    if (sum.calibrated) fmt::print("\n{}", format_calibration(sum));
    fmt::print("\nreport: {}/report.md (charts: step_time.svg, time_breakdown.svg, memory.svg; traces per plan under "
               "{}/plans)\n",
               report.string(), report.string());
  }
  for (const ValidatedRun& r : sum.runs)
    if (!r.ok) {
      fmt::print(stderr, "strata: error: plan {} did not train: {}\n", plan_to_inline(r.choice.plan), r.failure);
      return 1;
    }
  return 0;
}

}  // namespace strata
