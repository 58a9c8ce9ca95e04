// strata: the subcommands of SPEC.md. Parses flags, loads the three inputs, calls the cost
// model or the planner, formats text / JSON / traces / exports. Exit codes: 0 success,
// 2 invalid input (message names the field, value and rule), 3 nothing feasible,
// 1 internal error.
#include <algorithm>
#include <chrono>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/progress.h"
#include "costmodel/estimate.h"
#include "costmodel/megatron_args.h"
#include "costmodel/report.h"
#include "planner/export.h"
#include "planner/search.h"

namespace strata {
namespace {

constexpr int kExitOk = 0, kExitInternal = 1, kExitInput = 2, kExitInfeasible = 3;

const char* kUsage = R"(strata: plan and prove distributed training of large transformer models

usage:
  strata plan      --model M --cluster C --gpus N --global-batch-size B [--top K] [--json]
                   [--export megatron|deepspeed|bridge] [--fix tp=8,pp=4,...] [--pareto] [--search-offload] [--trace FILE]
                   [--precision bf16|fp16|fp8|fp32 (default bf16; fp16 on V100)] [--seq-length S]
                   [--compare PLAN] [--attention auto|flash|unfused] [--memory-limit 72GiB|77GB|90%]
  strata plan      --megatron-args A --cluster C [--gpus N] [...]   (the launch's plan as --compare)
  strata estimate  --model M --cluster C --plan P [--json] [--trace FILE] [--seq-length S] [--ops]
                   [--memory-limit 72GiB|77GB|90%]
  strata estimate  --megatron-args A --cluster C [--gpus N] [--json] [--trace FILE] [--seq-length S] [--ops]
                   [--memory-limit 72GiB|77GB|90%]
  strata train     --model M --plan P --steps S [--data synthetic|synthetic:STATES|FILE] [--seed N]
                   [--json FILE|-] [--trace FILE] [--lr X] [--min-lr X] [--lr-warmup-iters N]
                   [--weight-decay X] [--clip-grad X] [--loss-scale X] [--loss-scale-window N]
                   [--dump-params FILE] [--checkpoint-dir D [--checkpoint-every N] [--keep-checkpoints K]
                   [--resume]] [--quiet] [--backend cpu|cuda [--comm auto|nccl|staged]] [--seq-length S]
                   [--inject-fault KIND@RANK:STEP] [--max-bad-steps N] [--distributed-timeout-minutes X]
                   [--ops [--cluster C]]
                                                       (under mpirun -np tp*pp*dp*cp)
  strata profile   [--backend cpu|cuda [--comm auto|nccl|staged]] [--out FILE] [--quick] [--json]
                   [--max-bytes N] [--model M [--tp T] [--seq-length S] [--gemm-probe]]
                                                          (under mpirun: one rank per core to use)
  strata plan --list-models | --list-clusters

  M  a preset (strata plan --list-models), a model JSON or a Hugging Face config.json
  C  a preset (strata plan --list-clusters) or a cluster JSON (schema: hw_profiles/README.md)
  P  a plan JSON or inline pairs: tp=8,pp=8,dp=16,mbs=1,vp=3,zero=1,recompute=selective,sp=1
  A  a Megatron-LM launch (a script or its flags; add --vocab-size): its model and plan; the
     GPUs from torchrun's --nproc-per-node x --nnodes unless --gpus is given

  strata validate  --model M --cluster C|measure --ranks N [--plans K] [--steps S] [--report DIR]
                   [--global-batch-size B] [--precision fp32|bf16|fp16] [--seq-length S] [--json]
                   [--no-spread] [--quick-profile] [--calibrate] [--no-gemm-probe] [--mpirun PATH]
                                                                                (runs mpirun itself)
  KIND  kill, throw, hang, nan, kill-in-checkpoint, slow or bitflip (fault injection, e.g. kill@1:3)

exit codes: 0 ok, 2 invalid input, 3 nothing feasible, 1 internal error
)";

// `strata CMD --help`: the usage of CMD alone (its synopsis lines from kUsage, the
// legend it uses) with the exit codes.
std::string usage_of(const std::string& cmd) {
  std::istringstream in(kUsage);
  std::string line, title, synopsis, legend, exits, current;
  std::getline(in, title);
  auto starts = [&](const char* prefix) { return line.rfind(prefix, 0) == 0; };
  while (std::getline(in, line)) {
    if (starts("  strata ")) {  // a synopsis, "  strata CMD ...", and its continuation lines
      std::istringstream words(line.substr(9));
      words >> current;
    } else if (!starts("       ")) {
      current.clear();
    }
    if (!current.empty()) {
      if (current == cmd) synopsis += line + "\n";
    } else if (starts("  M  ") || starts("  C  ") || starts("  P  ") || (starts("  KIND  ") && cmd == "train")) {
      legend += line + "\n";
    } else if (starts("exit codes:")) {
      exits = line + "\n";
    }
  }
  return title + "\n\nusage:\n" + synopsis + "\n" + legend + "\n" + exits;
}

void list_presets(bool models, bool json) {
  if (json) {  // one JSON array: each preset in its own schema (model JSON, cluster JSON)
    Json all = Json::array();
    if (models) {
      for (const auto& n : model_preset_names()) {
        ModelSpec m;
        find_model_preset(n, &m);
        Json j = model_to_json(m);
        j["parameters"] = static_cast<int64_t>(m.total_params());
        all.push_back(std::move(j));
      }
    } else {
      for (const auto& n : cluster_preset_names()) all.push_back(cluster_to_json(load_cluster(n)));
    }
    fmt::print("{}\n", all.dump(2));
    return;
  }
  if (models) {
    for (const auto& n : model_preset_names()) {
      ModelSpec m;
      find_model_preset(n, &m);
      fmt::print("{:<15} {:>9} params  L={:<4} H={:<6} A={:<4} G={:<4} F={:<6} V={:<7} S={:<6} {} {}{}\n", n,
                 human_count(m.total_params()), m.L, m.H, m.A, m.G, m.F, m.V, m.S, to_string(m.activation),
                 to_string(m.normalization),
                 m.moe() ? fmt::format("  E={} top-{} Fe={} ({} active)", m.E, m.K, m.Fe, human_count(m.active_params()))
                         : std::string());
    }
  } else {
    for (const auto& n : cluster_preset_names()) {
      const Cluster c = load_cluster(n);
      fmt::print("{:<16} {:<20} {:>7.1f} GiB  {:>7.1f} bf16 TFLOP/s  {:>6.0f} GB/s HBM  {} per node\n", n,
                 c.device.name, c.device.memory_bytes / (1024.0 * 1024 * 1024), c.device.peak_bf16_flops / 1e12,
                 c.device.memory_bandwidth_bytes_per_s / 1e9, c.devices_per_node);
    }
  }
}

void trace_to_file(const std::string& path, const ModelSpec& m, const Cluster& cl, const Plan& p) {
  const double steps = 2.0 * static_cast<double>(p.microbatches()) * static_cast<double>(p.p * p.v);
  if (steps > static_cast<double>(kMaxTraceSteps))
    throw InputError(fmt::format("--trace: {:.0f} pipeline steps are too many to write as a trace (limit {}); "
                                 "trace a smaller global_batch_size",
                                 steps, kMaxTraceSteps));
  EstimateOptions eo;
  eo.record_events = true;
  EstimateDetail d;
  const Estimate e = estimate(m, cl, p, eo, &d);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw InputError(fmt::format("--trace: cannot write file '{}'", path));
  write_trace(out, m, e, d);
  out.close();
  if (!out) throw InputError(fmt::format("--trace: writing '{}' failed", path));
}

// --memory-limit: the memory a plan may use per GPU, below the device's, for headroom
// (allocator spikes, a larger sequence later): "72" or "72GiB" (GiB), "77GB" (1e9 bytes),
// or "90%" of the device's memory. A plan fits when its predicted peak is within it. Sets
// the cluster's capacity and returns the limit (0 when the flag is absent).
double apply_memory_limit(const Args& a, Cluster* cl) {
  if (!a.has("memory-limit")) return 0;
  const std::string s = a.get("memory-limit");
  const double device = cl->device.memory_bytes;
  size_t used = 0;
  double x = 0;
  try {
    x = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = s.substr(used);  // "72 GiB" as "72GiB"
  unit.erase(0, std::min(unit.size(), unit.find_first_not_of(' ')));
  unit.erase(unit.find_last_not_of(' ') + 1);
  for (char& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  const double scale = unit.empty() || unit == "gib" ? 1024.0 * 1024 * 1024
                       : unit == "gb"                              ? 1e9
                       : unit == "%"                               ? device / 100.0
                                                                   : 0.0;
  const std::string rule = fmt::format(
      "must be a size of GPU memory: GiB (72, 72GiB), GB (77GB) or a share of the device's {} (90%)",
      human_bytes(device));
  // A decimal number: strtod's hexadecimal and "inf" forms are refused.
  const bool decimal = used > 0 && (std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '.') &&
                       s.substr(0, used).find_first_of("xX") == std::string::npos;
  if (!decimal || scale == 0.0 || !std::isfinite(x)) fail_field("--memory-limit", "'" + s + "'", rule);
  const double limit = x * scale;
  if (!(limit >= 1024.0 * 1024)) fail_field("--memory-limit", s, "must be at least 1 MiB");
  if (limit > device)
    fail_field("--memory-limit", s,
               fmt::format("must not exceed the device's memory ({} on {})", human_bytes(device), cl->name));
  cl->device.memory_bytes = limit;
  return limit;
}

// --megatron-args: the model and the plan of a Megatron-LM launch (the flags strata does not
// model are named on stderr), on --gpus GPUs or the launcher's.
std::optional<LaunchInputs> megatron_launch(const Args& a, std::initializer_list<const char*> instead) {
  if (!a.has("megatron-args")) return std::nullopt;
  for (const char* o : instead)
    if (a.has(o)) throw InputError(fmt::format("--{}: give --megatron-args or --{}, not both", o, o));
  const std::string arg = a.get("megatron-args");
  MegatronLaunch launch = parse_megatron_launch(megatron_launch_text(arg), "--megatron-args");
  std::error_code ec;
  launch.model["name"] = arg.rfind("--", 0) != 0 && std::filesystem::is_regular_file(arg, ec)
                             ? std::filesystem::path(arg).stem().string()
                             : std::string("megatron-launch");
  LaunchInputs in = launch_inputs(launch, a.integer("gpus", 0, 1, 1 << 24), "--megatron-args",
                                  a.integer("seq-length", 0, 1, 1 << 24));
  if (!launch.ignored.empty()) {
    std::string list;
    for (size_t i = 0; i < launch.ignored.size() && i < 12; ++i) list += (i ? ", " : "") + launch.ignored[i];
    if (launch.ignored.size() > 12) list += fmt::format(", ... ({} in all)", launch.ignored.size());
    fmt::print(stderr, "strata: --megatron-args: not modelled (no effect on the estimate): {}\n", list);
  }
  if (!launch.costly.empty())
    fmt::print(stderr, "strata: --megatron-args: note: not modelled, may change the step time or memory: {}\n",
               fmt::join(launch.costly, ", "));
  for (const std::string& u : launch.undecided)
    fmt::print(stderr, "strata: --megatron-args: note: every branch of `{}` read: a condition strata does not evaluate\n",
               u);
  return in;
}

// The precision where none is given: bf16, else fp16 on a GPU without it (V100, as
// Megatron-LM runs there), else fp32 (a device with neither).
Precision default_precision(const Cluster& cl) {
  if (cl.device.peak_flops(Precision::bf16) > 0) return Precision::bf16;
  return cl.device.peak_flops(Precision::fp16) > 0 ? Precision::fp16 : Precision::fp32;
}

// A Hugging Face config of a context-extended model gives its extended length as
// max_position_embeddings, which becomes the sequence unless --seq-length gives one: said on
// stderr (stdout keeps the table or the one JSON document), with the pre-training length.
void note_extended_context(const ModelSpec& m) {
  if (m.pretrain_seq_length > 0)
    fmt::print(stderr,
               "strata: note: {}: sequence {} from max_position_embeddings; its RoPE scaling extends a model "
               "pre-trained at {} (original_max_position_embeddings): give --seq-length {} to plan pre-training\n",
               m.name, m.S, m.pretrain_seq_length, m.pretrain_seq_length);
  if (m.learned_positions_in_config > 0)
    fmt::print(stderr,
               "strata: note: {}: sequence {} is longer than its config's learned position table ({} rows, "
               "n_positions): costed with a table of {} rows ({} parameters more)\n",
               m.name, m.S, m.learned_positions_in_config, m.S, (m.S - m.learned_positions_in_config) * m.H);
}

int cmd_estimate(const std::vector<std::string>& argv) {
  const Args a(argv, "estimate",
               {"model", "cluster", "plan", "trace", "seq-length", "gpus", "megatron-args", "memory-limit"},
               {"json", "ops", "list-models", "list-clusters", "help"});
  if (a.has("help")) return fmt::print("{}", kUsage), kExitOk;
  if (a.has("list-models") || a.has("list-clusters")) return list_presets(a.has("list-models"), a.has("json")), kExitOk;
  Cluster cl = load_cluster(a.required("cluster", "a preset or a cluster JSON"));
  const double device_bytes = cl.device.memory_bytes;
  const double limit = apply_memory_limit(a, &cl);
  const std::optional<LaunchInputs> launch = megatron_launch(a, {"model", "plan"});
  const ModelSpec m = model_on_stack(
      launch ? launch->model
             : load_model(a.required("model", "a preset or a model JSON"), a.integer("seq-length", 0, 1, 1 << 24)),
      cl);
  note_extended_context(m);
  Plan p = launch ? launch->plan : load_plan(a.required("plan", "a plan JSON or tp=..,pp=..,dp=.. pairs"));
  // A plan without a precision on a device without bf16 (V100): strata plan's default.
  if (!launch && !p.precision_given && cl.device.peak_flops(Precision::bf16) <= 0) {
    p.precision = default_precision(cl);
    fmt::print(stderr, "strata: note: the plan gives no precision and {} has no bf16: {}\n", cl.device.name,
               to_string(p.precision));
  }
  if (a.has("gpus") && a.integer("gpus", 1, 1, 1 << 24) != p.world_size())
    fail_field("--gpus", a.get("gpus"),
               fmt::format("must equal tp*pp*dp*cp = {} of the plan", p.world_size()));
  EstimateOptions eo;
  eo.want_ops = true;
  EstimateDetail d;
  const Estimate e = estimate(m, cl, p, eo, &d);
  if (!e.valid) {
    std::string msg;
    for (const auto& r : e.reasons) msg += (msg.empty() ? "" : "; ") + r.message;
    throw InputError("plan: " + msg);
  }
  if (a.has("trace")) trace_to_file(a.get("trace"), m, cl, p);
  if (a.has("json")) {
    Json j = estimate_to_json(e);
    if (limit > 0) j["memory_limit_bytes"] = limit;
    // The model's parameters: all of them, those a token passes through (with and without the
    // input embedding, the two ways model cards count), the multi-token prediction modules'.
    j["model_parameters"] = {{"total", std::llround(m.total_params())},
                             {"active", std::llround(m.active_params())},
                             {"active_without_input_embedding", std::llround(m.active_params_without_input_embedding())},
                             {"mtp", m.mtp_params(1)}};
    if (a.has("ops")) {  // one layer's operations, per micro-batch, as the text table has them
      auto rows = [](const std::vector<OpCost>& ops) {
        Json r = Json::array();
        for (const OpCost& o : ops)
          r.push_back({{"op", o.name}, {"phase", to_string(o.phase)}, {"kind", to_string(o.kind)}, {"flops", o.flops},
                       {"bytes", o.bytes}, {"time_s", o.time_s}, {"exposed_s", o.exposed_s}});
        return r;
      };
      j["ops"] = {{"layer", rows(d.layer_ops)}};
      if (!d.dense_layer_ops.empty()) j["ops"]["dense_layer"] = rows(d.dense_layer_ops);
    }
    fmt::print("{}\n", j.dump(2));
  } else {
    fmt::print("{}", format_estimate(m, cl, e, &d, device_bytes));
    if (a.has("ops")) fmt::print("{}", format_layer_ops(d));
    if (a.has("trace")) fmt::print("\ntrace written to {}\n", a.get("trace"));
  }
  return kExitOk;
}

// A plan's own split of the layers over its stages, run-length coded ("7|11x6|7"); "-" for
// strata's own layout.
std::string split_text(const ModelSpec& m, const Plan& p) {
  if (!p.explicit_split()) return "-";
  const StageLayout lay = make_layout(m.L, p);
  std::string out;
  for (int64_t s = 0; s < p.p;) {
    int64_t n = 1;
    while (s + n < p.p && lay.stage_layers(s + n) == lay.stage_layers(s)) ++n;
    out += fmt::format("{}{}{}", out.empty() ? "" : "|", lay.stage_layers(s), n > 1 ? fmt::format("x{}", n) : "");
    s += n;
  }
  return out;
}

std::string plan_row(const ModelSpec& m, const Estimate& e, int rank) {
  const Plan& p = e.plan;
  return fmt::format("{:>3}  {:>3} {:>3} {:>4} {:>3} {:>9} {:>3} {:>4} {:>4} {:>9} {:>3} {:>11}  {:>9.3f} {:>11.0f} {:>6.1f}% {:>9.1f} {:>7.1f}%  {}",
                     rank, p.t, p.p, p.d, p.c, p.c > 1 ? to_string(e.cp_comm) : "-", p.v, p.mbs, p.zero,
                     p.recompute_layers > 0 ? fmt::format("full/{}", p.recompute_layers) : to_string(p.recompute),
                     p.sp ? "y" : "n",
                     to_string(p.schedule()), e.step_time_s, e.tokens_per_s, 100.0 * e.mfu,
                     e.memory.peak / (1024.0 * 1024 * 1024), 100.0 * e.time.pipeline_bubble / e.step_time_s,
                     split_text(m, p) + (p.offload > 0 ? fmt::format("  offload={:g}", p.offload) : std::string()) +
                         (m.moe() ? fmt::format("  ep={}", p.ep) + (p.expert_tp() != p.t ? fmt::format(" etp={}", p.expert_tp()) : "")
                                  : std::string()));
}

const char* kPlanHeader =
    "  #   tp  pp   dp  cp   cp_comm  vp  mbs zero recompute  sp       sched     step_s    tokens/s    MFU  mem_GiB  bubble  "
    "layers per stage";

// Why `best` beats `other`: the terms that differ, largest saving first.
std::string explain(const Estimate& best, const Estimate& other) {
  struct Term {
    const char* name;
    double a, b;
  };
  std::vector<Term> terms;
  const Terms x = time_terms(best.time), y = time_terms(other.time);
  for (size_t i = 0; i < x.size(); ++i) terms.push_back({x[i].first, x[i].second, y[i].second});
  std::string o = fmt::format("\nbest plan against {}:\n", plan_to_inline(other.plan));
  o += fmt::format("  {:<18}{:>12}{:>12}{:>12}\n", "term (s)", "best", "compared", "difference");
  for (const auto& t : terms)
    o += fmt::format("  {:<18}{:>12.3f}{:>12.3f}{:>+12.3f}\n", t.name, t.a, t.b, t.a - t.b);
  o += fmt::format("  {:<18}{:>12.3f}{:>12.3f}{:>+12.3f}   ({:+.1f}%)\n", "step", best.step_time_s, other.step_time_s,
                   best.step_time_s - other.step_time_s, 100.0 * (best.step_time_s / other.step_time_s - 1.0));
  std::sort(terms.begin(), terms.end(), [](const Term& a, const Term& b) { return (a.a - a.b) < (b.a - b.b); });
  std::string why;
  for (const auto& t : terms)
    if (t.a - t.b < -0.005 * other.step_time_s)
      why += fmt::format("{}{} {:.2f} s less", why.empty() ? "" : ", ", t.name, t.b - t.a);
  std::string cost;
  for (const auto& t : terms)
    if (t.a - t.b > 0.005 * other.step_time_s)
      cost += fmt::format("{}{} {:.2f} s more", cost.empty() ? "" : ", ", t.name, t.a - t.b);
  o += fmt::format("  why: {}{}\n", why.empty() ? "no term differs by more than 0.5%" : why,
                   cost.empty() ? "" : "; paid for with " + cost);
  return o;
}

int cmd_plan(const std::vector<std::string>& argv) {
  const Args a(argv, "plan",
               {"model", "cluster", "gpus", "global-batch-size", "top", "export", "fix", "trace", "precision",
                "seq-length", "compare", "attention", "megatron-args", "memory-limit"},
               {"json", "pareto", "search-offload", "list-models", "list-clusters", "help"});
  if (a.has("help")) return fmt::print("{}", kUsage), kExitOk;
  if (a.has("list-models") || a.has("list-clusters")) return list_presets(a.has("list-models"), a.has("json")), kExitOk;
  Cluster cl = load_cluster(a.required("cluster", "a preset or a cluster JSON"));
  const double device_bytes = cl.device.memory_bytes;
  const double limit = apply_memory_limit(a, &cl);
  // A Megatron-LM launch gives the model, the GPUs, the global batch and the precision (each
  // unless given here) and is the plan compared with the best.
  const std::optional<LaunchInputs> launch = megatron_launch(a, {"model"});
  const ModelSpec m = model_on_stack(
      launch ? launch->model
             : load_model(a.required("model", "a preset or a model JSON"), a.integer("seq-length", 0, 1, 1 << 24)),
      cl);
  note_extended_context(m);
  SearchOptions so;
  if (a.has("fix")) so.fixed = parse_fixed(a.get("fix"));
  so.gpus = launch ? launch->plan.world_size() : a.integer("gpus", 0, 1, 1 << 24);
  if (!a.has("gpus") && !launch) a.required("gpus", "the number of GPUs to plan for");
  // (--fix gbs=B says it too; given both ways, they must agree.)
  so.gbs = a.has("global-batch-size") ? a.integer("global-batch-size", 0, 1, int64_t{1} << 30)
           : so.fixed.gbs              ? *so.fixed.gbs
           : launch                    ? launch->plan.gbs
                                       : 0;
  if (!so.gbs) a.required("global-batch-size", "sequences per optimizer step");
  if (so.fixed.gbs && *so.fixed.gbs != so.gbs)
    fail_field("--fix gbs", std::to_string(*so.fixed.gbs),
               fmt::format("disagrees with --global-batch-size {}: give one of them", so.gbs));
  if (so.fixed.precision && a.has("precision") && parse_precision(a.get("precision")) != *so.fixed.precision)
    fail_field("--fix precision", to_string(*so.fixed.precision),
               fmt::format("disagrees with --precision {}: give one of them", a.get("precision")));
  so.top_k = static_cast<int>(a.integer("top", 10, 1, 1000));
  // Default bf16, or fp16 on a GPU without bf16 (V100), as Megatron-LM runs there.
  so.precision = a.has("precision") ? parse_precision(a.get("precision"))
                 : so.fixed.precision                         ? *so.fixed.precision
                 : launch                                     ? launch->plan.precision
                                                              : default_precision(cl);
  if (a.has("precision") || so.fixed.precision)
    check_precision_on(cl, so.precision, a.has("precision") ? "--precision" : "--fix precision");
  so.pareto = a.has("pareto");
  so.search_offload = a.has("search-offload");
  const std::string att = a.get("attention", "auto");
  if (att != "auto" && att != "flash" && att != "unfused")
    fail_field("--attention", "'" + att + "'", "must be auto, flash or unfused");
  so.attention = att == "flash" ? AttentionChoice::flash : att == "unfused" ? AttentionChoice::unfused
                                                                            : AttentionChoice::automatic;
  // A launch's main-gradient type (--grad-reduce-in-bf16) and precision-aware optimizer (for
  // the ZeRO-1 candidates) hold for the search unless --fix says (Megatron ignores both in
  // fp32 training).
  const bool sixteen = so.precision != Precision::fp32;
  if (launch && sixteen && launch->plan.grad_reduce_in_fp32 != Tristate::automatic && !so.fixed.grad_reduce_in_fp32)
    so.fixed.grad_reduce_in_fp32 = launch->plan.grad_reduce_in_fp32 == Tristate::on;
  if (launch && sixteen && launch->plan.precision_aware_optimizer && !so.fixed.optimizer) so.fixed.optimizer = launch->plan;
  // A launch's user buffers (--tp-comm-overlap, or none without it) hold for the search
  // unless --fix says, as the compared launch is costed.
  if (launch && launch->plan.tp_comm_overlap != Tristate::automatic && !so.fixed.tp_comm_overlap)
    so.fixed.tp_comm_overlap = launch->plan.tp_comm_overlap == Tristate::on;
  // A launch's fp8 parameters (--fp8-param-gather, or Megatron's default without it) hold
  // for an fp8 search; fixing them needs one.
  if (launch && so.precision == Precision::fp8 && launch->plan.fp8_param_gather != Tristate::automatic &&
      !so.fixed.fp8_param_gather)
    so.fixed.fp8_param_gather = launch->plan.fp8_param_gather == Tristate::on;
  if (so.fixed.fp8_param_gather && so.precision != Precision::fp8)
    fail_field("--fix fp8_param_gather", *so.fixed.fp8_param_gather ? "1" : "0",
               fmt::format("is fp8's (the search's precision is {})", to_string(so.precision)));
  const std::string from = launch ? "--fix or --megatron-args" : "--fix";
  if (so.fixed.optimizer) {
    if (!sixteen) fail_field(from + " use_precision_aware_optimizer", "1", "needs 16-bit or fp8 parameters (--precision bf16, fp16 or fp8)");
    if (cl.strata_stack)
      fail_field(from + " use_precision_aware_optimizer", "1",
                 fmt::format("cluster {} runs the strata executor, whose optimizer keeps fp32 states", cl.name));
    if (!search_stack(m, cl, so).modern)
      fail_field(from + " use_precision_aware_optimizer", "1",
                 fmt::format("is Megatron-core's, and the search runs {} on {} on the legacy software stack",
                             m.name, cl.name));
  }
  // A launch's activation offloading holds for every candidate too, unless --fix says.
  if (launch && launch->plan.offload_modules && !so.fixed.activation_offload) so.fixed.activation_offload = launch->plan;
  if (so.fixed.activation_offload) {
    const std::string mods = offload_modules_text(so.fixed.activation_offload->offload_modules, "+");
    if (cl.strata_stack)
      fail_field(from + " offload_modules", mods,
                 fmt::format("cluster {} runs the strata executor, which keeps its activations on its own backend",
                             cl.name));
    if (!cl.host.present())
      fail_field(from + " offload_modules", mods,
                 fmt::format("cluster {} gives no \"host\" (memory, its bandwidth, PCIe; hw_profiles/README.md)",
                             cl.name));
    if (!m.moe() && (so.fixed.activation_offload->offload_modules & kOffloadExpertModules))
      fail_field(from + " offload_modules", mods, fmt::format("names the experts' modules; {} is dense", m.name));
    if (!search_stack(m, cl, so).modern)
      fail_field(from + " offload_modules", mods,
                 fmt::format("is Megatron-core's, and the search runs {} on {} on the legacy software stack", m.name,
                             cl.name));
  }
  if (so.fixed.grad_reduce_in_fp32 == false && !sixteen)
    fail_field(from + " grad_reduce_in_fp32", "0", "needs 16-bit parameters (--precision bf16, fp16 or fp8)");
  if (so.fixed.grad_reduce_in_fp32 == false && cl.strata_stack)
    fail_field(from + " grad_reduce_in_fp32", "0",
               fmt::format("cluster {} runs the strata executor, which reduces its gradients in fp32", cl.name));
  if (so.search_offload) {  // (a cluster that cannot offload is named, not searched without it)
    if (so.fixed.offload)
      throw InputError("--search-offload and --fix offload=... both given: keep one (--fix pins the fraction)");
    if (cl.strata_stack)
      throw InputError(fmt::format("--search-offload: cluster {} runs the strata executor, which keeps its optimizer "
                                   "on its own backend", cl.name));
    if (!cl.host.present())
      throw InputError(fmt::format("--search-offload: cluster {} gives no \"host\" section (memory, its bandwidth, "
                                   "PCIe; hw_profiles/README.md)", cl.name));
  }
  const std::string exp = a.get("export");
  if (!exp.empty() && exp != "megatron" && exp != "deepspeed" && exp != "bridge")
    fail_field("--export", "'" + exp + "'", "must be megatron, deepspeed or bridge (Megatron-Bridge overrides)");
  // The compared plan is checked before anything is printed.
  Plan compare;
  Estimate compared;
  if (a.has("compare") || launch) {
    const std::string what = a.has("compare") ? "--compare" : "--megatron-args";
    compare = a.has("compare") ? load_plan(a.get("compare")) : launch->plan;
    if (!a.has("compare")) {  // the launch's plan at the batch and in the precision searched
      compare.gbs = so.gbs;
      compare.precision = so.precision;
      if (compare.precision != Precision::fp8) compare.fp8_param_gather = Tristate::automatic;  // (fp8's only)
    }
    // With the optimizer settings every candidate gets, where the plan does not say.
    if (so.fixed.grad_reduce_in_fp32 && compare.grad_reduce_in_fp32 == Tristate::automatic)
      compare.grad_reduce_in_fp32 = *so.fixed.grad_reduce_in_fp32 ? Tristate::on : Tristate::off;
    if (so.fixed.optimizer && compare.zero == 1 && !compare.precision_aware_optimizer)
      compare.take_optimizer_of(*so.fixed.optimizer);
    if (so.fixed.activation_offload && !compare.offload_modules &&
        (compare.recompute != Recompute::full || compare.recompute_layers > 0))
      compare.take_activation_offload_of(*so.fixed.activation_offload);
    // Costed on the stack the search compares its candidates on (pin_to_plain_stack).
    pin_to_plain_stack(cl, search_stack(m, cl, so), compare);
    if (compare.world_size() != so.gpus)
      fail_field(what, plan_to_inline(compare), fmt::format("must use {} GPUs like the search", so.gpus));
    if (compare.gbs != so.gbs)
      fail_field(what, plan_to_inline(compare), fmt::format("must use global batch {} like the search", so.gbs));
    compared = estimate(m, cl, compare);
    if (!compared.valid) {
      std::string msg;
      for (const auto& x : compared.reasons) msg += (msg.empty() ? "" : "; ") + x.message;
      throw InputError(what + ": " + msg);
    }
  }

  // A search that runs past a second shows its progress on stderr (a pathological space:
  // hundreds of millions of feasible candidates), redrawn at most twice a second.
  std::optional<Progress> bar;
  const auto began = std::chrono::steady_clock::now();
  double shown_s = 0;
  so.on_progress = [&](int64_t done, int64_t total, int64_t candidates) {
    const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    if (el < 1.0 || (el - shown_s < 0.5 && done < total)) return;
    shown_s = el;
    if (!bar) bar.emplace("plan: (tp, pp) units", total, began);
    bar->update(done, fmt::format("{} candidates", candidates), 5.0);
  };
  const SearchResult r = search(m, cl, so);
  if (bar) bar->finish();
  // A --fix no candidate can meet (tp=16 on 8 GPUs, a vp that divides no stage's layers)
  // is bad input, not an infeasible search.
  if (r.candidates_evaluated == 0 && a.has("fix"))
    fail_field("--fix", a.get("fix"),
               fmt::format("leaves no candidate plan: tp*pp*dp*cp must equal --gpus {}, mbs x dp must divide the "
                           "global batch {}, sp needs tp > 1, and each fixed size must suit the model ({} layers, {} "
                           "heads, {} query groups, sequence {}){}{}",
                           so.gpus, so.gbs, m.L, m.A, m.G, m.S,
                           so.fixed.uneven_split.value_or(false)
                               ? "; uneven_split=1 keeps only pipelines whose ends a first/last split or a layout balances better"
                               : "",
                           so.fixed.cp_comm ? "; cp_comm_type keeps only context-parallel plans (cp > 1)" : ""));
  if (r.plans.empty()) {
    std::string why;
    for (const auto& [k, v] : r.rejected) why += fmt::format("{}{} {}", why.empty() ? "" : ", ", k, v);
    fmt::print(stderr, "strata plan: no feasible plan among {} candidates for {} on {} x {}{}; rejected: {}\n",
               r.candidates_evaluated, m.name, so.gpus, cl.name,
               limit > 0 ? fmt::format(" within --memory-limit {} per GPU", human_bytes(limit)) : "", why);
    if (a.has("json")) {
      Json j = search_to_json(r);
      if (limit > 0) j["memory_limit_bytes"] = limit;
      fmt::print("{}\n", j.dump(2));
    }
    return kExitInfeasible;
  }
  const Estimate& best = r.plans.front();
  if (a.has("trace")) trace_to_file(a.get("trace"), m, cl, best.plan);
  std::string exported;
  if (exp == "megatron") exported = export_megatron(m, best.plan, best.stack);
  if (exp == "deepspeed") exported = export_deepspeed(m, best.plan, best.stack);
  if (exp == "bridge") exported = export_bridge(m, best.plan, best.stack);
  if (a.has("json")) {  // one JSON document: the export, if asked for, goes inside it
    Json j = search_to_json(r);
    if (limit > 0) j["memory_limit_bytes"] = limit;
    if (a.has("compare") || launch) j["compared"] = estimate_to_json(compared);
    if (!exported.empty()) j["export"] = {{"format", exp}, {"text", exported}};
    return fmt::print("{}\n", j.dump(2)), kExitOk;
  }
  if (!exported.empty()) return fmt::print("{}", exported), kExitOk;
  std::string rej;
  for (const auto& [k, v] : r.rejected) rej += fmt::format("{}{} {}", rej.empty() ? "" : ", ", k, v);
  fmt::print("strata plan: {} ({} parameters) on {} x {}, global batch {} x {} tokens, {}\n", m.name,
             human_count(m.total_params()), so.gpus, cl.name, so.gbs, m.S, to_string(so.precision));
  if (limit > 0)
    fmt::print("memory limit {} per GPU (--memory-limit {}; the device has {})\n", human_bytes(limit),
               a.get("memory-limit"), human_bytes(device_bytes));
  fmt::print("searched {} candidates in {:.3f} s: {} feasible, {} simulated; rejected: {}\n\n", r.candidates_evaluated,
             r.search_time_s, r.feasible, r.simulated, rej.empty() ? "none" : rej);
  fmt::print("{}\n", kPlanHeader);
  for (size_t i = 0; i < r.plans.size(); ++i) fmt::print("{}\n", plan_row(m, r.plans[i], static_cast<int>(i + 1)));
  if (so.pareto) {
    // The frontier runs down to plans many times slower; the table keeps those within 2x of
    // the fastest (--json has them all).
    fmt::print("\nmemory / throughput frontier (no plan is both faster and smaller), within 2x of the fastest:\n{}\n",
               kPlanHeader);
    int shown = 0;
    for (const auto& e : r.pareto)
      if (e.step_time_s <= 2.0 * r.plans.front().step_time_s) fmt::print("{}\n", plan_row(m, e, ++shown));
    if (static_cast<size_t>(shown) < r.pareto.size())
      fmt::print("  ({} slower frontier plans down to {} per GPU in --json)\n", r.pareto.size() - shown,
                 human_bytes(r.pareto.front().memory.peak));
  }
  EstimateDetail d;
  EstimateOptions eo;
  const Estimate detailed = estimate(m, cl, best.plan, eo, &d);
  fmt::print("\nbest plan:\n{}", format_estimate(m, cl, detailed, &d, device_bytes));
  if (a.has("compare") || launch) {
    fmt::print("{}", explain(best, compared));
    if (!compared.fits)  // a plan the search would have rejected: the reason, not only the times
      fmt::print("  the compared plan does not fit: {} on stage {} against {} per GPU{}\n",
                 human_bytes(compared.memory.peak), compared.memory.stage, human_bytes(cl.device.memory_bytes),
                 limit > 0 ? " (--memory-limit)" : "");
  }
  if (a.has("trace")) fmt::print("\ntrace of the best plan written to {}\n", a.get("trace"));
  return kExitOk;
}

int run(int argc, char** argv) {
  if (argc < 2) {
    fmt::print(stderr, "{}", kUsage);
    return kExitInput;
  }
  const std::string cmd = argv[1];
  const std::vector<std::string> rest(argv + 2, argv + argc);
  if (cmd == "--help" || cmd == "-h" || cmd == "help") return fmt::print("{}", kUsage), kExitOk;
  // `strata train --help` and the like: that subcommand's usage, before it starts MPI.
  for (const auto& r : rest)
    if (r == "--help" || r == "-h") {
      const bool known = cmd == "plan" || cmd == "estimate" || cmd == "train" || cmd == "profile" || cmd == "validate";
      return fmt::print("{}", known ? usage_of(cmd) : kUsage), kExitOk;
    }
  if (cmd == "plan") return cmd_plan(rest);
  if (cmd == "estimate") return cmd_estimate(rest);
  if (cmd == "train") return cmd_train(rest);
  if (cmd == "profile") return cmd_profile(rest);
  if (cmd == "validate") return cmd_validate(rest);
  throw InputError(fmt::format("strata: unknown subcommand '{}' (plan, estimate, profile, train, validate; see strata --help)", cmd));
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  try {
    return strata::run(argc, argv);
  } catch (const strata::InputError& e) {
    std::fflush(stdout);
    fmt::print(stderr, "strata: error: {}\n", e.what());
    return strata::kExitInput;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "strata: internal error: {}\n", e.what());
    return strata::kExitInternal;
  }
}
