// The op-by-op compute model's mixture-of-experts block (router, permutation, the expert
// exchanges of each dispatcher, grouped expert GEMMs, shared experts), the overlap of its
// exchanges with another micro-batch's compute, and multi-latent attention's projections;
// see compute_acc.h. The dense layer that calls them is compute.cpp's.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "costmodel/compute_acc.h"

namespace strata {
namespace compute_detail {

// The MoE block after norm2 (Megatron-core's MoE layer with the all-to-all dispatcher),
// for balanced routing: the router (a replicated E x H GEMM on the rank's Tn tokens, then
// softmax and top-k in fp32), the K copies of each token permuted into expert order, sent
// to their experts' ranks (all-to-all over the ep ranks) and gathered over the etp ranks
// each expert's matrices are split over (expert_tensor_parallel_size; tensor parallelism
// needs sequence parallelism, so a rank holds Tn = T/t tokens), so that the E/ep local
// experts see Tn K etp token copies in all (T K when etp = t), an E/ep-th of that each, in
// grouped GEMMs; then the way back (reduce-scatter, all-to-all) and the un-permute that
// weights each copy by its probability and sums them. A shared expert runs as a dense MLP
// of Fs beside it, split over the tensor-parallel ranks.
MoeSizes moe_sizes(const Acc& a) {
  const ModelSpec& m = a.m;
  const double t = static_cast<double>(a.p.t), K = static_cast<double>(m.K);
  const double etp = static_cast<double>(a.p.expert_tp());
  MoeSizes z;
  z.sent = a.cs.Tn * K;                                       // token copies this rank dispatches
  z.arriving = z.sent * etp;                                  // token copies its experts compute
  z.local = static_cast<double>(m.E / a.p.ep);                // experts on this rank
  z.per_expert = z.arriving / z.local;
  z.fc1 = static_cast<double>(m.expert_fc1_out()) / etp;
  z.Ft = static_cast<double>(m.Fe) / etp;
  z.fs1 = static_cast<double>(m.shared_fc1_out()) / t;
  z.Fst = static_cast<double>(m.Fs) / t;
  return z;
}

namespace {

// The chance that none of `draws` taken without replacement from `pool` falls outside
// `inside` of them: every one among the other pool - inside.
double none_inside(double pool, double inside, double draws) {
  double q = 1;
  for (double i = 0; i < draws; ++i) {
    if (pool - inside - i <= 0) return 0;
    q *= (pool - inside - i) / (pool - i);
  }
  return q;
}

double choose(double n, double k) {
  if (k < 0 || k > n) return 0;
  return std::exp(std::lgamma(n + 1) - std::lgamma(k + 1) - std::lgamma(n - k + 1));
}

// The chance that one of `holders` equal holders of the E experts (the nodes, or the
// GPUs, of the expert-parallel group; Megatron gives each expert-parallel rank E/ep
// consecutive experts) holds none of a token's K, routing balanced: the K drawn among
// the E. With group-limited routing (ng groups of Eg consecutive experts, g of them per
// token), Megatron scores a group by its best experts, so each chosen group supplies one
// of the K or more: a holder of whole groups (gph of them) is missed when none of its
// groups is chosen, C(ng - gph, g) / C(ng, g); a holder inside a group (of `per` of its
// experts) when its group is not chosen, or is and the K fall among the chosen groups'
// other experts: (1 - g/ng) + g/ng x P(none of the K among its per of g Eg).
double holder_missed(const ModelSpec& m, int64_t holders) {
  const double E = static_cast<double>(m.E), K = static_cast<double>(m.K);
  const int64_t per = m.E / holders;
  if (m.moe_groups > 0 && m.E % holders == 0) {
    const int64_t Eg = m.E / m.moe_groups;
    const double ng = static_cast<double>(m.moe_groups), g = static_cast<double>(m.moe_group_topk);
    if (per % Eg == 0) return choose(ng - static_cast<double>(per / Eg), g) / choose(ng, g);
    if (Eg % per == 0)
      return (1.0 - g / ng) + g / ng * none_inside(g * static_cast<double>(Eg), static_cast<double>(per), K);
  }
  return none_inside(E, static_cast<double>(per), K);
}

// The dispatch (or combine) of an MoE layer's `bytes` of token copies, Tn tokens of this
// rank's (Plan::moe_dispatcher).
// - alltoall: one copy per expert, an all-to-all over the expert-parallel group.
// - allgather: every rank's tokens gathered over the expert-parallel x expert-tensor-
//   parallel group (each rank keeps those of its experts), the outputs reduce-scattered
//   back; no separate expert-tensor-parallel collective.
// - flex (DeepEP's or NVIDIA's HybridEP kernels, expert_tensor_parallel_size 1): a token
//   once to each other node of the group holding any of its experts, over the network to
//   the GPU of the sender's local rank there, and from there (and on the sender's node)
//   once to each other GPU holding them over NVLink; the combine reduces them back the same
//   way: per token (nodes - 1)(1 - P(a node holds none of its experts)) copies through
//   this GPU's NIC beside (ep - nodes)(1 - P(a GPU holds none)) over NVLink, the slower of
//   the two after one latency.
double ep_exchange_time(Acc& a, const char* name, Phase ph, bool dispatch, double bytes);
void ep_exchange(Acc& a, const char* name, Phase ph, bool dispatch, double bytes) {
  const double before = Acc::stream_s(a.w(ph));
  const double t = ep_exchange_time(a, name, ph, dispatch, bytes);
  if (a.p.moe_a2a_overlap && ph != Phase::recompute) {
    Acc::Exchanges& x = a.exchanges[ph == Phase::forward ? 0 : 1];
    if (x.n < 2) {
      x.before[x.n] = before;
      x.time[x.n] = t;
      x.wgrad_before[x.n] = a.wgrad_s;
    }
    ++x.n;
  }
}
// ep_exchange's booking: the exchange's time.
double ep_exchange_time(Acc& a, const char* name, Phase ph, bool dispatch, double bytes) {
  const GroupSpan& g = a.ep;
  const MoeDispatcher d = a.p.moe_dispatcher;
  if (d == MoeDispatcher::alltoall || (g.size <= 1 && d != MoeDispatcher::allgather))
    return a.comm(name, ph, OpKind::ep_comm, g, Collective::all_to_all, bytes);
  const ModelSpec& m = a.m;
  const Cluster& cl = a.cl;
  const double row = static_cast<double>(a.cs.work_bytes) * static_cast<double>(m.H), Tn = a.cs.Tn;
  if (d == MoeDispatcher::allgather) {  // (backward: the dispatch reduce-scatters, the combine gathers)
    const int64_t n = a.p.ep * a.p.expert_tp();
    const bool gathers = dispatch == (ph != Phase::backward);
    const char* op = dispatch ? (gathers ? "ep_dispatch_all_gather" : "ep_dispatch_reduce_scatter")
                              : (gathers ? "ep_combine_all_gather" : "ep_combine_reduce_scatter");
    return a.comm(op, ph, OpKind::ep_comm, group_span(n, 1, cl.devices_per_node),
                  gathers ? Collective::all_gather : Collective::reduce_scatter, Tn * row * static_cast<double>(n));
  }
  const double gpu_rows = Tn * static_cast<double>(g.size - g.nodes) * (1.0 - holder_missed(m, g.size));
  const double node_rows =
      g.nodes > 1 ? Tn * static_cast<double>(g.nodes - 1) * (1.0 - holder_missed(m, g.nodes)) : 0.0;
  const double nvlink = gpu_rows * row / (cl.intra.bandwidth_bytes_per_s * cl.intra.efficiency(Collective::all_to_all));
  const double network =
      node_rows * row / (cl.inter.bandwidth_bytes_per_s * cl.inter.efficiency(Collective::all_to_all));
  const double t = (g.nodes > 1 ? cl.inter.latency_s : cl.intra.latency_s) + std::max(nvlink, network);
  return a.book(dispatch ? "ep_dispatch_flex" : "ep_combine_flex", ph, OpKind::ep_comm,
                (g.nodes > 1 ? node_rows : gpu_rows) * row, t, 0.0);
}

}  // namespace

void moe_forward(Acc& a, Phase ph) {
  const ModelSpec& m = a.m;
  const Plan& p = a.p;
  const double e = a.cs.work_bytes, T = a.cs.T, Tn = a.cs.Tn, H = static_cast<double>(m.H);
  const double E = static_cast<double>(m.E);
  const MoeSizes z = moe_sizes(a);
  if (m.Fs > 0) {  // the shared expert: a dense MLP of Fs
    a.block_gather("sp_all_gather", ph, T, z.fs1, H, false);
    a.linear("shared_fc1", ph, T, z.fs1, H);
    a.mem(to_string(m.activation), ph, (m.gated() ? 3.0 : 2.0) * e * T * z.Fst, MemKind::activation);
    a.linear("shared_fc2", ph, T, H, z.Fst);
    a.block_reduce(p.sp ? "sp_reduce_scatter" : "tp_all_reduce", ph, T, H, z.Fst);
  }
  a.gemm("router", ph, Tn, E, H, a.peak_attn, e);
  a.mem("router_topk", ph, (e + 8.0) * Tn * E);
  a.mem("moe_permute", ph, 2.0 * e * z.sent * H);
  ep_exchange(a, "ep_dispatch_all_to_all", ph, true, e * z.sent * H);
  if (p.expert_tp() > 1 && p.moe_dispatcher != MoeDispatcher::allgather)
    a.comm("moe_tp_all_gather", ph, OpKind::tp_comm, a.etp, Collective::all_gather, e * z.arriving * H);
  a.grouped_linear("expert_fc1", ph, z.local, z.per_expert, z.fc1, H);
  a.mem(to_string(m.activation), ph, (m.gated() ? 3.0 : 2.0) * e * z.arriving * z.Ft, MemKind::activation);
  a.grouped_linear("expert_fc2", ph, z.local, z.per_expert, H, z.Ft);
  if (p.expert_tp() > 1 && p.moe_dispatcher != MoeDispatcher::allgather)
    a.comm("moe_tp_reduce_scatter", ph, OpKind::tp_comm, a.etp, Collective::reduce_scatter, e * z.arriving * H);
  ep_exchange(a, "ep_combine_all_to_all", ph, false, e * z.sent * H);
  a.mem("moe_unpermute", ph, 2.0 * e * z.sent * H + e * Tn * H);
}

void moe_backward(Acc& a) {
  const ModelSpec& m = a.m;
  const Plan& p = a.p;
  const Phase ph = Phase::backward;
  const double e = a.cs.work_bytes, T = a.cs.T, Tn = a.cs.Tn, H = static_cast<double>(m.H);
  const double E = static_cast<double>(m.E);
  const MoeSizes z = moe_sizes(a);
  a.mem("moe_unpermute", ph, 2.0 * e * z.sent * H + e * Tn * H);
  ep_exchange(a, "ep_combine_all_to_all", ph, false, e * z.sent * H);
  if (p.expert_tp() > 1 && p.moe_dispatcher != MoeDispatcher::allgather)
    a.comm("moe_tp_all_gather", ph, OpKind::tp_comm, a.etp, Collective::all_gather, e * z.arriving * H);
  a.grouped_linear("expert_fc2", ph, z.local, z.per_expert, H, z.Ft);
  a.mem(to_string(m.activation), ph, (m.gated() ? 5.0 : 3.0) * e * z.arriving * z.Ft, MemKind::activation);
  a.grouped_linear("expert_fc1", ph, z.local, z.per_expert, z.fc1, H);
  if (p.expert_tp() > 1 && p.moe_dispatcher != MoeDispatcher::allgather)
    a.comm("moe_tp_reduce_scatter", ph, OpKind::tp_comm, a.etp, Collective::reduce_scatter, e * z.arriving * H);
  ep_exchange(a, "ep_dispatch_all_to_all", ph, true, e * z.sent * H);
  a.mem("moe_permute", ph, 2.0 * e * z.sent * H);
  a.mem("router_topk", ph, (e + 8.0) * Tn * E);
  a.gemm("router", ph, Tn, H, E, a.peak_attn, e);                                            // dgrad
  a.wgrad("router", ph, H, E, Tn, a.peak_attn, e);                                          // wgrad
  if (m.Fs > 0) {  // as the dense MLP's backward (layer_backward), at the shared expert's sizes
    a.block_gather("sp_all_gather", ph, T, z.Fst, H, false);
    a.linear("shared_fc2", ph, T, H, z.Fst);
    a.mem(to_string(m.activation), ph, (m.gated() ? 5.0 : 3.0) * e * T * z.Fst, MemKind::activation);
    a.block_gather("sp_all_gather", ph, T, H, z.fs1, true);
    a.linear("shared_fc1", ph, T, z.fs1, H);
    a.tp_reduce(p.sp ? "sp_reduce_scatter" : "tp_all_reduce", ph, wgrad_overlap(a, T, z.fs1, H));
  }
}

// Multi-latent attention's up projections and RoPE (also what recompute_modules
// mla_up_proj runs again): the latents gathered over the sequence, the column-parallel up
// projections, RoPE on the rotary columns.
// (Recomputed, the latents' norms, fused into the up projections, run again, and the
// rotary key, gathered outside the recomputed region, is not gathered again.)
void mla_up_forward(Acc& a, Phase ph) {
  const ModelSpec& m = a.m;
  const double e = a.cs.work_bytes, T = a.cs.T, Tn = a.cs.Tn, H = static_cast<double>(m.H);
  const double t = static_cast<double>(a.p.t), A = static_cast<double>(m.A);
  const double ql = static_cast<double>(m.q_lora_rank), kvl = static_cast<double>(m.kv_lora_rank);
  const double rope = ph == Phase::recompute ? 0.0 : static_cast<double>(m.qk_pos_emb_head_dim);
  const double q_cols = static_cast<double>(m.AD()) / t, kv_cols = A / t * static_cast<double>(m.qk_head_dim() + m.Dv());
  if (ph == Phase::recompute) a.mem("latent_norms", ph, 2.0 * e * Tn * (ql + kvl), MemKind::norm);
  if (ql > 0) {
    a.sp_gather_width("sp_all_gather", ph, ql + kvl + rope);
    a.linear("q_up_proj", ph, T, q_cols, ql);
  } else {
    a.sp_gather_width("sp_all_gather", ph, kvl + rope);
    a.tp_gather("sp_all_gather", ph);
    a.linear("q_proj", ph, T, q_cols, H);
  }
  a.linear("kv_up_proj", ph, T, kv_cols, kvl);
  const double rope_cols = static_cast<double>(m.qk_pos_emb_head_dim);
  a.mem("rope", ph, 2.0 * e * T * rope_cols * (A / t + 1.0));
}

// Multi-latent attention's projections, forward (Megatron-core's MLASelfAttention): the
// down projections to the query latent (q_lora_rank) and to the key/value latent with the
// shared rotary key (kv_lora_rank + qk_pos_emb_head_dim), duplicated on every
// tensor-parallel rank and run on its own tokens (the sequence shard with sequence
// parallelism, so the hidden state is never gathered for them), their RMSNorms, then the
// latents gathered over the sequence (sequence parallelism: kv_lora_rank + q_lora_rank +
// the rotary key's columns, against H for a QKV layer) and the column-parallel up
// projections to the heads' queries (D each) and keys and values (qk_head_dim + Dv each).
// Without a query latent, one column-parallel query projection reads the gathered hidden
// state. RoPE on the rotary columns of the queries and of the shared key.
void mla_projections_forward(Acc& a, Phase ph) {
  const ModelSpec& m = a.m;
  const double e = a.cs.work_bytes, Tn = a.cs.Tn, H = static_cast<double>(m.H);
  const double ql = static_cast<double>(m.q_lora_rank), kvl = static_cast<double>(m.kv_lora_rank);
  const double rope = static_cast<double>(m.qk_pos_emb_head_dim);
  if (ql > 0) {
    a.linear("q_down_proj", ph, Tn, ql, H);
    a.mem("q_norm", ph, 2.0 * e * Tn * ql, MemKind::norm);
  }
  a.linear("kv_down_proj", ph, Tn, kvl + rope, H);
  a.mem("kv_norm", ph, 2.0 * e * Tn * kvl, MemKind::norm);
  mla_up_forward(a, ph);
}

// Its backward: RoPE, the up projections (their inputs gathered again for the weight
// gradients, behind the input gradients; the latents' gradients reduce-scattered behind the
// weight gradients where the stack overlaps them), the norms, the down projections.
void mla_projections_backward(Acc& a) {
  const ModelSpec& m = a.m;
  const Phase ph = Phase::backward;
  const double e = a.cs.work_bytes, T = a.cs.T, Tn = a.cs.Tn, H = static_cast<double>(m.H);
  const double t = static_cast<double>(a.p.t), A = static_cast<double>(m.A);
  const double ql = static_cast<double>(m.q_lora_rank), kvl = static_cast<double>(m.kv_lora_rank);
  const double rope = static_cast<double>(m.qk_pos_emb_head_dim);
  const double q_cols = static_cast<double>(m.AD()) / t, kv_cols = A / t * static_cast<double>(m.qk_head_dim() + m.Dv());
  a.mem("rope", ph, 2.0 * e * T * rope * (A / t + 1.0));
  const double q_in = ql > 0 ? ql : H;  // the query projection's input width
  const double dgrads = a.gemm_s(T, kvl, kv_cols) + a.gemm_s(T, q_in, q_cols);
  a.sp_gather_width("sp_all_gather", ph, (ql > 0 ? ql : 0.0) + kvl + rope, dgrads);
  if (ql <= 0) a.tp_gather("sp_all_gather", ph, dgrads);
  a.linear("kv_up_proj", ph, T, kv_cols, kvl);
  a.linear(ql > 0 ? "q_up_proj" : "q_proj", ph, T, q_cols, q_in);
  const double wgrads = wgrad_overlap(a, T, kv_cols, kvl) + wgrad_overlap(a, T, q_cols, q_in);
  // (The latents' gradients, summed over the ranks' heads: the down projections'
  // outputs, duplicated.)
  a.tp_reduce_width(a.p.sp ? "sp_reduce_scatter" : "tp_all_reduce", ph, (ql > 0 ? ql : 0.0) + kvl + rope, wgrads);
  if (ql <= 0) a.tp_reduce(a.p.sp ? "sp_reduce_scatter" : "tp_all_reduce", ph, wgrads);
  a.mem("kv_norm", ph, 3.0 * e * Tn * kvl, MemKind::norm);
  a.linear("kv_down_proj", ph, Tn, kvl + rope, H);
  if (ql > 0) {
    a.mem("q_norm", ph, 3.0 * e * Tn * ql, MemKind::norm);
    a.linear("q_down_proj", ph, Tn, ql, H);
  }
}

}  // namespace compute_detail

double paired_share(const Plan& p) {
  const double chunks = static_cast<double>(std::max<int64_t>(1, p.microbatches()) * p.v);
  const double warmup = static_cast<double>(p.p - 1 + (p.v - 1) * (p.v > 1 ? p.vp_group_size() : 0) + 1);
  return (chunks - std::min(chunks, warmup)) / chunks;
}

// Megatron-core's overlap_moe_expert_parallel_comm (Megatron-Bridge's moe_a2a_overlap, which
// its recipes run with delay_wgrad_compute): the schedule's steady state runs one
// micro-batch's forward beside another's backward, layer by layer
// (TransformerLayerSchedulePlan.run), each exchange on a communication stream beside one
// block of the other pass on the compute stream:
//   the backward's combine (after the unpermute's backward, which runs with it) beside the
//     forward's attention block to its dispatch (A);
//   the forward's dispatch beside the experts' backward B' = B + Bw (with delay_wgrad_compute
//     their input gradients B, then their weight-gradient GEMMs Bw; without it Bw = 0);
//   the backward's dispatch, once B is done, beside Bw and the forward's experts (M, after
//     its dispatch);
//   the forward's combine (and the unpermute after it) beside the backward's attention
//     block (P'), once both M and the backward's dispatch are done.
// So the pair lasts (cb starting up to the attention block's weight gradients early, below)
//   t1 = max(A, cb), then M starts at t1 + max(B + Bw, df) and the backward's dispatch at
//   t1 + max(B, df); s2 = max(M's end, db's end); the pair ends at s2 + max(cf, P'),
// and what it lasts beyond its kernels is the exchanges' exposed time (the hidden rest costs
// overlap_slowdown), split between the passes as their exchanges are. The warm-up's
// forwards and the cool-down's backwards run alone (paired_share: the layer's exchanges
// exposed that share of the time, weighed by it). A layer is paired with the mirror layer
// of another chunk, which strata takes to be alike.
// `first_op`: the layer's first op in the op list, whose exchanges' exposed times follow.
void compute_detail::overlap_expert_exchanges(Acc& a, size_t first_op) {
  Work& f = a.lc.forward;
  Work& b = a.lc.backward;
  const double comm = f.ep_comm_s + b.ep_comm_s;
  const Acc::Exchanges& xf = a.exchanges[0];
  const Acc::Exchanges& xb = a.exchanges[1];
  if (comm <= 0 || xf.n != 2 || xb.n != 2) return;
  // The forward: A to its dispatch, the experts M, the rest after its combine; the backward:
  // the unpermute's backward to its combine, the experts B', the attention block P'.
  const double A = xf.before[0], M = xf.before[1] - xf.before[0], post = Acc::stream_s(f) - xf.before[1];
  const double q0 = xb.before[0], Bp = xb.before[1] - xb.before[0], P = Acc::stream_s(b) - xb.before[1];
  const double df = xf.time[0], cf = xf.time[1] + post, cb = q0 + xb.time[0], db = xb.time[1];
  // With delay_wgrad_compute the experts' weight gradients (Bw) run after the input
  // gradients B that the backward's dispatch waits for, and the attention block's (Pw) after
  // its input gradients, beside the next layer's backward combine, which so starts up to Pw
  // early (by what of P' outlasts the forward's combine); without it B is the experts' whole
  // backward.
  const bool delayed = a.p.delay_wgrad;
  const double Bw = delayed ? xb.wgrad_before[1] - xb.wgrad_before[0] : 0.0, B = Bp - Bw;
  const double Pw = a.wgrad_s - xb.wgrad_before[1];
  const double early = delayed ? std::min(Pw, std::max(0.0, P - cf)) : 0.0;
  const double t1 = std::max(A, cb - early);
  const double s2 = std::max(t1 + std::max(B + Bw, df) + M, t1 + std::max(B, df) + db);
  const double pair = s2 + std::max(cf, P);
  const double kernels = A + M + post + q0 + Bp + P;
  const double exposed = std::max(0.0, std::min(comm, pair - kernels)), paired = paired_share(a.p);
  const double scale = paired * (exposed + a.cl.overlap_slowdown * (comm - exposed)) / comm + (1.0 - paired);
  f.ep_comm_s *= scale;
  b.ep_comm_s *= scale;
  if (a.ops)
    for (size_t i = first_op; i < a.ops->size(); ++i) {
      OpCost& o = (*a.ops)[i];
      if (o.kind == OpKind::ep_comm && o.phase != Phase::recompute) o.exposed_s *= scale;
    }
}

}  // namespace strata
