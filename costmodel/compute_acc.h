// The accumulator of the op-by-op compute model (compute.h): one piece of work's ops
// (a layer, the embedding, the output layer and loss) booked into a LayerCost, with the
// helpers its three files share: compute.cpp (the layer's dense and attention blocks, the
// 16-bit passes, the sharded parameters' traffic), compute_moe.cpp (mixture-of-experts
// blocks, multi-latent attention) and compute_ends.cpp (the embedding, the output layer
// and loss, multi-token prediction, the optimizer). Internal to costmodel/.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "costmodel/comm.h"
#include "costmodel/compute.h"
#include "executor/cuda/attention_plan.h"
#include "executor/cuda/limits.h"

namespace strata::compute_detail {

// Columns per tensor-parallel rank of `q` query-wide tensors (Q, the attention output) and
// `kv` key- or value-wide ones (ModelSpec::kv_width: replicated groups when t > G).
// With multi-latent attention the second query-wide tensor (the output) and the second
// key-wide one (V) are Dv wide per head.
inline double head_columns(const ModelSpec& m, int64_t t, int q, int kv) {
  if (m.mla())
    return static_cast<double>(q >= 1 ? m.AD() / t : 0) + static_cast<double>(q >= 2 ? m.VD() / t : 0) +
           static_cast<double>(kv >= 1 ? m.kv_width(t) : 0) + static_cast<double>(kv >= 2 ? m.v_width(t) : 0);
  return static_cast<double>(q) * static_cast<double>(m.AD()) / static_cast<double>(t) +
         static_cast<double>(kv) * static_cast<double>(m.kv_width(t));
}

// Where a GEMM of `flops` at `peak_flops` reads the efficiency curve: the curve is measured
// in the 16-bit precision; a kernel at another peak runs for as long as a 16-bit one of
// flops * (bf16 peak / its peak), and fixed costs are in time.
inline double gemm_curve_x(const Device& dev, double peak_flops, double flops) {
  const double ref = dev.peak_bf16_flops > 0 ? dev.peak_bf16_flops : dev.peak_fp16_flops;
  return ref > 0 ? flops * ref / peak_flops : flops;
}

// The roofline with the memory time from `memory_s(bytes)` (memory_time, or a memo of it).
template <class MemoryTime>
double roofline(const Device& dev, double flops, double bytes, double rate, MemoryTime&& memory_s) {
  return std::max({flops / rate, memory_s(bytes), dev.kernel_launch_s});
}

// Accumulates the ops of one piece of work into a LayerCost.
struct Acc {
  const ModelSpec& m;
  const Cluster& cl;
  const Plan& p;
  const ComputeSetup& cs;
  std::vector<OpCost>* ops;
  GroupSpan tp, cp, dp;
  GroupSpan etp, ep, edp;  // an expert's ranks, the expert-parallel ranks (etp apart), the expert replicas (etp ep apart)
  // Hybrid sharding (Plan::dp_instances): dp and edp are one instance's shard group, these
  // the instances holding alike shards (the shard group's size apart); size 1 without it.
  GroupSpan dp_across, edp_across;
  double peak_linear, peak_attn;  // FLOP/s for the linear layers and the attention core
  // What the fused attention's efficiency multiplies: the attention peak (16-bit in a 16-bit
  // plan, the strata executor's CUDA kernels on the tensor cores since flash_attention_tc.cu;
  // Eigen's fp32 on the CPU, whose profile gives every precision one peak), except where the
  // strata executor's CUDA kernels run in fp32 on the CUDA cores: head dims other than
  // flash_tc_head_dim's, and devices without bf16 tensor cores (before sm_80: no bf16 peak).
  double peak_flash;
  double lin_bytes;               // bytes per linear-GEMM operand element
  // The strata executor's 16-bit GEMMs on a device that reads 16-bit operands (Device::
  // gemm_reads_16bit): its float weights are cast into a 16-bit copy (4 bytes read, 2
  // written a weight) for each GEMM that reads them, the forward's and the input
  // gradient's, timed with the GEMM (its op name); its other operands are 16-bit already
  // (compute.cpp sixteen_bit_passes).
  bool casts_weights;
  // There, with the fused attention on the tensor cores and no context parallelism: qkv is
  // packed where it is made and kept so, the kernels reading it (and the backward's delta
  // the attention's output) in 16 bits (executor/gpt.cpp qkv_sixteen).
  bool qkv16;
  bool ub;                        // Transformer Engine's user-buffer overlap (Stack::userbuffers)
  LayerCost lc;
  // With the expert exchanges' overlap (Plan::moe_a2a_overlap): each pass's dispatch and
  // combine (in that pass's order), the time on the compute stream before each, and its
  // duration (ep_exchange; overlap_expert_exchanges reads them).
  struct Exchanges {
    double before[2] = {0, 0}, time[2] = {0, 0}, wgrad_before[2] = {0, 0};
    int n = 0;
  } exchanges[2];  // [0] forward, [1] backward
  double wgrad_s = 0;  // the backward's weight-gradient GEMMs so far
  // The curves' values met before in this piece of work, computed once each (the same
  // bits): a linear layer's forward, input-gradient and weight-gradient GEMMs share their
  // FLOPs, norms and residual adds repeat their bytes, and a recompute replays the forward.
  struct Memo {  // direct-mapped on the key's bits; a NaN key matches nothing
    static constexpr int kSize = 16;
    double key[kSize], value[kSize];
    Memo() { std::fill(key, key + kSize, std::numeric_limits<double>::quiet_NaN()); }
    template <class F>
    double operator()(double k, F&& f) {
      const uint64_t bits = std::bit_cast<uint64_t>(k);
      const size_t i = static_cast<size_t>(((bits ^ (bits >> 31)) * 0x9E3779B97F4A7C15ull) >> 60);
      if (key[i] == k) return value[i];
      key[i] = k;
      return value[i] = f();
    }
  };
  Memo gemm_memo, memory_memo, kind_memo[kMemKinds];

