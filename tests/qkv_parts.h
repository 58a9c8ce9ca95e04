// The query, key and value columns of a (rows, (A + 2G) D) QKV gradient (backend.h's layout),
// each gathered apart, so that attention tests compare dQ, dK and dV each against its own
// largest value (a small dQ error does not hide behind a large dK).
#pragma once

#include <cstdint>
#include <vector>

namespace strata::testing {

// part 0: the A D query columns, 1: the G D key columns, 2: the G D value columns.
inline std::vector<float> qkv_part(const std::vector<float>& qkv, int64_t rows, int64_t A, int64_t G, int64_t D,
                                   int part) {
  const int64_t ld = (A + 2 * G) * D;
  const int64_t lo = part == 0 ? 0 : part == 1 ? A * D : (A + G) * D, width = part == 0 ? A * D : G * D;
  std::vector<float> out;
  out.reserve(static_cast<size_t>(rows * width));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = lo; e < lo + width; ++e) out.push_back(qkv[static_cast<size_t>(r * ld + e)]);
  return out;
}
inline const char* qkv_part_name(int part) { return part == 0 ? "dq" : part == 1 ? "dk" : "dv"; }

}  // namespace strata::testing
