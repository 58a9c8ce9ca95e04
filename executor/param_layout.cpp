// Parameter layout of a rank's flat buffer, its mapping to the global tensors, and the
// seeded initialisation that makes every plan start from the same model.
#include "executor/param_layout.h"

#include "executor/hash.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace strata {

const char* to_string(TensorKind k) {
  switch (k) {
    case TensorKind::wte: return "wte";
    case TensorKind::wpe: return "wpe";
    case TensorKind::ln1_w: return "ln1_w";
    case TensorKind::ln1_b: return "ln1_b";
    case TensorKind::qkv_w: return "qkv_w";
    case TensorKind::qkv_b: return "qkv_b";
    case TensorKind::proj_w: return "proj_w";
    case TensorKind::proj_b: return "proj_b";
    case TensorKind::ln2_w: return "ln2_w";
    case TensorKind::ln2_b: return "ln2_b";
    case TensorKind::fc1_w: return "fc1_w";
    case TensorKind::fc1_b: return "fc1_b";
    case TensorKind::fc2_w: return "fc2_w";
    case TensorKind::fc2_b: return "fc2_b";
    case TensorKind::lnf_w: return "lnf_w";
    case TensorKind::lnf_b: return "lnf_b";
    case TensorKind::lm_head: return "lm_head";
  }
  return "?";
}

const TensorSlot& ParamLayout::at(TensorKind kind, int64_t layer) const {
  for (const TensorSlot& s : tensors)
    if (s.kind == kind && s.layer == layer) return s;
  std::fprintf(stderr, "strata: internal error: no tensor %s of layer %lld in this rank's layout\n",
               to_string(kind), static_cast<long long>(layer));
  std::abort();
}

bool ParamLayout::has(TensorKind kind, int64_t layer) const {
  for (const TensorSlot& s : tensors)
    if (s.kind == kind && s.layer == layer) return true;
  return false;
}

int64_t executor_vocab(const ModelSpec& m) { return m.padded_vocab(1); }

ParamLayout make_param_layout(const ModelSpec& m, int64_t t, int64_t r, bool embedding,
                              const std::vector<int64_t>& layers, bool head) {
  ParamLayout lay;
  lay.t = t;
  lay.r = r;
  const int64_t H = m.H, D = m.D(), V = executor_vocab(m);
  const bool ln = m.normalization == Norm::layernorm;
  auto add = [&](TensorKind kind, int64_t layer, int64_t rows, int64_t cols, bool replicated, bool decay) {
    TensorSlot s;
    s.kind = kind;
    s.layer = layer;
    s.offset = lay.size;
    s.rows = rows;
    s.cols = cols;
    s.tp_replicated = replicated;
    s.decay = decay;
    lay.tensors.push_back(s);
    lay.size += rows * cols;
  };
  auto unit = [&](int64_t begin, int64_t layer) { lay.units.push_back({begin, lay.size, layer}); };
  if (embedding) {  // wte and wpe are units of their own (wte's shards then match the tied copy's)
    int64_t b = lay.size;
    add(TensorKind::wte, -1, V / t, H, false, true);
    unit(b, -1);
    if (m.position == Position::learned) {
      b = lay.size;
      add(TensorKind::wpe, -1, m.S, H, true, true);
      unit(b, -1);
    }
  }
  for (int64_t l : layers) {
    const int64_t b = lay.size;
    add(TensorKind::ln1_w, l, H, 1, true, false);
    if (ln) add(TensorKind::ln1_b, l, H, 1, true, false);
    add(TensorKind::qkv_w, l, (m.A + 2 * m.G) * D / t, H, false, true);
    if (m.bias) add(TensorKind::qkv_b, l, (m.A + 2 * m.G) * D / t, 1, false, false);
    add(TensorKind::proj_w, l, H, m.A * D / t, false, true);
    if (m.bias) add(TensorKind::proj_b, l, H, 1, true, false);
    add(TensorKind::ln2_w, l, H, 1, true, false);
    if (ln) add(TensorKind::ln2_b, l, H, 1, true, false);
    add(TensorKind::fc1_w, l, m.fc1_out() / t, H, false, true);
    if (m.bias) add(TensorKind::fc1_b, l, m.fc1_out() / t, 1, false, false);
    add(TensorKind::fc2_w, l, H, m.F / t, false, true);
    if (m.bias) add(TensorKind::fc2_b, l, H, 1, true, false);
    unit(b, l);
  }
  if (head) {
    const int64_t b = lay.size;
    add(TensorKind::lnf_w, -1, H, 1, true, false);
    if (ln) add(TensorKind::lnf_b, -1, H, 1, true, false);
    if (!m.tie_embeddings) add(TensorKind::lm_head, -1, V / t, H, false, true);
    unit(b, -2);
    if (m.tie_embeddings && !embedding) {
      const int64_t e = lay.size;
      add(TensorKind::wte, -1, V / t, H, false, true);
      unit(e, -1);
    }
  }
  return lay;
}

