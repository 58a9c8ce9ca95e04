// Comm on Open MPI: one MPI communicator per group kind (MPI_Comm_split of the world),
// requests kept in slots. Errors return (MPI_ERRORS_RETURN on the world, inherited by every
// split) to MPI_CHECK, which prints the rank, the call, file and line and aborts every rank.
// Once start_watchdog() ran, every call that can block is bracketed for the watchdog.
//
// Progress: Open MPI moves a non-blocking collective forward only inside MPI calls, so a
// reduce-scatter started behind a layer's backward would wait for the rank's next poll
// between kernels (a few ms apart) for each of its fragments. When MPI was initialised with
// MPI_THREAD_SERIALIZED or more, a progress thread tests the requests in flight every
// STRATA_MPI_PROGRESS_US microseconds (default 1000; 0 turns it off), sleeping otherwise;
// every MPI call of this class holds one mutex per process, so calls stay serialised.
//
// Waiting: where the machine's ranks outnumber its cores (mpirun --oversubscribe), a rank
// that waits for a peer gives its core to the ranks that compute. MPI_Wait and the blocking
// collectives poll (Open MPI yields between polls when oversubscribed, which still takes a
// share of a core from a rank computing beside it), so this class then starts the
// non-blocking form and tests it, sleeping between tests: a pipeline stage idle in its
// bubble, or a rank ahead of its peers at a collective, costs the others nothing. The
// first 20 us of a wait poll; then it sleeps 50 us, doubling up to 200 us; a loop that
// polls a pipeline receive itself naps 100 us between polls (pause()). STRATA_MPI_WAIT =
// sleep | poll forces either (auto by default).
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "executor/comm.h"
#include "executor/watchdog.h"

