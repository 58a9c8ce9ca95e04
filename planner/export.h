// A plan in the words of the frameworks that run it: Megatron-LM command-line flags and a
// DeepSpeed config JSON. What a framework cannot express is said in a comment line.
#pragma once

#include <string>

#include "costmodel/model_spec.h"
#include "costmodel/plan.h"
#include "costmodel/stack.h"

namespace strata {

// `stack` is the plan's resolved software stack (resolve_stack).
std::string export_megatron(const ModelSpec& m, const Plan& p, const Stack& stack);
std::string export_deepspeed(const ModelSpec& m, const Plan& p, const Stack& stack);

}  // namespace strata
