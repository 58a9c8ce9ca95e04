// Subcommands that live in their own files.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace strata {

class Comm;
class CudaBackend;

int cmd_train(const std::vector<std::string>& argv);
int cmd_profile(const std::vector<std::string>& argv);
int cmd_validate(const std::vector<std::string>& argv);

// For subcommands under mpirun: every rank checks its input, then they agree. When any
// rank rejected it (error non-empty there), every rank prints one line naming its rank
// (the message, or that another rank failed), finalises MPI and returns true: exit 2.
// With `argv` (of subcommand `command`), ranks started with different arguments (mpirun's MPMD ':' form) are
// rejected too, rather than hanging in mismatched collectives.
bool any_rank_rejected_input(const std::string& error, const std::string& command = "",
                             const std::vector<std::string>* argv = nullptr);

// This process's rank among the processes of its machine (MPI_COMM_TYPE_SHARED), which
// picks its GPU. Collective over MPI_COMM_WORLD.
int node_local_rank(int* local_size = nullptr);
// How many ranks of the world name the same `device` on this machine (by host name and
// the device's id, e.g. its PCI bus id), this one included. Collective over MPI_COMM_WORLD.
int ranks_sharing(const std::string& device);
// The processors this machine's ranks share: with `sharing` > 0 (ranks on this rank's GPU,
// ranks_sharing()) the distinct GPUs among them, else the CPU cores any of them may run on
// (the union of their affinity masks). Collective over MPI_COMM_WORLD.
int node_processors(int sharing);

// The communicator between ranks on GPUs, by --comm: "nccl" (executor/cuda/nccl_comm.h: one
// GPU per rank), "staged" (host staging over Open MPI: ranks may share a GPU) or "auto"
// (nccl when this build has it and no two ranks of the world share a GPU, else staged).
// Collective over MPI_COMM_WORLD; every rank decides alike. Throws InputError for nccl when
// it cannot run (no NCCL in the build, or a GPU shared by `sharing` ranks somewhere).
std::unique_ptr<Comm> make_gpu_comm(CudaBackend& gpu, const std::string& choice, int sharing);
// Checks a --comm value: auto, nccl or staged (nccl and staged only with --backend cuda).
void check_comm_choice(const std::string& choice, const std::string& backend);

}  // namespace strata
