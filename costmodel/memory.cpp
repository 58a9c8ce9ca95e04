// Memory model; see memory.h. The per-layer activation derivation, for tokens T = B*S/c on
// this GPU, Tn = T/t with sequence parallelism (else T), e bytes per element, masks 1 byte:
//   norms' inputs            2 * e*Tn*H
//   QKV input                e*Tn*H          (sequence-parallel: stored sharded, re-gathered)
//   Q and K                  e*T*(A*D + G*D)/t
//   V                        e*T*G*D/t
//   unfused core             softmax out e*n, dropout mask n and dropout out e*n,
//                            n = B*(A/t)*(S/c)*S                  (only with attention dropout)
//   flash core               log-sum-exp 4*B*(A/t)*(S/c)
//   projection input         e*T*A*D/t
//   MLP input                e*Tn*H
//   activation input         e*T*F/t (GeLU) or 2*e*T*F/t (gated: SwiGLU, GeGLU)
//   fc2 input                e*T*F/t
//   dropout masks            2 * Tn*H                              (only with hidden dropout)
// For GPT-3 style (e = 2, G = A, F = 4H, dropout, c = 1) this is Korthikanti's
// s*b*h*(10 + 24/t + 5*a*s/(h*t)), and s*b*h*(34/t + 5*a*s/(h*t)) with sequence parallelism.
#include "costmodel/memory.h"

#include <algorithm>
#include <array>
#include <vector>

#include "costmodel/schedule.h"

namespace strata {

StateBytes state_bytes(Precision prec, bool fused, bool fp32_grads) {
  switch (prec) {
    // fp32 weights are the master copy; gradients fp32; Adam m and v.
    case Precision::fp32: return {4, 4, 8};
    // fp16 weights and gradients; optimizer: fp32 master, fp32 gradient copy, m, v
    // (Megatron's "20 bytes per parameter", 4 + 16/d with the distributed optimizer). With
    // fp32 main gradients (--accumulate-allreduce-grads-in-fp32) as bf16's below.
    case Precision::fp16: return fp32_grads ? StateBytes{2, fused ? 4.0 : 6.0, 12} : StateBytes{2, 2, 16};
    // bf16 weights; fp32 main gradients, plus (legacy stacks: DeepSpeed's bf16 optimizer,
    // Megatron without gradient-accumulation fusion) the bf16 gradients summed into them;
    // optimizer fp32 master, m, v. Megatron's "6 + 12/d" with fusion, BLOOM's "2 + 2 + 4".
    // fp8 parameters (Transformer Engine with Megatron's --fp8-param-gather: the model holds
    // fp8 weights, the optimizer the fp32 master), gradients and optimizer as bf16.
    // With bf16 main gradients (grad_reduce_in_fp32 false) 2 bytes each (plus the bf16
    // gradients summed into them where unfused), and the optimizer keeps an fp32 copy of its
    // shard's gradients (Megatron's distributed optimizer casts them before its step), as fp16.
    case Precision::bf16:
    case Precision::fp8: {
      const double w = prec == Precision::fp8 ? 1.0 : 2.0;
      return fp32_grads ? StateBytes{w, fused ? 4.0 : 6.0, 12} : StateBytes{w, fused ? 2.0 : 4.0, 16};
    }
  }
  return {2, 6, 12};
}

namespace {

// A mixture-of-experts layer's activations in place of the dense MLP's fc1 output and fc2
// input: the router's logits and fp32
// probabilities (Tn x E), the token copies as the experts' fc1 reads them (Tn K etp after
// the expert-tensor-parallel gather, compute_moe.cpp), each expert's fc1 output and fc2 input
// (split over etp), the experts' outputs the probability-weighted sum keeps (Tn K x H), and
// the shared expert's fc1 output and fc2 input. Out of line: the dense path stays short.
[[gnu::noinline]] double moe_mlp_activation_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs, double lin) {
  const double e = cs.act_bytes, T = cs.T, Tn = cs.Tn, H = static_cast<double>(m.H), t = static_cast<double>(p.t);
  const double K = static_cast<double>(m.K), etp = static_cast<double>(p.expert_tp());
  const double copies = Tn * K * etp;
  // A recomputed activation function (recompute_modules moe_act) keeps no fc2 input.
  const double fc2_in = p.recomputes(kRecomputeMoeAct) ? 0.0 : lin * copies * static_cast<double>(m.Fe) / etp;
  return (e + 4.0) * Tn * static_cast<double>(m.E) + lin * copies * H +
         e * copies * static_cast<double>(m.expert_fc1_out()) / etp + fc2_in +
         e * Tn * K * H + e * T * static_cast<double>(m.shared_fc1_out()) / t + lin * T * static_cast<double>(m.Fs) / t;
}

// What multi-latent attention changes in layer_activation_bytes' attention terms: V and the
// output Dv wide per head (not D); the latents' norms keep their inputs and the up
// projections theirs (the sequence shard, gathered again for the weight gradients); with
// fp8 each down projection keeps its own 1-byte copy of the norm's output (one more, unless
// recompute_modules layernorm drops both); and recompute_modules mla_up_proj drops the
// queries, keys and values, made again from the latents, and the up projections' inputs
// (the latents' norms, fused into them, run again). Out of line: the common path stays as
// it was.
[[gnu::noinline]] double mla_activation_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs, double proj_in,
                                              double lin) {
  const double e = cs.act_bytes, T = cs.T, Tn = cs.Tn, H = static_cast<double>(m.H), t = static_cast<double>(p.t);
  const double D_less = static_cast<double>(m.kv_width(p.t) - m.v_width(p.t));  // per rank, V and O alike
  const bool fp8 = p.precision == Precision::fp8 && !cs.stack.strata;
  double bytes = -(e + proj_in) * T * D_less + (e + lin) * Tn * static_cast<double>(m.q_lora_rank + m.kv_lora_rank);
  if (fp8 && !p.recomputes(kRecomputeLayernorm)) bytes += Tn * H;
  if (p.recomputes(kRecomputeMlaUpProj))
    bytes -= e * T * (static_cast<double>(m.AD()) / t + static_cast<double>(m.kv_width(p.t) + m.v_width(p.t))) +
             lin * Tn * static_cast<double>(m.q_lora_rank + m.kv_lora_rank);
  return bytes;
}

