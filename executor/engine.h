// The training engine of one rank, shared by its three files: train.cpp (set-up, the
// step loop, measurements, output), pipeline.cpp (the schedule walk: forward and
// backward of each (chunk, micro-batch), sends and receives) and data_parallel.cpp
// (gradient reductions, ZeRO shards and gathers, the optimizer step). Internal to the
// executor; train.h is the interface.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "costmodel/schedule.h"
#include "executor/data.h"
#include "executor/gpt.h"
#include "executor/memory_tracker.h"
#include "executor/param_layout.h"
#include "executor/process_grid.h"
#include "executor/train.h"
#include "executor/zero.h"

namespace strata {

struct TraceEvent {
  std::string name;
  int tid = 0;  // 0 compute, 1 communication
  double ts = 0, dur = 0;
  int64_t mb = -1, chunk = -1, layer = -1;  // -1: not one (the args leave it out)
  const char* op = nullptr;                 // a collective's kind (static strings)
};

struct Pending {  // a data-parallel reduction or a send in flight
  Request req;
  double start = 0;
  int64_t idx = -1;  // a data-parallel collective: its index in dp_waits_ (CommWaits::launched)
  Buf keep;  // a send's buffer or a reduction's input, alive until it completes
  // ZeRO-2/3: a micro-batch's reduce-scattered block, added into `into` (n floats) once
  // complete, in the order the reductions were started (so sums are deterministic).
  Buf block;  // in the backend's memory, not charged (the cost model has no term for it)
  float* into = nullptr;
  bool added = false;
};

struct MicroState {
  std::vector<LayerActs> layers;
  HeadActs head;
  std::vector<int32_t> tokens, targets;  // (B, S)
};

class Engine {
 public:
  Engine(const ModelSpec& m, const Plan& p, const TrainOptions& o, Comm& comm, Backend& be);

  TrainResult run();

 private:
  const TensorSlot& tensor_of(size_t u) const {
    for (const TensorSlot& s : lay_.tensors)
      if (s.offset == lay_.units[u].begin) return s;
    return lay_.tensors.front();
  }
  // The working weights (and ZeRO-3's gathered units) are floats holding values rounded to
  // the training precision: charged at the 4 bytes each they take (the cost model's strata
  // stack books them so too).
  static constexpr int kWeightBytes = 4;
  bool mixed() const { return plan_.precision != Precision::fp32; }

  void allocate();
  const float* weights(int u);
  float* grads(int u);
  void release_weights(int u);
  void prefetch(int u);
  void prefetch_head();       // the final norm and output-layer units (ZeRO-3)
  void prefetch_embedding();  // the word and position embedding units (ZeRO-3)
  void unit_done(int u);
  void mlp_done(int64_t layer);
  void poll();
  double skew_of(CommWaits* waits, const Group& g);
  // After the step's clock stopped: how much of this stage's pipeline bubble the schedule
  // implies at the step's own compute (bubble_split in pipeline.cpp).
  void bubble_split();
  void add_completed_blocks();
  void idle() {  // waiting for a peer: progress MPI, and give the core away (Comm::pause)
    poll();
    comm_.pause();
  }
  // Waits for a pipeline receive while progressing the rest; timed by the watchdog.
  void wait_polling(Request& r) {
    comm_.begin_wait(r);
    while (!comm_.test(r)) idle();
    comm_.end_wait();
  }
  void wait_pending(std::vector<Pending>* list, double* exposed);
  ModelCtx ctx();
  UnitView view(int u) { return UnitView{&lay_, lay_.units[static_cast<size_t>(u)].begin, weights(u), grads(u)}; }
  // The forward reads weights only (no ZeRO-2/3 gradient buffer is created for it).
  UnitView weights_view(int u) {
    return UnitView{&lay_, lay_.units[static_cast<size_t>(u)].begin, weights(u), nullptr};
  }
  double run_step(int64_t k, StepRecord* rec);
  void forward_step(int64_t k, const Step& st, double* loss_sum);
  void backward_step(const Step& st);
  void finish_gradients();
  void optimizer_step(StepRecord* rec);
  float* master_block(size_t u);
  std::vector<float> full_fp32_params();
  // The rank's full units of an owned-block array (gathered over ZeRO shards).
  std::vector<float> full_of(const std::function<const float*(size_t)>& block);
  // Local flat index -> index in the single-rank (global) layout.
  std::vector<int64_t> global_index() const;
  void save_checkpoint(int64_t step);  // checkpointing.cpp
  void load_checkpoint(const std::string& path);
  int64_t start_step_ = 0;
  std::vector<float> global_params(const std::vector<float>& full);
  // The executor's clock (ModelCtx::now): the backend's queued work is done first.
  double now() {
    be_.synchronise();
    return comm_.wtime();
  }
  bool tracing() const { return !o_.trace_path.empty(); }
  void event(const std::string& name, int tid, double t0, double t1, int64_t mb = -1, int64_t chunk = -1,
             int64_t layer = -1, const char* op = nullptr) {
    if (tracing()) trace_.push_back({name, tid, t0 - t_origin_, t1 - t0, mb, chunk, layer, op});
  }
  // What the forward or backward step running now is at, for the collectives' trace slices.
  int64_t trace_mb_ = -1, trace_chunk_ = -1, trace_layer_ = -1;

