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

}  // namespace strata
