// See progress.h.
#include "cli/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>

namespace strata {

Progress::Progress(std::string label, int64_t total, std::chrono::steady_clock::time_point start)
    : label_(std::move(label)), total_(std::max<int64_t>(total, 1)), tty_(isatty(2) != 0), start_(start) {}

double Progress::elapsed_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Progress::update(int64_t done, const std::string& line, double every_s) {
  const double el = elapsed_s();
  const double eta = done > 0 ? el / static_cast<double>(done) * static_cast<double>(total_ - done) : 0.0;
  if (tty_) {
    constexpr int64_t kWidth = 24;
    const int64_t filled = std::clamp<int64_t>(done * kWidth / total_, 0, kWidth);
    fmt::print(stderr, "\r\033[K  {} [{}{}] {}/{}  {:.0f} s, ETA {:.0f} s  {}", label_,
               std::string(static_cast<size_t>(filled), '#'), std::string(static_cast<size_t>(kWidth - filled), '.'),
               done, total_, el, eta, line);
    std::fflush(stderr);
    drawn_ = true;
    return;
  }
  if (every_s > 0 && done < total_ && last_print_s_ >= 0 && el - last_print_s_ < every_s) return;
  last_print_s_ = el;
  fmt::print(stderr, "  {} {}/{} ({:.0f} s, ETA {:.0f} s): {}\n", label_, done, total_, el, eta, line);
}

void Progress::finish() {
  if (tty_ && drawn_) fmt::print(stderr, "\n");
  drawn_ = false;
}

}  // namespace strata
