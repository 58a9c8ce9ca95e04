// `strata profile`: measures this machine on every rank at once (run it under mpirun with
// as many ranks as training will use) and writes a cluster JSON in the preset schema; with
// --backend cuda, each rank's GPU (GEMMs, memory, kernels in device memory).
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/args.h"
#include "cli/progress.h"
#include "cli/commands.h"
#include "costmodel/json_input.h"
#include "executor/cuda/cuda_backend.h"
#include "executor/memory_tracker.h"
#include "hw_profiles/profiler.h"

namespace strata {

int cmd_profile(const std::vector<std::string>& argv) {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SINGLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::string error, out_path, backend = "cpu", comm_choice = "auto";
  ProfileOptions o;
  bool json = false;
  try {
    const Args a(argv, "profile", {"backend", "out", "max-bytes", "model", "tp", "comm", "seq-length"}, {"quick", "json", "gemm-probe"});
    backend = a.get("backend", "cpu");
    check_backend(backend, "profile");
    comm_choice = a.get("comm", "auto");
    check_comm_choice(comm_choice, backend);
    out_path = a.get("out");
    if (rank == 0) check_output_file("--out", out_path);  // now, not after the profile (rank 0 writes it)
    o.quick = a.has("quick");
    if (o.quick) o.min_time_s = 0.01;
    o.max_message_bytes = a.integer("max-bytes", o.max_message_bytes, 4096, int64_t{1} << 30);
    json = a.has("json");
    if (a.has("model")) {  // the GEMM shapes this model runs, at its tensor-parallel size
      const ModelSpec m = load_model(a.get("model"), a.integer("seq-length", 0, 0, 1 << 20));
      const int64_t t = a.integer("tp", 1, 1, 1024);
      if (m.A % t || m.G % t || m.F % t)
        throw InputError("--tp: " + std::to_string(t) + " does not divide the heads, query groups and ffn of " + m.name);
      o.extra_gemms = model_gemm_shapes(m, t);
      o.kernels = model_memory_kernels(m, t);
      o.attention = model_attention_shape(m, t);
      // The model's largest GEMM holds its three fp32 operands at once on each rank: one
      // this machine cannot hold (a sequence of a million: S x S scores) is refused now
      // rather than swapping for hours.
      if (backend == "cpu") {
        double most = 0;
        GemmShape big;
        for (const GemmShape& g : o.extra_gemms) {
          const double bytes = 4.0 * (static_cast<double>(g.M) * static_cast<double>(g.K) +
                                      static_cast<double>(g.K) * static_cast<double>(g.N) +
                                      static_cast<double>(g.M) * static_cast<double>(g.N));
          if (bytes > most) most = bytes, big = g;
        }
        const double ram = physical_memory_bytes();
        int here = 1;  // the ranks on this machine, all profiling at once
        node_local_rank(&here);
        if (ram > 0 && most * here > ram / 2)
          fail_field("--model", a.get("model"),
                     fmt::format("its largest GEMM ({} x {} x {}) needs {:.1f} GB of operands per rank, more than half "
                                 "of this machine's {:.1f} GB over its {} rank(s): profile a shorter --seq-length or a "
                                 "larger --tp",
                                 big.M, big.N, big.K, most / 1e9, ram / 1e9, here));
      }
    }
    if (a.has("gemm-probe")) {  // the model's GEMMs only, briefly: the rate now, for strata validate
      if (!a.has("model")) fail_field("--gemm-probe", "(without --model)", "times the model's GEMM shapes: give --model");
      o.gemms_only = true;
      o.min_time_s = 0.02;
    }
  } catch (const InputError& e) {
    error = e.what();
  }
  if (any_rank_rejected_input(error, "profile", &argv)) return 2;
  // One GPU per process of this machine (by its rank there), buffers in device memory,
  // links through the communicator the executor uses between GPU ranks (NCCL when each rank
  // has its own GPU, else host staging; --comm).
  const int local = backend == "cuda" ? node_local_rank() : 0;
  std::unique_ptr<Backend> be;  // declared first, destroyed last: the communicator may use it
  std::unique_ptr<Comm> comm;
  ProfileResult r;
  Progress bar("profile", 1);
  try {
    if (backend == "cuda") {
      std::unique_ptr<CudaBackend> cuda = make_cuda_backend(local);
      if (!cuda) throw InputError("--backend cuda: " + cuda_unavailable_reason());
      o.device_name = cuda->device_name();
      CudaBackend* raw = cuda.get();
      o.gemm_precision = [raw](Precision p) { raw->set_gemm_precision(p); };
      const int sharing = ranks_sharing(cuda->device_id());
      o.processors = node_processors(sharing);
      comm = make_gpu_comm(*cuda, comm_choice, sharing);
      be = std::move(cuda);
    } else {
      o.processors = node_processors(0);
      comm = make_mpi_comm();
      be = make_cpu_backend();
    }
    o.progress = [&bar](const std::string& line, int done, int total, double, double) {
      bar.set_total(total);
      bar.update(done, line);
    };
    ProcessGrid world;  // the profiler's collectives run on the world group
    world.d = size;
    comm->setup(world);
    r = run_profile(*comm, *be, o);
    comm.reset();  // communicators freed before MPI_Finalize
    be.reset();
  } catch (const InputError& e) {
    fmt::print(stderr, "strata: error: rank {} of {}: {}\n", rank, size, e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
    return 2;
  } catch (const std::exception& e) {  // a CUDA or MPI failure: every rank stops
    fmt::print(stderr, "strata: internal error: rank {} of {}: {}\n", rank, size, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
  int64_t wrong = 0;
  for (const CollectiveRow& row : r.rows) wrong += row.wrong;
  if (wrong > 0) {  // a collective returned wrong data: no profile is written from it
    if (rank == 0) {
      fmt::print("{}", format_collective_table(r.rows, r.ranks));
      fmt::print(stderr, "strata: error: {} collective results were wrong (#wrong column); no profile written\n", wrong);
    }
    MPI_Finalize();
    return 1;
  }
  if (rank == 0) {
    bar.finish();
    // A probe writes its points, (FLOPs of one GEMM, FLOP/s on the slowest rank), not a cluster.
    Json probe = Json::array();
    for (const auto& [f, rate] : r.gemm) probe.push_back({f, rate});
    const Json j = o.gemms_only ? Json{{"gemm", probe}} : cluster_to_json(r.cluster);
    if (json) std::cout << j.dump(2) << "\n";
    else if (o.gemms_only) fmt::print("GEMM probe: {} shapes\n", r.gemm.size());
    else fmt::print("{}", format_profile_summary(r));
    if (!out_path.empty()) {
      std::ofstream f(out_path);
      f << j.dump(2) << "\n";
      if (!f) {
        fmt::print(stderr, "strata: error: --out: cannot write '{}'\n", out_path);
        MPI_Abort(MPI_COMM_WORLD, 2);
      }
      if (!json && !o.gemms_only) fmt::print("\ncluster profile written to {} (use it as --cluster {})\n", out_path, out_path);
    }
  }
  MPI_Finalize();
  return 0;
}

}  // namespace strata
