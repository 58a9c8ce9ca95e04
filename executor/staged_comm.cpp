// The host-staged communicator; see staged_comm.h.
#include "executor/staged_comm.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace strata {
namespace {

class StagedComm final : public Comm {
 public:
  StagedComm(std::unique_ptr<Comm> inner, StagingCopier copier) : in_(std::move(inner)), cp_(std::move(copier)) {
    if (!in_ || !cp_.to_host || !cp_.to_device) throw std::invalid_argument("staged communicator: missing inner comm or copier");
  }
  int rank() const override { return in_->rank(); }
  int size() const override { return in_->size(); }
  void setup(const ProcessGrid& grid) override { in_->setup(grid); }

  void all_reduce(float* buf, int64_t n, const Group& g, ReduceOp op) override {
    if (g.size() == 1) return;  // as the inner communicators: nothing to combine
    std::vector<float> h = down(buf, n);
    in_->all_reduce(h.data(), n, g, op);
    up(buf, h);
  }
  void all_reduce(double* buf, int64_t n, const Group& g, ReduceOp op) override {
    if (g.size() == 1) return;
    std::vector<double> h(static_cast<size_t>(n));
    cp_.to_host(h.data(), buf, bytes_of(h));
    in_->all_reduce(h.data(), n, g, op);
    cp_.to_device(buf, h.data(), bytes_of(h));
  }
  void reduce_scatter(const float* in, float* out, int64_t n_out, const Group& g) override {
    std::vector<float> h_in = down(in, n_out * g.size()), h_out(static_cast<size_t>(n_out));
    in_->reduce_scatter(h_in.data(), h_out.data(), n_out, g);
    up(out, h_out);
  }
  void all_gather(const float* in, float* out, int64_t n_in, const Group& g) override {
    // in may be this rank's block of out: staged separately, so no aliasing on the host.
    std::vector<float> h_in = down(in, n_in), h_out(static_cast<size_t>(n_in * g.size()));
    in_->all_gather(h_in.data(), h_out.data(), n_in, g);
    up(out, h_out);
  }
  void broadcast(float* buf, int64_t n, int root_index, const Group& g) override {
    std::vector<float> h = down(buf, n);
    in_->broadcast(h.data(), n, root_index, g);
    up(buf, h);
  }
  void barrier(const Group& g) override { in_->barrier(g); }

  Request isend(const float* buf, int64_t n, int peer, int tag) override {
    Pending& p = open(nullptr);
    p.host = down(buf, n);
    p.inner = in_->isend(p.host.data(), n, peer, tag);
    return mine(p);
  }
  Request irecv(float* buf, int64_t n, int peer, int tag) override {
    Pending& p = open(buf);
    p.host.assign(static_cast<size_t>(n), 0.0f);
    p.inner = in_->irecv(p.host.data(), n, peer, tag);
    return mine(p);
  }
  Request iall_reduce(float* buf, int64_t n, const Group& g) override {
    Pending& p = open(buf);
    p.host = down(buf, n);
    p.inner = in_->iall_reduce(p.host.data(), n, g);
    return mine(p);
  }
  Request ireduce_scatter(const float* in, float* out, int64_t n_out, const Group& g) override {
    Pending& p = open(out);
    p.send = down(in, n_out * g.size());
    p.host.assign(static_cast<size_t>(n_out), 0.0f);
    p.inner = in_->ireduce_scatter(p.send.data(), p.host.data(), n_out, g);
    return mine(p);
  }
  Request iall_gather(const float* in, float* out, int64_t n_in, const Group& g) override {
    Pending& p = open(out);
    p.send = down(in, n_in);
    p.host.assign(static_cast<size_t>(n_in * g.size()), 0.0f);
    p.inner = in_->iall_gather(p.send.data(), p.host.data(), n_in, g);
    return mine(p);
  }
  bool test(Request& r) override {
    if (!r.pending()) return true;
    Pending& p = at(r);
    if (!in_->test(p.inner)) return false;
    close(r);
    return true;
  }
  void wait(Request& r) override {
    if (!r.pending()) return;
    in_->wait(at(r).inner);
    close(r);
  }
  double wtime() const override { return in_->wtime(); }
  std::vector<std::string> gather_strings(const std::string& s, int root_rank) override {
    return in_->gather_strings(s, root_rank);
  }
  void start_watchdog(double timeout_s) override { in_->start_watchdog(timeout_s); }
  void set_step(int64_t step) override { in_->set_step(step); }
  void begin_wait(const Request& r) override {
    if (r.pending()) in_->begin_wait(at(r).inner);
  }
  void end_wait() override { in_->end_wait(); }
  void pause() override { in_->pause(); }

 private:
  // A non-blocking call in flight: the inner request, its staging buffers and where the
  // result goes (null for a send).
  struct Pending {
    bool used = false;
    Request inner;
    std::vector<float> host, send;
    float* dest = nullptr;
  };

  template <typename T>
  static size_t bytes_of(const std::vector<T>& v) {
    return v.size() * sizeof(T);
  }
  std::vector<float> down(const float* dev, int64_t n) {
    std::vector<float> h(static_cast<size_t>(n));
    if (n > 0) cp_.to_host(h.data(), dev, bytes_of(h));
    return h;
  }
  void up(float* dev, const std::vector<float>& h) {
    if (!h.empty()) cp_.to_device(dev, h.data(), bytes_of(h));
  }
  Pending& open(float* dest) {
    size_t i = 0;
    while (i < pending_.size() && pending_[i].used) ++i;
    if (i == pending_.size()) pending_.emplace_back();
    Pending& p = pending_[i];
    p.used = true;
    p.dest = dest;
    p.inner = Request{};
    return p;
  }
  Request mine(const Pending& p) { return Request{static_cast<int64_t>(&p - pending_.data())}; }
  Pending& at(const Request& r) {
    if (r.slot < 0 || static_cast<size_t>(r.slot) >= pending_.size() || !pending_[static_cast<size_t>(r.slot)].used)
      throw std::logic_error("staged communicator: unknown request " + std::to_string(r.slot));
    return pending_[static_cast<size_t>(r.slot)];
  }
  // The inner request completed: the result goes back, the staging buffers are dropped.
  void close(Request& r) {
    Pending& p = at(r);
    if (p.dest) up(p.dest, p.host);
    p = Pending{};
    r = Request{};
  }

  std::unique_ptr<Comm> in_;
  StagingCopier cp_;
  std::vector<Pending> pending_;
};

}  // namespace

std::unique_ptr<Comm> make_staged_comm(std::unique_ptr<Comm> inner, StagingCopier copier) {
  return std::make_unique<StagedComm>(std::move(inner), std::move(copier));
}

}  // namespace strata
