// Checkpoints: the files (checksums, atomic folders, keep-K, corrupt or truncated shards
// refused), resume after a crash reproducing the uninterrupted run's losses bit for bit
// (fp32), and resharding: a checkpoint saved under one plan loads under another with the
// same model and continues with the same losses as an uninterrupted run of the new plan.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "executor/checkpoint.h"
#include "train_runner.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using strata_test::TrainRun;
using strata_test::fresh_dir;


CheckpointMeta meta_at(int64_t step, int64_t G) {
  CheckpointMeta m;
  m.step = step;
  m.model = "toy";
  m.data = "synthetic";
  m.plan = Json::object();
  m.global_params = G;
  m.world_size = 2;
  return m;
}

// Two "ranks" write their slices of a global state of 3 * G floats and commit.
void write_toy(const fs::path& dir, int64_t step, const std::vector<float>& state, int64_t keep) {
  const fs::path tmp = dir / (".tmp-" + std::to_string(step));
  fs::create_directories(tmp);
  std::vector<std::string> lines;
  for (int r = 0; r < 2; ++r) {
    int64_t b = 0, e = 0;
    shard_range(static_cast<int64_t>(state.size()), r, 2, &b, &e);
    lines.push_back(write_shard(tmp.string(), r, state.data() + b, e - b));
  }
  commit_checkpoint(dir.string(), tmp.string(), meta_at(step, static_cast<int64_t>(state.size()) / 3), lines, keep);
}

TEST(CheckpointFiles, RoundTripKeepAndIntegrity) {
  EXPECT_EQ(fnv1a64("", 0), 0xcbf29ce484222325ull);  // FNV-1a 64 offset basis
  EXPECT_EQ(fnv1a64("a", 1), 0xaf63dc4c8601ec8cull);  // published test vector
  int64_t covered = 0;
  for (int r = 0; r < 3; ++r) {
    int64_t b = 0, e = 0;
    shard_range(10, r, 3, &b, &e);
    EXPECT_EQ(b, covered);
    covered = e;
  }
  EXPECT_EQ(covered, 10);

  const fs::path dir = fresh_dir("strata_ckpt_files");
  std::vector<float> state(3 * 1001);
  for (size_t i = 0; i < state.size(); ++i) state[i] = 0.25f * static_cast<float>(i);
  for (int64_t step : {5, 10, 15}) write_toy(dir, step, state, 2);
  EXPECT_FALSE(fs::exists(dir / checkpoint_name(5)));  // only the newest two are kept
  EXPECT_TRUE(fs::exists(dir / checkpoint_name(10)));
  // An interrupted write (a .tmp folder, no rename) is never picked.
  fs::create_directories(dir / ".step-00000020.tmp");
  EXPECT_EQ(newest_checkpoint(dir.string()), (dir / checkpoint_name(15)).string());
  CheckpointMeta meta;
  EXPECT_EQ(read_checkpoint(newest_checkpoint(dir.string()), &meta), state);
  EXPECT_EQ(meta.step, 15);

  // One flipped byte fails its checksum; a truncated shard fails its size.
  const fs::path shard = dir / checkpoint_name(15) / "shard-00001.bin";
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(17);
    f.put('\x5a');
  }
  try {
    read_checkpoint((dir / checkpoint_name(15)).string(), &meta);
    ADD_FAILURE() << "a corrupt shard was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
  }
  fs::resize_file(dir / checkpoint_name(10) / "shard-00000.bin", 100);
  EXPECT_THROW(read_checkpoint((dir / checkpoint_name(10)).string(), &meta), InputError);
  fs::remove(dir / checkpoint_name(10) / "manifest.json");
  EXPECT_THROW(read_checkpoint((dir / checkpoint_name(10)).string(), &meta), InputError);
  fs::remove_all(dir);
}

const std::string kArgs = "--seq-length 32 --lr 5e-4 --lr-warmup-iters 3";

