// Replays the fuzz corpus (tests/fuzz/corpus: the inputs libFuzzer kept for new coverage,
// minimised by scripts/fuzz.sh; tests/fuzz/regressions: the inputs of the bugs it found)
// through the loaders, in the Release build (g++) and under ASan +
// UBSan (clang) in CI: every input either loads or is refused with InputError; any other exception,
// crash or sanitizer report fails. scripts/fuzz.sh generates new inputs (libFuzzer, clang).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "fuzz/fuzz_loaders.h"

namespace {

namespace fs = std::filesystem;

TEST(FuzzCorpus, EveryInputLoadsOrIsRefusedCleanly) {
  std::vector<fs::path> files;
  for (const char* sub : {"corpus", "regressions"}) {
    const fs::path dir = fs::path(STRATA_SOURCE_DIR) / "tests" / "fuzz" / sub;
    ASSERT_TRUE(fs::is_directory(dir)) << dir;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.is_regular_file()) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 100u) << "the corpus should hold the inputs of a fuzzing run (scripts/fuzz.sh)";
  int per_target[8] = {};
  for (const fs::path& f : files) {
    std::ifstream in(f, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!bytes.empty()) ++per_target[static_cast<unsigned char>(bytes[0]) % 8];
    EXPECT_NO_THROW(strata_fuzz::run_one(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size())) << f;
  }
  for (int t = 0; t < 8; ++t) {
    EXPECT_GT(per_target[t], 0) << "no corpus input for " << strata_fuzz::kTargets[t];
    std::printf("%-20s %d inputs\n", strata_fuzz::kTargets[t], per_target[t]);
  }
  std::error_code ec;
  fs::remove_all(strata_fuzz::scratch("ckpt"), ec);
  fs::remove(strata_fuzz::scratch("tokens.bin"), ec);
}

}  // namespace