// torchtitan's op-level selective recompute (selective_ac_option op): a layer keeps its input
// (the checkpoint's), what the policy saves - the fused attention's output O and
// log-sum-exp, and the outputs of the odd matrix multiplications in forward order: of q, k,
// v, o, then gate, up, down (a gated MLP) or fc1, fc2, those of q, v, gate or fc1, and down
// (row-parallel: the whole sequence at full width, before its reduce-scatter) - and with
// sequence parallelism the two reduce-scatters' outputs.
// Everything else is made again before the layer's backward (op_sac_rebuilt_bytes).
[[gnu::noinline]] double op_sac_activation_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs) {
  const double e = cs.act_bytes, T = cs.T, Tn = cs.Tn, H = static_cast<double>(m.H), t = static_cast<double>(p.t);
  const double q = T * static_cast<double>(m.AD()) / t, v = T * static_cast<double>(m.kv_width(p.t));
  const double first_mlp = T * static_cast<double>(m.F) / t;  // gate, or a GeLU MLP's fc1
  const double down = m.gated() ? T * H : 0.0;                // the 7th; a GeLU MLP has 6
  const double heads = static_cast<double>(p.mbs) * static_cast<double>(m.A / p.t);
  const double Sq = static_cast<double>(m.S) / static_cast<double>(p.c);
  return e * (Tn * H + q + v + first_mlp + down + q) + 4.0 * heads * Sq + (p.sp && p.t > 1 ? 2.0 * e * Tn * H : 0.0);
}

// What op_sac rebuilds for one layer's backward, beside the working set: the norms'
// outputs (gathered too with sequence parallelism) and the residual stream between the
// blocks; the attention's inputs as its backward reads them: the roped q, and k and v
// repeated to every query head (torchtitan's repeat_kv copies both where a rank has more
// query heads than key/value heads; else the roped k, v being kept); and the MLP's up
// output and activation outputs (silu's and the product; a GeLU's output). (torchtitan's
// eager RMSNorm also holds an fp32 copy of its input; compiled, it does not: not counted.)
double op_sac_rebuilt_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs) {
  const double e = cs.act_bytes, T = cs.T, Tn = cs.Tn, H = static_cast<double>(m.H), t = static_cast<double>(p.t);
  const double q = T * static_cast<double>(m.AD()) / t, k = T * static_cast<double>(m.kv_width(p.t));
  const double Ft = T * static_cast<double>(m.F) / t;
  const bool repeated = q > k;
  return e * (3.0 * Tn * H + (p.sp && p.t > 1 ? 2.0 * T * H : 0.0) + (m.position == Position::rope ? q : 0.0) +
              (repeated ? 2.0 * q : k) + (m.gated() ? 3.0 : 1.0) * Ft);
}

// layer_activation_bytes, inlined into it and into layer_full_activation_bytes (both run
// for every candidate of a search).
[[gnu::always_inline]] inline double activation_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs) {
  const double e = cs.act_bytes, T = cs.T, Tn = cs.Tn, H = static_cast<double>(m.H);
  const double t = static_cast<double>(p.t);
  // K or V columns on this rank (each replicated group counted where t > G), and the queries'.
  const double GDt = static_cast<double>(m.kv_width(p.t)), AD = static_cast<double>(m.AD());
  if (p.recompute == Recompute::full) return e * Tn * H;  // the layer's input only
  if (p.op_sac()) return op_sac_activation_bytes(m, p, cs);
  // With fp8 (Transformer Engine) each linear layer keeps its input as the fp8 copy its
  // GEMM read (LayerNormLinear and LayerNormMLP keep ln_out and the activation's output
  // in fp8, Linear its fp8 input). A fused core that is not recomputed also keeps its
  // 16-bit output for its own backward, so the projection's input is then held twice.
  const bool fp8 = p.precision == Precision::fp8 && !cs.stack.strata;
  const double lin = fp8 ? 1.0 : e;
  const bool core_recomputed = p.recomputes(kRecomputeCoreAttn);
  const bool core_keeps_output = cs.attention != AttentionKernel::unfused && !core_recomputed;
  const double proj_in = !fp8 ? e : core_keeps_output ? e + 1.0 : 1.0;
  double bytes = 2.0 * e * Tn * H                  // norm inputs
                 + lin * Tn * H                    // QKV input
                 + e * T * (AD / t + GDt)          // Q, K
                 + e * T * GDt                     // V
                 + proj_in * T * AD / t            // attention output, projection input
                 + lin * Tn * H;                   // MLP input
  if (m.mla()) bytes += mla_activation_bytes(m, p, cs, proj_in, lin);
  if (m.moe()) {
    bytes += moe_mlp_activation_bytes(m, p, cs, lin);
  } else if (!p.recomputes(kRecomputeMlp)) {  // (added in the order of one sum: the same bits)
    bytes += e * T * static_cast<double>(m.fc1_out()) / t;  // fc1 output
    bytes += lin * T * static_cast<double>(m.F) / t;        // fc2 input
  } else if (cs.stack.modern && !p.recomputes(kRecomputeLayernorm)) {
    // recompute_modules mlp keeps only the block's input: on the modern stack the pre-MLP
    // norm is fused into fc1 and runs again with it, so its output (the MLP input) goes too.
    bytes -= lin * Tn * H;
  }

  // Recomputed norms (recompute_modules layernorm) keep neither output: the QKV and MLP inputs.
  if (p.recomputes(kRecomputeLayernorm)) bytes -= 2.0 * lin * Tn * H;
  if (m.hidden_dropout > 0) bytes += 2.0 * Tn * H;
  // The strata executor keeps the gathered (full-sequence) QKV and MLP inputs as well.
  if (cs.stack.strata && p.sp && p.t > 1) bytes += 2.0 * e * T * H;
  const double heads = static_cast<double>(p.mbs) * static_cast<double>(m.A / p.t);
  const double Sq = static_cast<double>(m.S) / static_cast<double>(p.c);
  if (cs.attention == AttentionKernel::unfused) {
    const double n = heads * Sq * static_cast<double>(m.S);
    if (!core_recomputed) bytes += (m.attention_dropout > 0 ? 2.0 * e + 1.0 : e) * n;
  } else if (!core_recomputed) {
    // A fused core keeps its log-sum-exp (its output is counted above, with the
    // projection's input); recomputed (selective), it keeps nothing of its own.
    bytes += 4.0 * heads * Sq;
  }
  return bytes;
}

}  // namespace

double layer_activation_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs) {
  return activation_bytes(m, p, cs);
}

