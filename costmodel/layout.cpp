// Stage layout; see layout.h.
#include "costmodel/layout.h"

namespace strata {

int64_t StageLayout::stage_layers(int64_t s) const {
  int64_t n = 0;
  for (int64_t c = 0; c < v; ++c) n += chunk_layers(s, c);
  return n;
}

StageLayout make_layout(int64_t L, int64_t p, int64_t v) {
  StageLayout out;
  out.p = p;
  out.v = v;
  out.layers.assign(static_cast<size_t>(p * v), 0);
  if (L % (p * v) == 0) {
    for (auto& x : out.layers) x = L / (p * v);
    return out;
  }
  if (p >= 2 && (L + 2) % (p * v) == 0) {
    const int64_t per = (L + 2) / (p * v);
    for (auto& x : out.layers) x = per;
    out.layers.front() = per - 1;  // stage 0, chunk 0: the embedding's slot
    out.layers.back() = per - 1;   // stage p-1, chunk v-1: the output layer's slot
    return out;
  }
  // Other uneven cases only arise with v == 1 (check_plan refuses the rest).
  const int64_t base = L / p, extra = L % p;
  for (int64_t s = 0; s < p; ++s) out.layers[static_cast<size_t>(s)] = base;
  // Give the extra layers to the middle stages first (the ends carry embedding and head).
  int64_t given = 0;
  for (int64_t k = 0; given < extra; ++k) {
    const int64_t s = (p / 2 + ((k % 2) ? -(k + 1) / 2 : k / 2) + p) % p;
    out.layers[static_cast<size_t>(s)] += 1;
    ++given;
  }
  return out;
}

}  // namespace strata
