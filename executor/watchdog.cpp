// See watchdog.h. The shared table is a file in /dev/shm mapped by every rank of the job on
// this machine; each rank writes only its own slot, with atomic stores, and reads the others.
#include "executor/watchdog.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>

#include <fmt/format.h>

namespace strata {

struct Watchdog::Slot {
  int64_t pid;      // 0: no rank wrote this slot (it runs on another machine, or not yet)
  int64_t state;    // 1 running, 2 finished, 3 stopped by its watchdog
  int64_t step;     // the step it is in (1-based)
  int64_t in_call;  // 1 while inside a communication call
  int64_t since_ns; // when it entered the current call
  int64_t beat_ns;  // its last sign of progress
  char op[48];      // the call (with the group kind)
};

namespace {

int64_t load(const int64_t& x) { return __atomic_load_n(&x, __ATOMIC_ACQUIRE); }
void store(int64_t& x, int64_t v) { __atomic_store_n(&x, v, __ATOMIC_RELEASE); }

std::string seconds(int64_t ns) { return fmt::format("{:.1f} s", static_cast<double>(ns) * 1e-9); }

// Tables left by jobs whose rank 0 is gone (a job killed before it could remove its own).
void remove_stale_tables() {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    long pid = 0;
    if (std::sscanf(name.c_str(), "strata-watch-%ld-", &pid) == 1 && pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 &&
        errno == ESRCH)
      ::unlink(e.path().c_str());
  }
}

}  // namespace

int64_t Watchdog::now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);  // one clock for every process of the machine
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

Watchdog::Watchdog(int rank, int world, double timeout_s, const std::string& table)
    : rank_(rank), world_(world), timeout_s_(timeout_s), timeout_ns_(static_cast<int64_t>(timeout_s * 1e9)) {
  map_bytes_ = sizeof(Slot) * static_cast<size_t>(world_);
  if (!table.empty()) {
    if (rank_ == 0) remove_stale_tables();
    table_path_ = "/dev/shm/" + table;
    const int fd = ::open(table_path_.c_str(), O_RDWR | O_CREAT, 0600);
    if (fd >= 0) {
      struct stat st {};
      // Every rank sizes it; growing to the same size never clears what another rank wrote.
      if (::fstat(fd, &st) == 0 && (st.st_size >= static_cast<off_t>(map_bytes_) ||
                                    ::ftruncate(fd, static_cast<off_t>(map_bytes_)) == 0)) {
        void* p = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) map_ = p;
      }
      ::close(fd);
    }
  }
  if (map_ == nullptr) private_.assign(map_bytes_, 0);
  Slot* me = slot(rank_);
  const int64_t now = now_ns();
  store(me->step, 0);
  store(me->in_call, 0);
  store(me->since_ns, now);
  store(me->beat_ns, now);
  store(me->state, 1);
  store(me->pid, static_cast<int64_t>(::getpid()));
  if (timeout_ns_ > 0) thread_ = std::thread([this] { loop(); });
}

Watchdog::~Watchdog() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  store(slot(rank_)->state, 2);
  if (map_ != nullptr) {
    ::munmap(map_, map_bytes_);
    ::unlink(table_path_.c_str());  // every rank: each machine has its own copy (ENOENT is fine)
  }
}

Watchdog::Slot* Watchdog::slot(int r) const {
  char* base = map_ != nullptr ? static_cast<char*>(map_) : const_cast<char*>(private_.data());
  return reinterpret_cast<Slot*>(base + sizeof(Slot) * static_cast<size_t>(r));
}

void Watchdog::enter(const char* op, const char* group, const std::vector<int>* ranks) {
  Slot* me = slot(rank_);
  const int64_t now = now_ns();
  {
    std::lock_guard<std::mutex> lock(mu_);
    op_ = op;
    group_ = group;
    ranks_ = ranks;
  }
  std::snprintf(me->op, sizeof(me->op), "%s (%s)", op, group);
  store(me->since_ns, now);
  store(me->beat_ns, now);
  store(me->in_call, 1);
}

void Watchdog::leave() {
  Slot* me = slot(rank_);
  store(me->beat_ns, now_ns());  // before in_call: never "outside a call, no progress since it began"
  store(me->in_call, 0);
  std::lock_guard<std::mutex> lock(mu_);
  op_ = nullptr;
  ranks_ = nullptr;
}

void Watchdog::beat() { store(slot(rank_)->beat_ns, now_ns()); }

void Watchdog::set_step(int64_t step) {
  store(slot(rank_)->step, step);
  beat();
}

