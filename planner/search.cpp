// The planner's search; see search.h.
#include "planner/search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace strata {

FixedDims parse_fixed(const std::string& text) {
  const Json j = parse_inline_pairs(text, "--fix");
  FixedDims f;
  Json optimizer = Json::object();  // the precision-aware optimizer's keys, read as a plan reads them
  Json activations = Json::object();  // activation offloading's keys, alike
  Json dispatcher = Json::object();   // the MoE token dispatcher's keys, alike
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string k = it.key();
    const Json& v = it.value();
    if (k == "use_precision_aware_optimizer" || k == "exp_avg_dtype" || k == "exp_avg_sq_dtype" ||
        k == "main_params_dtype" || k == "store_param_remainders") {
      optimizer[k] = v;
      continue;
    }
    if (k == "offload_modules" || k == "fine_grained_activation_offloading" || k == "activation_offload_fraction" ||
        k == "min_offloaded_tensor_size") {
      activations[k] = v;
      continue;
    }
    if (k == "moe_token_dispatcher_type" || k == "moe_flex_dispatcher_backend" || k == "moe_enable_deepep") {
      dispatcher[k] = v;
      continue;
    }
    auto integer = [&](int64_t lo, int64_t hi) -> int64_t {
      if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
        fail_field("--fix " + k, show_value(v), fmt::format("must be an integer in [{}, {}]", lo, hi));
      return v.get<int64_t>();
    };
    if (k == "tp" || k == "tensor_parallel") f.t = integer(1, 1 << 20);
    else if (k == "pp" || k == "pipeline_parallel") f.p = integer(1, 1 << 20);
    else if (k == "dp" || k == "data_parallel") f.d = integer(1, 1 << 20);
    else if (k == "cp" || k == "context_parallel") f.c = integer(1, 1 << 20);
    else if (k == "vp" || k == "virtual_pipeline_stages") f.v = integer(1, 1 << 20);
    else if (k == "mbs" || k == "micro_batch_size") f.mbs = integer(1, 1 << 30);
    else if (k == "zero" || k == "zero_stage") f.zero = static_cast<int>(integer(0, 3));
    else if (k == "recompute_num_layers") f.recompute_layers = integer(0, 100000);
    else if (k == "ep" || k == "expert_model_parallel_size") f.ep = integer(1, 1 << 20);
    else if (k == "uneven_split") f.uneven_split = integer(0, 1) == 1;
    else if (k == "num_distributed_optimizer_instances") f.dp_instances = integer(1, 1 << 20);
    else if (k == "gbs" || k == "global_batch_size") f.gbs = integer(1, int64_t{1} << 30);
    else if (k == "precision") {
      const std::string s = v.is_string() ? v.get<std::string>() : "";
      if (s == "fp32") f.precision = Precision::fp32;
      else if (s == "bf16") f.precision = Precision::bf16;
      else if (s == "fp16") f.precision = Precision::fp16;
      else if (s == "fp8") f.precision = Precision::fp8;
      else fail_field("--fix precision", show_value(v), "must be one of fp32, bf16, fp16, fp8");
    }
    else if (k == "data_parallel_shard_size") f.dp_shard_size = integer(1, 1 << 20);
    else if (k == "offload" || k == "optimizer_offload_fraction") {
      if (!v.is_number() || v.get<double>() < 0 || v.get<double>() > 1)
        fail_field("--fix " + k, show_value(v), "must be a number in [0, 1]");
      f.offload = v.get<double>();
    }
    else if (k == "cp_comm_type") {
      const std::string s = v.is_string() ? v.get<std::string>() : "";
      if (s == "p2p") f.cp_comm = CpComm::p2p;
      else if (s == "a2a") f.cp_comm = CpComm::a2a;
      else if (s == "allgather" || s == "all_gather") f.cp_comm = CpComm::allgather;
      else fail_field("--fix cp_comm_type", show_value(v), "must be one of p2p, a2a, allgather");
    }
    else if (k == "sp" || k == "sequence_parallel") {
      if (v.is_boolean()) f.sp = v.get<bool>();
      else f.sp = integer(0, 1) == 1;
    } else if (k == "grad_reduce_in_fp32") {
      if (v.is_boolean()) f.grad_reduce_in_fp32 = v.get<bool>();
      else f.grad_reduce_in_fp32 = integer(0, 1) == 1;
    } else if (k == "fp8_param_gather") {
      if (v.is_boolean()) f.fp8_param_gather = v.get<bool>();
      else f.fp8_param_gather = integer(0, 1) == 1;
    } else if (k == "tp_comm_overlap") {
      if (v.is_boolean()) f.tp_comm_overlap = v.get<bool>();
      else f.tp_comm_overlap = integer(0, 1) == 1;
    } else if (k == "overlap_moe_expert_parallel_comm" || k == "moe_a2a_overlap") {
      if (v.is_boolean()) f.moe_a2a_overlap = v.get<bool>();
      else f.moe_a2a_overlap = integer(0, 1) == 1;
    } else if (k == "recompute") {
      const std::string s = v.is_string() ? v.get<std::string>() : "";
      if (s == "none") f.recompute = Recompute::none;
      else if (s == "selective") f.recompute = Recompute::selective;
      else if (s == "full") f.recompute = Recompute::full;
      else fail_field("--fix recompute", show_value(v), "must be one of none, selective, full");
    } else if (k == "selective_ac_option") {
      f.selective_ac_op = plan_from_json(Json{{"selective_ac_option", v}}, "--fix").selective_ac_op;  // (its checks)
    } else if (k == "schedule" || k == "pipeline_schedule") {
      const std::string s = v.is_string() ? v.get<std::string>() : "";
      if (s == "gpipe") f.gpipe = true;
      else if (s == "1f1b" || s == "interleaved") f.gpipe = false;
      else fail_field("--fix schedule", show_value(v), "must be one of 1f1b, gpipe, interleaved");
    } else {
      fail_field("--fix " + k, show_value(v),
                 "unknown key: use tp, pp, dp, cp, vp, mbs, gbs, zero, recompute, recompute_num_layers, sp, schedule, "
                 "precision, "
                 "uneven_split, cp_comm_type, offload, ep, grad_reduce_in_fp32, fp8_param_gather, tp_comm_overlap, "
                 "selective_ac_option, moe_token_dispatcher_type (and "
                 "its moe_flex_dispatcher_backend), overlap_moe_expert_parallel_comm, use_precision_aware_optimizer (and "
                 "its exp_avg_dtype, exp_avg_sq_dtype, main_params_dtype, store_param_remainders), offload_modules "
                 "(and its activation_offload_fraction, min_offloaded_tensor_size), num_distributed_optimizer_instances "
                 "or data_parallel_shard_size");
    }
  }
  if (!optimizer.empty()) {
    const Plan o = plan_from_json(optimizer, "--fix");
    if (o.precision_aware_optimizer) f.optimizer = o;
  }
  if (f.dp_instances && f.dp_shard_size)
    throw InputError("--fix: num_distributed_optimizer_instances and data_parallel_shard_size both given: keep one");
  // Megatron-LM's --recompute-num-layers applies to full recompute only: fixing it fixes that.
  if (f.recompute_layers && *f.recompute_layers > 0) {
    if (f.recompute && *f.recompute != Recompute::full)
      fail_field("--fix recompute_num_layers", std::to_string(*f.recompute_layers),
                 fmt::format("needs recompute=full (--fix gives recompute={})",
                             *f.recompute == Recompute::none ? "none" : "selective"));
    f.recompute = Recompute::full;
  }
  // torchtitan's op policy is its selective recompute: fixing it fixes that.
  if (f.selective_ac_op) {
    if (f.recompute_layers && *f.recompute_layers > 0)
      fail_field("--fix selective_ac_option", "\"op\"",
                 "cannot be combined with recompute_num_layers (the layers full recompute recomputes)");
    if (f.recompute && *f.recompute != Recompute::selective)
      fail_field("--fix selective_ac_option", "\"op\"",
                 fmt::format("needs recompute=selective (--fix gives recompute={})",
                             *f.recompute == Recompute::none ? "none" : "full"));
    f.recompute = Recompute::selective;
  }
  if (!dispatcher.empty()) f.moe_dispatcher = plan_from_json(dispatcher, "--fix").moe_dispatcher;
  if (!activations.empty()) {
    if (!activations.contains("offload_modules") && !activations.contains("fine_grained_activation_offloading"))
      fail_field("--fix " + activations.begin().key(), show_value(activations.begin().value()),
                 "needs offload_modules (the modules whose activations go to the host)");
    const Plan o = plan_from_json(activations, "--fix");
    if (o.offload_modules) f.activation_offload = o;
  }
  return f;
}

