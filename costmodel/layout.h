// Which layers each pipeline stage and virtual chunk holds, and where the embedding and
// the output layer live. Rule (Megatron; Megatron-DeepSpeed's 'type:transformer|embedding'
// partition used by BLOOM; Llama 3 405B's first and last stage one layer short):
//   L divisible by p*v:          L/(p*v) layers per chunk;
//   else (L+2) divisible by p*v: embedding and output layer each take a layer's slot, so
//                                the first chunk of the first stage and the last chunk of
//                                the last stage hold (L+2)/(p*v) - 1 layers;
//   else (v = 1):                as even as possible, extra layers on the middle stages.
#pragma once

#include <cstdint>
#include <vector>

#include "costmodel/model_spec.h"
#include "costmodel/plan.h"

namespace strata {

struct StageLayout {
  int64_t p = 1, v = 1;
  std::vector<int64_t> layers;  // (v, p): layers of chunk c on stage s at [c*p + s]

  int64_t chunk_layers(int64_t s, int64_t c) const { return layers[static_cast<size_t>(c * p + s)]; }
  int64_t stage_layers(int64_t s) const;
  bool has_embedding(int64_t s, int64_t c) const { return s == 0 && c == 0; }
  bool has_head(int64_t s, int64_t c) const { return s == p - 1 && c == v - 1; }
};

StageLayout make_layout(int64_t L, int64_t p, int64_t v);
void make_layout_into(int64_t L, int64_t p, int64_t v, StageLayout* out);  // reusing out's storage

}  // namespace strata