#define MPI_CHECK(call)                                                                  \
  do {                                                                                   \
    int mpi_check_rc_ = (call);                                                          \
    if (mpi_check_rc_ != MPI_SUCCESS) {                                                  \
      char mpi_check_msg_[MPI_MAX_ERROR_STRING];                                         \
      int mpi_check_len_ = 0;                                                            \
      MPI_Error_string(mpi_check_rc_, mpi_check_msg_, &mpi_check_len_);                  \
      int mpi_check_rank_ = -1;                                                          \
      MPI_Comm_rank(MPI_COMM_WORLD, &mpi_check_rank_);                                   \
      std::fprintf(stderr, "strata: error: rank %d: %s failed at %s:%d: %s\n", mpi_check_rank_, \
                   #call, __FILE__, __LINE__, mpi_check_msg_);                           \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                      \
    }                                                                                    \
  } while (0)

namespace strata {
namespace {

// MPI is one library per process: every MpiComm of the process serialises on this mutex.
std::mutex& mpi_mutex() {
  static std::mutex m;
  return m;
}

const char* group_name(int id) {
  static const char* names[] = {"world", "tensor", "data", "pipeline", "embedding", "model", "context", "data x context"};
  static_assert(sizeof(names) / sizeof(names[0]) == kGroupKinds);
  return id >= 0 && id < kGroupKinds ? names[id] : "other";
}

class MpiComm final : public Comm {
 public:
  MpiComm() {
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
    MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    if (size_ > 1) {  // (every rank makes its MpiComm: a collective is safe here, whatever the variable says)
      std::lock_guard<std::mutex> lk(mpi_mutex());
      const NodeCpus n = node_cpus();
      sleepy_ = n.ranks > n.cores;
    }
    const char* wait = std::getenv("STRATA_MPI_WAIT");
    if (wait && std::string(wait) == "sleep") sleepy_ = true;
    if (wait && std::string(wait) == "poll") sleepy_ = false;
    comms_.assign(kGroupKinds, MPI_COMM_NULL);
    comms_[kWorld] = MPI_COMM_WORLD;
    int level = MPI_THREAD_SINGLE;
    MPI_CHECK(MPI_Query_thread(&level));
    const int64_t us = progress_interval_us();
    if (level >= MPI_THREAD_SERIALIZED && size_ > 1 && us > 0) {
      interval_ = std::chrono::microseconds(us);
      progress_ = std::thread([this] { progress_loop(); });
    }
  }
  ~MpiComm() override {
    if (progress_.joinable()) {
      {
        std::lock_guard<std::mutex> lk(mpi_mutex());
        stop_ = true;
      }
      cv_.notify_all();
      progress_.join();
    }
    std::lock_guard<std::mutex> lk(mpi_mutex());  // another MpiComm's thread may be testing
    for (size_t i = 1; i < comms_.size(); ++i)
      if (comms_[i] != MPI_COMM_NULL) MPI_Comm_free(&comms_[i]);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void setup(const ProcessGrid& grid) override {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    Watch w(this, "comm_split", world_group_name_, world_ranks_);
    for (int kind : {kTensor, kData, kPipeline, kEmbedding, kModel, kContext, kReplica}) {
      const auto groups = grid.all_groups(static_cast<GroupKind>(kind));
      int color = MPI_UNDEFINED;
      for (size_t i = 0; i < groups.size(); ++i)
        for (int r : groups[i])
          if (r == rank_) color = static_cast<int>(i);
      // Key = rank: the new communicator orders ranks as the group lists them (ascending).
      MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, color, rank_, &comms_[static_cast<size_t>(kind)]));
    }
  }

  void all_reduce(float* buf, int64_t n, const Group& g, ReduceOp op) override {
    all_reduce_in_place(buf, n, MPI_FLOAT, g, op);
  }
  void all_reduce(double* buf, int64_t n, const Group& g, ReduceOp op) override {
    all_reduce_in_place(buf, n, MPI_DOUBLE, g, op);
  }
  // Both all_reduce()s: blocking, or where ranks share cores its non-blocking form and a
  // sleeping wait.
  void all_reduce_in_place(void* buf, int64_t n, MPI_Datatype type, const Group& g, ReduceOp op) {
    if (g.size() == 1) return;
    std::lock_guard<std::mutex> lk(mpi_mutex());
    Watch w(this, "all_reduce", g);
    if (!sleepy_) {
      MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf, count(n), type, mpi_op(op), comm(g)));
      return;
    }
    MPI_Request q;
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, count(n), type, mpi_op(op), comm(g), &q));
    block(&q);
  }
  void reduce_scatter(const float* in, float* out, int64_t n_out, const Group& g) override {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    Watch w(this, "reduce_scatter", g);
    if (!sleepy_) {
      MPI_CHECK(MPI_Reduce_scatter_block(in, out, count(n_out), MPI_FLOAT, MPI_SUM, comm(g)));
      return;
    }
    MPI_Request q;
    MPI_CHECK(MPI_Ireduce_scatter_block(in, out, count(n_out), MPI_FLOAT, MPI_SUM, comm(g), &q));
    block(&q);
  }
  void all_gather(const float* in, float* out, int64_t n_in, const Group& g) override {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    const void* src = in == out + static_cast<int64_t>(g.me) * n_in ? MPI_IN_PLACE : in;
    Watch w(this, "all_gather", g);
    if (!sleepy_) {
      MPI_CHECK(MPI_Allgather(src, count(n_in), MPI_FLOAT, out, count(n_in), MPI_FLOAT, comm(g)));
      return;
    }
    MPI_Request q;
    MPI_CHECK(MPI_Iallgather(src, count(n_in), MPI_FLOAT, out, count(n_in), MPI_FLOAT, comm(g), &q));
    block(&q);
  }
  void broadcast(float* buf, int64_t n, int root_index, const Group& g) override {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    Watch w(this, "broadcast", g);
    if (!sleepy_) {
      MPI_CHECK(MPI_Bcast(buf, count(n), MPI_FLOAT, root_index, comm(g)));
      return;
    }
    MPI_Request q;
    MPI_CHECK(MPI_Ibcast(buf, count(n), MPI_FLOAT, root_index, comm(g), &q));
    block(&q);
  }
  void barrier(const Group& g) override {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    Watch w(this, "barrier", g);
    if (!sleepy_) {
      MPI_CHECK(MPI_Barrier(comm(g)));
      return;
    }
    MPI_Request q;
    MPI_CHECK(MPI_Ibarrier(comm(g), &q));
    block(&q);
  }

  Request isend(const float* buf, int64_t n, int peer, int tag) override {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    Request r = slot("send", peer);
    MPI_CHECK(MPI_Isend(buf, count(n), MPI_FLOAT, peer, tag, MPI_COMM_WORLD, &reqs_[static_cast<size_t>(r.slot)]));
    started();
    return r;
  }
  Request irecv(float* buf, int64_t n, int peer, int tag) override {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    Request r = slot("recv", peer);
    MPI_CHECK(MPI_Irecv(buf, count(n), MPI_FLOAT, peer, tag, MPI_COMM_WORLD, &reqs_[static_cast<size_t>(r.slot)]));
    started();
    return r;
  }
  Request iall_reduce(float* buf, int64_t n, const Group& g) override {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    Request r = slot("all_reduce", g);
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, count(n), MPI_FLOAT, MPI_SUM, comm(g),
                             &reqs_[static_cast<size_t>(r.slot)]));
    started();
    return r;
  }
  Request ireduce_scatter(const float* in, float* out, int64_t n_out, const Group& g) override {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    Request r = slot("reduce_scatter", g);
    MPI_CHECK(MPI_Ireduce_scatter_block(in, out, count(n_out), MPI_FLOAT, MPI_SUM, comm(g),
                                        &reqs_[static_cast<size_t>(r.slot)]));
    started();
    return r;
  }
  Request iall_gather(const float* in, float* out, int64_t n_in, const Group& g) override {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    Request r = slot("all_gather", g);
    const void* src = in == out + static_cast<int64_t>(g.me) * n_in ? MPI_IN_PLACE : in;
    MPI_CHECK(MPI_Iallgather(src, count(n_in), MPI_FLOAT, out, count(n_in), MPI_FLOAT, comm(g),
                             &reqs_[static_cast<size_t>(r.slot)]));
    started();
    return r;
  }
  bool test(Request& r) override {
    if (!r.pending()) return true;
    std::lock_guard<std::mutex> lk(mpi_mutex());
    if (wd_) wd_->beat();
    const size_t s = static_cast<size_t>(r.slot);
    int done = done_[s];
    if (!done) MPI_CHECK(MPI_Test(&reqs_[s], &done, MPI_STATUS_IGNORE));
    if (done) finished(r);
    return done != 0;
  }
  void wait(Request& r) override {
    if (!r.pending()) return;
    std::lock_guard<std::mutex> lk(mpi_mutex());
    const size_t s = static_cast<size_t>(r.slot);
    if (!done_[s]) {
      const Pending& p = meta_[s];
      Watch w(this, p.op, p.group, p.ranks);
      block(&reqs_[s]);
    }
    finished(r);
  }
  double wtime() const override { return MPI_Wtime(); }
  bool has_progress_thread() const override { return progress_.joinable(); }
  int64_t completed_in_background() const override { return background_.load(std::memory_order_relaxed); }

  void start_watchdog(double timeout_s) override {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    // One table name for the job: rank 0's pid and clock, broadcast.
    char name[64] = {};
    if (rank_ == 0) {
      timespec ts{};
      clock_gettime(CLOCK_REALTIME, &ts);
      std::snprintf(name, sizeof(name), "strata-watch-%ld-%lld", static_cast<long>(::getpid()),
                    static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec);
    }
    MPI_CHECK(MPI_Bcast(name, sizeof(name), MPI_CHAR, 0, MPI_COMM_WORLD));
    world_ranks_.resize(static_cast<size_t>(size_));
    for (int i = 0; i < size_; ++i) world_ranks_[static_cast<size_t>(i)] = i;
    wd_.reset();
    wd_ = std::make_unique<Watchdog>(rank_, size_, timeout_s, name);
    MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));  // every rank's slot is in the table
  }
  void set_step(int64_t step) override {
    if (wd_) wd_->set_step(step);
  }
  void begin_wait(const Request& r) override {
    if (!wd_ || !r.pending()) return;
    const Pending& p = meta_[static_cast<size_t>(r.slot)];
    wd_->enter(p.op, p.group, &p.ranks);
  }
  void pause() override {
    if (sleepy_) std::this_thread::sleep_for(std::chrono::microseconds{100});
    else std::this_thread::yield();
  }
  void end_wait() override {
    if (wd_) wd_->leave();
  }
  std::vector<std::string> gather_strings(const std::string& s, int root) override {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    Watch w(this, "gather", world_group_name_, world_ranks_);
    int len = static_cast<int>(s.size());
    std::vector<int> lens(static_cast<size_t>(size_)), displs(static_cast<size_t>(size_));
    MPI_CHECK(MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, root, MPI_COMM_WORLD));
    int64_t total64 = 0;
    for (int i = 0; i < size_; ++i) {
      displs[static_cast<size_t>(i)] = count(total64);
      total64 += lens[static_cast<size_t>(i)];
    }
    const int total = rank_ == root ? count(total64) : 0;
    std::string all(static_cast<size_t>(rank_ == root ? total : 0), '\0');
    MPI_CHECK(MPI_Gatherv(s.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, root,
                          MPI_COMM_WORLD));
    std::vector<std::string> out;
    if (rank_ == root)
      for (int i = 0; i < size_; ++i)
        out.push_back(all.substr(static_cast<size_t>(displs[static_cast<size_t>(i)]),
                                 static_cast<size_t>(lens[static_cast<size_t>(i)])));
    return out;
  }

 private:
  static int count(int64_t n) {  // MPI counts are int: refuse what would wrap
    if (n > INT_MAX) {
      std::fprintf(stderr, "strata: internal error: %lld elements in one MPI call exceed INT_MAX\n", static_cast<long long>(n));
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return static_cast<int>(n);
  }
  static MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::max ? MPI_MAX : MPI_SUM; }
  MPI_Comm comm(const Group& g) const { return comms_[static_cast<size_t>(g.id)]; }
  // What a request waits for, for the watchdog's message.
  struct Pending {
    const char* op = "";
    const char* group = "";
    std::vector<int> ranks;
  };
  // Brackets a call that can block (no-op until the watchdog runs).
  class Watch {
   public:
    Watch(MpiComm* c, const char* op, const Group& g) : Watch(c, op, group_name(g.id), g.ranks) {}
    Watch(MpiComm* c, const char* op, const char* group, const std::vector<int>& ranks) : wd_(c->wd_.get()) {
      if (wd_) wd_->enter(op, group, &ranks);
    }
    ~Watch() {
      if (wd_) wd_->leave();
    }
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;

   private:
    Watchdog* wd_;
  };

  Request slot(const char* op, const Group& g) {
    Request r = slot();
    Pending& p = meta_[static_cast<size_t>(r.slot)];
    p.op = op;
    p.group = group_name(g.id);
    p.ranks = g.ranks;
    return r;
  }
  Request slot(const char* op, int peer) {
    Request r = slot();
    Pending& p = meta_[static_cast<size_t>(r.slot)];
    p.op = op;
    p.group = "point-to-point";
    p.ranks.assign({rank_, peer});
    return r;
  }
  Request slot() {
    Request r;
    if (!free_.empty()) {
      r.slot = free_.back();
      free_.pop_back();
    } else {
      r.slot = static_cast<int64_t>(reqs_.size());
      reqs_.push_back(MPI_REQUEST_NULL);
      meta_.emplace_back();
      done_.push_back(0);
    }
    return r;
  }
  // A request was just created (mpi_mutex() held): one more for the progress thread to test.
  void started() {
    if (in_flight_++ == 0 && progress_.joinable()) cv_.notify_one();
  }
  // The request completed, seen by the caller or by the progress thread (mpi_mutex() held).
  void finished(Request& r) {
    const size_t s = static_cast<size_t>(r.slot);
    if (!done_[s]) --in_flight_;
    done_[s] = 0;
    reqs_[s] = MPI_REQUEST_NULL;
    free_.push_back(r.slot);
    r.slot = -1;
  }
  // MPI_Wait, or where waiting ranks should free their core (sleepy_, see the top) a test
  // loop that sleeps: 20 us of polls, then sleeps of 50 us doubling up to 200 us.
  void block(MPI_Request* req) {
    if (!sleepy_) {
      MPI_CHECK(MPI_Wait(req, MPI_STATUS_IGNORE));
      return;
    }
    int done = 0;
    MPI_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
    const double spin_until = MPI_Wtime() + 20e-6;
    while (!done && MPI_Wtime() < spin_until) MPI_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
    std::chrono::microseconds nap{50};
    while (!done) {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds{200});
      MPI_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
    }
  }

  static int64_t progress_interval_us() {
    const char* v = std::getenv("STRATA_MPI_PROGRESS_US");
    if (!v || !*v) return 1000;
    char* end = nullptr;
    const long long x = std::strtoll(v, &end, 10);
    return end && *end == '\0' && x >= 0 && x <= 1000000 ? x : 1000;
  }
  // Tests every request in flight each interval while there are any; sleeps otherwise.
  // MPI_Testsome skips the null slots (free, or completed and not yet collected).
  void progress_loop() {
    std::unique_lock<std::mutex> lk(mpi_mutex());
    std::vector<int> idx;
    while (!stop_) {
      if (in_flight_ == 0) {
        cv_.wait(lk);
        continue;
      }
      cv_.wait_for(lk, interval_);
      if (stop_ || in_flight_ == 0) continue;
      idx.resize(reqs_.size());
      int n = 0;
      MPI_CHECK(MPI_Testsome(static_cast<int>(reqs_.size()), reqs_.data(), &n, idx.data(), MPI_STATUSES_IGNORE));
      if (n == MPI_UNDEFINED) continue;
      for (int i = 0; i < n; ++i) {
        done_[static_cast<size_t>(idx[static_cast<size_t>(i)])] = 1;
        --in_flight_;
      }
      background_.fetch_add(n, std::memory_order_relaxed);
    }
  }

  int rank_ = 0, size_ = 1;
  bool sleepy_ = false;  // waits sleep between tests (see the top)
  std::vector<MPI_Comm> comms_;
  std::vector<MPI_Request> reqs_;
  std::vector<Pending> meta_;
  std::unique_ptr<Watchdog> wd_;
  const char* world_group_name_ = "world";
  std::vector<int> world_ranks_;
  std::vector<int64_t> free_;
  // The progress thread (absent below MPI_THREAD_SERIALIZED or in a world of one rank).
  // mpi_mutex() is held around every MPI call and around the request tables.
  std::condition_variable cv_;
  std::thread progress_;
  std::chrono::microseconds interval_{0};
  bool stop_ = false;
  int64_t in_flight_ = 0;      // requests neither completed-and-collected nor seen done
  std::vector<char> done_;     // per slot: completed by the progress thread, not yet collected
  std::atomic<int64_t> background_{0};
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm() { return std::make_unique<MpiComm>(); }

NodeCpus node_cpus() {
  int rank = 0;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  MPI_Comm node = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
  NodeCpus n;
  MPI_CHECK(MPI_Comm_size(node, &n.ranks));
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof mask, &mask) != 0) {  // (cannot fail for this process) every CPU there is
    const int all = std::min<int>(CPU_SETSIZE, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
    for (int c = 0; c < all; ++c) CPU_SET(c, &mask);
  }
  std::vector<unsigned char> on(CPU_SETSIZE, 0);
  for (int c = 0; c < CPU_SETSIZE; ++c) on[static_cast<size_t>(c)] = CPU_ISSET(c, &mask) ? 1 : 0;
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, on.data(), CPU_SETSIZE, MPI_UNSIGNED_CHAR, MPI_MAX, node));
  n.cores = 0;
  for (unsigned char b : on) n.cores += b;
  n.cores = std::max(n.cores, 1);
  MPI_Comm_free(&node);
  return n;
}

}  // namespace strata
