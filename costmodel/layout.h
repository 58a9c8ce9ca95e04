// Which layers each pipeline stage and virtual chunk holds, and where the embedding and
// the output layer live. Rule (Megatron; Megatron-DeepSpeed's 'type:transformer|embedding'
// partition used by BLOOM; Llama 3 405B's first and last stage one layer short):
//   L divisible by p*v:          L/(p*v) layers per chunk;
//   else (L+2) divisible by p*v: embedding and output layer each take a layer's slot, so
//                                the first chunk of the first stage and the last chunk of
//                                the last stage hold (L+2)/(p*v) - 1 layers;
//   else (v = 1):                as even as possible, extra layers on the middle stages.
// A plan may give its own split instead (Megatron-LM's uneven pipeline options, below).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "costmodel/model_spec.h"
#include "costmodel/plan.h"

namespace strata {

struct StageLayout {
  int64_t p = 1, v = 1;
  std::vector<int64_t> layers;  // (v, p): layers of chunk c on stage s at [c*p + s]

  // A model that mixes dense and MoE layers (ModelSpec::mixed; count_layer_kinds): of each
  // chunk's layers, in model order, the dense ones, and the dense ones among those a plan's
  // recompute recomputes (partial full recompute: each chunk's first recompute_num_layers;
  // otherwise all). Empty for other models: every layer is of the model's one kind.
  std::vector<int64_t> dense, dense_recomputed;

  int64_t chunk_layers(int64_t s, int64_t c) const { return layers[static_cast<size_t>(c * p + s)]; }
  int64_t stage_layers(int64_t s) const;
  int64_t chunk_dense(int64_t s, int64_t c) const { return dense.empty() ? 0 : dense[static_cast<size_t>(c * p + s)]; }
  int64_t chunk_dense_recomputed(int64_t s, int64_t c) const {
    return dense_recomputed.empty() ? 0 : dense_recomputed[static_cast<size_t>(c * p + s)];
  }
  int64_t stage_dense(int64_t s) const;
  bool has_embedding(int64_t s, int64_t c) const { return s == 0 && c == 0; }
  bool has_head(int64_t s, int64_t c) const { return s == p - 1 && c == v - 1; }
};

StageLayout make_layout(int64_t L, int64_t p, int64_t v);
void make_layout_into(int64_t L, int64_t p, int64_t v, StageLayout* out);  // reusing out's storage

// A plan's own split, where it gives one (Plan::explicit_split), else the rule above:
//   pipeline_model_parallel_layout: each virtual stage's 't's (chunks may be empty);
//   decoder_first/last_pipeline_num_layers: that many layers on the first / last stage, the
//     rest evenly over the others; each stage's layers split evenly over its v chunks
//     (Megatron-core's TransformerConfig rules, split_problem).
// A split that breaks its rules (check_plan reports it) falls back to the rule above. Where
// a plan's own split leaves a stage's chunks unlike, memory.cpp weighs each chunk by its
// own activations along the schedule (weighted_activation_peak).
StageLayout make_layout(int64_t L, const Plan& p);
void make_layout_into(int64_t L, const Plan& p, StageLayout* out);
// The layout of m's layers under p, the dense and MoE layers counted where m mixes them.
void make_layout_into(const ModelSpec& m, const Plan& p, StageLayout* out);
StageLayout make_layout(const ModelSpec& m, const Plan& p);
// Fills out->dense and out->dense_recomputed for m's layers (clears them unless m.mixed()).
void count_layer_kinds(const ModelSpec& m, const Plan& p, StageLayout* out);
// Why the plan's own split cannot hold L layers; empty when it can (or there is none).
std::string split_problem(int64_t L, const Plan& p);

}  // namespace strata
