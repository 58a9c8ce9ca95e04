// Collective times; see comm.h.
#include "costmodel/comm.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace strata {

GroupSpan group_span(int64_t size, int64_t stride, int64_t devices_per_node) {
  GroupSpan g;
  g.size = size;
  if (size <= 1) return g;
  if (stride >= devices_per_node) {
    g.per_node = 1;
  } else {
    g.per_node = std::min(size, std::max<int64_t>(1, devices_per_node / stride));
  }
  g.nodes = (size + g.per_node - 1) / g.per_node;
  return g;
}

double bus_factor(Collective c, int64_t n) {
  if (n <= 1) return 0;
  const double nd = static_cast<double>(n);
  switch (c) {
    case Collective::all_reduce: return 2.0 * (nd - 1) / nd;
    case Collective::all_gather:
    case Collective::reduce_scatter:
    case Collective::all_to_all: return (nd - 1) / nd;
    case Collective::send_recv: return 1.0;
  }
  return 1.0;
}

double bus_bandwidth(const Cluster& cl, const GroupSpan& g, Collective c) {
  const double intra = cl.intra.bandwidth_bytes_per_s * cl.intra.efficiency(c);
  if (g.nodes <= 1) return intra;
  // The node's NICs are shared by the devices_per_node / per_node groups of this kind: a
  // group gets its members' shares (the bandwidth is per device).
  const double share = cl.inter.bandwidth_bytes_per_s * static_cast<double>(g.per_node);
  return std::min(intra, share * cl.inter.efficiency(c));
}

double collective_time(const Cluster& cl, const GroupSpan& g, Collective c, double bytes) {
  if (g.size <= 1 || bytes <= 0) return 0;
  // ceil(log2(size)) rounds of a tree (twice for an all-reduce): exact in integers.
  const double rounds = static_cast<double>(std::bit_width(static_cast<uint64_t>(g.size - 1)));
  // (An all-to-all sends to every peer at once: one step, as a send/recv.)
  const double steps = c == Collective::send_recv || c == Collective::all_to_all
                           ? 1.0
                           : rounds * (c == Collective::all_reduce ? 2.0 : 1.0);
  const double latency = (g.nodes > 1 ? cl.inter.latency_s : cl.intra.latency_s) * steps;
  if (c == Collective::all_to_all && g.nodes > 1) {
    // Every member sends the (n - k)/n of its buffer meant for the other nodes through its
    // own share of the NICs (a ring crosses them once per node; an all-to-all k times), and
    // the (k - 1)/n for its node's members over NVLink at the same time.
    const double n = static_cast<double>(g.size), k = static_cast<double>(g.per_node);
    const double off = bytes * (n - k) / n / (cl.inter.bandwidth_bytes_per_s * cl.inter.efficiency(c));
    const double on = bytes * (k - 1) / n / (cl.intra.bandwidth_bytes_per_s * cl.intra.efficiency(c));
    return latency + std::max(off, on);
  }
  return latency + bytes * bus_factor(c, g.size) / bus_bandwidth(cl, g, c);
}

}  // namespace strata