  Acc(const ModelSpec& m_, const Cluster& cl_, const Plan& p_, const ComputeSetup& cs_, std::vector<OpCost>* ops_)
      : m(m_), cl(cl_), p(p_), cs(cs_), ops(ops_) {
    const int64_t N = cl.devices_per_node;
    tp = group_span(p.t, 1, N);
    cp = group_span(p.c, p.t, N);
    dp = group_span(p.shard_ranks(), p.t, N);  // parameter replicas (data x context parallel) one shard spans
    etp = group_span(p.expert_tp(), 1, N);
    ep = group_span(p.ep, p.expert_tp(), N);
    edp = group_span(p.expert_shard_ranks(), p.expert_tp() * p.ep, N);
    dp_across = group_span(p.dp_instances, p.t * p.shard_ranks(), N);
    edp_across = group_span(p.dp_instances, p.expert_tp() * p.ep * p.expert_shard_ranks(), N);
    const Device& dev = cl.device;
    peak_attn = p.precision == Precision::fp8 ? dev.peak_bf16_flops : dev.peak_flops(p.precision);
    peak_linear = dev.gemm_peak(p.precision);
    const bool tc_flash = !cs.stack.strata || (cuda::flash_tc_head_dim(m.D()) && dev.peak_bf16_flops > 0);
    peak_flash = tc_flash ? peak_attn : dev.peak_fp32_flops;
    lin_bytes = p.precision == Precision::fp8 ? 1.0 : cs.work_bytes;
    casts_weights = cs.sixteen_operands;
    qkv16 = casts_weights && cs.attention == AttentionKernel::flash && p.c == 1 && tc_flash;
    ub = cs.stack.userbuffers;
  }

