// Checkpoints of `strata train`: files and their integrity, not the engine's state (the
// engine turns its shards into the plan-independent global arrays and back). A checkpoint
// is a folder D/step-NNNNNNNN holding one shard file per rank (rank r: the r-th of W equal
// slices of the global state [parameters | Adam m | Adam v], fp32, in the single-rank
// layout) and manifest.json (plan, step, counters, every file's size and FNV-1a 64 hash).
// It is written into D/.tmp-step-NNNNNNNN, every file fsynced, then renamed into place and
// D fsynced: a folder named step-* is complete. Because the state is global, a checkpoint
// loads under any plan (resharding). D must be one folder every rank sees (a local disk on
// one machine, or a shared filesystem across machines).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>  // the manifest holds the plan by value

#include "costmodel/json_input.h"

namespace strata {

struct CheckpointMeta {
  int64_t step = 0;        // steps done
  int64_t adam_step = 0;   // updates applied
  int64_t good_steps = 0;  // fp16: steps since the loss scale last changed
  double loss_scale = 1;
  uint64_t seed = 0;
  std::string model, data;
  Json plan;
  int64_t global_params = 0;  // floats per global array
  int world_size = 1;
};

std::string checkpoint_name(int64_t step);  // "step-00000010"
uint64_t fnv1a64(const void* data, size_t bytes);

// The slice of `total` floats rank r of w writes: [begin, end).
void shard_range(int64_t total, int r, int w, int64_t* begin, int64_t* end);

// Writes rank r's slice into `tmp_dir` (which exists) and fsyncs it; returns "name size hash".
// `die_halfway` (fault injection): SIGKILL once half the bytes are on disk.
std::string write_shard(const std::string& tmp_dir, int rank, const float* data, int64_t n, bool die_halfway = false);
// Rank 0, after every shard is written: the manifest (shard lines from every rank), fsync,
// rename tmp_dir to its final name, fsync the parent, and remove all but the newest `keep`.
void commit_checkpoint(const std::string& dir, const std::string& tmp_dir, const CheckpointMeta& meta,
                       const std::vector<std::string>& shard_lines, int64_t keep);

// The step-N folders under dir, by step (complete or not: only renamed folders are named so).
std::vector<std::pair<int64_t, std::filesystem::path>> checkpoints_in(const std::string& dir);
// The newest checkpoint folder under dir ("" when none). Only complete (renamed) folders.
std::string newest_checkpoint(const std::string& dir);
// A checkpoint folder's manifest alone (its meta data; the manifest's JSON into `manifest`
// when asked): what a run checks before it loads the state. Throws InputError.
CheckpointMeta read_checkpoint_meta(const std::string& path, Json* manifest = nullptr);
// Whether a run may resume from it: the same model (name and parameter count), seed and
// data, and not past the run's last step; else an InputError naming the difference.
void check_resume_meta(const CheckpointMeta& meta, const std::string& path, const std::string& model,
                       int64_t global_params, uint64_t seed, const std::string& data, int64_t steps);
// Reads and verifies a checkpoint folder (sizes and hashes of every file): the meta data and
// the global state (3 * global_params floats). Throws InputError naming what is wrong.
std::vector<float> read_checkpoint(const std::string& path, CheckpointMeta* meta);

}  // namespace strata
