// The collective watchdog of `strata train`: a thread per rank that stops the rank when its
// main thread has been inside one communication call, or has made no progress at all, for
// longer than the timeout (Megatron's --distributed-timeout-minutes; NCCL's watchdog in
// PyTorch does the same). Before it stops, it names the rank that failed: every rank of the
// job on this machine publishes its state (pid, step, in a call or computing, since when)
// in a small table in /dev/shm, so a rank waiting on a peer can tell a peer that died, a
// peer stuck outside communication and a peer that is itself waiting. A rank that stops
// exits with status 1, and the launcher (mpirun) then stops the others.
//
// The main thread reports through enter()/leave() around every call of the communicator
// and beat() at step boundaries; the thread only reads. Nothing here calls MPI.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace strata {

class Watchdog {
 public:
  // `table` names the shared table (the same on every rank of the job, e.g. from rank 0's
  // pid and clock); "" keeps the state private (then a waiting rank cannot name its peer).
  Watchdog(int rank, int world, double timeout_s, const std::string& table);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // `op` and `group` must be string literals (kept by pointer); `ranks`, the group's world
  // ranks, must stay alive until leave().
  void enter(const char* op, const char* group, const std::vector<int>* ranks);
  void leave();
  void beat();
  void set_step(int64_t step);
  double timeout_s() const { return timeout_s_; }

  // The message the watchdog prints for this rank's state at time `now_ns` (exposed for tests).
  std::string diagnose(int64_t now_ns) const;
  static int64_t now_ns();

 private:
  struct Slot;  // one per rank in the table
  void loop();
  Slot* slot(int r) const;

  int rank_, world_;
  double timeout_s_;
  int64_t timeout_ns_;
  std::string table_path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::vector<char> private_;  // the table when no shared one could be made
  // The main thread's current call, for the message (under mu_: leave() waits while the
  // watchdog reads them, so `ranks_` stays alive).
  mutable std::mutex mu_;
  const char* op_ = nullptr;
  const char* group_ = nullptr;
  const std::vector<int>* ranks_ = nullptr;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace strata
