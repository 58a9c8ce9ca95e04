// The collectives and point-to-point calls the executor needs, on groups passed as
// values. One implementation per backend: cpu/mpi_comm.cpp (Open MPI); the CUDA backend
// adds NCCL behind the same interface. Non-blocking calls return a Request that the
// caller polls with test() (MPI makes no progress otherwise) and finishes with wait().
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "executor/process_grid.h"

namespace strata {

enum class ReduceOp { sum, max };

struct Request {
  int64_t slot = -1;  // -1: nothing pending
  bool pending() const { return slot >= 0; }
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Creates the native communicator of every group kind of the grid; collective over
  // the world, called once before any group is used.
  virtual void setup(const ProcessGrid& grid) = 0;

  virtual void all_reduce(float* buf, int64_t n, const Group& g, ReduceOp op = ReduceOp::sum) = 0;
  virtual void all_reduce(double* buf, int64_t n, const Group& g, ReduceOp op = ReduceOp::sum) = 0;
  // in: g.size() blocks of n_out; out: this rank's block of the sum.
  virtual void reduce_scatter(const float* in, float* out, int64_t n_out, const Group& g) = 0;
  // in: n_in values; out: g.size() blocks of n_in in group order. in may be this rank's
  // block of out (in place).
  virtual void all_gather(const float* in, float* out, int64_t n_in, const Group& g) = 0;
  virtual void broadcast(float* buf, int64_t n, int root_index, const Group& g) = 0;
  virtual void barrier(const Group& g) = 0;

  virtual Request isend(const float* buf, int64_t n, int peer_rank, int tag) = 0;
  virtual Request irecv(float* buf, int64_t n, int peer_rank, int tag) = 0;
  virtual Request iall_reduce(float* buf, int64_t n, const Group& g) = 0;
  virtual Request ireduce_scatter(const float* in, float* out, int64_t n_out, const Group& g) = 0;
  virtual Request iall_gather(const float* in, float* out, int64_t n_in, const Group& g) = 0;
  virtual bool test(Request& r) = 0;  // progresses the library; true (and r cleared) when done
  virtual void wait(Request& r) = 0;
  virtual double wtime() const = 0;
  // Whether a progress thread of this communicator moves its non-blocking requests forward
  // while the caller computes, and how many requests that thread saw complete (for tests).
  virtual bool has_progress_thread() const { return false; }
  virtual int64_t completed_in_background() const { return 0; }
  // Every rank's string, on `root_rank` (empty elsewhere); for traces and errors.
  virtual std::vector<std::string> gather_strings(const std::string& s, int root_rank) = 0;
  // The collective watchdog (executor/watchdog.h): from now on a call that has not completed
  // in `timeout_s`, or a rank without progress for that long, stops the rank with a message
  // naming the rank that failed. Collective over the world. Without it (the default, and
  // in a world of one rank) nothing is watched.
  virtual void start_watchdog(double timeout_s) { (void)timeout_s; }
  // The step in progress (1-based), for the watchdog's messages; also a sign of progress.
  virtual void set_step(int64_t step) { (void)step; }
  // Brackets a loop that polls `r` with test() until it completes (while progressing other
  // requests), so the watchdog times it like a blocking wait. No other request may be
  // created inside the bracket.
  virtual void begin_wait(const Request& r) { (void)r; }
  virtual void end_wait() {}
  // Between two polls of such a loop: gives the core away (a yield; on Open MPI where the
  // machine's ranks outnumber its cores, a 100 us sleep, so a rank idle in a pipeline
  // bubble leaves its core to the ranks that compute).
  virtual void pause() { std::this_thread::yield(); }
};

// The Open MPI communicator over MPI_COMM_WORLD (MPI must be initialised).
std::unique_ptr<Comm> make_mpi_comm();
// The CPU cores this machine's ranks may run on (the union of their affinity masks), and
// how many ranks it holds. Collective over MPI_COMM_WORLD.
struct NodeCpus {
  int cores = 1, ranks = 1;
};
NodeCpus node_cpus();
// A world of one rank, without MPI (local_comm.cpp).
std::unique_ptr<Comm> make_local_comm();

}  // namespace strata
