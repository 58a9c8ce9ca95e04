// Fault injection for the tests of fault handling (`strata train --inject-fault
// KIND@RANK:STEP`, SPEC.md): kill (SIGKILL), throw (an exception), hang (the rank stops
// responding), nan (its gradients become NaN), kill-in-checkpoint (SIGKILL halfway
// through writing its shard of that step's checkpoint) and slow (the rank sleeps
// kSlowRankSeconds before its first backward of the step: a straggler, whose peers' waits
// the executor must count as skew, not communication) and bitflip (after that step's
// optimizer update the rank flips mantissa bit 10 of its first weight: silent data
// corruption, which the end-of-run replica check must see under plain data parallelism).
// For nan and slow, STEP may be a range FIRST-LAST or FIRST- (every step from FIRST on), to
// test K bad steps in a row.
#pragma once

#include <cstdint>
#include <string>

namespace strata {

struct FaultInjection {
  enum class Kind { none, kill, throw_exception, hang, nan, kill_in_checkpoint, slow, bitflip };
  Kind kind = Kind::none;
  int rank = 0;
  int64_t first = 0, last = 0;  // steps, 1-based, inclusive
  bool at(int r, int64_t step, Kind k) const { return kind == k && r == rank && step >= first && step <= last; }
};

// Throws InputError naming the flag, the value and the rule.
FaultInjection parse_fault(const std::string& spec, int world_size);

// The injected faults themselves (none returns, except throw_exception, which throws).
[[noreturn]] void inject_kill();
[[noreturn]] void inject_hang();
[[noreturn]] void inject_throw(int rank, int64_t step);
// Long against a step's own backward, which the peer's wait excludes (1.5 s: under the
// sanitizers on a busy host tiny-gpt's backward took about 0.25 s of a 0.5 s sleep).
constexpr double kSlowRankSeconds = 1.5;
void inject_slow();

}  // namespace strata
