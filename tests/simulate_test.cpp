// The discrete-event walk against closed forms where they exist (uniform stages, no
// communication: (m + p - 1)(F + B) for GPipe and 1F1B, (m v + p - 1)(f + b) for the
// interleaved schedule with per-chunk f, b), and the two fast paths (the position walk
// with its steady-state jumps, the windowed extrapolation) against the full walk.
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "costmodel/simulate.h"

namespace strata {
namespace {

StageTimes uniform(int64_t p, int64_t v, double f, double b, double send) {
  StageTimes st;
  st.p = p;
  st.v = v;
  st.fwd_s.assign(static_cast<size_t>(p * v), f);
  st.bwd_s.assign(static_cast<size_t>(p * v), b);
  st.send_s.assign(static_cast<size_t>(p), send);
  return st;
}

TEST(Simulate, ClosedFormBubbles) {
  for (int64_t p : {1, 2, 4, 8}) {
    for (int64_t m : {1, 4, 8, 32}) {
      const double F = 1.0, B = 2.0;
      for (auto kind : {ScheduleKind::one_f_one_b, ScheduleKind::gpipe}) {
        const SimResult r = simulate(make_schedule(kind, p, 1, m), uniform(p, 1, F, B, 0), false);
        EXPECT_DOUBLE_EQ(r.makespan_s, static_cast<double>(m + p - 1) * (F + B)) << to_string(kind) << p << " " << m;
        EXPECT_DOUBLE_EQ(r.compute_s[0], static_cast<double>(m) * (F + B));
      }
      if (p >= 2 && m % p == 0) {
        const int64_t v = 2;
        const double f = 0.5, b = 1.0;  // per chunk
        const SimResult r = simulate(make_schedule(ScheduleKind::interleaved, p, v, m), uniform(p, v, f, b, 0), false);
        EXPECT_DOUBLE_EQ(r.makespan_s, static_cast<double>(m * v + p - 1) * (f + b)) << p << " " << m;
      }
    }
  }
}

// Megatron-core's micro-batch groups (schedule.h): with uniform stages and no
// communication, every group it accepts (g >= p, the last group empty or at least p) keeps
// the classic (m v + p - 1)(f + b): a chunk's forward on the first stage waits for the
// previous chunk's forward from the last stage, which ran g >= p forwards earlier, so the
// round trip of p stages never stalls it. A last group of r < p, which Megatron-core
// refuses, does stall: m = 5, p = 4, g = 4 leaves r = 1, and the lone micro-batch's chunk 1
// waits for its chunk 0 to cross all four stages.
TEST(Simulate, InterleavedGroupsKeepTheClassicBubble) {
  const double f = 0.5, b = 1.0;
  int checked = 0;
  for (int64_t p : {2, 3, 4, 8}) {
    for (int64_t v : {2, 3}) {
      for (int64_t m = p; m <= 3 * p + 2; ++m) {
        for (int64_t g = p; g <= m; ++g) {
          if (m % g != 0 && m % g < p) continue;
          StageTimes st = uniform(p, v, f, b, 0);
          st.g = g;
          const SimResult r = simulate(make_schedule(ScheduleKind::interleaved, p, v, m, g), st, false);
          EXPECT_DOUBLE_EQ(r.makespan_s, static_cast<double>(m * v + p - 1) * (f + b)) << p << " " << v << " " << m << " " << g;
          EXPECT_DOUBLE_EQ(simulate_pipeline(ScheduleKind::interleaved, m, st, false).makespan_s, r.makespan_s);
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
  StageTimes four = uniform(4, 2, f, b, 0);
  four.g = 4;
  const SimResult stalled = simulate(make_schedule(ScheduleKind::interleaved, 4, 2, 5, 4), four, false);
  EXPECT_GT(stalled.makespan_s, static_cast<double>(5 * 2 + 4 - 1) * (f + b));
  // The position walk finds that input missing where it looks and hands over to the
  // stored walk, which gives the stall.
  const SimResult fallback = simulate_pipeline(ScheduleKind::interleaved, 5, four, false);
  EXPECT_FALSE(fallback.by_position);
  EXPECT_DOUBLE_EQ(fallback.makespan_s, stalled.makespan_s);
}

// The executor's replay (simulate_steps): each step its own duration. GPipe, p = 2, m = 2,
// stage 0 runs F0 1, F1 3, B0 2, B1 2 and stage 1 F0 1, F1 1, B0 2, B1 2 (seconds):
//   stage 0: F0 [0,1], F1 [1,4], then B0 waits for stage 1's B0 -> [7,9], B1 [9,11]
//   stage 1: F0 [1,2], F1 waits for stage 0's F1 -> [4,5], B0 [5,7], B1 [7,9]
// Idle (end - compute): stage 0 11 - 8 = 3, stage 1 9 - 6 = 3. With every step at its
// (stage, chunk, direction)'s time and no sends it is simulate() exactly.
TEST(Simulate, StepsWithTheirOwnDurations) {
  const Schedule g = make_schedule(ScheduleKind::gpipe, 2, 1, 2);
  const SimResult r = simulate_steps(g, {{1, 3, 2, 2}, {1, 1, 2, 2}});
  EXPECT_DOUBLE_EQ(r.end_s[0], 11.0);
  EXPECT_DOUBLE_EQ(r.end_s[1], 9.0);
  EXPECT_DOUBLE_EQ(r.end_s[0] - r.compute_s[0], 3.0);
  EXPECT_DOUBLE_EQ(r.end_s[1] - r.compute_s[1], 3.0);
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.5, 2.0);
  for (auto kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved}) {
    const int64_t p = 3, v = kind == ScheduleKind::interleaved ? 2 : 1, m = 6;
    StageTimes st = uniform(p, v, 0, 0, 0);
    for (auto& x : st.fwd_s) x = u(rng);
    for (auto& x : st.bwd_s) x = u(rng);
    const Schedule sc = make_schedule(kind, p, v, m);
    std::vector<std::vector<double>> steps(static_cast<size_t>(p));
    for (int64_t s = 0; s < p; ++s)
      for (const Step& x : sc.stages[static_cast<size_t>(s)])
        steps[static_cast<size_t>(s)].push_back(x.forward ? st.f(s, x.chunk) : st.b(s, x.chunk));
    const SimResult a = simulate(sc, st, false), b = simulate_steps(sc, steps);
    EXPECT_EQ(a.end_s, b.end_s) << to_string(kind);
    EXPECT_EQ(a.compute_s, b.compute_s) << to_string(kind);
  }
  EXPECT_THROW(simulate_steps(g, {{1, 3, 2, 2}}), std::logic_error);
}

TEST(Simulate, SendsLengthenTheCriticalPath) {
  // Two stages, one micro-batch: F0, send, F1, B1, send, B0.
  const SimResult r = simulate(make_schedule(ScheduleKind::one_f_one_b, 2, 1, 1), uniform(2, 1, 1, 2, 0.25), true);
  EXPECT_DOUBLE_EQ(r.makespan_s, 1 + 0.25 + 1 + 2 + 0.25 + 2);
  EXPECT_DOUBLE_EQ(r.p2p_s[0], 0.25);
  EXPECT_DOUBLE_EQ(r.p2p_s[1], 0.25);
  ASSERT_EQ(r.events.size(), 4u);
}

TEST(Simulate, ExtrapolationMatchesTheFullWalk) {
  int extrapolated = 0, cases = 0;
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.5, 1.5);
  for (auto kind : {ScheduleKind::one_f_one_b, ScheduleKind::gpipe, ScheduleKind::interleaved}) {
    for (int64_t p : {2, 3, 4, 8, 16, 32}) {
      for (int64_t m : {96, 128, 200, 480, 1024}) {
        if (m <= 4 * p + 16) continue;  // short schedules are walked in full anyway
        const int64_t v = kind == ScheduleKind::interleaved ? (p % 2 ? 3 : 2) : 1;
        if (kind == ScheduleKind::interleaved && m % p != 0) continue;
        StageTimes st = uniform(p, v, 1, 2, 0.05);
        for (auto& x : st.fwd_s) x = u(rng);
        for (auto& x : st.bwd_s) x = 2 * u(rng);
        for (auto& x : st.send_s) x = 0.1 * u(rng);
        const SimResult full = simulate(make_schedule(kind, p, v, m), st, false);
        const SimResult fast = simulate_windows(kind, m, st, false);
        extrapolated += fast.extrapolated;
        ++cases;
        EXPECT_NEAR(fast.makespan_s / full.makespan_s, 1.0, 1e-9) << to_string(kind) << " p=" << p << " m=" << m;
        for (size_t s = 0; s < static_cast<size_t>(p); ++s) {
          EXPECT_NEAR(fast.end_s[s] / full.end_s[s], 1.0, 1e-9);
          EXPECT_NEAR(fast.compute_s[s] / full.compute_s[s], 1.0, 1e-9);
        }
      }
    }
  }
  std::printf("%d of %d long schedules extrapolated, the rest walked in full\n", extrapolated, cases);
  EXPECT_GT(extrapolated, 0);
}

TEST(Simulate, UniformPipelinesAreExtrapolatedEarly) {
  // Stages alike except the ends (embedding, output layer): periodic after ~2p.
  for (auto kind : {ScheduleKind::one_f_one_b, ScheduleKind::gpipe, ScheduleKind::interleaved}) {
    const int64_t v = kind == ScheduleKind::interleaved ? 3 : 1;
    StageTimes st = uniform(16, v, 1, 2, 0.01);
    st.fwd_s.back() += 0.1;
    st.bwd_s.back() += 0.2;
    st.fwd_s.front() += 0.02;
    const SimResult fast = simulate_pipeline(kind, 192, st, false);
    const SimResult full = simulate(make_schedule(kind, 16, v, 192), st, false);
    EXPECT_TRUE(fast.extrapolated);
    EXPECT_NEAR(fast.makespan_s / full.makespan_s, 1.0, 1e-12);
  }
}

// The position walk (no fallback) against the stored walk: the same finishing times to
// rounding, the same busy and send times.
void expect_same_walk(const SimResult& fast, const SimResult& full, const std::string& what) {
  EXPECT_TRUE(fast.by_position) << what;
  EXPECT_NEAR(fast.makespan_s / full.makespan_s, 1.0, 1e-12) << what;
  ASSERT_EQ(fast.end_s.size(), full.end_s.size()) << what;
  for (size_t s = 0; s < full.end_s.size(); ++s) {
    EXPECT_NEAR(fast.end_s[s] / full.end_s[s], 1.0, 1e-12) << what << " stage " << s;
    EXPECT_NEAR(fast.compute_s[s], full.compute_s[s], 1e-9 * full.compute_s[s]) << what;
    EXPECT_NEAR(fast.p2p_s[s], full.p2p_s[s], 1e-9 * (1 + full.p2p_s[s])) << what;
  }
}

// The position-by-position walk (with its jumps) against the stored walk for every
// schedule, short and long, uniform and random stage times; it must never need the
// fallback for a schedule make_schedule() builds.
TEST(Simulate, PositionWalkMatchesTheStoredWalk) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.5, 1.5);
  int cases = 0, jumped = 0;
  for (auto kind : {ScheduleKind::one_f_one_b, ScheduleKind::gpipe, ScheduleKind::interleaved}) {
    for (int64_t p : {2, 3, 4, 5, 7, 8, 16}) {
      // Fixed counts, and counts about p, where the warm-ups (min(p - s - 1, m)) change shape.
      for (int64_t m : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{7}, int64_t{16}, int64_t{24}, int64_t{64},
                        int64_t{100}, int64_t{240}, p - 1, p + 1, 2 * p - 1}) {
        if (m < 1) continue;
        const int64_t v = kind == ScheduleKind::interleaved ? (p % 2 ? 3 : 2) : 1;
        if (kind == ScheduleKind::interleaved && m % p != 0) continue;
        for (int random = 0; random < 3; ++random) {
          StageTimes st = uniform(p, v, 1, 2, random == 2 ? 0.0 : 0.05);
          if (random) {
            for (auto& x : st.fwd_s) x = u(rng);
            for (auto& x : st.bwd_s) x = 2 * u(rng);
            for (auto& x : st.send_s) x *= u(rng);
          }
          const SimResult full = simulate(make_schedule(kind, p, v, m), st, false);
          const SimResult fast = simulate_pipeline(kind, m, st, false);
          const std::string what = std::string(to_string(kind)) + " p=" + std::to_string(p) + " m=" + std::to_string(m);
          ++cases;
          jumped += fast.extrapolated;
          expect_same_walk(fast, full, what);
        }
      }
    }
  }
  std::printf("%d schedules walked by position, %d of them jumped over their steady state\n", cases, jumped);
  EXPECT_GT(jumped, cases / 4);
}

