// Progress of long work on stderr: a bar redrawn in place with done/total, elapsed time and
// ETA when stderr is a terminal; plain periodic lines when it is not (logs, CI, pipes).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace strata {

class Progress {
 public:
  // `label` prefixes every line ("train", "validate"); total > 0. `start`: when the work
  // began (a bar shown only once the work runs long), for the elapsed time and the ETA.
  Progress(std::string label, int64_t total,
           std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now());
  // `done` units of `total` finished; `line` says what just happened. Without a terminal a
  // line is printed for every call when `every_s` is 0, else at most once per every_s seconds
  // (and always for the last unit).
  void update(int64_t done, const std::string& line, double every_s = 0);
  void set_total(int64_t total) { total_ = total > 0 ? total : 1; }
  // Ends the bar's line on a terminal.
  void finish();
  double elapsed_s() const;

 private:
  std::string label_;
  int64_t total_;
  bool tty_;
  bool drawn_ = false;
  double last_print_s_ = -1;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace strata