TEST(CheckpointResume, CrashAndResumeReproducesEveryLossBitwise) {
  // Uninterrupted: 6 steps. Crashed: the same run whose newest checkpoint on disk is the
  // one after step 3 (what a crash between steps 3 and 6 leaves), resumed to step 6.
  for (const std::string plan : {"dp=2,mbs=1,gbs=8,precision=fp32", "tp=2,pp=2,sp=1,mbs=1,gbs=8,zero=0,precision=fp32",
                                 "dp=2,mbs=1,gbs=8,zero=3,precision=bf16"}) {
    const fs::path dir = fresh_dir("strata_ckpt_resume");
    const TrainRun full = strata_test::train("tiny-gpt", plan, 6, kArgs);
    ASSERT_EQ(full.rc, 0) << full.err;
    const TrainRun first = strata_test::train("tiny-gpt", plan, 6, kArgs + " --checkpoint-dir " + dir.string() +
                                                                      " --checkpoint-every 3 --keep-checkpoints 3");
    ASSERT_EQ(first.rc, 0) << first.err;
    ASSERT_TRUE(fs::exists(dir / checkpoint_name(3)));
    fs::remove_all(dir / checkpoint_name(6));  // the crash
    const TrainRun resumed =
        strata_test::train("tiny-gpt", plan, 6, kArgs + " --checkpoint-dir " + dir.string() + " --resume");
    ASSERT_EQ(resumed.rc, 0) << resumed.err;
    ASSERT_EQ(full.losses.size(), 6u);
    ASSERT_EQ(resumed.losses.size(), 3u);
    for (size_t i = 0; i < 3; ++i)
      EXPECT_EQ(resumed.losses[i], full.losses[3 + i]) << plan << " step " << 4 + i;  // bitwise
    EXPECT_EQ(resumed.params, full.params) << plan;
    fs::remove_all(dir);
  }
}

TEST(CheckpointResume, ReshardsBetweenPlans) {
  struct Pair {
    std::string from, to;
  };
  for (const Pair& pr : {Pair{"tp=2,pp=2,mbs=1,gbs=8,precision=fp32", "dp=4,mbs=1,gbs=8,precision=fp32"},
                         Pair{"dp=4,zero=3,mbs=1,gbs=8,precision=fp32", "mbs=1,gbs=8,precision=fp32"},
                         Pair{"pp=2,vp=2,dp=2,zero=1,mbs=1,gbs=8,precision=fp32", "tp=2,sp=1,mbs=2,gbs=8,precision=fp32"},
                         // ZeRO shards over data x context parallel, saved and loaded.
                         Pair{"cp=2,dp=2,zero=1,mbs=1,gbs=8,precision=fp32", "cp=2,zero=3,mbs=1,gbs=8,precision=fp32"}}) {
    const fs::path dir = fresh_dir("strata_ckpt_reshard");
    const TrainRun saved = strata_test::train("tiny-gpt", pr.from, 6, kArgs + " --checkpoint-dir " + dir.string() +
                                                                          " --checkpoint-every 3 --keep-checkpoints 3");
    ASSERT_EQ(saved.rc, 0) << saved.err;
    fs::remove_all(dir / checkpoint_name(6));
    // The loaded model equals the saved one: resume at step 3 with nothing left to train.
    CheckpointMeta meta;
    const std::vector<float> state = read_checkpoint((dir / checkpoint_name(3)).string(), &meta);
    const TrainRun loaded = strata_test::train("tiny-gpt", pr.to, 3, kArgs + " --checkpoint-dir " + dir.string() + " --resume");
    ASSERT_EQ(loaded.rc, 0) << loaded.err;
    ASSERT_EQ(loaded.params.size(), static_cast<size_t>(meta.global_params));
    EXPECT_TRUE(std::equal(loaded.params.begin(), loaded.params.end(), state.begin())) << pr.from << " -> " << pr.to;
    // Training continues as an uninterrupted run of the new plan does.
    const TrainRun resumed = strata_test::train("tiny-gpt", pr.to, 6, kArgs + " --checkpoint-dir " + dir.string() + " --resume");
    const TrainRun plain = strata_test::train("tiny-gpt", pr.to, 6, kArgs);
    ASSERT_EQ(resumed.rc, 0) << resumed.err;
    ASSERT_EQ(plain.rc, 0) << plain.err;
    ASSERT_EQ(resumed.losses.size(), 3u);
    for (size_t i = 0; i < 3; ++i)
      EXPECT_NEAR(resumed.losses[i], plain.losses[3 + i], 1e-5 * std::fabs(plain.losses[3 + i]))
          << pr.from << " -> " << pr.to << " step " << 4 + i;
    fs::remove_all(dir);
  }
}

