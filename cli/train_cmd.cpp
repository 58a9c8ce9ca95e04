// `strata train`: loads the model and plan, checks them on every rank (a failure on any
// rank makes every rank print an error and exit 2, so nothing hangs), runs the executor
// and writes the SPEC training JSON (rank 0).
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>

#include <fmt/format.h>

#include "cli/args.h"
#include "cli/progress.h"
#include "cli/commands.h"
#include "costmodel/estimate.h"
#include "costmodel/json_input.h"
#include "costmodel/stack.h"
#include "executor/checkpoint.h"
#include "executor/data.h"
#include "executor/param_layout.h"
#include "executor/cuda/cuda_backend.h"
#include "executor/train.h"

namespace strata {

int cmd_train(const std::vector<std::string>& argv) {
  int initialised = 0;
  // Serialized: the communicator's progress thread tests the requests in flight while this
  // thread computes, each MPI call under the communicator's mutex (executor/cpu/mpi_comm.cpp);
  // the collective watchdog thread never calls MPI.
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &initialised);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  ModelSpec m;
  Plan plan;
  TrainOptions o;
  std::string json_path, error, backend = "cpu", comm_choice = "auto";
  std::optional<Cluster> op_cluster;  // --ops --cluster C: the cost model's op times beside the measured
  try {
    const Args a(argv, "train",
                 {"model", "plan", "steps", "backend", "data", "seed", "json", "trace", "lr", "min-lr", "lr-warmup-iters",
                  "weight-decay", "clip-grad", "loss-scale", "loss-scale-window", "dump-params", "seq-length",
                  "checkpoint-dir", "checkpoint-every", "keep-checkpoints", "inject-fault", "max-bad-steps",
                  "distributed-timeout-minutes", "comm", "cluster"},
                 {"quiet", "resume", "ops"});
    m = load_model(a.required("model", "a preset, model JSON or config.json"), a.integer("seq-length", 0, 0, 1 << 20));
    plan = load_plan(a.required("plan", "a plan JSON or inline pairs tp=2,dp=2,..."));
    o.steps = a.integer("steps", 10, 1, 100000000);
    backend = a.get("backend", "cpu");
    check_backend(backend, "train");
    comm_choice = a.get("comm", "auto");
    check_comm_choice(comm_choice, backend);
    o.data = a.get("data", "synthetic");
    o.seed = static_cast<uint64_t>(a.integer("seed", 1234, 0, INT64_MAX));
    auto real = [&](const char* flag, double fallback, double lo, double hi) {
      if (!a.has(flag)) return fallback;
      const std::string s = a.get(flag);
      size_t used = 0;
      double x = 0;
      try {
        x = std::stod(s, &used);
      } catch (...) {
        used = 0;
      }
      if (used != s.size() || !(x >= lo && x <= hi))
        throw InputError(fmt::format("--{}: '{}' must be a number in [{}, {}]", flag, s, lo, hi));
      return x;
    };
    o.lr = real("lr", o.lr, 0.0, 10.0);
    o.min_lr = real("min-lr", std::min(o.min_lr, o.lr), 0.0, o.lr);
    o.warmup = a.integer("lr-warmup-iters", -1, -1, 100000000);
    o.weight_decay = real("weight-decay", o.weight_decay, 0.0, 10.0);
    o.clip_grad = real("clip-grad", o.clip_grad, 0.0, 1e9);
    o.loss_scale = real("loss-scale", o.loss_scale, 1.0, 1e30);
    o.loss_scale_window = a.integer("loss-scale-window", o.loss_scale_window, 1, 100000000);
    o.trace_path = a.get("trace");
    o.dump_params_path = a.get("dump-params");
    o.checkpoint_dir = a.get("checkpoint-dir");
    o.checkpoint_every = a.integer("checkpoint-every", 0, 1, 100000000);
    o.keep_checkpoints = a.integer("keep-checkpoints", 2, 1, 1000000);
    o.resume = a.has("resume");
    o.op_times = a.has("ops");
    if (a.has("cluster")) {
      if (!o.op_times) throw InputError("--cluster: '" + a.get("cluster") + "' is for --ops (the predicted op times); pass --ops");
      op_cluster = load_cluster(a.get("cluster"));
      // Checked here, on every rank, not after the run: a plan the cost model cannot cost there.
      const Estimate e = estimate(model_on_stack(m, *op_cluster), *op_cluster, plan);
      if (!e.valid) {
        std::string why;
        for (const auto& r : e.reasons) why += (why.empty() ? "" : "; ") + r.message;
        throw InputError("--cluster: '" + a.get("cluster") + "': the cost model cannot cost this plan there (" + why +
                         "), so it has no op times to predict");
      }
    }
    o.max_bad_steps = a.integer("max-bad-steps", o.max_bad_steps, 1, 1000000000);
    // Megatron's name; fractions allowed (0.1 = 6 s, for tests); 0 turns the watchdog off.
    o.distributed_timeout_s = 60.0 * real("distributed-timeout-minutes", o.distributed_timeout_s / 60.0, 0.0, 1e6);
    // (Below a second a healthy step's collectives outlast it: the watchdog would stop the run.)
    if (o.distributed_timeout_s > 0 && o.distributed_timeout_s < 1.0)
      fail_field("--distributed-timeout-minutes", a.get("distributed-timeout-minutes"),
                 "must be 0 (no watchdog) or at least 1/60 (one second)");
    if (a.has("inject-fault")) {
      o.fault = parse_fault(a.get("inject-fault"), size);
      // A fault after the last step would never fire: the run would pass without the test.
      if (o.fault.first > o.steps)
        throw InputError(fmt::format("--inject-fault: '{}': step {} is after the last step, {} (--steps)",
                                     a.get("inject-fault"), o.fault.first, o.steps));
    }
    if (o.fault.kind == FaultInjection::Kind::kill_in_checkpoint &&
        (o.checkpoint_every == 0 || o.fault.first % o.checkpoint_every != 0))
      throw InputError("--inject-fault: kill-in-checkpoint at step " + std::to_string(o.fault.first) +
                       " needs a checkpoint written at that step (--checkpoint-dir D --checkpoint-every N with N dividing it)");
    if ((o.checkpoint_every > 0 || o.resume || a.has("keep-checkpoints")) && o.checkpoint_dir.empty())
      throw InputError(std::string(o.resume ? "--resume" : o.checkpoint_every > 0 ? "--checkpoint-every" : "--keep-checkpoints") +
                       " needs --checkpoint-dir D");
    // The checkpoint folder and the output files are checked now, on every rank, not when
    // the first checkpoint or the end of the run writes them.
    check_output_folder("--checkpoint-dir", o.checkpoint_dir, /*written=*/o.checkpoint_every > 0);
    // A new run must not mix its checkpoints with another run's (keep-K would prune by step
    // across both, and a later --resume would pick the other run's newest).
    if (o.checkpoint_every > 0 && !o.resume && !checkpoints_in(o.checkpoint_dir).empty())
      throw InputError("--checkpoint-dir: '" + o.checkpoint_dir +
                       "' already holds checkpoints; pass --resume to continue that run, or use an empty folder");
    if (!a.has("quiet")) {
      auto bar = std::make_shared<Progress>("train", o.steps);
      o.on_step = [bar](const StepRecord& r, int64_t steps) {
        bar->update(r.step,
                    fmt::format("step {}/{}  loss {:.5f}  {:.3f} s  {:.0f} tokens/s  grad norm {:.3f}{}", r.step, steps,
                                r.loss, r.step_time_s, r.tokens_per_s, r.grad_norm,
                                r.skipped ? "  (skipped: non-finite gradients)" : ""));
        if (r.step == steps) bar->finish();
      };
    }
    json_path = a.get("json");
    if (rank == 0) {  // the rank that writes them (on another node the folder may not exist)
      check_output_file("--json", json_path);
      check_output_file("--trace", o.trace_path);
      check_output_file("--dump-params", o.dump_params_path);
      check_distinct_outputs({{"--json", json_path}, {"--trace", o.trace_path}, {"--dump-params", o.dump_params_path}});
    }
    validate_train_plan(m, plan, size, backend != "cuda");
    if (backend == "cuda") {  // the CUDA kernels' limits (executor/cuda/limits.h)
      if (plan.attention == AttentionChoice::flash && m.D() > cuda::kFlashMaxHeadDim)
        throw InputError("plan: attention flash with head dim " + std::to_string(m.D()) +
                         ": the CUDA backend's fused attention takes head dims up to " +
                         std::to_string(cuda::kFlashMaxHeadDim));
      if (plan.attention != AttentionChoice::flash && m.S > cuda::kUnfusedAttentionMaxSeq)
        throw InputError("plan: attention " + std::string(plan.attention == AttentionChoice::unfused ? "unfused" : "auto") +
                         " with seq_length " + std::to_string(m.S) +
                         ": the CUDA backend's unfused attention keeps S x S score matrices and needs "
                         "seq_length <= " + std::to_string(cuda::kUnfusedAttentionMaxSeq) + "; use attention: flash");
    }
    TokenSource check(o.data, m.V, m.S, o.seed);  // a missing or bad token file fails here
    // A checkpoint of another run (model, seed, data) or past --steps fails here too, on
    // every rank, before any rank loads it.
    if (o.resume) {
      const std::string newest = newest_checkpoint(o.checkpoint_dir);
      if (!newest.empty())
        check_resume_meta(read_checkpoint_meta(newest), newest, m.name, global_param_layout(m).size, o.seed, o.data,
                          o.steps);
    }
  } catch (const InputError& e) {
    error = e.what();
  }
  if (any_rank_rejected_input(error, "train", &argv)) return 2;
  try {
    std::unique_ptr<Backend> be;  // declared first, destroyed last: the communicator may use it
    std::unique_ptr<Comm> comm;
    if (backend == "cuda") {
      // Buffers in device memory; between ranks NCCL when each has its own GPU, else the
      // host-staged communicator (ranks may share one GPU, which NCCL refuses). GEMM
      // operands are rounded to the training precision already: run them on the tensor cores.
      // The device: this process's rank among those of its machine, modulo its GPUs.
      std::unique_ptr<CudaBackend> cuda = make_cuda_backend(node_local_rank());
      if (!cuda) throw InputError("--backend cuda: " + cuda_unavailable_reason());
      // Every rank that shares this GPU needs room: the ranks of the world on the same
      // machine and device (by PCI bus id, whatever CUDA_VISIBLE_DEVICES each was given).
      const int sharing = ranks_sharing(cuda->device_id());
      Backend::DeviceMemory dm;
      if (cuda->device_memory(&dm))
        check_rank_fits(m, plan, static_cast<double>(dm.free) / sharing,
                        "the GPU (" + cuda->device_name() + ") has " + std::to_string(dm.free / 1000000000) +
                            " GB free" + (sharing > 1 ? ", shared by " + std::to_string(sharing) + " ranks" : ""));
      cuda->set_gemm_precision(plan.precision == Precision::fp16 ? Precision::fp16
                               : plan.precision == Precision::fp32 ? Precision::fp32
                                                                   : Precision::bf16);
      comm = make_gpu_comm(*cuda, comm_choice, sharing);
      be = std::move(cuda);
    } else {
      comm = make_mpi_comm();
      be = make_cpu_backend();
    }
    const TrainResult r = train(m, plan, o, *comm, *be);
    if (rank == 0) {
      Json j = train_result_to_json(r);
      std::vector<OpRow> op_rows;
      if (o.op_times) {  // rank 0's per-op times, and the cost model's for the same plan
        EstimateDetail d;
        bool predicted = false;
        if (op_cluster) {
          EstimateOptions eo;
          eo.want_ops = true;
          predicted = estimate(model_on_stack(m, *op_cluster), *op_cluster, plan, eo, &d).valid;
          if (!predicted) fmt::print(stderr, "strata: the plan is not valid on --cluster {}: no predicted op times\n",
                                     op_cluster->name);
        }
        const OpPredictions pred{&d.layer_ops, &d.embedding_ops, &d.head_ops};
        op_rows = op_table(r.ops, r.op_steps * plan.microbatches(), predicted ? &pred : nullptr);
        Json rows = Json::array();
        for (const OpRow& x : op_rows)
          rows.push_back({{"phase", x.phase}, {"op", x.op}, {"per", x.in_layer ? "layer" : "micro_batch"},
                          {"measured_s", x.measured_s},
                          {"predicted_s", std::isfinite(x.predicted_s) ? Json(x.predicted_s) : Json(nullptr)}});
        j["ops"] = {{"rank", 0}, {"steps", r.op_steps}, {"rows", rows}};
      }
      if (json_path == "-") {
        std::cout << j.dump(2) << "\n";
      } else if (!json_path.empty()) {
        std::ofstream f(json_path);
        f << j.dump(2) << "\n";
        if (!f) throw InputError("--json: cannot write '" + json_path + "'");
      }
      if (json_path != "-" && r.steps.empty()) {
        fmt::print("nothing to train: the checkpoint is at step {} already\n", o.steps);
      } else if (json_path != "-") {
        fmt::print("trained {} steps of {} with {} on {} rank(s): loss {:.4f} -> {:.4f}", r.steps.size(), m.name,
                   plan_to_inline(plan), r.world_size, r.steps.front().loss, r.steps.back().loss);
        if (r.entropy_rate_nats >= 0) fmt::print(" (source entropy rate {:.4f} nats)", r.entropy_rate_nats);
        fmt::print(", median step {:.4f} s\n", r.median_step_time_s);
        if (o.op_times) fmt::print("\n{}", format_op_table(op_rows, r.op_steps, op_cluster.has_value()));
      }
    }
  } catch (const InputError& e) {
    fmt::print(stderr, "strata: error: rank {} of {}: {}\n", rank, size, e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
    return 2;
  } catch (const TrainingStopped& e) {  // every rank stops alike: no abort needed
    if (rank == 0) fmt::print(stderr, "strata: error: {}\n", e.what());
    MPI_Finalize();
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "strata: internal error: rank {} of {}: {}\n", rank, size, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
  MPI_Finalize();
  return 0;
}

}  // namespace strata