  Work& w(Phase ph) {
    return ph == Phase::forward ? lc.forward : ph == Phase::backward ? lc.backward : lc.recompute;
  }
  // A phase's time on the compute stream: its kernels and the collectives it waits for.
  static double on_stream(const Work& w) { return w.compute_s + w.tp_comm_s + w.cp_comm_s + w.ep_comm_s; }
  // The same but for the expert exchanges (which the overlap moves to their own stream).
  static double stream_s(const Work& w) { return w.compute_s + w.tp_comm_s + w.cp_comm_s; }
  // Callers test `ops` first: the estimate's hot path keeps no op list and so makes no call.
  void record(const char* name, Phase ph, OpKind k, double flops, double bytes, double t, double exposed) {
    ops->push_back(OpCost{name, ph, k, flops, bytes, t, exposed});
  }
  // A compute kernel of `flops` at `rate` FLOP/s moving `bytes` (roofline).
  double kernel(const char* name, Phase ph, double flops, double bytes, double rate) {
    const double t = roofline(cl.device, flops, bytes, rate, [&](double b) { return memory_s(b); });
    w(ph).compute_s += t;
    if (ops) record(name, ph, OpKind::gemm, flops, bytes, t, t);
    return t;
  }
  // An (M x K)(K x N) GEMM; `out_bytes` per output element (the output written, or with
  // fused accumulation an fp32 main gradient read and written).
  double gemm(const char* name, Phase ph, double M, double N, double K, double peak, double eb, double out_bytes = -1) {
    const double flops = 2 * M * N * K;
    const double bytes = eb * (M * K + K * N) + (out_bytes < 0 ? eb : out_bytes) * M * N;
    return kernel(name, ph, flops, bytes, peak * efficiency(peak, flops));
  }
  // gemm_efficiency(), memory_time() and gemm_time() through the memos.
  double efficiency(double peak, double flops) {
    const double x = gemm_curve_x(cl.device, peak, flops);
    return gemm_memo(x, [&] { return cl.device.gemm_efficiency.at(x); });
  }
  double memory_s(double bytes) {
    return memory_memo(bytes, [&] { return memory_time(cl.device, bytes); });
  }
  double gemm_s(double M, double N, double K) {
    const double flops = 2.0 * M * N * K;
    return roofline(cl.device, flops, lin_bytes * (M * K + K * N + M * N), peak_linear * efficiency(peak_linear, flops),
                    [&](double b) { return memory_s(b); });
  }
  // A weight-gradient GEMM. With fused accumulation it adds into the main gradient (read and
  // written: 8 bytes per weight in fp32, 4 in 16 bits); otherwise accumulation is its own
  // pass (grad_accumulation ops).
  double wgrad_out_bytes() const { return cs.stack.grad_accumulation_fusion ? 2.0 * cs.grad_bytes : -1.0; }
  double wgrad(const char* name, Phase ph, double M, double N, double K, double peak, double eb) {
    const double t = gemm(name, ph, M, N, K, peak, eb, wgrad_out_bytes());
    if (ph == Phase::backward) wgrad_s += t;
    return t;
  }
  // The attention core's batched GEMMs (QK^T, AV and their gradients) of `flops`, `count`
  // products over Sk keys: at the efficiency of one product (batched_gemm per_matrix),
  // of the whole batch in one call, or on the strata executor's batched backend (CUDA) of
  // the batch each of its calls runs (executor/cuda/attention_plan.h: one micro-batch row's
  // query groups on this rank, as many as its workspace holds).
  double batched(const char* name, Phase ph, double flops, double bytes, double count, double Sk) {
    double one = flops;
    if (cl.device.batched_gemm_per_matrix) {
      one = flops / std::max(count, 1.0);
    } else if (cs.stack.strata) {  // (no context parallelism there: Sq = Sk = S)
      const attention_plan::Heads hd{static_cast<int64_t>(Sk), p.mbs, m.A / p.t, std::max<int64_t>(1, m.G / p.t), m.D()};
      const double per_call = static_cast<double>(hd.groups_per_pass(cuda::kUnfusedAttentionWorkspaceBytes));
      one = flops / std::max(count, 1.0) * std::min(count, per_call);
    }
    return kernel(name, ph, flops, bytes, peak_attn * efficiency(peak_attn, one));
  }
  // A linear layer y = x W with x (M x K), W (K x N). Backward: dgrad (M x N)(N x K) and
  // wgrad (K x M)(M x N) accumulated into the fp32 main gradient.
  double linear(const char* name, Phase ph, double M, double N, double K) {
    double t = 0;
    if (p.precision == Precision::fp8) t += mem("fp8_cast", ph, 3.0 * M * K);
    if (casts_weights) t += mem(name, ph, 6.0 * K * N);  // W's 16-bit copy: the forward's, or dgrad's
    if (ph != Phase::backward) return t + gemm(name, ph, M, N, K, peak_linear, lin_bytes);
    if (p.precision == Precision::fp8) t += mem("fp8_cast", ph, 3.0 * M * N);
    t += gemm(name, ph, M, K, N, peak_linear, lin_bytes);   // dgrad (its own copy of W, above)
    t += wgrad(name, ph, K, N, M, peak_linear, lin_bytes);  // wgrad
    return t;
  }
  // n GEMMs alike run as one grouped kernel (the experts of a layer, Megatron-core's
  // --moe-grouped-gemm): their FLOPs and bytes at the efficiency of one of them. Backward:
  // dgrad and wgrad as in linear().
  double grouped_linear(const char* name, Phase ph, double n, double M, double N, double K) {
    auto grouped = [&](double m_, double n_, double k_, double out_bytes) {
      const double flops = 2.0 * m_ * n_ * k_;
      const double bytes = lin_bytes * (m_ * k_ + k_ * n_) + (out_bytes < 0 ? lin_bytes : out_bytes) * m_ * n_;
      return kernel(name, ph, n * flops, n * bytes, peak_linear * efficiency(peak_linear, flops));
    };
    double t = 0;
    if (p.precision == Precision::fp8) t += mem("fp8_cast", ph, 3.0 * n * M * K);
    if (ph != Phase::backward) return t + grouped(M, N, K, -1.0);
    if (p.precision == Precision::fp8) t += mem("fp8_cast", ph, 3.0 * n * M * N);
    t += grouped(M, K, N, -1.0);                                              // dgrad
    const double w = grouped(K, N, M, wgrad_out_bytes());                    // wgrad
    if (ph == Phase::backward) wgrad_s += w;
    t += w;
    return t;
  }
  // A memory-bound op; of `kind` (MemKind), at that kind's curve where the device has one.
  double mem(const char* name, Phase ph, double bytes, MemKind kind = MemKind::generic) {
    const int k = static_cast<int>(kind);
    const double t = k == 0 || cl.device.kernel_efficiency[k].empty()
                         ? memory_s(bytes)
                         : kind_memo[k](bytes, [&] { return memory_time(cl.device, bytes, kind); });
    w(ph).compute_s += t;
    if (ops) record(name, ph, OpKind::memory, 0, bytes, t, t);
    return t;
  }
  // A collective, `hidden_s` of which overlaps compute issued alongside it.
  double comm(const char* name, Phase ph, OpKind kind, const GroupSpan& g, Collective c, double bytes,
              double hidden_s = 0) {
    return book(name, ph, kind, bytes, collective_time(cl, g, c, bytes), hidden_s);
  }
  // A collective of `t` seconds, `hidden_s` of which overlaps compute.
  double book(const char* name, Phase ph, OpKind kind, double bytes, double t, double hidden_s) {
    // What overlaps still costs: the collective's kernels take SMs and memory bandwidth
    // from the compute running beside it.
    const double exposed = std::max(0.0, t - hidden_s) + cl.overlap_slowdown * std::min(t, hidden_s);
    if (kind == OpKind::tp_comm) {
      w(ph).tp_comm_s += exposed;
      w(ph).tp_comm_all_s += t;
    }
    else if (kind == OpKind::cp_comm) w(ph).cp_comm_s += exposed;
    else if (kind == OpKind::ep_comm) w(ph).ep_comm_s += exposed;
    else {
      w(ph).dp_comm_s += exposed;
      w(ph).dp_comm_all_s += t;
    }
    if (ops && t > 0) record(name, ph, kind, 0, bytes, t, exposed);
    return t;
  }
  // f / g of Megatron: the collective after a row-parallel layer (forward) or before a
  // column-parallel one (backward) on the activation (T x H).
  void tp_reduce(const char* name, Phase ph, double hidden_s = 0) {
    if (p.t == 1) return;
    const double bytes = cs.work_bytes * cs.T * static_cast<double>(m.H);
    comm(name, ph, OpKind::tp_comm, tp, p.sp ? Collective::reduce_scatter : Collective::all_reduce, bytes, hidden_s);
  }
  void tp_gather(const char* name, Phase ph, double hidden_s = 0) {
    if (p.t == 1 || !p.sp) return;
    comm(name, ph, OpKind::tp_comm, tp, Collective::all_gather, cs.work_bytes * cs.T * static_cast<double>(m.H), hidden_s);
  }
  // The sequence-parallel all-gather of the activation (or of its gradient) that feeds an
  // (M x K)(K x N) GEMM of a layer's attention or MLP block (or a shared expert's). With
  // Transformer Engine's user buffers (Acc::ub) it moves fp8 where the GEMMs are (their
  // fp8 inputs are gathered: ub_element_bytes) and overlaps that GEMM: split into t ring-exchange
  // steps, each transfer beside the GEMM of the chunk before it, so all but one t-th of the
  // GEMM hides it ("ring_exchange": the QKV and fc1 inputs, the output projection's and
  // fc2's output gradients). `bulk`: gathered whole behind a GEMM that does not need it
  // (the input gathered again for the weight gradient, behind the input-gradient GEMM),
  // which Megatron-core overlaps without user buffers too.
  void block_gather(const char* name, Phase ph, double M, double N, double K, bool bulk) {
    if (p.t == 1 || !p.sp) return;
    if (!ub) return tp_gather(name, ph, bulk ? gemm_s(M, N, K) : 0.0);
    const double t = static_cast<double>(p.t);
    const double g = bulk ? gemm_s(M, N, K) : split_gemm(ph, M / t, N, K, t, gemm_s(M, N, K));
    comm(name, ph, OpKind::tp_comm, tp, Collective::all_gather, ub_element_bytes(p, true, cs.work_bytes) * cs.T * static_cast<double>(m.H),
         bulk ? g : g * (t - 1.0) / t);
  }
  // An (M x K)(K x N) GEMM run as n GEMMs of (m_ x K)(K x n_) each: their time, the excess
  // over the whole GEMM's, each chunk at the efficiency of its own size, booked as compute
  // ("ub_split_gemm").
  // `whole`: the unsplit GEMM's time, (n m_ x K)(K x n_) or (m_ x K)(K x n n_).
  double split_gemm(Phase ph, double m_, double n_, double K, double n, double whole) {
    const double split = n * gemm_s(m_, n_, K);
    const double extra = std::max(0.0, split - whole);
    w(ph).compute_s += extra;
    if (ops) record("ub_split_gemm", ph, OpKind::gemm, 0, 0, extra, extra);
    return split;
  }
  // The collective after a row-parallel (M x K)(K x N) GEMM in the forward (the output
  // projection, fc2). With user buffers, in fp8 (Megatron-Bridge's and NeMo's fp8 configs
  // of every tensor-parallel recipe but one) as a ring exchange of t steps beside the GEMM
  // split over its M rows, exposed as the gathers' are; otherwise as Transformer Engine's
  // default, "pipeline": the GEMM split over its N output columns in kUbPipelineSplits
  // chunks, each chunk's reduce-scatter beside the next chunk's GEMM, the last chunk's
  // exposed and whatever of the rest outlasts the GEMM.
  static constexpr double kUbPipelineSplits = 4;  // Transformer Engine's default num_splits
  void block_reduce(const char* name, Phase ph, double M, double N, double K) {
    if (!ub) return tp_reduce(name, ph);
    const double bytes = cs.work_bytes * cs.T * static_cast<double>(m.H);
    const double c = collective_time(cl, tp, Collective::reduce_scatter, bytes);
    if (p.precision == Precision::fp8) {
      const double t = static_cast<double>(p.t), g = split_gemm(ph, M / t, N, K, t, gemm_s(M, N, K));
      book(name, ph, OpKind::tp_comm, bytes, c, g * (t - 1.0) / t);
      return;
    }
    const double n = kUbPipelineSplits, g = split_gemm(ph, M, N / n, K, n, gemm_s(M, N, K));
    book(name, ph, OpKind::tp_comm, bytes, c, (n - 1.0) / n * std::min(c, g));
  }
  // The same of a sequence-parallel activation `width` wide (MLA's latents), gathered before
  // its column-parallel layer and its gradient reduce-scattered after it.
  void sp_gather_width(const char* name, Phase ph, double width, double hidden_s = 0) {
    if (p.t == 1 || !p.sp) return;
    comm(name, ph, OpKind::tp_comm, tp, Collective::all_gather, cs.work_bytes * cs.T * width, hidden_s);
  }
  // The gradient of a `width`-wide input of column-parallel layers: reduce-scattered over
  // the sequence (sequence parallelism) or all-reduced.
  void tp_reduce_width(const char* name, Phase ph, double width, double hidden_s = 0) {
    if (p.t == 1) return;
    comm(name, ph, OpKind::tp_comm, tp, p.sp ? Collective::reduce_scatter : Collective::all_reduce,
         cs.work_bytes * cs.T * width, hidden_s);
  }
};

// Megatron's fused bias + dropout + residual add (or the embedding's dropout, without the
// residual): bytes of `elems` values of e bytes.
inline double dropout_bytes(double elems, double rate, int e, bool with_residual) {
  // bias + dropout + residual add (Megatron's fused bias_dropout_add): read x and the
  // residual, write y, write a 1-byte mask when dropout is on.
  return elems * ((with_residual ? 3.0 : 2.0) * e + (rate > 0 ? 1.0 : 0.0));
}

// With tp_comm_overlap, the input-gradient collective of a column-parallel layer runs
// beside its weight-gradient GEMM (Megatron's async all-reduce / reduce-scatter).
inline double wgrad_overlap(Acc& a, double M, double N, double K) {
  return a.cs.stack.tp_comm_overlap ? a.gemm_s(K, N, M) : 0.0;
}

// compute.cpp: the parameters' ZeRO-2/3 traffic of a piece of work (its definition says how).
void sharded_traffic(Acc& a, double params, const GroupSpan& group, const GroupSpan& across);

// compute_moe.cpp: the MoE block's sizes on this rank, its forward (also its replay under
// recompute) and backward, and the overlap of its expert exchanges with another
// micro-batch's compute; multi-latent attention's projections.
struct MoeSizes {
  double sent, arriving, local, per_expert, fc1, Ft, fs1, Fst;
};
MoeSizes moe_sizes(const Acc& a);
void moe_forward(Acc& a, Phase ph);
void moe_backward(Acc& a);
void overlap_expert_exchanges(Acc& a, size_t first_op);
void mla_up_forward(Acc& a, Phase ph);
void mla_projections_forward(Acc& a, Phase ph);
void mla_projections_backward(Acc& a);

}  // namespace strata::compute_detail
