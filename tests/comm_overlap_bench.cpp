// How much of a non-blocking reduce-scatter is left to wait for after the caller computed
// for 20 ms without calling MPI: the exposed part of a data-parallel reduction behind a
// layer's backward. Run under mpirun -np 2, with the communicator's progress thread
// (default) and without it (STRATA_MPI_PROGRESS_US=0); scripts/bench-executor.sh prints both.
// The compute is a loop over a 1 MiB array, as a kernel would run, with no MPI call inside.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "executor/comm.h"
#include "executor/process_grid.h"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  {
    std::unique_ptr<strata::Comm> c = strata::make_mpi_comm();
    strata::ProcessGrid grid;
    grid.d = c->size();
    c->setup(grid);
    const strata::Group g = grid.group(strata::kData, c->rank());
    std::vector<float> work(1 << 18, 1.0f);
    const double compute_s = 0.020;
    const int reps = 10;
    if (c->rank() == 0)
      std::printf("# %d ranks, progress thread: %s; reduce-scatter started, then %.0f ms of compute, then wait\n"
                  "# %12s %14s %14s\n",
                  c->size(), c->has_progress_thread() ? "on" : "off", compute_s * 1e3, "bytes in", "wait (ms)",
                  "alone (ms)");
    for (int64_t n : {int64_t{1} << 14, int64_t{1} << 16, int64_t{1} << 18, int64_t{1} << 20, int64_t{1} << 21}) {
      std::vector<float> in(static_cast<size_t>(n * c->size()), 1.0f), out(static_cast<size_t>(n));
      double wait_s = 0, alone_s = 0;
      for (int r = 0; r < reps; ++r) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        c->reduce_scatter(in.data(), out.data(), n, g);
        alone_s += MPI_Wtime() - t0;
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        strata::Request q = c->ireduce_scatter(in.data(), out.data(), n, g);
        float acc = 0;
        while (MPI_Wtime() - t0 < compute_s)  // MPI_Wtime is a clock read, not a progress call
          for (float& x : work) acc += (x = x * 0.999f + 0.001f);
        if (acc < 0) std::printf("%f", acc);
        const double t1 = MPI_Wtime();
        c->wait(q);
        wait_s += MPI_Wtime() - t1;
      }
      double v[2] = {wait_s / reps, alone_s / reps};
      MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (c->rank() == 0)
        std::printf("  %12lld %14.3f %14.3f\n", static_cast<long long>(n * c->size() * 4), v[0] * 1e3, v[1] * 1e3);
    }
  }
  MPI_Finalize();
  return 0;
}
