// The counter-based hash behind every seeded value of the executor (initial weights, the
// Markov source, sample order): splitmix64's finaliser, so any element is computed from
// its coordinates alone, the same on every rank and every plan.
#pragma once

#include <cstdint>

namespace strata {

inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace strata