// The groups of layer_activation_bytes' tensors that the plan's offload modules hold (the
// tensors each module saves, as Megatron-core's offload groups capture them), each of at
// least min_offloaded_tensor_size elements (smaller ones stay on the GPU), in the order of
// the layer's backward. On the modern stack, which the rules require, Transformer Engine's
// LayerNormLinear holds the attention's norm (input_layernorm is an identity: attn_norm has
// nothing), and so does a dense layer's fc1 (mlp_norm has nothing there; an MoE layer's
// pre-MLP norm is a module of its own). A selectively recomputed core runs outside its
// offload group: core_attn then has nothing. A fused core keeps Q, K, V, its log-sum-exp
// and its output O, which is also the projection's input (attn_proj): in 16 bits one
// tensor that each group copies, freed once both have it on the host (Megatron offloads
// attn_proj only with core_attn); with fp8 the projection keeps its own 1-byte copy.
// expert_fc1 makes the experts' fc1 keep its original 16-bit input (one tensor of every
// token copy) for the host, in place of the copy it would keep.
LayerOffload layer_offload(const ModelSpec& m, const Plan& p, const ComputeSetup& cs) {
  LayerOffload lo;
  const unsigned mods = p.offload_modules;
  if (mods == 0 || p.recompute == Recompute::full) return lo;
  const double e = cs.act_bytes, T = cs.T, Tn = cs.Tn, H = static_cast<double>(m.H);
  const double t = static_cast<double>(p.t);
  const double GDt = static_cast<double>(m.kv_width(p.t)), AD = static_cast<double>(m.AD());
  const bool fp8 = p.precision == Precision::fp8 && !cs.stack.strata;
  const double lin = fp8 ? 1.0 : e;
  const bool core_recomputed = p.recomputes(kRecomputeCoreAttn);
  const bool norms_recomputed = p.recomputes(kRecomputeLayernorm);
  const double least = static_cast<double>(p.min_offloaded_tensor_size);
  // A tensor of `elements` elements, `bytes` each, if it is large enough to go.
  auto tensor = [&](double bytes, double elements) { return elements >= least ? bytes * elements : 0.0; };
  auto group = [&](unsigned module, double freed, double copied) {
    if (!(mods & module) || copied <= 0) return;
    lo.group[lo.n++] = OffloadGroup{module, freed, copied};
    lo.freed += freed;
    lo.copied += copied;
  };
  if (m.moe()) {
    const double K = static_cast<double>(m.K), etp = static_cast<double>(p.expert_tp());
    const double copies = Tn * K * etp;
    const double fc1_out = tensor(e, copies * static_cast<double>(m.expert_fc1_out()) / etp);
    group(kOffloadMoeAct, fc1_out, fc1_out);
    group(kOffloadExpertFc1, lin * copies * H * (copies * H >= least ? 1.0 : 0.0), tensor(e, copies * H));
    group(kOffloadMlpNorm, tensor(e, Tn * H), tensor(e, Tn * H));
  }
  const bool fused = cs.attention != AttentionKernel::unfused;
  const double o = fused && !core_recomputed ? tensor(e, T * AD / t) : 0.0;  // the core's output O, where it keeps it
  const double proj_in = fp8 ? tensor(1.0, T * AD / t) : o > 0 ? o : tensor(e, T * AD / t);
  // (16 bits: O is freed with attn_proj's group, the later of the two to copy it.)
  group(kOffloadAttnProj, proj_in, proj_in);
  if (!core_recomputed) {
    const double heads = static_cast<double>(p.mbs) * static_cast<double>(m.A / p.t);
    const double Sq = static_cast<double>(m.S) / static_cast<double>(p.c);
    double core = tensor(e, T * AD / t) + 2.0 * tensor(e, T * GDt);  // Q, K, V
    if (!fused) {
      const double n = heads * Sq * static_cast<double>(m.S);
      core += m.attention_dropout > 0 ? 2.0 * tensor(e, n) + tensor(1.0, n) : tensor(e, n);
    } else {
      core += tensor(4.0, heads * Sq);  // log-sum-exp
    }
    group(kOffloadCoreAttn, core + (fp8 ? o : 0.0), core + o);
  }
  // The fused norm's input, and its output (the QKV input) unless the norms are recomputed.
  const double qkv = tensor(e, Tn * H) + (norms_recomputed ? 0.0 : tensor(lin, Tn * H));
  group(kOffloadQkvLinear, qkv, qkv);
  return lo;
}

double layer_offload_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs) {
  return layer_offload(m, p, cs).freed;
}

double layer_full_activation_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs) {
  return activation_bytes(m, p.without_recompute(), cs);
}

double embedding_activation_bytes(const ModelSpec& m, const Plan&, const ComputeSetup& cs) {
  return m.hidden_dropout > 0 ? cs.Tn * static_cast<double>(m.H) : 0.0;  // dropout mask
}

double head_activation_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs) {
  const double H = static_cast<double>(m.H);
  const double Vt = static_cast<double>(m.padded_vocab(p.t)) / static_cast<double>(p.t);
  // Final norm input and output (the output layer's input), and what the loss keeps for
  // backward: the unfused loss an fp32 softmax, the fused cross-entropy the logits as they are.
  // The strata executor keeps the gathered (full-sequence) norm output as well.
  const double gathered = cs.stack.strata && p.sp && p.t > 1 ? cs.act_bytes * cs.T * H : 0.0;
  return 2.0 * cs.act_bytes * cs.Tn * H + gathered + (cs.stack.cross_entropy_fusion ? cs.act_bytes : 4.0) * cs.T * Vt;
}

double head_working_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs) {
  const double Vt = static_cast<double>(m.padded_vocab(p.t)) / static_cast<double>(p.t);
  // The strata executor keeps its fp32 logits and turns them into their gradient in place
  // (executor/gpt.cpp head_forward, head_backward): beside them only the gradient of the
  // final norm's output (all T rows, gathered with sequence parallelism) and of its input
  // (this rank's rows), in fp32.
  // Where its GEMMs read 16-bit operands (ComputeSetup::sixteen_operands) the gradient is
  // written in 16 bits beside the logits instead, which are freed then: the 2 bytes a logit
  // with the logits, then with the two gradients.
  const double norm_grads = 4.0 * (cs.T + cs.Tn) * static_cast<double>(m.H);
  if (cs.stack.strata && cs.sixteen_operands) return 2.0 * cs.T * Vt + std::max(0.0, norm_grads - 4.0 * cs.T * Vt);
  if (cs.stack.strata) return norm_grads;
  // Unfused: the half-precision logits being cast, then the fp32 gradient of the logits.
  // Fused cross-entropy: the gradient of the logits in place of the logits.
  return (cs.stack.cross_entropy_fusion ? cs.act_bytes : cs.act_bytes + 4.0) * cs.T * Vt;
}

namespace {
// Activation offloading's groups of a layer (StageMemoryInputs::offload) and what stays.
// Out of line: the common path stays as it was.
[[gnu::noinline]] void offload_inputs(const ModelSpec& m, const Plan& p, const ComputeSetup& cs, StageMemoryInputs* in) {
  const double f = p.activation_offload_fraction;
  // (With partial recompute, the layers it leaves keep everything, and offload.)
  const bool full = p.recompute == Recompute::full;
  const LayerOffload lo = layer_offload(m, full ? p.without_recompute() : p, cs);
  (full ? in->per_full_layer : in->per_layer) -= f * lo.freed;
  in->offload_freed = lo.freed;
  in->offload_copied = lo.copied;
}
}  // namespace

