// Pipeline schedules as data: for each stage, the ordered list of (chunk, micro-batch,
// forward|backward) steps it runs in one training step. The simulator (simulate.h) and the
// executor walk these same lists.
//   GPipe:       all m forwards, then all m backwards.
//   1F1B:        warm-up of min(p - s - 1, m) forwards, steady state of one forward and
//                one backward, cool-down of the remaining backwards (Narayanan et al. 2021).
//   Interleaved: v model chunks per stage; the micro-batches run in groups of g
//                (Megatron-core's microbatch_group_size_per_vp_stage, default p): all v
//                chunks of a group, chunk by chunk, then the next group. Forward k of a
//                full group runs chunk (k mod gv) / g of micro-batch (k / gv) * g + k mod g;
//                the last group holds the r = m - g * floor((m - 1) / g) micro-batches left
//                and runs chunk by chunk over those r. Backwards run the chunks in reverse;
//                warm-up (p - s - 1) * 2 + (v - 1) * g, all forwards when m == p
//                (Megatron's schedules.py; g = p with m divisible by p is the classic
//                schedule, where every group is full).
#pragma once

#include <cstdint>
#include <vector>

#include "costmodel/plan.h"

namespace strata {

// The interleaved schedule's groups of g of m micro-batches: the full groups before the
// last, the last group's size r (1 to g), and the forwards (or backwards) of the full
// groups, which run chunk (k mod gv) / g; the last group's chunk (k - head) / r.
struct Groups {
  int64_t full, last, head;
};
inline Groups groups_of(int64_t m, int64_t g, int64_t v) {
  const int64_t full = (m - 1) / g;
  return Groups{full, m - full * g, full * g * v};
}

struct Step {
  int32_t chunk = 0;
  int32_t mb = 0;
  bool forward = true;
};

struct Schedule {
  ScheduleKind kind = ScheduleKind::one_f_one_b;
  int64_t p = 1, v = 1, m = 1;
  int64_t g = 1;  // micro-batch group of the interleaved schedule (p unless asked otherwise)
  std::vector<std::vector<Step>> stages;  // (p, 2*m*v)
};

// g: the interleaved schedule's micro-batch group, 0 for p (Megatron's default).
Schedule make_schedule(ScheduleKind kind, int64_t p, int64_t v, int64_t m, int64_t g = 0);

// The same lists without storing them: position k of stage s runs forward or backward
// number `index` of that stage, which is micro-batch `index` for GPipe and 1F1B; for the
// interleaved schedule the index runs over (chunk, micro-batch) pairs in Megatron's order.
// schedule_test checks it against make_schedule step by step.
struct StepAt {
  int64_t index;
  int32_t chunk;
  bool forward;
};
struct ScheduleShape {
  ScheduleKind kind;
  int64_t p, v, m;  // v = 1 unless interleaved
  int64_t g = 0;    // the interleaved schedule's micro-batch group; 0 for p
  int64_t group() const { return g > 0 ? g : p; }
  int64_t warmup(int64_t s) const;
  int64_t mb_of(int64_t index) const;
  int32_t chunk_of(int64_t index, bool forward) const;
  StepAt at(int64_t s, int64_t k) const { return at(s, k, warmup(s)); }
  StepAt at(int64_t s, int64_t k, int64_t w) const;  // w = warmup(s), for walks that keep it
  int64_t positions() const { return 2 * m * v; }
};

// The most steps the simulator walks for one plan (memory and time stay bounded), and the
// steps a plan needs: the whole interleaved schedule; for 1F1B and GPipe, whose long
// schedules are extended from their steady state, the walks that find it (about 10 p
// micro-batches).
constexpr int64_t kMaxWalkSteps = int64_t{1} << 22;
double walk_steps(ScheduleKind kind, int64_t p, int64_t v, int64_t m);
// Most (chunk, micro-batch) activation sets alive at once on each stage: forwards run
// minus backwards run, maximised along the stage's order.
std::vector<int64_t> peak_in_flight(const Schedule& s);
// Same, for one chunk of each stage.
std::vector<int64_t> peak_in_flight_of_chunk(const Schedule& s, int32_t chunk);

}  // namespace strata
