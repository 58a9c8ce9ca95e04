// The planner's search; see search.h.
#include "planner/search.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <tuple>

#include <fmt/format.h>

namespace strata {

FixedDims parse_fixed(const std::string& text) {
  const Json j = parse_inline_pairs(text, "--fix");
  FixedDims f;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string k = it.key();
    const Json& v = it.value();
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
    else if (k == "sp" || k == "sequence_parallel") {
      if (v.is_boolean()) f.sp = v.get<bool>();
      else f.sp = integer(0, 1) == 1;
    } else if (k == "recompute") {
      const std::string s = v.is_string() ? v.get<std::string>() : "";
      if (s == "none") f.recompute = Recompute::none;
      else if (s == "selective") f.recompute = Recompute::selective;
      else if (s == "full") f.recompute = Recompute::full;
      else fail_field("--fix recompute", show_value(v), "must be one of none, selective, full");
    } else if (k == "schedule" || k == "pipeline_schedule") {
      const std::string s = v.is_string() ? v.get<std::string>() : "";
      if (s == "gpipe") f.gpipe = true;
      else if (s == "1f1b" || s == "interleaved") f.gpipe = false;
      else fail_field("--fix schedule", show_value(v), "must be one of 1f1b, gpipe, interleaved");
    } else {
      fail_field("--fix " + k, show_value(v),
                 "unknown key: use tp, pp, dp, cp, vp, mbs, zero, recompute, recompute_num_layers, sp or schedule");
    }
  }
  return f;
}

