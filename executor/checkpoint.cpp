// Checkpoint files; see checkpoint.h.
#include "executor/checkpoint.h"
#include "executor/fault.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include <fmt/format.h>

namespace strata {
namespace {

namespace fs = std::filesystem;

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) throw InputError("checkpoint: cannot open '" + path + "' to sync it");
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw InputError("checkpoint: fsync of '" + path + "' failed");
}

void write_file_synced(const std::string& path, const void* data, size_t bytes) {
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    f.close();
    if (!f) throw InputError("checkpoint: cannot write '" + path + "'");
  }
  fsync_path(path, false);
}

}  // namespace

std::string checkpoint_name(int64_t step) { return fmt::format("step-{:08d}", step); }

uint64_t fnv1a64(const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64 offset basis
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;  // FNV prime
  }
  return h;
}

void shard_range(int64_t total, int r, int w, int64_t* begin, int64_t* end) {
  const int64_t per = (total + w - 1) / w;
  *begin = std::min(total, per * r);
  *end = std::min(total, *begin + per);
}

std::string write_shard(const std::string& tmp_dir, int rank, const float* data, int64_t n, bool die_halfway) {
  const std::string name = fmt::format("shard-{:05d}.bin", rank);
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  if (die_halfway) {
    write_file_synced((fs::path(tmp_dir) / name).string(), data, bytes / 2);
    inject_kill();
  }
  write_file_synced((fs::path(tmp_dir) / name).string(), data, bytes);
  return fmt::format("{} {} {:016x}", name, bytes, fnv1a64(data, bytes));
}

void commit_checkpoint(const std::string& dir, const std::string& tmp_dir, const CheckpointMeta& meta,
                       const std::vector<std::string>& shard_lines, int64_t keep) {
  Json files = Json::array();
  for (const std::string& line : shard_lines) {
    std::istringstream in(line);
    std::string name, hash;
    int64_t bytes = 0;
    in >> name >> bytes >> hash;
    files.push_back({{"name", name}, {"bytes", bytes}, {"fnv1a64", hash}});
  }
  const Json j = {{"format", "strata-checkpoint-1"},
                  {"step", meta.step},
                  {"adam_step", meta.adam_step},
                  {"good_steps", meta.good_steps},
                  {"loss_scale", meta.loss_scale},
                  {"seed", meta.seed},
                  {"model", meta.model},
                  {"data", meta.data},
                  {"plan", meta.plan},
                  {"global_params", meta.global_params},
                  {"world_size", meta.world_size},
                  {"state", "parameters, adam_m, adam_v: fp32, single-rank layout, sliced across the shards in order"},
                  {"files", files}};
  const std::string text = j.dump(2) + "\n";
  write_file_synced((fs::path(tmp_dir) / "manifest.json").string(), text.data(), text.size());
  fsync_path(tmp_dir, true);
  const fs::path final_dir = fs::path(dir) / checkpoint_name(meta.step);
  std::error_code ec;
  fs::remove_all(final_dir, ec);  // a checkpoint of the same step from an earlier run
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) throw InputError("checkpoint: cannot rename '" + tmp_dir + "' to '" + final_dir.string() + "': " + ec.message());
  fsync_path(dir, true);
  // Keep the newest `keep`, by step.
  std::vector<std::pair<int64_t, fs::path>> found = checkpoints_in(dir);
  for (size_t i = 0; keep > 0 && i + static_cast<size_t>(keep) < found.size(); ++i) fs::remove_all(found[i].second, ec);
}

std::vector<std::pair<int64_t, fs::path>> checkpoints_in(const std::string& dir) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (!e.is_directory() || n.rfind("step-", 0) != 0 || n.size() <= 5 || n.size() > 5 + 18) continue;
    if (!std::all_of(n.begin() + 5, n.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    found.push_back({std::stoll(n.substr(5)), e.path()});
  }
  std::sort(found.begin(), found.end());
  return found;
}

std::string newest_checkpoint(const std::string& dir) {
  const std::vector<std::pair<int64_t, fs::path>> found = checkpoints_in(dir);
  for (auto it = found.rbegin(); it != found.rend(); ++it)
    if (fs::exists(it->second / "manifest.json")) return it->second.string();  // (read_checkpoint checks it)
  return "";
}

