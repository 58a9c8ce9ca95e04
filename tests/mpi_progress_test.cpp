// The Open MPI communicator's progress thread (executor/cpu/mpi_comm.cpp), on 2 ranks under
// mpirun with MPI_THREAD_SERIALIZED as strata train initialises MPI:
//   1. a reduce-scatter of 2 x 1M floats completes while both ranks sleep without calling
//      MPI (the thread's completion counter moves; Open MPI alone would not progress it:
//      it takes many fragments), and then test() finds it done with the right sums;
//   2. many requests in flight at once (sends, receives, all-reduces, reduce-scatters,
//      all-gathers), finished in a shuffled order by test() and wait() while the thread
//      tests them too: every result exact, every slot reused without loss;
//   3. with STRATA_MPI_PROGRESS_US=0 there is no thread, and the same calls still complete.
// Run directly, the test re-runs itself under mpirun (STRATA_MPIEXEC) and checks its exit.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "executor/comm.h"
#include "executor/process_grid.h"
#include "self_under_mpirun.h"

namespace strata {
namespace {

int failed = 0;
void expect(bool ok, int rank, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
    ++failed;
  }
}

// Values that sum exactly in float: small integers.
float value(int rank, int64_t i, int salt) { return static_cast<float>(rank * 1000 + salt * 7 + (i % 97)); }

int mpi_main() {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  const bool want_thread = std::getenv("STRATA_MPI_PROGRESS_US") == nullptr ||
                           std::string(std::getenv("STRATA_MPI_PROGRESS_US")) != "0";
  {
    std::unique_ptr<Comm> c = make_mpi_comm();
    const int rank = c->rank(), n = c->size();
    expect(n == 2, rank, "world of 2");
    ProcessGrid grid;
    grid.d = 2;
    c->setup(grid);
    const Group g = grid.group(kData, rank);
    expect(c->has_progress_thread() == (want_thread && provided >= MPI_THREAD_SERIALIZED), rank,
           "progress thread iff MPI_THREAD_SERIALIZED and STRATA_MPI_PROGRESS_US != 0");

    // 1. Progress while the caller does not call MPI.
    {
      const int64_t m = 1 << 20;
      std::vector<float> in(static_cast<size_t>(2 * m)), out(static_cast<size_t>(m), -1.0f);
      for (int64_t i = 0; i < 2 * m; ++i) in[static_cast<size_t>(i)] = value(rank, i, 1);
      MPI_Barrier(MPI_COMM_WORLD);
      const int64_t before = c->completed_in_background();
      Request q = c->ireduce_scatter(in.data(), out.data(), m, g);
      if (c->has_progress_thread()) {
        // Sleep (no MPI call on this thread) until the thread saw it complete; the 120 s
        // limit only stops a broken build from hanging, it is not a speed claim.
        for (int k = 0; k < 120000 && c->completed_in_background() == before; ++k)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        expect(c->completed_in_background() > before, rank, "the reduce-scatter completed while the caller slept");
        expect(c->test(q), rank, "test() finds the request the thread completed");
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        expect(c->completed_in_background() == before, rank, "no background completions without the thread");
        c->wait(q);
      }
      bool ok = true;
      for (int64_t i = 0; i < m; ++i) {
        const int64_t j = rank * m + i;
        ok = ok && out[static_cast<size_t>(i)] == value(0, j, 1) + value(1, j, 1);
      }
      expect(ok, rank, "reduce-scatter sums");
    }

    // 2. Many requests in flight, finished in a shuffled order by test() and wait().
    for (int round = 0; round < 20; ++round) {
      const int64_t m = 1000 + 3000 * round;
      const int peer = 1 - rank;
      std::vector<std::vector<float>> bufs;
      std::vector<Request> reqs;
      std::vector<int> kinds;
      for (int k = 0; k < 6; ++k) {
        const int kind = (k + round) % 4;
        std::vector<float> a(static_cast<size_t>(2 * m));
        for (int64_t i = 0; i < 2 * m; ++i) a[static_cast<size_t>(i)] = value(rank, i, k + round);
        bufs.push_back(std::move(a));
        bufs.push_back(std::vector<float>(static_cast<size_t>(2 * m), 0.0f));
        float* src = bufs[bufs.size() - 2].data();
        float* dst = bufs.back().data();
        Request r;
        if (kind == 0) r = c->iall_reduce(src, 2 * m, g);
        else if (kind == 1) r = c->ireduce_scatter(src, dst, m, g);
        else if (kind == 2) r = c->iall_gather(src, dst, m, g);
        else r = rank == 0 ? c->isend(src, m, peer, 100 + k) : c->irecv(dst, m, peer, 100 + k);
        reqs.push_back(r);
        kinds.push_back(kind);
      }
      if (round % 3 == 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));  // let the thread finish some
      // Finish odd requests by polling, even ones by waiting, last first.
      for (int k = 5; k >= 0; --k) {
        Request& r = reqs[static_cast<size_t>(k)];
        if (k % 2) {
          c->begin_wait(r);
          while (!c->test(r)) {
          }
          c->end_wait();
        } else {
          c->wait(r);
        }
        expect(!r.pending(), rank, "request cleared once done");
      }
      bool ok = true;
      for (int k = 0; k < 6; ++k) {
        const std::vector<float>& a = bufs[static_cast<size_t>(2 * k)];
        const std::vector<float>& d = bufs[static_cast<size_t>(2 * k + 1)];
        const int s = k + round;
        for (int64_t i = 0; i < m; ++i) {
          const size_t si = static_cast<size_t>(i);
          switch (kinds[static_cast<size_t>(k)]) {
            case 0: ok = ok && a[si] == value(0, i, s) + value(1, i, s); break;
            case 1: ok = ok && d[si] == value(0, rank * m + i, s) + value(1, rank * m + i, s); break;
            case 2: ok = ok && d[si] == value(0, i, s) && d[static_cast<size_t>(m + i)] == value(1, i, s); break;
            default: ok = ok && (rank == 0 || d[si] == value(0, i, s));
          }
        }
      }
      expect(ok, rank, "round " + std::to_string(round) + ": every result exact");
    }
    int bad = failed;
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0 && bad == 0)
      std::printf("mpi progress: all checks passed (progress thread: %s)\n", c->has_progress_thread() ? "yes" : "no");
  }
  MPI_Finalize();
  return failed == 0 ? 0 : 1;
}

TEST(MpiProgress, RequestsCompleteWhileTheCallerComputes) {
  int rc = -1;
  const std::string out = run_self_under_mpirun(2, "", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("mpi progress: all checks passed (progress thread: yes)"), std::string::npos) << out;
}

TEST(MpiProgress, OffWithZeroInterval) {
  int rc = -1;
  const std::string out = run_self_under_mpirun(2, "STRATA_MPI_PROGRESS_US=0", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("mpi progress: all checks passed (progress thread: no)"), std::string::npos) << out;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  // Under mpirun: one rank of the check. Otherwise: the gtest that launches it.
  if (std::getenv("OMPI_COMM_WORLD_SIZE")) return strata::mpi_main();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
