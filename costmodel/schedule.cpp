// Pipeline schedules; see schedule.h.
#include "costmodel/schedule.h"

#include <algorithm>

namespace strata {

namespace {

// Forward or backward k of the interleaved schedule with groups of g micro-batches
// (schedule.h): Megatron's schedule table in closed form.
Step interleaved_step(int64_t k, int64_t v, int64_t m, int64_t g, bool forward) {
  const auto [full, r, head] = groups_of(m, g, v);
  int64_t chunk = 0, mb = 0;
  if (k < head) {
    const int64_t in = k % (g * v);
    chunk = in / g;
    mb = (k / (g * v)) * g + in % g;
  } else {
    const int64_t in = k - head;
    chunk = in / r;
    mb = full * g + in % r;
  }
  Step st;
  st.chunk = static_cast<int32_t>(forward ? chunk : v - 1 - chunk);
  st.mb = static_cast<int32_t>(mb);
  st.forward = forward;
  return st;
}

}  // namespace

Schedule make_schedule(ScheduleKind kind, int64_t p, int64_t v, int64_t m, int64_t g) {
  Schedule sc;
  sc.kind = kind;
  sc.p = p;
  sc.v = kind == ScheduleKind::interleaved ? v : 1;
  sc.m = m;
  sc.g = kind == ScheduleKind::interleaved && g > 0 ? g : p;
  sc.stages.resize(static_cast<size_t>(p));
  for (int64_t s = 0; s < p; ++s) {
    auto& out = sc.stages[static_cast<size_t>(s)];
    out.reserve(static_cast<size_t>(2 * m * sc.v));
    auto F = [&](int64_t mb) { out.push_back(Step{0, static_cast<int32_t>(mb), true}); };
    auto B = [&](int64_t mb) { out.push_back(Step{0, static_cast<int32_t>(mb), false}); };
    if (kind == ScheduleKind::gpipe) {
      for (int64_t i = 0; i < m; ++i) F(i);
      for (int64_t i = 0; i < m; ++i) B(i);
    } else if (kind == ScheduleKind::one_f_one_b) {
      const int64_t warmup = std::min(p - s - 1, m);
      for (int64_t i = 0; i < warmup; ++i) F(i);
      for (int64_t i = 0; i < m - warmup; ++i) {
        F(warmup + i);
        B(i);
      }
      for (int64_t i = m - warmup; i < m; ++i) B(i);
    } else {
      const int64_t total = m * sc.v;
      const int64_t warmup = ScheduleShape{kind, p, sc.v, m, sc.g}.warmup(s);
      auto step = [&](int64_t k, bool forward) { return interleaved_step(k, sc.v, m, sc.g, forward); };
      for (int64_t k = 0; k < warmup; ++k) out.push_back(step(k, true));
      for (int64_t i = 0; i < total - warmup; ++i) {
        out.push_back(step(warmup + i, true));
        out.push_back(step(i, false));
      }
      for (int64_t k = total - warmup; k < total; ++k) out.push_back(step(k, false));
    }
  }
  return sc;
}

int64_t ScheduleShape::warmup(int64_t s) const {
  if (kind == ScheduleKind::gpipe) return m;
  if (kind == ScheduleKind::one_f_one_b) return std::min(p - s - 1, m);
  const int64_t total = m * v;
  return m == p ? total : std::min((p - s - 1) * 2 + (v - 1) * group(), total);
}

int64_t ScheduleShape::mb_of(int64_t index) const {
  return kind == ScheduleKind::interleaved ? interleaved_step(index, v, m, group(), true).mb : index;
}

int32_t ScheduleShape::chunk_of(int64_t index, bool forward) const {
  if (kind != ScheduleKind::interleaved) return 0;
  if (group() != p || m % p != 0) return interleaved_step(index, v, m, group(), forward).chunk;
  const int64_t c = (index % (p * v)) / p;  // every group full (the walks' hot path)
  return static_cast<int32_t>(forward ? c : v - 1 - c);
}

StepAt ScheduleShape::at(int64_t, int64_t k, int64_t w) const {
  const int64_t total = m * v;
  int64_t index = 0;
  bool forward = true;
  if (k < w) {
    index = k;
  } else if (k < 2 * total - w) {
    const int64_t j = k - w;
    forward = j % 2 == 0;
    index = forward ? w + j / 2 : j / 2;
  } else {
    forward = false;
    index = k - total;  // the cool-down: backward total - w + (k - (2 total - w))
  }
  return StepAt{index, chunk_of(index, forward), forward};
}

double walk_steps(ScheduleKind kind, int64_t p, int64_t v, int64_t m) {
  const double pd = static_cast<double>(p), md = static_cast<double>(m);
  if (kind == ScheduleKind::interleaved) return 2.0 * pd * static_cast<double>(v) * md;
  return 2.0 * pd * std::min(md, 10.0 * pd + 24.0);
}

std::vector<int64_t> peak_in_flight_of_chunk(const Schedule& sc, int32_t chunk) {
  std::vector<int64_t> peak(static_cast<size_t>(sc.p), 0);
  for (size_t s = 0; s < sc.stages.size(); ++s) {
    int64_t live = 0;
    for (const Step& st : sc.stages[s]) {
      if (chunk >= 0 && st.chunk != chunk) continue;
      live += st.forward ? 1 : -1;
      peak[s] = std::max(peak[s], live);
    }
  }
  return peak;
}

std::vector<int64_t> peak_in_flight(const Schedule& sc) { return peak_in_flight_of_chunk(sc, -1); }

}  // namespace strata
