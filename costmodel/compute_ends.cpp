// The op-by-op compute model's work outside the transformer layers: the embedding, the
// final norm, output layer and loss, multi-token prediction modules, and the optimizer
// step (on the GPU, or offloaded to the host); see compute_acc.h and compute.h.
#include <algorithm>
#include <cstdint>

#include "costmodel/compute_acc.h"

namespace strata {

using namespace compute_detail;

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
  // this rank) as the norm writes it, and the logit gradients in the cross-entropy's
  // backward pass, which writes them (below): neither is a pass of its own
  // (executor/gpt.cpp head_forward). Where the device's GEMMs read 16-bit operands
  // (compute_acc.h casts_weights) the norm writes its output in 16 bits for the GEMMs, or
  // with sequence parallelism it is gathered and then packed so; the weight is cast for
  // each GEMM that reads it; in the backward the cross-entropy writes the logit gradients
  // in 16 bits for both GEMMs (executor/gpt.cpp head_backward).
  const bool gathered = p.sp && p.t > 1;
  a.mem(norm, Phase::forward, (e + (a.casts_weights && !gathered ? 2.0 : e)) * cs.Tn * H, MemKind::norm);
  a.tp_gather("sp_all_gather", Phase::forward);
  if (a.casts_weights) {
    if (gathered) a.mem("pack16", Phase::forward, 6.0 * T * H);
    a.mem("lm_head", Phase::forward, 6.0 * Vt * H);
  }
  a.gemm("lm_head", Phase::forward, T, Vt, H, peak, eb);
  // Vocab-parallel cross-entropy on the T x V/t logits; three all-reduces of T floats (max,
  // sum, target logit; the strata executor's sum and target logit go in one of 2T).
  // Bytes per logit element:
  // - unfused (Megatron-LM's, DeepSpeed's, this repository's): cast to fp32 (e + 4), max (4),
  //   subtract (8), exp (8), sum (4), normalise in place and keep for backward (8) = e + 36;
  //   backward: copy the softmax (8), subtract the one-hot and scale (8), cast back (4 + e).
  // - fused (Megatron-core's cross_entropy_loss_fusion, the modern stack's default; Transformer
  //   Engine's kernel): one pass reads the e-byte logits for the running max and sum, a
  //   second reads them again and writes the gradient in their place (3e); backward scales
  //   that gradient in place (2e).
  // - the strata executor's (executor/cuda/cross_entropy.cu, executor/cpu's) on its fp32
  //   logits, reading them only: max (4), the sum of exponentials (4) = 8, or both at once
  //   (4) where the device does it in one pass (Device::cross_entropy_one_pass: the CUDA
  //   backend); backward: each probability computed again from its logit, the gradient
  //   written in its place, rounded to 16 bits in the same pass (8); where the GEMMs read
  //   16-bit operands written in 16-bit storage beside them instead (4 + 2), for both GEMMs.
  const bool fused_ce = cs.stack.cross_entropy_fusion;
  const double strata_fwd = a.cl.device.cross_entropy_one_pass ? 4.0 : 8.0;
  const double fwd_ce = cs.stack.strata ? strata_fwd : fused_ce ? 3.0 * e : e + 36.0;
  const double bwd_ce = cs.stack.strata ? (a.casts_weights ? 6.0 : 8.0) : fused_ce ? 2.0 * e : 20.0 + e;
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
  if (a.casts_weights) a.mem("lm_head", Phase::backward, 6.0 * Vt * H);
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
