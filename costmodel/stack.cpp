// Software-stack resolution; see stack.h.
#include "costmodel/stack.h"

#include <nlohmann/json.hpp>

namespace strata {

bool needs_fused_attention(const ModelSpec& m, const Plan& p) {
  return p.c > 1 || m.S > kLegacyFusedSoftmaxMaxKeys;
}

bool sharding_selects_modern(const Cluster& cl, const Plan& p) {
  return p.zero >= 2 && p.replicas() > 1 && cl.device.peak_bf16_flops > 0;
}

void pin_to_plain_stack(const Cluster& cl, const Stack& plain, Plan& p) {
  if (p.software_stack == StackChoice::automatic && !plain.modern && !plain.strata && sharding_selects_modern(cl, p))
    p.software_stack = StackChoice::legacy;
}

Stack resolve_stack(const ModelSpec& m, const Cluster& cl, const Plan& p) {
  Stack s;
  s.strata = cl.strata_stack;
  s.modern = !s.strata && (p.software_stack == StackChoice::automatic
                               ? cl.modern_stack || m.position == Position::rope || p.precision == Precision::fp8 ||
                                     sharding_selects_modern(cl, p)
                               : p.software_stack == StackChoice::modern);
  auto pick = [&](Tristate t) { return t == Tristate::automatic ? s.modern : t == Tristate::on; };
  if (s.strata) {
    auto pick_as = [](Tristate t, bool dflt) { return t == Tristate::automatic ? dflt : t == Tristate::on; };
    // The executor's attention is unfused unless the plan asks for the fused one.
    s.attention = p.attention == AttentionChoice::flash ? AttentionKernel::flash : AttentionKernel::unfused;
    s.overlap_grad_reduce = pick_as(p.overlap_grad_reduce, true);
    s.overlap_param_gather = pick_as(p.overlap_param_gather, false);
    s.tp_comm_overlap = pick_as(p.tp_comm_overlap, false);
    s.grad_accumulation_fusion = pick_as(p.grad_accumulation_fusion, true);
    s.grad_reduce_in_fp32 = true;  // (a plan saying off is refused: check_plan's grad_reduce)
    return s;
  }
  s.attention = p.attention == AttentionChoice::flash     ? AttentionKernel::flash
                : p.attention == AttentionChoice::unfused ? AttentionKernel::unfused
                : s.modern || needs_fused_attention(m, p) ? AttentionKernel::flash
                                                          : AttentionKernel::unfused;
  s.overlap_grad_reduce = pick(p.overlap_grad_reduce);
  s.overlap_param_gather = pick(p.overlap_param_gather);
  // (Transformer Engine overlaps its backward's collectives on the modern stack whatever
  // --tp-comm-overlap says; that flag is the user buffers below.)
  s.tp_comm_overlap = s.modern || (p.tp_comm_overlap == Tristate::on && p.sp);
  s.grad_accumulation_fusion = pick(p.grad_accumulation_fusion);
  s.cross_entropy_fusion = pick(p.cross_entropy_loss_fusion);
  // User buffers: where they can run (sequence parallelism, a tensor-parallel group inside
  // one node's NVLink), asked for, or under "auto" on a GPU with fp8 (Hopper and newer), as
  // NVIDIA's performance recipes run them there (stack.h).
  s.userbuffers = s.modern && p.sp && p.t > 1 && p.t <= cl.devices_per_node &&
                  (p.tp_comm_overlap == Tristate::on ||
                   (p.tp_comm_overlap == Tristate::automatic && cl.device.peak_fp8_flops > 0));
  s.grad_reduce_in_fp32 = p.grad_reduce_in_fp32 == Tristate::automatic ? p.precision != Precision::fp16
                                                                        : p.grad_reduce_in_fp32 == Tristate::on;
  return s;
}

ModelSpec model_on_stack(const ModelSpec& m, const Cluster& cl) {
  ModelSpec r = m;
  if (cl.strata_stack) r.attention_dropout = r.hidden_dropout = 0.0;
  return r;
}

AttentionKernel resolve_attention(const ModelSpec& m, const Cluster& cl, const Plan& p) {
  return resolve_stack(m, cl, p).attention;
}

Json stack_to_json(const Stack& s) {
  return Json{{"software_stack", s.strata ? "strata" : s.modern ? "modern" : "legacy"},
              {"attention", to_string(s.attention)},
              {"overlap_grad_reduce", s.overlap_grad_reduce},
              {"overlap_param_gather", s.overlap_param_gather},
              {"tp_comm_overlap", s.tp_comm_overlap},
              {"tp_comm_overlap_userbuffers", s.userbuffers},
              {"grad_accumulation_fusion", s.grad_accumulation_fusion},
              {"cross_entropy_loss_fusion", s.cross_entropy_fusion},
              {"grad_reduce_in_fp32", s.grad_reduce_in_fp32}};
}

}  // namespace strata
