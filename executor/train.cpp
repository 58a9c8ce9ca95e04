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
#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "costmodel/layout.h"
#include "costmodel/schedule.h"
#include "executor/data.h"
#include "executor/gpt.h"
#include "executor/memory_tracker.h"
#include "executor/param_layout.h"
#include "executor/process_grid.h"
#include "executor/zero.h"

namespace strata {

void validate_train_plan(const ModelSpec& m, const Plan& p, int world_size) {
  auto fail = [](const std::string& msg) { throw InputError(msg); };
  if (p.world_size() != world_size)
    fail("plan: tp*pp*dp*cp = " + std::to_string(p.t) + "*" + std::to_string(p.p) + "*" + std::to_string(p.d) + "*" +
         std::to_string(p.c) + " = " + std::to_string(p.world_size()) + " ranks, but mpirun started " +
         std::to_string(world_size) + "; run with mpirun -np " + std::to_string(p.world_size()));
  if (p.c != 1) fail("plan: context_parallel " + std::to_string(p.c) + ": the executor runs context_parallel = 1 only");
  auto div = [&](const char* what, int64_t n, const char* by, int64_t k) {
    if (k <= 0 || n % k != 0)
      fail(std::string("plan: ") + what + " = " + std::to_string(n) + " is not divisible by " + by + " = " +
           std::to_string(k));
  };
  div("num_attention_heads", m.A, "tensor_parallel", p.t);
  div("num_query_groups", m.G, "tensor_parallel", p.t);
  div("ffn_hidden_size", m.F, "tensor_parallel", p.t);
  div("padded vocab_size", executor_vocab(m), "tensor_parallel", p.t);
  if (p.sp) div("seq_length * micro_batch_size", m.S * p.mbs, "tensor_parallel (sequence parallel)", p.t);
  div("global_batch_size", p.gbs, "micro_batch_size * data_parallel", p.mbs * p.d);
  if (m.position == Position::rope && m.D() % 2 != 0) fail("model: rope needs an even head dim, got " + std::to_string(m.D()));
  if (p.p * p.v > m.L)
    fail("plan: pipeline_parallel * virtual_pipeline_stages = " + std::to_string(p.p * p.v) + " exceeds num_layers " +
         std::to_string(m.L));
  if (p.v > 1) {
    div("num_layers", m.L, "pipeline_parallel * virtual_pipeline_stages", p.p * p.v);
    div("micro-batches per step (gbs / (mbs * dp))", p.gbs / (p.mbs * p.d), "pipeline_parallel (interleaved)", p.p);
  }
  if (p.precision == Precision::fp8) fail("plan: precision fp8: the CPU executor runs fp32, bf16 and fp16");
  // Parameters, gradients and Adam states alone take 16 bytes per parameter of a rank's
  // share; refuse plans that cannot fit this machine instead of failing to allocate.
  const double per_rank = m.total_params() / static_cast<double>(p.t * p.p) * 16.0;
  const double ram = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  if (ram > 0 && per_rank > ram)
    fail("model: " + m.name + " needs about " + std::to_string(static_cast<int64_t>(per_rank / 1e9)) +
         " GB of parameters, gradients and optimizer states per rank with tp*pp = " + std::to_string(p.t * p.p) +
         "; this machine has " + std::to_string(static_cast<int64_t>(ram / 1e9)) + " GB (the CPU executor trains small models)");
}

namespace {

struct TraceEvent {
  std::string name;
  int tid = 0;  // 0 compute, 1 communication
  double ts = 0, dur = 0;
  int64_t mb = -1, chunk = -1;
};

struct Pending {  // a data-parallel reduction or a send in flight
  Request req;
  double start = 0;
  Buf keep;  // a send's buffer, alive until the send completes
};

struct MicroState {
  std::vector<LayerActs> layers;
  HeadActs head;
  std::vector<int32_t> tokens, targets;  // (B, S)
};

class Engine {
 public:
  Engine(const ModelSpec& m, const Plan& p, const TrainOptions& o, Comm& comm, Backend& be)
      : m_(m), plan_(p), o_(o), comm_(comm), be_(be), data_(o.data, executor_vocab(m), m.S, o.seed) {
    grid_.t = p.t;
    grid_.c = p.c;
    grid_.d = p.d;
    grid_.p = p.p;
    comm_.setup(grid_);
    me_ = grid_.coords(comm_.rank());
    tp_ = grid_.group(kTensor, comm_.rank());
    dp_ = grid_.group(kData, comm_.rank());
    pp_ = grid_.group(kPipeline, comm_.rank());
    emb_ = grid_.group(kEmbedding, comm_.rank());
    world_ = grid_.group(kWorld, comm_.rank());
    mb_count_ = p.microbatches();
    schedule_ = make_schedule(p.schedule(), p.p, p.v, mb_count_);
    const StageLayout sl = make_layout(m.L, p.p, p.v);
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
    sh_ = make_sharding(lay_, zero_ > 0 ? p.d : 1, zero_ > 0 ? me_.dp : 0);
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
    for (size_t u = 0; u < lay_.units.size(); ++u) unit_chunk_.push_back(chunk_of_unit(u));
    allocate();
  }

  TrainResult run();

