// Pipeline simulation; see simulate.h.
#include "costmodel/simulate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>

namespace strata {

namespace {

// The walk of simulate(): dur(s, k, step) is the k-th step's compute on stage s, send(s)
// the synchronous send after a step whose output leaves the stage.
template <class Dur, class Send>
SimResult walk_lists(const Schedule& sc, const Dur& dur, const Send& send_of, bool record_events) {
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
      const double d = dur(s, static_cast<int64_t>(next[static_cast<size_t>(s)]), step);
      const double start = std::max(free_at[static_cast<size_t>(s)], ready);
      const double end = start + d;
      // Does the output leave this stage?
      const bool sends = step.forward ? !(s == p - 1 && c == v - 1) : !(s == 0 && c == 0);
      const double send = (sends && p > 1) ? send_of(s) : 0.0;
      free_at[static_cast<size_t>(s)] = end + send;
      r.compute_s[static_cast<size_t>(s)] += d;
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

}  // namespace

SimResult simulate(const Schedule& sc, const StageTimes& st, bool record_events) {
  return walk_lists(
      sc, [&](int64_t s, int64_t, const Step& step) { return step.forward ? st.f(s, step.chunk) : st.b(s, step.chunk); },
      [&](int64_t s) { return st.send_s[static_cast<size_t>(s)]; }, record_events);
}

SimResult simulate_steps(const Schedule& sc, const std::vector<std::vector<double>>& step_s) {
  if (step_s.size() != sc.stages.size()) throw std::logic_error("simulate_steps: one duration list per stage");
  for (size_t s = 0; s < step_s.size(); ++s)
    if (step_s[s].size() != sc.stages[s].size()) throw std::logic_error("simulate_steps: one duration per step");
  return walk_lists(
      sc, [&](int64_t s, int64_t k, const Step&) { return step_s[static_cast<size_t>(s)][static_cast<size_t>(k)]; },
      [](int64_t) { return 0.0; }, false);
}

namespace {

// The result of a position walk from each stage's finishing time. Busy time does not
// depend on the timing: every step runs once, and every step sends except the last
// chunk's forward on the last stage and the first chunk's backward on the first.
void finish_walk(int64_t m, int64_t v, const StageTimes& st, const double* free_at, bool jumped, SimResult* out) {
  const int64_t p = st.p;
  out->end_s.assign(free_at, free_at + p);
  out->compute_s.assign(static_cast<size_t>(p), 0.0);
  out->p2p_s.assign(static_cast<size_t>(p), 0.0);
  const double md = static_cast<double>(m);
  for (int64_t s = 0; s < p; ++s) {
    double fb = 0;
    for (int64_t c = 0; c < v; ++c) fb += st.f(s, c) + st.b(s, c);
    const size_t i = static_cast<size_t>(s);
    out->compute_s[i] = md * fb;
    const double sends = 2.0 * md * static_cast<double>(v) - (s == p - 1 ? md : 0.0) - (s == 0 ? md : 0.0);
    out->p2p_s[i] = sends * st.send_s[i];
  }
  out->makespan_s = *std::max_element(free_at, free_at + p);
  out->extrapolated = jumped;
  out->by_position = true;
}

// The steady-state test of the position walks. A walk records each stage's finishing time
// after every position; the period ending at position k can be jumped over when it lies in
// a steady region [lo, hi] and moved every stage's times of the last D positions by the
// same c as the period before. jump() then says how many whole periods J remain inside the
// region (0: no jump here) and the shift J * c; the walk refills its inputs of the last D
// positions as they will be J periods later and moves on by J * P positions.
class SteadyState {
 public:
  struct Region {
    int64_t lo, hi;
  };
  // D: the positions of history a steady step reads (2, unless the interleaved schedule's
  // micro-batch groups hold more than p: the first stage then reads the last stage's
  // forward of 2 (g - p + 1) positions before).
  SteadyState(int64_t P, Region a, Region b, size_t stages, std::vector<double>* scratch, int64_t D = 2)
      : P_(P), D_(D), n_(stages), hist_(*scratch), regions_{a, b} {
    // The last P + D positions' rows in a ring of a power of two rows (a mask, not a
    // division, finds a position's row).
    while (rows_ < P + D) rows_ *= 2;
    for (const Region& r : regions_) {
      if (r.lo > r.hi) continue;
      first_ = std::min(first_, std::max(r.lo + P - 1, P + D - 1));
      last_ = std::max(last_, r.hi - P);
    }
    // No history without a position to check (a group as long as the schedule has none).
    if (first_ > last_) first_ = INT64_MAX, last_ = INT64_MIN;
    // Unset: every row a check reads was recorded by this walk (checks stop at the jump).
    hist_.resize(first_ <= last_ ? static_cast<size_t>(rows_) * n_ : 0);
  }
  const double* row(int64_t k) const { return &hist_[static_cast<size_t>(k & (rows_ - 1)) * n_]; }
  void record(int64_t k, const std::vector<double>& free_at) { record(k, free_at.data()); }
  void record(int64_t k, const double* free_at) {  // the stages' times, free_at[0, stages)
    if (k < first_ - P_ - (D_ - 1) || k > last_) return;  // a row no check reads
    std::copy(free_at, free_at + n_, hist_.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(k & (rows_ - 1)) * n_));
  }
  // After the refill: every stage's time moves by the shift and the walk on by J periods.
  void jumped(int64_t* k, int64_t J, double shift, std::vector<double>* free_at) { jumped(k, J, shift, free_at->data()); }
  void jumped(int64_t* k, int64_t J, double shift, double* free_at) {
    for (size_t s = 0; s < n_; ++s) free_at[s] += shift;
    *k += J * P_;
    record(*k, free_at);
  }
  // Past the jump, exactly at `target` (>= k, in the region): the state recorded at the
  // position before k with target's phase, moved on by the whole periods between. A walk
  // whose other state follows from the position alone lands there instead of walking the
  // rest of the period after jumped(); per_period: jump()'s shift over J.
  void landed(int64_t* k, int64_t target, double per_period, double* free_at) const {
    const int64_t r = (target - *k) % P_, from = r == 0 ? *k : *k - (P_ - r);
    const double shift = static_cast<double>((target - from) / P_) * per_period;
    const double* src = row(from);
    for (size_t s = 0; s < n_; ++s) free_at[s] = src[s] + shift;
    *k = target;
  }
  int64_t jump(int64_t k, double* shift, double* per_period = nullptr) {
    if (k < first_ || k > last_) return 0;  // outside every region's checks
    for (const Region& r : regions_) {
      if (k - P_ + 1 < r.lo || k + P_ > r.hi || k - P_ - (D_ - 1) < 0) continue;
      const double c = row(k)[0] - row(k - P_)[0];
      const double tol = 1e-12 * row(k)[0];
      auto moved_alike = [&](int64_t d, size_t s) { return std::fabs((row(k - d)[s] - row(k - d - P_)[s]) - c) <= tol; };
      // Where the last check failed first: in a slow transient the same time stays behind
      // from one position to the next, and one comparison says so.
      if (!moved_alike(bad_d_, bad_s_)) continue;
      bool periodic = true;
      for (int64_t d = 0; d < D_ && periodic; ++d) {
        const double* now = row(k - d);
        const double* before = row(k - d - P_);
        for (size_t s = 0; s < n_ && periodic; ++s) {
          periodic = std::fabs((now[s] - before[s]) - c) <= tol;
          if (!periodic) bad_d_ = d, bad_s_ = s;
        }
      }
      if (!periodic) continue;
      const int64_t J = (r.hi - k) / P_;  // whole periods still inside the region
      *shift = static_cast<double>(J) * c;
      if (per_period) *per_period = c;
      return J;
    }
    return 0;
  }