namespace {

// --fix's hybrid sharding on a ZeRO >= 1 candidate: its instances, or as many as shard
// groups of the fixed size make of its replicas (a size that does not divide them is given
// an instance count check_plan refuses, dp_instances; a group of every replica is one
// instance, plain ZeRO).
void hybrid_sharding(const FixedDims& f, Plan* pl) {
  if (f.dp_instances) {
    pl->dp_instances = *f.dp_instances;
  } else if (f.dp_shard_size) {
    const int64_t r = pl->replicas(), s = *f.dp_shard_size;
    pl->dp_instances = r % s == 0 ? r / s : r + 1;  // (r + 1 divides no r: refused)
  }
}

// The main gradients' type every candidate takes: --fix grad_reduce_in_fp32, else Megatron's default.
Tristate grad_reduce_of(const FixedDims& f) {
  return !f.grad_reduce_in_fp32 ? Tristate::automatic : *f.grad_reduce_in_fp32 ? Tristate::on : Tristate::off;
}

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> small, large;
  for (int64_t i = 1; i * i <= n; ++i) {
    if (n % i == 0) {
      small.push_back(i);
      if (i != n / i) large.push_back(n / i);
    }
  }
  small.insert(small.end(), large.rbegin(), large.rend());
  return small;
}

template <class T>
bool allowed(const std::optional<T>& fixed, T value) {
  return !fixed || *fixed == value;
}

// Keeps the K best estimates by step time (ties: less memory).
struct TopK {
  size_t k;
  std::vector<Estimate> items;
  static bool better(const Estimate& a, const Estimate& b) {
    if (a.step_time_s != b.step_time_s) return a.step_time_s < b.step_time_s;
    return a.memory.peak < b.memory.peak;
  }
  double bound() const { return items.size() < k ? 1e300 : items.back().step_time_s; }
  void add(Estimate e) {
    if (items.size() >= k && !better(e, items.back())) return;
    auto pos = std::lower_bound(items.begin(), items.end(), e, better);
    items.insert(pos, std::move(e));
    if (items.size() > k) items.pop_back();
  }
};

// Frontier of (peak memory, step time): sorted by memory, step times strictly falling.
struct Frontier {
  std::vector<Estimate> pts;
  bool dominated(double mem, double time) const {
    for (const auto& e : pts)
      if (e.memory.peak <= mem && e.step_time_s <= time) return true;
    return false;
  }
  void add(Estimate e) {
    if (dominated(e.memory.peak, e.step_time_s)) return;
    std::vector<Estimate> keep;
    for (auto& x : pts)
      if (!(e.memory.peak <= x.memory.peak && e.step_time_s <= x.step_time_s)) keep.push_back(std::move(x));
    keep.push_back(std::move(e));
    std::sort(keep.begin(), keep.end(), [](const Estimate& a, const Estimate& b) { return a.memory.peak < b.memory.peak; });
    pts = std::move(keep);
  }
};

}  // namespace

namespace {

// One micro-batch's work of a layer (or the embedding, or the output layer) as
// balanced_end_split weighs it: forward, backward and recompute.
double split_work(const LayerCost& c) { return c.forward.total() + c.backward.total() + c.recompute.total(); }
// The output layer's, with multi-token prediction's transformer layers (ModelSpec::mtp_layers),
// which run beside it: of the last decoder layer's kind, the MoE (or only) layer's `layer` or
// a mixed model's dense layer's `dense`.
double head_split_work(const ModelSpec& m, const LayerCost& head, const LayerCost& layer, const LayerCost& dense) {
  return split_work(head) +
         static_cast<double>(m.mtp_layers) * (m.mtp_layers > 0 ? split_work(m.mixed() && !m.mtp_moe() ? dense : layer) : 0.0);
}

}  // namespace