namespace {
// Multi-token prediction's parameters on the last stage (StageMemoryInputs::mtp_params):
// with p > 1 the stage's own word embedding (and learned positions) too, which Megatron-core
// builds there for the modules (GPTModel: pre_process or mtp_process); tied, the output
// layer keeps its weight beside it, unused (the modules' logits take the embedding's).
double mtp_stage_params(const ModelSpec& m, const Plan& p) {
  return static_cast<double>(m.mtp_params(p.t, p.ep, p.etp)) +
         (p.p > 1 ? static_cast<double>(m.word_embedding_params(p.t) + m.position_params()) : 0.0);
}
// Its share of the last stage. Per micro-batch in flight each module keeps its transformer
// layer's activations (of the layer's kind; recomputed as compute.cpp recomputes it), the
// embedding's norm input and eh_proj's (Tn x 2H: with sequence parallelism the shard,
// gathered again in the backward; hnorm's input is the decoder's output, which the output
// layer keeps already), and as the output layer does, its final norm's input and output and
// the loss's logits (head_act). A module recomputed in full keeps its layer's input and,
// outside the checkpoint, the final norm's output and the logits.
[[gnu::noinline]] void mtp_inputs(const ModelSpec& m, const Plan& p, const ComputeSetup& cs, StageMemoryInputs* in) {
  const double n = static_cast<double>(m.mtp_layers);
  const bool dense_kind = m.mixed() && !m.mtp_moe();
  const bool recomputed = p.recompute == Recompute::full && p.recompute_layers == 0;
  const bool block = p.recompute == Recompute::full && p.recompute_layers > 0;  // (not recomputed)
  const double per = dense_kind ? (block ? in->dense.per_full_layer : in->dense.per_layer)
                                : (block ? in->per_full_layer : in->per_layer);
  const double TnH = cs.act_bytes * cs.Tn * static_cast<double>(m.H);
  const double extras = recomputed ? -TnH : 3.0 * TnH;
  in->head_act += n * (per + extras + in->head_act);
  in->mtp_params = mtp_stage_params(m, p);
  in->mtp_expert_params = m.mtp_moe() ? n * in->layer_expert_params : 0.0;
}
}  // namespace

StageMemoryInputs stage_memory_inputs(const ModelSpec& m, const Plan& p, const ComputeSetup& cs) {
  StageMemoryInputs in;
  in.per_layer = layer_activation_bytes(m, p, cs);
  in.per_full_layer = layer_full_activation_bytes(m, p, cs);
  if (p.offload_modules) offload_inputs(m, p, cs, &in);
  in.embedding_act = embedding_activation_bytes(m, p, cs);
  in.head_act = head_activation_bytes(m, p, cs);
  in.head_working = head_working_bytes(m, p, cs);
  in.layer_params = static_cast<double>(m.layer_params(p.t, p.ep, p.etp));
  in.layer_expert_params = m.moe() ? static_cast<double>(m.layer_expert_params(p.expert_tp(), p.ep)) : 0.0;
  in.word_embedding_params = static_cast<double>(m.word_embedding_params(p.t));
  in.position_params = static_cast<double>(m.position_params());
  in.final_norm_params = static_cast<double>(m.final_norm_params());
  if (m.mixed()) {
    const ModelSpec dm = m.dense_layers();
    StageMemoryInputs d;
    d.per_layer = layer_activation_bytes(dm, p, cs);
    d.per_full_layer = layer_full_activation_bytes(dm, p, cs);
    if (p.offload_modules) offload_inputs(dm, p, cs, &d);
    in.dense = StageMemoryInputs::Dense{d.per_layer, d.per_full_layer, static_cast<double>(dm.layer_params(p.t, p.ep, p.etp)),
                                        d.offload_freed, d.offload_copied};
  }
  if (m.mtp_layers > 0) mtp_inputs(m, p, cs, &in);
  return in;
}

namespace {

// (layers: the stage's, lay.stage_layers(s).)
inline double stage_params(const ModelSpec& m, const Plan& p, const StageLayout& lay, int64_t s, const StageMemoryInputs& in,
                           int64_t layers) {
  double n = static_cast<double>(layers) * in.layer_params;
  if (!lay.dense.empty())  // a mixed model's dense layers
    if (const int64_t nd = lay.stage_dense(s); nd > 0)
      n = static_cast<double>(layers - nd) * in.layer_params + static_cast<double>(nd) * in.dense.layer_params;
  const double emb = in.word_embedding_params;
  if (s == 0) n += emb + in.position_params;
  if (s == p.p - 1) {
    n += in.final_norm_params + in.mtp_params;
    if (!m.tie_embeddings || p.p > 1) n += emb;  // untied output layer, or the tied copy
  }
  return n;
}

// A layout of a mixed model's layers without their kinds counted (made from the layer count
// alone): counted here, so that no caller costs every layer as an MoE layer.
[[gnu::noinline]] StageLayout counted(const ModelSpec& m, const Plan& p, const StageLayout& lay) {
  StageLayout c = lay;
  count_layer_kinds(m, p, &c);
  return c;
}

}  // namespace

double stage_params(const ModelSpec& m, const Plan& p, const StageLayout& lay, int64_t s) {
  if (m.mixed() && lay.dense.empty()) return stage_params(m, p, counted(m, p, lay), s);
  StageMemoryInputs in;
  in.layer_params = static_cast<double>(m.layer_params(p.t, p.ep, p.etp));
  in.word_embedding_params = static_cast<double>(m.word_embedding_params(p.t));
  in.position_params = static_cast<double>(m.position_params());
  in.final_norm_params = static_cast<double>(m.final_norm_params());
  if (m.mixed()) in.dense.layer_params = static_cast<double>(m.dense_layers().layer_params(p.t, p.ep, p.etp));
  if (m.mtp_layers > 0) in.mtp_params = mtp_stage_params(m, p);
  return stage_params(m, p, lay, s, in, lay.stage_layers(s));
}

double weighted_activation_peak(const Plan& p, int64_t s, const double* chunk_weights) {
  double unused = 0;
  return weighted_activation_peak(p, s, chunk_weights, nullptr, &unused);
}

