// Time of one collective on a process group: latency + bytes x algorithm factor / bus
// bandwidth, with the factors nccl-tests uses (doc/PERFORMANCE.md there):
//   all_reduce     S = buffer bytes         time = S * 2(n-1)/n / busbw
//   all_gather     S = gathered (output)    time = S * (n-1)/n  / busbw
//   reduce_scatter S = input bytes          time = S * (n-1)/n  / busbw
//   send_recv      S = message bytes        time = S / busbw
//   all_to_all     S = bytes each rank sends (its whole buffer, its own share included)
//                                           time = S * (n-1)/n  / busbw, one latency step;
//                  across nodes with k members on each: S (n-k)/n through the member's own
//                  NIC share, beside S (k-1)/n over NVLink (the slower of the two)
// Groups are placed the Megatron way (tensor innermost, then context, data, pipeline), so a
// group's stride in rank order says how many of its members share a node. A group inside a
// node runs at the NVLink bandwidth; one across nodes gets its share of the node's NICs,
// because the node's other groups of the same kind communicate at the same time.
#pragma once

#include <cstdint>

#include "costmodel/hardware.h"

namespace strata {

struct GroupSpan {
  int64_t size = 1;      // ranks in the group
  int64_t per_node = 1;  // of them on one node
  int64_t nodes = 1;     // nodes the group spans
};

// A group of `size` ranks whose members are `stride` apart in rank order.
GroupSpan group_span(int64_t size, int64_t stride, int64_t devices_per_node);

// The bus bandwidth (bytes/s, nccl-tests busbw) a collective reaches on this group.
double bus_bandwidth(const Cluster& cl, const GroupSpan& g, Collective c);
// Seconds for one collective moving `bytes` (see the table above). Zero for a group of one.
double collective_time(const Cluster& cl, const GroupSpan& g, Collective c, double bytes);
// nccl-tests' factor from algbw to busbw for a group of n.
double bus_factor(Collective c, int64_t n);

}  // namespace strata