std::optional<Plan> balanced_end_split(const ModelSpec& m, const Plan& p, double w, double e, double h) {
  const int64_t L = m.L, P = p.p, v = p.v;
  if (P < 2 || v < 1 || !(w > 0) || !(e >= 0) || !(h >= 0)) return std::nullopt;
  // strata's own layout by the same measure: every stage L / p layers, or with slots for
  // the embedding and the output layer v slots of (L + 2) / (p v) each, the first and last
  // stage one layer short, or else as even as possible (make_layout).
  double own = 0;
  if (L % (P * v) == 0) {
    own = static_cast<double>(L / P) * w + std::max(e, h);
  } else if ((L + 2) % (P * v) == 0) {
    const double full = static_cast<double>((L + 2) / P);
    own = std::max((full - 1) * w + std::max(e, h), P > 2 ? full * w : 0.0);
  } else {
    const StageLayout lay = make_layout(L, P, v);
    for (int64_t s = 0; s < P; ++s)
      own = std::max(own, static_cast<double>(lay.stage_layers(s)) * w + (s == 0 ? e : 0.0) + (s == P - 1 ? h : 0.0));
  }
  int64_t best_f = 0, best_l = 0, best_mid = 0;
  double best = own;
  auto take = [&](int64_t f, int64_t l, int64_t mid) {
    if (f < v || l < v || f % v != 0 || l % v != 0) return;
    const double b = std::max({static_cast<double>(f) * w + e, static_cast<double>(l) * w + h,
                               static_cast<double>(mid) * w});
    if (b < best || (b == best && best_f > 0 && f < best_f)) best = b, best_f = f, best_l = l, best_mid = mid;
  };
  // The middle stages' layers (none with two stages), then the rest R = f + l split where
  // f w + e = l w + h, rounded to multiples of v either way.
  for (int64_t mid = P > 2 ? v : 0; P == 2 ? mid == 0 : (P - 2) * mid <= L - 2 * v; mid += P > 2 ? v : 1) {
    const int64_t R = L - (P - 2) * mid;
    if (R < 2 * v) continue;  // (two stages of more chunks than half the layers)
    const double f_star = std::clamp((static_cast<double>(R) * w + h - e) / (2.0 * w), 0.0, static_cast<double>(R));
    const int64_t lo = std::clamp<int64_t>(static_cast<int64_t>(std::floor(f_star / static_cast<double>(v))) * v, v, R - v);
    for (int64_t f : {lo, lo + v}) take(f, R - f, mid);
  }
  // With virtual stages, single layers moved by a layout (search.h).
  if (v > 1 && P > 2 && L % (P * v) == 0) {
    const int64_t n = L / (P * v);
    auto moves = [&](double end) {  // layers off an end so that it does at most one layer more than the rest
      // (clamped as a double: an end of 1e300 layers must not overflow the conversion)
      return static_cast<int64_t>(std::clamp(std::ceil(end / w) - 1.0, 0.0, static_cast<double>(n)));
    };
    // The costlier end's moves first, where both want more middle stages than there are.
    int64_t a = 0, b = 0;
    if (h >= e) {
      b = std::min(moves(h), P - 2);
      a = std::min(moves(e), P - 2 - b);
    } else {
      a = std::min(moves(e), P - 2);
      b = std::min(moves(h), P - 2 - a);
    }
    const double base = static_cast<double>(n * v) * w;
    const double slowest = std::max({base + e - static_cast<double>(a) * w, base + h - static_cast<double>(b) * w,
                                     base + (a + b > 0 ? w : 0.0)});
    if (a + b > 0 && slowest < best) {
      std::vector<int64_t> layers(static_cast<size_t>(P * v), n);  // (chunk * p + stage), layout.h's order
      layers.front() -= a;
      layers.back() -= b;
      // The output layer's on the last chunk of the first middle stages, the embedding's on the
      // first chunk of the last ones (the other way about, the walk puts the extra layer on
      // the critical path: Llama 3 70B tp4 pp8 vp5 in FP8 on H100, 21.38 s with it on stage 1,
      // 21.40 s on stage 3, 21.49 s on stage 6, against 22.25 s for the even layout).
      for (int64_t i = 1; i <= a; ++i) ++layers[static_cast<size_t>(P - 1 - i)];           // chunk 0, stage p - 1 - i
      for (int64_t j = 1; j <= b; ++j) ++layers[static_cast<size_t>((v - 1) * P + j)];  // chunk v - 1, stage j
      // Megatron's notation, runs of like virtual stages as "(t*2|)*32", a comma after each
      // (cosmetic): "Et*2|(t*2|)*32,t*3|(t*2|)*5,tL".
      auto part = [](int64_t k) { return k == 0 ? std::string() : k == 1 ? std::string("t") : fmt::format("t*{}", k); };
      std::string text = "E" + part(layers.front()) + "|";
      for (size_t k = 1; k + 1 < layers.size();) {
        size_t run = 1;
        while (k + run + 1 < layers.size() && layers[k + run] == layers[k]) ++run;
        text += run > 1 ? fmt::format("({}|)*{},", part(layers[k]), run) : part(layers[k]) + "|";
        k += run;
      }
      // (multi-token prediction's layers with the loss, as Megatron-core places them)
      text += part(layers.back()) + (m.mtp_layers == 0   ? std::string()
                                     : m.mtp_layers == 1 ? std::string("m")
                                                         : fmt::format("m*{}", m.mtp_layers)) + "L";
      Plan q = p;
      q.first_stage_layers = q.last_stage_layers = 0;
      q.layout = std::make_shared<const PipelineLayout>(PipelineLayout{std::move(text), std::move(layers), m.mtp_layers});
      return q;
    }
  }
  if (best_f == 0) return std::nullopt;
  Plan q = p;
  q.layout.reset();
  // Only what differs from the middle stages (with two stages, the first stage's count).
  q.first_stage_layers = P == 2 || best_f != best_mid ? best_f : 0;
  q.last_stage_layers = P > 2 && best_l != best_mid ? best_l : 0;
  return q;
}

