// Per-op times of what a rank runs (strata train --ops), under the cost model's op names
// (costmodel/compute.cpp: norm1, qkv, attn_proj, bias_dropout_add, fc1, gelu, round16,
// pack16, ...), so a measured layer lines up with `strata estimate --ops` op by op. An op is
// a region between two stamps of the backend's clock (Backend::mark: the host clock on the
// CPU, events on a GPU's stream, so nothing waits for them). Regions nest: an op's own time
// leaves out the regions inside it (a tensor-parallel collective inside a layer's op is a
// region of its own), and a layer's own time is what no op of it covers ("other"). The
// stamps are read once per step, after the step has synchronised the backend.
#pragma once

#include <cstdint>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#include "costmodel/compute.h"
#include "executor/backend.h"

namespace strata {

class OpLog {
 public:
  explicit OpLog(Backend* be) : be_(be) {}
  // Opens a region inside the one open (if any), in the current phase; closes the newest.
  void begin(const char* op);
  void end() noexcept;
  // "forward", "backward" or "recompute": the phase of the regions opened from now on.
  const char* phase() const { return phase_; }
  void set_phase(const char* phase) { phase_ = phase; }
  // Reads the step's stamps and adds each region's own time to its (phase, op) row, when
  // `count` (the first step, a warm-up, is read and dropped).
  void step_done(bool count);
  struct Row {
    std::string phase, op;
    bool in_layer = false;  // inside a layer's region (an op of it, or its own time "other")
    int64_t calls = 0;      // over the counted steps
    double seconds = 0;     // own time over the counted steps
  };
  const std::vector<Row>& rows() const { return rows_; }  // in the order first seen
  int64_t steps() const { return steps_; }

 private:
  struct Region {
    const char* phase;
    const char* op;
    int64_t begin = 0, end = -1;
    int parent = -1;
  };
  Backend* be_;
  const char* phase_ = "forward";
  std::vector<Region> regions_;
  std::vector<int> open_;
  std::vector<Row> rows_;
  int64_t steps_ = 0;
  std::exception_ptr failed_;  // a stamp that failed in end(), thrown by step_done
};

// The region of one op for the scope's life; nothing when the context keeps no log (or
// the op is null: a region only some plans have).
class OpScope {
 public:
  OpScope(OpLog* log, const char* op) : log_(op ? log : nullptr) {
    if (log_) log_->begin(op);
  }
  ~OpScope() {
    if (log_) log_->end();
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  OpLog* log_;
};

// The phase of the regions opened in the scope's life (a recompute inside a backward).
class OpPhase {
 public:
  OpPhase(OpLog* log, const char* phase) : log_(log), before_(log ? log->phase() : nullptr) {
    if (log_) log_->set_phase(phase);
  }
  ~OpPhase() {
    if (log_) log_->set_phase(before_);
  }
  OpPhase(const OpPhase&) = delete;
  OpPhase& operator=(const OpPhase&) = delete;

 private:
  OpLog* log_;
  const char* before_;
};

// The executor's name for a cost-model op: the same, but the unfused attention core, which
// the executor runs as one backend call and the cost model as its products and softmax
// (attn_scores, softmax, attn_dropout, attn_context), is "core_attention" on both sides.
std::string executor_op_name(const std::string& model_op);

// One row of `strata train --ops`: a (phase, op) of the layers per layer and micro-batch
// (its own seconds over the layer runs of its phase, counted by the "other" rows; a
// recompute inside the backward, selective recompute's, over the backward's), or of what
// runs outside the layers (the embedding, the output layer, their collectives) per
// micro-batch (over the micro-batches of the counted steps).
// predicted_s: the cost model's ops of the same phase summed (compute ops and tensor- or
// context-parallel collectives, before overlap): in a layer, its layer ops under that
// executor_op_name; outside, the embedding's compute ops for "embedding", the output
// layer's (final norm, logits, loss) for "output_layer", and the collectives of those of
// the two that rank 0 ran for "tp_comm" / "cp_comm". NaN where it has none or none was given.
struct OpRow {
  std::string phase, op;
  bool in_layer = false;
  double measured_s = 0;
  double predicted_s = std::numeric_limits<double>::quiet_NaN();
};
// The cost model's ops for a table (EstimateDetail's, per micro-batch): one layer's, the
// embedding's and the output layer's.
struct OpPredictions {
  const std::vector<OpCost>* layer = nullptr;
  const std::vector<OpCost>* embedding = nullptr;
  const std::vector<OpCost>* head = nullptr;
};
// micro_batches: those the counted steps ran (steps x micro-batches per step).
std::vector<OpRow> op_table(const std::vector<OpLog::Row>& rows, int64_t micro_batches,
                            const OpPredictions* predicted);
// The table as strata train --ops prints it.
std::string format_op_table(const std::vector<OpRow>& table, int64_t steps, bool with_predicted);

// Regions the executor opens that are no op of a layer: a layer's own time and the
// collectives (whose times the tp_comm / cp_comm terms report).
inline constexpr const char* kLayerRegion = "layer";
inline constexpr const char* kOtherOp = "other";

}  // namespace strata
