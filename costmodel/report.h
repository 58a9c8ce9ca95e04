// Presentation of an estimate: the readable breakdown `strata estimate` prints and the
// simulated timeline as Chrome trace-event JSON (Perfetto, chrome://tracing).
#pragma once

#include <ostream>
#include <string>

#include "costmodel/estimate.h"

namespace strata {

// device_memory_bytes: the device's memory where cl's (the budget a plan must fit in) is a
// --memory-limit below it; 0 otherwise.
std::string format_estimate(const ModelSpec& m, const Cluster& cl, const Estimate& e, const EstimateDetail* d,
                            double device_memory_bytes = 0);
// One track per pipeline stage ("stage s", standing for its t*c*d ranks) with a compute
// and a p2p stream; slices for forward / recompute / backward of each micro-batch and
// chunk (args: microbatch, chunk, layers), sends, the data-parallel reduction and the
// optimizer. Written event by event (a trace can hold millions).
void write_trace(std::ostream& out, const ModelSpec& m, const Estimate& e, const EstimateDetail& d);
// The most pipeline steps a trace is written for (its file grows ~100 bytes a step).
constexpr int64_t kMaxTraceSteps = 200000;
// The ops of one transformer layer for one micro-batch (the detail behind the breakdown).
std::string format_layer_ops(const EstimateDetail& d);
void write_text_file(const std::string& path, const std::string& text, const std::string& what);

std::string human_bytes(double bytes);    // "52.1 GiB"
std::string human_seconds(double s);      // "31.2 s", "12.4 ms"
std::string human_count(double n);        // "174.6B", "1.2M"

}  // namespace strata
