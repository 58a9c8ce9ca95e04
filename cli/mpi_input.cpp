// Input checks of the MPI subcommands, agreed across ranks (see commands.h).
#include <mpi.h>

#include <fmt/format.h>

#include "cli/commands.h"

namespace strata {

bool any_rank_rejected_input(const std::string& error) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int bad = error.empty() ? 0 : 1;
  MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (!bad) return false;
  fmt::print(stderr, "strata: error: rank {} of {}: {}\n", rank, size,
             error.empty() ? "another rank found invalid input (see its message)" : error);
  MPI_Finalize();
  return true;
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

}  // namespace strata