double weighted_activation_peak(const Plan& p, int64_t s, const double* chunk_weights, const double* chunk_parts,
                                double* part_at_peak) {
  const bool interleaved = p.schedule() == ScheduleKind::interleaved;
  const ScheduleShape sh{p.schedule(), p.p, interleaved ? p.v : 1, p.microbatches(), interleaved ? p.vp_group_size() : 0};
  // The last few walks, by their whole input: a search asks again for every ZeRO stage of a
  // candidate (activations do not depend on it), and a middle stage like another for its own.
  struct Memo {
    std::array<int64_t, 6> shape;  // kind, p, v, m, g, s
    std::vector<double> weights;   // the chunk weights, then the parts (none without)
    double peak, part;
  };
  thread_local std::vector<Memo> memo;
  thread_local size_t memo_next = 0;
  const std::array<int64_t, 6> shape_key{static_cast<int64_t>(sh.kind), sh.p, sh.v, sh.m, sh.g, s};
  thread_local std::vector<double> key;  // (per thread, as the memo: no allocation a call)
  key.assign(chunk_weights, chunk_weights + sh.v);
  if (chunk_parts) key.insert(key.end(), chunk_parts, chunk_parts + sh.v);
  for (const Memo& e : memo)
    if (e.shape == shape_key && e.weights == key) return *part_at_peak = e.part, e.peak;
  auto remember = [&](double peak, double part) {
    Memo e{shape_key, key, peak, part};
    if (memo.size() < 8) memo.push_back(std::move(e));
    else memo[memo_next++ % 8] = std::move(e);
    *part_at_peak = part;
    return peak;
  };
  const int64_t warm = sh.warmup(s), positions = sh.positions();
  // Past its warm-up an interleaved stage alternates a forward and a backward; while both
  // run full groups (forward index (k + warm) / 2 below the last group's head, and before
  // the cool-down) their chunks repeat every group through the chunks, P = 2 g v positions,
  // each chunk entered g times and left g times. So once a period has left the sums exactly
  // where they began (the same additions from the same values: bit for bit), every further
  // whole period inside that region repeats it, peak included, and is skipped; the rest is
  // walked. (A search meets layouts with unlike chunks in every one of its plans.)
  int64_t period = 0, region_end = 0;
  if (interleaved) {
    const int64_t g = sh.group();
    const Groups gr = groups_of(sh.m, g, sh.v);
    const int64_t head = gr.last == g ? sh.m * sh.v : gr.head;
    period = 2 * g * sh.v;
    region_end = std::min(2 * head - warm, positions - warm);
  }
  double now = 0, peak = 0, period_start = 0, part = 0, part_peak = 0, part_start = 0;
  for (int64_t k = 0; k < positions; ++k) {
    if (period > 0 && k >= warm && (k - warm) % period == 0) {
      if (k > warm && now == period_start && part == part_start && k <= region_end) {
        k += (region_end - k) / period * period;
        period = 0;
        if (k >= positions) break;
      } else {
        period_start = now;
        part_start = part;
      }
    }
    const StepAt st = sh.at(s, k, warm);
    const double sign = st.forward ? 1.0 : -1.0;
    now += sign * chunk_weights[st.chunk];
    if (chunk_parts) part += sign * chunk_parts[st.chunk];
    if (now > peak) peak = now, part_peak = part;
  }
  return remember(peak, part_peak);
}

