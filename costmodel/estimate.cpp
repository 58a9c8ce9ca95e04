// The estimate; see estimate.h.
#include "costmodel/estimate.h"

#include <algorithm>
#include <cmath>
#include <string_view>

#include <nlohmann/json.hpp>

#include "costmodel/comm.h"
#include "costmodel/schedule.h"

namespace strata {

namespace {

// Chunk-forwards in the interleaved schedule's forward order with groups of g (Megatron-
// core's table: full groups of g, then a last group of r, schedule.h), counted as the
// order advances: f0 of chunk 0 and fl of chunk v - 1 among the first k forwards.
struct ChunkCounter {
  int64_t g, v, r, head;  // head: forwards of the full groups
  int64_t k = 0, f0 = 0, fl = 0;
  int64_t pos = 0;  // k's place in its group's round (gv steps; rv in the last group)
  ChunkCounter(int64_t g_, int64_t v_, int64_t m, int64_t k0) : g(g_), v(v_) {
    const Groups gr = groups_of(m, g, v);
    r = gr.last;
    head = gr.head;
    // The counts at k0 in closed form, then step by step.
    const int64_t kh = std::min(k0, head), rounds = kh / (g * v), in = kh % (g * v);
    f0 = rounds * g + std::min(in, g);
    fl = rounds * g + std::max<int64_t>(0, in - (v - 1) * g);
    if (k0 > head) {
      const int64_t t = k0 - head;
      f0 += std::min(t, r);
      fl += std::max<int64_t>(0, t - (v - 1) * r);
    }
    k = k0;
    pos = k0 < head ? in : k0 - head;
  }
  void next() {
    const bool last_group = k >= head;
    const int64_t n = last_group ? r : g, round = n * v;
    if (pos < n) ++f0;
    if (pos >= (v - 1) * n) ++fl;
    ++k;
    ++pos;
    if (!last_group && pos == round) pos = 0;
    if (k == head) pos = 0;
  }
};

// in_flight() of the interleaved schedule with groups of g != p, without its lists. Stage
// s runs w = warmup(s) forwards, then J = total - w pairs (forward w + i, backward i),
// then backwards only, which lower every count. Backward i runs the chunk v - 1 - c of
// forward i's c, so after pair i's forward the first chunk holds F0(w + i + 1) - FL(i) and
// the last FL(w + i + 1) - F0(i) (F0, FL: chunk-0 and chunk-(v-1) forwards among the first
// k, ChunkCounter). While both arguments stay in the full groups the counts repeat every
// round of gv pairs (each adds g to both), so the first round and the pairs from one
// before the last group on give every value. memory_test compares the result with
// peak_in_flight() of make_schedule().
void grouped_in_flight(int64_t p, int64_t v, int64_t m, int64_t g, InFlight* out) {
  const ScheduleShape sh{ScheduleKind::interleaved, p, v, m, g};
  const int64_t total = m * v, gv = g * v, head = groups_of(m, g, v).head;
  for (auto* x : {&out->all, &out->first, &out->last}) x->resize(static_cast<size_t>(p));
  for (int64_t s = 0; s < p; ++s) {
    const size_t i_s = static_cast<size_t>(s);
    const int64_t w = sh.warmup(s), J = total - w;
    const ChunkCounter at_w(g, v, m, w);
    int64_t first = at_w.f0, last = at_w.fl;
    auto scan = [&](int64_t from, int64_t to) {  // pairs [from, to)
      if (from >= to) return;
      ChunkCounter fwd(g, v, m, w + from + 1), bwd(g, v, m, from);
      for (int64_t i = from; i < to; ++i) {
        first = std::max(first, fwd.f0 - bwd.fl);
        last = std::max(last, fwd.fl - bwd.f0);
        fwd.next();
        bwd.next();
      }
    };
    const int64_t tail = std::max(std::min(J, gv), head - w - 1);
    scan(0, std::min(J, gv));
    scan(tail, J);
    out->all[i_s] = w + (J > 0 ? 1 : 0);
    out->first[i_s] = first;
    out->last[i_s] = last;
  }
}

}  // namespace

InFlight in_flight(ScheduleKind kind, int64_t p, int64_t v, int64_t m, int64_t g) {
  InFlight f;
  in_flight_into(kind, p, v, m, &f, g);
  return f;
}

void in_flight_into(ScheduleKind kind, int64_t p, int64_t v, int64_t m, InFlight* out, int64_t g) {
  InFlight& f = *out;
  if (kind != ScheduleKind::interleaved) {
    // GPipe keeps all m; 1F1B's warm-up leaves min(p - s, m) on stage s (schedule.h).
    // memory_test checks both against the stored schedule.
    f.all.resize(static_cast<size_t>(p));
    for (int64_t s = 0; s < p; ++s)
      f.all[static_cast<size_t>(s)] = kind == ScheduleKind::gpipe ? m : std::min(p - s, m);
    f.first = f.all;
    f.last = f.all;
    return;
  }
  if (g > 0 && g != p) {
    grouped_in_flight(p, v, m, g, out);
    return;
  }
  // peak_in_flight() of make_schedule(kind, p, v, m) in closed form; memory_test compares
  // the two. Stage s runs w = warmup(s) forwards, then J forward/backward pairs before the
  // cool-down, which only lowers the counts; pairs past a round of n = pv repeat the first
  // round's counts (n pairs run p forwards and p backwards of every chunk), so J = min(total
  // - w, n). Forward k runs chunk (k mod n) / p, backward j chunk v - 1 - (j mod n) / p.
  //   all:   w, plus 1 at the first pair's forward.
  //   first: F(k) chunk-0 forwards among the first k; no chunk-0 backward runs before
  //          backward (v-1)p, and from there each pair adds at most one forward and removes
  //          one backward: the peak is F(w + min(J, (v-1)p + 1)).
  //   last:  L(k) chunk-(v-1) forwards among the first k; backwards 0..p-1 are all chunk
  //          v-1, so the first p pairs cannot raise the count past the first pair's
  //          forward, and the J - 1 < n forwards after it hold at most p of chunk v-1 (one
  //          block of p per round) against the p backwards: the peak is L(w + 1).
  const int64_t n = p * v, total = m * v;
  auto F = [&](int64_t k) { return (k / n) * p + std::min(k % n, p); };
  auto L = [&](int64_t k) { return (k / n) * p + std::max<int64_t>(0, k % n - (v - 1) * p); };
  const ScheduleShape sh{kind, p, v, m};
  for (auto* x : {&f.all, &f.first, &f.last}) x->resize(static_cast<size_t>(p));
  for (int64_t s = 0; s < p; ++s) {
    const size_t i = static_cast<size_t>(s);
    const int64_t w = sh.warmup(s), J = std::min(total - w, n);
    const int64_t pair = J > 0 ? 1 : 0;
    f.all[i] = w + pair;
    f.first[i] = F(w + (J > 0 ? std::min(J, (v - 1) * p + 1) : 0));
    f.last[i] = L(w + pair);
  }
}

size_t stages_memory(const ModelSpec& m, const Cluster& cl, const Plan& p, const StageLayout& lay,
                     const ComputeSetup& cs, const InFlight& fl, std::vector<MemoryBreakdown>* out) {
  stage_memories(m, cl, p, lay, cs, fl.all.data(), fl.first.data(), fl.last.data(), out);
  size_t worst = 0;
  for (size_t i = 1; i < out->size(); ++i)
    if ((*out)[i].peak > (*out)[worst].peak) worst = i;
  return worst;
}

double p2p_time(const ModelSpec& m, const Cluster& cl, const Plan& p, const ComputeSetup& cs) {
  if (p.p <= 1) return 0;
  const double bytes = cs.work_bytes * cs.T * static_cast<double>(m.H);
  const GroupSpan pp = group_span(p.p, p.t * p.c * p.d, cl.devices_per_node);
  if (pp.per_node > 1) {  // neighbours share a node
    const GroupSpan pair{2, 2, 1};
    return collective_time(cl, pair, Collective::send_recv, p.sp ? bytes / static_cast<double>(p.t) : bytes);
  }
  // Across nodes: every GPU of the node sends at once, so each gets its NIC share.
  const GroupSpan pair{2, 1, 2};
  const double shard = bytes / static_cast<double>(p.t);
  double t = collective_time(cl, pair, Collective::send_recv, shard);
  if (!p.sp && p.t > 1) t += collective_time(cl, group_span(p.t, 1, cl.devices_per_node), Collective::all_gather, bytes);
  return t;
}

double model_flops_per_step(const ModelSpec& m, const Plan& p) { return 3.0 * m.forward_flops(p.gbs); }

namespace {

// hardware_flops_per_step() with the plan's layout made already.
double hardware_flops(const ModelSpec& m, const Plan& p, const StageLayout& lay) {
  double f = model_flops_per_step(m, p);
  // (With multi-token prediction its layers, too, run the recompute modules, and with full
  // recompute of every layer the layers' forwards again.)
  const double L = static_cast<double>(m.L + m.mtp_layers);
  if (p.recompute == Recompute::full) {
    if (p.recompute_layers == 0) {
      f += static_cast<double>(m.L) * m.layer_forward_flops(p.gbs);  // every layer
      f += static_cast<double>(m.mtp_layers) * (m.layer_forward_flops(p.gbs, m.mtp_moe()) +
                                                2.0 * static_cast<double>(p.gbs) * static_cast<double>(m.S) * 2.0 *
                                                    static_cast<double>(m.H) * static_cast<double>(m.H));  // and eh_proj
    } else if (!m.mixed()) {  // recompute_num_layers caps each chunk's
      double recomputed = 0;
      for (int64_t s = 0; s < p.p; ++s)
        for (int64_t c = 0; c < lay.v; ++c) recomputed += static_cast<double>(p.recomputed_layers(lay.chunk_layers(s, c)));
      f += recomputed * m.layer_forward_flops(p.gbs);
    } else {  // the dense and MoE layers among them
      double dense = 0, moe = 0;
      for (int64_t s = 0; s < p.p; ++s)
        for (int64_t c = 0; c < lay.v; ++c) {
          const int64_t k = p.recomputed_layers(lay.chunk_layers(s, c)), kd = lay.chunk_dense_recomputed(s, c);
          dense += static_cast<double>(kd);
          moe += static_cast<double>(k - kd);
        }
      f += dense * m.layer_forward_flops(p.gbs, false) + moe * m.layer_forward_flops(p.gbs, true);
    }
  }
  // recompute_modules mla_up_proj: the up projections again on every layer; mlp: a dense
  // layer's MLP again.
  const double tokens = static_cast<double>(p.gbs) * static_cast<double>(m.S), H = static_cast<double>(m.H);
  if (m.mla() && p.recomputes(kRecomputeMlaUpProj)) {
    const double q_in = m.q_lora_rank > 0 ? static_cast<double>(m.q_lora_rank) : H;
    f += L * 2.0 * tokens *
         (q_in * static_cast<double>(m.AD()) +
          static_cast<double>(m.kv_lora_rank) * static_cast<double>(m.A) * static_cast<double>(m.qk_head_dim() + m.Dv()));
  }
  if (p.recomputes(kRecomputeMlp) && (!m.moe() || m.mixed()))
    f += static_cast<double>(m.L - m.moe_layer_count() + (m.mtp_moe() ? 0 : m.mtp_layers)) * 2.0 * tokens * H *
         static_cast<double>(m.fc1_out() + m.F);
  // torchtitan's op policy: k, the output projection and (gated) the up projection again.
  if (p.op_sac())
    f += L * 2.0 * tokens * H *
         (static_cast<double>(m.G * m.D()) + static_cast<double>(m.AD()) + (m.gated() ? static_cast<double>(m.F) : 0.0));
  if (p.recomputes(kRecomputeCoreAttn))  // (multi-latent attention: QK^T over D, AV over Dv)
    f += m.mla() ? L * 2.0 * static_cast<double>(p.gbs) * static_cast<double>(m.S) * m.attention_keys() *
                       static_cast<double>(m.AD() + m.VD())
                 : L * 4.0 * static_cast<double>(p.gbs) * static_cast<double>(m.S) * m.attention_keys() *
                       static_cast<double>(m.AD());
  return f;
}

}  // namespace

double hardware_flops_per_step(const ModelSpec& m, const Plan& p) {
  return hardware_flops(m, p, make_layout(m, p));
}

namespace {

// What data parallelism adds after a stage's last backward: the gradient reduction
// (all-reduce, or with ZeRO-1 a reduce-scatter; ZeRO-2 reduce-scatters every micro-batch
// inside the backward, sharded_traffic in compute.cpp), with ZeRO-1/2 the parameter
// all-gather after the optimizer, and between the first and last stage the tied-embedding
// all-reduce (or that of multi-token prediction's copy of the embedding). When the
// stack overlaps them, the reduction runs bucket by bucket beside the last micro-batch's
// backward (its last bucket always exposed) and the gather beside the next forward.
struct DpTail {
  double exposed_s = 0, total_s = 0;
};

// expert_params: the routed experts' share of params, reduced over their own replicas (the
// expert data-parallel group, d / ep ranks tp * ep apart) after the dense parameters'.
// layers: the stage's (multi-latent attention's duplicated down projections, whose
// gradients the tensor-parallel ranks sum at the end of the step under sequence parallelism).
DpTail data_parallel_tail(const ModelSpec& m, const Cluster& cl, const Plan& p, const ComputeSetup& cs, int64_t stage,
                          double params, double expert_params, double last_backward_s, double first_forward_s,
                          int64_t layers) {
  // Megatron-core's default bucket: max(40M, 1M x the data-parallel size) parameters
  // (DistributedDataParallel: larger groups get larger buckets, so that each rank's chunk of
  // a ring stays bandwidth-bound).
  const double bucket_params = std::max(40e6, 1e6 * static_cast<double>(p.d));
  const int64_t N = cl.devices_per_node, I = p.dp_instances;
  // The shard group (one instance's replicas, every replica without hybrid sharding) and the
  // instances holding alike shards, whose shards' gradients are all-reduced after the
  // reduce-scatter (Megatron-core's partial distributed optimizer).
  const GroupSpan dp = group_span(p.shard_ranks(), p.t, N), dp_across = group_span(I, p.t * p.shard_ranks(), N);
  double reduce = 0, gather = 0;
  // (A shard group of one rank still all-reduces between the instances: with ZeRO-1 an
  // expert replica per instance is a plain data-parallel replica.)
  auto over = [&](const GroupSpan& g, const GroupSpan& across, double n) {
    if (g.size <= 1 && across.size <= 1) return;
    if (p.zero == 0) reduce += collective_time(cl, g, Collective::all_reduce, cs.grad_bytes * n);
    if (p.zero == 1) {
      reduce += collective_time(cl, g, Collective::reduce_scatter, cs.grad_bytes * n);
      if (across.size > 1)
        reduce += collective_time(cl, across, Collective::all_reduce, cs.grad_bytes * n / static_cast<double>(g.size));
    }
    if (p.zero == 1 || p.zero == 2) gather += collective_time(cl, g, Collective::all_gather, cs.weight_work_bytes * n);
  };
  over(dp, dp_across, params - expert_params);
  if (expert_params > 0) {
    const int64_t es = p.expert_shard_ranks(), stride = p.expert_tp() * p.ep;
    over(group_span(es, stride, N), group_span(I, stride * es, N), expert_params);
  }
  double exposed = reduce;
  if (cs.stack.overlap_grad_reduce) {
    const double last_bucket = reduce * std::min(1.0, bucket_params / std::max(params, 1.0));
    exposed = std::max(reduce - last_backward_s, last_bucket);
    exposed += cl.overlap_slowdown * (reduce - exposed);
  }
  if (cs.stack.overlap_param_gather) {
    const double hidden = std::min(gather, first_forward_s);
    exposed += gather - hidden + cl.overlap_slowdown * hidden;
  } else {
    exposed += gather;
  }
  // Multi-latent attention with sequence parallelism: each rank's down projections saw its
  // own tokens, so their weight gradients are all-reduced over the tensor-parallel group
  // (Megatron-core's finalize_model_grads, after the backward: exposed).
  if (m.mla() && p.sp && p.t > 1 && layers > 0) {
    const double H = static_cast<double>(m.H), ql = static_cast<double>(m.q_lora_rank);
    const double kvl = static_cast<double>(m.kv_lora_rank), rope = static_cast<double>(m.qk_pos_emb_head_dim);
    const double duplicated = static_cast<double>(layers) * (H * (ql + kvl + rope) + ql + kvl);
    const double t_dup = collective_time(cl, group_span(p.t, 1, cl.devices_per_node), Collective::all_reduce,
                                         cs.grad_bytes * duplicated);
    exposed += t_dup;
    reduce += t_dup;
  }
  // (Multi-token prediction's copy of the word embedding on the last stage too.)
  if ((m.tie_embeddings || m.mtp_layers > 0) && p.p > 1 && (stage == 0 || stage == p.p - 1)) {
    const GroupSpan pair = group_span(2, p.t * p.c * p.d * (p.p - 1), cl.devices_per_node);
    const double t_emb = collective_time(cl, pair, Collective::all_reduce,
                                         cs.grad_bytes * static_cast<double>(m.word_embedding_params(p.t)));
    exposed += t_emb;
    reduce += t_emb;
  }
  return DpTail{exposed, reduce + gather};
}

}  // namespace

namespace {

// The estimate at the cluster's rates; busy_share (when asked): the stages' mean busy share
// of the step (its compute, sends, exposed reduction and optimizer over the step time).
Estimate estimate_once(const ModelSpec& m, const Cluster& cl, const Plan& p, const EstimateOptions& opt,
                       EstimateDetail* detail, double* busy_share) {
  Estimate est;
  est.plan = p;
  est.reasons = check_plan(m, cl, p);
  if (!est.reasons.empty()) return est;
  est.valid = true;

  const ComputeSetup cs = compute_setup(m, cl, p);
  est.attention = cs.attention;
  est.cp_comm = cs.cp_comm;
  est.stack = cs.stack;
  thread_local StageLayout lay;  // per-thread scratch (see st below)
  make_layout_into(m, p, &lay);
  const ScheduleKind kind = p.schedule();
  const int64_t mbs_per_step = p.microbatches();
  est.microbatches = mbs_per_step;

  std::vector<OpCost> layer_ops;
  const LayerCost layer = opt.pre.layer && !opt.want_ops ? *opt.pre.layer
                                                         : layer_cost(m, cl, p, cs, opt.want_ops ? &layer_ops : nullptr);
  // With partial recompute (recompute_num_layers), the other layers keep everything: their
  // backward is that of a plan without recompute.
  LayerCost plain = layer;
  if (p.recompute == Recompute::full && p.recompute_layers > 0)
    plain = opt.pre.plain_layer ? *opt.pre.plain_layer : layer_cost(m, cl, p.without_recompute(), cs);
  std::vector<OpCost> embedding_ops, head_ops;
  const bool end_ops = opt.want_ops && detail;
  const LayerCost emb = opt.pre.embedding && !end_ops ? *opt.pre.embedding
                                                      : embedding_cost(m, cl, p, cs, end_ops ? &embedding_ops : nullptr);
  const LayerCost head = opt.pre.head && !end_ops ? *opt.pre.head : head_cost(m, cl, p, cs, end_ops ? &head_ops : nullptr);
  // A model that mixes dense and MoE layers: its dense layers' costs too (those above are
  // its MoE layers').
  LayerCost dense, dense_plain;
  if (m.mixed()) {
    if (opt.pre.dense_layer && !opt.want_ops) {
      dense = *opt.pre.dense_layer;
      dense_plain = *opt.pre.dense_plain_layer;
    } else {
      const ModelSpec dm = m.dense_layers();
      dense = layer_cost(dm, cl, p, cs, opt.want_ops && detail ? &detail->dense_layer_ops : nullptr);
      dense_plain = p.recompute == Recompute::full && p.recompute_layers > 0 ? layer_cost(dm, cl, p.without_recompute(), cs)
                                                                              : dense;
    }
  }

  // Multi-token prediction (ModelSpec::mtp_layers): each module's transformer layer, of the
  // last decoder layer's kind, runs with the output layer (whose cost holds the modules'
  // other work); recomputed with every layer (Megatron-core skips its recompute under the
  // block method, partial recompute here).
  const LayerCost* mtp_layer = nullptr;
  if (m.mtp_layers > 0) {
    const bool block = p.recompute == Recompute::full && p.recompute_layers > 0;
    mtp_layer = m.mixed() && !m.mtp_moe() ? (block ? &dense_plain : &dense) : (block ? &plain : &layer);
  }
  const double n_mtp = static_cast<double>(m.mtp_layers);

  // Per-stage, per-chunk durations of one micro-batch.
  // Per-stage scratch, kept per thread between calls: a planner thread estimates millions
  // of plans, and these would otherwise be allocated and freed for each.
  thread_local StageTimes st;
  st.p = p.p;
  st.v = lay.v;
  st.g = kind == ScheduleKind::interleaved ? p.vp_group_size() : 0;
  st.fwd_s.assign(static_cast<size_t>(p.p * lay.v), 0.0);
  st.bwd_s.assign(static_cast<size_t>(p.p * lay.v), 0.0);
  // One micro-batch of chunk c on stage s: forward, recompute, backward. k layers run the
  // plan's forward, backward and recompute; with partial recompute the other n - k run the
  // forward and backward of a plan without recompute.
  // Of n layers, k recomputed, with the embedding and the output layer where they are; of
  // those, in a mixed model, nd and kd dense layers (the rest MoE layers).
  auto work_of = [&](double n, double k, double nd, double kd, bool with_embedding, bool with_head, Work* f, Work* r,
                     Work* b) {
    // (The forwards differ only on the strata stack, which packs what each layer keeps.)
    n -= nd;
    k -= kd;
    *f = k * layer.forward;
    *f += (n - k) * plain.forward;
    *r = k * layer.recompute;
    *b = k * layer.backward;
    *b += (n - k) * plain.backward;
    if (nd > 0) {
      *f += kd * dense.forward;
      *f += (nd - kd) * dense_plain.forward;
      *r += kd * dense.recompute;
      *b += kd * dense.backward;
      *b += (nd - kd) * dense_plain.backward;
    }
    if (with_embedding) {
      *f += emb.forward;
      *b += emb.backward;
    }
    if (with_head) {
      *f += head.forward;
      *b += head.backward;
      if (mtp_layer) {
        *r += head.recompute;  // (the modules' fronts, recomputed with every layer)
        *f += n_mtp * mtp_layer->forward;
        *r += n_mtp * mtp_layer->recompute;
        *b += n_mtp * mtp_layer->backward;
      }
    }
  };
  auto recomputed = [&](int64_t layers) {
    return static_cast<double>(p.recompute == Recompute::full ? p.recomputed_layers(layers) : layers);
  };
  auto chunk_work = [&](int64_t s, int64_t c, Work* f, Work* r, Work* b) {
    const int64_t layers = lay.chunk_layers(s, c);
    work_of(static_cast<double>(layers), recomputed(layers), static_cast<double>(lay.chunk_dense(s, c)),
            static_cast<double>(lay.chunk_dense_recomputed(s, c)), lay.has_embedding(s, c), lay.has_head(s, c), f, r, b);
  };
  // A chunk like the one before it (the same layers, no embedding, no output layer: every
  // middle stage of an even split) costs the same: its sums are kept.
  int64_t prev_layers = -1, prev_dense = -1, prev_dense_k = -1;
  bool prev_ends = true;
  Work f, r, b;
  const bool mixed = !lay.dense.empty();
  for (int64_t s = 0; s < p.p; ++s) {
    for (int64_t c = 0; c < lay.v; ++c) {
      const int64_t layers = lay.chunk_layers(s, c);
      const int64_t nd = mixed ? lay.chunk_dense(s, c) : 0, kd = mixed ? lay.chunk_dense_recomputed(s, c) : 0;
      const bool ends = lay.has_embedding(s, c) || lay.has_head(s, c);
      if (layers != prev_layers || nd != prev_dense || kd != prev_dense_k || ends || prev_ends) chunk_work(s, c, &f, &r, &b);
      prev_layers = layers;
      prev_dense = nd;
      prev_dense_k = kd;
      prev_ends = ends;
      st.fwd_s[static_cast<size_t>(c * p.p + s)] = f.total();
      st.bwd_s[static_cast<size_t>(c * p.p + s)] = b.total() + r.total();
    }
  }
  st.send_s.assign(static_cast<size_t>(p.p), p2p_time(m, cl, p, cs));

  // Memory per stage.
  thread_local InFlight fl_local;  // per-thread scratch, like the buffers above
  if (!opt.pre.in_flight) in_flight_into(kind, p.p, lay.v, mbs_per_step, &fl_local, st.g);
  const InFlight& fl = opt.pre.in_flight ? *opt.pre.in_flight : fl_local;
  thread_local std::vector<MemoryBreakdown> mem;
  const size_t worst = stages_memory(m, cl, p, lay, cs, fl, &mem);
  est.memory = mem[worst];
  est.fits = est.memory.peak <= cl.device.memory_bytes;
  // Offloaded optimizer states: the node's ranks' shares of its host memory.
  const double ranks_on_node = ranks_per_node(cl, p);
  if (p.offload > 0 || p.offload_modules) {
    est.host_memory_bytes = offloaded_host_bytes(cl, p, mem);
    if (est.host_memory_bytes > cl.host.memory_bytes) est.fits = false;
  }

  // Pipeline.
  thread_local SimResult sim;  // per-thread scratch, like the buffers above
  simulate_pipeline_into(kind, mbs_per_step, st, opt.record_events, &sim);

  // Data-parallel reduction and the optimizer, per stage, after its last backward.
  thread_local std::vector<double> dp_exposed, dp_total, opt_s, finish;
  for (auto* v : {&dp_exposed, &dp_total, &opt_s, &finish}) v->assign(static_cast<size_t>(p.p), 0.0);
  double before_backward = 0;  // the stage before's last_backward
  for (int64_t s = 0; s < p.p; ++s) {
    const size_t i = static_cast<size_t>(s);
    const double P = mem[i].params;
    double last_backward = 0;
    for (int64_t c = 0; c < lay.v; ++c) last_backward += st.b(s, c);
    // The tail depends on the stage through these inputs, and on whether it holds an end of
    // a tied embedding: a middle stage like the one before it has the same tail.
    const bool same = s >= 2 && s < p.p - 1 && P == mem[i - 1].params && mem[i].expert_params == mem[i - 1].expert_params && last_backward == before_backward &&
                      st.f(s, 0) == st.f(s - 1, 0);
    before_backward = last_backward;
    if (!same) {
      const double Pe = mem[i].expert_params;
      const int64_t mla_layers = m.mla() ? lay.stage_layers(s) + (s == p.p - 1 ? m.mtp_layers : 0) : 0;
      const DpTail tail = data_parallel_tail(m, cl, p, cs, s, P, Pe, last_backward, st.f(s, 0), mla_layers);
      dp_exposed[i] = tail.exposed_s;
      dp_total[i] = tail.total_s;
      const double shard = Pe == 0 ? P / static_cast<double>(p.shard_ranks())
                                   : (P - Pe) / static_cast<double>(p.shard_ranks()) +
                                         Pe / static_cast<double>(p.expert_shard_ranks());
      const double updated = p.zero >= 1 ? shard : P, offloaded = p.offload * updated;
      opt_s[i] = optimizer_time(cl.device, p, cs.grad_bytes, updated - offloaded, p.zero >= 2 ? shard : P);
      if (offloaded > 0) opt_s[i] += offload_optimizer_time(cl, p, cs.grad_bytes, offloaded, ranks_on_node);
    } else {
      dp_exposed[i] = dp_exposed[i - 1];
      dp_total[i] = dp_total[i - 1];
      opt_s[i] = opt_s[i - 1];
    }
    finish[i] = sim.end_s[i] + dp_exposed[i] + opt_s[i];
  }
  size_t crit = 0;
  for (size_t i = 1; i < finish.size(); ++i)
    if (finish[i] > finish[crit]) crit = i;
  est.critical_stage = static_cast<int64_t>(crit);
  est.step_time_s = finish[crit] + cl.step_overhead_s;

  // Breakdown on the critical stage.
  const double mb = static_cast<double>(mbs_per_step);
  TimeBreakdown& tb = est.time;
  // The critical stage's work by kind, summed over its chunks: chunk_work's is linear in
  // the chunk's layer counts, so the stage's counts give the sum at once (with one chunk,
  // the same operations in the same order).
  Work F, Bw, R;
  {
    const int64_t cs_ = static_cast<int64_t>(crit);
    double n = 0, k = 0, nd = 0, kd = 0;
    for (int64_t c = 0; c < lay.v; ++c) {
      n += static_cast<double>(lay.chunk_layers(cs_, c));
      k += recomputed(lay.chunk_layers(cs_, c));
      nd += static_cast<double>(lay.chunk_dense(cs_, c));
      kd += static_cast<double>(lay.chunk_dense_recomputed(cs_, c));
    }
    work_of(n, k, nd, kd, lay.has_embedding(cs_, 0), lay.has_head(cs_, lay.v - 1), &F, &R, &Bw);
  }
  tb.forward = mb * F.compute_s;
  tb.backward = mb * Bw.compute_s;
  tb.recompute = mb * R.compute_s;
  tb.tp_comm = mb * (F.tp_comm_s + Bw.tp_comm_s + R.tp_comm_s);
  tb.cp_comm = mb * (F.cp_comm_s + Bw.cp_comm_s + R.cp_comm_s);
  tb.ep_comm = mb * (F.ep_comm_s + Bw.ep_comm_s + R.ep_comm_s);
  tb.activation_offload = mb * (F.offload_s + Bw.offload_s + R.offload_s);
  tb.dp_comm = mb * (F.dp_comm_s + Bw.dp_comm_s + R.dp_comm_s) + dp_exposed[crit];
  tb.pp_comm = sim.p2p_s[crit];
  tb.optimizer = opt_s[crit];
  tb.overhead = cl.step_overhead_s;
  tb.pipeline_bubble = 0;
  tb.pipeline_bubble = std::max(0.0, est.step_time_s - tb.sum());
  est.dp_comm_total_s = dp_total[crit] + mb * (F.dp_comm_all_s + Bw.dp_comm_all_s + R.dp_comm_all_s);
  est.tp_comm_total_s = mb * (F.tp_comm_all_s + Bw.tp_comm_all_s + R.tp_comm_all_s);

  const double world = static_cast<double>(p.world_size());
  const double mfu_peak = p.precision == Precision::fp8 ? cl.device.peak_bf16_flops : cl.device.peak_flops(p.precision);
  est.tokens_per_s = static_cast<double>(p.gbs) * static_cast<double>(m.S) / est.step_time_s;
  est.model_tflops_per_gpu = model_flops_per_step(m, p) / est.step_time_s / world / 1e12;
  est.hardware_tflops_per_gpu = hardware_flops(m, p, lay) / est.step_time_s / world / 1e12;
  est.mfu = est.model_tflops_per_gpu * 1e12 / mfu_peak;

  if (busy_share) {
    double busy = 0;
    for (size_t i = 0; i < finish.size(); ++i) busy += sim.compute_s[i] + sim.p2p_s[i] + dp_exposed[i] + opt_s[i];
    // The step's fixed overhead (data loading, logging) is work on every rank too.
    const double P = static_cast<double>(p.p);
    *busy_share = std::min(1.0, (busy + P * cl.step_overhead_s) / (P * est.step_time_s));
  }
  if (detail) {
    detail->layout = lay;
    detail->stage_times = st;
    detail->sim = std::move(sim);
    detail->stage_memory = mem;
    detail->stage_dp_exposed_s = dp_exposed;
    detail->stage_dp_total_s = dp_total;
    detail->stage_optimizer_s = opt_s;
    detail->stage_finish_s = finish;
    detail->layer = layer;
    detail->plain_layer = plain;
    detail->embedding = emb;
    detail->head = head;
    detail->layer_ops = std::move(layer_ops);
    detail->embedding_ops = std::move(embedding_ops);
    detail->head_ops = std::move(head_ops);
    detail->dense_layer = dense;
    detail->dense_plain_layer = dense_plain;
    if (mtp_layer) detail->mtp_layer = *mtp_layer;
  }
  return est;
}

}  // namespace

double offloaded_host_bytes(const Cluster& cl, const Plan& p, const std::vector<MemoryBreakdown>& stage_memory) {
  double most = 0;
  for (const MemoryBreakdown& mb : stage_memory) most = std::max(most, mb.host_offload + mb.host_activations);
  return ranks_per_node(cl, p) * most;
}

double ranks_per_node(const Cluster& cl, const Plan& p) {
  return static_cast<double>(std::min(cl.devices_per_node, p.world_size()));
}

double max_compute_speed(const Cluster& cl) {
  return cl.shares_processors()
             ? static_cast<double>(cl.devices_per_node) / static_cast<double>(cl.processors_per_node)
             : 1.0;
}

Cluster with_compute_speed(const Cluster& cl, double speed) {
  Cluster c = cl;
  Device& d = c.device;
  for (double* rate : {&d.peak_fp32_flops, &d.peak_tf32_flops, &d.peak_bf16_flops, &d.peak_fp16_flops,
                       &d.peak_fp8_flops, &d.memory_bandwidth_bytes_per_s})
    *rate *= speed;
  d.kernel_launch_s /= speed;
  return c;
}

Estimate estimate(const ModelSpec& m, const Cluster& cl, const Plan& p, const EstimateOptions& opt,
                  EstimateDetail* detail) {
  if (!cl.shares_processors()) return estimate_once(m, cl, p, opt, detail, nullptr);
  // Ranks sharing processors (estimate.h): the compute speed s, against the cluster's
  // rates, at which the node's busy ranks k(s) give back s = f(s) = min(1, C / k(s)) N / C.
  // f maps [1, N / C] into itself (a busy share is at most 1), so f(s) - s changes sign
  // there: the first passes take f(s) as the next s while it stays inside the bracket of
  // the points seen so far (the usual case ends there), later ones the bracket's middle,
  // until s and f(s), or the bracket's ends, agree within 1e-9; the estimate returned is
  // the one at the s it reports.
  const double N = static_cast<double>(cl.devices_per_node), C = static_cast<double>(cl.processors_per_node);
  const double ranks = ranks_per_node(cl, p);
  EstimateOptions o = opt;
  o.pre = Precomputed{};  // layer costs at each pass's rates
  o.pre.in_flight = opt.pre.in_flight;
  double lo = 1, hi = N / C, speed = 1, busy = 1;
  Estimate est;
  for (int pass = 0;; ++pass) {
    est = estimate_once(m, with_compute_speed(cl, speed), p, o, detail, &busy);
    if (!est.valid) return est;
    const double f = std::min(1.0, C / std::max(ranks * busy, 1e-12)) * (N / C);
    if (std::fabs(f - speed) <= 1e-9 * speed || hi - lo <= 1e-9 * lo || pass == 200) break;
    (f > speed ? lo : hi) = speed;
    speed = pass < 8 && f >= lo && f <= hi ? f : 0.5 * (lo + hi);
  }
  est.mfu *= speed;  // against the device's own peak, not the pass's
  est.compute_speed = speed;
  est.busy_ranks = ranks * busy;
  est.ranks_per_node = ranks;
  est.processors_per_node = C;
  return est;
}

Terms time_terms(const TimeBreakdown& t) {
  Terms terms{{"forward", t.forward},     {"backward", t.backward}, {"recompute", t.recompute},
              {"tp_comm", t.tp_comm},     {"cp_comm", t.cp_comm},   {"pp_comm", t.pp_comm},
              {"dp_comm", t.dp_comm},     {"pipeline_bubble", t.pipeline_bubble},
              {"optimizer", t.optimizer}, {"overhead", t.overhead}};
  // Expert-parallel all-to-alls, where a mixture-of-experts plan has them (after cp_comm).
  if (t.ep_comm > 0) terms.insert(terms.begin() + 5, {"ep_comm", t.ep_comm});
  // Activation copies to and from the host the compute waited for (offload_modules), after
  // the communication terms.
  if (t.activation_offload > 0)
    terms.insert(terms.begin() + (t.ep_comm > 0 ? 9 : 8), {"activation_offload", t.activation_offload});
  return terms;
}

Terms memory_terms(const MemoryBreakdown& m) {
  return {{"weights", m.weights},           {"gradients", m.gradients},
          {"optimizer_states", m.optimizer_states}, {"activations", m.activations},
          {"comm_buffers", m.comm_buffers}, {"framework_overhead", m.framework_overhead},
          {"peak", m.peak}};
}

Json estimate_to_json(const Estimate& e) {
  Json j;
  j["plan"] = plan_to_json(e.plan);
  if (!e.valid) {
    j["valid"] = false;
    j["fits"] = false;
    Json r = Json::array();
    for (const auto& x : e.reasons) r.push_back({{"reason", x.key}, {"message", x.message}});
    j["reasons"] = r;
    return j;
  }
  j["fits"] = e.fits;
  j["step_time_s"] = e.step_time_s;
  j["tokens_per_s"] = e.tokens_per_s;
  j["model_tflops_per_gpu"] = e.model_tflops_per_gpu;
  j["hardware_tflops_per_gpu"] = e.hardware_tflops_per_gpu;
  j["mfu"] = e.mfu;
  for (const auto& [k, v] : time_terms(e.time)) j["time_s"][k] = v;
  // Whole bytes; the peak is the sum of the rounded terms, as the model's peak is theirs.
  // (Past 2^53 bytes, where a double holds only whole numbers anyway, the numbers as they are.)
  int64_t sum = 0;
  const bool whole = e.memory.peak < 9e15;
  for (const auto& [k, v] : memory_terms(e.memory)) {
    if (std::string_view(k) == "peak") continue;
    if (!whole) {
      j["memory_bytes"][k] = v;
      continue;
    }
    const int64_t b = std::llround(v);
    j["memory_bytes"][k] = b;
    sum += b;
  }
  if (whole) j["memory_bytes"]["peak"] = sum;
  else j["memory_bytes"]["peak"] = e.memory.peak;
  j["memory_stage"] = e.memory.stage;
  if (e.memory.at_optimizer_step) j["memory_at_optimizer_step"] = true;
  j["critical_stage"] = e.critical_stage;
  j["microbatches"] = e.microbatches;
  j["attention"] = to_string(e.attention);
  if (e.plan.c > 1) j["cp_comm_type"] = to_string(e.cp_comm);
  j["stack"] = stack_to_json(e.stack);
  j["schedule"] = to_string(e.plan.schedule());
  j["comm_before_overlap_s"] = {{"tp_comm", e.tp_comm_total_s}, {"dp_comm", e.dp_comm_total_s}};
  if (e.plan.offload > 0 || e.plan.offload_modules) {  // host memory, outside the GPU's peak above
    j["host_memory_bytes"] = {{"per_node", std::llround(e.host_memory_bytes)}};
    if (e.plan.offload > 0) j["host_memory_bytes"]["optimizer_offload_per_gpu"] = std::llround(e.memory.host_offload);
    if (e.plan.offload_modules)
      j["host_memory_bytes"]["activation_offload_per_gpu"] = std::llround(e.memory.host_activations);
  }
  if (e.processors_per_node > 0)
    j["processor_sharing"] = {{"processors_per_node", e.processors_per_node},
                              {"ranks_per_node", e.ranks_per_node},
                              {"busy_ranks", e.busy_ranks},
                              {"compute_speed", e.compute_speed}};
  return j;
}

}  // namespace strata
