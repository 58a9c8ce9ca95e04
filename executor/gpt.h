// The transformer, forward and backward by hand, one free function per part and
// direction, for one tensor-parallel rank: the vocab-parallel embedding, a layer
// (column-parallel QKV and fc1, row-parallel proj and fc2, optional sequence parallelism,
// selective or full recompute), and the head (final norm, vocab-parallel logits and
// cross-entropy). Weights are read and gradients accumulated through UnitViews, so the
// caller decides where a unit lives (the flat buffer, or a ZeRO-3 gathered copy).
// Activations are kept in (S, B, H) order, as Megatron does; with sequence parallelism a
// rank holds rows [r*n, (r+1)*n) of the N = S*B rows, n = N/t.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <vector>

#include "costmodel/model_spec.h"
#include "costmodel/plan.h"
#include "executor/backend.h"
#include "executor/comm.h"
#include "executor/memory_tracker.h"
#include "executor/op_log.h"
#include "executor/param_layout.h"

namespace strata {

// Weights and gradients of one unit: w and g point at the unit's first element.
struct UnitView {
  const ParamLayout* lay = nullptr;
  int64_t begin = 0;  // the unit's begin in the layout
  const float* w = nullptr;
  float* g = nullptr;
  const float* weight(TensorKind k, int64_t layer = -1) const { return w + (lay->at(k, layer).offset - begin); }
  float* grad(TensorKind k, int64_t layer = -1) const { return g + (lay->at(k, layer).offset - begin); }
  const float* weight_or_null(TensorKind k, int64_t layer = -1) const {
    return lay->has(k, layer) ? weight(k, layer) : nullptr;
  }
  float* grad_or_null(TensorKind k, int64_t layer = -1) const { return lay->has(k, layer) ? grad(k, layer) : nullptr; }
};

// One group's collectives in one step as this rank saw them, so the engine can tell waiting
// for a peer that started a collective later (skew) from the transfer: when each was
// started, in order (the same order on every member of the group), and each wait with the
// index of the collective it waited for; seconds on the comm clock. Indices count from the
// start of training, so a collective started in an earlier step never matches this one's.
struct CommWaits {
  struct Wait {
    int64_t idx = 0;
    double begin = 0, end = 0;
  };
  std::vector<double> launch;
  std::vector<Wait> waits;
  int64_t base = 0;  // the index of this step's first collective
  int64_t launched(double t) {
    launch.push_back(t);
    return base + static_cast<int64_t>(launch.size()) - 1;
  }
  void waited(int64_t idx, double t0, double t1) {
    if (idx >= base) waits.push_back({idx - base, t0, t1});
  }
  void new_step() {
    base += static_cast<int64_t>(launch.size());
    launch.clear();
    waits.clear();
  }
};

// What the model functions need besides the weights. Seconds spent in tensor-parallel
// collectives are added to *tp_comm_s.
struct ModelCtx {
  const ModelSpec* m = nullptr;
  Backend* be = nullptr;
  Comm* comm = nullptr;
  Group tp;
  int64_t t = 1, r = 0;  // tensor-parallel size and rank
  bool sp = false;
  Recompute recompute = Recompute::none;
  bool flash = false;  // fused attention (Backend::flash_attention_*): lse kept, no S x S probabilities
  int64_t recompute_layers = 0;  // full recompute: layers of each chunk recomputed (0 = all); see pipeline.cpp
  Precision precision = Precision::fp32;
  MemoryTracker* mem = nullptr;
  int64_t B = 1, S = 1;  // micro-batch and this rank's positions of each sequence
  // Context parallelism: the cp ranks of `cpg` cut every sequence into 2 cp chunks of S/2
  // positions, and rank cpr holds chunks cpr and 2 cp - 1 - cpr (Megatron's balance of the
  // causal mask: every rank gets an early and a late chunk), its rows in that order. The
  // attention gathers every rank's keys and values; everything else is per token.
  Group cpg;
  int64_t cp = 1, cpr = 0;
  double* cp_comm_s = nullptr;  // seconds in the context-parallel exchanges
  int64_t segments() const { return cp > 1 ? 2 : 1; }
  int64_t seg_len() const { return cp > 1 ? S / 2 : S; }
  // The global position of segment k's first token.
  int64_t seg_pos(int64_t k) const { return cp > 1 ? (k == 0 ? cpr : 2 * cp - 1 - cpr) * (S / 2) : 0; }
  int64_t S_global() const { return S * cp; }
  double* tp_comm_s = nullptr;
  // The tensor- and context-parallel collectives this rank waited for (nullptr: not recorded).
  CommWaits* tp_waits = nullptr;
  CommWaits* cp_waits = nullptr;
  double* recompute_s = nullptr;  // seconds of the full-recompute forwards run in backward
  // Called between the GEMMs of a layer, so non-blocking data-parallel reductions make
  // progress while the layer computes (MPI progresses only inside its calls).
  std::function<void()> poll;
  void tick() const {
    if (poll) poll();
  }
  // Called by layer_backward once the MLP block's gradients (ln2, fc1, fc2) of `layer`
  // are complete, so their data-parallel reduction can start before the attention block's.
  std::function<void(int64_t layer)> mlp_grads_done;
  // Set when tracing: each tensor- or context-parallel collective a layer runs, as its time
  // term ("tp_comm", "cp_comm"), the collective and its start and end on the clock.
  std::function<void(const char* term, const char* op, double t0, double t1)> on_comm;
  // Set with strata train --ops: each op of a layer as a region of this log (op_log.h).
  OpLog* ops = nullptr;
  // Set when tracing: each recompute a layer's backward runs (the whole forward again with
  // full recompute, the attention core's with selective), its start and end.
  std::function<void(double t0, double t1)> on_recompute;