namespace {

// What a stage holds whatever its micro-batches in flight: its states and communication
// buffers (in `fixed`), one chunk-micro-batch of its layers' activations and the working
// set of its backward.
struct StageShape {
  MemoryBreakdown fixed;
  double per_chunk = 0, working = 0;
  double step_copy = 0;  // the optimizer step's fp32 copy of 16-bit main gradients, where transient
  // The part of per_chunk that recomputed layers keep (their inputs), and of each chunk
  // weight where there are weights: with_in_flight charges it the allocator's fraction for
  // recompute, and the rest of what the stage keeps the one for saved tensors.
  double per_chunk_recomputed = 0;
  std::vector<double> chunk_recomputed;
  // Each chunk's activations, with the embedding's on stage 0's first chunk and the output
  // layer's on the last stage's last, where a plan's own split leaves the stage's chunks
  // unlike (else empty: the average above is exact).
  std::vector<double> chunk_weights;
};

StageShape stage_shape(const ModelSpec& m, const Plan& p, const StageLayout& lay, const ComputeSetup& cs, int64_t s,
                       const StageMemoryInputs& in) {
  StageShape shape;
  MemoryBreakdown& mb = shape.fixed;
  const int64_t layers_here = lay.stage_layers(s);
  const double P = stage_params(m, p, lay, s, in, layers_here);
  mb.params = P;
  const int64_t dense_layers = lay.dense.empty() ? 0 : lay.stage_dense(s);  // a mixed model's dense layers here
  const double Pe = in.layer_expert_params > 0
                        ? static_cast<double>(layers_here - dense_layers) * in.layer_expert_params +
                              (s == p.p - 1 ? in.mtp_expert_params : 0.0)
                        : 0.0;  // the routed experts' share of P
  mb.expert_params = Pe;
  const double d = static_cast<double>(p.shard_ranks());  // the ranks ZeRO shards over
  StateBytes sb = state_bytes(p.precision, cs.stack.grad_accumulation_fusion, cs.stack.grad_reduce_in_fp32);
  // The strata executor: its working weights as floats (holding the values rounded to the
  // compute precision: 4 bytes each in every precision), fp32 gradients, fp32 master (mixed
  // precision only) and Adam moments.
  if (cs.stack.strata) sb = {cs.weight_work_bytes, 4.0, p.precision == Precision::fp32 ? 8.0 : 12.0};
  // fp8 weights of 1 byte are Megatron's --fp8-param-gather, which it runs only where the
  // parameters are gathered (the distributed optimizer, FSDP; Plan::fp8_weights): without it
  // the model keeps bf16 weights, which Transformer Engine casts to fp8 for each GEMM.
  else if (p.precision == Precision::fp8 && !p.fp8_weights()) sb.weights = 2.0;
  // Megatron-core with 16-bit main gradients (grad_reduce_in_fp32 off; fp16's default): the
  // optimizer casts its shard's gradients to fp32 at the step (shard_main_param.grad =
  // grad.float()) and drops them when the next step zeroes its gradients (set to None),
  // before any forward: a transient of the step, while no activations are alive, not a
  // state. The legacy stacks' optimizers (apex-style FP16_Optimizer, DeepSpeed's ZeRO) keep
  // their fp32 gradient copy: among the states (state_bytes' 16).
  double copy_per = 0;
  if (cs.stack.modern && cs.grad_bytes < 4.0) {
    sb.optimizer_states -= 4.0;
    copy_per = 4.0;
  }
  // Megatron-core's precision-aware optimizer: the master weights (16-bit remainders of
  // bf16 weights, or main_params_dtype) and the moments in their own types. Transformer
  // Engine manages them for 16-bit parameters and steps on the gradients as they are (no
  // fp32 copy); with fp8 parameters Megatron-core keeps its fp32 master weights and copy.
  if (p.precision_aware_optimizer && !cs.stack.strata) {
    double master = 4.0;
    if (p.precision != Precision::fp8) {
      master = p.precision == Precision::bf16 && p.store_param_remainders && p.main_params_dtype == OptDtype::fp32
                   ? 2.0
                   : bytes_of(p.main_params_dtype);
      copy_per = 0;
    }
    sb.optimizer_states = master + bytes_of(p.exp_avg_dtype) + bytes_of(p.exp_avg_sq_dtype);
  }
  if (Pe == 0) {
    mb.weights = sb.weights * P / (p.zero >= 3 ? d : 1.0);
    mb.gradients = sb.gradients * P / (p.zero >= 2 ? d : 1.0);
    mb.optimizer_states = sb.optimizer_states * P / (p.zero >= 1 ? d : 1.0);
    if (copy_per > 0) shape.step_copy = copy_per * P / (p.zero >= 1 ? d : 1.0);
  } else {  // the dense parameters sharded over their d replicas, the experts' over theirs
    const double de = static_cast<double>(p.expert_shard_ranks());
    auto states = [&](double per, bool sharded) { return sharded ? per * (P - Pe) / d + per * Pe / de : per * P; };
    mb.weights = states(sb.weights, p.zero >= 3);
    mb.gradients = states(sb.gradients, p.zero >= 2);
    mb.optimizer_states = states(sb.optimizer_states, p.zero >= 1);
    shape.step_copy = states(copy_per, p.zero >= 1);
  }
  // ZeRO-1 in the strata executor reduce-scatters the full gradient buffer into a separate
  // owned block (Megatron's distributed optimizer works in place).
  if (cs.stack.strata && p.zero == 1 && d > 1) mb.gradients += sb.gradients * P / d;
  if (p.offload > 0) {  // that share of the states on the host, with an fp32 gradient each
    const double moved = p.offload * mb.optimizer_states;
    mb.optimizer_states -= moved;
    shape.step_copy *= 1.0 - p.offload;  // (that share's fp32 gradients are the host's, below)
    const double shard = p.zero < 1 ? P : Pe == 0 ? P / d : (P - Pe) / d + Pe / static_cast<double>(p.expert_shard_ranks());
    // (A legacy optimizer's states with 16-bit gradients, 16 bytes, hold that fp32 gradient already.)
    const double grad32 = sb.optimizer_states >= 16.0 ? 0.0 : 4.0;
    mb.host_offload = moved + (Pe == 0 ? grad32 * p.offload * P / (p.zero >= 1 ? d : 1.0) : grad32 * p.offload * shard);
    // With ZeRO-2/3 the gradient shard is the offloaded parameters' own (DeepSpeed's
    // ZeRO-Offload moves each reduced partition to the host); Megatron's distributed
    // optimizer (ZeRO-1) keeps its gradient buffer on the GPU.
    if (p.zero >= 2) mb.gradients -= p.offload * mb.gradients;
  }

  // Activations: the layers of an average chunk of the stage (times the chunk-microbatches
  // in flight, below). With partial recompute, the recomputed layers keep their input only.
  // A mixed model's dense layers keep their own.
  const double per_layer = in.per_layer;
  const double per_full_layer = in.per_full_layer;
  double& per_chunk = shape.per_chunk;
  auto chunk_act = [&](int64_t c) {
    const int64_t n = lay.chunk_layers(s, c);
    const int64_t k = p.recompute == Recompute::full ? p.recomputed_layers(n) : n;
    return static_cast<double>(k) * per_layer + static_cast<double>(n - k) * per_full_layer;
  };
  // A mixed model's chunk, its dense layers' own (nd of the n, kd of the k).
  auto mixed_chunk_act = [&](int64_t c) {
    const int64_t n = lay.chunk_layers(s, c);
    const int64_t k = p.recompute == Recompute::full ? p.recomputed_layers(n) : n;
    const int64_t nd = lay.chunk_dense(s, c), kd = lay.chunk_dense_recomputed(s, c);
    return static_cast<double>(k - kd) * per_layer + static_cast<double>(n - k - (nd - kd)) * per_full_layer +
           static_cast<double>(kd) * in.dense.per_layer + static_cast<double>(nd - kd) * in.dense.per_full_layer;
  };
  // What a chunk's recomputed layers keep: their inputs (a mixed model's dense ones their own).
  auto chunk_recomputed = [&](int64_t c) {
    if (p.recompute != Recompute::full) return 0.0;
    const int64_t k = p.recomputed_layers(lay.chunk_layers(s, c));
    if (dense_layers == 0) return static_cast<double>(k) * per_layer;
    const int64_t kd = lay.chunk_dense_recomputed(s, c);
    return static_cast<double>(k - kd) * per_layer + static_cast<double>(kd) * in.dense.per_layer;
  };
  bool alike = true;
  if (dense_layers == 0) {
    for (int64_t c = 0; c < lay.v; ++c) {
      per_chunk += chunk_act(c);
      alike = alike && lay.chunk_layers(s, c) == lay.chunk_layers(s, 0);
    }
  } else {
    for (int64_t c = 0; c < lay.v; ++c) {
      per_chunk += mixed_chunk_act(c);
      alike = alike && lay.chunk_layers(s, c) == lay.chunk_layers(s, 0) && lay.chunk_dense(s, c) == lay.chunk_dense(s, 0) &&
              lay.chunk_dense_recomputed(s, c) == lay.chunk_dense_recomputed(s, 0);
    }
  }
  for (int64_t c = 0; c < lay.v; ++c) shape.per_chunk_recomputed += chunk_recomputed(c);
  if ((p.explicit_split() || dense_layers > 0) && !alike) {
    for (int64_t c = 0; c < lay.v; ++c) {
      double w = dense_layers == 0 ? chunk_act(c) : mixed_chunk_act(c);
      if (lay.has_embedding(s, c)) w += in.embedding_act;
      if (lay.has_head(s, c)) w += in.head_act;
      shape.chunk_weights.push_back(w);
      if (p.recompute == Recompute::full) shape.chunk_recomputed.push_back(chunk_recomputed(c));
    }
  }
  per_chunk /= static_cast<double>(lay.v);
  shape.per_chunk_recomputed /= static_cast<double>(lay.v);
  // Of the layer kinds a mixed model's stage holds (one or both), the larger of what follows.
  const bool moe_here = layers_here > dense_layers;
  auto larger = [&](double moe_kind, double dense_kind) { return std::max(moe_here ? moe_kind : 0.0, dense_kind); };
  // Working set of the layer running its backward: the gradients of its largest
  // activations (fc1 output, activation output, two of width H) and, when recomputed, the
  // whole layer's activations rebuilt for it. The loss adds its own on the last stage.
  double& working = shape.working;
  if (layers_here > 0) {
    auto dense_mlp = [&] {
      return cs.act_bytes * cs.T *
             ((static_cast<double>(m.fc1_out()) + static_cast<double>(m.F)) / static_cast<double>(p.t) +
              2.0 * static_cast<double>(m.H));
    };
    if (!m.moe()) {
      working = dense_mlp();
    } else {  // the token copies' expert activations and the shared expert's in their place
      const double etp = static_cast<double>(p.expert_tp()), copies = cs.Tn * static_cast<double>(m.K) * etp;
      working = cs.act_bytes * (copies * (static_cast<double>(m.expert_fc1_out() + m.Fe) / etp + 2.0 * static_cast<double>(m.H)) +
                                cs.T * static_cast<double>(m.shared_fc1_out() + m.Fs) / static_cast<double>(p.t));
      if (dense_layers > 0) working = larger(working, dense_mlp());
    }
    // A recomputed layer rebuilds all its activations for its backward. With partial
    // recompute the recomputed (first) layers of a chunk run their backward last, after
    // the chunk's other layers freed more than one layer's worth: no new peak.
    bool every_layer_recomputed = p.recompute == Recompute::full;
    for (int64_t c = 0; c < lay.v && every_layer_recomputed; ++c)
      every_layer_recomputed = p.recomputed_layers(lay.chunk_layers(s, c)) == lay.chunk_layers(s, c);
    // (per_full_layer is what an offloading layer keeps; the rebuilt layer is whole.)
    const double f = p.activation_offload_fraction;
    double offloaded = f * in.offload_freed, freed = in.offload_freed, rebuilt = in.per_full_layer + offloaded;
    if (dense_layers > 0) {
      offloaded = larger(offloaded, f * in.dense.offload_freed);
      freed = larger(freed, in.dense.offload_freed);
      rebuilt = larger(rebuilt, in.dense.per_full_layer + f * in.dense.offload_freed);
    }
    if (every_layer_recomputed) working += rebuilt;
    // Offloaded activations: Megatron-core keeps one layer's groups on the GPU (each
    // module's last group of the first chunk backwarded, its margin: the layer whose
    // backward runs at the peak) and reloads the layer below's while it runs; a stage whose
    // every layer is recomputed offloads nothing.
    if (offloaded > 0 && !every_layer_recomputed) working += 2.0 * freed;
    // recompute_modules mla_up_proj and mlp rebuild one layer's queries, keys and values
    // and its MLP's fc1 output and fc2 input for its backward.
    if (p.recomputes(kRecomputeMlaUpProj | kRecomputeMlp)) {
      if (m.mla() && p.recomputes(kRecomputeMlaUpProj))
        working += cs.act_bytes * cs.T *
                   (static_cast<double>(m.AD()) / static_cast<double>(p.t) + static_cast<double>(m.kv_width(p.t) + m.v_width(p.t)));
      if (p.recomputes(kRecomputeMlp) && (!m.moe() || dense_layers > 0))
        working += cs.act_bytes * cs.T * (static_cast<double>(m.fc1_out()) + static_cast<double>(m.F)) / static_cast<double>(p.t);
    }
    if (p.op_sac()) working += op_sac_rebuilt_bytes(m, p, cs);
    // Selective recompute of an unfused core rebuilds one layer's S x S probabilities.
    if (p.recomputes(kRecomputeCoreAttn) && cs.attention == AttentionKernel::unfused)
      working += cs.act_bytes * static_cast<double>(p.mbs) * static_cast<double>(m.A / p.t) *
                 (static_cast<double>(m.S) / static_cast<double>(p.c)) * static_cast<double>(m.S);
  }
  // Communication buffers: pipeline send/recv in both directions; ZeRO-3's gathered layer
  // and its prefetched successor, and (ZeRO-2 and 3) one layer of gradients to
  // reduce-scatter.
  double comm = 0;
  // (The strata executor receives straight into the next layer's input, an activation.)
  if (p.p > 1 && !cs.stack.strata) comm += 4.0 * cs.act_bytes * cs.Tn * static_cast<double>(m.H);
  // The strata executor (ZeRO-2/3) reduce-scatters each unit's micro-batch gradient, one
  // at a time, while the next unit's is formed: at most the two largest units of the stage
  // (whether the second is still held depends on when the first completes); with tied
  // embeddings on one stage the wte gradient, formed at the output layer, waits for the
  // embedding's backward as well. ZeRO-3 holds the gathered unit in use and the one
  // prefetched: again the two largest.
  if (cs.stack.strata && p.zero >= 2 && p.replicas() > 1) {
    std::vector<double> units;
    for (int64_t c = 0; c < lay.v; ++c) {
      if (lay.has_head(s, c))
        units.push_back(in.final_norm_params +
                        (!m.tie_embeddings || p.p > 1 ? in.word_embedding_params : 0.0));
      for (int64_t l = 0; l < lay.chunk_layers(s, c); ++l) units.push_back(in.layer_params);
      if (lay.has_embedding(s, c))
        units.push_back(in.word_embedding_params + in.position_params);
    }
    std::sort(units.rbegin(), units.rend());
    const double top2 = (units.size() > 0 ? units[0] : 0.0) + (units.size() > 1 ? units[1] : 0.0);
    const bool tied_here = m.tie_embeddings && p.p == 1;
    comm += cs.grad_bytes * (top2 + (tied_here ? in.word_embedding_params : 0.0));
    if (p.zero >= 3) comm += cs.weight_work_bytes * top2;  // gathered as floats
  }
  if ((p.zero == 1 || p.zero == 2) && p.replicas() > 1 && !cs.stack.modern && !cs.stack.strata) {
    // Legacy sharded optimizers stage gradients and parameters through flat buckets:
    // DeepSpeed's reduce_bucket_size and allgather_bucket_size default to 5e8 elements
    // each. (Megatron-core's distributed optimizer works in place in its buffers.)
    constexpr double kDeepSpeedBucketElements = 5e8;
    comm += std::min(P, kDeepSpeedBucketElements) * (cs.grad_bytes + cs.weight_bytes);
  }
  if (p.zero >= 3 && p.replicas() > 1 && !cs.stack.strata) {
    const double lp = dense_layers > 0 ? larger(in.layer_params, in.dense.layer_params) : in.layer_params;
    comm += 2.0 * cs.weight_bytes * lp + cs.grad_bytes * lp;
  }
  // ZeRO-2 on the modern stack (FSDP's SHARD_GRAD_OP): one layer's whole gradient waiting
  // for its reduce-scatter (legacy stacks stage it in DeepSpeed's bucket above).
  if (p.zero == 2 && p.replicas() > 1 && cs.stack.modern)
    comm += cs.grad_bytes * (dense_layers > 0 ? larger(in.layer_params, in.dense.layer_params) : in.layer_params);
  // Transformer Engine's user buffers (Stack::userbuffers; Megatron's _initialize_tp_communicators
  // with Transformer Engine 2.7 or later): twelve of Megatron's input shape, the
  // micro-batch's sequence on this context-parallel rank x H, bf16 (Megatron gives no other
  // type) but the eight that feed all-gathers (qkv, proj, fc1, fc2 dgrad; qkv, fc1 fprop;
  // proj, fc2 wgrad), fp8 in an fp8 run; the forward reduce-scatters' (proj, fc2 fprop) run
  // as ring exchanges in fp8 runs (compute.cpp) and hold (2t - 1)/t of the shape.
  if (cs.stack.userbuffers) {
    const double t = static_cast<double>(p.t);
    const double rs_fprop = p.precision == Precision::fp8 ? (2.0 * t - 1.0) / t : 1.0;
    comm += cs.T * static_cast<double>(m.H) * (8.0 * ub_element_bytes(p, true, 2.0) + 2.0 * 2.0 * (rs_fprop + 1.0));
  }
  mb.comm_buffers = comm;
  return shape;
}

// The host's share of stage s's activations with `in_flight` chunk-micro-batches alive
// (offloading only: in.offload_copied > 0): the copies of an average chunk's offloading layers.
// Out of line, and outside the breakdown's common path.
[[gnu::noinline]] double host_activations(const Plan& p, const StageLayout& lay, int64_t s, int64_t in_flight,
                                          const StageMemoryInputs& in) {
  double layers = 0, dense = 0;  // of an average chunk, those that offload (with partial recompute, the others)
  for (int64_t c = 0; c < lay.v; ++c) {
    const int64_t n = lay.chunk_layers(s, c), nd = lay.chunk_dense(s, c);  // (nd: a mixed model's dense layers)
    const bool full = p.recompute == Recompute::full;
    const int64_t d = full ? nd - lay.chunk_dense_recomputed(s, c) : nd;
    layers += static_cast<double>((full ? n - p.recomputed_layers(n) : n) - d);
    dense += static_cast<double>(d);
  }
  const double share = static_cast<double>(in_flight) * p.activation_offload_fraction;
  double host = share * in.offload_copied * layers / static_cast<double>(lay.v);
  if (dense > 0) host += share * in.dense.offload_copied * dense / static_cast<double>(lay.v);
  return host;
}

// The optimizer step, where its fp32 gradient copy (stage_shape) outweighs the activations:
// the terms as they stand then (the copy among the optimizer's states, no activations).
// Out of line: the common path stays a straight copy of the stage's shape.
[[gnu::noinline]] void at_optimizer_step(const Cluster& cl, double step_copy, MemoryBreakdown& mb) {
  const double overhead = cl.framework_overhead_bytes + cl.allocator_fragmentation * step_copy;
  const double at_step = mb.weights + mb.gradients + mb.optimizer_states + step_copy + mb.comm_buffers + overhead;
  if (at_step <= mb.peak) return;
  mb.optimizer_states += step_copy;
  mb.activations = 0;
  mb.framework_overhead = overhead;
  mb.peak = at_step;
  mb.at_optimizer_step = true;
}

// A stage's memory with its micro-batches in flight, written into *out (in place: no copy
// of the breakdown in the search's loop).
void with_in_flight(const StageShape& shape, const Cluster& cl, const Plan& p, const ComputeSetup& cs, int64_t s,
                    int64_t in_flight, int64_t in_flight_first, int64_t in_flight_last, const StageMemoryInputs& in,
                    MemoryBreakdown* out) {
  MemoryBreakdown& mb = *out;
  mb = shape.fixed;
  mb.stage = s;
  const double per_chunk = shape.per_chunk, working = shape.working;
  double act = static_cast<double>(in_flight) * per_chunk;
  double act_recomputed = static_cast<double>(in_flight) * shape.per_chunk_recomputed;
  if (s == 0) act += static_cast<double>(in_flight_first) * in.embedding_act;
  if (s == p.p - 1) act += static_cast<double>(in_flight_last) * in.head_act;
  if (!shape.chunk_weights.empty()) {  // (the recomputed layers' part summed alongside, at the peak)
    act_recomputed = 0;
    act = weighted_activation_peak(p, s, shape.chunk_weights.data(),
                                   shape.chunk_recomputed.empty() ? nullptr : shape.chunk_recomputed.data(),
                                   &act_recomputed);
  }
  // What is kept from forward to backward (act) and the working set beside it at the peak.
  double kept = act, transient = working;
  // The last stage: while the loss and its gradient are formed the current micro-batch's
  // output-layer activations are alive; the layers' backward starts after they are freed.
  if (s == p.p - 1) {
    if (in.head_working >= working - in.head_act) transient = in.head_working;
    else kept = act - in.head_act;
  }
  mb.activations = kept + transient;

  // The framework's own memory (CUDA context, library workspaces, communicator buffers) and
  // what the caching allocator reserves beyond the live tensors, as a fraction of them.
  // Fragmentation hits what is allocated and freed during the step: activations, and on
  // legacy stacks the per-parameter gradients autograd allocates (modern stacks keep them
  // in one contiguous buffer). Tensors saved from a layer's forward for its backward are
  // freed in the reverse order of their allocation and asked for again at the same sizes
  // by the next micro-batch, so the allocator's cached blocks fit them
  // (allocator_fragmentation_saved). The backward's working set is allocated and freed
  // out of that order, and a recomputed layer's activations are rebuilt in the backward
  // among it and the layers' kept inputs, whose segments they split
  // (allocator_fragmentation: the working set, and what recomputed layers keep).
  const double churn = transient + std::min(act_recomputed, kept);
  mb.framework_overhead = cl.framework_overhead_bytes + cl.allocator_fragmentation * churn +
                          cl.allocator_fragmentation_saved * (mb.activations - churn) +
                          (cs.stack.modern ? 0.0 : cl.allocator_fragmentation * mb.gradients);
  mb.peak = mb.weights + mb.gradients + mb.optimizer_states + mb.activations + mb.comm_buffers + mb.framework_overhead;
  if (shape.step_copy > 0) at_optimizer_step(cl, shape.step_copy, mb);
}

}  // namespace

