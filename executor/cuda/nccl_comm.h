// The NCCL communicator (issue 5): collectives on GPU buffers through NCCL, one GPU per
// rank, bootstrapped through the inner (MPI) communicator: rank 0 of the world draws the
// unique id and broadcasts it, every rank joins the world communicator, and one NCCL
// communicator per group kind of the grid (tensor, data, pipeline, embedding, model) is
// split from it, ordered as the grid lists its ranks.
//
// Streams: each group kind has its own communication stream. A collective first makes that
// stream wait on an event recorded on the backend's compute stream, so it reads what the ops
// before it wrote; non-blocking ones (iall_reduce, ireduce_scatter, iall_gather) record a
// completion event that test() queries without blocking and wait() waits on, so the data
// parallel reduction and the ZeRO gathers run beside the compute, as on the CPU. Blocking
// collectives return once their stream is done.
//
// Point-to-point (isend / irecv), barrier and collectives on host buffers (the executor's
// losses, norms and counters) go through the host-staged path over the inner communicator
// (staged_comm.h): NCCL takes device memory only, and NCCL send/recv issued one call at a
// time, as the Comm interface does, can deadlock two stages that send to each other first.
//
// Limits: collectives of different group kinds may run at once on their streams; NCCL
// documents that concurrent communicators can hang when their kernels cannot all be resident,
// which the same program order on every rank makes unlikely but does not exclude. The
// collective watchdog times the staged calls only; a stuck NCCL call is stopped by its
// timeout with a message that blames the rank's progress, not the call.
#pragma once

#include <memory>
#include <string>

#include "executor/comm.h"
#include "executor/cuda/cuda_backend.h"

namespace strata {

// "" when NCCL can run: built against nccl.h and libnccl.so.2 (2.18 or newer) loads;
// otherwise why not.
std::string nccl_unavailable_reason();
// Over `inner` (a world communicator: MPI, or a world of one) on `gpu`'s device and compute
// stream; `gpu` must outlive the communicator. Null when NCCL cannot run. Ranks of one
// NCCL communicator need distinct GPUs (NCCL refuses two on one device): use the
// host-staged communicator when ranks share a GPU. A group of one has nothing to combine and
// skips NCCL, unless `single_rank_groups` (tests: the only groups one GPU has).
std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm> inner, CudaBackend& gpu, bool single_rank_groups = false);

}  // namespace strata