  // The executor's clock: waits for the backend's queued work first, so time spent on a GPU
  // is charged to the phase that queued it.
  double now() const {
    be->synchronise();
    return comm->wtime();
  }
  int64_t N() const { return S * B; }
  int64_t n() const { return sp ? S * B / t : S * B; }  // rows this rank holds between layers
  int act_bytes() const { return precision == Precision::fp32 ? 4 : 2; }
  Buf act(int64_t count) const { return Buf(mem, MemCategory::activations, count, act_bytes()); }
  Buf f32(int64_t count) const { return Buf(mem, MemCategory::activations, count, 4); }
  // The same, not zeroed: for an output the next op writes whole (Buf::uninitialised).
  Buf act_out(int64_t count) const { return Buf::uninitialised(mem, MemCategory::activations, count, act_bytes()); }
  Buf f32_out(int64_t count) const { return Buf::uninitialised(mem, MemCategory::activations, count, 4); }
};

// Saved tensors of one layer for one micro-batch. With full recompute only x is kept
// until the backward runs the forward again.
struct LayerActs {
  Buf x;                   // (n, H) layer input
  Buf h1, mean1, rstd1;    // (n, H), (n), (n)
  Buf g1;                  // (N, H) gathered h1 (sequence parallel only)
  Buf qkv;                 // (N, (A+2G)*D/t), q and k after rope
  Buf probs;               // (B, A/t, S, S), per segment with cp > 1 (B, A/t, S/2, S cp); empty
                           // with selective recompute or fused attention
  Buf lse;                 // (B, A/t, S) fused attention's log-sum-exp (per segment with cp > 1);
                           // empty with selective recompute
  Buf att;                 // (N, A*D/t)
  Buf x2;                  // (n, H) after the attention residual
  Buf h2, mean2, rstd2;    // (n, H), (n), (n)
  Buf g2;                  // (N, H) gathered h2 (sequence parallel only)
  Buf u;                   // (N, fc1_out/t)
  Buf a;                   // (N, F/t)
  // The tensors kept in the training precision (the others are fp32): those stored in 16
  // bits between the forward and the backward (Buf::pack).
  std::array<Buf*, 11> sixteen_bit() { return {&x, &h1, &g1, &qkv, &probs, &att, &x2, &h2, &g2, &u, &a}; }
};

struct HeadActs {
  Buf x;              // (n, H) input of the final norm
  Buf hf, mean, rstd; // (n, H), (n), (n)
  Buf hf_full;        // (N, H) gathered (sequence parallel only)
  Buf probs;          // (N, V/t) the logits (fp32), their gradient after the backward
  Buf mx, st;         // (N), (N, 2): each row's maximum and sum of exponentials (backend.h;
                      // untracked: 12 bytes a token against the logits' 4 V/t)
  ByteBuf targets;    // (N) int32 in (S, B) order, in the backend's memory
};

// x (n, H) = wte[tokens] (vocab-parallel, reduced over tp) + wpe[positions].
// tokens: (B, S) as the data gives them.
Buf embedding_forward(const ModelCtx& c, const UnitView& wte, const UnitView* wpe, const int32_t* tokens);
// dx (n, H): accumulates into the wte and wpe gradients.
void embedding_backward(const ModelCtx& c, const UnitView& wte, const UnitView* wpe, const int32_t* tokens,
                        const Buf& dx);

// Runs layer `layer` on x (moved into acts), returns the output (n, H).
Buf layer_forward(const ModelCtx& c, const UnitView& u, int64_t layer, Buf x, LayerActs* acts);
// dout (n, H) -> dx (n, H); accumulates the layer's gradients; releases acts.
Buf layer_backward(const ModelCtx& c, const UnitView& u, int64_t layer, LayerActs* acts, const Buf& dout);

// Final norm, logits against `out_w` (wte when tied, else lm_head; (V/t, H)), and the sum
// of the token losses of the micro-batch (identical on every tp rank). targets (B, S).
double head_forward(const ModelCtx& c, const UnitView& final_unit, const float* out_w, Buf x,
                    const int32_t* targets, HeadActs* acts);
// dloss_scale multiplies d(sum of token losses); out_grad accumulates (V/t, H). Returns dx.
Buf head_backward(const ModelCtx& c, const UnitView& final_unit, const float* out_w, float* out_grad,
                  HeadActs* acts, float dloss_scale);

}  // namespace strata
