// libFuzzer entry point over the loaders (fuzz_loaders.h); built by scripts/fuzz.sh with
// clang, -fsanitize=fuzzer,address,undefined.
#include "fuzz_loaders.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  strata_fuzz::run_one(data, size);
  return 0;
}