// The interleaved position walk with Megatron-core's micro-batch groups: every group it
// accepts (p <= g <= m, the last group empty or at least p), uniform and random stage
// times, against the stored walk; long schedules must still jump their steady state.
TEST(Simulate, PositionWalkWithGroupsMatchesTheStoredWalk) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(0.5, 1.5);
  int cases = 0, jumped = 0;
  for (int64_t p : {2, 3, 4, 5, 8, 12}) {
    for (int64_t v : {p % 2 ? int64_t{3} : int64_t{2}, int64_t{4}}) {
      for (int64_t m : {p, p + 1, 2 * p - 1, 2 * p + 1, 3 * p + 2, int64_t{37}, int64_t{95}, int64_t{190}}) {
        if (m < p) continue;
        for (int64_t g = p; g <= m; ++g) {
          if (m % g != 0 && m % g < p) continue;     // Megatron-core refuses it
          if (g > 2 * p + 3 && g != m) continue;     // enough groups to cover the shapes
          for (int random = 0; random < 2; ++random) {
            StageTimes st = uniform(p, v, 1, 2, 0.05);
            st.g = g;
            if (random) {
              for (auto& x : st.fwd_s) x = u(rng);
              for (auto& x : st.bwd_s) x = 2 * u(rng);
              for (auto& x : st.send_s) x *= u(rng);
            } else {
              st.fwd_s.back() += 0.3;  // the output layer
              st.bwd_s.back() += 0.6;
            }
            const SimResult full = simulate(make_schedule(ScheduleKind::interleaved, p, v, m, g), st, false);
            const SimResult fast = simulate_pipeline(ScheduleKind::interleaved, m, st, false);
            const std::string what =
                "p=" + std::to_string(p) + " v=" + std::to_string(v) + " m=" + std::to_string(m) + " g=" + std::to_string(g);
            ++cases;
            jumped += fast.extrapolated;
            expect_same_walk(fast, full, what);
          }
        }
      }
    }
  }
  std::printf("%d grouped interleaved schedules walked by position, %d of them jumped\n", cases, jumped);
  EXPECT_GT(jumped, cases / 4);
}

