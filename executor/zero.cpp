// Shard offsets per unit, AdamW and the learning-rate schedule.
#include "executor/zero.h"

#include <algorithm>
#include <cmath>

namespace strata {

Sharding make_sharding(const ParamLayout& lay, int64_t dz, int64_t me) {
  Sharding s;
  s.dz = dz;
  s.me = me;
  for (const Unit& u : lay.units) {
    const int64_t sh = (u.size() + dz - 1) / dz;
    s.full_off.push_back(s.full_size);
    s.shard.push_back(sh);
    s.shard_off.push_back(s.shard_size);
    s.full_size += sh * dz;
    s.shard_size += sh;
  }
  return s;
}

std::vector<uint8_t> pack_flags(const std::vector<uint8_t>& flags) {
  std::vector<uint8_t> bits((flags.size() + 7) / 8, 0);
  for (size_t i = 0; i < flags.size(); ++i)
    if (flags[i]) bits[i >> 3] = static_cast<uint8_t>(bits[i >> 3] | (1u << (i & 7)));
  return bits;
}

void adamw_update(float* p, const float* g, float* m, float* v, FlagBits decay, int64_t n, const AdamW& opt,
                  double lr, int64_t step, float grad_mul) {
  const double bc1 = 1.0 - std::pow(opt.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(opt.beta2, static_cast<double>(step));
  const float b1 = static_cast<float>(opt.beta1), b2 = static_cast<float>(opt.beta2);
  const float step_size = static_cast<float>(lr / bc1), inv_bc2 = static_cast<float>(1.0 / bc2);
  const float eps = static_cast<float>(opt.eps), wd = static_cast<float>(lr * opt.weight_decay);
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * grad_mul;
    m[i] = b1 * m[i] + (1.0f - b1) * gi;
    v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
    if (decay[i]) p[i] -= wd * p[i];
    p[i] -= step_size * m[i] / (std::sqrt(v[i] * inv_bc2) + eps);
  }
}

void grad_norm_terms(const float* g, FlagBits counted, int64_t n, double acc[2]) {
  // Eight fixed lanes (element i into lane i % 8, the lanes added in order at the end): the
  // same bits on every run, without a chain of dependent adds, one per parameter.
  constexpr int64_t kLanes = 8;
  double sum[kLanes] = {};
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = g[i];
    const bool finite = std::isfinite(x);
    bad += finite ? 0 : 1;
    sum[i % kLanes] += finite && counted[i] ? x * x : 0.0;
  }
  double s = 0;
  for (int64_t k = 0; k < kLanes; ++k) s += sum[k];
  acc[0] += s;
  acc[1] += static_cast<double>(bad);
}

double learning_rate(int64_t k, int64_t warmup, int64_t total, double lr, double min_lr) {
  if (k < warmup) return lr * static_cast<double>(k + 1) / static_cast<double>(warmup);
  if (total <= warmup) return lr;
  const double progress = std::min(1.0, static_cast<double>(k - warmup) / static_cast<double>(total - warmup));
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace strata
