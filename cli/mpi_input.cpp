// Input checks of the MPI subcommands, agreed across ranks (see commands.h).
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "costmodel/json_input.h"
#include "executor/checkpoint.h"
#include "executor/comm.h"
#include "executor/cuda/cuda_backend.h"
#include "executor/cuda/nccl_comm.h"
#include "executor/staged_comm.h"

namespace strata {

bool any_rank_rejected_input(const std::string& error, const std::string& command, const std::vector<std::string>* argv) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::string why = error;
  if (argv) {  // one command line on every rank: the largest hash and the largest complement agree
    std::string joined = command + '\0';
    for (const std::string& w : *argv) joined += w + '\0';
    uint64_t h[2] = {fnv1a64(joined.data(), joined.size()), 0};
    h[1] = ~h[0];
    MPI_Allreduce(MPI_IN_PLACE, h, 2, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
    if (h[0] != ~h[1] && why.empty())
      why = "the ranks were started with different arguments (mpirun's ':' form?): every rank must run the same command";
  }
  int bad = why.empty() ? 0 : 1;
  MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (!bad) return false;
  fmt::print(stderr, "strata: error: rank {} of {}: {}\n", rank, size,
             why.empty() ? "another rank found invalid input (see its message)" : why);
  MPI_Finalize();
  return true;
}

int ranks_sharing(const std::string& device) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(host, &len);
  // A hash of "host/device" as the split colour (non-negative, as MPI_Comm_split wants).
  const std::string key = std::string(host, static_cast<size_t>(len)) + "/" + device;
  const uint64_t h = fnv1a64(key.data(), key.size());
  MPI_Comm same = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, static_cast<int>(h & 0x7fffffffu), rank, &same);
  int n = 1;
  MPI_Comm_size(same, &n);
  MPI_Comm_free(&same);
  return n;
}

int node_processors(int sharing) {
  if (sharing <= 0) return node_cpus().cores;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  double share = 1.0 / sharing;  // each GPU counted once: 1 / (its ranks) from each of them
  MPI_Allreduce(MPI_IN_PLACE, &share, 1, MPI_DOUBLE, MPI_SUM, node);
  MPI_Comm_free(&node);
  return std::max(1, static_cast<int>(std::lround(share)));
}

int node_local_rank(int* local_size) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int local = 0, n = 1;
  MPI_Comm_rank(node, &local);
  MPI_Comm_size(node, &n);
  MPI_Comm_free(&node);
  if (local_size) *local_size = n;
  return local;
}

void check_comm_choice(const std::string& choice, const std::string& backend) {
  if (choice != "auto" && choice != "nccl" && choice != "staged")
    throw InputError("--comm: '" + choice + "' must be auto, nccl or staged");
  if (choice != "auto" && backend != "cuda")
    throw InputError("--comm " + choice + ": needs --backend cuda (CPU ranks always use Open MPI)");
  if (choice == "nccl" && !nccl_unavailable_reason().empty()) throw InputError("--comm nccl: " + nccl_unavailable_reason());
}

std::unique_ptr<Comm> make_gpu_comm(CudaBackend& gpu, const std::string& choice, int sharing) {
  int most = sharing;  // the most ranks on one GPU anywhere in the world
  MPI_Allreduce(MPI_IN_PLACE, &most, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  int loaded = nccl_unavailable_reason().empty() ? 1 : 0;  // NCCL on every rank, or on none
  MPI_Allreduce(MPI_IN_PLACE, &loaded, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  const bool have_nccl = loaded == 1;
  if (choice == "nccl" && !have_nccl)
    throw InputError("--comm nccl: " + (nccl_unavailable_reason().empty() ? std::string("another rank cannot load NCCL")
                                                                          : nccl_unavailable_reason()));
  if (choice == "nccl" && most > 1)
    throw InputError("--comm nccl: " + std::to_string(most) +
                     " ranks share one GPU, which NCCL refuses; use --comm staged (or auto)");
  if (choice == "nccl" || (choice == "auto" && have_nccl && most == 1)) return make_nccl_comm(make_mpi_comm(), gpu);
  return make_staged_comm(make_mpi_comm(), gpu.staging_copier());
}

}  // namespace strata
