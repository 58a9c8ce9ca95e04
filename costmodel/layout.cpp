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
  make_layout_into(L, p, v, &out);
  return out;
}

void make_layout_into(int64_t L, int64_t p, int64_t v, StageLayout* out) {
  out->p = p;
  out->v = v;
  std::vector<int64_t>& layers = out->layers;
  if (L % (p * v) == 0) {
    layers.assign(static_cast<size_t>(p * v), L / (p * v));
    return;
  }
  if (p >= 2 && (L + 2) % (p * v) == 0) {
    const int64_t per = (L + 2) / (p * v);
    layers.assign(static_cast<size_t>(p * v), per);
    layers.front() = per - 1;  // stage 0, chunk 0: the embedding's slot
    layers.back() = per - 1;   // stage p-1, chunk v-1: the output layer's slot
    return;
  }
  // Neither divides: as even as possible over the q = p v chunks in model order (chunk c of
  // stage s holds virtual stage c p + s), the extra layers to the middle chunks first (the
  // ends carry the embedding and the output layer). check_plan asks for L >= q, so every
  // chunk holds a layer.
  const int64_t q = p * v, base = L / q, extra = L % q;
  layers.assign(static_cast<size_t>(q), base);
  for (int64_t k = 0; k < extra; ++k) {
    const int64_t g = (q / 2 + ((k % 2) ? -(k + 1) / 2 : k / 2) + q) % q;
    layers[static_cast<size_t>(g)] += 1;
  }
}

}  // namespace strata
