// Command-line flags of one subcommand: "--name value", "--name=value" and boolean
// "--name". Unknown flags, missing values and malformed numbers are InputErrors that name
// the flag, so every subcommand reports bad usage the same way (exit code 2).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "costmodel/hardware.h"

namespace strata {

class Args {
 public:
  Args(const std::vector<std::string>& argv, const std::string& command, const std::set<std::string>& value_flags,
       const std::set<std::string>& bool_flags);
  bool has(const std::string& flag) const { return values_.count(flag) > 0; }
  std::string get(const std::string& flag, const std::string& fallback = "") const;
  std::string required(const std::string& flag, const std::string& what) const;
  int64_t integer(const std::string& flag, int64_t fallback, int64_t lo, int64_t hi) const;

 private:
  std::string command_;
  std::map<std::string, std::string> values_;
};

// --precision: bf16, fp16, fp32, and fp8 when `allow_fp8` (the CPU executor runs no fp8).
Precision parse_precision(const std::string& s, bool allow_fp8 = true);
// A --precision the cluster's device cannot run is bad input (exit 2), not a search in
// which every candidate is rejected: the rule of check_plan's "precision" reason.
void check_precision_on(const Cluster& cl, Precision p, const std::string& field = "--precision");

// --backend of `command` (train, profile): "cpu" passes; "cuda" throws InputError saying
// why it cannot run here (no GPU, a build without CUDA, or not yet wired for the command);
// anything else names the allowed values.
void check_backend(const std::string& backend, const std::string& command);

// An output file of `flag` ("--json", "--trace", "--out", ...), checked before the work that
// produces it, on every rank, so that a path that cannot be written fails at once (exit 2)
// rather than after a run: not a folder, its folder existing and writable, and the file
// writable where it exists (/dev/null or a pipe too). "" (not asked for) and "-" (stdout)
// pass. Callers check on the rank that writes it.
void check_output_file(const std::string& flag, const std::string& path);
// An output folder (--checkpoint-dir, --report): a folder where it exists, else creatable
// (the nearest existing folder above it writable), and writable. "" passes. Not `written`
// (a folder only read: --resume without new checkpoints), only a path that exists and is
// not a folder fails.
void check_output_folder(const std::string& flag, const std::string& path, bool written = true);
// Two output flags naming one file: the second would overwrite the first.
void check_distinct_outputs(const std::vector<std::pair<std::string, std::string>>& flag_paths);

}  // namespace strata