MemoryBreakdown stage_memory(const ModelSpec& m, const Cluster& cl, const Plan& p, const StageLayout& lay,
                             const ComputeSetup& cs, int64_t s, int64_t in_flight, int64_t in_flight_first,
                             int64_t in_flight_last, const StageMemoryInputs* pre) {
  if (m.mixed() && lay.dense.empty())
    return stage_memory(m, cl, p, counted(m, p, lay), cs, s, in_flight, in_flight_first, in_flight_last, pre);
  const StageMemoryInputs in = pre ? *pre : stage_memory_inputs(m, p, cs);
  MemoryBreakdown mb;
  with_in_flight(stage_shape(m, p, lay, cs, s, in), cl, p, cs, s, in_flight, in_flight_first, in_flight_last, in, &mb);
  if (in.offload_copied > 0 || in.dense.offload_copied > 0) mb.host_activations = host_activations(p, lay, s, in_flight, in);
  return mb;
}

void stage_memories(const ModelSpec& m, const Cluster& cl, const Plan& p, const StageLayout& lay,
                    const ComputeSetup& cs, const int64_t* in_flight, const int64_t* in_flight_first,
                    const int64_t* in_flight_last, std::vector<MemoryBreakdown>* out) {
  if (m.mixed() && lay.dense.empty())
    return stage_memories(m, cl, p, counted(m, p, lay), cs, in_flight, in_flight_first, in_flight_last, out);
  const StageMemoryInputs in = stage_memory_inputs(m, p, cs);
  out->resize(static_cast<size_t>(p.p));
  StageShape shape;
  for (int64_t s = 0; s < p.p; ++s) {
    // A middle stage with the layers of the middle stage before it holds what that one holds
    // but for its micro-batches in flight (no embedding, no output layer: 0 < s < p - 1).
    bool like = s >= 2 && s < p.p - 1;
    for (int64_t c = 0; c < lay.v && like; ++c)
      like = lay.chunk_layers(s, c) == lay.chunk_layers(s - 1, c) &&
             (lay.dense.empty() || (lay.chunk_dense(s, c) == lay.chunk_dense(s - 1, c) &&
                                    lay.chunk_dense_recomputed(s, c) == lay.chunk_dense_recomputed(s - 1, c)));
    if (!like) shape = stage_shape(m, p, lay, cs, s, in);
    const size_t i = static_cast<size_t>(s);
    with_in_flight(shape, cl, p, cs, s, in_flight[i], in_flight_first[i], in_flight_last[i], in, &(*out)[i]);
  }
  if (in.offload_copied > 0 || in.dense.offload_copied > 0)
    for (int64_t s = 0; s < p.p; ++s)
      (*out)[static_cast<size_t>(s)].host_activations = host_activations(p, lay, s, in_flight[s], in);
}

}  // namespace strata
