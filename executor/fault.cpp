// See fault.h.
#include "executor/fault.h"

#include <unistd.h>

#include <chrono>
#include <climits>
#include <csignal>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "costmodel/json_input.h"

namespace strata {

namespace {

int64_t number(const std::string& s, const std::string& spec, const char* what, int64_t lo, int64_t hi) {
  if (s.empty() || s.size() > 18 || s.find_first_not_of("0123456789") != std::string::npos)
    throw InputError(fmt::format("--inject-fault: '{}': {} '{}' must be a whole number of at most 18 digits", spec, what, s));
  const int64_t v = std::stoll(s);
  if (v < lo || v > hi)
    throw InputError(fmt::format("--inject-fault: '{}': {} {} must be in [{}, {}]", spec, what, v, lo, hi));
  return v;
}

}  // namespace

FaultInjection parse_fault(const std::string& spec, int world_size) {
  const size_t at = spec.find('@'), colon = spec.find(':', at == std::string::npos ? 0 : at);
  if (at == std::string::npos || colon == std::string::npos)
    throw InputError("--inject-fault: '" + spec + "' must be KIND@RANK:STEP (e.g. kill@1:3)");
  const std::string kind = spec.substr(0, at), rank = spec.substr(at + 1, colon - at - 1), step = spec.substr(colon + 1);
  FaultInjection f;
  if (kind == "kill") f.kind = FaultInjection::Kind::kill;
  else if (kind == "throw") f.kind = FaultInjection::Kind::throw_exception;
  else if (kind == "hang") f.kind = FaultInjection::Kind::hang;
  else if (kind == "nan") f.kind = FaultInjection::Kind::nan;
  else if (kind == "kill-in-checkpoint") f.kind = FaultInjection::Kind::kill_in_checkpoint;
  else if (kind == "slow") f.kind = FaultInjection::Kind::slow;
  else if (kind == "bitflip") f.kind = FaultInjection::Kind::bitflip;
  else
    throw InputError("--inject-fault: '" + spec + "': kind '" + kind +
                     "' must be one of kill, throw, hang, nan, kill-in-checkpoint, slow, bitflip");
  f.rank = static_cast<int>(number(rank, spec, "rank", 0, world_size - 1));
  const size_t dash = step.find('-');
  if (dash == std::string::npos) {
    f.first = f.last = number(step, spec, "step", 1, INT64_MAX / 2);
  } else {
    if (f.kind != FaultInjection::Kind::nan && f.kind != FaultInjection::Kind::slow)
      throw InputError("--inject-fault: '" + spec + "': a range of steps is for nan and slow only");
    f.first = number(step.substr(0, dash), spec, "step", 1, INT64_MAX / 2);
    f.last = dash + 1 == step.size() ? INT64_MAX : number(step.substr(dash + 1), spec, "last step", f.first, INT64_MAX / 2);
  }
  return f;
}

void inject_kill() {
  std::raise(SIGKILL);
  for (;;) ::pause();
}

void inject_slow() { std::this_thread::sleep_for(std::chrono::duration<double>(kSlowRankSeconds)); }

void inject_hang() {
  for (;;) ::pause();  // no progress, no messages: the watchdogs must notice
}

void inject_throw(int rank, int64_t step) {
  throw std::runtime_error(fmt::format("injected fault: exception on rank {} at step {}", rank, step));
}

}  // namespace strata