 private:
  int64_t P_, D_, rows_ = 1;
  int64_t bad_d_ = 0;  // the row (d back) and time of the last failed check's first mismatch
  size_t bad_s_ = 0;
  int64_t first_ = INT64_MAX, last_ = INT64_MIN;  // the positions where jump() can say yes
  size_t n_;
  std::vector<double>& hist_;
  Region regions_[2];
};

// A step's time on (stage, chunk), at [c * p + s], with the send that follows it (none
// after the last chunk's forward on the last stage and the first chunk's backward on the
// first): the interleaved walks' durations.
void step_times_with_sends(const StageTimes& st, std::vector<double>* fsum, std::vector<double>* bsum) {
  const int64_t p = st.p, v = st.v;
  fsum->resize(static_cast<size_t>(p * v));
  bsum->resize(static_cast<size_t>(p * v));
  for (int64_t c = 0; c < v; ++c)
    for (int64_t s = 0; s < p; ++s) {
      const double send = st.send_s[static_cast<size_t>(s)];
      (*fsum)[static_cast<size_t>(c * p + s)] = st.f(s, c) + ((s == p - 1 && c == v - 1) ? 0.0 : send);
      (*bsum)[static_cast<size_t>(c * p + s)] = st.b(s, c) + ((s == 0 && c == 0) ? 0.0 : send);
    }
}

// The position walks: the walk of simulate() for a schedule made by make_schedule(),
// position by position. Every stage runs one step per position and the inputs of a step
// were produced at an earlier position or at the same one further up the pipeline
// (forwards: swept from the first stage) or further down (backwards: swept from the last),
// so they need neither the step lists nor a worklist. Where every stage is in its steady
// state (alternating forward and backward) the walk maps the state (the finishing times of
// the last D positions, which is all a steady step reads: 2, or 2(g - p + 1) for the
// interleaved schedule's groups of g) by the same max-plus linear map every period of P
// positions: one micro-batch for 1F1B (2 positions), one group of g micro-batches through
// all v chunks for the interleaved schedule (2gv), one position in either phase of GPipe. Once a period moves every stage's times by the same c, each later
// period moves them by c again (a max-plus map commutes with adding a constant), so the
// walk jumps by whole periods to the end of that region (SteadyState) and walks the rest:
// exact up to rounding. They return false, leaving *out alone, when the walk would exceed
// kMaxWalkSteps or (interleaved) an input is not where it looks for it; the caller then
// walks the stored schedule.
//
// The interleaved schedule, its positions from ScheduleShape, with tagged history: the
// walk of the shapes interleaved_walk_rings (below) does not take, one group of p < m <=
// 2(p - 1) micro-batches, where the first stages' warm-ups are the whole schedule and the
// last ones' are not. Micro-batches run through the chunks in groups of g (Megatron-core's
// schedule table: g = p unless set): forward i runs chunk (i mod gv) / g of the full
// groups, and the last group, of r <= g
// micro-batches, chunk (i - head) / r, where head = (groups before it) g v; backward i the
// chunks in reverse. The steady state's period is one full group through all chunks (2gv
// positions), and its region ends before the first stage reaches the last group.
bool interleaved_walk(int64_t m, const StageTimes& st, SimResult* out) {
  const int64_t p = st.p, g = st.g > 0 ? st.g : p;
  if (g < p) return false;  // (Megatron-core refuses such groups; the stored walk shows why)
  const ScheduleShape sh{ScheduleKind::interleaved, p, st.v, m, g};
  const int64_t v = sh.v, gv = g * v, total = m * v, positions = 2 * total, P = 2 * gv;
  const Groups gr = groups_of(m, g, v);
  const int64_t r = gr.last;
  const int64_t head = r == g ? total : gr.head;  // the forwards of full groups (all when the last is full)
  const int64_t D = 2 * (g - p + 1);  // (SteadyState)
  const size_t n = static_cast<size_t>(p);
  // The estimate's hot path for interleaved plans, so its state lives in per-thread
  // scratch, in arrays the loops below index directly.
  struct Done {
    int64_t index;
    double t;
  };
  thread_local std::vector<double> hist, free_at, fsum, bsum;
  thread_local std::vector<Done> fdone, bdone;
  thread_local std::vector<int64_t> warm, fidx, bidx;
  thread_local std::vector<int64_t> fnext, bnext;
  thread_local std::vector<int32_t> fchunk, bchunk;
  const int64_t w0 = sh.warmup(0);
  SteadyState steady(P, {w0 + D, std::min(positions - w0 - 1, 2 * head - w0 - 1)}, {1, 0}, n, &hist, D);
  // Finished steps by (stage, direction, index), tagged with their index; a slot overwritten
  // before its consumer ran sends the caller to the general walk.
  int64_t R = 4;
  while (R < 2 * std::max(g, p) + 4) R *= 2;
  const int64_t mask = R - 1;
  fdone.assign(n * static_cast<size_t>(R), Done{-1, 0.0});
  bdone.assign(n * static_cast<size_t>(R), Done{-1, 0.0});
  free_at.assign(n, 0.0);
  step_times_with_sends(st, &fsum, &bsum);
  // Each stage's warm-up and where it is in its lists: the forwards and backwards run so
  // far, the chunk (in forward order) of the next one and the index where that chunk ends.
  warm.resize(n);
  fidx.assign(n, 0);
  bidx.assign(n, 0);
  fchunk.assign(n, 0);
  bchunk.assign(n, 0);
  fnext.assign(n, head == 0 ? r : g);
  bnext.assign(n, head == 0 ? r : g);
  for (int64_t s = 0; s < p; ++s) warm[static_cast<size_t>(s)] = sh.warmup(s);
  bool jumped = false;
  int64_t walked = 0;
  // Raw pointers: the loops store through char and int64_t pointers, which could alias a
  // vector's own pointers in the compiler's eyes and force reloading them at every step.
  double* const fa = free_at.data();
  Done* const fd = fdone.data();
  Done* const bd = bdone.data();
  const double* const fs = fsum.data();
  const double* const bs = bsum.data();
  const int64_t* const wm = warm.data();
  int64_t* const fi = fidx.data();
  int64_t* const bi = bidx.data();
  int32_t* const fc = fchunk.data();
  int32_t* const bc = bchunk.data();
  int64_t* const fn = fnext.data();
  int64_t* const bn = bnext.data();
  // Step `index`'s chunk in forward order, from the stage's chunk and where it ends: past
  // the end the next chunk begins (chunk 0 again after the last, a new group), and the
  // last group's chunks hold r steps.
  auto chunk_of = [&](int64_t index, int32_t* c, int64_t* next) -> int64_t {
    if (index == *next) {
      if (index == head) {
        *c = 0;
        *next = head + r;
      } else {
        *c = *c + 1 == v ? 0 : *c + 1;
        *next = index + (index < head ? g : r);
      }
    }
    return *c;
  };

  // Which stages run forwards at a position: warm-ups fall by 2 per stage, so the stages in
  // their warm-up (w > k) are a prefix, all running forwards, as are those in their
  // cool-down (w >= positions - k), all running backwards; the two never meet (warm-up
  // needs k < w <= total, cool-down k >= total). The stages after the prefix are in their
  // steady state, whose warm-ups have one parity: all run forwards where k - w is even.
  int64_t a = p, cooled = 0;  // the prefix: [0, a)

  for (int64_t k = 0; k < positions; ++k) {
    const bool warming = k < total;
    if (warming) {
      while (a > 0 && wm[a - 1] <= k) --a;
    } else {
      while (cooled < p && wm[cooled] >= positions - k) ++cooled;
      a = cooled;
    }
    const bool steady_forward = ((k - wm[p - 1]) & 1) == 0;
    // Forwards, first stage to last: forward i of stage s > 0 takes forward i of the stage
    // before; the first stage's forward of chunk c > 0 takes the last stage's forward of
    // chunk c - 1, one group earlier in its list.
    for (int64_t s = warming ? 0 : a, end_s = steady_forward ? p : a; s < end_s; ++s) {
      const size_t i = static_cast<size_t>(s);
      const int64_t index = fi[i]++;
      const int64_t c = chunk_of(index, &fc[i], &fn[i]);
      double ready = 0;
      if (s > 0) {
        const Done& d = fd[static_cast<size_t>((s - 1) * R + (index & mask))];
        if (d.index != index) return false;
        ready = d.t;
      } else if (c > 0) {
        const int64_t in = index - (index < head ? g : r);  // one group back
        const Done& d = fd[static_cast<size_t>((p - 1) * R + (in & mask))];
        if (d.index != in) return false;
        ready = d.t;
      }
      const double end = std::max(fa[i], ready) + fs[c * p + s];
      fa[i] = end;
      fd[static_cast<size_t>(s * R + (index & mask))] = Done{index, end};
    }
    // Backwards, last stage to first, alike in reverse; the last stage's backward of the
    // last chunk takes its own forward, which ran earlier.
    for (int64_t s = (steady_forward ? a : p) - 1, end_s = warming ? a : 0; s >= end_s; --s) {
      const size_t i = static_cast<size_t>(s);
      const int64_t index = bi[i]++;
      const int64_t c = v - 1 - chunk_of(index, &bc[i], &bn[i]);
      double ready = 0;
      if (s < p - 1) {
        const Done& d = bd[static_cast<size_t>((s + 1) * R + (index & mask))];
        if (d.index != index) return false;
        ready = d.t;
      } else if (c < v - 1) {
        const int64_t in = index - (index < head ? g : r);
        const Done& d = bd[static_cast<size_t>(in & mask)];
        if (d.index != in) return false;
        ready = d.t;
      }
      const double end = std::max(fa[i], ready) + bs[c * p + s];
      fa[i] = end;
      bd[static_cast<size_t>(s * R + (index & mask))] = Done{index, end};
    }
    walked += p;
    if (walked > kMaxWalkSteps) return false;
    steady.record(k, free_at);
    double shift = 0;
    if (const int64_t J = steady.jump(k, &shift); J > 0) {
      // What the last D positions produced, as produced J periods later: the inputs of
      // the positions after the jump.
      for (int64_t d = D - 1; d >= 0; --d) {
        const double* t = steady.row(k - d);
        for (int64_t s = 0; s < p; ++s) {
          const StepAt will = sh.at(s, k - d + J * P);
          (will.forward ? fd : bd)[static_cast<size_t>(s * R + (will.index & mask))] = Done{will.index, t[s] + shift};
        }
      }
      // Every stage ran gv forwards and gv backwards per period, all in full groups: its
      // chunks are the same, J rounds on.
      for (size_t i = 0; i < n; ++i) {
        fidx[i] += J * gv;
        bidx[i] += J * gv;
        fnext[i] += J * gv;
        bnext[i] += J * gv;
      }
      steady.jumped(&k, J, shift, &free_at);
      jumped = true;
    }
  }
  finish_walk(m, v, st, free_at.data(), jumped, out);
  return true;
}

// The interleaved walk again without tagged history, for groups of g >= p micro-batches
// whose last group, of r, holds at least p (every group Megatron-core accepts) and
// warm-ups below the schedule's length, or m = p, where every stage runs all its forwards
// first (then the walk is the two chains: warm-up and cool-down of the whole pipeline).
// Stage s has warm-up w_s = 2(p - 1 - s) + (v - 1)g: it runs forward k at position
// k < w_s, then forward (k + w_s)/2 where k - w_s is even and backward (k - w_s - 1)/2
// where it is odd, then backward k - T from position 2T - w_s on (T = mv). The warm-ups
// have one parity, so at a position every stage in its steady state runs the same way,
// forwards where k - w_{p-1} is even; the stages still in their warm-up (w_s > k) are a
// prefix, as are those in their cool-down (w_s >= 2T - k), and the two never meet
// (T > w_0).
//
// What each step reads. Steady forward i on stage s > 0 takes forward i of stage s - 1,
// which ran it two positions before (2i - w_s - 2) and a backward since, unless s - 1 is
// in its warm-up (then k = w_s = i: forward k of this very position) or in its cool-down
// (then i = T - 1, its last forward): in every case stage s - 1's last forward before
// this position's steady steps. Alike a steady backward j on s < p - 1 takes stage s + 1's
// last backward. So the state is each stage's last forward and last backward finishing
// times (LF, LB; a stage is free at the later of the two); the forwards sweep down from
// the last stage, each reading the stage below before it is overwritten, the backwards up
// from the first, after the warm-up prefix's chain (forward k, each stage reading the one
// below at this position) and before the cool-down prefix's (backward k - T, reading the
// stage above). The links between chunks, stage 0's forward i of chunk > 0 taking stage
// p - 1's forward of the same micro-batch one chunk before (i - g in the full groups,
// i - r in the last) and stage p - 1's backward j of order-chunk > 0 taking stage 0's
// backward j - g (or j - r), were produced at earlier positions: 2(g - p + 1) before in the
// steady state (r >= p: so never at the same position or later), more in the warm-up
// and the cool-down, so they are read from two rings of each end stage's finishing times
// by index. At a position the steady stages' indices are consecutive (i_s = i_{p-1} + p - 1
// - s, j_s = j_{p-1} - (p - 1 - s)), p at most against chunks of g or r >= p of them, so
// they fall in at most two chunks, split at one stage; each run is a max, a max and an
// add.
//
// A periodic steady state (every stage steady, every index in the full groups) is found
// as in the walks above; its period is a group through all chunks (2gv positions) and its
// state (LF, LB) over the last D = 2(g - p) + 1 positions (1 for groups of p): a ring entry
// still to be read was written within the last 2(g - p + 1) positions, at a position
// whose LF[p - 1] or LB[0] holds it, or the one after. The walk then lands on the region's
// last position itself, not on the last one of its phase (up to a period short of it):
// the state there, and over the D positions before it, is the history's of the positions
// with that phase in the period just walked, moved on by the whole periods between
// (SteadyState::landed); the counters follow from the position, and the ring entries of
// those D positions are refilled from the landed rows. Checked against the stored walk
// for 2 to 6 chunks on up to 32 stages, groups of p, and every group Megatron-core
// accepts on up to 12 stages (simulate_test).
bool interleaved_walk_rings(int64_t m, const StageTimes& st, SimResult* out) {
  const int64_t p = st.p, v = st.v, g = st.g > 0 ? st.g : p, gv = g * v, total = m * v, positions = 2 * total;
  const int64_t P = 2 * gv, D = 2 * (g - p) + 1;
  const Groups gr = groups_of(m, g, v);
  const int64_t r = gr.last == g ? g : gr.last;
  const int64_t head = gr.last == g ? total : gr.head;  // the indices of full groups (all when the last is full)
  const int64_t wl = (v - 1) * g, w0 = wl + 2 * (p - 1);  // the last and the first stage's warm-ups
  const size_t n = static_cast<size_t>(p);
  thread_local std::vector<double> state, fsum, bsum, rings, hist;
  state.assign(2 * n, 0.0);
  step_times_with_sends(st, &fsum, &bsum);
  int64_t R = 4;
  while (R < 2 * (v + 1) * g + 4) R *= 2;
  const int64_t mask = R - 1;
  rings.resize(2 * static_cast<size_t>(R));  // every entry read was written first (above)
  double* const LF = state.data();
  double* const LB = LF + p;
  double* const HF = rings.data();  // stage p - 1's forwards by index
  double* const HB = HF + R;        // stage 0's backwards by index
  const double* const fs = fsum.data();
  const double* const bs = bsum.data();
  // The steady region: every stage steady, from D positions in, until the first stage's
  // forwards reach the last group (or its cool-down begins).
  const int64_t hi_steady = positions - w0 - 1;
  const int64_t hi = std::min(hi_steady, 2 * head - w0 - 1);
  SteadyState steady(P, {w0 + std::max<int64_t>(D, 2), hi}, {1, 0}, 2 * n, &hist, D);
  // Where an index is in its chunk, counted rather than divided: (chunk, offset, the
  // chunk's length) of the warm-up chain's forward k, of the last stage's next steady
  // forward (index wl) and backward (index 0), and of the cool-down chain's backward k - T.
  struct Place {
    int64_t index, c, q, len;
  };
  auto place_of = [&](int64_t index) {
    if (index < head) return Place{index, (index % gv) / g, index % g, g};
    return Place{index, (index - head) / r, (index - head) % r, r};
  };
  auto next = [&](Place& x) {
    if (++x.index == head) {
      x = Place{head, 0, 0, r};
    } else if (++x.q == x.len) {
      x.q = 0;
      x.c = x.c + 1 == v ? 0 : x.c + 1;
    }
  };
  auto lag = [&](int64_t index) { return index < head ? g : r; };  // one chunk back, same micro-batch
  Place warm = place_of(0), fwd = place_of(wl), bwd = place_of(0), cool{-1, -1, 0, 0};
  // Forward k down the warm-up prefix [0, a), each stage taking the one below's.
  auto warm_chain = [&](int64_t k, int64_t a) {
    double t = warm.c > 0 ? HF[(k - lag(k)) & mask] : 0.0;
    const double* d = fs + warm.c * p;
    for (int64_t s = 0; s < a; ++s) LF[s] = t = std::max(LF[s], t) + d[s];
    if (a == p) HF[k & mask] = t;
    next(warm);
  };
  // The steady stages [lo, p) at a forward position, last stage first: the indices from
  // the last stage's up, stages [q + p - len, p) in its chunk, those below in the next.
  auto steady_forwards = [&](int64_t lo) {
    const Place x = fwd;
    next(fwd);
    const int64_t i = x.index, ct = x.c;
    const int64_t cn = ct + 1 == v ? 0 : ct + 1;  // (the last full group's last chunk is v - 1)
    const double* const top = fs + ct * p;
    const double* const low = fs + cn * p;
    const int64_t split = std::max(x.q + p - x.len, lo);
    int64_t s = p - 1;
    for (; s >= split && s > 0; --s) LF[s] = std::max(std::max(LF[s], LB[s]), LF[s - 1]) + top[s];
    for (; s >= lo && s > 0; --s) LF[s] = std::max(std::max(LF[s], LB[s]), LF[s - 1]) + low[s];
    if (lo == 0) {  // stage 0: forward i + p - 1, after the last stage's of the chunk before
      const bool same = x.q + p - 1 < x.len;
      const int64_t i0 = i + p - 1, c0 = same ? ct : cn;
      const double in = c0 > 0 ? HF[(i0 - lag(i0)) & mask] : 0.0;
      LF[0] = std::max(std::max(LF[0], LB[0]), in) + (same ? top : low)[0];
    }
    HF[i & mask] = LF[p - 1];
  };
  // At a backward position, first steady stage first: stages [p - 1 - q, p) run order-chunk
  // c (chunk v - 1 - c), those below the one before (chunk 0 before order-chunk 0).
  auto steady_backwards = [&](int64_t lo) {
    const Place x = bwd;
    next(bwd);
    const int64_t j = x.index, ct = x.c;
    const double* const top = bs + (v - 1 - ct) * p;
    const double* const low = bs + (ct == 0 ? 0 : v - ct) * p;
    const int64_t split = std::max(p - 1 - x.q, lo);
    int64_t s = lo;
    for (; s < split; ++s) LB[s] = std::max(std::max(LF[s], LB[s]), LB[s + 1]) + low[s];
    for (; s < p - 1; ++s) LB[s] = std::max(std::max(LF[s], LB[s]), LB[s + 1]) + top[s];
    // The last stage: backward j, after stage 0's of the chunk after (order-chunk before).
    const double in = ct > 0 ? HB[(j - lag(j)) & mask] : 0.0;
    LB[p - 1] = std::max(std::max(LF[p - 1], LB[p - 1]), in) + top[p - 1];
    if (lo == 0) HB[(j - (p - 1)) & mask] = LB[0];
  };
  // Backward k - T up the cool-down prefix [0, cooled), each taking the one above's.
  auto cool_chain = [&](int64_t k, int64_t cooled) {
    const int64_t j = k - total;
    if (cool.c < 0) cool = place_of(j);  // its first position
    double t = cooled < p ? LB[cooled] : (cool.c > 0 ? HB[(j - lag(j)) & mask] : 0.0);
    const double* d = bs + (v - 1 - cool.c) * p;
    for (int64_t s = cooled - 1; s >= 0; --s) LB[s] = t = std::max(std::max(LF[s], LB[s]), t) + d[s];
    HB[j & mask] = t;
    next(cool);
  };
  // The positions in four phases, so that no step tests which: every stage in its warm-up
  // (k < w_{p-1}); the warm-up prefix [0, a) shrinking by one stage every two positions
  // (a = p - 1 - (k - wl) / 2, 1 <= a < p, up to w_0); every stage steady, up to the last
  // position before the first stage's cool-down, 2T - w_0 - 1; then the cool-down prefix
  // [0, cooled) growing (cooled = p - (2T - k - wl + 1) / 2, rounded down, at most p). A
  // stage runs a forward where k - wl is even.
  bool jumped = false;
  int64_t walked = 0, k = 0;
  if (m == p) {  // every stage's warm-up is the whole schedule: all forwards, then all backwards
    if (2 * total * p > kMaxWalkSteps) return false;
    for (; k < total; ++k) warm_chain(k, p);
    for (; k < positions; ++k) cool_chain(k, p);
    finish_walk(m, v, st, LB, false, out);
    return true;
  }
  for (; k < wl; ++k) {
    if ((walked += p) > kMaxWalkSteps) return false;
    warm_chain(k, p);
  }
  for (; k < w0; ++k) {
    if ((walked += p) > kMaxWalkSteps) return false;
    const int64_t a = p - 1 - ((k - wl) >> 1);
    warm_chain(k, a);
    if (((k - wl) & 1) == 0) steady_forwards(a);
    else steady_backwards(a);
  }
  for (; k <= hi_steady; ++k) {
    if ((walked += p) > kMaxWalkSteps) return false;
    if (((k - wl) & 1) == 0) steady_forwards(0);
    else steady_backwards(0);
    steady.record(k, LF);
    double shift = 0, c = 0;
    if (const int64_t J = steady.jump(k, &shift, &c); J > 0) {
      // On to hi, the steady region's last position. The last stage's next forward and
      // backward there, and the ring entries the D positions up to it wrote: at a forward
      // position the last stage's forward (k + wl) / 2, at a backward one the first stage's
      // backward (k - w0 - 1) / 2.
      for (int64_t d = D - 1; d >= 0; --d) {
        int64_t y = k;
        steady.landed(&y, hi - d, c, LF);
        if (((y - wl) & 1) == 0) HF[((y + wl) / 2) & mask] = LF[p - 1];
        else HB[((y - w0 - 1) / 2) & mask] = LB[0];
      }
      k = hi;
      fwd = place_of(wl + (k - wl) / 2 + 1);
      bwd = place_of((k - wl + 1) / 2);
      jumped = true;
    }
  }
  for (; k < positions; ++k) {
    if ((walked += p) > kMaxWalkSteps) return false;
    const int64_t cooled = std::min(p, p - ((2 * total - k - wl + 1) >> 1));
    if (cooled < p) {
      if (((k - wl) & 1) == 0) steady_forwards(cooled);
      else steady_backwards(cooled);
    }
    cool_chain(k, cooled);
  }
  finish_walk(m, v, st, LB, jumped, out);
  return true;
}

// interleaved_walk_rings's shapes: groups of at least p, the last one too, and a first
// warm-up shorter than the schedule, or m = p (one group, every warm-up the schedule).
bool ring_walk_applies(int64_t m, const StageTimes& st) {
  const int64_t p = st.p, v = st.v, g = st.g > 0 ? st.g : p;
  if (g < p || m < p) return false;
  if (m == p) return g == p;
  const Groups gr = groups_of(m, g, v);
  return gr.last >= p && 2 * (p - 1) + (v - 1) * g < m * v;
}

// The same walk for the schedules with one chunk per stage, 1F1B and GPipe, with their
// positions in closed form (GPipe is 1F1B with every warm-up m): stage s with warm-up
// w = min(p - s - 1, m) runs forward k at position k < w, then forward w + j/2 (j = k - w
// even) and backward j/2 (j odd), then backward k - m from position 2m - w on.
//
// So at position k the stages fall into two runs. Warm-ups shrink down the pipeline, so
// the stages still in their warm-up (w > k: s < p - 1 - k, all of them when k < m for
// GPipe) are a prefix, all running forwards; alike those in their cool-down (w >= 2m - k:
// s < p - 2m + k, all when k >= m for GPipe) are a prefix, all running backwards, and the
// two never meet (warm-up needs k < w <= m, cool-down k >= 2m - w >= m). The stages after
// the prefix are in their steady state with w = p - 1 - s (a capped warm-up w = m has no
// steady state), running a forward where k - w is even: every other stage.
//
// No step needs more than the last forward and the last backward each stage finished.
// Forward i of stage s runs at position i (i <= w) or 2i - w (i > w), and forward i of
// stage s - 1 (warm-up w + 1, or m like s) at the same position or, for i > w, at the one
// before, 2i - w - 1, where s - 1 is in its steady state at odd offset (2i - 2w - 1): it
// runs a backward there, so forward i is still its last forward when s reads it. Alike
// backward j of stage s, at w + 2j + 1 (j < m - w) or j + m, and of stage s + 1 (warm-up
// w - 1, or m like s) at the same position or, for j < m - w, at the position before, w + 2j,
// where s + 1 runs a forward next. And each of those is the neighbour's finishing time
// after the position before, except the first steady stage's input in the warm-up, the
// warm-up prefix's step at this very position (walked first): a steady forward's input
// stage runs a backward at this position and ran the forward at the one before (for
// s - 1 = a the prefix's), a steady backward's input stage runs a forward here and ran the
// backward before; the cool-down prefix reads stage a's backward of this position. So the
// state is one array of finishing times, each read before it is overwritten: the steady
// stages in one pass up the pipeline, the stage below's old time carried in a register.
// The estimate's hot path: its state lives in per-thread scratch, and a step is a max and
// an add.
bool one_chunk_walk(ScheduleKind kind, int64_t m, const StageTimes& st, SimResult* out) {
  const int64_t p = st.p, positions = 2 * m;
  const bool gpipe = kind == ScheduleKind::gpipe;
  const int64_t P = gpipe ? 1 : 2;
  const size_t n = static_cast<size_t>(p);
  // A forward's and a backward's time on each stage with the send that follows it (none
  // after the last stage's forward and the first stage's backward), added once here, and
  // each stage's finishing time with a 0 after the last stage (the last stage's backward
  // needs nothing but its own forward).
  thread_local std::vector<double> fs, bs, free_at, hist;
  fs.resize(n);
  bs.resize(n);
  free_at.assign(n + 1, 0.0);
  for (int64_t s = 0; s < p; ++s) {
    const size_t i = static_cast<size_t>(s);
    fs[i] = st.fwd_s[i] + (s < p - 1 ? st.send_s[i] : 0.0);
    bs[i] = st.bwd_s[i] + (s > 0 ? st.send_s[i] : 0.0);
  }
  // The steady regions: GPipe's two phases, 1F1B's forward/backward pairs.
  const int64_t w0 = gpipe ? m : std::min(p - 1, m);
  SteadyState steady(P, gpipe ? SteadyState::Region{1, m - 1} : SteadyState::Region{w0 + 2, positions - w0 - 1},
                     gpipe ? SteadyState::Region{m + 1, positions - 1} : SteadyState::Region{1, 0}, n, &hist);
  // Raw pointers, so that the stores through doubles need not reload the vectors' own.
  const double* const f_dur = fs.data();
  const double* const b_dur = bs.data();
  double* const fa = free_at.data();
  bool jumped = false;
  int64_t walked = 0;
  for (int64_t k = 0; k < positions; ++k) {
    if ((walked += p) > kMaxWalkSteps) return false;
    // The prefix in warm-up (k < m) or cool-down, then the steady stages from `a` on.
    const bool warming = k < m;
    const int64_t a = gpipe ? p : std::clamp(warming ? p - 1 - k : p - positions + k, int64_t{0}, p);
    // Down the warm-up prefix each step waits for the one before it: the chain is carried
    // in a register rather than read back from the store just made.
    if (warming) {
      double t = 0;
      for (int64_t s = 0; s < a; ++s) fa[s] = t = std::max(fa[s], t) + f_dur[s];
    }
    // The steady stages in one pass up the pipeline, every step reading its neighbours'
    // times before they are overwritten: `left` holds the stage below's. Stage a runs a
    // backward where k + a - (p - 1) is odd, and the stages alternate from there.
    if (a < p) {
      int64_t s = a;
      double left = a > 0 ? fa[a - 1] : 0.0, mine = fa[a];
      if ((k + a - (p - 1)) & 1) {
        const double right = fa[s + 1];
        fa[s] = std::max(mine, right) + b_dur[s];
        left = mine;
        mine = right;
        ++s;
      }
      for (; s + 1 < p; s += 2) {  // a forward on s, a backward on s + 1
        const double up = fa[s + 1], right = fa[s + 2];
        fa[s] = std::max(mine, left) + f_dur[s];
        fa[s + 1] = std::max(up, right) + b_dur[s + 1];
        left = up;
        mine = right;
      }
      if (s < p) fa[s] = std::max(mine, left) + f_dur[s];
    }
    if (!warming) {
      double t = fa[a];  // stage a's last backward (it runs one here), or the 0 past the last stage
      for (int64_t s = a - 1; s >= 0; --s) fa[s] = t = std::max(fa[s], t) + b_dur[s];
    }
    steady.record(k, fa);
    double shift = 0;
    if (const int64_t J = steady.jump(k, &shift); J > 0) {
      // Each stage's time moved by the period's shift (SteadyState): J periods later the
      // same steps hold the same places, J shifts later.
      steady.jumped(&k, J, shift, fa);
      jumped = true;
    }
  }
  finish_walk(m, 1, st, fa, jumped, out);
  return true;
}

}  // namespace

void simulate_pipeline_into(ScheduleKind kind, int64_t m, const StageTimes& st, bool record_events, SimResult* out) {
  const int64_t p = st.p, v = kind == ScheduleKind::interleaved ? st.v : 1;
  out->events.clear();
  out->extrapolated = out->by_position = false;
  if (p == 1 && !record_events) {
    // A single stage has no dependencies between steps: the walk is a sum.
    double total = 0;
    for (int64_t c = 0; c < v; ++c) total += static_cast<double>(m) * (st.f(0, c) + st.b(0, c));
    out->end_s.assign(1, total);
    out->compute_s.assign(1, total);
    out->p2p_s.assign(1, 0.0);
    out->makespan_s = total;
    return;
  }
  if (!record_events &&
      (kind == ScheduleKind::interleaved
           ? (ring_walk_applies(m, st) ? interleaved_walk_rings(m, st, out) : interleaved_walk(m, st, out))
           : one_chunk_walk(kind, m, st, out)))
    return;
  *out = simulate_windows(kind, m, st, record_events);
}

SimResult simulate_pipeline(ScheduleKind kind, int64_t m, const StageTimes& st, bool record_events) {
  SimResult r;
  simulate_pipeline_into(kind, m, st, record_events, &r);
  return r;
}

SimResult simulate_windows(ScheduleKind kind, int64_t m, const StageTimes& st, bool record_events) {
  const int64_t p = st.p, v = kind == ScheduleKind::interleaved ? st.v : 1;
  // The long-run growth of the step per micro-batch is the largest cycle mean of the
  // schedule's dependency graph. It is at least the bottleneck's work per micro-batch, and
  // for 1F1B (whose warm-up covers every round trip) and GPipe at most that: the busiest
  // stage's forward + backward + sends (1F1B), the slowest forward plus the slowest
  // backward (GPipe). So: walk schedules p micro-batches apart; once every stage's
  // finishing time grows by exactly that bound twice in a row, the walk is in its final
  // periodic regime and each further micro-batch adds the bound. Otherwise double the
  // length and try again, down to the full walk. The interleaved schedule's shorter
  // warm-up does not bound its cycles that way: it is always walked in full.
  double bound = 0;
  {
    double max_f = 0, max_b = 0;
    for (int64_t s = 0; s < p; ++s) {
      double f = 0, b = 0;
      for (int64_t c = 0; c < v; ++c) f += st.f(s, c), b += st.b(s, c);
      const double sends = p > 1 ? st.send_s[static_cast<size_t>(s)] : 0.0;
      f += sends * static_cast<double>(v - (s == p - 1 ? 1 : 0));
      b += sends * static_cast<double>(v - (s == 0 ? 1 : 0));
      max_f = std::max(max_f, f);
      max_b = std::max(max_b, b);
      bound = std::max(bound, f + b);
    }
    if (kind == ScheduleKind::gpipe) bound = max_f + max_b;
  }
  const bool bounded = kind != ScheduleKind::interleaved;
  auto steps = [&](int64_t mm) { return 2 * p * v * mm; };
  for (int64_t m2 = std::max<int64_t>(8, 2 * p) / p * p; bounded && !record_events && m2 + 2 * p < m; m2 *= 2) {
    const SimResult a = simulate(make_schedule(kind, p, v, m2 - p), st, false);
    const SimResult b = simulate(make_schedule(kind, p, v, m2), st, false);
    SimResult c = simulate(make_schedule(kind, p, v, m2 + p), st, false);
    const double step = bound * static_cast<double>(p);
    bool periodic = true;
    for (size_t s = 0; s < c.end_s.size() && periodic; ++s) {
      const double tol = 1e-12 * c.end_s[s];
      periodic = std::fabs((b.end_s[s] - a.end_s[s]) - step) <= tol && std::fabs((c.end_s[s] - b.end_s[s]) - step) <= tol;
    }
    // Not periodic yet: walk longer while the walk limit allows (the next window, or the
    // whole schedule). Past it, extend from here with the long-run slope, which is exact
    // for these schedules: only the rest of the transient is approximated.
    if (!periodic && (steps(m) <= kMaxWalkSteps || steps(2 * m2 + p) <= kMaxWalkSteps)) continue;
    const double k = static_cast<double>(m - (m2 + p)) / static_cast<double>(p);
    c.makespan_s = 0;
    for (size_t s = 0; s < c.end_s.size(); ++s) {
      c.end_s[s] += k * step;
      c.compute_s[s] += k * (c.compute_s[s] - b.compute_s[s]);
      c.p2p_s[s] += k * (c.p2p_s[s] - b.p2p_s[s]);
      c.makespan_s = std::max(c.makespan_s, c.end_s[s]);
    }
    c.extrapolated = true;
    return c;
  }
  return simulate(make_schedule(kind, p, v, m, st.g), st, record_events);
}

}  // namespace strata
