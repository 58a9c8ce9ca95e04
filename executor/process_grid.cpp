// Process grid arithmetic (Megatron rank order).
#include "executor/process_grid.h"

#include <algorithm>
#include <set>

namespace strata {

Coords ProcessGrid::coords(int64_t rank) const {
  Coords x;
  x.tp = rank % t;
  rank /= t;
  x.cp = rank % c;
  rank /= c;
  x.dp = rank % d;
  x.pp = rank / d;
  return x;
}

int64_t ProcessGrid::rank_of(const Coords& x) const { return x.tp + t * (x.cp + c * (x.dp + d * x.pp)); }

Group ProcessGrid::group(GroupKind kind, int64_t rank) const {
  const Coords me = coords(rank);
  Group g;
  g.id = kind;
  auto push = [&](const Coords& x) { g.ranks.push_back(static_cast<int>(rank_of(x))); };
  switch (kind) {
    case kWorld:
      for (int64_t r = 0; r < world(); ++r) g.ranks.push_back(static_cast<int>(r));
      break;
    case kTensor:
      for (int64_t i = 0; i < t; ++i) { Coords x = me; x.tp = i; push(x); }
      break;
    case kData:
      for (int64_t i = 0; i < d; ++i) { Coords x = me; x.dp = i; push(x); }
      break;
    case kPipeline:
      for (int64_t i = 0; i < p; ++i) { Coords x = me; x.pp = i; push(x); }
      break;
    case kEmbedding: {
      Coords x = me;
      x.pp = 0;
      push(x);
      if (p > 1) { x.pp = p - 1; push(x); }
      break;
    }
    case kContext:
      for (int64_t i = 0; i < c; ++i) { Coords x = me; x.cp = i; push(x); }
      break;
    case kReplica:
      for (int64_t j = 0; j < d; ++j)
        for (int64_t i = 0; i < c; ++i) { Coords x = me; x.cp = i; x.dp = j; push(x); }
      break;
    case kModel:
      for (int64_t j = 0; j < p; ++j)
        for (int64_t i = 0; i < t; ++i) { Coords x = me; x.tp = i; x.pp = j; push(x); }
      break;
  }
  g.me = static_cast<int>(std::find(g.ranks.begin(), g.ranks.end(), static_cast<int>(rank)) - g.ranks.begin());
  if (g.me == g.size()) g.me = -1;  // not a member (embedding group of a middle stage)
  return g;
}

std::vector<std::vector<int>> ProcessGrid::all_groups(GroupKind kind) const {
  std::set<std::vector<int>> seen;
  std::vector<std::vector<int>> out;
  for (int64_t r = 0; r < world(); ++r) {
    Group g = group(kind, r);
    if (g.me < 0) continue;
    if (seen.insert(g.ranks).second) out.push_back(g.ranks);
  }
  return out;
}

}  // namespace strata