CheckpointMeta read_checkpoint_meta(const std::string& path, Json* manifest) {
  CheckpointMeta m;
  Json j;
  CheckpointMeta* meta = &m;
  {
    std::error_code ec;
    if (fs::exists(fs::path(path) / "manifest.json", ec) && !fs::is_regular_file(fs::path(path) / "manifest.json", ec))
      throw InputError("checkpoint '" + path + "': manifest.json is not a regular file (a pipe or a device?)");
    std::ifstream f(fs::path(path) / "manifest.json");
    if (!f) throw InputError("checkpoint '" + path + "': no manifest.json");
    try {
      j = Json::parse(f);
    } catch (const std::exception& e) {
      throw InputError("checkpoint '" + path + "': manifest.json is not JSON: " + e.what());
    }
  }
  try {
    if (j.at("format") != "strata-checkpoint-1") throw InputError("checkpoint '" + path + "': unknown format");
    // Numbers through the checked readers: a float where an integer belongs (1e56 as a
    // world size) is refused, not converted (undefined behaviour; found by fuzzing).
    Fields f(j, "checkpoint '" + path + "': manifest.json");
    constexpr int64_t kMax = INT64_MAX / 4;
    meta->step = f.integer("step", 0, kMax);
    meta->adam_step = f.integer("adam_step", 0, kMax);
    meta->good_steps = f.integer("good_steps", 0, kMax);
    meta->loss_scale = f.real("loss_scale", 0.0, std::numeric_limits<double>::max());
    meta->seed = static_cast<uint64_t>(f.integer("seed", 0, INT64_MAX));
    meta->model = f.string("model");
    meta->data = f.string("data");
    meta->plan = j.at("plan");
    meta->global_params = f.integer("global_params", 0, kMax);
    meta->world_size = static_cast<int>(f.integer("world_size", 1, 1 << 24));
  } catch (const InputError&) {
    throw;
  } catch (const std::exception& e) {
    throw InputError("checkpoint '" + path + "': manifest.json: " + e.what());
  }
  if (meta->global_params <= 0 || meta->global_params > (int64_t{1} << 34) || meta->step < 0)
    throw InputError("checkpoint '" + path + "': manifest.json: implausible global_params or step");
  if (manifest) *manifest = std::move(j);
  return m;
}

void check_resume_meta(const CheckpointMeta& meta, const std::string& path, const std::string& model,
                       int64_t global_params, uint64_t seed, const std::string& data, int64_t steps) {
  if (meta.model != model || meta.global_params != global_params)
    throw InputError("checkpoint '" + path + "': holds model " + meta.model + " (" + std::to_string(meta.global_params) +
                     " parameters), not " + model + " (" + std::to_string(global_params) + ")");
  if (meta.seed != seed || meta.data != data)
    throw InputError("checkpoint '" + path + "': was trained with --seed " + std::to_string(meta.seed) + " --data " +
                     meta.data + "; resume with the same ones (the data order depends on them)");
  if (meta.step > steps)
    throw InputError("checkpoint '" + path + "': is at step " + std::to_string(meta.step) + ", beyond --steps " +
                     std::to_string(steps));
}

std::vector<float> read_checkpoint(const std::string& path, CheckpointMeta* meta) {
  Json j;
  *meta = read_checkpoint_meta(path, &j);
  const int64_t total = 3 * meta->global_params;
  std::vector<std::pair<std::string, int64_t>> entries;
  std::vector<std::string> hashes;
  try {
    for (const Json& fj : j.at("files")) {
      Fields f(fj, "checkpoint '" + path + "': manifest.json files[]");
      const std::string name = f.string("name");
      entries.push_back({name, f.integer("bytes", 0, INT64_MAX / 4)});
      hashes.push_back(f.string("fnv1a64"));
    }
  } catch (const InputError&) {
    throw;
  } catch (const std::exception& e) {
    throw InputError("checkpoint '" + path + "': manifest.json files: " + e.what());
  }
  // Every entry checked against the files on disk before anything is allocated: the state
  // is as large as the shards really are, never as large as a manifest claims.
  int64_t listed = 0;
  std::set<std::string> names;
  for (const auto& [name, bytes] : entries) {
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == ".." || bytes < 0 ||
        bytes % 4 != 0 || bytes / 4 > total - listed || !names.insert(name).second)
      throw InputError("checkpoint '" + path + "': manifest lists a bad file entry '" + name + "'");
    std::error_code ec;
    const auto on_disk = fs::file_size(fs::path(path) / name, ec);
    if (ec) throw InputError("checkpoint '" + path + "': missing " + name);
    if (static_cast<int64_t>(on_disk) != bytes)
      throw InputError("checkpoint '" + path + "': " + name + " is " + std::to_string(on_disk) + " bytes, not " +
                       std::to_string(bytes));
    listed += bytes / 4;
  }
  if (listed != total)
    throw InputError("checkpoint '" + path + "': the shards hold " + std::to_string(listed) + " of " +
                     std::to_string(total) + " floats");
  std::vector<float> state(static_cast<size_t>(total));
  int64_t at = 0;
  for (size_t k = 0; k < entries.size(); ++k) {
    const std::string& name = entries[k].first;
    const int64_t bytes = entries[k].second;
    std::ifstream f(fs::path(path) / name, std::ios::binary);
    if (!f) throw InputError("checkpoint '" + path + "': missing " + name);
    f.read(reinterpret_cast<char*>(state.data() + at), bytes);
    if (f.gcount() != bytes || f.peek() != EOF)
      throw InputError("checkpoint '" + path + "': " + name + " is not " + std::to_string(bytes) + " bytes");
    const std::string hash = fmt::format("{:016x}", fnv1a64(state.data() + at, static_cast<size_t>(bytes)));
    if (hash != hashes[k])
      throw InputError("checkpoint '" + path + "': " + name + " fails its checksum (corrupt)");
    at += bytes / 4;
  }
  if (at != total) throw InputError("checkpoint '" + path + "': the shards hold " + std::to_string(at) + " of " +
                                    std::to_string(total) + " floats");
  return state;
}

}  // namespace strata
