// Forward and backward of the embedding, a transformer layer and the head, written by
// hand for one tensor-parallel rank (Megatron's column/row-parallel split; the f and g
// operators are the gathers, reduce-scatters and all-reduces below). Backward mirrors
// forward in reverse and accumulates parameter gradients with +=.
#include "executor/gpt.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace strata {
namespace {

// Runs a collective, adding its seconds to *sum (a ModelCtx counter; null: not counted) and
// handing them to the trace as `term` ("tp_comm", "cp_comm") and `op`.
// launch < 0: a blocking call, started when called.
void timed_into(const ModelCtx& c, double* sum, CommWaits* waits, const char* term, const char* op, auto&& fn,
                double launch = -1) {
  const OpScope region(c.ops, term);  // not the time of the op it sits in
  const double t0 = c.now();
  fn();
  const double t1 = c.now();
  if (sum) *sum += t1 - t0;
  if (waits) waits->waited(waits->launched(launch < 0 ? t0 : launch), t0, t1);
  if (c.on_comm) c.on_comm(term, op, t0, t1);
}
void timed(const ModelCtx& c, const char* op, auto&& fn) { timed_into(c, c.tp_comm_s, c.tp_waits, "tp_comm", op, fn); }

// A recompute that ran from t0 to t1: its compute seconds (without the collectives it ran,
// which stay in their own terms) into recompute_s, its interval to the trace.
void recomputed(const ModelCtx& c, double t0, double t1, double compute_s) {
  if (c.recompute_s) *c.recompute_s += compute_s;
  if (c.on_recompute) c.on_recompute(t0, t1);
}

// (n, H) rows of every tp rank -> (N, H): sequence-parallel all-gather.
Buf gather_rows(const ModelCtx& c, const Buf& in, int64_t H) {
  Buf out = c.act_out(c.N() * H);
  timed(c, "all_gather", [&] { c.comm->all_gather(in.data(), out.data(), c.n() * H, c.tp); });
  return out;
}

// (N, H) partial sums -> this rank's (n, H) rows of the sum: sequence-parallel reduce-scatter.
Buf reduce_scatter_rows(const ModelCtx& c, const Buf& in, int64_t H) {
  Buf out = c.f32_out(c.n() * H);
  timed(c, "reduce_scatter", [&] { c.comm->reduce_scatter(in.data(), out.data(), c.n() * H, c.tp); });
  return out;
}

// Sums the partial (N, H) over tp: to (n, H) with sequence parallelism, in place without.
Buf reduce_rows(const ModelCtx& c, Buf in, int64_t H) {
  if (c.t == 1) return in;
  if (c.sp) return reduce_scatter_rows(c, in, H);
  timed(c, "all_reduce", [&] { c.comm->all_reduce(in.data(), in.size(), c.tp); });
  return in;
}

// Rounds to the training precision (nothing in fp32): the cost model's round16 passes,
// where the op that made the tensor did not round it as it wrote it (the norms, the
// activation and its backward, the residual add after the attention and the bias adds
// that end a product round in their own pass: backend.h).
void round(const ModelCtx& c, float* x, int64_t n) {
  if (c.precision == Precision::fp32) return;
  const OpScope op(c.ops, "round16");
  c.be->round_to(x, n, c.precision);
}
void round(const ModelCtx& c, Buf& b) { round(c, b.data(), b.size()); }

// Whether the GEMMs take their 16-bit inputs in 16-bit storage (Backend::gemm_reads_16bit:
// the CUDA backend's; its float operands would be cast into 16-bit copies first). Then each
// GEMM input of the layer is stored in 16 bits once, where it is made (Buf::pack, which
// rounds as round() does: a packed input needs no rounding pass of its own), and every GEMM
// that takes it reads it so, forward and backward; the kept ones are not unpacked for the
// backward. Otherwise (the CPU backend's fp32 GEMMs on rounded floats) the inputs stay
// rounded floats and the kept ones go back to floats before the backward.
bool sixteen_operands(const ModelCtx& c) { return c.precision != Precision::fp32 && c.be->gemm_reads_16bit(); }

// Whether qkv is stored in 16 bits from its making (packed instead of rounded, after its bias
// or RoPE) through the backward: where sixteen_operands(c) and the fused attention, without
// context parallelism, reads it as stored (Backend::flash_reads_16bit), as its backward
// reads the attention's output (packed for the projection's GEMMs) for its delta.
bool qkv_sixteen(const ModelCtx& c) {
  return c.flash && c.cp == 1 && sixteen_operands(c) && c.be->flash_reads_16bit(c.m->D(), c.precision);
}

// b stored in 16 bits, in place, where sixteen_operands(c): in a region of its own (pack16)
// within a layer, in the caller's outside (the output layer's).
void pack_operand(const ModelCtx& c, Buf& b, bool own_region = true) {
  if (!sixteen_operands(c) || b.packed()) return;
  const OpScope op(own_region ? c.ops : nullptr, "pack16");
  b.pack(c.precision);
}

// A buffer as an operand (GEMMs, the *_stored backwards): its 16-bit values while packed, else its floats.
Operand operand(const Buf& b) {
  return b.packed() ? Operand::sixteen(b.data16(), b.packed_as()) : Operand::floats(b.data());
}
Operand operand(const float* x) { return Operand::floats(x); }

// Backend::gemm on operands in either storage.
void gemm(const ModelCtx& c, bool ta, bool tb, int64_t M, int64_t N, int64_t K, Operand A, int64_t lda,
          Operand B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (A.is_16bit() || B.is_16bit())
    c.be->gemm_mixed(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
  else
    c.be->gemm(ta, tb, M, N, K, 1.0f, static_cast<const float*>(A.p), lda, static_cast<const float*>(B.p), ldb, beta, C,
               ldc);
}

// (n, H) -> (N, H) input of a column-parallel GEMM in the training precision: gathered with
// sequence parallelism and then rounded in place, else rounded into a copy in one pass;
// where sixteen_operands(c), stored in 16 bits instead of rounded (the copy made so).
// (The caller's region names the copy; the gather's rounding is a round16 region of its
// own, its packing a pack16 one.)
Buf gemm_input_rows(const ModelCtx& c, const Buf& in, int64_t H) {
  if (c.sp && c.t > 1) {
    Buf out = gather_rows(c, in, H);
    if (sixteen_operands(c)) pack_operand(c, out);
    else round(c, out);
    return out;
  }
  if (sixteen_operands(c))
    return Buf::packed_copy(c.mem, MemCategory::activations, in.data(), in.size(), c.precision, c.act_bytes());
  Buf out = c.act_out(in.size());
  c.be->round_copy(out.data(), in.data(), in.size(), c.precision);
  return out;
}

// y += b, rounded to `rounded` in the same pass (fp32: not rounded); without a bias the
// rounding is a pass of its own.
void add_bias(const ModelCtx& c, float* y, const float* b, int64_t N, int64_t F, Precision rounded = Precision::fp32) {
  if (b) c.be->add_bias(y, b, N, F, rounded);
  else if (rounded != Precision::fp32) round(c, y, N * F);
}

// dy in either storage (Backend::bias_grad_stored: a packed gradient read as stored).
void bias_grad(const ModelCtx& c, float* db, Operand dy, int64_t N, int64_t F) {
  if (db) c.be->bias_grad_stored(db, dy, N, F);
}

// A 16-bit tensor that only GEMMs read, made where sixteen_operands(c): a buffer its op
// writes in 16-bit storage (Backend::*_packed), so no pack16 pass follows.
Buf packed_out(const ModelCtx& c, int64_t count) {
  return Buf::packed_out(c.mem, MemCategory::activations, count, c.precision, c.act_bytes());
}

// The output in 16-bit storage where sixteen_operands(c) and only GEMMs read it (not
// gathered first: sequence parallelism gathers floats).
void norm_forward(const ModelCtx& c, const float* w, const float* b, const Buf& x, Buf* out, Buf* mean, Buf* rstd) {
  const int64_t n = c.n(), H = c.m->H;
  const bool packed = sixteen_operands(c) && !(c.sp && c.t > 1);
  *out = packed ? packed_out(c, n * H) : c.act_out(n * H);
  *rstd = c.f32_out(n);
  if (c.m->normalization == Norm::layernorm) {
    *mean = c.f32_out(n);
    if (packed)
      c.be->layernorm_forward_packed(out->data16(), mean->data(), rstd->data(), x.data(), w, b, n, H, c.precision);
    else
      c.be->layernorm_forward(out->data(), mean->data(), rstd->data(), x.data(), w, b, n, H, c.precision);
  } else if (packed) {
    c.be->rmsnorm_forward_packed(out->data16(), rstd->data(), x.data(), w, n, H, c.precision);
  } else {
    c.be->rmsnorm_forward(out->data(), rstd->data(), x.data(), w, n, H, c.precision);
  }
}

// x as it is kept: packed (sixteen_operands: kept so through the backward) it is read as
// stored; the *_stored ops take floats as they are.
void norm_backward(const ModelCtx& c, float* dx, float* dw, float* db, const Buf& dout, const Buf& x,
                   const Buf& mean, const Buf& rstd, const float* w) {
  const int64_t n = c.n(), H = c.m->H;
  if (c.m->normalization == Norm::layernorm)
    c.be->layernorm_backward_stored(dx, dw, db, dout.data(), operand(x), mean.data(), rstd.data(), w, n, H);
  else
    c.be->rmsnorm_backward_stored(dx, dw, dout.data(), operand(x), rstd.data(), w, n, H);
}

Buf copy_of(const ModelCtx& c, const Buf& b) {
  Buf out = c.f32_out(b.size());
  c.be->copy(out.data(), b.data(), b.size());
  return out;
}

// Calls fn(offset, count, global_row0) for the parts of this rank's local rows [row0, row0 +
// n) (row s*B + b is local position s) that lie in one context-parallel segment: offset
// from row0, the rows there, and the global row (position * B + b) of the first of them.
template <typename Fn>
void for_segments(const ModelCtx& c, int64_t row0, int64_t n, Fn&& fn) {
  const int64_t seg_rows = c.seg_len() * c.B;
  for (int64_t k = 0; k < c.segments(); ++k) {
    const int64_t lo = std::max(row0, k * seg_rows), hi = std::min(row0 + n, (k + 1) * seg_rows);
    if (lo < hi) fn(lo - row0, hi - lo, c.seg_pos(k) * c.B + (lo - k * seg_rows));
  }
}

// RoPE of the heads [0, heads) of the local (S, B) rows of x, at their global positions.
void rope_rows(const ModelCtx& c, float* x, int64_t heads, int64_t ld, bool inverse) {
  const int64_t D = c.m->D();
  if (c.cp == 1) {
    c.be->rope(x, c.S, c.B, heads, D, ld, inverse);
    return;
  }
  for (int64_t k = 0; k < c.segments(); ++k)
    c.be->rope_at(x + k * c.seg_len() * c.B * ld, c.seg_len(), c.B, heads, D, ld, inverse, c.seg_pos(k));
}

// The blocks of an all-gather over the cp ranks (rank j's: its chunks j and 2 cp - 1 - j,
// `chunk` floats each) to position order, or (to_ranks) back into the blocks of a
// reduce-scatter.
void reorder_chunks(const ModelCtx& c, float* dst, const float* src, int64_t chunk, bool to_ranks) {
  for (int64_t j = 0; j < c.cp; ++j)
    for (int64_t k = 0; k < 2; ++k) {
      const int64_t block = (2 * j + k) * chunk, position = (k == 0 ? j : 2 * c.cp - 1 - j) * chunk;
      if (to_ranks) c.be->copy(dst + block, src + position, chunk);
      else c.be->copy(dst + position, src + block, chunk);
    }
}

// Context parallel: the keys and values of the whole sequence in position order, from every
// cp rank's QKV rows (S cp * B rows of 2 Gt D): an all-gather of each rank's two chunks,
// then each chunk to its place. Started and finished apart, so the backward can run the
// MLP block's while it is in flight.
struct KvGather {
  Buf local, all;
  Request req;
  double launch = 0;
};
KvGather start_gather_kv(const ModelCtx& c, const Buf& qkv, int64_t At, int64_t Gt) {
  const int64_t D = c.m->D(), Q = (At + 2 * Gt) * D, KV = 2 * Gt * D, N = c.N();
  KvGather g;
  g.local = c.f32(N * KV);
  c.be->copy_rows(g.local.data(), KV, qkv.data() + At * D, Q, N, KV);
  g.all = c.f32(c.cp * N * KV);
  g.launch = c.comm->wtime();
  g.req = c.comm->iall_gather(g.local.data(), g.all.data(), N * KV, c.cpg);
  return g;
}
Buf finish_gather_kv(const ModelCtx& c, KvGather* g, int64_t Gt) {
  const int64_t KV = 2 * Gt * c.m->D(), N = c.N(), chunk = c.seg_len() * c.B * KV;
  timed_into(c, c.cp_comm_s, c.cp_waits, "cp_comm", "all_gather", [&] { c.comm->wait(g->req); }, g->launch);
  g->local.release();
  Buf full = c.f32(c.cp * N * KV);
  reorder_chunks(c, full.data(), g->all.data(), chunk, false);
  g->all.release();
  return full;
}
Buf gather_kv(const ModelCtx& c, const Buf& qkv, int64_t At, int64_t Gt) {
  KvGather g = start_gather_kv(c, qkv, At, Gt);
  return finish_gather_kv(c, &g, Gt);
}

// The reverse: the gradients of the whole sequence's keys and values (position order),
// summed over the cp ranks, each rank's two chunks into the key and value columns of dqkv.
void scatter_dkv(const ModelCtx& c, const Buf& dkv, float* dqkv, int64_t At, int64_t Gt) {
  const int64_t D = c.m->D(), Q = (At + 2 * Gt) * D, KV = 2 * Gt * D, N = c.N(), chunk = c.seg_len() * c.B * KV;
  Buf blocks = c.f32(c.cp * N * KV);
  reorder_chunks(c, blocks.data(), dkv.data(), chunk, true);
  Buf mine = c.f32(N * KV);
  timed_into(c, c.cp_comm_s, c.cp_waits, "cp_comm", "reduce_scatter", [&] { c.comm->reduce_scatter(blocks.data(), mine.data(), N * KV, c.cpg); });
  blocks.release();
  c.be->copy_rows(dqkv + At * D, Q, mine.data(), KV, N, KV);
}

// The attention core of a context-parallel rank, segment by segment, against the gathered
// keys and values: out (N, At D); probs (per segment (B, At, S/2, S cp)) or lse (per
// segment (B, At, S/2)) when not null.
void attention_cp_forward(const ModelCtx& c, float* out, float* probs, float* lse, const float* qkv, const Buf& kv,
                          int64_t At, int64_t Gt) {
  const int64_t D = c.m->D(), Q = (At + 2 * Gt) * D, KV = 2 * Gt * D, Sc = c.seg_len(), Sg = c.S_global();
  for (int64_t k = 0; k < c.segments(); ++k) {
    const int64_t rows = k * Sc * c.B;
    if (c.flash)
      c.be->flash_attention_forward_cp(out + rows * At * D, lse + k * c.B * At * Sc, qkv + rows * Q, Q, kv.data(), KV,
                                       Sc, c.seg_pos(k), c.B, At, Gt, D);
    else
      c.be->attention_forward_cp(out + rows * At * D, probs ? probs + k * c.B * At * Sc * Sg : nullptr, Sg,
                                 qkv + rows * Q, Q, kv.data(), KV, Sc, c.seg_pos(k), c.B, At, Gt, D);
  }
}

// forward_all's part after the attention core (whose region ends as this begins): the
// projection, the residual, the MLP block.
Buf attention_out_and_mlp(const ModelCtx& c, const UnitView& u, int64_t l, LayerActs* a) {
  const ModelSpec& m = *c.m;
  const int64_t H = m.H, D = m.D(), At = m.A / c.t;
  const int64_t Ft = m.F / c.t, F1 = m.fc1_out() / c.t, N = c.N(), n = c.n();
  if (sixteen_operands(c)) pack_operand(c, a->att);
  else round(c, a->att);
  Buf o = c.f32_out(N * H);
  {
    const OpScope op(c.ops, "attn_proj");
    gemm(c, false, true, N, H, At * D, operand(a->att), At * D, operand(u.weight(TensorKind::proj_w, l)), At * D, 0.0f,
         o.data(), H);
    c.tick();
  }
  o = reduce_rows(c, std::move(o), H);
  a->x2 = c.act_out(n * H);
  {
    const OpScope op(c.ops, "bias_dropout_add");
    add_bias(c, o.data(), u.weight_or_null(TensorKind::proj_b, l), n, H);
    c.be->add(a->x2.data(), a->x.data(), o.data(), n * H, c.precision);
  }
  o.release();
  // MLP block.
  {
    const OpScope op(c.ops, "norm2");
    norm_forward(c, u.weight(TensorKind::ln2_w, l), u.weight_or_null(TensorKind::ln2_b, l), a->x2, &a->h2, &a->mean2,
                 &a->rstd2);
  }
  const bool gathered = c.sp && c.t > 1;
  if (gathered) a->g2 = gather_rows(c, a->h2, H);
  pack_operand(c, a->h2);
  if (gathered) pack_operand(c, a->g2);
  const Buf& g2 = gathered ? a->g2 : a->h2;
  a->u = c.act_out(N * F1);
  {
    const OpScope op(c.ops, "fc1");
    gemm(c, false, true, N, F1, H, operand(g2), H, operand(u.weight(TensorKind::fc1_w, l)), H, 0.0f, a->u.data(), F1);
    c.tick();
    add_bias(c, a->u.data(), u.weight_or_null(TensorKind::fc1_b, l), N, F1, c.precision);
  }
  {
    const OpScope op(c.ops, to_string(m.activation));
    if (sixteen_operands(c)) {
      // The activation written in 16 bits (fc2's input), and in the same pass the fc1 output
      // as it is kept for the backward where it is (not under full recompute but in its replay).
      a->a = packed_out(c, N * Ft);
      Buf u16 = c.recompute == Recompute::full ? Buf{} : packed_out(c, N * F1);
      c.be->activation_forward_packed(m.activation, a->a.data16(), u16.empty() ? nullptr : u16.data16(), a->u.data(),
                                      N, Ft, c.precision);
      if (!u16.empty()) a->u = std::move(u16);
    } else {
      a->a = c.act_out(N * Ft);
      c.be->activation_forward(m.activation, a->a.data(), a->u.data(), N, Ft, c.precision);
    }
  }
  Buf y = c.f32_out(N * H);
  {
    const OpScope op(c.ops, "fc2");
    gemm(c, false, true, N, H, Ft, operand(a->a), Ft, operand(u.weight(TensorKind::fc2_w, l)), Ft, 0.0f, y.data(), H);
    c.tick();
  }
  y = reduce_rows(c, std::move(y), H);
  Buf out = c.act_out(n * H);
  const OpScope op(c.ops, "bias_dropout_add");
  add_bias(c, y.data(), u.weight_or_null(TensorKind::fc2_b, l), n, H);
  c.be->add(out.data(), a->x2.data(), y.data(), n * H);
  return out;
}

// The forward of layer l keeping every saved tensor; returns the output.
Buf forward_all(const ModelCtx& c, const UnitView& u, int64_t l, LayerActs* a) {
  const ModelSpec& m = *c.m;
  const int64_t H = m.H, D = m.D(), At = m.A / c.t, Gt = m.G / c.t, Q = (At + 2 * Gt) * D, N = c.N();
  // The residual stream, like every tensor the layer keeps, in the training precision (as
  // Megatron's 16-bit activations): the forward uses the values its backward will read.
  round(c, a->x);
  // Attention block. (Each op in a region of the cost model's name for it: OpLog.)
  {
    const OpScope op(c.ops, "norm1");
    norm_forward(c, u.weight(TensorKind::ln1_w, l), u.weight_or_null(TensorKind::ln1_b, l), a->x, &a->h1, &a->mean1,
                 &a->rstd1);
  }
  const bool gathered = c.sp && c.t > 1;
  if (gathered) a->g1 = gather_rows(c, a->h1, H);
  pack_operand(c, a->h1);
  if (gathered) pack_operand(c, a->g1);
  const Buf& g1 = gathered ? a->g1 : a->h1;
  a->qkv = c.act_out(N * Q);
  {
    const OpScope op(c.ops, "qkv");
    gemm(c, false, true, N, Q, H, operand(g1), H, operand(u.weight(TensorKind::qkv_w, l)), H, 0.0f, a->qkv.data(), Q);
    c.tick();
    // (Rounded with the bias, or after RoPE, the last to write it; where qkv_sixteen,
    // packed after both instead: packing rounds.)
    add_bias(c, a->qkv.data(), u.weight_or_null(TensorKind::qkv_b, l), N, Q,
             m.position == Position::rope || qkv_sixteen(c) ? Precision::fp32 : c.precision);
  }
  if (m.position == Position::rope) {
    const OpScope op(c.ops, "rope");
    rope_rows(c, a->qkv.data(), At, Q, false);
    rope_rows(c, a->qkv.data() + At * D, Gt, Q, false);
  }
  if (qkv_sixteen(c)) pack_operand(c, a->qkv);
  else if (m.position == Position::rope) round(c, a->qkv);
  a->att = c.act_out(N * At * D);
  {
    const OpScope core(c.ops, c.flash ? "flash_attention" : "core_attention");
    if (c.cp > 1) {
      const Buf kv = gather_kv(c, a->qkv, At, Gt);
      if (c.flash) {
        Buf lse = c.f32(c.B * At * c.S);
        attention_cp_forward(c, a->att.data(), nullptr, lse.data(), a->qkv.data(), kv, At, Gt);
        if (c.recompute == Recompute::none) a->lse = std::move(lse);
      } else {
        if (c.recompute == Recompute::none) a->probs = c.act(c.B * At * c.S * c.S_global());
        attention_cp_forward(c, a->att.data(), a->probs.empty() ? nullptr : a->probs.data(), nullptr, a->qkv.data(), kv,
                             At, Gt);
      }
    } else if (c.flash) {
      // The log-sum-exp is what the fused backward needs; selective recompute drops it too.
      Buf lse = c.f32_out(c.B * At * c.S);
      c.be->flash_attention_forward_stored(a->att.data(), lse.data(), operand(a->qkv), c.S, c.B, At, Gt, D);
      if (c.recompute == Recompute::none) a->lse = std::move(lse);
    } else {
      if (c.recompute == Recompute::none) a->probs = c.act_out(c.B * At * c.S * c.S);
      c.be->attention_forward(a->att.data(), a->probs.empty() ? nullptr : a->probs.data(), a->qkv.data(), c.S, c.B, At,
                              Gt, D);
    }
  }
  return attention_out_and_mlp(c, u, l, a);
}

}  // namespace

Buf embedding_forward(const ModelCtx& c, const UnitView& wte, const UnitView* wpe, const int32_t* tokens) {
  const ModelSpec& m = *c.m;
  const int64_t H = m.H, N = c.N(), Vt = executor_vocab(m) / c.t, lo = c.r * Vt;
  const float* W = wte.weight(TensorKind::wte);
  Buf x = c.f32_out(N * H);
  const ByteBuf tok(c.be, tokens, static_cast<size_t>(c.S * c.B) * sizeof(int32_t));  // in the backend's memory
  c.be->embedding_forward(x.data(), W, reinterpret_cast<const int32_t*>(tok.data()), c.S, c.B, H, lo, Vt);
  x = reduce_rows(c, std::move(x), H);
  Buf out = c.act_out(c.n() * H);
  const int64_t row0 = c.sp ? c.r * c.n() : 0;
  if (wpe)
    for_segments(c, row0, c.n(), [&](int64_t off, int64_t rows, int64_t global_row0) {
      c.be->add_positions(out.data() + off * H, x.data() + off * H, wpe->weight(TensorKind::wpe), rows, H, c.B,
                          global_row0);
    });
  else c.be->copy(out.data(), x.data(), c.n() * H);
  return out;
}

void embedding_backward(const ModelCtx& c, const UnitView& wte, const UnitView* wpe, const int32_t* tokens,
                        const Buf& dx) {
  const ModelSpec& m = *c.m;
  const int64_t H = m.H, Vt = executor_vocab(m) / c.t, lo = c.r * Vt;
  if (wpe) {  // positions of this rank's rows (partial over tp with sequence parallelism)
    const int64_t row0 = c.sp ? c.r * c.n() : 0;
    for_segments(c, row0, c.n(), [&](int64_t off, int64_t rows, int64_t global_row0) {
      c.be->position_grad(wpe->grad(TensorKind::wpe), dx.data() + off * H, rows, H, c.B, global_row0);
    });
  }
  Buf full;
  const Buf* d = &dx;
  if (c.sp && c.t > 1) {
    full = gather_rows(c, dx, H);
    d = &full;
  }
  const ByteBuf tok(c.be, tokens, static_cast<size_t>(c.S * c.B) * sizeof(int32_t));
  c.be->embedding_backward(wte.grad(TensorKind::wte), d->data(), reinterpret_cast<const int32_t*>(tok.data()), c.S, c.B,
                           H, lo, Vt);
}

namespace {

// The 16-bit tensors a layer keeps for its backward, stored in 16 bits until then
// (Buf::pack): in the backend's memory each takes the 2 bytes per value the tracker and the
// cost model count for it. The forward rounded them already (the unfused core's
// probabilities excepted: its output was computed from the unrounded ones), so packing
// loses nothing the forward used.
void pack_saved(const ModelCtx& c, LayerActs* a) {
  if (c.precision == Precision::fp32) return;  // (pack keeps fp32 as it is)
  const OpScope op(c.ops, "pack16");
  for (Buf* b : a->sixteen_bit()) b->pack(c.precision);
}
// With sixteen_operands(c) the GEMM inputs stay packed: the norms' outputs (gathered or
// not), the activation and the attention's output, whose backward GEMM reads it first (the
// fused attention's backward, after it, unpacks it unless it reads it as stored:
// unpack_for_attention, qkv_sixteen); and so do the
// norms' inputs and the fc1 output, which the norms' and the activation's backwards read as
// stored (Backend::*_stored), but under full recompute, whose replay starts from the input
// (only x is here then; the replay writes the fc1 output's 16-bit copy itself); and qkv
// where the fused attention reads it as stored (qkv_sixteen). (The region only where there
// is something to unpack: the cost model books no unpack16 op otherwise.)
void unpack_saved(const ModelCtx& c, LayerActs* a) {
  const bool keep = sixteen_operands(c);
  const bool replayed = c.recompute == Recompute::full;
  std::vector<Buf*> unpacked;
  for (Buf* b : a->sixteen_bit()) {
    const bool gemm_input = b == &a->h1 || b == &a->g1 || b == &a->h2 || b == &a->g2 || b == &a->a || b == &a->att;
    const bool read_stored = (!replayed && (b == &a->x || b == &a->x2 || b == &a->u)) ||
                             (b == &a->qkv && qkv_sixteen(c));
    if (b->packed() && !(keep && (gemm_input || read_stored))) unpacked.push_back(b);
  }
  if (unpacked.empty()) return;
  const OpScope op(c.ops, "unpack16");
  for (Buf* b : unpacked) b->unpack();
}

// The attention's output as floats for the fused attention's backward, once the
// projection's weight-gradient GEMM has read it (packed where sixteen_operands(c)).
void unpack_for_attention(const ModelCtx& c, Buf& att) {
  if (!att.packed()) return;
  const OpScope op(c.ops, "unpack16");
  att.unpack();
}

}  // namespace

Buf layer_forward(const ModelCtx& c, const UnitView& u, int64_t l, Buf x, LayerActs* a) {
  const OpScope layer(c.ops, kLayerRegion);  // its own time: what no op covers ("other")
  a->x = std::move(x);
  Buf out = forward_all(c, u, l, a);
  if (c.recompute == Recompute::full) {  // keep the input only
    Buf keep = std::move(a->x);
    *a = LayerActs{};
    a->x = std::move(keep);
  }
  pack_saved(c, a);
  return out;
}

Buf layer_backward(const ModelCtx& c, const UnitView& u, int64_t l, LayerActs* a, const Buf& dout) {
  const OpScope layer(c.ops, kLayerRegion);
  unpack_saved(c, a);
  if (c.recompute == Recompute::full) {  // run the forward again, with every tensor kept
    ModelCtx again = c;
    again.recompute = Recompute::none;
    const double t0 = c.now(), tp0 = c.tp_comm_s ? *c.tp_comm_s : 0.0, cp0 = c.cp_comm_s ? *c.cp_comm_s : 0.0;
    {
      const OpPhase phase(c.ops, "recompute");
      const OpScope layer(c.ops, kLayerRegion);
      forward_all(again, u, l, a);
    }
    // Its tensor- and context-parallel collectives stay in tp_comm and cp_comm; recompute
    // is the compute.
    const double t1 = c.now();
    recomputed(c, t0, t1, t1 - t0 - ((c.tp_comm_s ? *c.tp_comm_s : 0.0) - tp0) - ((c.cp_comm_s ? *c.cp_comm_s : 0.0) - cp0));
  }
  const ModelSpec& m = *c.m;
  const int64_t H = m.H, D = m.D(), At = m.A / c.t, Gt = m.G / c.t, Q = (At + 2 * Gt) * D;
  const int64_t Ft = m.F / c.t, F1 = m.fc1_out() / c.t, N = c.N(), n = c.n();
  const bool gathered = c.sp && c.t > 1;
  // Context parallel: the attention's backward needs every rank's keys and values again.
  // Their gather starts here and runs behind the MLP block's backward, whose polls progress
  // it (MPI moves only inside its calls).
  KvGather kv_pre;
  if (c.cp > 1) kv_pre = start_gather_kv(c, a->qkv, At, Gt);
  auto tick = [&] {
    c.tick();
    if (c.cp > 1) c.comm->test(kv_pre.req);
  };
  // MLP block: out = x2 + fc2(act(fc1(norm2(x2)))). (Each op in a region of the cost
  // model's name for it: OpLog; the copies feeding a rounding count with it.)
  Buf dx;  // (n, H) gradient of the residual stream
  {
    const OpScope op(c.ops, "bias_dropout_add");
    dx = copy_of(c, dout);
    bias_grad(c, u.grad_or_null(TensorKind::fc2_b, l), operand(dout), n, H);
  }
  const bool sixteen = sixteen_operands(c);
  const char* const input_region =
      gathered || c.precision == Precision::fp32 ? nullptr : sixteen ? "pack16" : "round16";
  Buf dy;
  {
    const OpScope op(c.ops, input_region);
    dy = gemm_input_rows(c, dout, H);
  }
  Buf da = c.f32_out(N * Ft);
  {
    const OpScope op(c.ops, "fc2");
    gemm(c, false, false, N, Ft, H, operand(dy), H, operand(u.weight(TensorKind::fc2_w, l)), Ft, 0.0f, da.data(), Ft);
    tick();
    gemm(c, true, false, H, Ft, N, operand(dy), H, operand(a->a), Ft, 1.0f, u.grad(TensorKind::fc2_w, l), Ft);
    tick();
  }
  dy.release();
  // du in 16-bit storage where sixteen (fc1's GEMMs and its bias gradient read it so); u as
  // kept: packed where sixteen, else floats
  Buf du = sixteen ? packed_out(c, N * F1) : c.f32_out(N * F1);
  {
    const OpScope op(c.ops, to_string(m.activation));
    if (sixteen)
      c.be->activation_backward_packed(m.activation, du.data16(), da.data(), operand(a->u), N, Ft, c.precision);
    else
      c.be->activation_backward_stored(m.activation, du.data(), da.data(), operand(a->u), N, Ft, c.precision);
  }
  da.release();
  const Buf& g2 = gathered ? a->g2 : a->h2;
  Buf dg2;
  {
    const OpScope op(c.ops, "fc1");
    gemm(c, true, false, F1, H, N, operand(du), F1, operand(g2), H, 1.0f, u.grad(TensorKind::fc1_w, l), H);
    tick();
    bias_grad(c, u.grad_or_null(TensorKind::fc1_b, l), operand(du), N, F1);
    dg2 = c.f32_out(N * H);
    gemm(c, false, false, N, H, F1, operand(du), F1, operand(u.weight(TensorKind::fc1_w, l)), H, 0.0f, dg2.data(), H);
    tick();
  }
  du.release();
  Buf dh2 = reduce_rows(c, std::move(dg2), H);
  {
    const OpScope op(c.ops, "norm2");
    norm_backward(c, dx.data(), u.grad(TensorKind::ln2_w, l), u.grad_or_null(TensorKind::ln2_b, l), dh2, a->x2,
                  a->mean2, a->rstd2, u.weight(TensorKind::ln2_w, l));
  }
  dh2.release();
  if (c.mlp_grads_done) c.mlp_grads_done(l);
  // Attention block: x2 = x + proj(attention(qkv(norm1(x)))).
  {
    const OpScope op(c.ops, "bias_dropout_add");
    bias_grad(c, u.grad_or_null(TensorKind::proj_b, l), operand(dx), n, H);
  }
  Buf dO;
  {
    const OpScope op(c.ops, input_region);
    dO = gemm_input_rows(c, dx, H);
  }
  Buf datt = c.f32_out(N * At * D);
  {
    const OpScope op(c.ops, "attn_proj");
    gemm(c, false, false, N, At * D, H, operand(dO), H, operand(u.weight(TensorKind::proj_w, l)), At * D, 0.0f,
         datt.data(), At * D);
    c.tick();
    gemm(c, true, false, H, At * D, N, operand(dO), H, operand(a->att), At * D, 1.0f, u.grad(TensorKind::proj_w, l),
         At * D);
    c.tick();
  }
  dO.release();
  round(c, datt);
  Buf dqkv;
  {
    const OpScope core(c.ops, c.flash ? "flash_attention" : "core_attention");
    if (c.cp > 1) {
      // The keys and values travelled again (the forward kept only this rank's; gathered
      // behind the MLP block above), and their gradients, summed over the cp ranks, travel back.
      const int64_t Sc = c.seg_len(), Sg = c.S_global(), KV = 2 * Gt * D;
      const Buf kv = finish_gather_kv(c, &kv_pre, Gt);
      if (c.flash ? a->lse.empty() : a->probs.empty()) {  // selective recompute: the core's forward again
        const double t0 = c.now(), cp0 = c.cp_comm_s ? *c.cp_comm_s : 0.0;
        const OpPhase phase(c.ops, "recompute");
        const OpScope op(c.ops, c.flash ? "flash_attention" : "core_attention");
        Buf again = c.f32(N * At * D);
        if (c.flash) a->lse = c.f32(c.B * At * c.S);
        else a->probs = c.act(c.B * At * c.S * Sg);
        attention_cp_forward(c, again.data(), c.flash ? nullptr : a->probs.data(), c.flash ? a->lse.data() : nullptr,
                             a->qkv.data(), kv, At, Gt);
        const double t1 = c.now();
        recomputed(c, t0, t1, t1 - t0 - ((c.cp_comm_s ? *c.cp_comm_s : 0.0) - cp0));
      }
      dqkv = c.f32(N * Q);
      Buf dkv = c.f32(Sg * c.B * KV);
      if (c.flash) unpack_for_attention(c, a->att);
      for (int64_t k = 0; k < c.segments(); ++k) {
        const int64_t rows = k * Sc * c.B;
        if (c.flash)
          c.be->flash_attention_backward_cp(dqkv.data() + rows * Q, Q, dkv.data(), KV, datt.data() + rows * At * D,
                                            a->att.data() + rows * At * D, a->lse.data() + k * c.B * At * Sc,
                                            a->qkv.data() + rows * Q, kv.data(), Sc, c.seg_pos(k), c.B, At, Gt, D);
        else
          c.be->attention_backward_cp(dqkv.data() + rows * Q, Q, dkv.data(), KV, datt.data() + rows * At * D,
                                      a->probs.data() + k * c.B * At * Sc * Sg, Sg, a->qkv.data() + rows * Q, kv.data(),
                                      Sc, c.seg_pos(k), c.B, At, Gt, D);
      }
      scatter_dkv(c, dkv, dqkv.data(), At, Gt);
    } else if (c.flash) {
      if (a->lse.empty()) {  // selective recompute: the fused forward again, for its log-sum-exp
        const double t0 = c.now();
        const OpPhase phase(c.ops, "recompute");
        const OpScope op(c.ops, "flash_attention");
        a->lse = c.f32_out(c.B * At * c.S);
        Buf again = c.f32_out(N * At * D);
        c.be->flash_attention_forward_stored(again.data(), a->lse.data(), operand(a->qkv), c.S, c.B, At, Gt, D);
        const double t1 = c.now();
        recomputed(c, t0, t1, t1 - t0);
      }
      // The output as the projection saw it (rounded to the training precision) enters
      // rowsum(dO * O), so a recomputed and a kept log-sum-exp give the same gradients.
      // (Where qkv_sixteen, qkv and the output are read as they are kept: packed.)
      dqkv = c.f32_out(N * Q);
      if (!qkv_sixteen(c)) unpack_for_attention(c, a->att);
      c.be->flash_attention_backward_stored(dqkv.data(), datt.data(), operand(a->att), a->lse.data(), operand(a->qkv),
                                            c.S, c.B, At, Gt, D);
    } else {
      if (a->probs.empty()) {
        // Selective recompute: the core attention forward runs again (as Megatron's
        // checkpointed core attention does) to rebuild the probabilities; its time is recompute.
        const double t0 = c.now();
        const OpPhase phase(c.ops, "recompute");
        const OpScope op(c.ops, "core_attention");
        a->probs = c.act_out(c.B * At * c.S * c.S);
        Buf again = c.f32_out(N * At * D);
        c.be->attention_forward(again.data(), a->probs.data(), a->qkv.data(), c.S, c.B, At, Gt, D);
        const double t1 = c.now();
        recomputed(c, t0, t1, t1 - t0);
      }
      dqkv = c.f32_out(N * Q);
      c.be->attention_backward(dqkv.data(), datt.data(), a->probs.data(), a->qkv.data(), c.S, c.B, At, Gt, D);
    }
  }
  datt.release();
  if (m.position == Position::rope) {
    const OpScope op(c.ops, "rope");
    rope_rows(c, dqkv.data(), At, Q, true);
    rope_rows(c, dqkv.data() + At * D, Gt, Q, true);
  }
  // With sixteen: packing rounds (and the bias gradient sums the packed values), so no
  // rounding pass.
  if (!sixteen) round(c, dqkv);
  const Buf& g1 = gathered ? a->g1 : a->h1;
  Buf dg1;
  {
    const OpScope op(c.ops, "qkv");
    pack_operand(c, dqkv);
    gemm(c, true, false, Q, H, N, operand(dqkv), Q, operand(g1), H, 1.0f, u.grad(TensorKind::qkv_w, l), H);
    c.tick();
    bias_grad(c, u.grad_or_null(TensorKind::qkv_b, l), operand(dqkv), N, Q);
    dg1 = c.f32_out(N * H);
    gemm(c, false, false, N, H, Q, operand(dqkv), Q, operand(u.weight(TensorKind::qkv_w, l)), H, 0.0f, dg1.data(), H);
    c.tick();
  }
  dqkv.release();
  Buf dh1 = reduce_rows(c, std::move(dg1), H);
  {
    const OpScope op(c.ops, "norm1");
    norm_backward(c, dx.data(), u.grad(TensorKind::ln1_w, l), u.grad_or_null(TensorKind::ln1_b, l), dh1, a->x,
                  a->mean1, a->rstd1, u.weight(TensorKind::ln1_w, l));
  }
  *a = LayerActs{};
  return dx;
}

double head_forward(const ModelCtx& c, const UnitView& fu, const float* out_w, Buf x, const int32_t* targets,
                    HeadActs* h) {
  const ModelSpec& m = *c.m;
  const int64_t H = m.H, N = c.N(), Vt = executor_vocab(m) / c.t, lo = c.r * Vt;
  h->x = std::move(x);
  norm_forward(c, fu.weight(TensorKind::lnf_w), fu.weight_or_null(TensorKind::lnf_b), h->x, &h->hf, &h->mean, &h->rstd);
  const bool gathered = c.sp && c.t > 1;
  if (gathered) h->hf_full = gather_rows(c, h->hf, H);
  Buf& hf = gathered ? h->hf_full : h->hf;
  pack_operand(c, hf, false);  // (only the GEMMs read it: sixteen_operands)
  h->probs = c.f32_out(N * Vt);
  float* z = h->probs.data();
  gemm(c, false, true, N, Vt, H, operand(hf), H, operand(out_w), H, 0.0f, z, Vt);
  c.tick();
  // Vocab-parallel cross-entropy: the row maximum, then the sum of exponentials and the
  // target's logit, each reduced over tp (backend.h).
  std::vector<int32_t> tg(static_cast<size_t>(N));
  for (int64_t s = 0; s < c.S; ++s)
    for (int64_t b = 0; b < c.B; ++b) tg[static_cast<size_t>(s * c.B + b)] = targets[b * c.S + s];
  h->targets = ByteBuf(c.be, tg.data(), tg.size() * sizeof(int32_t));
  const int32_t* dtg = reinterpret_cast<const int32_t*>(h->targets.data());
  // The logits stay as they are: the backward computes the probabilities from them, the
  // row maxima and the sums in one pass (backend.h).
  h->mx = Buf::untracked(c.be, N);
  h->st = Buf::untracked(c.be, 2 * N);
  if (c.be->cross_entropy_one_pass()) {
    // Both in one pass against this rank's maxima; with tp, moved to the ranks' maxima.
    c.be->cross_entropy_forward(h->mx.data(), h->st.data(), z, dtg, N, Vt, lo);
    if (c.t > 1) {
      Buf mg = Buf::untracked(c.be, N);
      c.be->copy(mg.data(), h->mx.data(), N);
      timed(c, "all_reduce", [&] { c.comm->all_reduce(mg.data(), N, c.tp, ReduceOp::max); });
      c.be->cross_entropy_rescale(h->st.data(), h->mx.data(), mg.data(), dtg, N, Vt, lo);
      h->mx = std::move(mg);
    }
  } else {
    c.be->cross_entropy_max(h->mx.data(), z, N, Vt);
    if (c.t > 1) timed(c, "all_reduce", [&] { c.comm->all_reduce(h->mx.data(), N, c.tp, ReduceOp::max); });
    c.be->cross_entropy_exp_sum(h->st.data(), z, h->mx.data(), dtg, N, Vt, lo);
  }
  if (c.t > 1) timed(c, "all_reduce", [&] { c.comm->all_reduce(h->st.data(), 2 * N, c.tp); });
  std::vector<float> hst(static_cast<size_t>(2 * N));
  c.be->to_host(hst.data(), h->st.data(), 2 * N);
  double loss = 0;
  for (int64_t i = 0; i < N; ++i)
    loss += std::log(static_cast<double>(hst[static_cast<size_t>(2 * i)])) -
            static_cast<double>(hst[static_cast<size_t>(2 * i + 1)]);
  return loss;
}

Buf head_backward(const ModelCtx& c, const UnitView& fu, const float* out_w, float* out_grad, HeadActs* h,
                  float dloss_scale) {
  const ModelSpec& m = *c.m;
  const int64_t H = m.H, N = c.N(), Vt = executor_vocab(m) / c.t, lo = c.r * Vt;
  // dlogits, rounded to the training precision (the GEMMs' input) in the same pass: over the
  // logits, or (sixteen_operands: both GEMMs read it in 16 bits) written in 16-bit storage
  // beside them, which are freed then. Either is held to the end, as the logits were.
  float* z = h->probs.data();
  const int32_t* tg = reinterpret_cast<const int32_t*>(h->targets.data());
  Buf dz;
  if (sixteen_operands(c)) {
    dz = packed_out(c, N * Vt);
    c.be->cross_entropy_backward_packed(dz.data16(), z, h->mx.data(), h->st.data(), tg, N, Vt, lo, dloss_scale,
                                        c.precision);
    h->probs.release();
  } else {
    c.be->cross_entropy_backward(z, h->mx.data(), h->st.data(), tg, N, Vt, lo, dloss_scale, c.precision);
    dz = std::move(h->probs);
  }
  const Buf& hf = (c.sp && c.t > 1) ? h->hf_full : h->hf;
  gemm(c, true, false, Vt, H, N, operand(dz), Vt, operand(hf), H, 1.0f, out_grad, H);
  c.tick();
  Buf dhf = c.f32_out(N * H);
  gemm(c, false, false, N, H, Vt, operand(dz), Vt, operand(out_w), H, 0.0f, dhf.data(), H);
  c.tick();
  dhf = reduce_rows(c, std::move(dhf), H);
  Buf dx = c.f32(c.n() * H);
  norm_backward(c, dx.data(), fu.grad(TensorKind::lnf_w), fu.grad_or_null(TensorKind::lnf_b), dhf, h->x, h->mean,
                h->rstd, fu.weight(TensorKind::lnf_w));
  *h = HeadActs{};
  return dx;
}

}  // namespace strata
