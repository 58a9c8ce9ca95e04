// Runs `strata train` under mpirun for the tests (train_test, checkpoint_test, fault_test): the JSON,
// the losses and the gathered parameters (--dump-params) of one run.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace strata_test {

using Json = nlohmann::json;

inline std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// An empty folder under the test temp dir, unique to this process.
inline std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path d =
      std::filesystem::path(::testing::TempDir()) / (name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

struct TrainRun {
  int rc = -1;
  std::string out, err;
  Json j;
  std::vector<float> params;
  std::vector<double> losses;
};

inline int ranks_of(const std::string& plan) {
  int n = 1;
  for (const char* k : {"tp=", "pp=", "dp=", "cp="}) {
    const size_t at = plan.find(k);
    if (at != std::string::npos && (at == 0 || plan[at - 1] == ',')) n *= std::stoi(plan.substr(at + 3));
  }
  return n;
}

// Runs strata train on `np` ranks (default: the plan's world size) under a 5-minute timeout.
inline TrainRun train(const std::string& model, const std::string& plan, int steps, const std::string& extra = "", int np = 0) {
  static int counter = 0;
  const std::string base =
      ::testing::TempDir() + "strata_train_" + std::to_string(::getpid()) + "_" + std::to_string(++counter);
  if (np == 0) np = ranks_of(plan);
  std::ostringstream cmd;
  cmd << "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_pml=ob1 "
      << "ASAN_OPTIONS=detect_leaks=0 timeout 300 " << STRATA_MPIEXEC << " -np " << np << " " << STRATA_BINARY
      << " train --model " << model << " --plan '" << plan << "' --steps " << steps << " --quiet --json " << base
      << ".json --dump-params " << base << ".bin " << extra << " > " << base << ".out 2> " << base << ".err";
  TrainRun r;
  const int status = std::system(cmd.str().c_str());
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(base + ".out");
  r.err = slurp(base + ".err");
  if (r.rc == 0) {
    r.j = Json::parse(slurp(base + ".json"));
    for (const auto& s : r.j["steps"]) r.losses.push_back(s["loss"].get<double>());
    const std::string bin = slurp(base + ".bin");
    r.params.resize(bin.size() / sizeof(float));
    std::copy(bin.begin(), bin.end(), reinterpret_cast<char*>(r.params.data()));
  }
  // Each run's files are read: remove them (a parameter dump is megabytes, and a test
  // binary runs dozens of trainings).
  for (const char* ext : {".json", ".bin", ".out", ".err"}) {
    std::error_code ec;
    std::filesystem::remove(base + ext, ec);
  }
  return r;
}

}  // namespace strata_test