 private:
  const TensorSlot& tensor_of(size_t u) const {
    for (const TensorSlot& s : lay_.tensors)
      if (s.offset == lay_.units[u].begin) return s;
    return lay_.tensors.front();
  }
  int chunk_of_unit(size_t u) const {
    const Unit& un = lay_.units[u];
    if (un.layer >= 0) {
      for (size_t c = 0; c < chunk_layers_.size(); ++c)
        for (int64_t l : chunk_layers_[c])
          if (l == un.layer) return static_cast<int>(c);
    }
    if (static_cast<int>(u) == wte_unit_ || static_cast<int>(u) == wpe_unit_) return 0;
    return static_cast<int>(plan_.v - 1);
  }
  int elem_bytes() const { return plan_.precision == Precision::fp32 ? 4 : 2; }
  bool mixed() const { return plan_.precision != Precision::fp32; }

  void allocate();
  const float* weights(int u);
  float* grads(int u);
  void release_weights(int u);
  void prefetch(int u);
  void unit_done(int u);
  void mlp_done(int64_t layer);
  void poll();
  void idle() {  // waiting for a peer: progress MPI, and give the core away when oversubscribed
    poll();
    std::this_thread::yield();
  }
  void wait_pending(std::vector<Pending>* list, double* exposed);
  ModelCtx ctx();
  UnitView view(int u) { return UnitView{&lay_, lay_.units[static_cast<size_t>(u)].begin, weights(u), grads(u)}; }
  double run_step(int64_t k, StepRecord* rec);
  void forward_step(int64_t k, const Step& st, double* loss_sum);
  void backward_step(const Step& st);
  void finish_gradients();
  void optimizer_step(int64_t k, StepRecord* rec);
  float* master_block(size_t u);
  std::vector<float> full_fp32_params();
  std::vector<float> global_params(const std::vector<float>& full);
  void event(const std::string& name, int tid, double t0, double t1, int64_t mb = -1, int64_t chunk = -1) {
    if (!o_.trace_path.empty()) trace_.push_back({name, tid, t0 - t_origin_, t1 - t0, mb, chunk});
  }

