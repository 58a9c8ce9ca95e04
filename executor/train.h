// `strata train`: runs a plan for real on this rank's share of the model. Sets up the
// process grid, the rank's parameter units and ZeRO shards, walks the cost model's
// pipeline schedule (costmodel/schedule.h) micro-batch by micro-batch, reduces
// gradients per unit during the backward (polled, so MPI progresses), clips, steps
// AdamW, and measures time per phase and memory per category.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "costmodel/json_input.h"
#include "costmodel/model_spec.h"
#include "costmodel/plan.h"
#include "executor/backend.h"
#include "executor/comm.h"
#include "executor/fault.h"
#include "executor/op_log.h"

namespace strata {

struct StepRecord {
  int64_t step = 0;
  double loss = 0, step_time_s = 0, tokens_per_s = 0, grad_norm = 0, loss_scale = 1;
  bool skipped = false;
};

struct TrainOptions {
  int64_t steps = 10;
  std::string data = "synthetic";
  uint64_t seed = 1234;
  double lr = 1e-3, min_lr = 1e-4;
  int64_t warmup = -1;  // -1: steps / 10, at least 10 (a short run stays in warm-up)
  double weight_decay = 0.1, clip_grad = 1.0;
  double loss_scale = 65536.0;      // fp16 initial dynamic loss scale
  int64_t loss_scale_window = 1000; // good steps before the scale doubles
  std::string trace_path;
  std::string dump_params_path;     // rank 0 writes the gathered global fp32 parameters
  // Checkpoints (executor/checkpoint.h): every `checkpoint_every` steps into
  // `checkpoint_dir`, keeping the newest `keep_checkpoints`; `resume` continues from the
  // newest complete one there (from step 0 when there is none), under any plan.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  int64_t keep_checkpoints = 2;
  bool resume = false;
  // Faults: training stops (TrainingStopped) after this many steps in a row with NaN or Inf
  // in the loss or the gradients (each one skipped; fp16: counted once the halving loss
  // scale has reached its minimum of 1).
  int64_t max_bad_steps = 10;
  // The collective watchdog's timeout (Comm::start_watchdog), seconds; 0: none.
  double distributed_timeout_s = 600;
  FaultInjection fault;  // --inject-fault, for tests
  // Per-op times of the layers (executor/op_log.h; strata train --ops): each op a region on
  // the backend's clock, named as the cost model names it; TrainResult::ops.
  bool op_times = false;
  // Called on rank 0 after every step with the step's record (the CLI draws progress).
  std::function<void(const StepRecord&, int64_t steps)> on_step;
};


// Training stopped on purpose, on every rank alike (K bad steps in a row); the message says
// why and what state is kept.
struct TrainingStopped : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TrainResult {
  Plan plan;
  int world_size = 1;
  std::string backend = "cpu";  // Backend::name()
  std::vector<StepRecord> steps;
  double median_step_time_s = 0;
  // Per rank maxima over the world (the most loaded rank), bytes.
  int64_t peak_weights = 0, peak_gradients = 0, peak_optimizer = 0, peak_activations = 0, peak_comm = 0, peak_total = 0;
  // Mean per step (after the first when there are several), seconds; max over ranks.
  // Exposed time only, except dp_comm_total_s: the union of the intervals in which a
  // data-parallel collective was in flight (launch to the poll that saw it done).
  double forward_s = 0, backward_s = 0, recompute_s = 0, optimizer_s = 0, tp_comm_s = 0, cp_comm_s = 0, pp_comm_s = 0,
         dp_comm_s = 0,
         dp_comm_total_s = 0, pipeline_bubble_s = 0;
  // One step's data-parallel collectives run back to back with nothing to hide behind.
  double dp_comm_standalone_s = 0;
  // The part of dp_comm_s spent waiting for a replica that started the collective later
  // (a slower backward: load imbalance, not communication).
  double dp_skew_s = 0;
  // The part of tp_comm_s / cp_comm_s spent waiting for a peer of the group that entered
  // the collective later (load imbalance, a slower core), not moving data.
  double tp_skew_s = 0, cp_skew_s = 0;
  // The pipeline bubble of the rank with the largest, split by replaying each step's
  // schedule with the stages' measured busy times (Engine::bubble_split): what the
  // schedule implies at the mean time of each (chunk, direction), and what the steps'
  // variation around that mean adds; the rest (pp_skew in the JSON, with the variation) is
  // lag: slower peers, transfers, wake-ups.
  double pipeline_bubble_schedule_s = 0, pipeline_bubble_variation_s = 0;
  double replica_max_abs_diff = 0;  // parameters across data-parallel replicas after training
  double entropy_rate_nats = -1;    // the synthetic source's loss floor; -1 for files
  double model_flops_per_step = 0;  // 6*N*tokens + attention, no recompute (Megatron's)
  // The device's own accounting (CUDA backend; absent on the CPU): for each memory pool (by
  // SPEC category, then "untracked") the largest over the ranks of its peak bytes in use and
  // reserved (so their sum may mix ranks), and the device's bytes in use after training
  // (driver context, libraries and every pool's reserve: what nvidia-smi shows). Values are
  // stored as 4-byte floats whatever the training precision.
  bool has_device_memory = false;
  int64_t device_used_peak[kMemPools] = {}, device_reserved_peak[kMemPools] = {};
  int64_t device_in_use = 0, device_total = 0;
  // TrainOptions::op_times: this rank's per-op times over the steps after the first
  // (op_steps of them), each (phase, op) row's own seconds and calls summed over those steps.
  std::vector<OpLog::Row> ops;
  int64_t op_steps = 0;
};

// Throws InputError (exit 2) naming the field and the rule: world size, divisibility of
// heads, groups, ffn, vocabulary, sequence, layers, batch.
// host_memory: also refuse plans a rank cannot fit in this machine's RAM (the CPU backend;
// the CUDA backend checks the GPU's free memory instead, check_rank_fits).
void validate_train_plan(const ModelSpec& m, const Plan& p, int world_size, bool host_memory = true);
// The model rules of validate_train_plan alone: what the executor cannot train (ALiBi, a
// sliding window, rope with an odd head dim) throws InputError.
void check_trainable_model(const ModelSpec& m);
// Throws InputError when a rank of the plan cannot fit in `capacity` bytes (described by
// `where`, e.g. "this machine has 24 GB"): a rough bound, parameters, gradients and Adam
// states at 16 bytes per parameter of the rank's share, plus the first stage's activations
// (Korthikanti's values per token, hidden unit and layer, the S x S scores unless the
// attention is fused, fp32, up to pp micro-batches in flight).
void check_rank_fits(const ModelSpec& m, const Plan& p, double capacity, const std::string& where);

TrainResult train(const ModelSpec& m, const Plan& p, const TrainOptions& o, Comm& comm, Backend& be);

Json train_result_to_json(const TrainResult& r);

}  // namespace strata
