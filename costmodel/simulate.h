// Discrete-event walk of a pipeline schedule: each stage runs its step list in order on
// one compute stream; a step starts when the stage is free and its input has arrived (the
// previous stage's forward, the next stage's backward, plus the point-to-point transfer).
// Sends are synchronous, as in Megatron-LM: the sending stage is busy for the transfer.
// Gives each stage's finishing time and busy time; the bubble is what is left.
#pragma once

#include <cstdint>
#include <vector>

#include "costmodel/schedule.h"

namespace strata {

struct StageTimes {
  int64_t p = 1, v = 1;
  int64_t g = 0;                     // the interleaved schedule's micro-batch group; 0 for p
  std::vector<double> fwd_s, bwd_s;  // (v, p): one micro-batch of chunk c on stage s, at [c*p + s]
  std::vector<double> send_s;        // (p): one point-to-point transfer out of stage s
  double f(int64_t s, int64_t c) const { return fwd_s[static_cast<size_t>(c * p + s)]; }
  double b(int64_t s, int64_t c) const { return bwd_s[static_cast<size_t>(c * p + s)]; }
};

struct SimEvent {
  int32_t stage, chunk, mb;
  bool forward;
  double start_s, end_s;   // compute
  double send_end_s;       // end of the synchronous send that follows (== end_s when none)
};

struct SimResult {
  std::vector<double> end_s;           // per stage: when its last step (and send) finishes
  std::vector<double> compute_s;       // per stage: time spent in forward/backward steps
  std::vector<double> p2p_s;           // per stage: time spent sending
  double makespan_s = 0;
  bool extrapolated = false;           // the walk jumped over periodic steady-state steps
  bool by_position = false;            // walked position by position, without the stored lists
  std::vector<SimEvent> events;        // filled when asked for
};

// Walks the schedule exactly. Throws std::logic_error if the schedule deadlocks.
SimResult simulate(const Schedule& sc, const StageTimes& st, bool record_events);
// The same walk with every step's own duration, step_s[s][k] for the k-th step of stage s,
// and no send time: the executor replays a measured step through it (its steps' busy times
// and its schedule) to see how much of its idle time the schedule alone implies.
SimResult simulate_steps(const Schedule& sc, const std::vector<std::vector<double>>& step_s);

// The step time of a pipeline with m micro-batches: the same walk, position by position
// without storing the lists, jumping over whole periods of the steady state once one
// period has shifted every stage's times alike (exact: see simulate.cpp). Falls back to
// the stored walk (and, past kMaxWalkSteps, to extending shorter walks linearly in m);
// tests check every path against simulate().
SimResult simulate_pipeline(ScheduleKind kind, int64_t m, const StageTimes& st, bool record_events);
// The same into *out, reusing its vectors' storage (the estimate's per-thread scratch).
void simulate_pipeline_into(ScheduleKind kind, int64_t m, const StageTimes& st, bool record_events, SimResult* out);

// The fallback of simulate_pipeline() (and its method before the position walk): walks
// stored schedules p micro-batches apart until the finishing times grow by the
// bottleneck's work per round, then extends them linearly in m (1F1B and GPipe); the
// interleaved schedule is walked in full.
SimResult simulate_windows(ScheduleKind kind, int64_t m, const StageTimes& st, bool record_events);

}  // namespace strata
