// The training engine of one rank. Order of a step:
//   1. walk this stage's list of the schedule (forward / backward of (chunk, micro-batch)),
//      receiving and sending activations and their gradients to the neighbouring stages;
//   2. as a unit's last backward of the step ends, start its data-parallel reduction
//      (all-reduce, or reduce-scatter with ZeRO 1; ZeRO 2 and 3 reduce-scatter after every
//      micro-batch) and poll it while the backward goes on;
//   3. finish the reductions; sum tied-embedding gradients of the first and last stage and,
//      with sequence parallelism, the partial gradients of replicated tensors over tp;
//   4. unscale (fp16), skip on overflow, clip by the global norm, AdamW on the owned shard,
//      round into the working weights and all-gather them (ZeRO 1, 2).
#include "executor/train.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <map>
#include <numeric>
#include <sstream>
#include <thread>

#include <malloc.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "costmodel/layout.h"
#include "executor/checkpoint.h"
#include "executor/engine.h"

namespace strata {

void check_trainable_model(const ModelSpec& m) {
  auto fail = [](const std::string& msg) { throw InputError(msg); };
  if (m.position == Position::rope && m.D() % 2 != 0) fail("model: rope needs an even head dim, got " + std::to_string(m.D()));
  // Trained without its linear biases an ALiBi model would silently be a model without
  // positions.
  if (m.position == Position::alibi)
    fail("model: position_embedding alibi is not implemented by the executor (learned, rope and none are)");
  if (m.moe())
    fail("model: num_experts " + std::to_string(m.E) +
         " (mixture of experts) is not implemented by the executor: it trains dense MLPs (strata estimate and plan "
         "model the experts on a GPU cluster)");
  if (m.mla())
    fail("model: kv_lora_rank " + std::to_string(m.kv_lora_rank) +
         " (multi-latent attention) is not implemented by the executor (strata estimate and plan model it)");
  if (m.mtp_layers > 0)
    fail("model: mtp_num_layers " + std::to_string(m.mtp_layers) +
         " (multi-token prediction) is not implemented by the executor (strata estimate and plan model it; give "
         "the model mtp_num_layers 0 to train without it)");
  if (m.windowed())
    fail("model: window_size " + std::to_string(m.window_size) +
         " (sliding-window attention) is not implemented by the executor: it attends to the whole causal prefix");
}

void validate_train_plan(const ModelSpec& m, const Plan& p, int world_size, bool host_memory) {
  auto fail = [](const std::string& msg) { throw InputError(msg); };
  if (p.c > 1 && p.cp_comm != CpComm::automatic && p.cp_comm != CpComm::allgather)
    fail(std::string("plan: cp_comm_type = ") + to_string(p.cp_comm) +
         " is not implemented by the executor: it gathers the keys and values (allgather; leave it auto)");
  if (p.op_sac())
    fail("plan: selective_ac_option op (torchtitan's op-level policy) is not implemented by the executor: its "
         "selective recompute is the attention core (core_attn); strata estimate and plan model it on a GPU cluster");
  if (p.recompute == Recompute::selective && p.recompute_modules != kRecomputeCoreAttn)
    fail("plan: recompute_modules " + recompute_modules_text(p.recompute_modules, " ") +
         " is not implemented by the executor: its selective recompute is the attention core (core_attn)");
  if (p.precision_aware_optimizer)
    fail("plan: use_precision_aware_optimizer is not implemented by the executor: its optimizer keeps fp32 master "
         "weights and moments (strata estimate and plan model it on a GPU cluster)");
  if (p.grad_reduce_in_fp32 == Tristate::off)
    fail("plan: grad_reduce_in_fp32 = false is not implemented by the executor: it accumulates and reduces its "
         "gradients in fp32 (strata estimate and plan model 16-bit gradients on a GPU cluster)");
  if (p.offload > 0)
    fail(fmt::format("plan: optimizer_offload_fraction = {} is not implemented by the executor: it keeps the optimizer "
                     "on its own backend (strata estimate and plan model the offload on a GPU cluster)",
                     p.offload));
  if (p.dp_instances > 1)
    fail(fmt::format("plan: num_distributed_optimizer_instances = {} is not implemented by the executor: it shards over "
                     "every replica (strata estimate and plan model hybrid sharding on a GPU cluster)",
                     p.dp_instances));
  if (p.offload_modules)
    fail("plan: offload_modules " + offload_modules_text(p.offload_modules, " ") +
         " is not implemented by the executor: it keeps its activations on its own backend (strata estimate and plan "
         "model fine-grained activation offloading on a GPU cluster)");
  if (p.world_size() != world_size)
    fail("plan: tp*pp*dp*cp = " + std::to_string(p.t) + "*" + std::to_string(p.p) + "*" + std::to_string(p.d) + "*" +
         std::to_string(p.c) + " = " + std::to_string(p.world_size()) + " ranks, but mpirun started " +
         std::to_string(world_size) + "; run with mpirun -np " + std::to_string(p.world_size()));
  auto div = [&](const char* what, int64_t n, const char* by, int64_t k) {
    if (k <= 0 || n % k != 0)
      fail(std::string("plan: ") + what + " = " + std::to_string(n) + " is not divisible by " + by + " = " +
           std::to_string(k));
  };
  div("num_attention_heads", m.A, "tensor_parallel", p.t);
  div("num_query_groups", m.G, "tensor_parallel", p.t);
  div("ffn_hidden_size", m.F, "tensor_parallel", p.t);
  div("padded vocab_size", executor_vocab(m), "tensor_parallel", p.t);
  // Context parallelism cuts each sequence into 2 cp chunks (two per rank).
  if (p.c > 1) div("seq_length", m.S, "2 * context_parallel", 2 * p.c);
  if (p.sp)
    div(p.c > 1 ? "seq_length / context_parallel * micro_batch_size" : "seq_length * micro_batch_size",
        m.S / p.c * p.mbs, "tensor_parallel (sequence parallel)", p.t);
  div("global_batch_size", p.gbs, "micro_batch_size * data_parallel", p.mbs * p.d);
  check_trainable_model(m);
  if (p.explicit_split()) {  // Megatron-LM's uneven split, as given (layout.h)
    if (const std::string why = split_problem(m.L, p); !why.empty()) fail("plan: " + why);
  } else if (p.p * p.v > m.L) {
    fail("plan: pipeline_parallel * virtual_pipeline_stages = " + std::to_string(p.p * p.v) + " exceeds num_layers " +
         std::to_string(m.L));
  }
  if (p.v > 1) {
    if (!p.explicit_split()) div("num_layers", m.L, "pipeline_parallel * virtual_pipeline_stages", p.p * p.v);
    // Fewer micro-batches than stages, or a micro-batch group Megatron-core refuses; the
    // schedule (make_schedule) takes any group it accepts.
    std::vector<Reason> why;
    interleaved_reasons(p, &why);
    if (!why.empty()) fail("plan: " + why.front().message);
  }
  if (p.precision == Precision::fp8) fail("plan: precision fp8: the CPU executor runs fp32, bf16 and fp16");
  const double ram = physical_memory_bytes();
  if (host_memory && ram > 0)
    check_rank_fits(m, p, ram,
                    "this machine has " + std::to_string(static_cast<int64_t>(ram / 1e9)) +
                        " GB (the CPU executor trains small models)");
}

void check_rank_fits(const ModelSpec& m, const Plan& p, double capacity, const std::string& where) {
  // Parameters, gradients and Adam states alone take 16 bytes per parameter of a rank's
  // share; the activations of the first stage, Korthikanti et al.'s 34 + 5 a s / h values
  // per token and hidden unit and layer (fp32 here; no S x S term with fused attention),
  // for its layers and up to pp micro-batches in flight. Refuse plans that cannot fit
  // instead of failing to allocate.
  const double states = m.total_params() / static_cast<double>(p.t * p.p) * 16.0;
  const double tokens = static_cast<double>(p.mbs) * static_cast<double>(m.S) / static_cast<double>(p.c);  // this rank's
  const double scores = p.attention == AttentionChoice::flash
                            ? 0.0
                            : 5.0 * static_cast<double>(m.A) * static_cast<double>(m.S) / static_cast<double>(m.H);
  const double acts = static_cast<double>(m.L) * tokens * static_cast<double>(m.H) * (34.0 + scores) * 2.0 /
                      static_cast<double>(p.t);
  if (states + acts > capacity)
    throw InputError("model: " + m.name + " needs about " + std::to_string(static_cast<int64_t>((states + acts) / 1e9)) +
                     " GB per rank with tp*pp = " + std::to_string(p.t * p.p) + " and micro_batch_size " +
                     std::to_string(p.mbs) + " (" + std::to_string(static_cast<int64_t>(states / 1e9)) +
                     " GB of parameters, gradients and Adam states, " + std::to_string(static_cast<int64_t>(acts / 1e9)) +
                     " GB of activations); " + where);
}

Engine::Engine(const ModelSpec& m, const Plan& p, const TrainOptions& o, Comm& comm, Backend& be)
    : m_(m), plan_(p), o_(o), comm_(comm), be_(be), data_(o.data, m.V, m.S, o.seed) {
  // Activations are allocated and freed every micro-batch. glibc maps every block above
  // its mmap threshold afresh (and trims freed heap), so each step would page-fault and
  // zero all of them again; keep freed blocks in the heap instead, as the caching
  // allocators of GPU frameworks do. The memory tracker counts live bytes either way.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mem_.set_backend(&be_);  // every Buf of the run lives in the backend's memory
  if (o.op_times) ops_ = std::make_unique<OpLog>(&be_);
  grid_.t = p.t;
  grid_.c = p.c;
  grid_.d = p.d;
  grid_.p = p.p;
  comm_.setup(grid_);
  me_ = grid_.coords(comm_.rank());
  tp_ = grid_.group(kTensor, comm_.rank());
  cp_ = grid_.group(kContext, comm_.rank());
  dp_ = grid_.group(p.c > 1 ? kReplica : kData, comm_.rank());
  replicas_ = p.d * p.c;
  if (p.c > 1 && std::string(be.name()) != "cpu")
    throw InputError(std::string("plan: context_parallel ") + std::to_string(p.c) + ": the " + be.name() +
                     " backend runs context_parallel = 1; context parallelism runs on the CPU backend");
  pp_ = grid_.group(kPipeline, comm_.rank());
  emb_ = grid_.group(kEmbedding, comm_.rank());
  world_ = grid_.group(kWorld, comm_.rank());
  mb_count_ = p.microbatches();
  schedule_ = make_schedule(p.schedule(), p.p, p.v, mb_count_, p.vp_group_size());
  const StageLayout sl = make_layout(m.L, p);
  // Layers of each chunk of this stage: virtual stage c*p + s holds the next layers.
  std::vector<int64_t> first(static_cast<size_t>(p.p * p.v) + 1, 0);
  for (int64_t vs = 0; vs < p.p * p.v; ++vs)
    first[static_cast<size_t>(vs) + 1] = first[static_cast<size_t>(vs)] + sl.layers[static_cast<size_t>(vs)];
  std::vector<int64_t> mine;
  for (int64_t c = 0; c < p.v; ++c) {
    std::vector<int64_t> ls;
    const int64_t vs = c * p.p + me_.pp;
    for (int64_t l = first[static_cast<size_t>(vs)]; l < first[static_cast<size_t>(vs) + 1]; ++l) ls.push_back(l);
    chunk_layers_.push_back(ls);
    mine.insert(mine.end(), ls.begin(), ls.end());
  }
  const bool emb = me_.pp == 0, head = me_.pp == p.p - 1;
  lay_ = make_param_layout(m, p.t, me_.tp, emb, mine, head);
  zero_ = p.zero;
  sh_ = make_sharding(lay_, zero_ > 0 ? replicas_ : 1, zero_ > 0 ? dp_.me : 0);
  for (size_t u = 0; u < lay_.units.size(); ++u) {
    const Unit& un = lay_.units[u];
    if (un.layer >= 0) layer_unit_[un.layer] = static_cast<int>(u);
    else if (un.layer == -2) final_unit_ = static_cast<int>(u);
    else {
      const TensorKind k = tensor_of(u).kind;
      if (k == TensorKind::wpe) wpe_unit_ = static_cast<int>(u);
      else if (emb && wte_unit_ < 0) wte_unit_ = static_cast<int>(u);
      else tied_copy_unit_ = static_cast<int>(u);
    }
  }
  if (head) head_w_unit_ = m.tie_embeddings ? (emb ? wte_unit_ : tied_copy_unit_) : final_unit_;
  allocate();
  if (o.resume) {  // the newest complete checkpoint, saved under this plan or any other
    const std::string path = newest_checkpoint(o.checkpoint_dir);
    if (!path.empty()) load_checkpoint(path);
    if (comm_.rank() == 0 && o.on_step)
      std::fprintf(stderr, "%s\n", path.empty() ? ("no checkpoint under " + o.checkpoint_dir + ": starting at step 0").c_str()
                                                 : ("resuming from " + path).c_str());
    // A newer step folder without its manifest is not a checkpoint (strata renames a folder
    // into place only once its manifest is written): said, not passed over in silence.
    const auto all = checkpoints_in(o.checkpoint_dir);
    if (comm_.rank() == 0 && !all.empty() && all.back().second.string() != path)
      std::fprintf(stderr, "strata: note: %s has no manifest.json (not a complete checkpoint): %s\n",
                   all.back().second.string().c_str(),
                   path.empty() ? "starting at step 0" : ("resuming from the newest complete one, " + path).c_str());
  }
}

void Engine::allocate() {
  const int64_t full = sh_.full_size, shard = sh_.shard_size;
  // The rank's initial values, computed once (3.3M of them for tiny-gpt: a tenth of a
  // second each time, which every rank of every test run paid twice).
  std::vector<float> tmp(static_cast<size_t>(lay_.size));
  initialise(m_, lay_, o_.seed, tmp.data());
  if (zero_ < 3) {
    work_ = Buf(&mem_, MemCategory::weights, full, kWeightBytes);
    for (size_t u = 0; u < lay_.units.size(); ++u)
      be_.to_device(work_.data() + sh_.full_off[u], tmp.data() + lay_.units[u].begin, lay_.units[u].size());
  }
  // The owned block of every unit, initialised from the same global values: the ZeRO-3
  // weight shard and the fp32 master weights start from it (fp32 without ZeRO-3 has neither).
  std::vector<float> owned(static_cast<size_t>(zero_ == 3 || mixed() ? shard : 0), 0.0f);
  if (!owned.empty()) {
    for (size_t u = 0; u < lay_.units.size(); ++u) {
      const int64_t lo = sh_.me * sh_.shard[u];
      for (int64_t i = 0; i < sh_.shard[u]; ++i)
        if (lo + i < lay_.units[u].size())
          owned[static_cast<size_t>(sh_.shard_off[u] + i)] = tmp[static_cast<size_t>(lay_.units[u].begin + lo + i)];
    }
  }
  std::vector<float>().swap(tmp);  // freed before the optimizer's buffers are made
  if (zero_ == 3) {
    work_shard_ = Buf(&mem_, MemCategory::weights, shard, kWeightBytes);
    be_.to_device(work_shard_.data(), owned.data(), shard);
  }
  if (mixed()) {
    master_ = Buf(&mem_, MemCategory::optimizer_states, shard, 4);
    be_.to_device(master_.data(), owned.data(), shard);
    if (zero_ < 3) be_.round_to(work_.data(), work_.size(), plan_.precision);
    else be_.round_to(work_shard_.data(), work_shard_.size(), plan_.precision);
  }
  adam_m_ = Buf(&mem_, MemCategory::optimizer_states, shard, 4);
  adam_v_ = Buf(&mem_, MemCategory::optimizer_states, shard, 4);
  if (zero_ < 2) grad_full_ = Buf(&mem_, MemCategory::gradients, full, 4);
  if (zero_ >= 1) grad_shard_ = Buf(&mem_, MemCategory::gradients, shard, 4);
  // Per owned element: weight decay, and whether it counts in the global gradient norm
  // (once per model: data-parallel rank 0 without ZeRO, tp rank 0 for replicated
  // tensors, the first stage's wte and not the tied copy).
  std::vector<uint8_t> decay(static_cast<size_t>(shard), 0), counted(static_cast<size_t>(shard), 0);
  for (size_t u = 0; u < lay_.units.size(); ++u) {
    const int64_t lo = sh_.me * sh_.shard[u], b = lay_.units[u].begin;
    for (const TensorSlot& s : lay_.tensors) {
      if (s.offset < b || s.offset >= lay_.units[u].end) continue;
      const bool count = (zero_ > 0 || dp_.me == 0) && (!s.tp_replicated || me_.tp == 0) &&
                         static_cast<int>(u) != tied_copy_unit_;
      // The slot's elements in this rank's shard of the unit: one range of both masks.
      const int64_t first = std::max(lo, s.offset - b), end = std::min(lo + sh_.shard[u], s.offset - b + s.size());
      if (first >= end) continue;
      const auto at = static_cast<std::ptrdiff_t>(sh_.shard_off[u] + first - lo);
      std::fill_n(decay.begin() + at, end - first, s.decay ? 1 : 0);
      std::fill_n(counted.begin() + at, end - first, count ? 1 : 0);
    }
  }
  // In the backend's memory one bit per element (a byte each was a quarter of a GB for
  // gpt2-124m's two masks on the GPU, outside every category).
  const std::vector<uint8_t> decay_bits = pack_flags(decay), counted_bits = pack_flags(counted);
  decay_mask_ = ByteBuf(&be_, decay_bits.data(), decay_bits.size());
  counted_mask_ = ByteBuf(&be_, counted_bits.data(), counted_bits.size());
  done_count_.assign(lay_.units.size(), 0);
  loss_scale_ = plan_.precision == Precision::fp16 ? o_.loss_scale : 1.0;
}

ModelCtx Engine::ctx() {
  ModelCtx c;
  c.m = &m_;
  c.be = &be_;
  c.comm = &comm_;
  c.tp = tp_;
  c.t = plan_.t;
  c.r = me_.tp;
  c.sp = plan_.sp;
  c.recompute = plan_.recompute;
  c.flash = plan_.attention == AttentionChoice::flash;
  c.recompute_layers = plan_.recompute_layers;
  c.precision = plan_.precision;
  c.mem = &mem_;
  c.B = plan_.mbs;
  c.S = m_.S / plan_.c;
  c.cpg = cp_;
  c.cp = plan_.c;
  c.cpr = me_.cp;
  c.cp_comm_s = &cp_s_;
  c.tp_comm_s = &tp_s_;
  if (plan_.t > 1) c.tp_waits = &tp_waits_;
  if (plan_.c > 1) c.cp_waits = &cp_waits_;
  c.recompute_s = &recompute_s_;
  c.ops = ops_.get();
  c.poll = [this] { poll(); };
  c.mlp_grads_done = [this](int64_t layer) { mlp_done(layer); };
  if (tracing()) {
    c.on_comm = [this](const char* term, const char* op, double t0, double t1) {
      event(term, 1, t0, t1, trace_mb_, trace_chunk_, trace_layer_, op);
    };
    c.on_recompute = [this](double t0, double t1) {
      event("layer recompute", 0, t0, t1, trace_mb_, trace_chunk_, trace_layer_);
    };
  }
  return c;
}

TrainResult Engine::run() {
  TrainResult res;
  res.plan = plan_;
  res.world_size = comm_.size();
  res.backend = be_.name();
  if (data_.synthetic()) res.entropy_rate_nats = data_.chain().entropy_rate_nats;
  const double tokens = static_cast<double>(plan_.gbs * m_.S);
  res.model_flops_per_step = 3.0 * m_.forward_flops(plan_.gbs);
  comm_.barrier(world_);
  t_origin_ = now();
  std::vector<double> sums(16, 0.0);
  for (int64_t k = start_step_; k < o_.steps; ++k) {
    comm_.set_step(k + 1);
    comm_.barrier(world_);
    const double t0 = now();
    StepRecord rec;
    rec.step = k + 1;
    rec.loss = run_step(k, &rec);
    // NaN/Inf in the gradients skipped the update (optimizer_step); a non-finite loss is
    // as bad. With fp16, overflow while the dynamic loss scale is still coming down is
    // normal (Megatron starts at 2^32), so a skipped step counts once the scale is at its
    // minimum (1), as DeepSpeed stops there. K in a row: diverging or a broken rank: stop.
    const bool bad = (rec.skipped && (plan_.precision != Precision::fp16 || rec.loss_scale <= 1.0)) ||
                     !std::isfinite(rec.loss);
    bad_in_row_ = bad ? bad_in_row_ + 1 : 0;
    if (bad_in_row_ >= o_.max_bad_steps) {
      if (o_.on_step && comm_.rank() == 0) o_.on_step(rec, o_.steps);
      const std::string newest = o_.checkpoint_dir.empty() ? "" : newest_checkpoint(o_.checkpoint_dir);
      throw TrainingStopped(fmt::format(
          "training stopped at step {}: {} steps in a row had NaN or Inf in the loss or gradients (--max-bad-steps {}{}); "
          "the steps with NaN or Inf gradients were skipped, so the model holds none; {}",
          k + 1, bad_in_row_, o_.max_bad_steps,
          plan_.precision == Precision::fp16 ? fmt::format("; fp16 loss scale at its minimum, now {:g}", loss_scale_) : "",
          newest.empty() ? "no checkpoint was written" : "the newest good checkpoint is " + newest));
    }
    double dt = now() - t0;
    // After the step's clock stopped: the skew in its tensor-, context- and data-parallel
    // waits (the part before the last member of the group started the collective).
    tp_skew_s_ = skew_of(&tp_waits_, tp_);
    cp_skew_s_ = skew_of(&cp_waits_, cp_);
    dp_skew_s_ = skew_of(&dp_waits_, dp_);
    bubble_split();
    comm_.all_reduce(&dt, 1, world_, ReduceOp::max);
    rec.step_time_s = dt;
    rec.tokens_per_s = tokens / dt;
    res.steps.push_back(rec);
    const bool counted = k > start_step_ || o_.steps - start_step_ == 1;
    if (ops_) {  // the step's op regions, read once the backend has caught up
      be_.synchronise();
      ops_->step_done(counted);
    }
    if (counted) {  // the first step run is a warm-up
      const double ph[16] = {forward_s_,  backward_s_, recompute_s_, optimizer_s_, tp_s_,      pp_s_,
                             dp_s_,       dp_total_s_, bubble_s_,    1.0,          dp_skew_s_, cp_s_,
                             tp_skew_s_,  cp_skew_s_,  bubble_schedule_s_, bubble_variation_s_};
      for (int i = 0; i < 16; ++i) sums[static_cast<size_t>(i)] += ph[i];
    }
    if (o_.on_step && comm_.rank() == 0) o_.on_step(rec, o_.steps);
    if (o_.checkpoint_every > 0 && (k + 1) % o_.checkpoint_every == 0) save_checkpoint(k + 1);
  }
  if (ops_) {
    res.ops = ops_->rows();
    res.op_steps = ops_->steps();
  }
  std::vector<double> times(res.steps.size());
  for (size_t i = 0; i < times.size(); ++i) times[i] = res.steps[i].step_time_s;
  std::sort(times.begin(), times.end());
  if (!times.empty()) {  // the mean of the two middle steps when their number is even
    const size_t h = times.size() / 2;
    res.median_step_time_s = times.size() % 2 ? times[h] : 0.5 * (times[h - 1] + times[h]);
  }
  const double n = std::max(1.0, sums[9]);
  double ph[13];
  for (int i = 0; i < 9; ++i) ph[i] = sums[static_cast<size_t>(i)] / n;
  for (int i = 9; i < 13; ++i) ph[i] = sums[static_cast<size_t>(i + 1)] / n;
  comm_.all_reduce(ph, 13, world_, ReduceOp::max);
  res.forward_s = ph[0];
  res.backward_s = ph[1];
  res.recompute_s = ph[2];
  res.optimizer_s = ph[3];
  res.tp_comm_s = ph[4];
  res.pp_comm_s = ph[5];
  res.dp_comm_s = ph[6];
  res.dp_comm_total_s = ph[7];
  res.pipeline_bubble_s = ph[8];
  res.dp_skew_s = ph[9];
  res.cp_comm_s = ph[10];
  res.tp_skew_s = ph[11];
  res.cp_skew_s = ph[12];
  // The bubble's split (bubble_split) on the rank with the largest bubble, so that the parts
  // add up to the pipeline_bubble reported: the lowest such rank sends its mean split.
  {
    const double mine = sums[8] / n;
    double lowest = mine >= res.pipeline_bubble_s ? -static_cast<double>(comm_.rank()) : -1e300;  // negated
    comm_.all_reduce(&lowest, 1, world_, ReduceOp::max);
    double split[2] = {-1e300, -1e300};
    if (-static_cast<double>(comm_.rank()) == lowest) split[0] = sums[14] / n, split[1] = sums[15] / n;
    comm_.all_reduce(split, 2, world_, ReduceOp::max);
    res.pipeline_bubble_schedule_s = split[0];
    res.pipeline_bubble_variation_s = split[1];
  }
  double mem[6] = {static_cast<double>(mem_.peak(MemCategory::weights)), static_cast<double>(mem_.peak(MemCategory::gradients)),
                   static_cast<double>(mem_.peak(MemCategory::optimizer_states)),
                   static_cast<double>(mem_.peak(MemCategory::activations)),
                   static_cast<double>(mem_.peak(MemCategory::comm_buffers)), static_cast<double>(mem_.peak_total())};
  comm_.all_reduce(mem, 6, world_, ReduceOp::max);
  res.peak_weights = static_cast<int64_t>(mem[0]);
  res.peak_gradients = static_cast<int64_t>(mem[1]);
  res.peak_optimizer = static_cast<int64_t>(mem[2]);
  res.peak_activations = static_cast<int64_t>(mem[3]);
  res.peak_comm = static_cast<int64_t>(mem[4]);
  res.peak_total = static_cast<int64_t>(mem[5]);
  Backend::DeviceMemory dm;
  if (be_.device_memory(&dm)) {  // every rank runs the same backend: all reach this reduction
    double d[2 * kMemPools + 2];
    for (int i = 0; i < kMemPools; ++i) {
      d[i] = static_cast<double>(dm.used_peak[i]);
      d[kMemPools + i] = static_cast<double>(dm.reserved_peak[i]);
    }
    d[2 * kMemPools] = static_cast<double>(dm.total - dm.free);
    d[2 * kMemPools + 1] = static_cast<double>(dm.total);
    comm_.all_reduce(d, 2 * kMemPools + 2, world_, ReduceOp::max);
    res.has_device_memory = true;
    for (int i = 0; i < kMemPools; ++i) {
      res.device_used_peak[i] = static_cast<int64_t>(d[i]);
      res.device_reserved_peak[i] = static_cast<int64_t>(d[kMemPools + i]);
    }
    res.device_in_use = static_cast<int64_t>(d[2 * kMemPools]);
    res.device_total = static_cast<int64_t>(d[2 * kMemPools + 1]);
  }
  // The data-parallel reductions of one step run alone (blocking, nothing to overlap
  // with): what the overlapped ones would cost if fully exposed.
  if (replicas_ > 1) {
    // In the backend's memory, where the communicator works.
    Buf scratch = Buf::untracked(&be_, sh_.full_size), out = Buf::untracked(&be_, sh_.shard_size);
    comm_.barrier(dp_);
    const double t0 = now();
    const int64_t per_step = zero_ >= 2 ? mb_count_ : 1;
    for (int64_t k = 0; k < per_step; ++k)
      for (size_t u = 0; u < lay_.units.size(); ++u) {
        float* g = scratch.data() + sh_.full_off[u];
        if (zero_ == 0) comm_.all_reduce(g, sh_.padded(u), dp_);
        else comm_.reduce_scatter(g, out.data() + sh_.shard_off[u], sh_.shard[u], dp_);
      }
    for (size_t u = 0; u < lay_.units.size() && zero_ >= 1; ++u) {
      if (zero_ < 3) {
        float* f = scratch.data() + sh_.full_off[u];
        comm_.all_gather(f + sh_.me * sh_.shard[u], f, sh_.shard[u], dp_);
      }
    }
    double dt = now() - t0;
    comm_.all_reduce(&dt, 1, world_, ReduceOp::max);
    res.dp_comm_standalone_s = dt;
  }
  // Replicas: the spread of every parameter across data-parallel ranks (none with one
  // replica): max(x) + max(-x) over the group, element by element. One host copy, one
  // more for the maxima, one buffer in the backend's memory, where the communicator works.
  double spread = 0;
  if (dp_.size() > 1) {
    std::vector<float> x = full_fp32_params();
    const int64_t n = static_cast<int64_t>(x.size());
    std::vector<float> hi(x.size());
    Buf d = Buf::untracked(&be_, n);
    be_.to_device(d.data(), x.data(), n);
    comm_.all_reduce(d.data(), n, dp_, ReduceOp::max);
    be_.to_host(hi.data(), d.data(), n);
    for (float& v : x) v = -v;
    be_.to_device(d.data(), x.data(), n);
    comm_.all_reduce(d.data(), n, dp_, ReduceOp::max);
    be_.to_host(x.data(), d.data(), n);
    for (size_t i = 0; i < hi.size(); ++i) {
      const double diff = static_cast<double>(hi[i] + x[i]);
      if (!(diff <= spread)) spread = diff;  // NaN propagates
    }
  }
  comm_.all_reduce(&spread, 1, world_, ReduceOp::max);
  res.replica_max_abs_diff = spread;
  if (!(spread == 0) && comm_.rank() == 0)  // NaN too
    std::fprintf(stderr,
                 "strata: warning: the data-parallel replicas of the weights differ by up to %g after the last "
                 "step (replica_max_abs_diff): silent data corruption or a non-deterministic reduction\n",
                 spread);
  if (!o_.dump_params_path.empty()) {
    const std::vector<float> g = global_params(full_fp32_params());
    if (comm_.rank() == 0) {
      std::ofstream f(o_.dump_params_path, std::ios::binary);
      f.write(reinterpret_cast<const char*>(g.data()), static_cast<std::streamsize>(g.size() * sizeof(float)));
      if (!f) throw InputError("--dump-params: cannot write '" + o_.dump_params_path + "'");
    }
  }
  if (!o_.trace_path.empty()) {
    std::ostringstream os;
    os << std::fixed << std::setprecision(3);  // microseconds with ns digits, at any run length
    for (const TraceEvent& e : trace_) {
      os << ",\n{\"name\":\"" << e.name << "\",\"ph\":\"X\",\"pid\":" << comm_.rank() << ",\"tid\":" << e.tid
         << ",\"ts\":" << e.ts * 1e6 << ",\"dur\":" << e.dur * 1e6 << ",\"args\":{\"microbatch\":" << e.mb
         << ",\"chunk\":" << e.chunk;
      if (e.layer >= 0) os << ",\"layer\":" << e.layer;
      if (e.op) os << ",\"op\":\"" << e.op << "\"";
      os << "}}";
    }
    const std::vector<std::string> parts = comm_.gather_strings(os.str(), 0);
    if (comm_.rank() == 0) {
      std::ofstream f(o_.trace_path);
      // One process per rank, threads compute (0) and communication (1).
      f << "{\"traceEvents\":[";
      for (int r = 0; r < comm_.size(); ++r)
        f << (r ? "," : "") << "\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << r
          << ",\"args\":{\"name\":\"rank " << r << "\"}},\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << r
          << ",\"tid\":0,\"args\":{\"name\":\"compute\"}},\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << r
          << ",\"tid\":1,\"args\":{\"name\":\"communication\"}}";
      for (const std::string& s : parts) f << s;
      f << "\n]}\n";
      if (!f) throw InputError("--trace: cannot write '" + o_.trace_path + "'");
    }
  }
  return res;
}


TrainResult train(const ModelSpec& m, const Plan& p, const TrainOptions& o, Comm& comm, Backend& be) {
  validate_train_plan(m, p, comm.size(), std::string(be.name()) == "cpu");  // host memory: the CPU backend's
  if (o.distributed_timeout_s > 0 && comm.size() > 1) comm.start_watchdog(o.distributed_timeout_s);
  Engine e(m, p, o, comm, be);
  return e.run();
}

Json train_result_to_json(const TrainResult& r) {
  Json j;
  j["plan"] = plan_to_json(r.plan);
  j["world_size"] = r.world_size;
  j["backend"] = r.backend;
  Json steps = Json::array();
  for (const StepRecord& s : r.steps) {
    Json e;
    e["step"] = s.step;
    e["loss"] = s.loss;
    e["step_time_s"] = s.step_time_s;
    e["tokens_per_s"] = s.tokens_per_s;
    e["grad_norm"] = std::isfinite(s.grad_norm) ? Json(s.grad_norm) : Json(nullptr);
    e["loss_scale"] = s.loss_scale;
    e["skipped"] = s.skipped;
    steps.push_back(e);
  }
  j["steps"] = steps;
  j["median_step_time_s"] = r.median_step_time_s;
  j["peak_memory_bytes"] = {{"weights", r.peak_weights},         {"gradients", r.peak_gradients},
                            {"optimizer_states", r.peak_optimizer}, {"activations", r.peak_activations},
                            {"comm_buffers", r.peak_comm},         {"total", r.peak_total}};
  if (r.has_device_memory) {
    Json used = Json::object(), reserved = Json::object();
    int64_t used_sum = 0, reserved_sum = 0;
    for (int i = 0; i < kMemPools; ++i) {
      const char* name = mem_pool_name(i);
      used[name] = r.device_used_peak[i];
      reserved[name] = r.device_reserved_peak[i];
      used_sum += r.device_used_peak[i];
      reserved_sum += r.device_reserved_peak[i];
    }
    used["sum_of_peaks"] = used_sum;
    reserved["sum_of_peaks"] = reserved_sum;
    j["device_memory_bytes"] = {{"pool_peak_in_use", used},
                                {"pool_peak_reserved", reserved},
                                {"device_in_use_after_training", r.device_in_use},
                                {"device_total", r.device_total}};
  }
  j["time_s"] = {{"forward", r.forward_s},   {"backward", r.backward_s},   {"recompute", r.recompute_s},
                 {"optimizer", r.optimizer_s}, {"tp_comm", r.tp_comm_s},   {"cp_comm", r.cp_comm_s}, {"pp_comm", r.pp_comm_s},
                 {"dp_comm", r.dp_comm_s},   {"dp_comm_in_flight", r.dp_comm_total_s},
                 {"dp_comm_standalone", r.dp_comm_standalone_s}, {"dp_skew", r.dp_skew_s},
                 {"tp_skew", r.tp_skew_s},   {"cp_skew", r.cp_skew_s},
                 {"pipeline_bubble", r.pipeline_bubble_s},
                 {"pipeline_bubble_schedule", r.pipeline_bubble_schedule_s},
                 {"pipeline_bubble_variation", r.pipeline_bubble_variation_s},
                 {"pp_skew", std::max(0.0, r.pipeline_bubble_s - r.pipeline_bubble_schedule_s)}};
  j["replica_max_abs_diff"] = std::isfinite(r.replica_max_abs_diff) ? Json(r.replica_max_abs_diff) : Json(nullptr);
  if (r.entropy_rate_nats >= 0) j["entropy_rate_nats"] = r.entropy_rate_nats;
  j["model_flops_per_step"] = r.model_flops_per_step;
  const double med = r.median_step_time_s > 0 ? r.median_step_time_s : 1.0;
  j["model_flops_per_s_per_rank"] = r.model_flops_per_step / med / r.world_size;
  return j;
}

}  // namespace strata
