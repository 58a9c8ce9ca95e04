// Flag parsing; see args.h.
#include "cli/args.h"

#include <unistd.h>

#include <cctype>
#include <filesystem>

#include <fmt/format.h>

#include "costmodel/json_input.h"
#include "executor/cuda/cuda_backend.h"

namespace strata {

Args::Args(const std::vector<std::string>& argv, const std::string& command, const std::set<std::string>& value_flags,
           const std::set<std::string>& bool_flags)
    : command_(command) {
  for (size_t i = 0; i < argv.size(); ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || a.size() < 3)
      throw InputError(fmt::format("strata {}: unexpected argument '{}' (flags start with --; see strata {} --help)",
                                   command, a, command));
    std::string name = a.substr(2), value;
    bool inline_value = false;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    if (bool_flags.count(name)) {
      if (inline_value) throw InputError(fmt::format("strata {}: --{} takes no value", command, name));
      value.assign(1, '1');
    } else if (value_flags.count(name)) {
      if (!inline_value) {
        if (i + 1 >= argv.size())
          throw InputError(fmt::format("strata {}: --{} needs a value", command, name));
        value = argv[++i];
      }
      if (value.empty()) throw InputError(fmt::format("strata {}: --{} needs a non-empty value", command, name));
    } else {
      throw InputError(fmt::format("strata {}: unknown flag --{} (see strata {} --help)", command, name, command));
    }
    if (values_.count(name)) throw InputError(fmt::format("strata {}: --{} given twice", command, name));
    values_[name] = value;
  }
}

std::string Args::get(const std::string& flag, const std::string& fallback) const {
  auto it = values_.find(flag);
  return it == values_.end() ? fallback : it->second;
}

std::string Args::required(const std::string& flag, const std::string& what) const {
  auto it = values_.find(flag);
  if (it == values_.end()) throw InputError(fmt::format("strata {}: --{} is required ({})", command_, flag, what));
  return it->second;
}

int64_t Args::integer(const std::string& flag, int64_t fallback, int64_t lo, int64_t hi) const {
  auto it = values_.find(flag);
  if (it == values_.end()) return fallback;
  const std::string& s = it->second;
  bool ok = !s.empty() && s.size() <= 18;
  for (size_t i = 0; i < s.size() && ok; ++i)
    ok = std::isdigit(static_cast<unsigned char>(s[i])) || (i == 0 && s[i] == '-' && s.size() > 1);
  const std::string rule = fmt::format("must be an integer in [{}, {}]", lo, hi);
  if (!ok) fail_field("--" + flag, "'" + s + "'", rule);
  const int64_t v = std::stoll(s);
  if (v < lo || v > hi) fail_field("--" + flag, s, rule);
  return v;
}

Precision parse_precision(const std::string& s, bool allow_fp8) {
  if (s == "bf16") return Precision::bf16;
  if (s == "fp16") return Precision::fp16;
  if (s == "fp32") return Precision::fp32;
  if (s == "fp8" && allow_fp8) return Precision::fp8;
  fail_field("--precision", "'" + s + "'",
             allow_fp8 ? "must be one of bf16, fp16, fp8, fp32" : "must be one of fp32, bf16, fp16 (what the CPU executor runs)");
}

void check_precision_on(const Cluster& cl, Precision p, const std::string& field) {
  if (p == Precision::fp8 && cl.device.peak_bf16_flops <= 0)
    fail_field(field, "fp8",
               fmt::format("runs attention and the output layer in bf16, which {} ({}) does not support", cl.device.name,
                           cl.name));
  if (cl.device.peak_flops(p) <= 0)
    fail_field(field, to_string(p), fmt::format("is not supported by {} ({})", cl.device.name, cl.name));
}

void check_backend(const std::string& backend, const std::string& command) {
  if (backend == "cpu") return;
  if (backend != "cuda") throw InputError("--backend: '" + backend + "' must be cpu or cuda");
  const std::string why = cuda_unavailable_reason();
  if (!why.empty()) throw InputError("--backend cuda: " + why);
  if (command == "train" || command == "profile") return;
  throw InputError("--backend cuda: `strata " + command + "` does not run on the CUDA backend (train and profile do)");
}

namespace {

// The folder a path's file goes in ("." for a bare name).
std::filesystem::path folder_of(const std::filesystem::path& p) {
  const std::filesystem::path parent = p.parent_path();
  return parent.empty() ? std::filesystem::path(".") : parent;
}

}  // namespace

void check_output_file(const std::string& flag, const std::string& path) {
  if (path.empty() || path == "-") return;
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (fs::exists(st)) {
    if (fs::is_directory(st)) fail_field(flag, "'" + path + "'", "is a folder; give a file name");
    if (access(path.c_str(), W_OK) != 0) fail_field(flag, "'" + path + "'", "exists and cannot be written");
    return;  // (a file, or /dev/null, /dev/stdout, a shell's >(...) pipe: the user's to give)
  }
  const fs::path dir = folder_of(path);
  if (!fs::is_directory(dir, ec)) fail_field(flag, "'" + path + "'", "names a folder that does not exist: " + dir.string());
  if (access(dir.c_str(), W_OK | X_OK) != 0)
    fail_field(flag, "'" + path + "'", "cannot be written: its folder " + dir.string() + " is not writable");
}

void check_output_folder(const std::string& flag, const std::string& path, bool written) {
  if (path.empty()) return;
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path at = path;
  if (fs::exists(at, ec)) {
    if (!fs::is_directory(at, ec)) fail_field(flag, "'" + path + "'", "is not a folder");
    if (written && access(path.c_str(), W_OK | X_OK) != 0)
      fail_field(flag, "'" + path + "'", "is a folder that cannot be written");
    return;
  }
  if (!written) return;
  // The nearest existing folder above it must let the rest be created.
  at = fs::absolute(at, ec);
  while (at.has_parent_path() && at != at.parent_path() && !fs::exists(at, ec)) at = at.parent_path();
  if (!fs::is_directory(at, ec))
    fail_field(flag, "'" + path + "'", "cannot be created: " + at.string() + " is not a folder");
  if (access(at.c_str(), W_OK | X_OK) != 0)
    fail_field(flag, "'" + path + "'", "cannot be created: " + at.string() + " is not writable");
}

void check_distinct_outputs(const std::vector<std::pair<std::string, std::string>>& flag_paths) {
  namespace fs = std::filesystem;
  for (size_t i = 0; i < flag_paths.size(); ++i)
    for (size_t k = i + 1; k < flag_paths.size(); ++k) {
      const std::string& a = flag_paths[i].second;
      const std::string& b = flag_paths[k].second;
      if (a.empty() || b.empty() || a == "-" || b == "-") continue;
      std::error_code ea, eb;
      const fs::path ca = fs::weakly_canonical(a, ea), cb = fs::weakly_canonical(b, eb);
      bool same = !ea && !eb && ca == cb;
      if (!same && fs::exists(ca, ea) && fs::exists(cb, eb)) same = fs::equivalent(ca, cb, ea) && !ea;  // hard links
      if (same && !fs::is_character_file(ca, ea))  // (two outputs to /dev/null are fine)
        fail_field(flag_paths[k].first, "'" + b + "'", "names the same file as " + flag_paths[i].first + ": give another");
    }
}

}  // namespace strata
