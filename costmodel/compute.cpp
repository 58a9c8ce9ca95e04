// Op-by-op compute model; see compute.h. Every byte count below is per GPU and per
// micro-batch; e is the activation element size, 1-byte dropout masks.
#include "costmodel/compute.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "costmodel/comm.h"
#include "costmodel/memory.h"
#include "executor/cuda/attention_plan.h"
#include "executor/cuda/limits.h"
#include "executor/cuda/limits.h"

namespace strata {

const char* to_string(Phase ph) {
  switch (ph) {
    case Phase::forward: return "forward";
    case Phase::backward: return "backward";
    case Phase::recompute: return "recompute";
  }
  return "?";
}

const char* to_string(OpKind k) {
  switch (k) {
    case OpKind::gemm: return "gemm";
    case OpKind::memory: return "memory";
    case OpKind::tp_comm: return "tp_comm";
    case OpKind::cp_comm: return "cp_comm";
    case OpKind::dp_comm: return "dp_comm";
    case OpKind::ep_comm: return "ep_comm";
    case OpKind::offload: return "offload";
  }
  return "?";
}

Work& Work::operator+=(const Work& o) {
  compute_s += o.compute_s;
  tp_comm_s += o.tp_comm_s;
  cp_comm_s += o.cp_comm_s;
  dp_comm_s += o.dp_comm_s;
  ep_comm_s += o.ep_comm_s;
  offload_s += o.offload_s;
  tp_comm_all_s += o.tp_comm_all_s;
  dp_comm_all_s += o.dp_comm_all_s;
  return *this;
}

Work operator*(double k, const Work& w) {
  Work r;
  r.compute_s = k * w.compute_s;
  r.tp_comm_s = k * w.tp_comm_s;
  r.cp_comm_s = k * w.cp_comm_s;
  r.dp_comm_s = k * w.dp_comm_s;
  r.ep_comm_s = k * w.ep_comm_s;
  r.offload_s = k * w.offload_s;
  r.tp_comm_all_s = k * w.tp_comm_all_s;
  r.dp_comm_all_s = k * w.dp_comm_all_s;
  return r;
}

namespace {

// Columns per tensor-parallel rank of `q` query-wide tensors (Q, the attention output) and
// `kv` key- or value-wide ones (ModelSpec::kv_width: replicated groups when t > G).
// With multi-latent attention the second query-wide tensor (the output) and the second
// key-wide one (V) are Dv wide per head.
double head_columns(const ModelSpec& m, int64_t t, int q, int kv) {
  if (m.mla())
    return static_cast<double>(q >= 1 ? m.AD() / t : 0) + static_cast<double>(q >= 2 ? m.VD() / t : 0) +
           static_cast<double>(kv >= 1 ? m.kv_width(t) : 0) + static_cast<double>(kv >= 2 ? m.v_width(t) : 0);
  return static_cast<double>(q) * static_cast<double>(m.AD()) / static_cast<double>(t) +
         static_cast<double>(kv) * static_cast<double>(m.kv_width(t));
}

// Where a GEMM of `flops` at `peak_flops` reads the efficiency curve: the curve is measured
// in the 16-bit precision; a kernel at another peak runs for as long as a 16-bit one of
// flops * (bf16 peak / its peak), and fixed costs are in time.
double gemm_curve_x(const Device& dev, double peak_flops, double flops) {
  const double ref = dev.peak_bf16_flops > 0 ? dev.peak_bf16_flops : dev.peak_fp16_flops;
  return ref > 0 ? flops * ref / peak_flops : flops;
}

// The roofline with the memory time from `memory_s(bytes)` (memory_time, or a memo of it).
template <class MemoryTime>
double roofline(const Device& dev, double flops, double bytes, double rate, MemoryTime&& memory_s) {
  return std::max({flops / rate, memory_s(bytes), dev.kernel_launch_s});
}

}  // namespace

double gemm_efficiency(const Device& dev, double peak_flops, double flops) {
  return dev.gemm_efficiency.at(gemm_curve_x(dev, peak_flops, flops));
}

double roofline_time(const Device& dev, double flops, double bytes, double rate) {
  return roofline(dev, flops, bytes, rate, [&](double b) { return memory_time(dev, b); });
}

double gemm_time(const Device& dev, double peak_flops, double M, double N, double K, double elem_bytes) {
  const double flops = 2.0 * M * N * K;
  return roofline_time(dev, flops, elem_bytes * (M * K + K * N + M * N),
                       peak_flops * gemm_efficiency(dev, peak_flops, flops));
}

double memory_time(const Device& dev, double bytes) {
  if (bytes <= 0) return 0;
  const double t = bytes / (dev.memory_bandwidth_bytes_per_s * dev.memory_efficiency.at(bytes));
  return std::max(t, dev.kernel_launch_s);
}

double memory_time(const Device& dev, double bytes, MemKind kind) {
  if (bytes <= 0) return 0;
  const double t = bytes / (dev.memory_bandwidth_bytes_per_s * dev.memory_curve(kind).at(bytes));
  return std::max(t, dev.kernel_launch_s);
}

ComputeSetup compute_setup(const ModelSpec& m, const Cluster& cl, const Plan& p) {
  ComputeSetup cs;
  cs.stack = resolve_stack(m, cl, p);
  cs.attention = cs.stack.attention;
  cs.act_bytes = bytes_of(p.precision);
  // The strata executor computes and communicates in float storage whatever the precision
  // (16-bit values are rounded floats, stored in 16 bits only while saved for the backward).
  cs.work_bytes = cs.stack.strata ? 4 : cs.act_bytes;
  cs.T = static_cast<double>(p.mbs) * static_cast<double>(m.S) / static_cast<double>(p.c);
  cs.Tn = p.sp ? cs.T / static_cast<double>(p.t) : cs.T;
  // Gradients are accumulated and reduced in fp32, or with grad_reduce_in_fp32 off (the
  // default in fp16 training) in 16 bits (resolve_stack). The strata executor keeps fp32
  // gradients in every precision.
  cs.grad_bytes = cs.stack.grad_reduce_in_fp32 || p.precision == Precision::fp32 ? 4.0 : 2.0;
  cs.weight_bytes = p.precision == Precision::fp32 ? 4.0 : p.precision == Precision::fp8 ? 1.0 : 2.0;
  cs.weight_work_bytes = cs.stack.strata ? 4.0 : cs.weight_bytes;  // its parameter gathers send floats
  cs.cp_comm = p.c > 1 ? resolve_cp_comm(m, cl, p) : CpComm::p2p;  // (nothing to move without context parallelism)
  return cs;
}

namespace {

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
    peak_linear = dev.peak_flops(p.precision);
    const bool tc_flash = !cs.stack.strata || (cuda::flash_tc_head_dim(m.D()) && dev.peak_bf16_flops > 0);
    peak_flash = tc_flash ? peak_attn : dev.peak_fp32_flops;
    lin_bytes = p.precision == Precision::fp8 ? 1.0 : cs.work_bytes;
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
    if (ph != Phase::backward) return t + gemm(name, ph, M, N, K, peak_linear, lin_bytes);
    if (p.precision == Precision::fp8) t += mem("fp8_cast", ph, 3.0 * M * N);
    t += gemm(name, ph, M, K, N, peak_linear, lin_bytes);   // dgrad
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

}  // namespace

double grad_accumulation_bytes(Precision prec, double grad_bytes) {
  if (prec == Precision::fp32) return 8.0;                      // fp32 .grad read and written
  if (prec == Precision::fp16 && grad_bytes < 4.0) return 4.0;  // fp16 .grad read and written (GEMM beta = 1)
  // The 16-bit grad written and read, the main gradient (fp32, or 16-bit with
  // grad_reduce_in_fp32 off) read and written: 12 bytes, or 8.
  return 4.0 + 2.0 * grad_bytes;
}

namespace {

double dropout_bytes(double elems, double rate, int e, bool with_residual) {
  // bias + dropout + residual add (Megatron's fused bias_dropout_add): read x and the
  // residual, write y, write a 1-byte mask when dropout is on.
  return elems * ((with_residual ? 3.0 : 2.0) * e + (rate > 0 ? 1.0 : 0.0));
}

// With tp_comm_overlap, the input-gradient collective of a column-parallel layer runs
// beside its weight-gradient GEMM (Megatron's async all-reduce / reduce-scatter).
double wgrad_overlap(Acc& a, double M, double N, double K) {
  return a.cs.stack.tp_comm_overlap ? a.gemm_s(K, N, M) : 0.0;
}

// The share of the Sq x Sk score products the strata executor's unfused attention computes
// with context parallelism: each of its two chunks of S/2c queries against the keys up to
// the chunk's end, (2c + 1)/(4c) of the block in all; 1 otherwise (the whole S x S).
double strata_cp_keys(const Acc& a) {
  if (!a.cs.stack.strata || a.p.c <= 1) return 1.0;
  const double c = static_cast<double>(a.p.c);
  return (2.0 * c + 1.0) / (4.0 * c);
}

// Attention core forward (after QKV, before the output projection).
double attention_core_forward(Acc& a, Phase ph) {
  const ModelSpec& m = a.m;
  const Plan& p = a.p;
  const double e = a.cs.work_bytes;
  const double heads = static_cast<double>(p.mbs) * static_cast<double>(m.A / p.t);  // Bh
  const double Sq = static_cast<double>(m.S) / static_cast<double>(p.c), Sk = static_cast<double>(m.S);
  const double D = static_cast<double>(m.D());
  double t = 0;
  if (a.cs.attention == AttentionKernel::flash) {
    // Causal: half of the S x S blocks (load-balanced across context-parallel ranks too),
    // less with a sliding window (ModelSpec::causal_share).
    // (Multi-latent attention: QK^T over D, AV over Dv.)
    const double flops = m.mla() ? 2.0 * heads * Sq * Sk * (D + static_cast<double>(m.Dv())) * m.causal_share()
                                 : 4.0 * heads * Sq * Sk * D * m.causal_share();
    const double bytes = e * a.cs.T * head_columns(m, p.t, 2, 2);
    t = a.kernel("flash_attention", ph, flops, bytes, a.peak_flash * a.cl.device.flash_fwd_efficiency);
  } else {
    const double n_s = heads * Sq * Sk;  // attention score elements
    // QK^T and AV as batched GEMMs: Bh products of (Sq x D)(D x Sk) and (Sq x Sk)(Sk x Dv).
    const double flops = 2.0 * heads * Sq * Sk * D * strata_cp_keys(a);
    const double Dv = static_cast<double>(m.Dv()), av_flops = m.mla() ? flops / D * Dv : flops;
    t += a.batched("attn_scores", ph, flops, e * (heads * (Sq * D + Sk * D) + n_s), heads, Sk);
    t += a.mem("softmax", ph, 2.0 * e * n_s);  // fused scale + mask + softmax
    if (m.attention_dropout > 0) t += a.mem("attn_dropout", ph, (2.0 * e + 1.0) * n_s);
    t += a.batched("attn_context", ph, av_flops, e * (n_s + heads * (Sk * Dv + Sq * Dv)), heads, Sk);
  }
  // Context parallel (cp_comm_type). p2p: ring exchange of K and V, (c-1) steps, hidden
  // behind the core. allgather: K and V gathered before the core (the same bytes), exposed;
  // the strata executor does this too. a2a: Q, K and V all-to-all'ed before the core (the
  // sequence split traded for a head split) and the output back after it, exposed.
  if (p.c > 1) {
    const double kv_bytes = e * a.cs.T * static_cast<double>(m.kv_width(p.t) + m.v_width(p.t));  // this rank's K and V
    if (a.cs.stack.strata) {
      // Selective recompute's core reuses the keys and values its backward gathers.
      if (!(ph == Phase::recompute && p.recomputes(kRecomputeCoreAttn)))
        a.comm("cp_kv_gather", ph, OpKind::cp_comm, a.cp, Collective::all_gather, kv_bytes * static_cast<double>(p.c));
    } else if (a.cs.cp_comm == CpComm::allgather) {
      a.comm("cp_kv_gather", ph, OpKind::cp_comm, a.cp, Collective::all_gather, kv_bytes * static_cast<double>(p.c));
    } else if (a.cs.cp_comm == CpComm::a2a) {
      const double q_bytes = e * a.cs.T * static_cast<double>(m.AD() / p.t);  // Q
      const double o_bytes = e * a.cs.T * static_cast<double>(m.VD() / p.t);  // the core's output
      a.comm("cp_qkv_all_to_all", ph, OpKind::cp_comm, a.cp, Collective::all_to_all, q_bytes + kv_bytes);
      a.comm("cp_out_all_to_all", ph, OpKind::cp_comm, a.cp, Collective::all_to_all, o_bytes);
    } else {
      a.comm("cp_kv_exchange", ph, OpKind::cp_comm, a.cp, Collective::send_recv,
             kv_bytes * static_cast<double>(p.c - 1), t);
    }
  }
  return t;
}

// mlp_s: the MLP block's backward compute before it, behind which the strata executor
// gathers the keys and values again.
double attention_core_backward(Acc& a, double mlp_s) {
  const ModelSpec& m = a.m;
  const Plan& p = a.p;
  const double e = a.cs.work_bytes;
  const double heads = static_cast<double>(p.mbs) * static_cast<double>(m.A / p.t);
  const double Sq = static_cast<double>(m.S) / static_cast<double>(p.c), Sk = static_cast<double>(m.S);
  const double D = static_cast<double>(m.D());
  const Phase ph = Phase::backward;
  double t = 0;
  if (a.cs.attention == AttentionKernel::flash) {
    // FlashAttention-2 backward: five S x S x D products against two in forward.
    // (Multi-latent attention: the recomputed S and dQ, dK, dS over D; dP, dV over Dv.)
    const double flops = m.mla() ? 2.0 * heads * Sq * Sk * (3.0 * D + 2.0 * static_cast<double>(m.Dv())) * m.causal_share()
                                 : 10.0 * heads * Sq * Sk * D * m.causal_share();
    const double bytes = 2.0 * e * a.cs.T * head_columns(m, p.t, 2, 2);
    t = a.kernel("flash_attention", ph, flops, bytes, a.peak_flash * a.cl.device.flash_bwd_efficiency);
  } else {
    const double n_s = heads * Sq * Sk;
    const double flops = 2.0 * heads * Sq * Sk * D * strata_cp_keys(a);
    const double bytes = e * n_s + e * heads * (Sk * D + Sq * D);
    const double Dv = static_cast<double>(m.Dv());
    const double av_flops = m.mla() ? flops / D * Dv : flops, av_bytes = m.mla() ? e * n_s + e * heads * (Sk * Dv + Sq * Dv) : bytes;
    t += a.batched("attn_context", ph, av_flops, av_bytes, heads, Sk);  // dP = dO V^T
    t += a.batched("attn_context", ph, av_flops, av_bytes, heads, Sk);  // dV = P^T dO
    if (m.attention_dropout > 0) t += a.mem("attn_dropout", ph, (2.0 * e + 1.0) * n_s);
    t += a.mem("softmax", ph, 3.0 * e * n_s);           // read y and dy, write dx
    t += a.batched("attn_scores", ph, flops, bytes, heads, Sk);   // dQ = dS K
    t += a.batched("attn_scores", ph, flops, bytes, heads, Sk);   // dK = dS^T Q
  }
  if (p.c > 1) {
    // K, V travel again and their gradients travel back (strata: an all-gather started
    // before the MLP block's backward and a reduce-scatter, exposed; allgather: both
    // exposed; a2a: the output's gradient all-to-all'ed before the core and those of Q, K
    // and V after it, exposed).
    const double kv_bytes = e * a.cs.T * static_cast<double>(m.kv_width(p.t) + m.v_width(p.t));
    if (a.cs.stack.strata || a.cs.cp_comm == CpComm::allgather) {
      a.comm("cp_kv_gather", ph, OpKind::cp_comm, a.cp, Collective::all_gather, kv_bytes * static_cast<double>(p.c),
             a.cs.stack.strata ? mlp_s : 0.0);
      a.comm("cp_dkv_reduce_scatter", ph, OpKind::cp_comm, a.cp, Collective::reduce_scatter,
             kv_bytes * static_cast<double>(p.c));
    } else if (a.cs.cp_comm == CpComm::a2a) {
      const double q_bytes = e * a.cs.T * static_cast<double>(m.AD() / p.t);
      const double o_bytes = e * a.cs.T * static_cast<double>(m.VD() / p.t);
      a.comm("cp_out_all_to_all", ph, OpKind::cp_comm, a.cp, Collective::all_to_all, o_bytes);
      a.comm("cp_qkv_all_to_all", ph, OpKind::cp_comm, a.cp, Collective::all_to_all, q_bytes + kv_bytes);
    } else {
      a.comm("cp_kv_exchange", ph, OpKind::cp_comm, a.cp, Collective::send_recv,
             2.0 * kv_bytes * static_cast<double>(p.c - 1), t);
    }
  }
  return t;
}

// The strata executor's own passes over a layer's 16-bit tensors (executor/gpt.cpp), which
// it holds as floats, one pass per tensor: rounding reads and writes 4 bytes per value;
// packing a saved tensor into 16 bits after the forward reads 4 and writes 2 bytes per value,
// unpacking it before the backward the reverse. Values per layer and micro-batch on this rank,
// with n tokens (sequence shard) and N (gathered): the forward rounds x, h1, x2, h2 (n H
// each), qkv (N Q), the attention output (N AD/t), the fc1 output (N F1/t) and the activation
// (N F/t); the backward rounds the GEMM inputs dy, dO (N H each), du (N F1/t), datt (N AD/t)
// and dqkv (N Q). Kept and packed: those of the forward, the gathered g1 and g2 with sequence
// parallelism (N H each) and the unfused core's probabilities (B A/t S^2) when nothing is
// recomputed; full recompute keeps only x. Nothing of this runs outside the strata stack or
// in fp32.
struct Tensors {
  std::array<double, 12> values{};
  int count = 0;
  void add(double v) { values[static_cast<size_t>(count++)] = v; }
};
struct SixteenBitPasses {
  Tensors forward_rounds, backward_rounds, kept;
};

SixteenBitPasses sixteen_bit_passes(const Acc& a) {
  SixteenBitPasses v;
  const Plan& p = a.p;
  if (!a.cs.stack.strata || (p.precision != Precision::bf16 && p.precision != Precision::fp16)) return v;
  const ModelSpec& m = a.m;
  const double T = a.cs.T, Tn = a.cs.Tn, H = static_cast<double>(m.H), t = static_cast<double>(p.t);
  const double Q = head_columns(m, p.t, 1, 2), ADt = static_cast<double>(m.AD()) / t;
  const double F1 = static_cast<double>(m.fc1_out()) / t, Ft = static_cast<double>(m.F) / t;
  for (double x : {Tn * H, Tn * H, T * Q, T * ADt, Tn * H, Tn * H, T * F1, T * Ft}) v.forward_rounds.add(x);
  for (double x : {T * H, T * F1, T * H, T * ADt, T * Q}) v.backward_rounds.add(x);
  if (p.recompute == Recompute::full) {
    v.kept.add(Tn * H);
    return v;
  }
  v.kept = v.forward_rounds;
  if (p.sp && p.t > 1) {
    v.kept.add(T * H);
    v.kept.add(T * H);
  }
  if (a.cs.attention == AttentionKernel::unfused && p.recompute == Recompute::none) {
    const double S = static_cast<double>(m.S);
    v.kept.add(static_cast<double>(p.mbs) * static_cast<double>(m.A / p.t) * S * S);
  }
  return v;
}

// One memory-bound pass per tensor, `bytes_per_value` each.
void passes(Acc& a, const char* name, Phase ph, const Tensors& ts, double bytes_per_value, MemKind kind) {
  for (int i = 0; i < ts.count; ++i) a.mem(name, ph, bytes_per_value * ts.values[static_cast<size_t>(i)], kind);
}

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
struct MoeSizes {
  double sent, arriving, local, per_expert, fc1, Ft, fs1, Fst;
};
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

// A dense MLP's forward (also what recompute_modules mlp runs again).
void dense_mlp_forward(Acc& a, Phase ph) {
  const ModelSpec& m = a.m;
  const double e = a.cs.work_bytes, T = a.cs.T, H = static_cast<double>(m.H), t = static_cast<double>(a.p.t);
  const double fc1_cols = static_cast<double>(m.fc1_out()) / t, Ft = static_cast<double>(m.F) / t;
  a.block_gather("sp_all_gather", ph, T, fc1_cols, H, false);
  a.linear("fc1", ph, T, fc1_cols, H);
  a.mem(to_string(m.activation), ph, (m.gated() ? 3.0 : 2.0) * e * T * Ft, MemKind::activation);
  a.linear("fc2", ph, T, H, Ft);
  a.block_reduce(a.p.sp ? "sp_reduce_scatter" : "tp_all_reduce", ph, T, H, Ft);
}

// The attention output projection's input width on a tensor-parallel rank: heads x D, or
// with multi-latent attention heads x v_head_dim.
double proj_width(const ModelSpec& m, int64_t t) {
  return static_cast<double>(m.mla() ? m.VD() : m.AD()) / static_cast<double>(t);
}

// The forward of one layer (also replayed by full recompute), but for packing what it
// keeps (pack_kept).
void layer_forward(Acc& a, Phase ph) {
  const ModelSpec& m = a.m;
  const Plan& p = a.p;
  const double e = a.cs.work_bytes, T = a.cs.T, Tn = a.cs.Tn, H = static_cast<double>(m.H);
  const double qkv_cols = head_columns(m, p.t, 1, 2);
  a.mem("norm1", ph, 2.0 * e * Tn * H, MemKind::norm);
  if (m.mla()) {
    mla_projections_forward(a, ph);
  } else {
    a.block_gather("sp_all_gather", ph, T, qkv_cols, H, false);
    a.linear("qkv", ph, T, qkv_cols, H);
    if (m.position == Position::rope) a.mem("rope", ph, 2.0 * e * T * head_columns(m, p.t, 1, 1));
  }
  attention_core_forward(a, ph);
  const double proj_in = proj_width(m, p.t);
  a.linear("attn_proj", ph, T, H, proj_in);
  a.block_reduce(p.sp ? "sp_reduce_scatter" : "tp_all_reduce", ph, T, H, proj_in);
  a.mem("bias_dropout_add", ph, dropout_bytes(Tn * H, m.hidden_dropout, a.cs.work_bytes, true));
  a.mem("norm2", ph, 2.0 * e * Tn * H, MemKind::norm);
  if (m.moe()) {
    moe_forward(a, ph);
  } else {
    dense_mlp_forward(a, ph);
  }
  a.mem("bias_dropout_add", ph, dropout_bytes(Tn * H, m.hidden_dropout, a.cs.work_bytes, true));
  if (a.cs.stack.strata) passes(a, "round16", ph, sixteen_bit_passes(a).forward_rounds, 8.0, MemKind::round16);
}

// After the forward (not its replay): the tensors it keeps packed into 16 bits.
void pack_kept(Acc& a) {
  if (a.cs.stack.strata) passes(a, "pack16", Phase::forward, sixteen_bit_passes(a).kept, 6.0, MemKind::generic);
}

void layer_backward(Acc& a) {
  const ModelSpec& m = a.m;
  const Plan& p = a.p;
  const Phase ph = Phase::backward;
  const double e = a.cs.work_bytes, T = a.cs.T, Tn = a.cs.Tn, H = static_cast<double>(m.H);
  const double t = static_cast<double>(p.t);
  const double qkv_cols = head_columns(m, p.t, 1, 2);
  const double fc1_cols = static_cast<double>(m.fc1_out()) / t;
  const double Ft = static_cast<double>(m.F) / t;
  const double mask = m.hidden_dropout > 0 ? 1.0 : 0.0;
  // MLP block, in reverse.
  const double compute0 = a.w(ph).compute_s;
  a.mem("bias_dropout_add", ph, (2.0 * e + mask) * Tn * H);
  if (m.moe()) {
    moe_backward(a);
  } else {
    a.block_gather("sp_all_gather", ph, T, Ft, H, false);  // backward of the reduce-scatter after fc2, for its dgrad
    a.linear("fc2", ph, T, H, Ft);
    a.mem(to_string(m.activation), ph,
          (m.gated() ? 5.0 : 3.0) * e * T * Ft, MemKind::activation);
    // fc1: the sequence-parallel input is gathered again for wgrad, behind dgrad.
    a.block_gather("sp_all_gather", ph, T, H, fc1_cols, true);
    a.linear("fc1", ph, T, fc1_cols, H);
    a.tp_reduce(p.sp ? "sp_reduce_scatter" : "tp_all_reduce", ph, wgrad_overlap(a, T, fc1_cols, H));
  }
  a.mem("norm2", ph, 3.0 * e * Tn * H, MemKind::norm);
  const double mlp_s = a.w(ph).compute_s - compute0;
  // Attention block, in reverse.
  a.mem("bias_dropout_add", ph, (2.0 * e + mask) * Tn * H);
  const double proj_in = proj_width(m, p.t);
  a.block_gather("sp_all_gather", ph, T, proj_in, H, false);  // the output gradient, for the projection's dgrad
  a.linear("attn_proj", ph, T, H, proj_in);
  attention_core_backward(a, mlp_s);
  if (m.mla()) {
    mla_projections_backward(a);
  } else {
    if (m.position == Position::rope) a.mem("rope", ph, 2.0 * e * T * head_columns(m, p.t, 1, 1));
    a.block_gather("sp_all_gather", ph, T, H, qkv_cols, true);
    a.linear("qkv", ph, T, qkv_cols, H);
    a.tp_reduce(p.sp ? "sp_reduce_scatter" : "tp_all_reduce", ph, wgrad_overlap(a, T, qkv_cols, H));
  }
  a.mem("norm1", ph, 3.0 * e * Tn * H, MemKind::norm);
  if (!a.cs.stack.grad_accumulation_fusion)
    a.mem("grad_accumulation", ph, grad_accumulation_bytes(p.precision, a.cs.grad_bytes) * static_cast<double>(m.layer_params(p.t, p.ep, p.etp)));
  if (!a.cs.stack.strata) return;
  const SixteenBitPasses sb = sixteen_bit_passes(a);
  passes(a, "unpack16", ph, sb.kept, 6.0, MemKind::generic);
  passes(a, "round16", ph, sb.backward_rounds, 8.0, MemKind::round16);
}

// ZeRO-2/3: a piece of work's gradient of every micro-batch is reduce-scattered into the
// shards (no rank keeps a whole gradient between micro-batches: DeepSpeed ZeRO-2, FSDP,
// the strata executor), ZeRO-2's behind the backward where the stack overlaps the
// data-parallel reduction (DeepSpeed's overlap_comm) and exposed where it does not; ZeRO-3
// always prefetches, and also gathers the piece's parameters before its forward and again
// before its backward. Each hides behind the piece's own time on the compute stream in that
// phase: its kernels and its exposed tensor-, context- and expert-parallel collectives, since the
// data-parallel stream runs on while the compute stream waits for those. (Behind the
// kernels alone, a faster GPU could make a step slower: every collective of a phase would
// lose the same cover at once.)
// `group`: the ranks holding those parameters (Acc::dp; the experts' Acc::edp). With hybrid
// sharding (`across`: the instances, Acc::dp_across, Acc::edp_across) the reduce-scattered
// shard is then all-reduced between the instances, on the same stream, behind what the
// collectives before it left of the window.
void sharded_traffic(Acc& a, double params, const GroupSpan& group, const GroupSpan& across) {
  if (a.p.zero < 2 || (group.size <= 1 && across.size <= 1) || params <= 0) return;
  const double fwd = Acc::on_stream(a.lc.forward);
  const double bwd = Acc::on_stream(a.lc.backward) + Acc::on_stream(a.lc.recompute);
  const double g = a.cs.grad_bytes * params;
  auto between_instances = [&](double hidden) {
    if (across.size > 1)
      a.comm("hsdp_all_reduce", Phase::backward, OpKind::dp_comm, across, Collective::all_reduce,
             g / static_cast<double>(group.size), hidden);
  };
  if (a.p.zero == 2) {
    const bool overlap = a.cs.stack.overlap_grad_reduce;
    const double rs = a.comm("zero2_reduce_scatter", Phase::backward, OpKind::dp_comm, group,
                             Collective::reduce_scatter, g, overlap ? bwd : 0.0);
    between_instances(overlap ? std::max(0.0, bwd - rs) : 0.0);
    return;
  }
  const double w = a.cs.weight_work_bytes * params;
  const double ag = collective_time(a.cl, group, Collective::all_gather, w);
  // The strata executor's gathers progress only while it polls between kernels: exposed
  // (its stack table in hw_profiles/README.md); its reduce-scatters overlap the backward.
  const bool strata = a.cs.stack.strata;
  a.comm("zero3_all_gather", Phase::forward, OpKind::dp_comm, group, Collective::all_gather, w, strata ? 0.0 : fwd);
  a.comm("zero3_all_gather", Phase::backward, OpKind::dp_comm, group, Collective::all_gather, w, strata ? 0.0 : bwd);
  const double rs = a.comm("zero3_reduce_scatter", Phase::backward, OpKind::dp_comm, group, Collective::reduce_scatter,
                           g, strata ? bwd : std::max(0.0, bwd - ag));
  between_instances(strata ? std::max(0.0, bwd - rs) : std::max(0.0, bwd - ag - rs));
}

}  // namespace

namespace {

// Fine-grained activation offloading (compute.h, layer_cost). The copies out run on their
// own stream and the forward never waits for them (Megatron-core waits only to reload).
// The backward reloads a layer ahead: Megatron-core keeps the last layer's groups of the
// first chunk on the GPU (its margin), and as each group's backward ends it reloads the
// next one offloaded, the same module's one layer down, so a layer's copies back hide
// behind one layer's backward (with its recompute); what they do not cover is exposed. The
// fraction offloads that share of the layers, each whole.
[[gnu::noinline]] void activation_offload(Acc& a) {
  const Host& h = a.cl.host;
  if (!h.present()) return;
  const LayerOffload lo = layer_offload(a.m, a.p, a.cs);
  if (lo.n == 0) return;
  const double ranks = static_cast<double>(std::min(a.cl.devices_per_node, a.p.world_size()));
  const double copy = std::max(lo.copied / (h.pcie_bandwidth_bytes_per_s * h.pcie_efficiency),
                               ranks * lo.copied / (h.memory_bandwidth_bytes_per_s * h.memory_efficiency));
  const double f = a.p.activation_offload_fraction;
  const double exposed = f * std::max(0.0, copy - Acc::on_stream(a.lc.backward) - Acc::on_stream(a.lc.recompute));
  a.lc.backward.offload_s += exposed;
  if (a.ops) {
    a.record("activation_offload", Phase::forward, OpKind::offload, 0, f * lo.copied, f * copy, 0.0);
    a.record("activation_reload", Phase::backward, OpKind::offload, 0, f * lo.copied, f * copy, exposed);
  }
}

}  // namespace

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
void overlap_expert_exchanges(Acc& a, size_t first_op) {
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

LayerCost layer_cost(const ModelSpec& m, const Cluster& cl, const Plan& p, const ComputeSetup& cs,
                     std::vector<OpCost>* ops) {
  Acc a(m, cl, p, cs, ops);
  const size_t first_op = ops ? ops->size() : 0;
  layer_forward(a, Phase::forward);
  // Full recompute replays the forward's ops, each costing what it cost there (a function
  // of its sizes alone), summed in the same order: the same bits. Walked again only when
  // the op list is asked for.
  const bool replay = p.recompute == Recompute::full;
  if (replay && !ops) a.lc.recompute = a.lc.forward;
  pack_kept(a);
  if (replay && ops) layer_forward(a, Phase::recompute);
  if (p.recomputes(kRecomputeCoreAttn)) attention_core_forward(a, Phase::recompute);
  if (p.recomputes(kRecomputeLayernorm)) {  // both norms' outputs again
    const double bytes = 2.0 * cs.work_bytes * cs.Tn * static_cast<double>(m.H);
    a.mem("norm1", Phase::recompute, bytes, MemKind::norm);
    a.mem("norm2", Phase::recompute, bytes, MemKind::norm);
  }
  if (m.moe() && p.recomputes(kRecomputeMoeAct)) {  // the experts' activation function again
    const MoeSizes z = moe_sizes(a);
    a.mem(to_string(m.activation), Phase::recompute, (m.gated() ? 3.0 : 2.0) * cs.work_bytes * z.arriving * z.Ft, MemKind::activation);
  }
  if (m.mla() && p.recomputes(kRecomputeMlaUpProj)) mla_up_forward(a, Phase::recompute);
  if (!m.moe() && p.recomputes(kRecomputeMlp)) {  // (the pre-MLP norm, fused into fc1 on the modern stack, again)
    if (cs.stack.modern && !p.recomputes(kRecomputeLayernorm))
      a.mem("norm2", Phase::recompute, 2.0 * cs.work_bytes * cs.Tn * static_cast<double>(m.H), MemKind::norm);
    dense_mlp_forward(a, Phase::recompute);
  }
  layer_backward(a);
  if (m.moe() && p.moe_a2a_overlap) overlap_expert_exchanges(a, first_op);
  if (m.moe()) {  // the experts' parameters are sharded over their own replicas
    const double experts = static_cast<double>(m.layer_expert_params(p.expert_tp(), p.ep));
    // (Each hides behind the layer's whole compute window: together they may claim more
    // cover than there is; an approximation.)
    sharded_traffic(a, static_cast<double>(m.layer_params(p.t, p.ep, p.etp)) - experts, a.dp, a.dp_across);
    sharded_traffic(a, experts, a.edp, a.edp_across);
  } else {
    sharded_traffic(a, static_cast<double>(m.layer_params(p.t)), a.dp, a.dp_across);
  }
  if (p.offload_modules) activation_offload(a);
  return a.lc;
}

LayerCost embedding_cost(const ModelSpec& m, const Cluster& cl, const Plan& p, const ComputeSetup& cs,
                         std::vector<OpCost>* ops) {
  Acc a(m, cl, p, cs, ops);
  const double e = cs.work_bytes, T = cs.T, H = static_cast<double>(m.H);
  // Vocab-parallel lookup: each tp rank writes the rows it owns, then the partial sums are
  // reduced (all-reduce, or reduce-scatter onto sequence shards).
  double bytes = 2.0 * e * T * H;
  if (m.position == Position::learned) bytes += 2.0 * e * T * H;
  a.mem("embedding", Phase::forward, bytes);
  a.tp_reduce(p.sp ? "sp_reduce_scatter" : "tp_all_reduce", Phase::forward);
  if (m.hidden_dropout > 0) a.mem("embedding_dropout", Phase::forward, dropout_bytes(cs.Tn * H, m.hidden_dropout, cs.work_bytes, false));
  a.tp_gather("sp_all_gather", Phase::backward);
  // Scatter-add of the output gradient into the fp32 embedding gradient rows.
  a.mem("embedding", Phase::backward, (e + 2.0 * cs.grad_bytes) * T * H);
  if (!cs.stack.grad_accumulation_fusion)
    a.mem("grad_accumulation", Phase::backward,
          grad_accumulation_bytes(p.precision, a.cs.grad_bytes) * static_cast<double>(m.word_embedding_params(p.t)));
  sharded_traffic(a, static_cast<double>(m.word_embedding_params(p.t) + m.position_params()), a.dp, a.dp_across);
  return a.lc;
}

namespace {

// The final norm `norm`, the vocabulary-parallel output layer and the loss of one
// micro-batch, forward and backward: head_cost's, and each multi-token prediction module's
// with the shared output layer.
void output_and_loss(Acc& a, const char* norm) {
  const ModelSpec& m = a.m;
  const Plan& p = a.p;
  const ComputeSetup& cs = a.cs;
  const double e = cs.work_bytes, T = cs.T, H = static_cast<double>(m.H);
  const double Vt = static_cast<double>(m.padded_vocab(p.t)) / static_cast<double>(p.t);
  const double peak = p.precision == Precision::fp8 ? a.cl.device.peak_bf16_flops : a.cl.device.peak_flops(p.precision);
  const double eb = cs.work_bytes;
  // The strata executor in 16-bit precisions rounds the final norm's output (its rows on
  // this rank) to 16 bits in place: a `round16` pass of its own, as in the layers
  // (executor/gpt.cpp head_forward); the logit gradients it rounds in the cross-entropy's
  // backward pass, which writes them (below).
  // (bf16 and fp16 only, as the layers' passes: sixteen_bit_passes. The executor refuses
  // fp8; the modules of multi-token prediction, which it refuses too, book theirs alike.)
  const bool rounds16 = cs.stack.strata && (p.precision == Precision::bf16 || p.precision == Precision::fp16);
  a.mem(norm, Phase::forward, 2.0 * e * cs.Tn * H, MemKind::norm);
  if (rounds16) a.mem("round16", Phase::forward, 8.0 * cs.Tn * H, MemKind::round16);
  a.tp_gather("sp_all_gather", Phase::forward);
  a.gemm("lm_head", Phase::forward, T, Vt, H, peak, eb);
  // Vocab-parallel cross-entropy on the T x V/t logits; three all-reduces of T floats (max,
  // sum, target logit; the strata executor's sum and target logit go in one of 2T).
  // Bytes per logit element:
  // - unfused (Megatron-LM's, DeepSpeed's, this repository's): cast to fp32 (e + 4), max (4),
  //   subtract (8), exp (8), sum (4), normalise in place and keep for backward (8) = e + 36;
  //   backward: copy the softmax (8), subtract the one-hot and scale (8), cast back (4 + e).
  // - fused (the modern stack: Megatron-core's cross_entropy_loss_fusion, Transformer
  //   Engine's kernel): one pass reads the e-byte logits for the running max and sum, a
  //   second reads them again and writes the gradient in their place (3e); backward scales
  //   that gradient in place (2e).
  // - the strata executor's (executor/cuda/cross_entropy.cu, the CPU backend's alike) on
  //   its fp32 logits: max (4), the sum of exponentials (4), reading the logits only = 8;
  //   backward: each probability computed again from its logit, the gradient written in
  //   its place, rounded to 16 bits in the same pass (8).
  const bool fused_ce = cs.stack.modern;
  const double fwd_ce = cs.stack.strata ? 8.0 : fused_ce ? 3.0 * e : e + 36.0;
  const double bwd_ce = cs.stack.strata ? 8.0 : fused_ce ? 2.0 * e : 20.0 + e;
  a.mem("cross_entropy", Phase::forward, fwd_ce * T * Vt);
  if (p.t > 1 && cs.stack.strata) {  // the executor's two: the maximum, then the sum and target logit together
    a.comm("ce_all_reduce", Phase::forward, OpKind::tp_comm, a.tp, Collective::all_reduce, 4.0 * T);
    a.comm("ce_all_reduce", Phase::forward, OpKind::tp_comm, a.tp, Collective::all_reduce, 8.0 * T);
  } else if (p.t > 1) {
    for (int i = 0; i < 3; ++i)
      a.comm("ce_all_reduce", Phase::forward, OpKind::tp_comm, a.tp, Collective::all_reduce, 4.0 * T);
  }
  a.mem("cross_entropy", Phase::backward, bwd_ce * T * Vt);
  if (!cs.stack.grad_accumulation_fusion)
    a.mem("grad_accumulation", Phase::backward, grad_accumulation_bytes(p.precision, a.cs.grad_bytes) * H * Vt);
  a.gemm("lm_head", Phase::backward, T, H, Vt, peak, eb);   // dgrad
  a.wgrad("lm_head", Phase::backward, H, Vt, T, peak, eb);  // wgrad
  a.tp_reduce(p.sp ? "sp_reduce_scatter" : "tp_all_reduce", Phase::backward);
  a.mem(norm, Phase::backward, 3.0 * e * cs.Tn * H, MemKind::norm);
}

// One multi-token prediction module (ModelSpec::mtp_layers; Megatron-core's
// MultiTokenPredictionLayer) but for its transformer layer, which estimate.cpp adds as a
// layer of its kind: the next tokens' embeddings looked up (the word embedding's copy on
// this stage) and reduced as the embedding's are; enorm and hnorm; their concatenation
// (T x 2H, written once); eh_proj, column-parallel (2H -> H/t; with sequence parallelism its
// input gathered first), its output gathered over the tensor-parallel ranks (T x H: the
// region's all-gather along the hidden dimension), then split onto the sequence shards
// again (a view); after the layer the final norm, the shared output layer and the loss as
// head_cost runs them. Backward: the split's all-gather of the gradient, eh_proj's GEMMs
// (its input gathered again for the weight gradient beside the input-gradient GEMM) and the
// input gradient's reduction, the concatenation, the two norms and the lookup's scatter-add.
// With full recompute of every layer (Megatron recomputes MTP uniformly; with the block
// method it skips them) the module's checkpointed part runs again: the norms to the final
// norm (the lookup is outside it). `first`: the module that books the parameter gathers of
// ZeRO-3 (eh_proj and norms of every module, the embedding copy).
void mtp_module(Acc& a, bool first) {
  const ModelSpec& m = a.m;
  const Plan& p = a.p;
  const ComputeSetup& cs = a.cs;
  const double e = cs.work_bytes, T = cs.T, Tn = cs.Tn, H = static_cast<double>(m.H), t = static_cast<double>(p.t);
  a.mem("mtp_embedding", Phase::forward, (m.position == Position::learned ? 4.0 : 2.0) * e * T * H);
  a.tp_reduce(p.sp ? "sp_reduce_scatter" : "tp_all_reduce", Phase::forward);
  auto front = [&](Phase ph) {
    a.mem("mtp_norm", ph, 2.0 * e * Tn * H, MemKind::norm);  // enorm
    a.mem("mtp_norm", ph, 2.0 * e * Tn * H, MemKind::norm);  // hnorm
    a.mem("mtp_concat", ph, 4.0 * e * Tn * H);
    a.sp_gather_width("sp_all_gather", ph, 2.0 * H);
    a.linear("mtp_eh_proj", ph, T, H / t, 2.0 * H);
    if (p.t > 1) a.comm("mtp_gather", ph, OpKind::tp_comm, a.tp, Collective::all_gather, e * T * H);
  };
  front(Phase::forward);
  if (p.recompute == Recompute::full && p.recompute_layers == 0) {
    front(Phase::recompute);
    a.mem("mtp_final_norm", Phase::recompute, 2.0 * e * Tn * H, MemKind::norm);
  }
  output_and_loss(a, "mtp_final_norm");
  a.tp_gather("sp_all_gather", Phase::backward);  // the split onto the sequence shards
  a.linear("mtp_eh_proj", Phase::backward, T, H / t, 2.0 * H);
  a.sp_gather_width("sp_all_gather", Phase::backward, 2.0 * H, a.gemm_s(T, 2.0 * H, H / t));
  a.tp_reduce_width(p.sp ? "sp_reduce_scatter" : "tp_all_reduce", Phase::backward, 2.0 * H);
  a.mem("mtp_concat", Phase::backward, 4.0 * e * Tn * H);
  a.mem("mtp_norm", Phase::backward, 3.0 * e * Tn * H, MemKind::norm);
  a.mem("mtp_norm", Phase::backward, 3.0 * e * Tn * H, MemKind::norm);
  a.tp_gather("sp_all_gather", Phase::backward);
  a.mem("mtp_embedding", Phase::backward, (e + 2.0 * cs.grad_bytes) * T * H);
  const double eh_params = 2.0 * H * H / t, norms = 3.0 * static_cast<double>(m.final_norm_params());
  if (!cs.stack.grad_accumulation_fusion)
    a.mem("grad_accumulation", Phase::backward, grad_accumulation_bytes(p.precision, cs.grad_bytes) * eh_params);
  if (first) {
    // The stage's own word embedding (and learned positions) when p > 1 (memory.cpp).
    const double copy = p.p > 1 ? static_cast<double>(m.word_embedding_params(p.t) + m.position_params()) : 0.0;
    sharded_traffic(a, static_cast<double>(m.mtp_layers) * (eh_params + norms) + copy, a.dp, a.dp_across);
  }
}

}  // namespace

LayerCost head_cost(const ModelSpec& m, const Cluster& cl, const Plan& p, const ComputeSetup& cs,
                    std::vector<OpCost>* ops) {
  Acc a(m, cl, p, cs, ops);
  output_and_loss(a, "final_norm");
  // The output layer's own weights: untied, or the tied copy on the last stage when p > 1
  // (with p = 1 the embedding's gather serves both).
  const bool own = !m.tie_embeddings || p.p > 1;
  sharded_traffic(a, static_cast<double>((own ? m.word_embedding_params(p.t) : 0) + m.final_norm_params()), a.dp,
                  a.dp_across);
  for (int64_t k = 0; k < m.mtp_layers; ++k) mtp_module(a, k == 0);
  return a.lc;
}

double optimizer_time(const Device& dev, const Plan& p, double grad_bytes, double params_updated,
                      double params_local) {
  // Memory passes per updated parameter (Megatron's optimizer step, each a kernel over the
  // local shard):
  //   bf16/fp8 with fp32 main gradients: global norm (4), clip (4 + 4), Adam (grad 4,
  //         master 4+4, m 4+4, v 4+4), copy master to the 16-bit weights (4 + 2) = 46 bytes
  //   16-bit main gradients: first their copy into fp32 (2 read + 4 write)     + 6
  //   fp16: unscale and check for inf/nan (4 + 4)                               + 8
  //         (so fp16 with its default fp16 gradients: 60)
  //   fp32: norm, clip, Adam on the weights themselves                           = 40 bytes
  // then one pass zeroing the local gradient buffer.
  // Megatron-core's precision-aware optimizer (16-bit parameters: Transformer Engine's
  // FusedAdam on the gradients as they are, g bytes): norm g, clip 2g, fp16's unscale 2g,
  // Adam reading g, the master weights M, the moments m and v read and written, the 16-bit
  // weights written (and read, to rebuild fp32 from their remainders).
  double per_param = 40.0;
  if (p.precision_aware_optimizer && (p.precision == Precision::bf16 || p.precision == Precision::fp16)) {
    const bool remainders = p.precision == Precision::bf16 && p.store_param_remainders &&
                            p.main_params_dtype == OptDtype::fp32;
    const double g = grad_bytes, master = remainders ? 2.0 : bytes_of(p.main_params_dtype);
    per_param = 4.0 * g + (p.precision == Precision::fp16 ? 2.0 * g : 0.0) +
                2.0 * (master + bytes_of(p.exp_avg_dtype) + bytes_of(p.exp_avg_sq_dtype)) + (remainders ? 4.0 : 2.0);
  } else if (p.precision != Precision::fp32) {
    per_param = 46.0 + (grad_bytes < 4.0 ? 6.0 : 0.0) + (p.precision == Precision::fp16 ? 8.0 : 0.0);
    // (fp8 parameters with the precision-aware optimizer: its moments in their own types)
    if (p.precision_aware_optimizer) per_param += 2.0 * (bytes_of(p.exp_avg_dtype) + bytes_of(p.exp_avg_sq_dtype)) - 16.0;
  }
  return memory_time(dev, per_param * params_updated) + memory_time(dev, grad_bytes * params_local);
}

double offload_optimizer_time(const Cluster& cl, const Plan& p, double grad_bytes, double n, double ranks_on_node) {
  const Host& h = cl.host;
  if (n <= 0 || !h.present()) return 0;
  // Gradients out (the main gradients: fp32, or 16-bit ones), weights back.
  const double grad = grad_bytes;
  const double weight = p.precision == Precision::fp32 ? 4.0 : 2.0;
  const double pcie = h.pcie_bandwidth_bytes_per_s * h.pcie_efficiency;
  // Host memory traffic per parameter: the gradient landing and read by CPU Adam, which
  // reads and writes the fp32 master, m and v (24), then the weights' copy written and read
  // again by the copy back.
  const double host_bytes = 2.0 * grad + 24.0 + 2.0 * weight;
  const double host_rate = h.memory_bandwidth_bytes_per_s * h.memory_efficiency;
  return n * grad / pcie + ranks_on_node * n * host_bytes / host_rate + n * weight / pcie;
}

}  // namespace strata