std::string Watchdog::diagnose(int64_t now) const {
  const Slot* me = slot(rank_);
  const bool in_call = load(me->in_call) != 0;
  const int64_t step = load(me->step);
  std::string msg = fmt::format("strata: error: rank {} of {}: watchdog (timeout {:g} s, --distributed-timeout-minutes): ",
                                rank_, world_, timeout_s_);
  std::vector<int> peers;
  if (in_call) {
    std::lock_guard<std::mutex> lock(mu_);
    std::string members;
    if (ranks_ != nullptr) {
      for (size_t i = 0; i < ranks_->size() && i < 16; ++i) {
        if (i) members += ',';
        members += std::to_string((*ranks_)[i]);
      }
      if (ranks_->size() > 16) members += ",...";
      peers = *ranks_;
    }
    const bool p2p = group_ != nullptr && std::strcmp(group_, "point-to-point") == 0;
    if (p2p && ranks_ != nullptr && ranks_->size() == 2) {
      peers = {(*ranks_)[1]};
      msg += fmt::format("{} {} rank {}", op_ ? op_ : "a call", std::strcmp(op_ ? op_ : "", "send") == 0 ? "to" : "from",
                         (*ranks_)[1]);
    } else {
      msg += fmt::format("{} over the {} group (ranks {})", op_ ? op_ : "a call", group_ ? group_ : "?", members);
    }
    msg += fmt::format(" has not completed in {} at step {}", seconds(now - load(me->since_ns)), step);
  } else {
    msg += fmt::format("this rank made no progress for {} outside communication at step {}; failed rank: {}",
                       seconds(now - load(me->beat_ns)), step, rank_);
    return msg + "\n";
  }
  // What the table says about every other rank (of the group first).
  std::vector<std::string> failed, notes;
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const Slot* s = slot(r);
    const int64_t pid = load(s->pid);
    if (pid == 0) continue;
    const bool member = peers.empty() || std::find(peers.begin(), peers.end(), r) != peers.end();
    if (load(s->state) == 3) {
      failed.push_back(fmt::format("{} (stopped by its own watchdog at step {})", r, load(s->step)));
    } else if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH && load(s->state) != 2) {
      failed.push_back(fmt::format("{} (pid {} is gone: killed or crashed at step {})", r, pid, load(s->step)));
    } else if (load(s->state) == 2) {
      if (member) notes.push_back(fmt::format("rank {} has finished", r));
    } else if (load(s->in_call) == 0 && now - load(s->beat_ns) > timeout_ns_ / 2) {
      failed.push_back(fmt::format("{} (alive, but no progress for {} outside communication, step {})", r,
                                   seconds(now - load(s->beat_ns)), load(s->step)));
    } else if (member && load(s->in_call) != 0) {
      char op[sizeof(s->op) + 1] = {};
      std::memcpy(op, s->op, sizeof(s->op));
      notes.push_back(fmt::format("rank {} waits in {} since {} (step {})", r, op, seconds(now - load(s->since_ns)),
                                  load(s->step)));
    }
  }
  if (!failed.empty()) {
    msg += "; failed rank";
    msg += failed.size() > 1 ? "s: " : ": ";
    for (size_t i = 0; i < failed.size(); ++i) {
      if (i) msg += ", ";
      msg += failed[i];
    }
  } else {
    msg += "; no rank on this machine is stuck outside communication (the failed rank runs on another machine, or the "
           "ranks wait on each other)";
  }
  for (size_t i = 0; i < notes.size() && i < 8; ++i) msg += "; " + notes[i];
  return msg + "\n";
}

void Watchdog::loop() {
  const auto period = std::chrono::nanoseconds(std::clamp<int64_t>(timeout_ns_ / 20, 1000000, 100000000));
  while (!stop_) {
    std::this_thread::sleep_for(period);
    const Slot* me = slot(rank_);
    const int64_t now = now_ns();
    const bool stuck = load(me->in_call) != 0 ? now - load(me->since_ns) > timeout_ns_ : now - load(me->beat_ns) > timeout_ns_;
    if (!stuck || stop_) continue;
    const std::string msg = diagnose(now);
    // write(2), not stdio: the main thread may be stuck holding stderr's lock.
    for (size_t done = 0; done < msg.size();) {
      const ssize_t n = ::write(2, msg.data() + done, msg.size() - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    // The main thread is stuck (inside MPI, which this thread must not call): end the
    // process; the launcher stops the other ranks when one exits with an error.
    if (load(me->in_call) == 0) store(slot(rank_)->state, 3);  // this rank is the failed one
    if (map_ != nullptr) ::unlink(table_path_.c_str());
    std::_Exit(1);
  }
}

}  // namespace strata
