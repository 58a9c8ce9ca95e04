// A synthetic cluster with round numbers, so hand-derived expectations do not move when
// the presets are re-measured: 100 TFLOP/s, GEMMs at 50 % of peak, 1 TB/s at 100 %,
// 8 devices per node, NVLink 200 GB/s at 75 %, 100 GB/s of NICs per node at 80 %.
#pragma once

#include <cstdint>

#include "costmodel/hardware.h"
#include "costmodel/model_spec.h"

namespace strata::testing {

inline Cluster round_cluster() {
  Cluster c;
  c.name = "round";
  c.device.name = "round-gpu";
  c.device.memory_bytes = 80e9;
  c.device.peak_fp32_flops = 25e12;
  c.device.peak_tf32_flops = 50e12;
  c.device.peak_bf16_flops = 100e12;
  c.device.peak_fp16_flops = 100e12;
  c.device.peak_fp8_flops = 200e12;
  c.device.memory_bandwidth_bytes_per_s = 1e12;
  c.device.gemm_efficiency = Curve({{1.0, 0.5}});
  c.device.memory_efficiency = Curve({{1.0, 1.0}});
  c.device.flash_fwd_efficiency = 0.5;
  c.device.flash_bwd_efficiency = 0.4;
  c.device.kernel_launch_s = 0;
  c.devices_per_node = 8;
  c.intra.bandwidth_bytes_per_s = 200e9;
  c.intra.latency_s = 5e-6;
  c.intra.eff_all_reduce = c.intra.eff_all_gather = c.intra.eff_reduce_scatter = c.intra.eff_send_recv = 0.75;
  c.intra.eff_all_to_all = 0.75;
  c.inter.bandwidth_bytes_per_s = 12.5e9;  // per device: 100 GB/s per node of 8
  c.inter.latency_s = 10e-6;
  c.inter.eff_all_reduce = c.inter.eff_all_gather = c.inter.eff_reduce_scatter = c.inter.eff_send_recv = 0.8;
  c.inter.eff_all_to_all = 0.8;
  c.framework_overhead_bytes = 1e9;
  c.allocator_fragmentation = 0.0;
  c.allocator_fragmentation_saved = 0.0;
  c.step_overhead_s = 0;
  c.overlap_slowdown = 0;
  c.modern_stack = false;
  return c;
}

// round_cluster on the modern software stack (FlashAttention, Megatron-core) with a host:
// 2 TB of memory per node at 400 GB/s, 50 GB/s of PCIe per GPU, each reached in full.
inline Cluster round_cluster_with_host() {
  Cluster c = round_cluster();
  c.modern_stack = true;
  c.host.memory_bytes = 2e12;
  c.host.memory_bandwidth_bytes_per_s = 400e9;
  c.host.memory_efficiency = 1;
  c.host.pcie_bandwidth_bytes_per_s = 50e9;
  c.host.pcie_efficiency = 1;
  return c;
}

// A Llama-style model (4 layers of H 4096, 32 heads, SwiGLU of 11008, vocabulary 32000,
// untied, sequence 2048) with `mtp` multi-token prediction modules: the multi-token
// prediction tests' model (compute_test, memory_test, estimate_test).
inline ModelSpec llama_with_mtp(int64_t mtp) {
  Json j = Json::parse(R"({"name":"mtp","num_layers":4,"hidden_size":4096,"num_attention_heads":32,
      "ffn_hidden_size":11008,"vocab_size":32000,"seq_length":2048,"activation":"swiglu","normalization":"rmsnorm",
      "position_embedding":"rope","tie_embeddings":false,"add_bias_linear":false})");
  j["mtp_num_layers"] = mtp;
  return model_from_json(j, "model");
}

}  // namespace strata::testing