  const ModelSpec& m_;
  Plan plan_;
  TrainOptions o_;
  Comm& comm_;
  Backend& be_;
  TokenSource data_;
  ProcessGrid grid_;
  Coords me_;
  Group tp_, dp_, pp_, emb_, world_;
  int64_t mb_count_ = 1;
  Schedule schedule_;
  std::vector<std::vector<int64_t>> chunk_layers_;  // (v) global layers of each chunk here
  ParamLayout lay_;
  int zero_ = 0;
  Sharding sh_;
  std::map<int64_t, int> layer_unit_;
  int wte_unit_ = -1, wpe_unit_ = -1, final_unit_ = -1, tied_copy_unit_ = -1, head_w_unit_ = -1;
  std::vector<int> unit_chunk_;
  MemoryTracker mem_;
  Buf work_;        // (full) working weights, zero < 3
  Buf work_shard_;  // (shard) working weights, zero 3
  Buf master_;      // (shard) fp32 master weights, mixed precision
  Buf adam_m_, adam_v_;
  Buf grad_full_;   // (full) zero < 2
  Buf grad_shard_;  // (shard) zero >= 1
  std::vector<uint8_t> decay_, counted_;  // (shard) AdamW decay; counted in the global norm
  std::map<int, Buf> gathered_;           // zero 3: resident units
  std::map<int, Request> prefetching_;
  std::map<int, Buf> grad_tmp_;           // zero >= 2: a unit's gradient of one micro-batch
  std::vector<int64_t> done_count_;
  std::vector<int64_t> early_split_;  // (units) reduced early from this offset on; 0 = not
  std::vector<Pending> dp_pending_, sends_;
  std::map<std::pair<int64_t, int64_t>, MicroState> micro_;
  double loss_scale_ = 1.0;
  int64_t good_steps_ = 0;
  // Per-step phase seconds.
  double dp_skew_s_ = 0;
  double forward_s_ = 0, backward_s_ = 0, recompute_s_ = 0, optimizer_s_ = 0, tp_s_ = 0, pp_s_ = 0, dp_s_ = 0,
         dp_total_s_ = 0, bubble_s_ = 0;
  std::vector<std::pair<double, double>> dp_intervals_;
  double t_origin_ = 0;
  std::vector<TraceEvent> trace_;
};

void Engine::allocate() {
  const int64_t full = sh_.full_size, shard = sh_.shard_size;
  if (zero_ < 3) {
    work_ = Buf(&mem_, MemCategory::weights, full, elem_bytes());
    std::vector<float> tmp(static_cast<size_t>(lay_.size));
    initialise(m_, lay_, o_.seed, tmp.data());
    for (size_t u = 0; u < lay_.units.size(); ++u)
      std::copy(tmp.begin() + lay_.units[u].begin, tmp.begin() + lay_.units[u].end, work_.data() + sh_.full_off[u]);
  }
  // The owned block of every unit, initialised from the same global values.
  std::vector<float> owned(static_cast<size_t>(shard), 0.0f);
  {
    std::vector<float> tmp(static_cast<size_t>(lay_.size));
    initialise(m_, lay_, o_.seed, tmp.data());
    for (size_t u = 0; u < lay_.units.size(); ++u) {
      const int64_t lo = sh_.me * sh_.shard[u];
      for (int64_t i = 0; i < sh_.shard[u]; ++i)
        if (lo + i < lay_.units[u].size())
          owned[static_cast<size_t>(sh_.shard_off[u] + i)] = tmp[static_cast<size_t>(lay_.units[u].begin + lo + i)];
    }
  }
  if (zero_ == 3) {
    work_shard_ = Buf(&mem_, MemCategory::weights, shard, elem_bytes());
    std::copy(owned.begin(), owned.end(), work_shard_.data());
  }
  if (mixed()) {
    master_ = Buf(&mem_, MemCategory::optimizer_states, shard, 4);
    std::copy(owned.begin(), owned.end(), master_.data());
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
  decay_.assign(static_cast<size_t>(shard), 0);
  counted_.assign(static_cast<size_t>(shard), 0);
  for (size_t u = 0; u < lay_.units.size(); ++u) {
    const int64_t lo = sh_.me * sh_.shard[u], b = lay_.units[u].begin;
    for (const TensorSlot& s : lay_.tensors) {
      if (s.offset < b || s.offset >= lay_.units[u].end) continue;
      const bool count = (zero_ > 0 || me_.dp == 0) && (!s.tp_replicated || me_.tp == 0) &&
                         static_cast<int>(u) != tied_copy_unit_;
      for (int64_t i = std::max(lo, s.offset - b); i < std::min(lo + sh_.shard[u], s.offset - b + s.size()); ++i) {
        decay_[static_cast<size_t>(sh_.shard_off[u] + i - lo)] = s.decay ? 1 : 0;
        counted_[static_cast<size_t>(sh_.shard_off[u] + i - lo)] = count ? 1 : 0;
      }
    }
  }
  done_count_.assign(lay_.units.size(), 0);
  loss_scale_ = plan_.precision == Precision::fp16 ? o_.loss_scale : 1.0;
}

const float* Engine::weights(int u) {
  const size_t su = static_cast<size_t>(u);
  if (zero_ < 3) return work_.data() + sh_.full_off[su];
  auto it = gathered_.find(u);
  if (it != gathered_.end()) {
    auto pf = prefetching_.find(u);
    if (pf != prefetching_.end()) {
      const double t0 = comm_.wtime();
      comm_.wait(pf->second);
      dp_s_ += comm_.wtime() - t0;
      prefetching_.erase(pf);
    }
    return it->second.data();
  }
  Buf b(&mem_, MemCategory::comm_buffers, sh_.padded(su), elem_bytes());
  const double t0 = comm_.wtime();
  comm_.all_gather(work_shard_.data() + sh_.shard_off[su], b.data(), sh_.shard[su], dp_);
  const double t1 = comm_.wtime();
  dp_s_ += t1 - t0;
  dp_intervals_.push_back({t0, t1});
  event("all_gather params", 1, t0, t1);
  return gathered_.emplace(u, std::move(b)).first->second.data();
}

void Engine::prefetch(int u) {
  if (zero_ < 3 || u < 0 || u >= static_cast<int>(lay_.units.size()) || gathered_.count(u)) return;
  const size_t su = static_cast<size_t>(u);
  Buf b(&mem_, MemCategory::comm_buffers, sh_.padded(su), elem_bytes());
  prefetching_[u] = comm_.iall_gather(work_shard_.data() + sh_.shard_off[su], b.data(), sh_.shard[su], dp_);
  gathered_.emplace(u, std::move(b));
}

void Engine::release_weights(int u) {
  if (zero_ < 3) return;
  auto pf = prefetching_.find(u);
  if (pf != prefetching_.end()) {
    comm_.wait(pf->second);
    prefetching_.erase(pf);
  }
  gathered_.erase(u);
}

float* Engine::grads(int u) {
  const size_t su = static_cast<size_t>(u);
  if (zero_ < 2) return grad_full_.data() + sh_.full_off[su];
  auto it = grad_tmp_.find(u);
  if (it == grad_tmp_.end()) it = grad_tmp_.emplace(u, Buf(&mem_, MemCategory::comm_buffers, sh_.padded(su), 4)).first;
  return it->second.data();
}

void Engine::poll() {
  for (Pending& p : dp_pending_)
    for (int i = 0; i < 16 && p.req.pending(); ++i)
      if (comm_.test(p.req)) dp_intervals_.push_back({p.start, comm_.wtime()});
  for (Pending& p : sends_)
    if (p.req.pending() && comm_.test(p.req)) p.keep.release();
}

void Engine::wait_pending(std::vector<Pending>* list, double* exposed) {
  if (list->empty()) return;
  const double t0 = comm_.wtime();
  for (Pending& p : *list) {
    if (!p.req.pending()) continue;
    comm_.wait(p.req);
    if (list == &dp_pending_) dp_intervals_.push_back({p.start, comm_.wtime()});
  }
  list->clear();
  *exposed += comm_.wtime() - t0;
  if (list == &dp_pending_) event("wait dp reduction", 1, t0, comm_.wtime());
}

// A unit's gradient of one micro-batch is complete.
void Engine::unit_done(int u) {
  const size_t su = static_cast<size_t>(u);
  if (zero_ >= 2) {  // reduce-scatter this micro-batch's gradient into the owned block
    Buf& g = grad_tmp_.at(u);
    std::vector<float> block(static_cast<size_t>(sh_.shard[su]));
    const double t0 = comm_.wtime();
    comm_.reduce_scatter(g.data(), block.data(), sh_.shard[su], dp_);
    const double t1 = comm_.wtime();
    dp_s_ += t1 - t0;
    dp_intervals_.push_back({t0, t1});
    event("reduce_scatter grads", 1, t0, t1);
    float* dst = grad_shard_.data() + sh_.shard_off[su];
    for (int64_t i = 0; i < sh_.shard[su]; ++i) dst[i] += block[static_cast<size_t>(i)];
    grad_tmp_.erase(u);
    return;
  }
  if (++done_count_[su] < mb_count_ || plan_.d == 1) {
    if (done_count_[su] == mb_count_ && zero_ == 1)  // d == 1: the block is the whole unit
      std::copy(grad_full_.data() + sh_.full_off[su], grad_full_.data() + sh_.full_off[su] + sh_.shard[su],
                grad_shard_.data() + sh_.shard_off[su]);
    return;
  }
  Pending p;
  p.start = comm_.wtime();
  float* g = grad_full_.data() + sh_.full_off[su];
  if (zero_ == 0) p.req = comm_.iall_reduce(g, early_split_[su] > 0 ? early_split_[su] : sh_.padded(su), dp_);
  else p.req = comm_.ireduce_scatter(g, grad_shard_.data() + sh_.shard_off[su], sh_.shard[su], dp_);
  dp_pending_.push_back(std::move(p));
}

// Without ZeRO, a layer's MLP gradients (the end of its unit) start their all-reduce as
// soon as the last micro-batch's MLP backward is done; unit_done reduces the rest.
void Engine::mlp_done(int64_t layer) {
  const int u = layer_unit_.at(layer);
  const size_t su = static_cast<size_t>(u);
  if (zero_ != 0 || plan_.d == 1 || done_count_[su] + 1 < mb_count_) return;
  const int64_t split = lay_.at(TensorKind::ln2_w, layer).offset - lay_.units[su].begin;
  Pending p;
  p.start = comm_.wtime();
  float* g = grad_full_.data() + sh_.full_off[su];
  p.req = comm_.iall_reduce(g + split, sh_.padded(su) - split, dp_);
  dp_pending_.push_back(std::move(p));
  early_split_[su] = split;
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
  c.precision = plan_.precision;
  c.mem = &mem_;
  c.B = plan_.mbs;
  c.S = m_.S;
  c.tp_comm_s = &tp_s_;
  c.recompute_s = &recompute_s_;
  c.poll = [this] { poll(); };
  c.mlp_grads_done = [this](int64_t layer) { mlp_done(layer); };
  return c;
}

namespace {
int tag_of(int64_t mb, int64_t chunk, int64_t v, bool backward) {
  return static_cast<int>(((mb * v + chunk) * 2) + (backward ? 1 : 0));
}
}  // namespace

void Engine::forward_step(int64_t k, const Step& st, double* loss_sum) {
  const ModelCtx c = ctx();
  const int64_t p = plan_.p, v = plan_.v, vs = st.chunk * p + me_.pp, last = p * v - 1;
  MicroState& ms = micro_[{st.chunk, st.mb}];
  const int64_t H = m_.H, rows = c.n();
  Buf x;
  if (vs == 0 || vs == last) data_.micro_batch(k, plan_.gbs, plan_.d, me_.dp, st.mb, plan_.mbs, &ms.tokens, &ms.targets);
  if (vs == 0) {
    const double t0 = comm_.wtime(), tp0 = tp_s_;
    UnitView wpe;
    if (wpe_unit_ >= 0) wpe = view(wpe_unit_);
    x = embedding_forward(c, view(wte_unit_), wpe_unit_ >= 0 ? &wpe : nullptr, ms.tokens.data());
    release_weights(wte_unit_);
    if (wpe_unit_ >= 0) release_weights(wpe_unit_);
    forward_s_ += comm_.wtime() - t0 - (tp_s_ - tp0);
  } else {
    x = c.act(rows * H);
    const int64_t src = (me_.pp + p - 1) % p;
    const double t0 = comm_.wtime();
    Request r = comm_.irecv(x.data(), rows * H, pp_.ranks[static_cast<size_t>(src)], tag_of(st.mb, st.chunk, v, false));
    while (!comm_.test(r)) idle();
    bubble_s_ += comm_.wtime() - t0;
    event("recv activations", 1, t0, comm_.wtime(), st.mb, st.chunk);
  }
  const auto& layers = chunk_layers_[static_cast<size_t>(st.chunk)];
  ms.layers.resize(layers.size());
  const double t0 = comm_.wtime(), tp0 = tp_s_;
  for (size_t i = 0; i < layers.size(); ++i) {
    const int u = layer_unit_.at(layers[i]);
    weights(u);
    if (i + 1 < layers.size()) prefetch(layer_unit_.at(layers[i + 1]));
    x = layer_forward(c, view(u), layers[i], std::move(x), &ms.layers[i]);
    release_weights(u);
    poll();
  }
  if (vs == last) {
    const float* w = weights(head_w_unit_);
    const TensorKind k_out = m_.tie_embeddings ? TensorKind::wte : TensorKind::lm_head;
    const float* out_w = w + (lay_.at(k_out).offset - lay_.units[static_cast<size_t>(head_w_unit_)].begin);
    *loss_sum += head_forward(c, view(final_unit_), out_w, std::move(x), ms.targets.data(), &ms.head);
    release_weights(final_unit_);
    release_weights(head_w_unit_);
  }
  const double t1 = comm_.wtime();
  forward_s_ += t1 - t0 - (tp_s_ - tp0);
  event("forward", 0, t0, t1, st.mb, st.chunk);
  if (vs != last) {
    const int64_t dst = (me_.pp + 1) % p, dchunk = st.chunk + (me_.pp == p - 1 ? 1 : 0);
    const double s0 = comm_.wtime();
    Pending snd;
    snd.req = comm_.isend(x.data(), x.size(), pp_.ranks[static_cast<size_t>(dst)], tag_of(st.mb, dchunk, v, false));
    snd.keep = std::move(x);
    sends_.push_back(std::move(snd));
    pp_s_ += comm_.wtime() - s0;
  }
}

void Engine::backward_step(const Step& st) {
  const ModelCtx c = ctx();
  const int64_t p = plan_.p, v = plan_.v, vs = st.chunk * p + me_.pp, last = p * v - 1;
  MicroState& ms = micro_.at({st.chunk, st.mb});
  const int64_t H = m_.H, rows = c.n();
  const float dloss = static_cast<float>(loss_scale_ / static_cast<double>(plan_.gbs * m_.S));
  Buf dx;
  double t0 = comm_.wtime(), tp0 = tp_s_;
  const double rc0 = recompute_s_;
  if (vs == last) {
    const float* w = weights(head_w_unit_);
    const TensorKind k_out = m_.tie_embeddings ? TensorKind::wte : TensorKind::lm_head;
    const int64_t rel = lay_.at(k_out).offset - lay_.units[static_cast<size_t>(head_w_unit_)].begin;
    float* gw = grads(head_w_unit_) + rel;
    dx = head_backward(c, view(final_unit_), w + rel, gw, &ms.head, dloss);
    release_weights(final_unit_);
    release_weights(head_w_unit_);
    unit_done(final_unit_);
    if (head_w_unit_ != final_unit_ && head_w_unit_ != wte_unit_) unit_done(head_w_unit_);
  } else {
    dx = c.f32(rows * H);
    const int64_t src = (me_.pp + 1) % p;
    const double r0 = comm_.wtime();
    Request r = comm_.irecv(dx.data(), rows * H, pp_.ranks[static_cast<size_t>(src)], tag_of(st.mb, st.chunk, v, true));
    while (!comm_.test(r)) idle();
    bubble_s_ += comm_.wtime() - r0;
    event("recv gradients", 1, r0, comm_.wtime(), st.mb, st.chunk);
    t0 = comm_.wtime();
    tp0 = tp_s_;
  }
  const auto& layers = chunk_layers_[static_cast<size_t>(st.chunk)];
  for (size_t i = layers.size(); i-- > 0;) {
    const int u = layer_unit_.at(layers[i]);
    weights(u);
    if (i > 0) prefetch(layer_unit_.at(layers[i - 1]));
    dx = layer_backward(c, view(u), layers[i], &ms.layers[i], dx);
    release_weights(u);
    unit_done(u);
    poll();
  }
  if (vs == 0) {
    UnitView wpe;
    if (wpe_unit_ >= 0) wpe = view(wpe_unit_);
    embedding_backward(c, view(wte_unit_), wpe_unit_ >= 0 ? &wpe : nullptr, ms.tokens.data(), dx);
    release_weights(wte_unit_);
    if (wpe_unit_ >= 0) release_weights(wpe_unit_);
    unit_done(wte_unit_);
    if (wpe_unit_ >= 0) unit_done(wpe_unit_);
  }
  const double t1 = comm_.wtime();
  backward_s_ += t1 - t0 - (tp_s_ - tp0) - (recompute_s_ - rc0);
  event("backward", 0, t0, t1, st.mb, st.chunk);
  if (vs != 0) {
    const int64_t dst = (me_.pp + p - 1) % p, dchunk = st.chunk - (me_.pp == 0 ? 1 : 0);
    Pending snd;
    snd.req = comm_.isend(dx.data(), dx.size(), pp_.ranks[static_cast<size_t>(dst)], tag_of(st.mb, dchunk, v, true));
    snd.keep = std::move(dx);
    sends_.push_back(std::move(snd));
  }
  micro_.erase({st.chunk, st.mb});
}

float* Engine::master_block(size_t u) {
  if (mixed()) return master_.data() + sh_.shard_off[u];
  if (zero_ == 3) return work_shard_.data() + sh_.shard_off[u];
  return work_.data() + sh_.full_off[u] + sh_.me * sh_.shard[u];
}

// The reduced gradient of every owned block: grad_shard_, or grad_full_ without ZeRO.
void Engine::finish_gradients() {
  wait_pending(&dp_pending_, &dp_s_);
  float* g = zero_ == 0 ? grad_full_.data() : grad_shard_.data();
  // Tied embeddings: the first and last stage each hold a wte; sum their gradients.
  if (plan_.p > 1 && m_.tie_embeddings && (wte_unit_ >= 0 || tied_copy_unit_ >= 0)) {
    const size_t u = static_cast<size_t>(wte_unit_ >= 0 ? wte_unit_ : tied_copy_unit_);
    const double t0 = comm_.wtime();
    comm_.all_reduce(g + sh_.shard_off[u], sh_.shard[u], emb_);
    pp_s_ += comm_.wtime() - t0;
  }
  // Sequence parallelism leaves the replicated tensors' gradients partial per tp rank.
  if (plan_.sp && plan_.t > 1) {
    const double t0 = comm_.wtime();
    for (size_t u = 0; u < lay_.units.size(); ++u) {
      const int64_t lo = sh_.me * sh_.shard[u], b = lay_.units[u].begin;
      for (const TensorSlot& s : lay_.tensors) {
        if (!s.tp_replicated || s.offset < b || s.offset >= lay_.units[u].end) continue;
        const int64_t a = std::max(lo, s.offset - b), e = std::min(lo + sh_.shard[u], s.offset - b + s.size());
        if (a < e) comm_.all_reduce(g + sh_.shard_off[u] + (a - lo), e - a, tp_);
      }
    }
    tp_s_ += comm_.wtime() - t0;
  }
}

void Engine::optimizer_step(int64_t k, StepRecord* rec) {
  const double t0 = comm_.wtime();
  const float* g = zero_ == 0 ? grad_full_.data() : grad_shard_.data();
  double acc[2] = {0.0, 0.0};  // sum of squares, non-finite count
  for (int64_t i = 0; i < sh_.shard_size; ++i) {
    const double x = g[i];
    if (!std::isfinite(x)) acc[1] += 1;
    else if (counted_[static_cast<size_t>(i)]) acc[0] += x * x;
  }
  comm_.all_reduce(acc, 2, world_);
  const double norm = std::sqrt(acc[0]) / loss_scale_;
  rec->loss_scale = loss_scale_;
  rec->grad_norm = norm;
  if (acc[1] > 0) {  // fp16 overflow: skip the step, halve the scale
    rec->skipped = true;
    rec->grad_norm = std::numeric_limits<double>::quiet_NaN();
    loss_scale_ = std::max(1.0, loss_scale_ / 2.0);
    good_steps_ = 0;
    optimizer_s_ += comm_.wtime() - t0;
    return;
  }
  if (plan_.precision == Precision::fp16 && ++good_steps_ % o_.loss_scale_window == 0) loss_scale_ *= 2.0;
  const double clip = o_.clip_grad > 0 && norm > o_.clip_grad ? o_.clip_grad / (norm + 1e-6) : 1.0;
  const float mul = static_cast<float>(clip / rec->loss_scale);
  const int64_t warmup = o_.warmup >= 0 ? o_.warmup : std::max<int64_t>(10, o_.steps / 10);
  const double lr = learning_rate(k, warmup, o_.steps, o_.lr, o_.min_lr);
  AdamW opt;
  opt.weight_decay = o_.weight_decay;
  for (size_t u = 0; u < lay_.units.size(); ++u) {
    const int64_t off = sh_.shard_off[u];
    const float* gu = zero_ == 0 ? g + sh_.full_off[u] : g + off;
    adamw_update(master_block(u), gu, adam_m_.data() + off, adam_v_.data() + off, decay_.data() + off, sh_.shard[u],
                 opt, lr, k + 1, mul);
  }
  // Working weights: round the owned block (mixed precision), then all-gather it (ZeRO 1, 2).
  if (mixed()) {
    for (size_t u = 0; u < lay_.units.size(); ++u) {
      float* dst = zero_ == 3 ? work_shard_.data() + sh_.shard_off[u] : work_.data() + sh_.full_off[u] + sh_.me * sh_.shard[u];
      std::copy(master_.data() + sh_.shard_off[u], master_.data() + sh_.shard_off[u] + sh_.shard[u], dst);
      be_.round_to(dst, sh_.shard[u], plan_.precision);
    }
  }
  const double t1 = comm_.wtime();
  optimizer_s_ += t1 - t0;
  event("optimizer", 0, t0, t1);
  if ((zero_ == 1 || zero_ == 2) && plan_.d > 1) {
    for (size_t u = 0; u < lay_.units.size(); ++u) {
      float* full = work_.data() + sh_.full_off[u];
      comm_.all_gather(full + sh_.me * sh_.shard[u], full, sh_.shard[u], dp_);
    }
    const double t2 = comm_.wtime();
    dp_s_ += t2 - t1;
    dp_intervals_.push_back({t1, t2});
    event("all_gather params", 1, t1, t2);
  }
}

double Engine::run_step(int64_t k, StepRecord* rec) {
  forward_s_ = backward_s_ = recompute_s_ = optimizer_s_ = tp_s_ = pp_s_ = dp_s_ = bubble_s_ = 0;
  dp_intervals_.clear();
  const double t_start = comm_.wtime();  // the step starts from a barrier on every rank
  if (zero_ < 2) grad_full_.zero();
  if (zero_ >= 1) grad_shard_.zero();
  std::fill(done_count_.begin(), done_count_.end(), 0);
  early_split_.assign(lay_.units.size(), 0);
  double loss_sum = 0;
  for (const Step& st : schedule_.stages[static_cast<size_t>(me_.pp)]) {
    if (st.forward) forward_step(k, st, &loss_sum);
    else backward_step(st);
  }
  wait_pending(&sends_, &pp_s_);
  const double arrive = comm_.wtime() - t_start;  // this rank's backward is done
  const double dp0 = dp_s_;
  finish_gradients();
  const double final_wait = dp_s_ - dp0;
  optimizer_step(k, rec);
  // Skew: the last data-parallel replica to finish its backward sets when the last
  // reduction can end; the part of this rank's final wait spent before that is load
  // imbalance, not communication.
  double latest = arrive;
  comm_.all_reduce(&latest, 1, dp_, ReduceOp::max);
  dp_skew_s_ = std::min(final_wait, latest - arrive);
  // Union of the intervals in which a data-parallel collective was in flight.
  std::sort(dp_intervals_.begin(), dp_intervals_.end());
  dp_total_s_ = 0;
  double cur_a = -1, cur_b = -1;
  for (const auto& [a, b] : dp_intervals_) {
    if (a > cur_b) {
      if (cur_b > cur_a) dp_total_s_ += cur_b - cur_a;
      cur_a = a;
      cur_b = b;
    } else {
      cur_b = std::max(cur_b, b);
    }
  }
  if (cur_b > cur_a) dp_total_s_ += cur_b - cur_a;
  // The loss: the last stage's tp rank 0 holds each pipeline's sum.
  double l = (me_.pp == plan_.p - 1 && me_.tp == 0) ? loss_sum : 0.0;
  comm_.all_reduce(&l, 1, world_);
  return l / static_cast<double>(plan_.gbs * m_.S);
}

std::vector<float> Engine::full_fp32_params() {
  std::vector<float> full(static_cast<size_t>(sh_.full_size), 0.0f);
  for (size_t u = 0; u < lay_.units.size(); ++u) {
    const float* src = master_block(u);
    std::copy(src, src + sh_.shard[u], full.begin() + sh_.full_off[u] + sh_.me * sh_.shard[u]);
    if (sh_.dz > 1) {
      float* f = full.data() + sh_.full_off[u];
      comm_.all_gather(f + sh_.me * sh_.shard[u], f, sh_.shard[u], dp_);
    }
  }
  return full;
}

std::vector<float> Engine::global_params(const std::vector<float>& full) {
  const ParamLayout g = global_param_layout(m_);
  std::vector<float> out(static_cast<size_t>(g.size), 0.0f);
  const bool writer = me_.dp == 0;
  if (writer) {
    for (size_t u = 0; u < lay_.units.size(); ++u) {
      if (static_cast<int>(u) == tied_copy_unit_) continue;
      const Unit& un = lay_.units[u];
      for (const TensorSlot& s : lay_.tensors) {
        if (s.offset < un.begin || s.offset >= un.end) continue;
        if (s.tp_replicated && me_.tp != 0) continue;
        const TensorSlot& gs = g.at(s.kind, s.layer);
        for (int64_t i = 0; i < s.rows; ++i)
          for (int64_t j = 0; j < s.cols; ++j) {
            int64_t gi = 0, gj = 0;
            global_coords(m_, s, plan_.t, me_.tp, i, j, &gi, &gj);
            out[static_cast<size_t>(gs.offset + gi * gs.cols + gj)] =
                full[static_cast<size_t>(sh_.full_off[u] + (s.offset - un.begin) + i * s.cols + j)];
          }
      }
    }
  }
  comm_.all_reduce(out.data(), static_cast<int64_t>(out.size()), world_);
  return out;
}

TrainResult Engine::run() {
  TrainResult res;
  res.plan = plan_;
  res.world_size = comm_.size();
  if (data_.synthetic()) res.entropy_rate_nats = data_.chain().entropy_rate_nats;
  const double tokens = static_cast<double>(plan_.gbs * m_.S);
  res.model_flops_per_step = 3.0 * m_.forward_flops(plan_.gbs);
  comm_.barrier(world_);
  t_origin_ = comm_.wtime();
  std::vector<double> sums(11, 0.0);
  for (int64_t k = 0; k < o_.steps; ++k) {
    comm_.barrier(world_);
    const double t0 = comm_.wtime();
    StepRecord rec;
    rec.step = k + 1;
    rec.loss = run_step(k, &rec);
    double dt = comm_.wtime() - t0;
    comm_.all_reduce(&dt, 1, world_, ReduceOp::max);
    rec.step_time_s = dt;
    rec.tokens_per_s = tokens / dt;
    res.steps.push_back(rec);
    if (k > 0 || o_.steps == 1) {
      const double ph[11] = {forward_s_, backward_s_, recompute_s_, optimizer_s_, tp_s_, pp_s_, dp_s_, dp_total_s_,
                             bubble_s_, 1.0, dp_skew_s_};
      for (int i = 0; i < 11; ++i) sums[static_cast<size_t>(i)] += ph[i];
    }
    if (o_.progress && comm_.rank() == 0)
      std::fprintf(stderr, "step %lld/%lld  loss %.5f  %.3f s  %.0f tokens/s  grad norm %.3f%s\n",
                   static_cast<long long>(k + 1), static_cast<long long>(o_.steps), rec.loss, dt, rec.tokens_per_s,
                   rec.grad_norm, rec.skipped ? "  (skipped: fp16 overflow)" : "");
  }
  std::vector<double> times(res.steps.size());
  for (size_t i = 0; i < times.size(); ++i) times[i] = res.steps[i].step_time_s;
  std::sort(times.begin(), times.end());
  if (!times.empty()) res.median_step_time_s = times[times.size() / 2];
  const double n = std::max(1.0, sums[9]);
  double ph[10];
  for (int i = 0; i < 9; ++i) ph[i] = sums[static_cast<size_t>(i)] / n;
  ph[9] = sums[10] / n;
  comm_.all_reduce(ph, 10, world_, ReduceOp::max);
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
  // The data-parallel reductions of one step run alone (blocking, nothing to overlap
  // with): what the overlapped ones would cost if fully exposed.
  if (plan_.d > 1) {
    std::vector<float> scratch(static_cast<size_t>(sh_.full_size), 0.0f), out(static_cast<size_t>(sh_.shard_size));
    comm_.barrier(dp_);
    const double t0 = comm_.wtime();
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
    double dt = comm_.wtime() - t0;
    comm_.all_reduce(&dt, 1, world_, ReduceOp::max);
    res.dp_comm_standalone_s = dt;
  }
  // Replicas: the spread of every parameter across data-parallel ranks.
  std::vector<float> full = full_fp32_params();
  {
    std::vector<float> hi = full, lo = full;
    for (float& x : lo) x = -x;
    comm_.all_reduce(hi.data(), static_cast<int64_t>(hi.size()), dp_, ReduceOp::max);
    comm_.all_reduce(lo.data(), static_cast<int64_t>(lo.size()), dp_, ReduceOp::max);
    double spread = 0;
    for (size_t i = 0; i < hi.size(); ++i) spread = std::max(spread, static_cast<double>(hi[i] + lo[i]));
    comm_.all_reduce(&spread, 1, world_, ReduceOp::max);
    res.replica_max_abs_diff = spread;
  }
  if (!o_.dump_params_path.empty()) {
    const std::vector<float> g = global_params(full);
    if (comm_.rank() == 0) {
      std::ofstream f(o_.dump_params_path, std::ios::binary);
      f.write(reinterpret_cast<const char*>(g.data()), static_cast<std::streamsize>(g.size() * sizeof(float)));
      if (!f) throw InputError("--dump-params: cannot write '" + o_.dump_params_path + "'");
    }
  }
  if (!o_.trace_path.empty()) {
    std::ostringstream os;
    for (const TraceEvent& e : trace_) {
      os << ",\n{\"name\":\"" << e.name << "\",\"ph\":\"X\",\"pid\":" << comm_.rank() << ",\"tid\":" << e.tid
         << ",\"ts\":" << e.ts * 1e6 << ",\"dur\":" << e.dur * 1e6 << ",\"args\":{\"microbatch\":" << e.mb
         << ",\"chunk\":" << e.chunk << "}}";
    }
    const std::vector<std::string> parts = comm_.gather_strings(os.str(), 0);
    if (comm_.rank() == 0) {
      std::ofstream f(o_.trace_path);
      f << "{\"traceEvents\":[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"args\":{\"name\":\"rank 0\"}}";
      for (int r = 1; r < comm_.size(); ++r)
        f << ",\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << r << ",\"args\":{\"name\":\"rank " << r << "\"}}";
      for (const std::string& s : parts) f << s;
      f << "\n]}\n";
      if (!f) throw InputError("--trace: cannot write '" + o_.trace_path + "'");
    }
  }
  return res;
}

}  // namespace

TrainResult train(const ModelSpec& m, const Plan& p, const TrainOptions& o, Comm& comm, Backend& be) {
  validate_train_plan(m, p, comm.size());
  Engine e(m, p, o, comm, be);
  return e.run();
}

Json train_result_to_json(const TrainResult& r) {
  Json j;
  j["plan"] = plan_to_json(r.plan);
  j["world_size"] = r.world_size;
  j["backend"] = "cpu";
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
  j["time_s"] = {{"forward", r.forward_s},   {"backward", r.backward_s},   {"recompute", r.recompute_s},
                 {"optimizer", r.optimizer_s}, {"tp_comm", r.tp_comm_s},   {"pp_comm", r.pp_comm_s},
                 {"dp_comm", r.dp_comm_s},   {"dp_comm_in_flight", r.dp_comm_total_s},
                 {"dp_comm_standalone", r.dp_comm_standalone_s}, {"dp_skew", r.dp_skew_s},
                 {"pipeline_bubble", r.pipeline_bubble_s}};
  j["replica_max_abs_diff"] = r.replica_max_abs_diff;
  if (r.entropy_rate_nats >= 0) j["entropy_rate_nats"] = r.entropy_rate_nats;
  j["model_flops_per_step"] = r.model_flops_per_step;
  const double med = r.median_step_time_s > 0 ? r.median_step_time_s : 1.0;
  j["model_flops_per_s_per_rank"] = r.model_flops_per_step / med / r.world_size;
  return j;
}

}  // namespace strata