TEST(CheckpointResume, BadUseIsRefused) {
  const fs::path dir = fresh_dir("strata_ckpt_bad");
  TrainRun r = strata_test::train("tiny-gpt", "mbs=1,gbs=2,precision=fp32", 2, "--checkpoint-every 1");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--checkpoint-dir"), std::string::npos) << r.err;
  // A checkpoint of another model, or one from a different seed, is refused with exit 2.
  r = strata_test::train("tiny-gpt", "mbs=1,gbs=2,precision=fp32", 2,
                         kArgs + " --checkpoint-dir " + dir.string() + " --checkpoint-every 1");
  ASSERT_EQ(r.rc, 0) << r.err;
  r = strata_test::train("tiny-llama", "mbs=1,gbs=2,precision=fp32", 2, kArgs + " --checkpoint-dir " + dir.string() + " --resume");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("holds model tiny-gpt"), std::string::npos) << r.err;
  // On two ranks, both say so (checked before any rank loads the state, not by the first
  // rank to fail aborting the others).
  r = strata_test::train("tiny-llama", "dp=2,mbs=1,gbs=2,precision=fp32", 2,
                         kArgs + " --checkpoint-dir " + dir.string() + " --resume", 2);
  EXPECT_EQ(r.rc, 2);
  size_t lines = 0;
  for (size_t at = 0; (at = r.err.find("holds model tiny-gpt", at)) != std::string::npos; ++at) ++lines;
  EXPECT_EQ(lines, 2u) << r.err;
  // A checkpoint folder that is a file, even only to resume from, is refused.
  r = strata_test::train("tiny-gpt", "mbs=1,gbs=2,precision=fp32", 2,
                         kArgs + " --checkpoint-dir " + (dir / "step-00000001" / "manifest.json").string() + " --resume");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("is not a folder"), std::string::npos) << r.err;
  r = strata_test::train("tiny-gpt", "mbs=1,gbs=2,precision=fp32", 2,
                         kArgs + " --seed 7 --checkpoint-dir " + dir.string() + " --resume");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--seed"), std::string::npos) << r.err;
  // A new run into a folder holding another run's checkpoints is refused (keep-K and a
  // later --resume would mix the two runs).
  r = strata_test::train("tiny-gpt", "mbs=1,gbs=2,precision=fp32", 2,
                         kArgs + " --checkpoint-dir " + dir.string() + " --checkpoint-every 1");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("already holds checkpoints"), std::string::npos) << r.err;
  fs::remove_all(dir);
}

TEST(CheckpointFiles, StepsOrderNumericallyPastEightDigits) {
  const fs::path dir = fresh_dir("strata_ckpt_order");
  for (const char* n : {"step-99999999", "step-100000000", "step-00000007", "step-x", ".step-00000009.tmp"})
    fs::create_directories(dir / n);
  const auto found = checkpoints_in(dir.string());
  ASSERT_EQ(found.size(), 3u);
  EXPECT_EQ(found.back().first, 100000000);
  EXPECT_EQ(found.front().first, 7);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
