// Rank -> (tp, cp, dp, pp) coordinates and the rank lists of every group, as pure math.
// Megatron's order: tensor parallel innermost, then context, then data, then pipeline:
//   rank = tp + t * (cp + c * (dp + d * pp)).
// Example, t=2 d=2 p=2 (8 ranks): tensor groups {0,1} {2,3} {4,5} {6,7}; data groups
// {0,2} {1,3} {4,6} {5,7}; pipeline groups {0,4} {1,5} {2,6} {3,7}.
#pragma once

#include <cstdint>
#include <vector>

namespace strata {

// A group of ranks, passed by value. `me` is this rank's index in `ranks`; `id` names the
// group kind to the communicator (which created one native communicator per group).
struct Group {
  std::vector<int> ranks;
  int me = 0;
  int id = 0;
  int size() const { return static_cast<int>(ranks.size()); }
};

// kContext: the context-parallel ranks of one (tp, dp, pp); kReplica: every rank holding the
// same parameters (data x context parallel, context innermost), what gradients are reduced over.
enum GroupKind { kWorld = 0, kTensor = 1, kData = 2, kPipeline = 3, kEmbedding = 4, kModel = 5, kContext = 6, kReplica = 7 };
constexpr int kGroupKinds = kReplica + 1;  // what a communicator's per-kind tables hold

struct Coords {
  int64_t tp = 0, cp = 0, dp = 0, pp = 0;
};

struct ProcessGrid {
  int64_t t = 1, c = 1, d = 1, p = 1;
  int64_t world() const { return t * c * d * p; }
  Coords coords(int64_t rank) const;
  int64_t rank_of(const Coords& x) const;
  // The ranks of `rank`'s group of each kind. The embedding group joins the first and the
  // last pipeline stage with the same tp, cp, dp (one rank when p == 1); the model group
  // holds every rank with the same dp and cp (tensor x pipeline).
  Group group(GroupKind kind, int64_t rank) const;
  // Every group of a kind, in a fixed order (for creating communicators collectively).
  std::vector<std::vector<int>> all_groups(GroupKind kind) const;
};

}  // namespace strata
