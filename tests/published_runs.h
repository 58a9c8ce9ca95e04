// Reads tests/data/published_runs.csv (a copy of shared/calibration/) and turns each usable
// row into the model JSON, plan JSON and cluster preset the validation harness builds,
// following the rules of that folder's README. Used by calibration_test and planner_bench.
#pragma once

#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace strata::testing {

using Row = std::map<std::string, std::string>;

// RFC 4180 CSV: quoted fields may hold commas, newlines and doubled quotes.
inline std::vector<Row> read_csv(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string s = ss.str();
  std::vector<std::vector<std::string>> recs(1);
  std::string field;
  bool quoted = false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char ch = s[i];
    if (quoted) {
      if (ch == '"' && i + 1 < s.size() && s[i + 1] == '"') field += '"', ++i;
      else if (ch == '"') quoted = false;
      else field += ch;
    } else if (ch == '"') {
      quoted = true;
    } else if (ch == ',') {
      recs.back().push_back(field), field.clear();
    } else if (ch == '\n' || ch == '\r') {
      if (ch == '\r' && i + 1 < s.size() && s[i + 1] == '\n') ++i;
      recs.back().push_back(field), field.clear();
      recs.emplace_back();
    } else {
      field += ch;
    }
  }
  if (!field.empty() || !recs.back().empty()) recs.back().push_back(field);
  std::vector<Row> rows;
  if (recs.empty()) return rows;
  const auto& head = recs.front();
  for (size_t r = 1; r < recs.size(); ++r) {
    if (recs[r].size() < head.size()) continue;
    Row row;
    for (size_t c = 0; c < head.size(); ++c) row[head[c]] = recs[r][c];
    rows.push_back(row);
  }
  return rows;
}

struct Case {
  std::string row_id, source, model_label;
  nlohmann::json model, plan;
  std::string cluster;
  double measured_step_s = 0;  // 0 when the row has no step time (OOM rows)
  double measured_memory_bytes = 0;
  bool oom = false;
};

inline double num(const Row& r, const std::string& k, double fallback = 0) {
  std::string v = r.at(k);
  if (!v.empty() && v[0] == '~') v = v.substr(1);
  if (v.empty()) return fallback;
  try {
    return std::stod(v);
  } catch (...) {
    return fallback;
  }
}

inline bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// Returns false for rows the harness skips.
inline bool make_case(const Row& r, Case* out) {
  const std::string src = r.at("source_id");
  if (src == "narayanan2021_text" || src == "korthikanti2022_t4") return false;
  Case c;
  c.row_id = r.at("row_id");
  c.source = src;
  c.model_label = r.at("model");
  const double h = num(r, "hidden"), heads = num(r, "heads");
  double vocab = num(r, "vocab");
  if (vocab == 0) vocab = contains(src, "bloom") ? 250880 : 51200;
  double ffn = num(r, "ffn_hidden");
  if (ffn == 0) ffn = 4 * h;
  c.model = {{"name", "row" + c.row_id},
             {"num_layers", static_cast<int64_t>(num(r, "layers"))},
             {"hidden_size", static_cast<int64_t>(h)},
             {"num_attention_heads", static_cast<int64_t>(heads)},
             {"num_query_groups", static_cast<int64_t>(num(r, "kv_heads", heads))},
             {"ffn_hidden_size", static_cast<int64_t>(ffn)},
             {"vocab_size", static_cast<int64_t>(vocab)},
             {"seq_length", static_cast<int64_t>(num(r, "seq_len"))},
             {"activation", "gelu"},
             {"normalization", "layernorm"},
             {"tie_embeddings", true}};
  const double dp = num(r, "dp", 1), gbs = num(r, "global_batch_size");
  double mbs = num(r, "micro_batch_size");
  if (mbs == 0) mbs = gbs / dp;  // Megatron v1: --batch-size is per data-parallel rank
  const std::string z = r.at("zero_or_sharding");
  int zero = 0;
  if (contains(z, "ZeRO-3") || contains(z, "FULL_SHARD") || contains(z, "full sharding")) zero = 3;
  else if (contains(z, "ZeRO-2") || contains(z, "SHARD_GRAD_OP")) zero = 2;
  else if (contains(z, "ZeRO-1") || contains(z, "distributed optimizer") || contains(z, "distributed-optimizer")) zero = 1;
  std::string rc = r.at("recompute");
  std::string recompute = "none";
  if (rc.rfind("full", 0) == 0) recompute = "full";
  else if (rc.rfind("selective", 0) == 0) recompute = "selective";
  if (rc.empty() && src == "megatron_readme_2020") recompute = "full";  // README: Eq. 3 and --checkpoint-activations
  const std::string prec = contains(r.at("precision"), "bf16") ? "bf16" : "fp16";
  c.plan = {{"tensor_parallel", static_cast<int64_t>(num(r, "tp", 1))},
            {"pipeline_parallel", static_cast<int64_t>(num(r, "pp", 1))},
            {"data_parallel", static_cast<int64_t>(dp)},
            {"context_parallel", static_cast<int64_t>(num(r, "cp", 1))},
            {"virtual_pipeline_stages", static_cast<int64_t>(num(r, "vp", 1))},
            {"micro_batch_size", static_cast<int64_t>(mbs)},
            {"global_batch_size", static_cast<int64_t>(gbs)},
            {"zero_stage", zero},
            {"recompute", recompute},
            {"sequence_parallel", r.at("sequence_parallel") == "y"},
            {"precision", prec},
            {"pipeline_schedule", "1f1b"}};
  const std::string gpu = r.at("gpu_type");
  if (contains(gpu, "V100")) c.cluster = "dgx2-v100-32g";
  else if (src == "megatron_readme_2020") c.cluster = "dgx-a100-40g";
  else c.cluster = "dgx-a100-80g";
  c.oom = r.at("other_metric") == "OOM";
  c.measured_memory_bytes = num(r, "memory_gb_per_gpu") * 1e9;
  const double it = num(r, "iteration_time_s");
  if (it > 0) {
    c.measured_step_s = it;
  } else if (!c.oom) {
    // Eq. 3 of Narayanan et al.: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
    const double B = gbs, s = num(r, "seq_len"), l = num(r, "layers");
    const double F = 96.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + vocab / (16.0 * l * h));
    c.measured_step_s = F / (num(r, "tflops_per_gpu") * 1e12 * num(r, "gpu_count"));
  }
  *out = c;
  return true;
}

inline std::vector<Case> published_cases(const std::string& csv_path) {
  std::vector<Case> cases;
  for (const Row& r : read_csv(csv_path)) {
    Case c;
    if (make_case(r, &c)) cases.push_back(c);
  }
  return cases;
}

}  // namespace strata::testing