namespace {

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

SearchResult search(const ModelSpec& m, const Cluster& cl, const SearchOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  SearchResult res;
  TopK top{static_cast<size_t>(std::max(1, opt.top_k)), {}};
  Frontier front;
  const FixedDims& fx = opt.fixed;
  const int64_t N = opt.gpus;

  // One attention kernel for every candidate, so plans compare like for like: context
  // parallelism turns "auto" into FlashAttention (it needs a fused kernel), so on a stack
  // whose "auto" is unfused, context-parallel candidates keep the unfused kernel of the
  // others and are rejected (cp_attention); --attention flash searches them all with flash.
  Plan probe;
  probe.precision = opt.precision;
  probe.attention = opt.attention;
  const Stack stack = resolve_stack(m, cl, probe);

  // Layer costs depend on (t, c, d for ZeRO-3, mbs, sp, recompute, ZeRO-3): cached.
  using CostKey = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, int, bool>;
  std::map<CostKey, std::array<LayerCost, 3>> costs;
  auto costs_of = [&](const Plan& pl, const ComputeSetup& cs) -> const std::array<LayerCost, 3>& {
    const CostKey key{pl.t, pl.c, pl.zero == 3 ? pl.d : 0, pl.mbs, pl.sp, static_cast<int>(pl.recompute), pl.zero == 3};
    auto it = costs.find(key);
    if (it == costs.end())
      it = costs.emplace(key, std::array<LayerCost, 3>{layer_cost(m, cl, pl, cs), embedding_cost(m, cl, pl, cs),
                                                       head_cost(m, cl, pl, cs)}).first;
    return it->second;
  };
  std::map<std::tuple<int, int64_t, int64_t, int64_t>, InFlight> flights;
  auto reject = [&](const std::string& key) {
    res.rejected[key] += 1;
    res.candidates_evaluated += 1;
  };

  // One candidate: rejected with its reason, out of memory, bounded out of the top K (and
  // the frontier), or estimated.
  auto consider = [&](const Plan& pl, const StageLayout& lay) {
    const std::vector<Reason> why = check_plan(m, cl, pl, false);
    if (!why.empty()) return reject(why.front().key);
    ++res.candidates_evaluated;
    const ComputeSetup cs = compute_setup(m, cl, pl);
    const int64_t mb_count = pl.microbatches();
    const ScheduleKind kind = pl.schedule();
    const auto fkey = std::make_tuple(static_cast<int>(kind), pl.p, pl.v,
                                      kind == ScheduleKind::gpipe ? mb_count : std::min(mb_count, 4 * pl.p + 4));
    auto fit = flights.find(fkey);
    if (fit == flights.end()) fit = flights.emplace(fkey, in_flight(kind, pl.p, pl.v, mb_count)).first;
    std::vector<MemoryBreakdown> mem;
    const size_t worst = stages_memory(m, cl, pl, lay, cs, fit->second, &mem);
    if (mem[worst].peak > cl.device.memory_bytes) {
      res.rejected["out_of_memory"] += 1;
      return;
    }
    ++res.feasible;
    const auto& lc = costs_of(pl, cs);
    const LayerCost* plain = &lc[0];
    if (pl.recompute == Recompute::full && pl.recompute_layers > 0) {
      Plan q = pl;
      q.recompute = Recompute::none;
      q.recompute_layers = 0;
      plain = &costs_of(q, cs)[0];
    }
    // Lower bound: the busiest stage's work with no bubble and no tail.
    double lb = 0;
    for (int64_t s = 0; s < pl.p; ++s) {
      double w = 0;
      for (int64_t c = 0; c < lay.v; ++c) {
        const int64_t n = lay.chunk_layers(s, c);
        const int64_t k = pl.recompute == Recompute::full ? pl.recomputed_layers(n) : n;
        w += static_cast<double>(n) * lc[0].forward.total() +
             static_cast<double>(k) * (lc[0].backward.total() + lc[0].recompute.total()) +
             static_cast<double>(n - k) * plain->backward.total();
      }
      if (s == 0) w += lc[1].forward.total() + lc[1].backward.total();
      if (s == pl.p - 1) w += lc[2].forward.total() + lc[2].backward.total();
      lb = std::max(lb, w);
    }
    lb *= static_cast<double>(mb_count);
    const bool need_top = lb < top.bound();
    const bool need_front = opt.pareto && !front.dominated(mem[worst].peak, lb);
    if (!need_top && !need_front) return;
    EstimateOptions eo;
    eo.pre = Precomputed{&lc[0], plain, &lc[1], &lc[2], &fit->second};
    Estimate e = estimate(m, cl, pl, eo);
    ++res.simulated;
    if (opt.pareto) front.add(e);
    top.add(std::move(e));
  };

  const Recompute recomputes[] = {Recompute::none, Recompute::selective, Recompute::full};
  for (int64_t t : divisors(N)) {
    if (!allowed(fx.t, t)) continue;
    for (int64_t p : divisors(N / t)) {
      if (!allowed(fx.p, p)) continue;
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
        for (int64_t v : vs) {
          if (!allowed(fx.v, v)) continue;
          if (mbss.empty()) {
            reject("batch_divisible");
            continue;
          }
          // Uneven pipelines are searched only in the (L+2)/p embedding-slot form.
          if (v == 1 && p > 1 && m.L % p != 0 && (m.L + 2) % p != 0) {
            reject("layers_pp");
            continue;
          }
          const StageLayout lay = make_layout(m.L, p, v);
          const int64_t chunk_max = *std::max_element(lay.layers.begin(), lay.layers.end());
          for (int64_t mbs : mbss) {
            if (!allowed(fx.mbs, mbs)) continue;
            for (int gp = 0; gp < (v > 1 ? 1 : 2); ++gp) {
              if (!allowed(fx.gpipe, gp == 1)) continue;
              for (int sp = 0; sp < (t > 1 ? 2 : 1); ++sp) {
                if (!allowed(fx.sp, sp == 1)) continue;
                for (Recompute rc : recomputes) {
                  if (!allowed(fx.recompute, rc)) continue;
                  // Full recompute of every layer of a chunk (0), or of the first k (block).
                  const int64_t partial = rc == Recompute::full ? chunk_max - 1 : 0;
                  for (int64_t rl = 0; rl <= partial; ++rl) {
                    if (!allowed(fx.recompute_layers, rl)) continue;
                    for (int zero = 0; zero <= (d * c > 1 ? 3 : 0); ++zero) {
                      if (!allowed(fx.zero, zero)) continue;
                      Plan pl;
                      pl.t = t; pl.p = p; pl.d = d; pl.c = c; pl.v = v; pl.mbs = mbs; pl.gbs = opt.gbs;
                      pl.zero = zero; pl.recompute = rc; pl.recompute_layers = rl; pl.sp = sp == 1;
                      pl.precision = opt.precision; pl.gpipe = gp == 1;
                      pl.attention = opt.attention;
                      if (c > 1 && opt.attention == AttentionChoice::automatic &&
                          stack.attention == AttentionKernel::unfused)
                        pl.attention = AttentionChoice::unfused;
                      consider(pl, lay);
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