std::optional<Plan> balanced_end_split(const ModelSpec& m, const Cluster& cl, const Plan& p) {
  Plan base = p;
  base.zero = 0;
  base.recompute_layers = 0;
  base.first_stage_layers = base.last_stage_layers = 0;
  base.layout.reset();
  base.dp_instances = 1;  // (no ZeRO here)
  const ComputeSetup cs = compute_setup(m, cl, base);
  const LayerCost layer = layer_cost(m, cl, base, cs);
  const LayerCost dense = m.mixed() ? layer_cost(m.dense_layers(), cl, base, cs) : LayerCost{};
  double w = split_work(layer);
  if (m.mixed()) {  // the layers' mean
    const double moe = static_cast<double>(m.moe_layer_count()), L = static_cast<double>(m.L);
    w = (moe * w + (L - moe) * split_work(dense)) / L;
  }
  return balanced_end_split(m, p, w, split_work(embedding_cost(m, cl, base, cs)),
                            head_split_work(m, head_cost(m, cl, base, cs), layer, dense));
}

Stack search_stack(const ModelSpec& m, const Cluster& cl, const SearchOptions& opt) {
  Plan plain;
  plain.precision = opt.precision;
  plain.attention = opt.attention;
  plain.grad_reduce_in_fp32 = grad_reduce_of(opt.fixed);
  return resolve_stack(m, cl, plain);
}