  const ModelSpec& m_;
  Plan plan_;
  TrainOptions o_;
  Comm& comm_;
  Backend& be_;
  TokenSource data_;
  ProcessGrid grid_;
  Coords me_;
  // dp_ is the group the gradients are reduced over and ZeRO shards across: the data-parallel
  // ranks, times the context-parallel ones when cp > 1 (each holds the same parameters).
  Group tp_, dp_, cp_, pp_, emb_, world_;
  int64_t replicas_ = 1;  // dp * cp
  int64_t mb_count_ = 1;
  Schedule schedule_;
  std::vector<std::vector<int64_t>> chunk_layers_;  // (v) global layers of each chunk here
  ParamLayout lay_;
  int zero_ = 0;
  Sharding sh_;
  std::map<int64_t, int> layer_unit_;
  int wte_unit_ = -1, wpe_unit_ = -1, final_unit_ = -1, tied_copy_unit_ = -1, head_w_unit_ = -1;
  MemoryTracker mem_;
  Buf work_;        // (full) working weights, zero < 3
  Buf work_shard_;  // (shard) working weights, zero 3
  Buf master_;      // (shard) fp32 master weights, mixed precision
  Buf adam_m_, adam_v_;
  Buf grad_full_;   // (full) zero < 2
  Buf grad_shard_;  // (shard) zero >= 1
  // Per owned element, bits (zero.h's FlagBits) in the backend's memory: AdamW's weight
  // decay; counted in the global gradient norm.
  ByteBuf decay_mask_, counted_mask_;
  std::unique_ptr<OpLog> ops_;  // strata train --ops: per-op times (TrainOptions::op_times)
  std::map<int, Buf> gathered_;           // zero 3: resident units
  struct Prefetch {
    Request req;
    int64_t idx = -1;
  };
  std::map<int, Prefetch> prefetching_;
  std::map<int, Buf> grad_tmp_;           // zero >= 2: a unit's gradient of one micro-batch
  std::vector<int64_t> done_count_;
  std::vector<int64_t> early_split_;  // (units) reduced early from this offset on; 0 = not
  std::vector<Pending> dp_pending_, sends_;
  std::map<std::pair<int64_t, int64_t>, MicroState> micro_;
  double loss_scale_ = 1.0;
  int64_t adam_step_ = 0;  // updates applied (skipped fp16 steps do not count)
  int64_t good_steps_ = 0;
  int64_t bad_in_row_ = 0;  // steps in a row skipped for NaN/Inf
  // Per-step phase seconds.
  double dp_skew_s_ = 0;
  // This step's tensor-, context- and data-parallel collectives (gpt.h), and the part of
  // their waits spent before the last member of the group started them (skew_of).
  CommWaits tp_waits_, cp_waits_, dp_waits_;
  double tp_skew_s_ = 0, cp_skew_s_ = 0;
  // Each step of this stage's list in the last step: its wall time less the receive it
  // waited for; and the split of the bubble bubble_split() derives from every stage's.
  std::vector<double> step_busy_;
  double bubble_schedule_s_ = 0, bubble_variation_s_ = 0;
  double step_start_ = 0;
  double forward_s_ = 0, backward_s_ = 0, recompute_s_ = 0, optimizer_s_ = 0, tp_s_ = 0, cp_s_ = 0, pp_s_ = 0, dp_s_ = 0,
         dp_total_s_ = 0, bubble_s_ = 0;
  std::vector<std::pair<double, double>> dp_intervals_;
  double t_origin_ = 0;
  std::vector<TraceEvent> trace_;
};

}  // namespace strata
