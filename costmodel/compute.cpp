// Op-by-op compute model of a transformer layer (its dense and attention blocks, the
// executor's 16-bit passes, the sharded parameters' traffic) and compute.h's public
// helpers; see compute_acc.h (the accumulator and shared helpers), compute_moe.cpp,
// compute_ends.cpp. Every
// byte count below is per GPU and per micro-batch; e is the activation element size,
// 1-byte dropout masks.
#include "costmodel/compute.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "costmodel/compute_acc.h"
#include "costmodel/memory.h"

namespace strata {

using namespace compute_detail;

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
  cs.weight_bytes = p.precision == Precision::fp32 ? 4.0 : p.fp8_weights() ? 1.0 : 2.0;
  cs.weight_work_bytes = cs.stack.strata ? 4.0 : cs.weight_bytes;  // its parameter gathers send floats
  cs.cp_comm = p.c > 1 ? resolve_cp_comm(m, cl, p) : CpComm::p2p;  // (nothing to move without context parallelism)
  cs.sixteen_operands = cs.stack.strata && (p.precision == Precision::bf16 || p.precision == Precision::fp16) &&
                        cl.device.gemm_reads_16bit;
  return cs;
}


double grad_accumulation_bytes(Precision prec, double grad_bytes) {
  if (prec == Precision::fp32) return 8.0;                      // fp32 .grad read and written
  if (prec == Precision::fp16 && grad_bytes < 4.0) return 4.0;  // fp16 .grad read and written (GEMM beta = 1)
  // The 16-bit grad written and read, the main gradient (fp32, or 16-bit with
  // grad_reduce_in_fp32 off) read and written: 12 bytes, or 8.
  return 4.0 + 2.0 * grad_bytes;
}

