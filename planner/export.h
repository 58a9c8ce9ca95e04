// A plan in the words of the frameworks that run it: Megatron-LM command-line flags, a
// DeepSpeed config JSON and Megatron-Bridge ConfigContainer overrides. What a framework
// cannot express is said in a comment line.
#pragma once

#include <string>

#include "costmodel/model_spec.h"
#include "costmodel/plan.h"
#include "costmodel/stack.h"

namespace strata {

// `stack` is the plan's resolved software stack (resolve_stack).
std::string export_megatron(const ModelSpec& m, const Plan& p, const Stack& stack);
std::string export_deepspeed(const ModelSpec& m, const Plan& p, const Stack& stack);
// Megatron-Bridge (NeMo 2 / the NeMo containers since 25.09): KEY=VALUE overrides of a
// recipe's ConfigContainer, as scripts/training/train.sh and run_recipe.py take them after
// the recipe (the same dotted names set cfg.<key> in Python). ZeRO-2/3 map to Megatron-FSDP's
// optim_grads / optim_grads_params sharding, FP8 to the current-scaling recipe.
std::string export_bridge(const ModelSpec& m, const Plan& p, const Stack& stack);

}  // namespace strata
