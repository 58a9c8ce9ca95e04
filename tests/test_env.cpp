// Linked into every test binary: buffer poisoning on (the CPU backend fills each buffer it
// hands out unwritten with NaN, so a read before a write fails the test), however the test
// is started: by ctest, whose environment sets it too, or by hand. Set before main, before
// any backend reads it; the strata processes a test starts inherit it.
#include <cstdlib>

namespace {
const bool kPoisonBuffers = [] { return ::setenv("STRATA_POISON_BUFFERS", "1", 0) == 0; }();
}  // namespace
