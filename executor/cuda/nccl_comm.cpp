// The NCCL communicator; see nccl_comm.h.
#include "executor/cuda/nccl_comm.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <array>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "executor/cuda/check.h"
#include "executor/staged_comm.h"

// Every NCCL call: a failure throws naming the call, the file, the line and NCCL's message.
#define NCCL_CHECK(call)                                                                          \
  do {                                                                                            \
    const ncclResult_t nccl_check_rc_ = (call);                                                   \
    if (nccl_check_rc_ != ncclSuccess)                                                            \
      ::strata::cuda::fail(#call, __FILE__, __LINE__,                                             \
                           std::string(nccl().GetErrorString(nccl_check_rc_)) + " (" +            \
                               std::to_string(static_cast<int>(nccl_check_rc_)) + "): " +         \
                               nccl().GetLastError(nullptr));                                     \
  } while (0)

namespace strata {
namespace {

// NCCL is loaded when first used (libnccl.so.2, from the loader's path: /usr/local/cuda/lib64
// here), not linked: a CUDA build runs where NCCL is missing, with the host-staged
// communicator, and says why `--comm nccl` cannot run.
struct NcclApi {
  std::string missing;  // "" when loaded
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*CommSplit)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  const char* (*GetLastError)(ncclComm_t) = nullptr;

  NcclApi() {
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      missing = std::string("cannot load libnccl.so.2 (") + (e ? e : "not found") + ")";
      return;
    }
    auto get = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (!fn && missing.empty()) missing = std::string("libnccl.so.2 has no ") + name + " (NCCL 2.18 or newer needed)";
    };
    get(GetUniqueId, "ncclGetUniqueId");
    get(CommInitRank, "ncclCommInitRank");
    get(CommSplit, "ncclCommSplit");
    get(CommDestroy, "ncclCommDestroy");
    get(AllReduce, "ncclAllReduce");
    get(ReduceScatter, "ncclReduceScatter");
    get(AllGather, "ncclAllGather");
    get(Broadcast, "ncclBroadcast");
    get(GetErrorString, "ncclGetErrorString");
    get(GetLastError, "ncclGetLastError");
  }
};

const NcclApi& nccl() {
  static const NcclApi api;
  return api;
}

constexpr int kKinds = kGroupKinds;  // kWorld .. kReplica (process_grid.h)

class NcclComm final : public Comm {
 public:
  NcclComm(std::unique_ptr<Comm> inner, CudaBackend& gpu) : gpu_(gpu), inner_(inner.get()) {
    staged_ = make_staged_comm(std::move(inner), gpu.staging_copier());
    compute_ = static_cast<cudaStream_t>(gpu.compute_stream());
    try {
      CUDA_CHECK(cudaSetDevice(gpu.device_ordinal()));
      for (cudaStream_t& s : streams_) CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    } catch (...) {
      release();  // the destructor does not run for a constructor that throws
      throw;
    }
  }
  ~NcclComm() override { release(); }

  int rank() const override { return staged_->rank(); }
  int size() const override { return staged_->size(); }

  void setup(const ProcessGrid& grid) override {
    staged_->setup(grid);  // the inner communicators: barrier, point-to-point, host buffers
    CUDA_CHECK(cudaSetDevice(gpu_.device_ordinal()));
    destroy_comms();  // a second setup() replaces the first one's communicators
    // The unique id travels as floats through the inner broadcast (bytes copied as they are).
    static_assert(sizeof(ncclUniqueId) % sizeof(float) == 0, "ncclUniqueId is a whole number of floats");
    ncclUniqueId id{};
    if (rank() == 0) NCCL_CHECK(nccl().GetUniqueId(&id));
    std::array<float, sizeof(ncclUniqueId) / sizeof(float)> wire{};
    std::memcpy(wire.data(), &id, sizeof(id));
    inner_->broadcast(wire.data(), static_cast<int64_t>(wire.size()), 0, grid.group(kWorld, rank()));
    std::memcpy(&id, wire.data(), sizeof(id));
    NCCL_CHECK(nccl().CommInitRank(&comms_[kWorld], size(), id, rank()));
    for (int kind : {kTensor, kData, kPipeline, kEmbedding, kModel, kContext, kReplica}) {
      const auto groups = grid.all_groups(static_cast<GroupKind>(kind));
      int color = NCCL_SPLIT_NOCOLOR;
      for (size_t i = 0; i < groups.size(); ++i)
        for (int r : groups[i])
          if (r == rank()) color = static_cast<int>(i);
      // Key = world rank: the new communicator orders its ranks as the group lists them.
      NCCL_CHECK(nccl().CommSplit(comms_[kWorld], color, rank(), &comms_[static_cast<size_t>(kind)], nullptr));
    }
  }

