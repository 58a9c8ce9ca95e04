// An independent measurement of the shared-memory links with raw MPI calls (none of
// strata's code): all-reduce bus bandwidth, a ping-pong between ranks 0 and 1, and a ring
// exchange on every rank at once, at the sizes given. scripts/bench-profile.sh compares strata profile's table against it.
// Usage: mpirun -np N mpi_bandwidth_check BYTES...
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  for (int a = 1; a < argc; ++a) {
    const long bytes = std::atol(argv[a]);
    const int count = static_cast<int>(bytes / 4);
    std::vector<float> buf(static_cast<size_t>(count), 1.0f), tmp(buf.size());
    const int iters = bytes >= (1 << 22) ? 50 : 400;
    // all-reduce: busbw = bytes * 2(n-1)/n / time
    MPI_Allreduce(MPI_IN_PLACE, buf.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; ++i) MPI_Allreduce(MPI_IN_PLACE, buf.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double ar = (MPI_Wtime() - t0) / iters;
    MPI_Allreduce(MPI_IN_PLACE, &ar, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    // ping-pong between 0 and 1: one-way time = round trip / 2
    double pp = 0;
    if (n >= 2) {
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = MPI_Wtime();
      for (int i = 0; i < iters; ++i) {
        if (rank == 0) {
          MPI_Send(buf.data(), count, MPI_FLOAT, 1, 5, MPI_COMM_WORLD);
          MPI_Recv(tmp.data(), count, MPI_FLOAT, 1, 6, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else if (rank == 1) {
          MPI_Recv(tmp.data(), count, MPI_FLOAT, 0, 5, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
          MPI_Send(buf.data(), count, MPI_FLOAT, 0, 6, MPI_COMM_WORLD);
        }
      }
      pp = (MPI_Wtime() - t0) / iters / 2;
      MPI_Bcast(&pp, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    }
    // ring exchange, every rank at once (the pattern strata profile's send/recv row uses):
    // send to rank + 1 while receiving from rank - 1.
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = MPI_Wtime();
    for (int i = 0; i < iters; ++i)
      MPI_Sendrecv(buf.data(), count, MPI_FLOAT, (rank + 1) % n, 7, tmp.data(), count, MPI_FLOAT, (rank + n - 1) % n, 7,
                   MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    double ring = (MPI_Wtime() - t0) / iters;
    MPI_Allreduce(MPI_IN_PLACE, &ring, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0)
      std::printf("%ld all_reduce_busbw_gbps %.3f pingpong_gbps %.3f ring_gbps %.3f\n", bytes,
                  bytes * 2.0 * (n - 1) / n / ar / 1e9, pp > 0 ? bytes / pp / 1e9 : 0.0, bytes / ring / 1e9);
  }
  MPI_Finalize();
  return 0;
}
