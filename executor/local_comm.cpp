// Comm for a world of one rank without MPI: every collective over a group of one is a
// copy or nothing. Single-process tests and tools use it; LeakSanitizer then sees only
// strata's own allocations (Open MPI keeps its own until exit).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "executor/comm.h"

namespace strata {
namespace {

class LocalComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void setup(const ProcessGrid&) override {}
  void all_reduce(float*, int64_t, const Group&, ReduceOp) override {}
  void all_reduce(double*, int64_t, const Group&, ReduceOp) override {}
  void reduce_scatter(const float* in, float* out, int64_t n_out, const Group&) override {
    if (in != out) std::copy(in, in + n_out, out);
  }
  void all_gather(const float* in, float* out, int64_t n_in, const Group&) override {
    if (in != out) std::copy(in, in + n_in, out);
  }
  void broadcast(float*, int64_t, int, const Group&) override {}
  void barrier(const Group&) override {}
  Request isend(const float*, int64_t, int, int) override { return none(); }
  Request irecv(float*, int64_t, int, int) override { return none(); }
  Request iall_reduce(float*, int64_t, const Group&) override { return {}; }
  Request ireduce_scatter(const float* in, float* out, int64_t n_out, const Group& g) override {
    reduce_scatter(in, out, n_out, g);
    return {};
  }
  Request iall_gather(const float* in, float* out, int64_t n_in, const Group& g) override {
    all_gather(in, out, n_in, g);
    return {};
  }
  bool test(Request&) override { return true; }
  void wait(Request&) override {}
  double wtime() const override {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  std::vector<std::string> gather_strings(const std::string& s, int) override { return {s}; }

 private:
  // A single rank has no peer: point-to-point use is a programming error.
  static Request none() {
    std::fprintf(stderr, "strata: internal error: send/recv on a world of one rank\n");
    std::abort();
  }
};

}  // namespace

std::unique_ptr<Comm> make_local_comm() { return std::make_unique<LocalComm>(); }

}  // namespace strata
