// Pipeline schedules as data: the order each stage runs, and that every (chunk,
// micro-batch) forward and backward appears exactly once, forward before backward.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "costmodel/schedule.h"

namespace strata {
namespace {

std::string order(const Schedule& sc, size_t s) {
  std::string o;
  for (const Step& st : sc.stages[s]) {
    if (!o.empty()) o += ' ';
    o += (st.forward ? "F" : "B") + (sc.v > 1 ? std::to_string(st.chunk) + "." : "") + std::to_string(st.mb);
  }
  return o;
}

TEST(Schedule, OneFOneBPhases) {
  // p = 4, m = 6: stage 1 warms up with p - s - 1 = 2 forwards, alternates, cools down.
  const Schedule sc = make_schedule(ScheduleKind::one_f_one_b, 4, 1, 6);
  EXPECT_EQ(order(sc, 1), "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5");
  EXPECT_EQ(order(sc, 3), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
  EXPECT_EQ(order(sc, 0), "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5");
}

TEST(Schedule, GPipe) {
  const Schedule sc = make_schedule(ScheduleKind::gpipe, 2, 1, 3);
  EXPECT_EQ(order(sc, 0), "F0 F1 F2 B0 B1 B2");
  EXPECT_EQ(order(sc, 1), "F0 F1 F2 B0 B1 B2");
}

TEST(Schedule, InterleavedMegatronOrder) {
  // p = 2, v = 2, m = 4. Forward k runs chunk (k mod 4) / 2 of micro-batch (k/4)*2 + k%2;
  // stage 0 warms up (2-0-1)*2 + (2-1)*2 = 4 chunk-forwards; backwards visit chunks in
  // reverse.
  const Schedule sc = make_schedule(ScheduleKind::interleaved, 2, 2, 4);
  EXPECT_EQ(order(sc, 0), "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3");
  EXPECT_EQ(order(sc, 1), "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3");
}

TEST(Schedule, InterleavedGroupsFollowMegatronCoresTable) {
  // p = 2, v = 2, m = 5 in groups of g = 3 (Megatron-core's microbatch_group_size_per_vp_
  // stage): its schedule table runs forward k as
  //   k      0 1 2 3 4 5 6 7 8 9
  //   mb     0 1 2 0 1 2 3 4 3 4
  //   chunk  0 0 0 1 1 1 0 0 1 1
  // (a full group of 3, then the last group of the 2 left), backward k the same
  // micro-batch with the chunk reversed. Warm-up (p - s - 1) * 2 + (v - 1) * g: 5 on
  // stage 0, 3 on stage 1.
  const Schedule sc = make_schedule(ScheduleKind::interleaved, 2, 2, 5, 3);
  EXPECT_EQ(sc.g, 3);
  EXPECT_EQ(order(sc, 0), "F0.0 F0.1 F0.2 F1.0 F1.1 F1.2 B1.0 F0.3 B1.1 F0.4 B1.2 F1.3 B0.0 F1.4 B0.1 "
                          "B0.2 B1.3 B1.4 B0.3 B0.4");
  EXPECT_EQ(order(sc, 1), "F0.0 F0.1 F0.2 F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F0.3 B0.0 F0.4 B0.1 F1.3 B0.2 "
                          "F1.4 B1.3 B1.4 B0.3 B0.4");
  // Group p with m a multiple of p is the classic schedule (InterleavedMegatronOrder).
  const Schedule classic = make_schedule(ScheduleKind::interleaved, 2, 2, 4, 2);
  EXPECT_EQ(order(classic, 0), order(make_schedule(ScheduleKind::interleaved, 2, 2, 4), 0));
}

// Every group Megatron-core accepts: from p up to m, leaving a last group of none or at
// least p micro-batches.
std::vector<int64_t> accepted_groups(int64_t p, int64_t m) {
  std::vector<int64_t> gs;
  for (int64_t g = p; g <= m; ++g)
    if (m % g == 0 || m % g >= p) gs.push_back(g);
  return gs;
}

TEST(Schedule, EveryStepExactlyOnceForwardFirst) {
  for (auto kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved}) {
    for (int64_t p : {1, 2, 3, 4, 8}) {
      for (int64_t m : {1, 2, 5, 8, 16, 24}) {
        const int64_t v = kind == ScheduleKind::interleaved ? 3 : 1;
        if (kind == ScheduleKind::interleaved && (p < 2 || m < p)) continue;
        for (int64_t g : kind == ScheduleKind::interleaved ? accepted_groups(p, m) : std::vector<int64_t>{0}) {
          const Schedule sc = make_schedule(kind, p, v, m, g);
          for (const auto& list : sc.stages) {
            ASSERT_EQ(static_cast<int64_t>(list.size()), 2 * m * v);
            std::set<std::tuple<int, int, bool>> seen;
            for (const Step& st : list) {
              EXPECT_TRUE(seen.insert({st.chunk, st.mb, st.forward}).second);
              if (!st.forward) {
                EXPECT_TRUE(seen.count({st.chunk, st.mb, true})) << "backward before its forward";
              }
            }
          }
        }
      }
    }
  }
}

// The computed lists (ScheduleShape, used by the estimate's walk and memory) are the
// stored ones, step by step.
TEST(Schedule, ShapeMatchesTheStoredLists) {
  int steps = 0;
  for (auto kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved}) {
    for (int64_t p : {1, 2, 3, 4, 7, 8}) {
      for (int64_t v : {1, 2, 3, 5}) {
        if (kind != ScheduleKind::interleaved && v > 1) continue;
        for (int64_t m : {1, 2, 3, 5, 8, 16, 21, 24, 56}) {
          if (kind == ScheduleKind::interleaved && (m < p || p < 2)) continue;
          for (int64_t g : kind == ScheduleKind::interleaved ? accepted_groups(p, m) : std::vector<int64_t>{0}) {
            const Schedule sc = make_schedule(kind, p, v, m, g);
            const ScheduleShape sh{kind, p, sc.v, m, g};
            for (int64_t s = 0; s < p; ++s) {
              const auto& list = sc.stages[static_cast<size_t>(s)];
              ASSERT_EQ(static_cast<int64_t>(list.size()), sh.positions());
              for (int64_t k = 0; k < sh.positions(); ++k) {
                const Step& want = list[static_cast<size_t>(k)];
                const StepAt got = sh.at(s, k);
                auto where = [&] {  // (streamed only when an assertion fails)
                  return std::string(to_string(kind)) + " p=" + std::to_string(p) + " v=" + std::to_string(v) +
                         " m=" + std::to_string(m) + " g=" + std::to_string(g) + " s=" + std::to_string(s) +
                         " k=" + std::to_string(k);
                };
                ASSERT_EQ(got.forward, want.forward) << where();
                ASSERT_EQ(got.chunk, want.chunk) << where();
                ASSERT_EQ(sh.mb_of(got.index), want.mb) << where();
                ++steps;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(steps, 10000);
}

}  // namespace
}  // namespace strata
