#include "executor/op_log.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>

namespace strata {

void OpLog::begin(const char* op) {
  Region r;
  r.phase = phase_;
  r.op = op;
  r.parent = open_.empty() ? -1 : open_.back();
  r.begin = be_->mark();
  regions_.push_back(r);
  open_.push_back(static_cast<int>(regions_.size()) - 1);
}

// Called from OpScope's destructor: never throws. A stamp that fails (a GPU's error
// surfacing at the event record) closes the region empty, and step_done throws it.
void OpLog::end() noexcept {
  if (open_.empty()) return;
  Region& r = regions_[static_cast<size_t>(open_.back())];
  open_.pop_back();
  try {
    r.end = be_->mark();
  } catch (...) {
    r.end = r.begin;
    if (!failed_) failed_ = std::current_exception();
  }
}

void OpLog::step_done(bool count) {
  if (failed_) std::rethrow_exception(std::exchange(failed_, nullptr));
  if (!open_.empty()) throw std::logic_error("OpLog::step_done with a region still open");
  std::vector<double> own(regions_.size(), 0.0);
  for (size_t i = 0; i < regions_.size(); ++i) {
    const Region& r = regions_[i];
    const double d = be_->mark_seconds(r.end) - be_->mark_seconds(r.begin);
    own[i] += d;
    if (r.parent >= 0) own[static_cast<size_t>(r.parent)] -= d;
  }
  if (count) {
    ++steps_;
    std::vector<char> in_layer(regions_.size(), 0);  // (parents come before their regions)
    for (size_t i = 0; i < regions_.size(); ++i) {
      const Region& r = regions_[i];
      const bool layer = std::strcmp(r.op, kLayerRegion) == 0;
      in_layer[i] = layer || (r.parent >= 0 && in_layer[static_cast<size_t>(r.parent)]);
      // A layer's own time is what none of its ops covers.
      const char* op = layer ? kOtherOp : r.op;
      Row* row = nullptr;
      for (Row& x : rows_)
        if (x.phase == r.phase && x.op == op && x.in_layer == (in_layer[i] != 0)) row = &x;
      if (!row) {
        rows_.push_back(Row{r.phase, op, in_layer[i] != 0, 0, 0.0});
        row = &rows_.back();
      }
      row->calls += 1;
      row->seconds += own[i];
    }
  }
  regions_.clear();
  be_->reset_marks();
}

std::string executor_op_name(const std::string& model_op) {
  for (const char* core : {"attn_scores", "softmax", "attn_dropout", "attn_context"})
    if (model_op == core) return "core_attention";
  return model_op;
}

namespace {
// The row of the table an op of the cost model falls in: a collective in its term's, a
// 16-bit rounding pass in round16's (the executor times it apart, in its own region),
// any other op in its executor name's (within a layer) or in `region`'s (outside).
std::string row_of(const OpCost& c, const char* region) {
  if (c.kind == OpKind::tp_comm) return "tp_comm";
  if (c.kind == OpKind::cp_comm) return "cp_comm";
  if (c.kind != OpKind::gemm && c.kind != OpKind::memory) return "";
  if (c.name == "round16") return c.name;
  return region ? std::string(region) : executor_op_name(c.name);
}
}  // namespace

std::vector<OpRow> op_table(const std::vector<OpLog::Row>& rows, int64_t micro_batches,
                            const OpPredictions* predicted) {
  // Outside the layers, the embedding's and the output layer's ops count where rank 0 ran
  // them (its table has their rows).
  auto ran = [&](const char* op) {
    return std::any_of(rows.begin(), rows.end(), [&](const OpLog::Row& r) { return !r.in_layer && r.op == op; });
  };
  const bool ran_embedding = ran("embedding"), ran_head = ran("output_layer");
  auto layer_runs = [&](const std::string& phase) {
    int64_t n = 0;
    for (const OpLog::Row& r : rows)
      if (r.in_layer && r.op == kOtherOp && r.phase == phase) n += r.calls;
    return n;
  };
  const int64_t backward_runs = layer_runs("backward");
  std::vector<OpRow> out;
  for (const OpLog::Row& r : rows) {
    OpRow o;
    o.phase = r.phase;
    o.op = r.op;
    o.in_layer = r.in_layer;
    int64_t runs = r.in_layer ? layer_runs(r.phase) : 0;
    if (r.in_layer && runs == 0) runs = backward_runs;  // selective recompute, inside the backward
    if (!r.in_layer) runs = micro_batches;
    o.measured_s = runs > 0 ? r.seconds / static_cast<double>(runs) : std::numeric_limits<double>::quiet_NaN();
    if (predicted) {
      double sum = 0;
      bool any = false;
      auto add = [&](const std::vector<OpCost>* ops, const char* region) {
        if (!ops) return;
        for (const OpCost& c : *ops) {
          if (to_string(c.phase) != r.phase || row_of(c, region) != r.op) continue;
          sum += c.time_s;
          any = true;
        }
      };
      if (r.in_layer) {
        add(predicted->layer, nullptr);
      } else {
        if (ran_embedding) add(predicted->embedding, "embedding");
        if (ran_head) add(predicted->head, "output_layer");
      }
      if (any) o.predicted_s = sum;
    }
    out.push_back(o);
  }
  return out;
}

std::string format_op_table(const std::vector<OpRow>& table, int64_t steps, bool with_predicted) {
  std::string s = fmt::format(
      "per-op times on rank 0, mean of {} step(s) after the first: one layer and one micro-batch, by the cost model's "
      "op names{}\n  {:<10} {:<18} {:>12} {:>13} {:>8}\n",
      steps, with_predicted ? " (predicted: --cluster)" : "", "phase", "op", "measured_ms", "predicted_ms", "error");
  auto row = [&](const OpRow& r) {
    const bool p = std::isfinite(r.predicted_s);
    const std::string pred = p ? fmt::format("{:13.4f}", r.predicted_s * 1e3) : fmt::format("{:>13}", "-");
    const std::string err = p && r.measured_s > 0 ? fmt::format("{:+7.1f}%", 100.0 * (r.predicted_s - r.measured_s) / r.measured_s)
                                                  : fmt::format("{:>8}", "");
    s += fmt::format("  {:<10} {:<18} {:12.4f} {} {}\n", r.phase, r.op, r.measured_s * 1e3, pred, err);
  };
  for (const char* phase : {"forward", "backward", "recompute"}) {
    double m = 0, pr = 0;
    bool any = false;
    for (const OpRow& r : table)
      if (r.in_layer && r.phase == phase) {
        row(r);
        m += r.measured_s;
        if (std::isfinite(r.predicted_s)) pr += r.predicted_s;
        any = true;
      }
    if (any)
      s += fmt::format("  {:<10} {:<18} {:12.4f} {}\n", phase, "layer total", m * 1e3,
                       with_predicted ? fmt::format("{:13.4f}", pr * 1e3) : fmt::format("{:>13}", "-"));
  }
  bool header = false;
  for (const OpRow& r : table) {
    if (r.in_layer) continue;
    if (!header) s += "outside the layers, per micro-batch:\n";
    header = true;
    row(r);
  }
  return s;
}

}  // namespace strata
