// Pipeline simulation; see simulate.h.
#include "costmodel/simulate.h"

#include <algorithm>
#include <stdexcept>

namespace strata {

SimResult simulate(const Schedule& sc, const StageTimes& st, bool record_events) {
  const int64_t p = sc.p, v = sc.v, m = sc.m;
  const size_t n = static_cast<size_t>(p * v * m);
  auto idx = [&](int64_t s, int64_t c, int64_t mb) { return static_cast<size_t>((c * p + s) * m + mb); };
  constexpr double kNotDone = -1.0;
  std::vector<double> done_f(n, kNotDone), done_b(n, kNotDone);  // arrival time at the consumer
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<double> free_at(static_cast<size_t>(p), 0.0);
  SimResult r;
  r.end_s.assign(static_cast<size_t>(p), 0.0);
  r.compute_s.assign(static_cast<size_t>(p), 0.0);
  r.p2p_s.assign(static_cast<size_t>(p), 0.0);
  if (record_events) r.events.reserve(n * 2);

  std::vector<int64_t> work;
  std::vector<char> queued(static_cast<size_t>(p), 1);
  for (int64_t s = p - 1; s >= 0; --s) work.push_back(s);
  size_t remaining = 0;
  for (const auto& l : sc.stages) remaining += l.size();

  auto wake = [&](int64_t s) {
    if (s >= 0 && s < p && !queued[static_cast<size_t>(s)]) {
      queued[static_cast<size_t>(s)] = 1;
      work.push_back(s);
    }
  };

  while (!work.empty()) {
    const int64_t s = work.back();
    work.pop_back();
    queued[static_cast<size_t>(s)] = 0;
    const auto& list = sc.stages[static_cast<size_t>(s)];
    while (next[static_cast<size_t>(s)] < list.size()) {
      const Step& step = list[next[static_cast<size_t>(s)]];
      const int64_t c = step.chunk, mb = step.mb;
      double ready = 0;
      if (step.forward) {
        if (s > 0) ready = done_f[idx(s - 1, c, mb)];
        else if (c > 0) ready = done_f[idx(p - 1, c - 1, mb)];
      } else {
        if (s < p - 1) ready = done_b[idx(s + 1, c, mb)];
        else if (c < v - 1) ready = done_b[idx(0, c + 1, mb)];
        else ready = done_f[idx(s, c, mb)] >= 0 ? 0.0 : kNotDone;  // own forward, ran earlier
      }
      if (ready < 0) break;
      const double dur = step.forward ? st.f(s, c) : st.b(s, c);
      const double start = std::max(free_at[static_cast<size_t>(s)], ready);
      const double end = start + dur;
      // Does the output leave this stage?
      const bool sends = step.forward ? !(s == p - 1 && c == v - 1) : !(s == 0 && c == 0);
      const double send = (sends && p > 1) ? st.send[static_cast<size_t>(s)] : 0.0;
      free_at[static_cast<size_t>(s)] = end + send;
      r.compute_s[static_cast<size_t>(s)] += dur;
      r.p2p_s[static_cast<size_t>(s)] += send;
      (step.forward ? done_f : done_b)[idx(s, c, mb)] = end + send;
      if (record_events)
        r.events.push_back(SimEvent{static_cast<int32_t>(s), step.chunk, step.mb, step.forward, start, end, end + send});
      ++next[static_cast<size_t>(s)];
      --remaining;
      if (step.forward) {
        wake(s + 1);
        if (s == p - 1) wake(0);
      } else {
        wake(s - 1);
        if (s == 0) wake(p - 1);
      }
    }
  }
  if (remaining != 0) throw std::logic_error("pipeline schedule deadlocked in simulation");
  for (int64_t s = 0; s < p; ++s) {
    r.end_s[static_cast<size_t>(s)] = free_at[static_cast<size_t>(s)];
    r.makespan_s = std::max(r.makespan_s, free_at[static_cast<size_t>(s)]);
  }
  return r;
}

SimResult simulate_pipeline(ScheduleKind kind, int64_t m, const StageTimes& st, bool record_events) {
  const int64_t p = st.p, v = kind == ScheduleKind::interleaved ? st.v : 1;
  // Long enough to reach the periodic steady state of every schedule here.
  const int64_t cap = std::max<int64_t>(32, ((3 * p + p - 1) / p) * p * 2);
  if (record_events || m <= cap + p || p == 1) {
    if (p == 1) {
      // A single stage has no dependencies between steps: the walk is a sum.
      SimResult r;
      double total = 0;
      for (int64_t c = 0; c < v; ++c) total += static_cast<double>(m) * (st.f(0, c) + st.b(0, c));
      if (record_events) return simulate(make_schedule(kind, p, v, m), st, true);
      r.end_s = {total};
      r.compute_s = {total};
      r.p2p_s = {0.0};
      r.makespan_s = total;
      return r;
    }
    return simulate(make_schedule(kind, p, v, m), st, record_events);
  }
  const int64_t m2 = (cap / p) * p, m1 = m2 - p;
  const SimResult a = simulate(make_schedule(kind, p, v, m1), st, false);
  SimResult b = simulate(make_schedule(kind, p, v, m2), st, false);
  const double k = static_cast<double>(m - m2) / static_cast<double>(p);
  b.makespan_s = 0;
  for (size_t s = 0; s < b.end_s.size(); ++s) {
    b.end_s[s] += k * (b.end_s[s] - a.end_s[s]);
    b.compute_s[s] += k * (b.compute_s[s] - a.compute_s[s]);
    b.p2p_s[s] += k * (b.p2p_s[s] - a.p2p_s[s]);
    b.makespan_s = std::max(b.makespan_s, b.end_s[s]);
  }
  b.extrapolated = true;
  return b;
}

}  // namespace strata