SearchResult search(const ModelSpec& m, const Cluster& cl, const SearchOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  SearchResult res;
  TopK top{static_cast<size_t>(std::max(1, opt.top_k)), {}};
  Frontier front;
  const FixedDims& fx = opt.fixed;
  const int64_t N = opt.gpus;

  // One software stack and one attention kernel for every candidate, so plans compare like
  // for like: ZeRO-2/3 would make "auto" the modern stack on their own, and context
  // parallelism FlashAttention (resolve_stack), so where the plain plan resolves legacy,
  // ZeRO-2/3 candidates are costed on it (software_stack=legacy in the plan), and where it
  // resolves unfused, context-parallel candidates keep the unfused kernel of the others and
  // are rejected (cp_attention); --attention flash searches them all with flash. (A model
  // longer than the legacy fused softmax is fused for all.)
  const Stack stack = search_stack(m, cl, opt);

  // Layer costs depend on (t, c, d for ZeRO-2/3, mbs, sp, recompute, ZeRO-2 or 3, and
  // cp_comm_type with the experts' ep and etp packed in one: experts()): cached.
  // (With the expert exchanges' overlap, its paired share too: paired_share.)
  using CostKey = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, int, int, int64_t, double>;
  auto experts = [](const Plan& pl, CpComm cc) {  // (ep and etp are below 2^20: check_plan's bound)
    return static_cast<int64_t>(cc) + 4 * (pl.etp + (int64_t{1} << 21) * pl.ep);
  };
  // [0] a layer (a mixed model's MoE layer), [1] the embedding, [2] the output layer, [3] a
  // mixed model's dense layer (ModelSpec::mixed; else left empty).
  std::map<CostKey, std::array<LayerCost, 4>> costs;
  const ModelSpec dense_model = m.mixed() ? m.dense_layers() : ModelSpec{};
  auto costs_of = [&](const Plan& pl, const ComputeSetup& cs) -> const std::array<LayerCost, 4>& {
    // (With multi-token prediction the output layer's cost says whether the block method
    // leaves the modules unrecomputed: recompute_layers > 0.)
    const int rc = static_cast<int>(pl.recompute) + (m.mtp_layers > 0 && pl.recompute_layers > 0 ? 8 : 0);
    const CostKey key{pl.t, pl.c, pl.zero >= 2 ? pl.d : 0, pl.mbs, pl.sp, rc,
                      pl.zero >= 2 ? pl.zero : 0, experts(pl, cs.cp_comm),
                      pl.moe_a2a_overlap ? paired_share(pl) + (pl.delay_wgrad ? 2.0 : 0.0) : 0.0};
    auto it = costs.find(key);
    if (it == costs.end())
      it = costs.emplace(key, std::array<LayerCost, 4>{layer_cost(m, cl, pl, cs), embedding_cost(m, cl, pl, cs),
                                                       head_cost(m, cl, pl, cs),
                                                       m.mixed() ? layer_cost(dense_model, cl, pl, cs) : LayerCost{}})
               .first;
    return it->second;
  };
  // One work per layer for balanced_end_split: a mixed model's layers' mean.
  auto layer_split_work = [&](const std::array<LayerCost, 4>& lc) {
    if (!m.mixed()) return split_work(lc[0]);
    const double moe = static_cast<double>(m.moe_layer_count()), L = static_cast<double>(m.L);
    return (moe * split_work(lc[0]) + (L - moe) * split_work(lc[3])) / L;
  };
  // The layout with a mixed model's dense layers counted for the plan (which of them its
  // partial recompute recomputes); other models' layouts as they are.
  StageLayout kinds_scratch;
  auto with_kinds = [&](const Plan& pl, const StageLayout& lay) -> const StageLayout& {
    if (!m.mixed()) return lay;
    kinds_scratch.p = lay.p;
    kinds_scratch.v = lay.v;
    kinds_scratch.layers = lay.layers;
    count_layer_kinds(m, pl, &kinds_scratch);
    return kinds_scratch;
  };
  std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t>, InFlight> flights;
  auto reject = [&](const std::string& key, int64_t n) {
    res.rejected[key] += n;
    res.candidates_evaluated += n;
  };

  // Memory of a candidate that passed check_plan: the peak of its most loaded stage.
  struct Fit {
    bool fits;
    double peak;
    const InFlight* flight;
  };
  std::vector<MemoryBreakdown> mem;  // memory_of's scratch, kept across candidates
  // A context-parallel plan's memory does not depend on its cp_comm_type: the fits of the
  // candidates that differ from those before them only in it are kept, keyed by what else
  // varies below the loop over the types (cleared above it).
  struct FitKey {
    int zero;
    double offload;
    int64_t experts;  // ep and etp (experts())
    int64_t recompute_layers, first, last;
    std::string layout;
    bool operator==(const FitKey&) const = default;
  };
  std::vector<std::pair<FitKey, Fit>> fits_by_type;
  auto memory_of = [&](const Plan& pl, const StageLayout& given, const ComputeSetup& cs) {
    const StageLayout& lay = with_kinds(pl, given);
    FitKey key;
    if (pl.c > 1) {
      key = FitKey{pl.zero, pl.offload, experts(pl, CpComm::automatic), pl.recompute_layers, pl.first_stage_layers, pl.last_stage_layers,
                   pl.layout ? pl.layout->text : std::string()};
      for (const auto& [k, f] : fits_by_type)
        if (k == key) return f;
    }
    const int64_t mb_count = pl.microbatches();
    const ScheduleKind kind = pl.schedule();
    // (Counts saturate after a few multiples of p, except GPipe's and those of the
    // interleaved schedule in groups of other than p, which depend on the count itself.)
    const int64_t g = kind == ScheduleKind::interleaved ? pl.vp_group_size() : 0;
    const bool whole = kind == ScheduleKind::gpipe || (g != 0 && g != pl.p);
    const auto fkey =
        std::make_tuple(static_cast<int>(kind), pl.p, pl.v, g, whole ? mb_count : std::min(mb_count, 4 * pl.p + 4));
    auto fit = flights.find(fkey);
    if (fit == flights.end()) fit = flights.emplace(fkey, in_flight(kind, pl.p, pl.v, mb_count, g)).first;
    const size_t worst = stages_memory(m, cl, pl, lay, cs, fit->second, &mem);
    const bool host_ok = (pl.offload <= 0 && !pl.offload_modules) || offloaded_host_bytes(cl, pl, mem) <= cl.host.memory_bytes;
    const Fit f{mem[worst].peak <= cl.device.memory_bytes && host_ok, mem[worst].peak, &fit->second};
    if (pl.c > 1) fits_by_type.emplace_back(std::move(key), f);
    return f;
  };

  // Estimate a feasible candidate unless a lower bound on its step time keeps it out of the
  // top K and off the frontier. The bound: any stage b runs m micro-batches of its work
  // (forward F_b, backward and recompute B_b), cannot start before the first forward
  // reaches it through the stages before it, and cannot finish before its last backward
  // drains back through them:
  //   step >= sum_{s<b} (F_s + send) + m (F_b + B_b) + sum_{s<b} (B_s + send).
  // For equal stages and b = p - 1 this is the exact 1F1B and GPipe step (m + p - 1)(F + B).
  // Ranks that share processors may compute up to max_compute_speed() faster than these
  // costs (estimate.h): the bound divides by it.
  const double fastest = max_compute_speed(cl);
  auto evaluate = [&](const Plan& pl, const StageLayout& given, const ComputeSetup& cs, const Fit& f) {
    const StageLayout& lay = with_kinds(pl, given);
    const auto& lc = costs_of(pl, cs);
    const LayerCost* plain = &lc[0];
    const LayerCost* dense_plain = &lc[3];
    if (pl.recompute == Recompute::full && pl.recompute_layers > 0) {
      const auto& without = costs_of(pl.without_recompute(), cs);
      plain = &without[0];
      dense_plain = &without[3];
    }
    const double send = p2p_time(m, cl, pl, cs), mbs_per_step = static_cast<double>(pl.microbatches());
    const bool mixed = !lay.dense.empty();
    // A layer's forward, its backward with recompute, and a plain layer's backward (the
    // same sums each chunk would form).
    const double fwd = lc[0].forward.total(), bwd = lc[0].backward.total() + lc[0].recompute.total();
    const double plain_bwd = plain->backward.total();
    double lb = 0, fill = 0;  // fill: forward and backward of chunk 0 on the stages before b
    for (int64_t s = 0; s < pl.p; ++s) {
      double work = 0, first_f = 0, first_b = 0;
      for (int64_t c = 0; c < lay.v; ++c) {
        const int64_t n = lay.chunk_layers(s, c);
        const int64_t k = pl.recompute == Recompute::full ? pl.recomputed_layers(n) : n;
        double f = static_cast<double>(n) * fwd;
        double b = static_cast<double>(k) * bwd + static_cast<double>(n - k) * plain_bwd;
        if (const int64_t nd = mixed ? lay.chunk_dense(s, c) : 0; nd > 0) {  // a mixed model's dense layers
          const int64_t kd = lay.chunk_dense_recomputed(s, c);
          f = static_cast<double>(n - nd) * fwd + static_cast<double>(nd) * lc[3].forward.total();
          b = static_cast<double>(k - kd) * bwd + static_cast<double>(n - k - (nd - kd)) * plain_bwd +
              static_cast<double>(kd) * (lc[3].backward.total() + lc[3].recompute.total()) +
              static_cast<double>(nd - kd) * dense_plain->backward.total();
        }
        work += f + b;
        if (c == 0) first_f = f, first_b = b;
      }
      if (s == 0) work += lc[1].forward.total() + lc[1].backward.total();
      if (s == pl.p - 1) work += lc[2].forward.total() + lc[2].backward.total();
      lb = std::max(lb, fill + mbs_per_step * work);
      fill += first_f + first_b + 2.0 * send;
    }
    lb /= fastest;
    if (lb >= top.bound() && !(opt.pareto && !front.dominated(f.peak, lb))) return;
    EstimateOptions eo;
    eo.pre = Precomputed{&lc[0], plain, &lc[1], &lc[2], f.flight, &lc[3], dense_plain};
    Estimate e = estimate(m, cl, pl, eo);
    ++res.simulated;
    if (opt.pareto) front.add(e);
    top.add(std::move(e));
  };

  // One candidate: rejected with its reason, out of memory, or evaluated.
  auto consider = [&](const Plan& pl, const StageLayout& lay) {
    const std::vector<Reason> why = check_plan(m, cl, pl, false);
    if (!why.empty()) return reject(why.front().key, 1);
    ++res.candidates_evaluated;
    const ComputeSetup cs = compute_setup(m, cl, pl);
    const Fit f = memory_of(pl, lay, cs);
    if (!f.fits) {
      res.rejected["out_of_memory"] += 1;
      return;
    }
    ++res.feasible;
    evaluate(pl, lay, cs, f);
  };

  // Full recompute of the first k layers of each chunk, k = 1 .. chunk_max (chunk_max: all
  // of them, recompute_num_layers = 0). Memory falls and time grows with k, so the fastest
  // plan that fits recomputes the fewest layers: bisect for it; every smaller k is out of
  // memory and every larger one slower (counted feasible, evaluated only for --pareto).
  auto consider_partial = [&](Plan pl, const StageLayout& lay, int64_t most) {
    auto at = [&, most](int64_t k) {
      pl.recompute_layers = k >= most ? 0 : k;
      return pl;
    };
    // With activation offloading every layer recomputed is refused (a recomputed layer has
    // nothing to offload): the candidates are those that leave a layer, one fewer.
    int64_t chunk_max = most;
    if (pl.offload_modules) {
      const std::vector<Reason> all = check_plan(m, cl, at(most), false);
      reject(all.empty() ? "activation_offload" : all.front().key, 1);
      if (--chunk_max == 0) return;
    }
    const std::vector<Reason> why = check_plan(m, cl, at(chunk_max), false);
    if (!why.empty()) return reject(why.front().key, chunk_max);
    res.candidates_evaluated += chunk_max;
    const ComputeSetup cs = compute_setup(m, cl, pl);
    auto fits = [&](int64_t k) { return memory_of(at(k), lay, cs); };
    // Memory falls with every layer recomputed, but where a stage's every layer becomes
    // recomputed: the layer rebuilt for its backward joins its working set (memory.cpp). On
    // the stages with the most layers that is k = chunk_max, so one fewer may fit where all
    // do not, and then the fitting k lie below it. (A stage with fewer layers reaches it
    // earlier and may rise by a fraction of a layer's activations there; in no sweep so far
    // has that moved the plan's peak, docs/MEASUREMENTS.md.)
    int64_t top = chunk_max;
    if (!fits(chunk_max).fits) {
      if (chunk_max == 1 || !fits(chunk_max - 1).fits) {
        res.rejected["out_of_memory"] += chunk_max;
        return;
      }
      res.rejected["out_of_memory"] += 1;
      top = chunk_max - 1;
    }
    int64_t lo = 1, hi = top;  // the smallest fitting k lies in [lo, hi]
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (fits(mid).fits) hi = mid;
      else lo = mid + 1;
    }
    res.rejected["out_of_memory"] += lo - 1;
    res.feasible += top - lo + 1;
    const int64_t stride = opt.pareto ? std::max<int64_t>(1, (top - lo) / 16) : top;
    for (int64_t k = lo; k <= top; k += stride) {
      const Plan q = at(k);
      evaluate(q, lay, cs, fits(k));
      if (!opt.pareto) break;
    }
  };

  // Rules that depend only on (t, p, c, v) reject every candidate below them at once.
  const std::set<std::string> structural = {"tp_heads", "tp_ffn", "cp_seq", "cp_attention", "layers_vp",
                                            "layers_pp", "vp_needs_pp", "precision", "moe_strata",
                                            "selective_ac_option"};
  auto count = [](const auto& values, const auto& fixed) {
    int64_t n = 0;
    for (const auto& x : values) n += allowed(fixed, x) ? 1 : 0;
    return n;
  };

  // The optimizer offload fractions of a ZeRO stage's candidates: the one --fix pins, else
  // none and, with --search-offload on a cluster with a host (not the strata executor's),
  // kOffloadFractions for ZeRO >= 1; zero_units counts a (t, p, c, v)'s ZeRO stages with them.
  const bool offload_dim = opt.search_offload && !fx.offload && cl.host.present() && !cl.strata_stack;
  std::vector<double> with_offload = {0.0};
  if (offload_dim) with_offload.insert(with_offload.end(), std::begin(kOffloadFractions), std::end(kOffloadFractions));
  const std::vector<double> pinned_offload = {fx.offload.value_or(0.0)};
  auto offloads_for = [&](int zero) -> const std::vector<double>& {
    return offload_dim && zero >= 1 ? with_offload : pinned_offload;
  };
  // Expert parallelism (mixture-of-experts models): the experts split over tensor_parallel
  // ranks (Megatron's default) or over none (expert_tensor_parallel_size 1, Megatron-core's
  // folding), each with every ep dividing the experts and the tensor x data x context
  // parallel ranks over that split; or what --fix pins. Pairs (etp, ep), etp 0 for
  // tensor_parallel; set for each (t, p, c), and counted in zero_units with the ZeRO stages
  // it multiplies.
  std::vector<std::pair<int64_t, int64_t>> eps = {{0, 1}};
  auto zero_units = [&](const std::vector<int>& zeros) {
    int64_t n = 0;
    for (int z : zeros)
      if (allowed(fx.zero, z)) n += static_cast<int64_t>(offloads_for(z).size());
    return n * static_cast<int64_t>(eps.size());
  };

  const Recompute recomputes[] = {Recompute::none, Recompute::selective, Recompute::full};
  int64_t units = 0, units_done = 0;  // (tensor, pipeline) pairs, for on_progress
  if (opt.on_progress)
    for (int64_t t : divisors(N))
      if (allowed(fx.t, t))
        for (int64_t p : divisors(N / t)) units += allowed(fx.p, p) ? 1 : 0;
  for (int64_t t : divisors(N)) {
    if (!allowed(fx.t, t)) continue;
    for (int64_t p : divisors(N / t)) {
      if (!allowed(fx.p, p)) continue;
      struct Done {  // on_progress once the unit is searched, however the loop below leaves it
        const SearchOptions& o;
        int64_t& done;
        int64_t total;
        const SearchResult& r;
        ~Done() {
          ++done;
          try {
            if (o.on_progress) o.on_progress(done, total, r.candidates_evaluated);
          } catch (...) {  // (a destructor must not throw: progress is not worth stopping the search for)
          }
        }
      } done_unit{opt, units_done, units, res};
      for (int64_t c : divisors(N / (t * p))) {
        if (!allowed(fx.c, c)) continue;
        const int64_t d = N / (t * p * c);
        if (!allowed(fx.d, d)) continue;
        // Virtual stages: divisors of the layers per stage, or of the layer slots per stage
        // when the embedding and output layer take one each ((L+2)/p).
        std::vector<int64_t> vs = {1};
        if (p > 1 && m.L % p == 0)
          for (int64_t v : divisors(m.L / p))
            if (v > 1) vs.push_back(v);
        if (p > 1 && (m.L + 2) % p == 0)
          for (int64_t v : divisors((m.L + 2) / p))
            if (v > 1 && (m.L + 2) / (p * v) >= 2 && std::find(vs.begin(), vs.end(), v) == vs.end()) vs.push_back(v);
        std::vector<int64_t> mbss;
        if (opt.gbs % d == 0) mbss = divisors(opt.gbs / d);
        const std::vector<int> zeros = d * c > 1 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{0};
        eps.clear();
        for (int64_t etp : {int64_t{0}, int64_t{1}}) {
          if (etp == 1 && (t == 1 || !m.moe())) continue;
          if (fx.ep) {
            eps.emplace_back(etp, *fx.ep);
            continue;
          }
          eps.emplace_back(etp, 1);
          if (m.moe())
            for (int64_t e : divisors(N / (p * (etp == 1 ? 1 : t))))
              if (e > 1 && m.E % e == 0) eps.emplace_back(etp, e);
        }
        // How context parallelism moves keys and values (cp_comm_type): the one --fix names
        // (rejected below where it cannot run, on the strata executor too), else all three,
        // or the gather, the only one the strata executor runs.
        const std::vector<CpComm> cps = c == 1            ? std::vector<CpComm>{CpComm::automatic}
                                        : fx.cp_comm      ? std::vector<CpComm>{*fx.cp_comm}
                                        : cl.strata_stack ? std::vector<CpComm>{CpComm::allgather}
                                                          : std::vector<CpComm>{CpComm::p2p, CpComm::a2a, CpComm::allgather};
        for (int64_t v : vs) {
          if (!allowed(fx.v, v)) continue;
          if (mbss.empty()) {
            reject("batch_divisible", 1);
            continue;
          }
          // strata's own uneven pipelines are searched only in the (L+2)/p embedding-slot
          // form (estimate also takes the as-even-as-possible split); Megatron's first/last
          // split that balances the ends (balanced_end_split) may still hold the layers.
          // The unit's candidates --fix allows: micro-batch sizes, schedules, sp, recompute
          // modes (full counted `full_weight` times: once per recompute_num_layers setting),
          // ZeRO units and cp_comm_types.
          auto unit_candidates = [&](int64_t full_weight) {
            int64_t recompute_choices = 0;
            for (Recompute rc : recomputes)
              if (allowed(fx.recompute, rc)) recompute_choices += rc == Recompute::full ? full_weight : 1;
            return count(mbss, fx.mbs) *
                   (v > 1 || p == 1 ? count(std::vector<bool>{false}, fx.gpipe)
                                    : count(std::vector<bool>{false, true}, fx.gpipe)) *
                   (t > 1 ? count(std::vector<bool>{false, true}, fx.sp) : count(std::vector<bool>{false}, fx.sp)) *
                   recompute_choices * zero_units(zeros) * count(cps, fx.cp_comm);
          };
          // A unit none of whose candidates --fix allows (a micro-batch size that does not
          // divide its batch, sp=1 with tp=1, ...) has no candidate to count, rejected or not:
          // a --fix that leaves none anywhere is bad input (cli), not an infeasible search.
          if (unit_candidates(1) == 0) continue;
          const bool own_ok = !(v == 1 && p > 1 && m.L % p != 0 && (m.L + 2) % p != 0);
          const bool splits = p > 1 && allowed(fx.uneven_split, true);
          if (!own_ok && !splits) {
            reject("layers_uneven", 1);
            continue;
          }
          const StageLayout lay = make_layout(m.L, p, v);
          const int64_t chunk_max = *std::max_element(lay.layers.begin(), lay.layers.end());
          StageLayout split_lay;  // the last balanced split's layout, made again when it changes
          int64_t split_max = 0;
          std::tuple<int64_t, int64_t, std::string> split_lay_for{-1, -1, ""};
          Plan probe_tpcv;
          probe_tpcv.t = t; probe_tpcv.p = p; probe_tpcv.d = d; probe_tpcv.c = c; probe_tpcv.v = v;
          probe_tpcv.mbs = mbss.front(); probe_tpcv.gbs = opt.gbs; probe_tpcv.precision = opt.precision;
          probe_tpcv.attention = opt.attention;
          probe_tpcv.grad_reduce_in_fp32 = grad_reduce_of(fx);
          if (fx.fp8_param_gather) probe_tpcv.fp8_param_gather = *fx.fp8_param_gather ? Tristate::on : Tristate::off;
          if (fx.tp_comm_overlap) probe_tpcv.tp_comm_overlap = *fx.tp_comm_overlap ? Tristate::on : Tristate::off;
          if (fx.moe_dispatcher) probe_tpcv.moe_dispatcher = *fx.moe_dispatcher;
          if (fx.moe_a2a_overlap) {  // (with delay_wgrad_compute, as Megatron-Bridge's recipes run it)
            probe_tpcv.moe_a2a_overlap = *fx.moe_a2a_overlap;
            probe_tpcv.delay_wgrad = *fx.moe_a2a_overlap;
          }
          if (fx.activation_offload) probe_tpcv.take_activation_offload_of(*fx.activation_offload);
          probe_tpcv.selective_ac_op = fx.selective_ac_op;
          if (fx.selective_ac_op) probe_tpcv.recompute = Recompute::selective;  // (what the policy cannot cost rejects the unit)
          // (An MoE model needs sequence parallelism with tp > 1: the probe has it, so that
          // moe_sp does not hide a structural reason.)
          probe_tpcv.sp = m.moe() && t > 1;
          if (c > 1 && opt.attention == AttentionChoice::automatic && stack.attention == AttentionKernel::unfused)
            probe_tpcv.attention = AttentionChoice::unfused;
          const std::vector<Reason> why = check_plan(m, cl, probe_tpcv, false);
          if (!why.empty() && structural.count(why.front().key)) {
            if (!own_ok) {  // strata's own layout is not searched here: the unit counted once, as without splits
              reject("layers_uneven", 1);
              continue;
            }
            reject(why.front().key, unit_candidates(chunk_max));
            continue;
          }
          if (!own_ok) reject("layers_uneven", 1);  // strata's own layout, once; the splits below
          // A cp_comm_type that cannot run these (t, c) (a2a's heads, p2p's sliding window)
          // rejects every candidate below it at once, as the structural rules do.
          std::vector<bool> cp_runs(cps.size(), true);
          for (size_t i = 0; i < cps.size(); ++i) {
            Plan q = probe_tpcv;
            q.cp_comm = cps[i];
            const std::vector<Reason> w = check_plan(m, cl, q, false);
            cp_runs[i] = w.empty() || w.front().key != "cp_comm";
          }
          for (int64_t mbs : mbss) {
            if (!allowed(fx.mbs, mbs)) continue;
            for (int gp = 0; gp < (v > 1 || p == 1 ? 1 : 2); ++gp) {  // GPipe = 1F1B without a pipeline
              if (!allowed(fx.gpipe, gp == 1)) continue;
              for (int sp = 0; sp < (t > 1 ? 2 : 1); ++sp) {
                if (!allowed(fx.sp, sp == 1)) continue;
                for (Recompute rc : recomputes) {
                  if (!allowed(fx.recompute, rc)) continue;
                  fits_by_type.clear();
                  for (size_t ci = 0; ci < cps.size(); ++ci) {
                    const CpComm cc = cps[ci];
                    if (!allowed(fx.cp_comm, cc)) continue;
                    if (!cp_runs[ci]) {  // (counted as the structural rules count: strata's own layout, no splits)
                      if (own_ok && allowed(fx.uneven_split, false))
                        reject("cp_comm",
                               zero_units(zeros) * (rc == Recompute::full && !fx.recompute_layers ? chunk_max : 1));
                      continue;
                    }
                    // The split balancing the ends for these layer costs (those of the plan
                    // without ZeRO, as balanced_end_split takes them), for every ZeRO stage.
                    std::optional<Plan> split;
                    if (splits) {
                      Plan q = probe_tpcv;
                      q.mbs = mbs; q.zero = 0; q.recompute = rc; q.sp = sp == 1; q.gpipe = gp == 1; q.cp_comm = cc;
                      const auto& lc = costs_of(q, compute_setup(m, cl, q));
                      split = balanced_end_split(m, q, layer_split_work(lc), split_work(lc[1]),
                                                 head_split_work(m, lc[2], lc[0], lc[3]));
                      if (split) {
                        std::tuple<int64_t, int64_t, std::string> key{split->first_stage_layers, split->last_stage_layers,
                                                                      split->layout ? split->layout->text : ""};
                        if (key != split_lay_for) {
                          split_lay = make_layout(m.L, *split);
                          split_max = *std::max_element(split_lay.layers.begin(), split_lay.layers.end());
                          split_lay_for = std::move(key);
                        }
                      }
                    }
                    auto run = [&](Plan& pl, const StageLayout& l, int64_t most) {
                      if (rc != Recompute::full) {
                        consider(pl, l);
                      } else if (fx.recompute_layers) {
                        pl.recompute_layers = *fx.recompute_layers;
                        consider(pl, l);
                      } else {
                        consider_partial(pl, l, most);
                      }
                    };
                    for (int zero : zeros) {
                      if (!allowed(fx.zero, zero)) continue;
                      for (double offload : offloads_for(zero))
                      for (const auto& [etp, ep] : eps) {
                        Plan pl = probe_tpcv;
                        pl.etp = etp;
                        pl.ep = ep;
                        pl.mbs = mbs; pl.zero = zero; pl.recompute = rc; pl.sp = sp == 1; pl.gpipe = gp == 1;
                        pl.cp_comm = cc;
                        pl.offload = offload;
                        if (fx.optimizer && zero == 1) pl.take_optimizer_of(*fx.optimizer);
                        if (zero >= 1 && (fx.dp_instances || fx.dp_shard_size)) hybrid_sharding(fx, &pl);
                        // One stack for every candidate: sharding alone does not make it modern here.
                        if (zero >= 2) pin_to_plain_stack(cl, stack, pl);
                        Plan q = pl;  // (before run() may set pl's recompute_num_layers)
                        if (own_ok && allowed(fx.uneven_split, false)) run(pl, lay, chunk_max);
                        if (split) {
                          q.first_stage_layers = split->first_stage_layers;
                          q.last_stage_layers = split->last_stage_layers;
                          q.layout = split->layout;
                          run(q, split_lay, split_max);
                        }
                      }
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  res.plans = std::move(top.items);
  res.pareto = std::move(front.pts);
  std::erase_if(res.rejected, [](const auto& kv) { return kv.second == 0; });
  res.search_time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

Json search_to_json(const SearchResult& r) {
  Json j;
  j["candidates_evaluated"] = r.candidates_evaluated;
  j["feasible"] = r.feasible;
  j["rejected"] = Json::object();
  for (const auto& [k, v] : r.rejected) j["rejected"][k] = v;
  j["search_time_s"] = r.search_time_s;
  j["simulated"] = r.simulated;
  j["plans"] = Json::array();
  for (const auto& e : r.plans) j["plans"].push_back(estimate_to_json(e));
  if (!r.pareto.empty()) {
    j["pareto"] = Json::array();
    for (const auto& e : r.pareto) j["pareto"].push_back(estimate_to_json(e));
  }
  return j;
}

}  // namespace strata
