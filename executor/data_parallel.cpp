// Data parallelism and ZeRO inside the engine: where a unit's weights and gradients live
// (the flat buffers, or ZeRO-3 gathered copies with prefetch), the per-unit gradient
// reductions started during the backward and polled so MPI progresses, the end-of-step
// sums (tied embeddings, sequence-parallel replicas), and the optimizer step on the owned
// shard with its all-gather.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <limits>

#include "executor/engine.h"

namespace strata {

const float* Engine::weights(int u) {
  const size_t su = static_cast<size_t>(u);
  if (zero_ < 3) return work_.data() + sh_.full_off[su];
  auto it = gathered_.find(u);
  if (it != gathered_.end()) {
    auto pf = prefetching_.find(u);
    if (pf != prefetching_.end()) {
      const double t0 = now();
      comm_.wait(pf->second.req);
      const double t1 = now();
      dp_s_ += t1 - t0;
      dp_waits_.waited(pf->second.idx, t0, t1);
      prefetching_.erase(pf);
    }
    return it->second.data();
  }
  Buf b(&mem_, MemCategory::comm_buffers, sh_.padded(su), kWeightBytes);
  const double t0 = now();
  comm_.all_gather(work_shard_.data() + sh_.shard_off[su], b.data(), sh_.shard[su], dp_);
  const double t1 = now();
  dp_s_ += t1 - t0;
  dp_waits_.waited(dp_waits_.launched(t0), t0, t1);
  dp_intervals_.push_back({t0, t1});
  event("all_gather params", 1, t0, t1);
  return gathered_.emplace(u, std::move(b)).first->second.data();
}

void Engine::prefetch(int u) {
  if (zero_ < 3 || u < 0 || u >= static_cast<int>(lay_.units.size()) || gathered_.count(u)) return;
  const size_t su = static_cast<size_t>(u);
  Buf b(&mem_, MemCategory::comm_buffers, sh_.padded(su), kWeightBytes);
  Prefetch& pf = prefetching_[u];
  pf.idx = dp_waits_.launched(comm_.wtime());
  pf.req = comm_.iall_gather(work_shard_.data() + sh_.shard_off[su], b.data(), sh_.shard[su], dp_);
  gathered_.emplace(u, std::move(b));
}

void Engine::prefetch_head() {
  prefetch(final_unit_);
  prefetch(head_w_unit_);
}

void Engine::prefetch_embedding() {
  prefetch(wte_unit_);
  prefetch(wpe_unit_);
}

void Engine::release_weights(int u) {
  if (zero_ < 3) return;
  auto pf = prefetching_.find(u);
  if (pf != prefetching_.end()) {
    comm_.wait(pf->second.req);
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
      if (comm_.test(p.req)) dp_intervals_.push_back({p.start, comm_.wtime()});  // no device sync when polling
  add_completed_blocks();
  for (Pending& p : sends_)
    if (p.req.pending() && comm_.test(p.req)) p.keep.release();
}

// Adds finished ZeRO-2/3 blocks into the owned gradient shard, oldest first, stopping at
// the first one still in flight; frees what they held.
void Engine::add_completed_blocks() {
  for (Pending& p : dp_pending_) {
    if (!p.into || p.added) continue;
    if (p.req.pending()) return;
    be_.add(p.into, p.into, p.block.data(), p.block.size());
    p.added = true;
    p.keep.release();
    p.block.release();
  }
}

void Engine::wait_pending(std::vector<Pending>* list, double* exposed) {
  if (list->empty()) return;
  const double t0 = now();
  for (Pending& p : *list) {
    if (!p.req.pending()) continue;
    const double w0 = now();
    comm_.wait(p.req);
    const double w1 = now();
    if (list == &dp_pending_) {
      dp_intervals_.push_back({p.start, w1});
      dp_waits_.waited(p.idx, w0, w1);
    }
  }
  if (list == &dp_pending_) add_completed_blocks();
  list->clear();
  const double t1 = now();
  *exposed += t1 - t0;
  event(list == &dp_pending_ ? "wait dp reduction" : "wait sends", 1, t0, t1);
}

// A unit's gradient of one micro-batch is complete.
void Engine::unit_done(int u) {
  const size_t su = static_cast<size_t>(u);
  if (zero_ >= 2) {  // reduce-scatter this micro-batch's gradient into the owned block
    // Started now, progressed by poll() between the GEMMs of the layers before it, and
    // added into the owned block when done (add_completed_blocks).
    // At most one in flight: the previous one (long done, usually: it ran behind this
    // unit's backward) completes first, so no more than two units' gradients are held.
    const double w0 = now();
    bool waited = false;
    for (Pending& q : dp_pending_)
      if (q.into && q.req.pending()) {
        const double q0 = now();
        comm_.wait(q.req);
        const double q1 = now();
        dp_intervals_.push_back({q.start, q1});
        dp_waits_.waited(q.idx, q0, q1);
        waited = true;
      }
    if (waited) {
      const double w1 = now();
      dp_s_ += w1 - w0;
      event("wait dp reduction", 1, w0, w1);
    }
    add_completed_blocks();
    Pending p;
    p.start = now();
    p.keep = std::move(grad_tmp_.at(u));
    grad_tmp_.erase(u);
    p.block = Buf::untracked(&be_, sh_.shard[su]);
    p.into = grad_shard_.data() + sh_.shard_off[su];
    p.idx = dp_waits_.launched(p.start);
    p.req = comm_.ireduce_scatter(p.keep.data(), p.block.data(), sh_.shard[su], dp_);
    dp_pending_.push_back(std::move(p));
    return;
  }
  if (++done_count_[su] < mb_count_ || replicas_ == 1) {
    if (done_count_[su] == mb_count_ && zero_ == 1)  // d == 1: the block is the whole unit
      be_.copy(grad_shard_.data() + sh_.shard_off[su], grad_full_.data() + sh_.full_off[su], sh_.shard[su]);
    return;
  }
  Pending p;
  p.start = now();
  float* g = grad_full_.data() + sh_.full_off[su];
  p.idx = dp_waits_.launched(p.start);
  if (zero_ == 0) p.req = comm_.iall_reduce(g, early_split_[su] > 0 ? early_split_[su] : sh_.padded(su), dp_);
  else p.req = comm_.ireduce_scatter(g, grad_shard_.data() + sh_.shard_off[su], sh_.shard[su], dp_);
  dp_pending_.push_back(std::move(p));
}

// Without ZeRO, a layer's MLP gradients (the end of its unit) start their all-reduce as
// soon as the last micro-batch's MLP backward is done; unit_done reduces the rest.
void Engine::mlp_done(int64_t layer) {
  const int u = layer_unit_.at(layer);
  const size_t su = static_cast<size_t>(u);
  if (zero_ != 0 || replicas_ == 1 || done_count_[su] + 1 < mb_count_) return;
  const int64_t split = lay_.at(TensorKind::ln2_w, layer).offset - lay_.units[su].begin;
  Pending p;
  p.start = now();
  float* g = grad_full_.data() + sh_.full_off[su];
  p.idx = dp_waits_.launched(p.start);
  p.req = comm_.iall_reduce(g + split, sh_.padded(su) - split, dp_);
  dp_pending_.push_back(std::move(p));
  early_split_[su] = split;
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
    // First meet the other stage (the one that finished its backward earlier waits here:
    // the pipeline's cool-down, so bubble), then sum (communication, in the data-parallel
    // tail as the cost model has it).
    const double t0 = now();
    double one = 1;
    comm_.all_reduce(&one, 1, emb_);
    const double t1 = now();
    bubble_s_ += t1 - t0;
    comm_.all_reduce(g + sh_.shard_off[u], sh_.shard[u], emb_);
    dp_s_ += now() - t1;
  }
  // Sequence parallelism leaves the replicated tensors' gradients partial per tp rank.
  if (plan_.sp && plan_.t > 1) {
    const double t0 = now();
    for (size_t u = 0; u < lay_.units.size(); ++u) {
      const int64_t lo = sh_.me * sh_.shard[u], b = lay_.units[u].begin;
      for (const TensorSlot& s : lay_.tensors) {
        if (!s.tp_replicated || s.offset < b || s.offset >= lay_.units[u].end) continue;
        const int64_t a = std::max(lo, s.offset - b), e = std::min(lo + sh_.shard[u], s.offset - b + s.size());
        if (a < e) comm_.all_reduce(g + sh_.shard_off[u] + (a - lo), e - a, tp_);
      }
    }
    tp_s_ += now() - t0;
  }
}

void Engine::optimizer_step(StepRecord* rec) {
  const double t0 = now();
  float* g = zero_ == 0 ? grad_full_.data() : grad_shard_.data();
  if (o_.fault.at(comm_.rank(), rec->step, FaultInjection::Kind::nan) && sh_.shard_size > 0) {
    const float nan = std::numeric_limits<float>::quiet_NaN();  // injected: this rank's gradients turn NaN
    be_.to_device(g, &nan, 1);
  }
  double acc[2] = {0.0, 0.0};  // sum of squares, non-finite count
  be_.grad_norm_terms(g, FlagBits{counted_mask_.data(), 0}, sh_.shard_size, acc);
  comm_.all_reduce(acc, 2, world_);
  const double norm = std::sqrt(acc[0]) / loss_scale_;
  rec->loss_scale = loss_scale_;
  rec->grad_norm = norm;
  if (acc[1] > 0) {  // NaN/Inf (fp16: overflow): skip the step, halve the scale
    rec->skipped = true;
    rec->grad_norm = std::numeric_limits<double>::quiet_NaN();
    loss_scale_ = std::max(1.0, loss_scale_ / 2.0);
    good_steps_ = 0;
    optimizer_s_ += now() - t0;
    return;
  }
  if (plan_.precision == Precision::fp16 && ++good_steps_ % o_.loss_scale_window == 0) loss_scale_ *= 2.0;
  ++adam_step_;
  const double clip = o_.clip_grad > 0 && norm > o_.clip_grad ? o_.clip_grad / (norm + 1e-6) : 1.0;
  const float mul = static_cast<float>(clip / rec->loss_scale);
  const int64_t warmup = o_.warmup >= 0 ? o_.warmup : std::max<int64_t>(10, o_.steps / 10);
  // Like Megatron's scheduler, the learning rate advances with the updates applied: a step
  // skipped for fp16 overflow moves neither the schedule nor Adam's bias correction.
  const double lr = learning_rate(adam_step_ - 1, warmup, o_.steps, o_.lr, o_.min_lr);
  AdamW opt;
  opt.weight_decay = o_.weight_decay;
  for (size_t u = 0; u < lay_.units.size(); ++u) {
    const int64_t off = sh_.shard_off[u];
    const float* gu = zero_ == 0 ? g + sh_.full_off[u] : g + off;
    be_.adamw(master_block(u), gu, adam_m_.data() + off, adam_v_.data() + off, FlagBits{decay_mask_.data(), off}, sh_.shard[u],
              opt, lr, adam_step_, mul);
  }
  if (o_.fault.at(comm_.rank(), rec->step, FaultInjection::Kind::bitflip)) {
    // Injected silent data corruption: mantissa bit 10 of the rank's first owned weight (a
    // change of 2^-14 to 2^-13 of it; the lowest bit's 2^-23 can vanish in the rounding of the next
    // update, which then leaves the replicas alike again).
    for (size_t u = 0; u < lay_.units.size(); ++u) {
      if (sh_.shard[u] == 0) continue;
      float x = 0;
      be_.to_host(&x, master_block(u), 1);
      uint32_t bits = 0;
      std::memcpy(&bits, &x, 4);
      bits ^= 1u << 10;
      std::memcpy(&x, &bits, 4);
      be_.to_device(master_block(u), &x, 1);
      break;
    }
  }
  // Working weights: round the owned block (mixed precision), then all-gather it (ZeRO 1, 2).
  if (mixed()) {
    for (size_t u = 0; u < lay_.units.size(); ++u) {
      float* dst = zero_ == 3 ? work_shard_.data() + sh_.shard_off[u] : work_.data() + sh_.full_off[u] + sh_.me * sh_.shard[u];
      be_.round_copy(dst, master_.data() + sh_.shard_off[u], sh_.shard[u], plan_.precision);
    }
  }
  const double t1 = now();
  optimizer_s_ += t1 - t0;
  event("optimizer", 0, t0, t1);
  if ((zero_ == 1 || zero_ == 2) && replicas_ > 1) {
    for (size_t u = 0; u < lay_.units.size(); ++u) {
      float* full = work_.data() + sh_.full_off[u];
      comm_.all_gather(full + sh_.me * sh_.shard[u], full, sh_.shard[u], dp_);
    }
    const double t2 = now();
    dp_s_ += t2 - t1;
    dp_waits_.waited(dp_waits_.launched(t1), t1, t2);  // the gathers, one after another, as one wait
    dp_intervals_.push_back({t1, t2});
    event("all_gather params", 1, t1, t2);
  }
}

std::vector<float> Engine::full_fp32_params() {
  return full_of([this](size_t u) -> const float* { return master_block(u); });
}

std::vector<float> Engine::full_of(const std::function<const float*(size_t)>& block) {
  // Gathered in the backend's memory (where the communicator works), then copied out.
  Buf gathered = Buf::untracked(&be_, sh_.full_size);
  for (size_t u = 0; u < lay_.units.size(); ++u) {
    float* f = gathered.data() + sh_.full_off[u];
    be_.copy(f + sh_.me * sh_.shard[u], block(u), sh_.shard[u]);
    if (sh_.dz > 1) comm_.all_gather(f + sh_.me * sh_.shard[u], f, sh_.shard[u], dp_);
  }
  std::vector<float> full(static_cast<size_t>(sh_.full_size), 0.0f);
  be_.to_host(full.data(), gathered.data(), sh_.full_size);
  return full;
}

std::vector<float> Engine::global_params(const std::vector<float>& full) {
  const ParamLayout g = global_param_layout(m_);
  std::vector<float> out(static_cast<size_t>(g.size), 0.0f);
  const bool writer = dp_.me == 0;  // one replica of each parameter (data x context parallel)
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

}  // namespace strata
