// The engine's side of checkpoints: its shards of parameters and Adam moments become the
// plan-independent global arrays (save), and global arrays become any plan's shards
// (load, so a checkpoint moves between plans). Files and integrity: checkpoint.h.
#include <cmath>
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "executor/checkpoint.h"
#include "executor/engine.h"

namespace strata {

namespace fs = std::filesystem;

std::vector<int64_t> Engine::global_index() const {
  const ParamLayout g = global_param_layout(m_);
  std::vector<int64_t> idx(static_cast<size_t>(lay_.size), -1);
  for (const TensorSlot& s : lay_.tensors) {
    const TensorSlot& gs = g.at(s.kind, s.layer);
    for (int64_t i = 0; i < s.rows; ++i)
      for (int64_t j = 0; j < s.cols; ++j) {
        int64_t gi = 0, gj = 0;
        global_coords(m_, s, plan_.t, me_.tp, i, j, &gi, &gj);
        idx[static_cast<size_t>(s.offset + i * s.cols + j)] = gs.offset + gi * gs.cols + gj;
      }
  }
  return idx;
}

void Engine::save_checkpoint(int64_t step) {
  // Global parameters, m and v: every rank ends with all three (one world all-reduce each).
  const std::vector<float> gp = global_params(full_fp32_params());
  const std::vector<float> gm = global_params(full_of([this](size_t u) -> const float* { return adam_m_.data() + sh_.shard_off[u]; }));
  const std::vector<float> gv = global_params(full_of([this](size_t u) -> const float* { return adam_v_.data() + sh_.shard_off[u]; }));
  const int64_t G = static_cast<int64_t>(gp.size());
  // A checkpoint never holds NaN or Inf: such a state is not written (the last good one stays).
  for (const std::vector<float>* v : {&gp, &gm, &gv})
    for (float x : *v)
      if (!std::isfinite(x)) {
        if (comm_.rank() == 0)
          std::fprintf(stderr, "strata: warning: checkpoint of step %lld not written: the state holds NaN or Inf\n",
                       static_cast<long long>(step));
        return;
      }
  int64_t b = 0, e = 0;
  shard_range(3 * G, comm_.rank(), comm_.size(), &b, &e);
  std::vector<float> slice(static_cast<size_t>(e - b));
  for (int64_t i = b; i < e; ++i) {
    const std::vector<float>& src = i < G ? gp : i < 2 * G ? gm : gv;
    slice[static_cast<size_t>(i - b)] = src[static_cast<size_t>(i % G)];
  }
  const std::string tmp = (fs::path(o_.checkpoint_dir) / fmt::format(".{}.tmp", checkpoint_name(step))).string();
  std::string error;
  if (comm_.rank() == 0) {
    std::error_code ec;
    fs::create_directories(o_.checkpoint_dir, ec);
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    if (ec) error = "--checkpoint-dir: cannot create '" + tmp + "': " + ec.message();
  }
  int bad = error.empty() ? 0 : 1;
  double flag = bad;
  comm_.all_reduce(&flag, 1, world_, ReduceOp::max);
  if (flag > 0) throw InputError(error.empty() ? "checkpoint: rank 0 could not create the folder" : error);
  const std::string line = write_shard(tmp, comm_.rank(), slice.data(), e - b,
                                       o_.fault.at(comm_.rank(), step, FaultInjection::Kind::kill_in_checkpoint));
  const std::vector<std::string> lines = comm_.gather_strings(line, 0);
  if (comm_.rank() == 0) {
    CheckpointMeta meta;
    meta.step = step;
    meta.adam_step = adam_step_;
    meta.good_steps = good_steps_;
    meta.loss_scale = loss_scale_;
    meta.seed = o_.seed;
    meta.model = m_.name;
    meta.data = o_.data;
    meta.plan = plan_to_json(plan_);
    meta.global_params = G;
    meta.world_size = comm_.size();
    commit_checkpoint(o_.checkpoint_dir, tmp, meta, lines, o_.keep_checkpoints);
  }
  comm_.barrier(world_);  // complete on disk before any rank goes on
}

void Engine::load_checkpoint(const std::string& path) {
  CheckpointMeta meta;
  const std::vector<float> state = read_checkpoint(path, &meta);
  const int64_t G = global_param_layout(m_).size;
  check_resume_meta(meta, path, m_.name, G, o_.seed, o_.data, o_.steps);
  const std::vector<int64_t> idx = global_index();
  auto value = [&](int which, int64_t local) {
    return state[static_cast<size_t>(which * G + idx[static_cast<size_t>(local)])];
  };
  // The buffers live in the backend's memory (a GPU's, perhaps): each is copied to the host,
  // filled there (padding untouched) and copied back.
  auto down = [&](const Buf& b) {
    std::vector<float> h(static_cast<size_t>(b.size()));
    be_.to_host(h.data(), b.data(), b.size());
    return h;
  };
  auto up = [&](Buf& b, const std::vector<float>& h) { be_.to_device(b.data(), h.data(), b.size()); };
  if (zero_ < 3) {
    std::vector<float> w = down(work_);
    for (size_t u = 0; u < lay_.units.size(); ++u)
      for (int64_t i = lay_.units[u].begin; i < lay_.units[u].end; ++i)
        w[static_cast<size_t>(sh_.full_off[u] + (i - lay_.units[u].begin))] = value(0, i);
    up(work_, w);
  }
  std::vector<float> master = down(master_), shard = down(work_shard_), am = down(adam_m_), av = down(adam_v_);
  for (size_t u = 0; u < lay_.units.size(); ++u) {
    const int64_t lo = sh_.me * sh_.shard[u];
    for (int64_t i = 0; i < sh_.shard[u]; ++i) {
      const size_t off = static_cast<size_t>(sh_.shard_off[u] + i);
      if (lo + i >= lay_.units[u].size()) continue;  // padding
      const int64_t local = lay_.units[u].begin + lo + i;
      if (mixed()) master[off] = value(0, local);
      if (zero_ == 3) shard[off] = value(0, local);
      am[off] = value(1, local);
      av[off] = value(2, local);
    }
  }
  if (mixed()) up(master_, master);
  if (zero_ == 3) up(work_shard_, shard);
  up(adam_m_, am);
  up(adam_v_, av);
  if (mixed()) {  // working weights: the master rounded, as after an optimizer step
    if (zero_ < 3) be_.round_to(work_.data(), work_.size(), plan_.precision);
    else be_.round_to(work_shard_.data(), work_shard_.size(), plan_.precision);
  }
  adam_step_ = meta.adam_step;
  good_steps_ = meta.good_steps;
  loss_scale_ = meta.loss_scale;
  start_step_ = meta.step;
}

}  // namespace strata
