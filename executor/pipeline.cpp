// The pipeline walk of the engine: one step is this stage's list of the cost model's
// schedule (costmodel/schedule.h), each entry the forward or backward of one (chunk,
// micro-batch): receive the input from the previous stage (or embed the tokens), run the
// chunk's layers, send the output on (or compute the loss). Messages are tagged by
// (micro-batch, chunk, direction), sends are non-blocking and kept until done.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "costmodel/simulate.h"
#include "executor/engine.h"

namespace strata {

namespace {

// The context of the i-th layer of a model chunk: with full recompute of
// recompute_num_layers = k > 0, Megatron's block method recomputes the first k layers of
// every chunk and keeps everything of the others (as costmodel/estimate.cpp counts them).
ModelCtx chunk_layer_ctx(const ModelCtx& c, size_t i) {
  ModelCtx ci = c;
  if (c.recompute == Recompute::full && c.recompute_layers > 0 && static_cast<int64_t>(i) >= c.recompute_layers)
    ci.recompute = Recompute::none;
  return ci;
}

}  // namespace

namespace {
int tag_of(int64_t mb, int64_t chunk, int64_t v, bool backward) {
  return static_cast<int>(((mb * v + chunk) * 2) + (backward ? 1 : 0));
}
}  // namespace

void Engine::forward_step(int64_t k, const Step& st, double* loss_sum) {
  trace_mb_ = st.mb;  // for the collectives' trace slices
  trace_chunk_ = st.chunk;
  if (ops_) ops_->set_phase("forward");
  const ModelCtx c = ctx();
  const int64_t p = plan_.p, v = plan_.v, vs = st.chunk * p + me_.pp, last = p * v - 1;
  MicroState& ms = micro_[{st.chunk, st.mb}];
  const int64_t H = m_.H, rows = c.n();
  Buf x;
  if (vs == 0 || vs == last) {
    data_.micro_batch(k, plan_.gbs, plan_.d, me_.dp, st.mb, plan_.mbs, &ms.tokens, &ms.targets);
    if (plan_.c > 1) {  // this context-parallel rank's two chunks of each sequence (gpt.h)
      const int64_t S = m_.S, Sc = S / (2 * plan_.c), chunks[2] = {me_.cp, 2 * plan_.c - 1 - me_.cp};
      for (std::vector<int32_t>* v : {&ms.tokens, &ms.targets}) {
        std::vector<int32_t> mine(static_cast<size_t>(plan_.mbs * 2 * Sc));
        for (int64_t b = 0; b < plan_.mbs; ++b)
          for (int64_t k2 = 0; k2 < 2; ++k2)
            std::copy_n(v->begin() + b * S + chunks[k2] * Sc, Sc, mine.begin() + (b * 2 + k2) * Sc);
        *v = std::move(mine);
      }
    }
  }
  const auto& layers = chunk_layers_[static_cast<size_t>(st.chunk)];
  if (vs == 0) {
    const double t0 = now(), tp0 = tp_s_, dp0 = dp_s_;
    // ZeRO-3 gathers run one unit ahead across the embedding, the layers and the head.
    if (!layers.empty()) prefetch(layer_unit_.at(layers.front()));
    UnitView wpe;
    if (wpe_unit_ >= 0) wpe = weights_view(wpe_unit_);
    {
      const OpScope op(c.ops, "embedding");
      x = embedding_forward(c, weights_view(wte_unit_), wpe_unit_ >= 0 ? &wpe : nullptr, ms.tokens.data());
    }
    release_weights(wte_unit_);
    if (wpe_unit_ >= 0) release_weights(wpe_unit_);
    forward_s_ += now() - t0 - (tp_s_ - tp0) - (dp_s_ - dp0);
  } else {
    x = c.act(rows * H);
    const int64_t src = (me_.pp + p - 1) % p;
    const double t0 = now();
    Request r = comm_.irecv(x.data(), rows * H, pp_.ranks[static_cast<size_t>(src)], tag_of(st.mb, st.chunk, v, false));
    wait_polling(r);
    bubble_s_ += now() - t0;
    event("recv activations", 1, t0, now(), st.mb, st.chunk);
  }
  ms.layers.resize(layers.size());
  const double t0 = now(), tp0 = tp_s_, dp0 = dp_s_, cp0 = cp_s_;
  for (size_t i = 0; i < layers.size(); ++i) {
    const int u = layer_unit_.at(layers[i]);
    weights(u);
    if (i + 1 < layers.size()) prefetch(layer_unit_.at(layers[i + 1]));
    else if (vs == last) prefetch_head();
    trace_layer_ = layers[i];
    const double l0 = tracing() ? now() : 0.0;
    x = layer_forward(chunk_layer_ctx(c, i), weights_view(u), layers[i], std::move(x), &ms.layers[i]);
    if (tracing()) event("layer forward", 0, l0, now(), st.mb, st.chunk, layers[i]);
    release_weights(u);
    poll();
  }
  trace_layer_ = -1;
  if (vs == last) {
    const float* w = weights(head_w_unit_);
    const TensorKind k_out = m_.tie_embeddings ? TensorKind::wte : TensorKind::lm_head;
    const float* out_w = w + (lay_.at(k_out).offset - lay_.units[static_cast<size_t>(head_w_unit_)].begin);
    {
      const OpScope op(c.ops, "output_layer");  // final norm, logits and loss
      *loss_sum += head_forward(c, weights_view(final_unit_), out_w, std::move(x), ms.targets.data(), &ms.head);
    }
    release_weights(final_unit_);
    release_weights(head_w_unit_);
  }
  const double t1 = now();
  forward_s_ += t1 - t0 - (tp_s_ - tp0) - (dp_s_ - dp0) - (cp_s_ - cp0);
  event("forward", 0, t0, t1, st.mb, st.chunk);
  if (vs != last) {
    const int64_t dst = (me_.pp + 1) % p, dchunk = st.chunk + (me_.pp == p - 1 ? 1 : 0);
    const double s0 = now();
    Pending snd;
    snd.req = comm_.isend(x.data(), x.size(), pp_.ranks[static_cast<size_t>(dst)], tag_of(st.mb, dchunk, v, false));
    snd.keep = std::move(x);
    sends_.push_back(std::move(snd));
    const double s1 = now();
    pp_s_ += s1 - s0;
    event("send activations", 1, s0, s1, st.mb, st.chunk);
  }
}

void Engine::backward_step(const Step& st) {
  trace_mb_ = st.mb;  // for the collectives' trace slices
  trace_chunk_ = st.chunk;
  if (ops_) ops_->set_phase("backward");
  const ModelCtx c = ctx();
  const int64_t p = plan_.p, v = plan_.v, vs = st.chunk * p + me_.pp, last = p * v - 1;
  MicroState& ms = micro_.at({st.chunk, st.mb});
  const int64_t H = m_.H, rows = c.n();
  const float dloss = static_cast<float>(loss_scale_ / static_cast<double>(plan_.gbs * m_.S));
  Buf dx;
  double t0 = now(), tp0 = tp_s_, dp0 = dp_s_, cp0 = cp_s_;
  const double rc0 = recompute_s_;
  const auto& layers = chunk_layers_[static_cast<size_t>(st.chunk)];
  if (vs == last) {
    if (!layers.empty()) prefetch(layer_unit_.at(layers.back()));
    const float* w = weights(head_w_unit_);
    const TensorKind k_out = m_.tie_embeddings ? TensorKind::wte : TensorKind::lm_head;
    const int64_t rel = lay_.at(k_out).offset - lay_.units[static_cast<size_t>(head_w_unit_)].begin;
    float* gw = grads(head_w_unit_) + rel;
    {
      const OpScope op(c.ops, "output_layer");
      dx = head_backward(c, view(final_unit_), w + rel, gw, &ms.head, dloss);
    }
    release_weights(final_unit_);
    release_weights(head_w_unit_);
    unit_done(final_unit_);
    if (head_w_unit_ != final_unit_ && head_w_unit_ != wte_unit_) unit_done(head_w_unit_);
  } else {
    dx = c.f32(rows * H);
    const int64_t src = (me_.pp + 1) % p;
    const double r0 = now();
    Request r = comm_.irecv(dx.data(), rows * H, pp_.ranks[static_cast<size_t>(src)], tag_of(st.mb, st.chunk, v, true));
    wait_polling(r);
    bubble_s_ += now() - r0;
    event("recv gradients", 1, r0, now(), st.mb, st.chunk);
    t0 = now();
    tp0 = tp_s_;
    dp0 = dp_s_;
    cp0 = cp_s_;
  }
  for (size_t i = layers.size(); i-- > 0;) {
    const int u = layer_unit_.at(layers[i]);
    weights(u);
    if (i > 0) prefetch(layer_unit_.at(layers[i - 1]));
    else if (vs == 0) prefetch_embedding();
    trace_layer_ = layers[i];
    const double l0 = tracing() ? now() : 0.0;
    dx = layer_backward(chunk_layer_ctx(c, i), view(u), layers[i], &ms.layers[i], dx);
    // Its recompute, if any, is a slice inside it (ModelCtx::on_recompute).
    if (tracing()) event("layer backward", 0, l0, now(), st.mb, st.chunk, layers[i]);
    release_weights(u);
    unit_done(u);
    poll();
  }
  trace_layer_ = -1;
  if (vs == 0) {
    UnitView wpe;
    if (wpe_unit_ >= 0) wpe = view(wpe_unit_);
    {
      const OpScope op(c.ops, "embedding");
      embedding_backward(c, view(wte_unit_), wpe_unit_ >= 0 ? &wpe : nullptr, ms.tokens.data(), dx);
    }
    release_weights(wte_unit_);
    if (wpe_unit_ >= 0) release_weights(wpe_unit_);
    unit_done(wte_unit_);
    if (wpe_unit_ >= 0) unit_done(wpe_unit_);
  }
  const double t1 = now();
  // Compute only: tensor- and data-parallel calls and the recompute are their own terms.
  backward_s_ += t1 - t0 - (tp_s_ - tp0) - (dp_s_ - dp0) - (recompute_s_ - rc0) - (cp_s_ - cp0);
  event("backward", 0, t0, t1, st.mb, st.chunk);
  if (vs != 0) {
    const int64_t dst = (me_.pp + p - 1) % p, dchunk = st.chunk - (me_.pp == 0 ? 1 : 0);
    Pending snd;
    const double s0 = tracing() ? now() : 0.0;
    snd.req = comm_.isend(dx.data(), dx.size(), pp_.ranks[static_cast<size_t>(dst)], tag_of(st.mb, dchunk, v, true));
    snd.keep = std::move(dx);
    sends_.push_back(std::move(snd));
    if (tracing()) event("send gradients", 1, s0, now(), st.mb, st.chunk);
  }
  micro_.erase({st.chunk, st.mb});
}

namespace {

// The latest start over g of each of the step's collectives (launch: this rank's, seconds
// from its step start), in place. Empty when the members did not record the same number
// (which would be a bug: the first all-reduce checks it, so the second cannot mismatch).
void latest_over(Comm& comm, std::vector<double>* launch, const Group& g) {
  const double n = static_cast<double>(launch->size());
  double count[2] = {n, -n};
  comm.all_reduce(count, 2, g, ReduceOp::max);
  if (count[0] != n || -count[1] != n || launch->empty()) {
    launch->clear();
    return;
  }
  comm.all_reduce(launch->data(), static_cast<int64_t>(launch->size()), g, ReduceOp::max);
}

}  // namespace

// Of this step's waits on group g's collectives, the seconds spent before the last member
// started the collective: it could not have finished earlier whatever the link, so that
// part is skew, not communication. Collective over g (the members recorded the same
// collectives in the same order); times are taken from the step's start on each rank (the
// step starts from a barrier), so the ranks' clocks need not agree.
double Engine::skew_of(CommWaits* w, const Group& g) {
  double skew = 0;
  if (g.size() > 1) {
    std::vector<double> latest(w->launch.size());
    for (size_t i = 0; i < latest.size(); ++i) latest[i] = w->launch[i] - step_start_;
    latest_over(comm_, &latest, g);
    for (const CommWaits::Wait& x : w->waits)
      if (static_cast<size_t>(x.idx) < latest.size())
        skew += std::clamp(latest[static_cast<size_t>(x.idx)] - (x.begin - step_start_), 0.0, x.end - x.begin);
  }
  w->new_step();
  return skew;
}

// The measured bubble (the receives a stage waited for, and an end stage's wait for the
// other at the tied embedding) holds what the schedule implies -- a stage waits for its
// input while the stages before it compute -- and what it does not: steps of unequal length,
// and lag (a slower peer, the transfer, a late wake-up). Replaying the step's schedule
// through the cost model's walk (simulate_steps) with every stage's measured busy times
// separates them: with each (chunk, direction)'s mean over the micro-batches the idle time
// is the schedule's (the cost model's mechanism at this run's compute); with each step's own
// time, minus that, the variation; the rest of the measured bubble is lag. Collective over
// the world; the busy times are the maxima over the ranks of a stage.
void Engine::bubble_split() {
  bubble_schedule_s_ = bubble_variation_s_ = 0;
  const int64_t p = plan_.p;
  if (p <= 1) return;
  const size_t n = step_busy_.size(), me = static_cast<size_t>(me_.pp);
  std::vector<double> all(static_cast<size_t>(p) * n, 0.0);
  std::copy(step_busy_.begin(), step_busy_.end(), all.begin() + static_cast<std::ptrdiff_t>(me * n));
  comm_.all_reduce(all.data(), static_cast<int64_t>(all.size()), world_, ReduceOp::max);
  std::vector<std::vector<double>> actual(static_cast<size_t>(p)), mean(static_cast<size_t>(p));
  const size_t v = static_cast<size_t>(schedule_.v);
  for (size_t s = 0; s < static_cast<size_t>(p); ++s) {
    actual[s].assign(all.begin() + static_cast<std::ptrdiff_t>(s * n), all.begin() + static_cast<std::ptrdiff_t>((s + 1) * n));
    std::vector<double> sum(2 * v, 0.0), count(2 * v, 0.0);
    const auto& list = schedule_.stages[s];
    auto slot = [&](const Step& st) { return static_cast<size_t>(st.chunk) * 2 + (st.forward ? 0 : 1); };
    for (size_t k = 0; k < n; ++k) {
      sum[slot(list[k])] += actual[s][k];
      count[slot(list[k])] += 1;
    }
    mean[s].resize(n);
    for (size_t k = 0; k < n; ++k) mean[s][k] = sum[slot(list[k])] / count[slot(list[k])];
  }
  // A stage's idle time: the gaps before its steps, and for an end stage holding a tied
  // embedding the wait for the other end stage (finish_gradients counts both as bubble).
  auto idle = [&](const SimResult& r) {
    double gaps = r.end_s[me] - r.compute_s[me];
    if (m_.tie_embeddings && (me == 0 || me == static_cast<size_t>(p - 1)))
      gaps += std::max(r.end_s[0], r.end_s[static_cast<size_t>(p - 1)]) - r.end_s[me];
    return gaps;
  };
  const double at_mean = idle(simulate_steps(schedule_, mean)), at_actual = idle(simulate_steps(schedule_, actual));
  bubble_schedule_s_ = at_mean;
  bubble_variation_s_ = at_actual - at_mean;
}

double Engine::run_step(int64_t k, StepRecord* rec) {
  forward_s_ = backward_s_ = recompute_s_ = optimizer_s_ = tp_s_ = cp_s_ = pp_s_ = dp_s_ = bubble_s_ = 0;
  dp_intervals_.clear();
  const double t_start = now();  // the step starts from a barrier on every rank
  step_start_ = t_start;
  for (CommWaits* w : {&tp_waits_, &cp_waits_, &dp_waits_}) w->new_step();
  if (zero_ < 2) grad_full_.zero();
  if (zero_ >= 1) grad_shard_.zero();
  std::fill(done_count_.begin(), done_count_.end(), 0);
  early_split_.assign(lay_.units.size(), 0);
  double loss_sum = 0;
  bool injected = false;
  const auto& list = schedule_.stages[static_cast<size_t>(me_.pp)];
  step_busy_.assign(list.size(), 0.0);
  size_t pos = 0;
  for (const Step& st : list) {
    if (!st.forward && !injected) {  // injected faults strike mid-step, with peers waiting
      injected = true;
      const int r = comm_.rank();
      using K = FaultInjection::Kind;
      if (o_.fault.at(r, k + 1, K::kill)) inject_kill();
      if (o_.fault.at(r, k + 1, K::hang)) inject_hang();
      if (o_.fault.at(r, k + 1, K::throw_exception)) inject_throw(r, k + 1);
      if (o_.fault.at(r, k + 1, K::slow)) inject_slow();
    }
    const double b0 = now(), w0 = bubble_s_;
    if (st.forward) forward_step(k, st, &loss_sum);
    else backward_step(st);
    step_busy_[pos++] = (now() - b0) - (bubble_s_ - w0);
  }
  // The last sends complete when their receivers reach the matching step: idle time
  // waiting on a peer (the cool-down of the schedule), so it counts as bubble.
  wait_pending(&sends_, &bubble_s_);
  finish_gradients();
  optimizer_step(rec);
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

}  // namespace strata
