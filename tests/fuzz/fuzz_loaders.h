// One fuzz input through the loaders of user input (issue 6): the first byte picks the
// loader, the rest is its input (the command-line specs' target also reads it as a
// Megatron-LM launch). Everything a loader accepts goes on through the code that
// uses it (check_plan, estimate, a token batch), so a value a loader lets through cannot
// crash what comes after. InputError is the one allowed failure (exit 2 in the CLI); any
// other exception, crash, hang, sanitizer report or oversized allocation is a bug.
// Used by tests/fuzz/loaders_fuzz.cpp (libFuzzer, clang) and tests/fuzz_corpus_test.cpp
// (the corpus replayed by ctest: g++ in Release, clang under the sanitizers).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "costmodel/estimate.h"
#include "costmodel/hardware.h"
#include "costmodel/json_input.h"
#include "costmodel/megatron_args.h"
#include "costmodel/model_spec.h"
#include "costmodel/plan.h"
#include "executor/checkpoint.h"
#include "executor/data.h"
#include "executor/fault.h"

namespace strata_fuzz {

inline const char* kTargets[] = {"model", "hf-config", "plan-json", "plan-inline", "cluster", "token-file",
                                 "checkpoint-manifest", "specs"};

inline void estimate_if_valid(const strata::ModelSpec& m, const strata::Cluster& cl, const strata::Plan& p) {
  if (!strata::check_plan(m, cl, p).empty()) return;
  const strata::Estimate e = strata::estimate(m, cl, p);
  (void)e;
}

inline std::string scratch(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("strata-fuzz-" + std::to_string(::getpid()) + "-" + name)).string();
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline void run_one(const uint8_t* data, size_t size) {
  using namespace strata;
  if (size == 0) return;
  const int target = data[0] % 8;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  static const Cluster a100 = load_cluster("dgx-a100-80g");
  static const ModelSpec gpt2 = load_model("gpt2-124m");
  static const Plan one = load_plan("tp=1,pp=1,dp=1,mbs=1");
  static const Plan eight = load_plan("tp=2,pp=2,dp=2,mbs=1,gbs=8");
  try {
    switch (target) {
      case 0: {
        const ModelSpec m = model_from_json(parse_json_text(text, "fuzz"), "fuzz");
        estimate_if_valid(m, a100, one);
        estimate_if_valid(m, a100, eight);
        break;
      }
      case 1: {
        const ModelSpec m = model_from_hf_config(parse_json_text(text, "fuzz"), "fuzz");
        estimate_if_valid(m, a100, one);
        break;
      }
      case 2:
        estimate_if_valid(gpt2, a100, plan_from_json(parse_json_text(text, "fuzz"), "fuzz"));
        break;
      case 3:
        estimate_if_valid(gpt2, a100, plan_from_json(parse_inline_pairs(text, "fuzz"), "fuzz"));
        break;
      case 4: {
        const Cluster cl = cluster_from_json(parse_json_text(text, "fuzz"), "fuzz");
        estimate_if_valid(gpt2, cl, one);
        estimate_if_valid(gpt2, cl, eight);
        break;
      }
      case 5: {  // a token file for a model of vocabulary 1000 and sequence 4
        const std::string path = scratch("tokens.bin");
        write_file(path, text);
        TokenSource src(path, 1000, 4, 7);
        std::vector<int32_t> in, out;
        src.micro_batch(0, 2, 1, 0, 0, 2, &in, &out);
        src.micro_batch(3, 2, 1, 0, 1, 2, &in, &out);
        break;
      }
      case 6: {  // a checkpoint folder: the input as its manifest, beside one 12-byte shard
        const std::string dir = scratch("ckpt");
        std::filesystem::create_directories(dir);
        const float shard[3] = {1.0f, 2.0f, 3.0f};
        write_file(dir + "/shard-00000.bin", std::string(reinterpret_cast<const char*>(shard), sizeof(shard)));
        write_file(dir + "/manifest.json", text);
        CheckpointMeta meta;
        read_checkpoint(dir, &meta);
        break;
      }
      default: {  // the small specs of the command line
        (void)parse_fault(text, 4);
        break;
      }
    }
  } catch (const InputError&) {
  }
  if (target == 7) {
    try {
      TokenSource src("synthetic:" + text, 1000, 4, 7);
    } catch (const InputError&) {
    }
    try {  // the text as a Megatron-LM launch (strata estimate --megatron-args) on 8 GPUs
      const LaunchInputs in = launch_inputs(parse_megatron_launch(text, "fuzz"), 8, "fuzz");
      estimate_if_valid(in.model, a100, in.plan);
    } catch (const InputError&) {
    }
  }
}

}  // namespace strata_fuzz
