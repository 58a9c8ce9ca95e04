// For test binaries that are their own MPI program: run directly, the gtest re-runs this
// executable under mpirun (STRATA_MPIEXEC); under mpirun (OMPI_COMM_WORLD_SIZE set) main
// runs one rank of the check instead.
#pragma once

#include <unistd.h>

#include <array>
#include <cstdio>
#include <string>

namespace strata {

// Runs this executable on np ranks with `env` (VAR=value ...) before the launcher; returns
// everything the ranks printed (also echoed) and sets *rc to the launcher's exit status.
inline std::string run_self_under_mpirun(int np, const std::string& env, int* rc) {
  *rc = -1;
  char self[4096] = {};
  if (readlink("/proc/self/exe", self, sizeof(self) - 1) <= 0) return "readlink /proc/self/exe failed";
  // Open MPI keeps allocations until exit (see CMakeLists.txt): no leak report from the ranks.
  const std::string cmd = "ASAN_OPTIONS=detect_leaks=0 " + env + " timeout 300 " + STRATA_MPIEXEC +
                          " --oversubscribe -np " + std::to_string(np) + " " + self + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return "popen failed";
  std::string out;
  std::array<char, 4096> buf{};
  while (fgets(buf.data(), static_cast<int>(buf.size()), p)) out += buf.data();
  *rc = pclose(p);
  std::printf("%s", out.c_str());
  return out;
}

}  // namespace strata