  void all_reduce(float* buf, int64_t n, const Group& g, ReduceOp op) override {
    if (on_host(buf)) return staged_->all_reduce(buf, n, g, op);
    if (skip(g)) return;
    cudaStream_t s = begin(g);
    NCCL_CHECK(nccl().AllReduce(buf, buf, count(n), ncclFloat, nccl_op(op), comm(g), s));
    finish(s);
  }
  void all_reduce(double* buf, int64_t n, const Group& g, ReduceOp op) override {
    if (on_host(buf)) return staged_->all_reduce(buf, n, g, op);
    if (skip(g)) return;
    cudaStream_t s = begin(g);
    NCCL_CHECK(nccl().AllReduce(buf, buf, count(n), ncclDouble, nccl_op(op), comm(g), s));
    finish(s);
  }
  void reduce_scatter(const float* in, float* out, int64_t n_out, const Group& g) override {
    if (on_host(in) || on_host(out)) return staged_->reduce_scatter(in, out, n_out, g);
    if (skip(g)) return copy_on_compute(out, in, n_out);
    cudaStream_t s = begin(g);
    NCCL_CHECK(nccl().ReduceScatter(in, out, count(n_out), ncclFloat, ncclSum, comm(g), s));
    finish(s);
  }
  void all_gather(const float* in, float* out, int64_t n_in, const Group& g) override {
    if (on_host(in) || on_host(out)) return staged_->all_gather(in, out, n_in, g);
    if (skip(g)) return copy_on_compute(out, in, n_in);
    cudaStream_t s = begin(g);
    NCCL_CHECK(nccl().AllGather(in, out, count(n_in), ncclFloat, comm(g), s));  // in place when in is my block
    finish(s);
  }
  void broadcast(float* buf, int64_t n, int root_index, const Group& g) override {
    if (on_host(buf)) return staged_->broadcast(buf, n, root_index, g);
    if (skip(g)) return;
    cudaStream_t s = begin(g);
    NCCL_CHECK(nccl().Broadcast(buf, buf, count(n), ncclFloat, root_index, comm(g), s));
    finish(s);
  }
  void barrier(const Group& g) override { staged_->barrier(g); }

  Request isend(const float* buf, int64_t n, int peer, int tag) override {
    return staged(staged_->isend(buf, n, peer, tag));
  }
  Request irecv(float* buf, int64_t n, int peer, int tag) override {
    return staged(staged_->irecv(buf, n, peer, tag));
  }
  Request iall_reduce(float* buf, int64_t n, const Group& g) override {
    if (on_host(buf)) return staged(staged_->iall_reduce(buf, n, g));
    if (skip(g)) return {};
    cudaStream_t s = begin(g);
    NCCL_CHECK(nccl().AllReduce(buf, buf, count(n), ncclFloat, ncclSum, comm(g), s));
    return issued(s);
  }
  Request ireduce_scatter(const float* in, float* out, int64_t n_out, const Group& g) override {
    if (on_host(in) || on_host(out)) return staged(staged_->ireduce_scatter(in, out, n_out, g));
    if (skip(g)) {
      copy_on_compute(out, in, n_out);
      return {};
    }
    cudaStream_t s = begin(g);
    NCCL_CHECK(nccl().ReduceScatter(in, out, count(n_out), ncclFloat, ncclSum, comm(g), s));
    return issued(s);
  }
  Request iall_gather(const float* in, float* out, int64_t n_in, const Group& g) override {
    if (on_host(in) || on_host(out)) return staged(staged_->iall_gather(in, out, n_in, g));
    if (skip(g)) {
      copy_on_compute(out, in, n_in);
      return {};
    }
    cudaStream_t s = begin(g);
    NCCL_CHECK(nccl().AllGather(in, out, count(n_in), ncclFloat, comm(g), s));
    return issued(s);
  }
  bool test(Request& r) override {
    if (!r.pending()) return true;
    if (is_staged(r)) {
      Request in = inner_request(r);
      if (!staged_->test(in)) return false;
      r = Request{};
      return true;
    }
    const cudaError_t rc = cudaEventQuery(event_of(r));
    if (rc == cudaErrorNotReady) return false;
    CUDA_CHECK(rc);
    done(r);
    return true;
  }
  void wait(Request& r) override {
    if (!r.pending()) return;
    if (is_staged(r)) {
      Request in = inner_request(r);
      staged_->wait(in);
      r = Request{};
      return;
    }
    CUDA_CHECK(cudaEventSynchronize(event_of(r)));
    done(r);
  }
  double wtime() const override { return staged_->wtime(); }
  std::vector<std::string> gather_strings(const std::string& s, int root_rank) override {
    return staged_->gather_strings(s, root_rank);
  }
  void start_watchdog(double timeout_s) override { staged_->start_watchdog(timeout_s); }
  void set_step(int64_t step) override { staged_->set_step(step); }
  void begin_wait(const Request& r) override {
    waiting_staged_ = r.pending() && is_staged(r);
    if (waiting_staged_) staged_->begin_wait(inner_request(r));
  }
  void end_wait() override {
    if (waiting_staged_) staged_->end_wait();
    waiting_staged_ = false;
  }

  // Tests: run groups of one through NCCL too (the only groups one GPU has).
  bool single_rank_groups = false;

