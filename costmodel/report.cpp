// Readable breakdown and Chrome trace; see report.h.
#include "costmodel/report.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace strata {

std::string human_bytes(double b) {
  const double g = 1024.0 * 1024.0 * 1024.0;
  if (std::fabs(b) >= g) return fmt::format("{:.2f} GiB", b / g);
  if (std::fabs(b) >= 1024.0 * 1024.0) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024.0));
  if (std::fabs(b) >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{:.0f} B", b);
}

std::string human_seconds(double s) {
  if (s >= 1.0) return fmt::format("{:.3f} s", s);
  if (s >= 1e-3) return fmt::format("{:.3f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

std::string human_count(double n) {
  if (n >= 1e12) return fmt::format("{:.2f}T", n / 1e12);
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f}K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

std::string format_estimate(const ModelSpec& m, const Cluster& cl, const Estimate& e, const EstimateDetail* d,
                            double device_memory_bytes) {
  std::string o;
  const Plan& p = e.plan;
  o += fmt::format("model    {} ({} parameters: L={} H={} A={} G={} F={} V={} S={})\n", m.name,
                   human_count(m.total_params()), m.L, m.H, m.A, m.G, m.F, m.padded_vocab(p.t), m.S);
  if (m.moe())
    o += fmt::format("         {} experts of {} ({} per token{}): {} parameters active ({} without the input "
                     "embedding), {} experts per GPU\n",
                     m.E, m.Fe, m.K, m.Fs > 0 ? fmt::format(", shared expert {}", m.Fs) : std::string(),
                     human_count(m.active_params()), human_count(m.active_params_without_input_embedding()), m.E / p.ep);
  if (m.mixed())
    o += fmt::format("         MoE on {} of the {} layers, dense MLP of {} on the others (moe_layer_freq {})\n",
                     m.moe_layer_count(), m.L, m.F, moe_layer_freq_text(m.moe_layer));
  if (m.mtp_layers > 0)
    o += fmt::format("         {} multi-token prediction module{} ({} {} layer{}, {} parameters more) with the output layer\n",
                     m.mtp_layers, m.mtp_layers > 1 ? "s" : "", m.mtp_layers, m.mtp_moe() ? "MoE" : "dense",
                     m.mtp_layers > 1 ? "s" : "", human_count(static_cast<double>(m.mtp_params(1))));
  o += fmt::format("cluster  {} ({}, {} per node), {} GPUs\n", cl.name, cl.device.name, cl.devices_per_node,
                   p.world_size());
  o += fmt::format("plan     {}\n", plan_to_inline(p));
  if (!e.valid) {
    o += "invalid plan:\n";
    for (const auto& r : e.reasons) o += fmt::format("  - {}\n", r.message);
    return o;
  }
  const std::string groups = p.v > 1 && p.vp_group_size() != p.p
                                 ? fmt::format(" (in groups of {}: microbatch_group_size_per_vp_stage)", p.vp_group_size())
                                 : std::string();
  const std::string cp = p.c > 1 ? fmt::format(", cp_comm_type {}", to_string(e.cp_comm)) : std::string();
  o += fmt::format("         schedule {}, {} micro-batches per step{}, {} gradient accumulation steps, attention {}{}\n",
                   to_string(p.schedule()), e.microbatches, groups, p.gbs / (p.mbs * p.d), to_string(e.attention), cp);
  o += fmt::format("\nstep time {}   {:.0f} tokens/s   {:.1f} model TFLOP/s per GPU ({:.1f} hardware)   MFU {:.1f}%\n",
                   human_seconds(e.step_time_s), e.tokens_per_s, e.model_tflops_per_gpu, e.hardware_tflops_per_gpu,
                   100.0 * e.mfu);
  const std::string limit = device_memory_bytes > 0 && device_memory_bytes != cl.device.memory_bytes
                                ? fmt::format(" (--memory-limit; the device has {})", human_bytes(device_memory_bytes))
                                : std::string();
  const bool host_over = (p.offload > 0 || p.offload_modules) && e.host_memory_bytes > cl.host.memory_bytes;
  // A plan that fits at the edge of what it may use: the published runs' measured peaks are
  // predicted within a few percent (README, Accuracy: BLOOM's 17 within 4.6 %), not exactly.
  constexpr double kTightShare = 0.95;
  const double budget = cl.device.memory_bytes, device = device_memory_bytes > 0 ? device_memory_bytes : budget;
  const std::string tight =
      e.fits && e.memory.peak > kTightShare * budget
          ? fmt::format(", {:.1f} % to spare; measured peaks of published runs are predicted within about 5 %: "
                        "--memory-limit {:.0f}% keeps that margin",
                        100.0 * (1.0 - e.memory.peak / budget), std::floor(100.0 * kTightShare * budget / device))
          : std::string();
  o += fmt::format("memory    {} of {}{} on stage {}: {}{}\n", human_bytes(e.memory.peak),
                   human_bytes(cl.device.memory_bytes), limit, e.memory.stage,
                   e.fits ? "fits" : host_over && e.memory.peak <= cl.device.memory_bytes ? "DOES NOT FIT (host memory)"
                                                                                            : "DOES NOT FIT",
                   tight);
  if (p.offload > 0)
    o += fmt::format("host      {} of {} per node: {} of each rank's optimizer shard offloaded (fp32 master, Adam "
                     "moments, fp32 gradients)\n",
                     human_bytes(e.host_memory_bytes), human_bytes(cl.host.memory_bytes),
                     p.offload >= 1 ? std::string("all") : fmt::format("{:g}", p.offload));
  if (p.offload_modules) {
    const std::string share = fmt::format("activations of {} offloaded ({} per GPU{})",
                                          offload_modules_text(p.offload_modules, ", "),
                                          human_bytes(e.memory.host_activations),
                                          p.activation_offload_fraction < 1
                                              ? fmt::format(", {:g} of each chunk's layers", p.activation_offload_fraction)
                                              : std::string());
    if (p.offload > 0) o += fmt::format("          and {}, in that total\n", share);
    else o += fmt::format("host      {} of {} per node: {}\n", human_bytes(e.host_memory_bytes),
                          human_bytes(cl.host.memory_bytes), share);
  }
  const TimeBreakdown& t = e.time;
  o += fmt::format("\n{:<22}{:>12}{:>8}   (stage {} finishes last; exposed time only)\n", "time per step", "seconds", "%",
                   e.critical_stage);
  auto row = [&](const char* name, double v) {
    o += fmt::format("  {:<20}{:>12.4f}{:>7.1f}%\n", name, v, 100.0 * v / e.step_time_s);
  };
  for (const auto& [name, v] : time_terms(t))
    if (v > 0 || std::string(name) != "overhead") row(name, v);
  o += fmt::format("  {:<20}{:>12.4f}\n", "step", e.step_time_s);
  o += fmt::format("  communication before overlap: tp {}, dp {}\n", human_seconds(e.tp_comm_total_s),
                   human_seconds(e.dp_comm_total_s));
  if (e.processors_per_node > 0)
    o += fmt::format("  {:g} ranks per node share {:g} processors, {:.2f} busy on average: compute at {:.3f}x the "
                     "cluster's rates (measured with all {} busy)\n",
                     e.ranks_per_node, e.processors_per_node, e.busy_ranks, e.compute_speed, cl.devices_per_node);
  const MemoryBreakdown& mm = e.memory;
  o += fmt::format("\n{:<22}{:>12}   (stage {}: {} parameters per tensor-parallel shard{})\n", "memory per GPU", "",
                   mm.stage, human_count(mm.params), p.zero == 3 ? ", 1/d of them kept by ZeRO-3" : "");
  for (const auto& [name, v] : memory_terms(mm)) o += fmt::format("  {:<20}{:>12}\n", name, human_bytes(v));
  if (mm.at_optimizer_step)
    o += "  (at the optimizer step: its fp32 copy of the 16-bit gradients, among optimizer_states, outweighs the "
         "activations)\n";
  if (d && d->stage_memory.size() > 1) {
    o += "\nper stage               layers    peak memory    finishes at\n";
    for (size_t s = 0; s < d->stage_memory.size(); ++s) {
      o += fmt::format("  stage {:<14}{:>8}{:>15}{:>15}\n", s, d->layout.stage_layers(static_cast<int64_t>(s)),
                       human_bytes(d->stage_memory[s].peak), human_seconds(d->stage_finish_s[s]));
      if (d->stage_memory.size() > 12 && s == 4) {
        o += "  ...\n";
        s = d->stage_memory.size() - 4;
      }
    }
  }
  return o;
}

// The simulated timeline, in the form of strata train's trace (SPEC: one track per rank and
// stream): one process per rank, "rank r (stage s, predicted)", with threads compute / p2p /
// collectives / p2p recv; a stage's t x c x d ranks run alike, so each repeats its stage's
// slices (rank = tp + t (cp + c (dp + d pp)), executor/process_grid.h). Past 64 ranks, or
// where the repeats would pass kMaxRankSlices layer slices, one process per stage instead
// ("stage s (predicted, n ranks)"; otherData's tracks says which). Each forward and
// backward of a chunk is a slice (args microbatch, chunk, layers) holding one slice per
// layer (args microbatch, chunk, layer), and the embedding's and the output layer's, laid
// end to end from the cost model's per-layer times; a recomputed layer's backward holds its
// recompute first; a layer's exposed tensor-, context- and data-parallel collectives are
// slices on the collectives thread at its end, and every send has its matching recv on the
// receiving stage. Past about kMaxLayerSlices layer slices they are left out (otherData
// says so) and a backward holds one recompute slice.
void write_trace(std::ostream& out, const ModelSpec& m, const Estimate& e, const EstimateDetail& d) {
  constexpr int64_t kMaxLayerSlices = 2000000, kMaxRankTracks = 64, kMaxRankSlices = 500000;
  const double us = 1e6;
  const Plan& p = e.plan;
  bool first = true;
  auto emit = [&](const std::string& json) {
    out << (first ? "\n" : ",\n") << json;
    first = false;
  };
  int64_t layer_slices = 0;
  for (const SimEvent& x : d.sim.events) layer_slices += d.layout.chunk_layers(x.stage, x.chunk) * (x.forward ? 1 : 2);
  const bool per_layer = layer_slices <= kMaxLayerSlices;
  const int64_t alike = p.t * p.c * p.d;  // the ranks of a stage
  const bool per_rank = p.world_size() <= kMaxRankTracks && layer_slices * alike <= kMaxRankSlices;
  out << "{\"displayTimeUnit\": \"ms\", \"otherData\": "
      << Json{{"model", m.name}, {"plan", plan_to_inline(p)}, {"step_time_s", e.step_time_s},
              {"source", "strata estimate (simulated)"},
              {"tracks", per_rank ? "one process per rank"
                                  : fmt::format("one process per pipeline stage (its {} ranks run alike)", alike)},
              {"layer_slices", per_layer ? "yes" : fmt::format("left out ({} would exceed {})", layer_slices,
                                                                kMaxLayerSlices)}}.dump()
      << ", \"traceEvents\": [";
  auto tracks = [&](int64_t pid, const std::string& name) {
    emit(fmt::format(R"j({{"name": "process_name", "ph": "M", "pid": {}, "args": {{"name": "{}"}}}})j", pid, name));
    int tid = 0;
    for (const char* thread : {"compute", "p2p", "collectives", "p2p recv"})
      emit(fmt::format(R"j({{"name": "thread_name", "ph": "M", "pid": {}, "tid": {}, "args": {{"name": "{}"}}}})j", pid,
                       tid++, thread));
  };
  // A stage's events without their pid (`"name": ...}`): written as they come, one process
  // a stage, or kept a stage and written once for each of its ranks.
  std::vector<std::vector<std::string>> kept(per_rank ? static_cast<size_t>(p.p) : 0);
  auto event = [&](int64_t stage, const std::string& rest) {
    if (per_rank) kept[static_cast<size_t>(stage)].push_back(rest);
    else emit(fmt::format("{{\"pid\": {}, {}", stage, rest));
  };
  if (!per_rank)
    for (int64_t s = 0; s < p.p; ++s) tracks(s, fmt::format("stage {} (predicted, {} ranks)", s, alike));
  // First layer of each (stage, chunk), for the args.
  std::vector<int64_t> first_layer(static_cast<size_t>(p.p * d.layout.v), 0);
  int64_t next = 0;
  for (int64_t c = 0; c < d.layout.v; ++c)
    for (int64_t s = 0; s < p.p; ++s) {
      first_layer[static_cast<size_t>(c * p.p + s)] = next;
      next += d.layout.chunk_layers(s, c);
    }
  // Endpoints rounded to the nanosecond, the duration their difference: a child that ends
  // where its parent ends is drawn ending there.
  auto slice = [&](const char* name, int64_t stage, int tid, double start_s, double end_s, const std::string& args) {
    const double a = std::round(start_s * us * 1e3) / 1e3, b = std::round(end_s * us * 1e3) / 1e3;
    event(stage, fmt::format(R"j("name": "{}", "ph": "X", "tid": {}, "ts": {:.3f}, "dur": {:.3f}, "args": {}}})j", name,
                             tid, a, std::max(0.0, b - a), args));
  };
  // The exposed collectives of work w, on the collectives thread, ending at `end`.
  auto collectives = [&](const SimEvent& x, const Work& w, double end, const std::string& args) {
    double c0 = end - w.tp_comm_s - w.cp_comm_s - w.ep_comm_s - w.dp_comm_s - w.offload_s;
    for (const auto& [term, sec] : {std::pair{"tp_comm", w.tp_comm_s}, {"cp_comm", w.cp_comm_s}, {"ep_comm", w.ep_comm_s},
                                    {"dp_comm", w.dp_comm_s}, {"activation_offload", w.offload_s}})
      if (sec > 0) {
        slice(term, x.stage, 2, c0, c0 + sec, args);
        c0 += sec;
      }
  };
  // One layer (or the embedding, or the output layer) of work w from t0, no later than
  // `limit` (its chunk's end); with a recompute `rec`, that runs first, a slice inside it
  // (Megatron recomputes a layer just before its backward). Returns its end.
  auto piece = [&](const char* name, const SimEvent& x, int64_t layer, double t0, const Work& w, double limit,
                   const Work* rec = nullptr) {
    const std::string args = layer >= 0
        ? fmt::format(R"j({{"microbatch": {}, "chunk": {}, "layer": {}}})j", x.mb, x.chunk, layer)
        : fmt::format(R"j({{"microbatch": {}, "chunk": {}}})j", x.mb, x.chunk);
    const double r = rec ? rec->total() : 0.0, end = std::min(limit, t0 + r + w.total());
    slice(name, x.stage, 0, t0, end, args);
    if (rec) {
      slice("layer recompute", x.stage, 0, t0, std::min(end, t0 + r), args);
      collectives(x, *rec, std::min(end, t0 + r), args);
    }
    collectives(x, w, end, args);
    return end;
  };
  for (const SimEvent& x : d.sim.events) {
    const int64_t n = d.layout.chunk_layers(x.stage, x.chunk);
    const int64_t k = p.recompute == Recompute::full ? p.recomputed_layers(n) : n;  // layers running the plan
    const int64_t l0 = first_layer[static_cast<size_t>(x.chunk * p.p + x.stage)];
    const bool emb = d.layout.has_embedding(x.stage, x.chunk), head = d.layout.has_head(x.stage, x.chunk);
    const std::string args =
        n == 0 ? fmt::format(R"j({{"microbatch": {}, "chunk": {}, "layers": "none"}})j", x.mb, x.chunk)
               : fmt::format(R"j({{"microbatch": {}, "chunk": {}, "layers": "{}-{}"}})j", x.mb, x.chunk, l0, l0 + n - 1);
    const bool recompute = d.layer.recompute.total() > 0 || d.dense_layer.recompute.total() > 0;
    // A mixed model's layer l is costed as its kind.
    auto moe_layer = [&](int64_t l) { return m.moe_layer.empty() || m.moe_layer[static_cast<size_t>(l)] != 0; };
    // The backward holds its recompute.
    slice(x.forward ? "forward" : "backward", x.stage, 0, x.start_s, x.end_s, args);
    double t = x.start_s;
    if (per_layer) {
      // The first k layers of a chunk run the plan (and its recompute), the others the plan
      // without recompute.
      auto cost = [&](int64_t i) -> const LayerCost& {
        if (moe_layer(l0 + i)) return i < k ? d.layer : d.plain_layer;
        return i < k ? d.dense_layer : d.dense_plain_layer;
      };
      auto layer = [&](int64_t i) -> const Work& { return x.forward ? cost(i).forward : cost(i).backward; };
      if (x.forward) {
        if (emb) t = piece("embedding forward", x, -1, t, d.embedding.forward, x.end_s);
        for (int64_t i = 0; i < n; ++i) t = piece("layer forward", x, l0 + i, t, layer(i), x.end_s);
        // (multi-token prediction's layers, whose other work is the output layer's)
        if (head)
          for (int64_t k = 0; k < m.mtp_layers; ++k) t = piece("mtp layer forward", x, -1, t, d.mtp_layer.forward, x.end_s);
        if (head) t = piece("output layer forward", x, -1, t, d.head.forward, x.end_s);
      } else {
        if (head)
          t = piece("output layer backward", x, -1, t, d.head.backward, x.end_s,
                    d.head.recompute.total() > 0 ? &d.head.recompute : nullptr);
        if (head)
          for (int64_t k = 0; k < m.mtp_layers; ++k)
            t = piece("mtp layer backward", x, -1, t, d.mtp_layer.backward, x.end_s,
                      d.mtp_layer.recompute.total() > 0 ? &d.mtp_layer.recompute : nullptr);
        for (int64_t i = n; i-- > 0;)
          t = piece("layer backward", x, l0 + i, t, layer(i), x.end_s, recompute && i < k ? &cost(i).recompute : nullptr);
        if (emb) t = piece("embedding backward", x, -1, t, d.embedding.backward, x.end_s);
      }
    } else if (!x.forward && recompute) {
      const int64_t kd = d.layout.chunk_dense_recomputed(x.stage, x.chunk);  // (a mixed model's dense layers)
      slice("recompute", x.stage, 0, t,
            std::min(x.end_s, t + d.layer.recompute.total() * static_cast<double>(k - kd) +
                                  d.dense_layer.recompute.total() * static_cast<double>(kd)),
            args);
    }
    if (x.send_end_s > x.end_s) {
      slice(x.forward ? "send activations" : "send gradients", x.stage, 1, x.end_s, x.send_end_s, args);
      // The receiving stage: the next (forward) or the previous (backward), round the ring
      // between chunks of the interleaved schedule; on its own thread, since that stage's
      // sends overlap it.
      const int64_t to = x.forward ? (x.stage + 1) % p.p : (x.stage + p.p - 1) % p.p;
      const int64_t chunk = x.chunk + (x.forward && x.stage == p.p - 1 ? 1 : !x.forward && x.stage == 0 ? -1 : 0);
      slice(x.forward ? "recv activations" : "recv gradients", to, 3, x.end_s, x.send_end_s,
            fmt::format(R"j({{"microbatch": {}, "chunk": {}}})j", x.mb, chunk));
    }
  }
  for (int64_t s = 0; s < p.p; ++s) {
    const size_t i = static_cast<size_t>(s);
    double t0 = d.sim.end_s[i];
    if (d.stage_dp_exposed_s[i] > 0) {
      slice("dp_comm (exposed)", s, 0, t0, t0 + d.stage_dp_exposed_s[i],
            fmt::format(R"j({{"total_s": {}}})j", d.stage_dp_total_s[i]));
      t0 += d.stage_dp_exposed_s[i];
    }
    slice("optimizer", s, 0, t0, t0 + d.stage_optimizer_s[i], "{}");
  }
  if (per_rank)
    for (int64_t r = 0; r < p.world_size(); ++r) {
      const int64_t s = r / alike;
      tracks(r, fmt::format("rank {} (stage {}, predicted)", r, s));
      for (const std::string& rest : kept[static_cast<size_t>(s)]) emit(fmt::format("{{\"pid\": {}, {}", r, rest));
    }
  out << "\n]}\n";
}

namespace {
std::string format_ops(const std::vector<OpCost>& ops, const char* which) {
  std::string o = fmt::format("\none {}, one micro-batch, one GPU:\n  {:<10}{:<23}{:<9}{:>12}{:>12}{:>11}{:>11}{:>9}\n",
                              which, "phase", "op", "kind", "GFLOP", "MB", "time_ms", "exposed", "TFLOP/s");
  double tot[3] = {0, 0, 0};
  for (const OpCost& op : ops) {
    o += fmt::format("  {:<10}{:<23}{:<9}{:>12.2f}{:>12.2f}{:>11.4f}{:>11.4f}{:>9.1f}\n", to_string(op.phase), op.name,
                     to_string(op.kind), op.flops / 1e9, op.bytes / 1e6, op.time_s * 1e3, op.exposed_s * 1e3,
                     op.flops > 0 ? op.flops / op.time_s / 1e12 : 0.0);
    tot[static_cast<int>(op.phase)] += op.exposed_s;
  }
  o += fmt::format("  exposed total: forward {:.4f} ms, backward {:.4f} ms, recompute {:.4f} ms\n", tot[0] * 1e3,
                   tot[1] * 1e3, tot[2] * 1e3);
  return o;
}
}  // namespace

std::string format_layer_ops(const EstimateDetail& d) {
  if (d.dense_layer_ops.empty()) return format_ops(d.layer_ops, "layer");
  return format_ops(d.layer_ops, "MoE layer") + format_ops(d.dense_layer_ops, "dense layer");
}

void write_text_file(const std::string& path, const std::string& text, const std::string& what) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw InputError(fmt::format("{}: cannot write file '{}'", what, path));
  out << text;
  out.close();
  if (!out) throw InputError(fmt::format("{}: writing '{}' failed", what, path));
}

}  // namespace strata
