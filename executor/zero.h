// ZeRO bookkeeping: each unit of the flat buffer is padded to a multiple of the shard
// count dz (d with ZeRO 1-3, else 1), so a unit's gradient reduce-scatters and its
// parameters all-gather in equal blocks; data-parallel rank `me` owns block `me` of
// every unit. Also AdamW with decoupled weight decay on an owned range.
#pragma once

#include <cstdint>
#include <vector>

#include "executor/param_layout.h"

namespace strata {

struct Sharding {
  int64_t dz = 1, me = 0;
  std::vector<int64_t> full_off;    // (units) offset of unit u in the padded full buffer
  std::vector<int64_t> shard;       // (units) floats per block: ceil(size / dz)
  std::vector<int64_t> shard_off;   // (units) offset of unit u's block in the shard buffer
  int64_t full_size = 0, shard_size = 0;
  int64_t padded(size_t u) const { return shard[u] * dz; }
  // Layout offset -> padded full buffer offset.
  int64_t full_index(const ParamLayout& lay, size_t u, int64_t layout_offset) const {
    return full_off[u] + (layout_offset - lay.units[u].begin);
  }
};

Sharding make_sharding(const ParamLayout& lay, int64_t dz, int64_t me);

struct AdamW {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
};

// A flag per element, one bit each (least significant first): element i's flag is bit
// first + i of `bits`. The optimizer's per-parameter flags (weight decay, counted in the
// clipping norm) take an eighth of a byte per parameter in the backend's memory this way.
struct FlagBits {
  const uint8_t* bits = nullptr;
  int64_t first = 0;
  bool operator[](int64_t i) const {
    const int64_t b = first + i;
    return ((bits[b >> 3] >> (b & 7)) & 1) != 0;
  }
  FlagBits operator+(int64_t k) const { return FlagBits{bits, first + k}; }
};
// n flags packed as FlagBits reads them: ceil(n / 8) bytes.
std::vector<uint8_t> pack_flags(const std::vector<uint8_t>& flags);

// One AdamW step on n elements: p master weights, g gradients (already unscaled and
// clipped by `grad_mul`), m and v moments, decay[i] set where weight decay applies.
// step is 1-based (bias correction).
void adamw_update(float* p, const float* g, float* m, float* v, FlagBits decay, int64_t n, const AdamW& opt,
                  double lr, int64_t step, float grad_mul);

// The clipping norm's inputs over n gradients: acc[0] += the sum of squares of the
// finite ones with counted[i] set (each parameter counted once across replicas), acc[1] +=
// the number of non-finite ones.
void grad_norm_terms(const float* g, FlagBits counted, int64_t n, double acc[2]);

// Learning rate at 0-based step k: linear warm-up over `warmup` steps to lr, then cosine
// decay to min_lr at `total` steps (Megatron's --lr-warmup-iters / --lr-decay-style cosine).
double learning_rate(int64_t k, int64_t warmup, int64_t total, double lr, double min_lr);

}  // namespace strata