 private:
  // Requests: even slots are NCCL operations (index * 2), odd ones wrap the staged
  // communicator's (its slot * 2 + 1).
  static bool is_staged(const Request& r) { return (r.slot & 1) != 0; }
  static Request inner_request(const Request& r) { return Request{r.slot >> 1}; }
  static Request staged(Request in) { return in.pending() ? Request{in.slot * 2 + 1} : Request{}; }

  static size_t count(int64_t n) {
    if (n < 0) throw std::invalid_argument("NCCL communicator: negative count " + std::to_string(n));
    return static_cast<size_t>(n);
  }
  static ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::max ? ncclMax : ncclSum; }
  // NCCL takes device (or registered, or managed) memory only. The executor also reduces
  // small host values (losses, norms, counters) through the same calls, every rank alike:
  // those go through the host path of the staged communicator (Open MPI).
  static bool on_host(const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();  // not a pointer CUDA knows: plain host memory
      return true;
    }
    return a.type == cudaMemoryTypeUnregistered || a.type == cudaMemoryTypeHost;
  }
  // A group of one has nothing to combine: all-reduce and broadcast do nothing, reduce-scatter
  // and all-gather copy (unless single_rank_groups).
  bool skip(const Group& g) const { return g.size() == 1 && !single_rank_groups; }
  void copy_on_compute(float* out, const float* in, int64_t n) {
    if (in != out && n > 0)
      CUDA_CHECK(cudaMemcpyAsync(out, in, count(n) * sizeof(float), cudaMemcpyDeviceToDevice, compute_));
  }
  ncclComm_t comm(const Group& g) const {
    if (g.id < 0 || g.id >= kKinds || !comms_[static_cast<size_t>(g.id)])
      throw std::logic_error("NCCL communicator: group kind " + std::to_string(g.id) +
                             " has no communicator on this rank (setup() not called?)");
    return comms_[static_cast<size_t>(g.id)];
  }
  // The group's stream, after everything issued on the compute stream so far.
  cudaStream_t begin(const Group& g) {
    (void)comm(g);
    cudaStream_t s = streams_[static_cast<size_t>(g.id)];
    CUDA_CHECK(cudaEventRecord(ready_, compute_));
    CUDA_CHECK(cudaStreamWaitEvent(s, ready_, 0));
    return s;
  }
  static void finish(cudaStream_t s) { CUDA_CHECK(cudaStreamSynchronize(s)); }
  // A non-blocking operation on `s`: its completion event, in a reusable slot.
  Request issued(cudaStream_t s) {
    size_t i = 0;
    while (i < slots_.size() && slots_[i].used) ++i;
    if (i == slots_.size()) {
      slots_.emplace_back();
      CUDA_CHECK(cudaEventCreateWithFlags(&slots_[i].event, cudaEventDisableTiming));
    }
    slots_[i].used = true;
    CUDA_CHECK(cudaEventRecord(slots_[i].event, s));
    return Request{static_cast<int64_t>(i) * 2};
  }
  cudaEvent_t event_of(const Request& r) const {
    const auto i = static_cast<size_t>(r.slot >> 1);
    if (i >= slots_.size() || !slots_[i].used)
      throw std::logic_error("NCCL communicator: unknown request " + std::to_string(r.slot));
    return slots_[i].event;
  }
  void done(Request& r) {
    slots_[static_cast<size_t>(r.slot >> 1)].used = false;
    r = Request{};
  }
  // The split communicators, then the world's; unchecked.
  void destroy_comms() {
    for (int k = kKinds - 1; k >= 0; --k)
      if (comms_[static_cast<size_t>(k)]) (void)nccl().CommDestroy(comms_[static_cast<size_t>(k)]);
    comms_.fill(nullptr);
  }
  // Unchecked (destructor and failed-constructor path): streams drained, communicators
  // and events freed.
  void release() {
    for (cudaStream_t s : streams_)
      if (s) (void)cudaStreamSynchronize(s);
    destroy_comms();
    for (Slot& e : slots_)
      if (e.event) (void)cudaEventDestroy(e.event);
    slots_.clear();
    if (ready_) (void)cudaEventDestroy(ready_);
    ready_ = nullptr;
    for (cudaStream_t& s : streams_) {
      if (s) (void)cudaStreamDestroy(s);
      s = nullptr;
    }
  }

  struct Slot {
    bool used = false;
    cudaEvent_t event = nullptr;
  };

  CudaBackend& gpu_;
  Comm* inner_;                      // owned by staged_
  std::unique_ptr<Comm> staged_;     // point-to-point, barrier, strings, watchdog
  cudaStream_t compute_ = nullptr;   // the backend's
  std::array<cudaStream_t, kKinds> streams_{};
  std::array<ncclComm_t, kKinds> comms_{};
  cudaEvent_t ready_ = nullptr;
  std::vector<Slot> slots_;
  bool waiting_staged_ = false;
};

}  // namespace

std::string nccl_unavailable_reason() { return nccl().missing; }

std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm> inner, CudaBackend& gpu, bool single_rank_groups) {
  if (!nccl().missing.empty()) return nullptr;
  auto c = std::make_unique<NcclComm>(std::move(inner), gpu);
  c->single_rank_groups = single_rank_groups;
  return c;
}

}  // namespace strata
