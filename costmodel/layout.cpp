// Stage layout; see layout.h.
#include "costmodel/layout.h"

#include <fmt/format.h>

namespace strata {

int64_t StageLayout::stage_layers(int64_t s) const {
  int64_t n = 0;
  for (int64_t c = 0; c < v; ++c) n += chunk_layers(s, c);
  return n;
}

int64_t StageLayout::stage_dense(int64_t s) const {
  int64_t n = 0;
  for (int64_t c = 0; c < v && !dense.empty(); ++c) n += chunk_dense(s, c);
  return n;
}

void count_layer_kinds(const ModelSpec& m, const Plan& p, StageLayout* out) {
  out->dense.clear();
  out->dense_recomputed.clear();
  if (!m.mixed()) return;
  const size_t q = out->layers.size();
  out->dense.resize(q);
  out->dense_recomputed.resize(q);
  int64_t begin = 0;  // chunk i = c p + s holds the i-th run of layers in model order
  for (size_t i = 0; i < q; ++i) {
    const int64_t n = out->layers[i];
    const int64_t k = p.recompute == Recompute::full ? p.recomputed_layers(n) : n;
    out->dense[i] = n - m.moe_layers_in(begin, begin + n);
    out->dense_recomputed[i] = k - m.moe_layers_in(begin, begin + k);
    begin += n;
  }
}

void make_layout_into(const ModelSpec& m, const Plan& p, StageLayout* out) {
  make_layout_into(m.L, p, out);
  if (m.mixed()) count_layer_kinds(m, p, out);
}

StageLayout make_layout(const ModelSpec& m, const Plan& p) {
  StageLayout out;
  make_layout_into(m, p, &out);
  return out;
}

StageLayout make_layout(int64_t L, int64_t p, int64_t v) {
  StageLayout out;
  make_layout_into(L, p, v, &out);
  return out;
}

void make_layout_into(int64_t L, int64_t p, int64_t v, StageLayout* out) {
  out->dense.clear();
  out->dense_recomputed.clear();
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

std::string split_problem(int64_t L, const Plan& p) {
  if (p.layout) {
    int64_t n = 0;
    for (int64_t k : p.layout->layers) n += k;
    if (static_cast<int64_t>(p.layout->layers.size()) != p.p * p.v)
      return fmt::format("pipeline_model_parallel_layout has {} virtual stages, not pipeline_parallel * "
                         "virtual_pipeline_stages = {} x {}", p.layout->layers.size(), p.p, p.v);
    if (n != L)
      return fmt::format("pipeline_model_parallel_layout holds {} decoder layers ('t'), not num_layers={}", n, L);
    return {};
  }
  const int64_t first = p.first_stage_layers, last = p.last_stage_layers;
  if (first == 0 && last == 0) return {};
  if (p.p < 2) return "decoder_first/last_pipeline_num_layers need pipeline_parallel >= 2";
  const int64_t middle = p.p - (first > 0 ? 1 : 0) - (last > 0 ? 1 : 0), rest = L - first - last;
  if (rest < 0)
    return fmt::format("decoder_first_pipeline_num_layers + decoder_last_pipeline_num_layers = {} exceed num_layers={}",
                       first + last, L);
  if ((rest > 0) != (middle > 0) || (middle > 0 && rest % middle != 0))
    return fmt::format("{}{}{} leave{} {} of num_layers={} to the {} other stage{}: they must split evenly, and "
                       "none may be left only where no stage is (Megatron-core's rule)",
                       first > 0 ? fmt::format("decoder_first_pipeline_num_layers={}", first) : "",
                       first > 0 && last > 0 ? " and " : "",
                       last > 0 ? fmt::format("decoder_last_pipeline_num_layers={}", last) : "",
                       first > 0 && last > 0 ? "" : "s", rest, L, middle, middle == 1 ? "" : "s");
  for (const auto& [what, n] : {std::pair<const char*, int64_t>{"decoder_first_pipeline_num_layers", first},
                                {"decoder_last_pipeline_num_layers", last},
                                {"the layers of each other stage", middle > 0 ? rest / middle : 0}})
    if (n % p.v != 0)
      return fmt::format("{}={} must be divisible by virtual_pipeline_stages={} (every chunk of a stage holds the "
                         "same layers)", what, n, p.v);
  return {};
}

StageLayout make_layout(int64_t L, const Plan& p) {
  StageLayout out;
  make_layout_into(L, p, &out);
  return out;
}

void make_layout_into(int64_t L, const Plan& p, StageLayout* out) {
  if (!p.explicit_split() || !split_problem(L, p).empty()) {
    make_layout_into(L, p.p, p.v, out);
    return;
  }
  out->dense.clear();
  out->dense_recomputed.clear();
  out->p = p.p;
  out->v = p.v;
  if (p.layout) {
    out->layers = p.layout->layers;
    return;
  }
  const int64_t first = p.first_stage_layers, last = p.last_stage_layers;
  const int64_t middle = p.p - (first > 0 ? 1 : 0) - (last > 0 ? 1 : 0), rest = L - first - last;
  out->layers.assign(static_cast<size_t>(p.p * p.v), 0);
  for (int64_t s = 0; s < p.p; ++s) {
    const int64_t n = s == 0 && first > 0 ? first : s == p.p - 1 && last > 0 ? last : rest / middle;
    for (int64_t c = 0; c < p.v; ++c) out->layers[static_cast<size_t>(c * p.p + s)] = n / p.v;
  }
}

}  // namespace strata