ParamLayout global_param_layout(const ModelSpec& m) {
  std::vector<int64_t> layers;
  for (int64_t l = 0; l < m.L; ++l) layers.push_back(l);
  return make_param_layout(m, 1, 0, true, layers, true);
}

void global_coords(const ModelSpec& m, const TensorSlot& s, int64_t t, int64_t r, int64_t row,
                   int64_t col, int64_t* grow, int64_t* gcol) {
  *grow = row;
  *gcol = col;
  if (t == 1) return;
  const int64_t D = m.D();
  switch (s.kind) {
    case TensorKind::wte:
    case TensorKind::lm_head: *grow = r * (executor_vocab(m) / t) + row; break;
    case TensorKind::qkv_w:
    case TensorKind::qkv_b: {
      const int64_t qa = m.A / t * D, kg = m.G / t * D;  // local q rows, local k (= v) rows
      if (row < qa) *grow = r * qa + row;
      else if (row < qa + kg) *grow = m.A * D + r * kg + (row - qa);
      else *grow = (m.A + m.G) * D + r * kg + (row - qa - kg);
      break;
    }
    case TensorKind::fc1_w:
    case TensorKind::fc1_b: {
      const int64_t f = m.F / t;
      if (!m.gated() || row < f) *grow = r * f + row;
      else *grow = m.F + r * f + (row - f);
      break;
    }
    case TensorKind::proj_w: *gcol = r * (m.A * D / t) + col; break;
    case TensorKind::fc2_w: *gcol = r * (m.F / t) + col; break;
    default: break;
  }
}

namespace {

// initial_value() in two parts: the hash of everything but the column, and the value of
// one column from it. initialise() hashes each row once (a row's global index does not
// depend on its column: global_coords), so four of a value's six mixes leave the column
// loop; the values are the same bits.
bool constant_kind(TensorKind kind, float* value) {
  switch (kind) {
    case TensorKind::ln1_w:
    case TensorKind::ln2_w:
    case TensorKind::lnf_w: *value = 1.0f; return true;
    case TensorKind::ln1_b:
    case TensorKind::ln2_b:
    case TensorKind::lnf_b:
    case TensorKind::qkv_b:
    case TensorKind::proj_b:
    case TensorKind::fc1_b:
    case TensorKind::fc2_b: *value = 0.0f; return true;
    default: return false;
  }
}

uint64_t row_hash(uint64_t seed, TensorKind kind, int64_t layer, int64_t grow) {
  uint64_t h = mix(seed);
  h = mix(h ^ static_cast<uint64_t>(kind));
  h = mix(h ^ static_cast<uint64_t>(layer + 2));
  return mix(h ^ static_cast<uint64_t>(grow));
}

double kind_std(const ModelSpec& m, TensorKind kind) {
  double std = 0.02;
  if (kind == TensorKind::proj_w || kind == TensorKind::fc2_w) std = 0.02 / std::sqrt(2.0 * static_cast<double>(m.L));
  if (kind == TensorKind::wpe) std = 0.01;
  return std;
}

float value_at(uint64_t row_h, int64_t gcol, double std) {
  const uint64_t h = mix(row_h ^ static_cast<uint64_t>(gcol));
  const uint64_t h2 = mix(h);
  // Box-Muller from two 53-bit uniforms in (0, 1].
  const double u1 = (static_cast<double>(h >> 11) + 1.0) / 9007199254740992.0;
  const double u2 = static_cast<double>(h2 >> 11) / 9007199254740992.0;
  const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  return static_cast<float>(z * std);
}

}  // namespace

float initial_value(const ModelSpec& m, uint64_t seed, TensorKind kind, int64_t layer, int64_t grow,
                    int64_t gcol) {
  float c = 0;
  if (constant_kind(kind, &c)) return c;
  return value_at(row_hash(seed, kind, layer, grow), gcol, kind_std(m, kind));
}

void initialise(const ModelSpec& m, const ParamLayout& lay, uint64_t seed, float* params) {
  for (const TensorSlot& s : lay.tensors) {
    float* out = params + s.offset;
    float c = 0;
    if (constant_kind(s.kind, &c)) {
      std::fill(out, out + s.size(), c);
      continue;
    }
    const double std = kind_std(m, s.kind);
    for (int64_t i = 0; i < s.rows; ++i) {
      int64_t gi = 0, gj = 0;
      global_coords(m, s, lay.t, lay.r, i, 0, &gi, &gj);
      const uint64_t row_h = row_hash(seed, s.kind, s.layer, gi);
      for (int64_t j = 0; j < s.cols; ++j) {
        global_coords(m, s, lay.t, lay.r, i, j, &gi, &gj);
        out[i * s.cols + j] = value_at(row_h, gj, std);
      }
    }
  }
}

}  // namespace strata