namespace {


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
    // Reads q, k, v and writes the output (qkv in 16 bits where qkv16).
    const double bytes = a.qkv16 ? a.cs.T * (2.0 * head_columns(m, p.t, 1, 2) + e * head_columns(m, p.t, 1, 0))
                                 : e * a.cs.T * head_columns(m, p.t, 2, 2);
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
    // Reads q, k, v, the output and its gradient, writes dq, dk, dv (qkv and the output in
    // 16 bits where qkv16).
    const double bytes = a.qkv16 ? a.cs.T * (2.0 + e) * head_columns(m, p.t, 2, 2)
                                 : 2.0 * e * a.cs.T * head_columns(m, p.t, 2, 2);
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
// it holds as floats: a rounding pass reads and writes 4 bytes per value; packing a tensor
// into 16 bits reads 4 and writes 2 bytes per value, unpacking it the reverse. Values per
// layer and micro-batch on this rank, with n tokens (sequence shard) and N (gathered): the
// forward's 16-bit tensors are x, h1, x2, h2 (n H each), qkv (N Q), the attention output
// (N AD/t), the fc1 output (N F1/t) and the activation (N F/t). The ops that make h1 and h2
// (the norms), x2 (the residual add), the activation and, where a bias add ends the product,
// the fc1 output and qkv (no RoPE after it) round them as they write them (backend.h); the
// others take a pass each: x, the attention output, and qkv and the fc1 output without
// biases (qkv also after RoPE). The backward rounds the GEMM inputs dy, dO (N H each), datt
// (N AD/t) and dqkv (N Q) in passes, du (N F1/t) in the activation's backward. Kept and
// packed: the forward's, the gathered g1 and g2 with sequence parallelism (N H each) and the
// unfused core's probabilities (B A/t S^2) when nothing is recomputed; full recompute keeps
// only x; all unpacked before the backward.
// Where the device's GEMMs read 16-bit operands (Device::gemm_reads_16bit: the CUDA
// backend), every GEMM input is packed once where it is made and read so: the GEMM inputs
// of the forward (h1 or g1, the attention output, h2 or g2, the activation) as soon as they
// are written, in the forward and in a full recompute's replay (the attention output packed
// instead of rounded); those kept stay packed for the backward (the attention output
// unpacked for the fused attention's backward); dy, dO and dqkv are packed instead of
// rounded (packing rounds; dqkv's bias gradient reads it packed). The norms' inputs x and
// x2 stay packed too, read so by the norms' backwards (reads_kept_16bit), but under full
// recompute (its replay starts from x as floats); the fc1 output's 16-bit copy is read so
// by the activation's backward even then (the replay writes it). The ops that make a GEMM
// input write it in 16 bits themselves where they can (Backend::*_packed), so no pack
// follows them: the norms (not where sequence parallelism gathers their output:
// norms_write_16bit), the activation (which writes the fc1 output's kept 16-bit copy in
// the same pass, in the forward but under full recompute and in its replay) and the
// activation's backward (du, which fc1's bias gradient reads so). With the fused attention
// on the tensor cores and no context parallelism (Acc::qkv16) qkv is packed where it is
// made instead of rounded and kept so, neither it nor the attention's output unpacked for
// the fused backward. Nothing of this runs outside the strata stack or in fp32.
struct Tensors {
  std::array<double, 12> values{};
  int count = 0;
  void add(double v) { values[static_cast<size_t>(count++)] = v; }
};
struct SixteenBitPasses {
  Tensors forward_rounds, gemm_input_packs, kept, unpacked, backward_rounds, backward_packs;
};

SixteenBitPasses sixteen_bit_passes(const Acc& a) {
  SixteenBitPasses v;
  const Plan& p = a.p;
  if (!a.cs.stack.strata || (p.precision != Precision::bf16 && p.precision != Precision::fp16)) return v;
  const ModelSpec& m = a.m;
  const bool as_stored = a.cl.device.gemm_reads_16bit;
  const double T = a.cs.T, Tn = a.cs.Tn, H = static_cast<double>(m.H), t = static_cast<double>(p.t);
  const double Q = head_columns(m, p.t, 1, 2), ADt = static_cast<double>(m.AD()) / t;
  const double F1 = static_cast<double>(m.fc1_out()) / t, Ft = static_cast<double>(m.F) / t;
  const bool qkv_fused = m.bias && m.position != Position::rope;
  const bool gathered = p.sp && p.t > 1;
  const bool full = p.recompute == Recompute::full;
  const bool flash = a.cs.attention != AttentionKernel::unfused;
  v.forward_rounds.add(Tn * H);
  if (!as_stored) v.forward_rounds.add(T * ADt);
  if (!qkv_fused && !a.qkv16) v.forward_rounds.add(T * Q);
  if (!m.bias) v.forward_rounds.add(T * F1);
  if (as_stored) {
    v.gemm_input_packs.add(T * ADt);  // att (h1, h2 and the activation written so: norms_write_16bit)
    if (a.qkv16) v.gemm_input_packs.add(T * Q);  // qkv, packed instead of rounded
    if (gathered)
      for (double x : {Tn * H, Tn * H, T * H, T * H}) v.gemm_input_packs.add(x);  // h1, h2, g1, g2
    v.backward_rounds.add(T * ADt);  // (dqkv's bias gradient reads it packed: no rounding pass)
    for (double x : {T * H, T * H, T * Q}) v.backward_packs.add(x);  // dy, dO, dqkv (du written so)
  } else {
    for (double x : {T * H, T * H, T * ADt, T * Q}) v.backward_rounds.add(x);
  }
  // What the forward's end packs, and the backward's start unpacks.
  if (full) {
    v.kept.add(Tn * H);
    v.unpacked.add(Tn * H);
    if (as_stored && flash && !a.qkv16) v.unpacked.add(T * ADt);  // the replay's output, for the fused backward
    return v;
  }
  auto both = [&](double x) {
    v.kept.add(x);
    v.unpacked.add(x);
  };
  if (as_stored) {
    // x, qkv (but where packed already: qkv16), x2 (u written so by the activation); unpacked
    // qkv and the fused attention's output, but where its kernels read them so (qkv16; x, x2
    // and u read as stored)
    v.kept.add(Tn * H);
    if (!a.qkv16) v.kept.add(T * Q);
    v.kept.add(Tn * H);
    if (!a.qkv16) {
      v.unpacked.add(T * Q);
      if (flash) v.unpacked.add(T * ADt);
    }
  } else {
    for (double x : {Tn * H, Tn * H, T * Q, T * ADt, Tn * H, Tn * H, T * F1, T * Ft}) both(x);  // x, h1, qkv, att, x2, h2, u, act
    if (gathered) {
      both(T * H);
      both(T * H);
    }
  }
  if (a.cs.attention == AttentionKernel::unfused && p.recompute == Recompute::none) {
    const double S = static_cast<double>(m.S);
    const double probs = static_cast<double>(p.mbs) * static_cast<double>(m.A / p.t) * S * S;
    v.kept.add(probs);
    v.unpacked.add(probs);
  }
  return v;
}

// Whether the layer's norms write their output in 16 bits, 2 bytes a value where floats
// take work_bytes (sixteen_bit_passes; the executor's norm_forward).
bool norms_write_16bit(const Acc& a) { return a.casts_weights && !(a.p.sp && a.p.t > 1); }

// Whether the norms' backwards read their kept inputs (x, x2) in 16 bits, 2 bytes a value
// where floats take work_bytes (sixteen_bit_passes); the activation's reads the fc1 output
// so wherever casts_weights (full recompute's replay writes it so too).
bool reads_kept_16bit(const Acc& a) {
  return a.cs.stack.strata && a.cl.device.gemm_reads_16bit && a.p.recompute != Recompute::full &&
         (a.p.precision == Precision::bf16 || a.p.precision == Precision::fp16);
}

// One memory-bound pass per tensor, `bytes_per_value` each.
void passes(Acc& a, const char* name, Phase ph, const Tensors& ts, double bytes_per_value, MemKind kind) {
  for (int i = 0; i < ts.count; ++i) a.mem(name, ph, bytes_per_value * ts.values[static_cast<size_t>(i)], kind);
}

// A dense MLP's forward (also what recompute_modules mlp runs again).
void dense_mlp_forward(Acc& a, Phase ph) {
  const ModelSpec& m = a.m;
  const double e = a.cs.work_bytes, T = a.cs.T, H = static_cast<double>(m.H), t = static_cast<double>(a.p.t);
  const double fc1_cols = static_cast<double>(m.fc1_out()) / t, Ft = static_cast<double>(m.F) / t;
  a.block_gather("sp_all_gather", ph, T, fc1_cols, H, false);
  a.linear("fc1", ph, T, fc1_cols, H);
  if (a.casts_weights) {
    // The strata executor's activation reads the fc1 output and writes its output and (where
    // the fc1 output is kept: not in a fully recomputed layer's first forward) the fc1
    // output's 16-bit copy (sixteen_bit_passes).
    const bool keep_u = ph == Phase::recompute || a.p.recompute != Recompute::full;
    a.mem(to_string(m.activation), ph, ((keep_u ? e + 2.0 : e) * fc1_cols + 2.0 * Ft) * T, MemKind::activation);
  } else {
    a.mem(to_string(m.activation), ph, (m.gated() ? 3.0 : 2.0) * e * T * Ft, MemKind::activation);
  }
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
  const double norm_out = norms_write_16bit(a) ? 2.0 : e;
  a.mem("norm1", ph, (e + norm_out) * Tn * H, MemKind::norm);
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
  a.mem("norm2", ph, (e + norm_out) * Tn * H, MemKind::norm);
  if (m.moe()) {
    moe_forward(a, ph);
  } else {
    dense_mlp_forward(a, ph);
  }
  a.mem("bias_dropout_add", ph, dropout_bytes(Tn * H, m.hidden_dropout, a.cs.work_bytes, true));
  if (a.cs.stack.strata) {
    const SixteenBitPasses sb = sixteen_bit_passes(a);
    passes(a, "round16", ph, sb.forward_rounds, 8.0, MemKind::round16);
    passes(a, "pack16", ph, sb.gemm_input_packs, 6.0, MemKind::generic);
  }
}

// What torchtitan's op-level selective recompute (selective_ac_option op) runs again before
// a layer's backward: its checkpoint replays the forward, taking the fused attention's
// output and the odd matrix multiplications' (q, v, gate or fc1, down) from what it kept
// and running the rest, up to the last tensor the backward needs (the down projection's
// input: eager checkpointing stops there). So the norms, their sequence-parallel gathers
// (the projections' weight gradients read the gathered inputs), the k and output
// projections, RoPE, the residual add, and in a gated MLP the up projection and the
// activation (a GeLU MLP: the activation alone; its fc2, the 6th multiplication, is never
// reached); not the reduce-scatters, whose outputs the policy keeps (torchtitan's tensor
// parallelism is sequence-parallel: check_plan refuses it without). GQA's repeated keys
// and values (torchtitan's repeat_kv copies) are costed as the forward costs them: not.
void op_sac_recompute(Acc& a) {
  const ModelSpec& m = a.m;
  const Plan& p = a.p;
  const Phase ph = Phase::recompute;
  const double e = a.cs.work_bytes, T = a.cs.T, Tn = a.cs.Tn, H = static_cast<double>(m.H);
  const double Ft = static_cast<double>(m.F) / static_cast<double>(p.t), kv_cols = head_columns(m, p.t, 0, 1);
  const double norm_out = norms_write_16bit(a) ? 2.0 : e;
  a.mem("norm1", ph, (e + norm_out) * Tn * H, MemKind::norm);
  a.block_gather("sp_all_gather", ph, T, kv_cols, H, false);
  a.linear("qkv", ph, T, kv_cols, H);  // k alone
  if (m.position == Position::rope) a.mem("rope", ph, 2.0 * e * T * head_columns(m, p.t, 1, 1));
  a.linear("attn_proj", ph, T, H, proj_width(m, p.t));
  a.mem("bias_dropout_add", ph, dropout_bytes(Tn * H, 0.0, a.cs.work_bytes, true));
  a.mem("norm2", ph, (e + norm_out) * Tn * H, MemKind::norm);
  a.block_gather("sp_all_gather", ph, T, Ft, H, false);
  if (m.gated()) a.linear("fc1", ph, T, Ft, H);  // the up half
  a.mem(to_string(m.activation), ph, (m.gated() ? 3.0 : 2.0) * e * T * Ft, MemKind::activation);
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
  // A norm's and the activation's backward read their output gradient, their kept input
  // (x: 16-bit where reads_kept_16bit; u where casts_weights) and write their input gradient
  // (du: 16-bit where casts_weights).
  const double kept_in = reads_kept_16bit(a) ? 2.0 : e;
  const double u_bytes = a.casts_weights ? 2.0 : e;
  // MLP block, in reverse.
  const double compute0 = a.w(ph).compute_s;
  a.mem("bias_dropout_add", ph, (2.0 * e + mask) * Tn * H);
  if (m.moe()) {
    moe_backward(a);
  } else {
    a.block_gather("sp_all_gather", ph, T, Ft, H, false);  // backward of the reduce-scatter after fc2, for its dgrad
    a.linear("fc2", ph, T, H, Ft);
    a.mem(to_string(m.activation), ph, (e + (m.gated() ? 2.0 : 1.0) * 2.0 * u_bytes) * T * Ft, MemKind::activation);
    // fc1: the sequence-parallel input is gathered again for wgrad, behind dgrad.
    a.block_gather("sp_all_gather", ph, T, H, fc1_cols, true);
    a.linear("fc1", ph, T, fc1_cols, H);
    a.tp_reduce(p.sp ? "sp_reduce_scatter" : "tp_all_reduce", ph, wgrad_overlap(a, T, fc1_cols, H));
  }
  a.mem("norm2", ph, (2.0 * e + kept_in) * Tn * H, MemKind::norm);
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
  a.mem("norm1", ph, (2.0 * e + kept_in) * Tn * H, MemKind::norm);
  if (!a.cs.stack.grad_accumulation_fusion)
    a.mem("grad_accumulation", ph, grad_accumulation_bytes(p.precision, a.cs.grad_bytes) * static_cast<double>(m.layer_params(p.t, p.ep, p.etp)));
  if (!a.cs.stack.strata) return;
  const SixteenBitPasses sb = sixteen_bit_passes(a);
  passes(a, "unpack16", ph, sb.unpacked, 6.0, MemKind::generic);
  passes(a, "round16", ph, sb.backward_rounds, 8.0, MemKind::round16);
  passes(a, "pack16", ph, sb.backward_packs, 6.0, MemKind::generic);
}

}  // namespace

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
void compute_detail::sharded_traffic(Acc& a, double params, const GroupSpan& group, const GroupSpan& across) {
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

LayerCost layer_cost(const ModelSpec& m, const Cluster& cl, const Plan& p, const ComputeSetup& cs,
                     std::vector<OpCost>* ops) {
  Acc a(m, cl, p, cs, ops);
  const size_t first_op = ops ? ops->size() : 0;
  layer_forward(a, Phase::forward);
  // Full recompute replays the forward's ops, each costing what it cost there (a function
  // of its sizes alone), summed in the same order: the same bits. Walked again only when
  // the op list is asked for, or where the replay differs (the strata executor's activation
  // writes the fc1 output's kept copy in the replay alone: dense_mlp_forward).
  const bool replay = p.recompute == Recompute::full;
  const bool copied = replay && !ops && !a.casts_weights;
  if (copied) a.lc.recompute = a.lc.forward;
  pack_kept(a);
  if (replay && !copied) layer_forward(a, Phase::recompute);
  if (p.recomputes(kRecomputeCoreAttn)) attention_core_forward(a, Phase::recompute);
  if (p.op_sac()) op_sac_recompute(a);
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
}  // namespace strata