// Megatron's default interleaved shape (groups of p, m a multiple of p, two groups or
// more), walked without tagged history as are most of the groups above: every chunk count
// from 2 to 6, pipelines up to 32 stages, short schedules and long ones that jump, stages
// alike but for the ends and random times per (stage, chunk), given as g = 0 and as g = p,
// against the stored walk.
TEST(Simulate, FullGroupInterleavedWalkMatchesTheStoredWalk) {
  std::mt19937 rng(23);
  std::uniform_real_distribution<double> u(0.5, 1.5);
  int cases = 0, jumped = 0;
  for (int64_t p : {2, 3, 4, 6, 8, 13, 16, 32}) {
    for (int64_t v : {2, 3, 4, 6}) {
      for (int64_t groups : {2, 3, 5, 12, 40}) {
        const int64_t m = groups * p;
        for (int random = 0; random < 3; ++random) {
          StageTimes st = uniform(p, v, 1, 2, 0.05);
          st.g = random == 1 ? p : 0;
          if (random == 0) {
            st.fwd_s.back() += 0.3;  // the output layer, on the last chunk of the last stage
            st.bwd_s.back() += 0.6;
            st.fwd_s.front() += 0.05;  // the embedding
          } else {
            for (auto& x : st.fwd_s) x = u(rng);
            for (auto& x : st.bwd_s) x = 2 * u(rng);
            for (auto& x : st.send_s) x *= u(rng);
          }
          const SimResult full = simulate(make_schedule(ScheduleKind::interleaved, p, v, m), st, false);
          const SimResult fast = simulate_pipeline(ScheduleKind::interleaved, m, st, false);
          const std::string what = "p=" + std::to_string(p) + " v=" + std::to_string(v) + " m=" + std::to_string(m) +
                                   " random=" + std::to_string(random);
          ++cases;
          jumped += fast.extrapolated;
          expect_same_walk(fast, full, what);
        }
      }
    }
  }
  std::printf("%d full-group interleaved schedules walked by position, %d of them jumped\n", cases, jumped);
  EXPECT_GT(jumped, cases / 4);
}

TEST(Simulate, DeadlockIsReported) {
  Schedule sc = make_schedule(ScheduleKind::one_f_one_b, 2, 1, 2);
  std::swap(sc.stages[1][0], sc.stages[1][1]);  // stage 1 would run B0 before F0
  EXPECT_THROW(simulate(sc, uniform(2, 1, 1, 1, 0), false), std::logic_error);
}

}  // namespace
}  // namespace strata
