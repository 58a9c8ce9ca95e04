// The host-staged communicator (executor/staged_comm.h) against the Open MPI one it wraps,
// on 4 ranks (tp 2 x dp 2) under mpirun: every collective over the tensor, data and world
// groups, in place and not, sends and receives around a ring, the non-blocking calls polled
// with test() and finished with wait(), many in flight at once. The "device" is host memory
// behind a copier that counts bytes, so the test also checks that each call moves exactly
// its input down and its result up. Values are small integers, so sums are exact in any
// order and the two communicators must agree bit for bit.
// Run directly, the test re-runs itself under mpirun (STRATA_MPIEXEC) and checks its exit.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "executor/staged_comm.h"
#include "self_under_mpirun.h"

namespace strata {
namespace {

struct Counter {
  size_t down = 0, up = 0;
};

class Checks {
 public:
  explicit Checks(int rank) : rank_(rank) {}
  void expect(bool ok, const std::string& what) {
    if (!ok) {
      std::fprintf(stderr, "rank %d: FAILED: %s\n", rank_, what.c_str());
      ++failed_;
    }
  }
  void same(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
    expect(got.size() == want.size() && std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0, what);
  }
  int failed() const { return failed_; }

 private:
  int rank_;
  int failed_ = 0;
};

std::vector<float> values(int rank, int64_t n, int salt) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<float>(rank * 100 + salt * 7 + (i % 50));
  return v;
}

int mpi_main() {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  int failed = 0;
  {
    Counter count;
    StagingCopier copier{[&](void* h, const void* d, size_t b) { std::memcpy(h, d, b), count.down += b; },
                         [&](void* d, const void* h, size_t b) { std::memcpy(d, h, b), count.up += b; }};
    std::unique_ptr<Comm> direct = make_mpi_comm(), staged = make_staged_comm(make_mpi_comm(), copier);
    const int rank = direct->rank();
    Checks c(rank);
    ProcessGrid grid;
    grid.t = 2;
    grid.d = 2;
    c.expect(direct->size() == 4 && staged->size() == 4 && staged->rank() == rank, "world of 4");
    direct->setup(grid);
    staged->setup(grid);
    const int64_t n = 1000;
    for (GroupKind kind : {kWorld, kTensor, kData}) {
      const Group g = grid.group(kind, rank);
      const std::string k = " (group " + std::to_string(kind) + ")";
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
        std::vector<float> a = values(rank, n, 1), b = a;
        count = Counter{};
        direct->all_reduce(a.data(), n, g, op);
        staged->all_reduce(b.data(), n, g, op);
        c.same(b, a, "all_reduce" + k);
        c.expect(count.down == n * sizeof(float) && count.up == n * sizeof(float), "all_reduce moves n floats each way" + k);
      }
      std::vector<double> da(7), db(7);
      for (size_t i = 0; i < da.size(); ++i) da[i] = db[i] = rank + 0.5 * static_cast<double>(i);
      direct->all_reduce(da.data(), 7, g, ReduceOp::sum);
      staged->all_reduce(db.data(), 7, g, ReduceOp::sum);
      c.expect(da == db, "all_reduce of doubles" + k);
      const int64_t blk = 33;
      {
        const std::vector<float> in = values(rank, blk * g.size(), 2);
        std::vector<float> a(static_cast<size_t>(blk)), b(static_cast<size_t>(blk), -1.0f);
        direct->reduce_scatter(in.data(), a.data(), blk, g);
        staged->reduce_scatter(in.data(), b.data(), blk, g);
        c.same(b, a, "reduce_scatter" + k);
      }
      {
        const std::vector<float> in = values(rank, blk, 3);
        std::vector<float> a(static_cast<size_t>(blk * g.size())), b(a.size(), -1.0f);
        direct->all_gather(in.data(), a.data(), blk, g);
        staged->all_gather(in.data(), b.data(), blk, g);
        c.same(b, a, "all_gather" + k);
        // In place: the input is this rank's block of the output.
        std::vector<float> ip(a.size(), -1.0f);
        std::copy(in.begin(), in.end(), ip.begin() + static_cast<int64_t>(g.me) * blk);
        staged->all_gather(ip.data() + static_cast<int64_t>(g.me) * blk, ip.data(), blk, g);
        c.same(ip, a, "all_gather in place" + k);
      }
      {
        std::vector<float> a = values(rank, 17, 4), b = a;
        direct->broadcast(a.data(), 17, g.size() - 1, g);
        staged->broadcast(b.data(), 17, g.size() - 1, g);
        c.same(b, a, "broadcast" + k);
      }
      staged->barrier(g);
    }
    // A ring of sends and receives, polled.
    {
      const int next = (rank + 1) % 4, prev = (rank + 3) % 4;
      const std::vector<float> out = values(rank, 257, 5);
      std::vector<float> in(257, -1.0f);
      Request rr = staged->irecv(in.data(), 257, prev, 9);
      Request rs = staged->isend(out.data(), 257, next, 9);
      // Both tested on every pass (each call makes progress), not short-circuited.
      for (bool done = false; !done;) {
        const bool received = staged->test(rr);
        const bool sent = staged->test(rs);
        done = received && sent;
      }
      c.same(in, values(prev, 257, 5), "ring send/recv");
      c.expect(!rr.pending() && !rs.pending(), "completed requests are cleared");
    }
    // Many non-blocking collectives in flight at once (the staging slots grow under them),
    // finished in another order than started, by test() and by wait().
    {
      const Group g = grid.group(kData, rank);
      std::vector<std::vector<float>> ar(6), want(6);
      std::vector<Request> req(6);
      for (int i = 0; i < 6; ++i) {
        ar[static_cast<size_t>(i)] = want[static_cast<size_t>(i)] = values(rank, 100 + i, 6 + i);
        direct->all_reduce(want[static_cast<size_t>(i)].data(), 100 + i, g, ReduceOp::sum);
        req[static_cast<size_t>(i)] = staged->iall_reduce(ar[static_cast<size_t>(i)].data(), 100 + i, g);
      }
      const std::vector<float> in_rs = values(rank, 40 * g.size(), 20), in_ag = values(rank, 40, 21);
      std::vector<float> rs(40, -1.0f), rs_want(40), ag(static_cast<size_t>(40 * g.size()), -1.0f), ag_want(ag.size());
      direct->reduce_scatter(in_rs.data(), rs_want.data(), 40, g);
      direct->all_gather(in_ag.data(), ag_want.data(), 40, g);
      Request r_rs = staged->ireduce_scatter(in_rs.data(), rs.data(), 40, g);
      Request r_ag = staged->iall_gather(in_ag.data(), ag.data(), 40, g);
      for (int i = 5; i >= 3; --i) staged->wait(req[static_cast<size_t>(i)]);
      staged->begin_wait(r_ag);
      while (!staged->test(r_ag)) staged->test(r_rs);
      staged->end_wait();
      staged->wait(r_rs);
      for (int i = 0; i < 3; ++i)
        while (!staged->test(req[static_cast<size_t>(i)])) {
        }
      for (int i = 0; i < 6; ++i) c.same(ar[static_cast<size_t>(i)], want[static_cast<size_t>(i)], "iall_reduce " + std::to_string(i));
      c.same(rs, rs_want, "ireduce_scatter");
      c.same(ag, ag_want, "iall_gather");
      Request done;
      c.expect(staged->test(done), "an empty request tests complete");
      staged->wait(done);
    }
    const std::vector<std::string> names = staged->gather_strings("rank" + std::to_string(rank), 0);
    if (rank == 0) c.expect(names.size() == 4 && names[3] == "rank3", "gather_strings");
    int mine = c.failed();
    MPI_Allreduce(&mine, &failed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) std::printf("staged comm: %s (%d failures over 4 ranks)\n", failed ? "FAILED" : "all checks passed", failed);
  }
  MPI_Finalize();
  return failed ? 1 : 0;
}

TEST(StagedComm, MatchesTheMpiCommOnFourRanks) {
  int rc = -1;
  const std::string out = run_self_under_mpirun(4, "", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("staged comm: all checks passed"), std::string::npos) << out;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  // Under mpirun: one rank of the check. Otherwise: the gtest that launches it.
  if (std::getenv("OMPI_COMM_WORLD_SIZE")) return strata::mpi_main();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
