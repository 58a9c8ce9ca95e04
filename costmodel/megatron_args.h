// A Megatron-LM launch read as strata's inputs: the flags of `pretrain_gpt.py` (as a launch
// script, an args file or the flags themselves give them) become a model JSON and a plan
// JSON in Megatron's own argument names (model_spec.cpp and plan.cpp read those), and the
// launcher's GPU count (torchrun's --nproc-per-node x --nnodes) the data-parallel size.
// The inverse of `strata plan --export megatron`. Flags that change no count, cost or
// layout (learning rates, data paths, logging) are listed as ignored, never guessed at.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "costmodel/json_input.h"
#include "costmodel/model_spec.h"
#include "costmodel/plan.h"

namespace strata {

struct MegatronLaunch {
  Json model;                        // Megatron names, for model_from_json
  Json plan;                         // Megatron names, for plan_from_json (no data_parallel)
  int64_t gpus = 0;                  // torchrun's nproc-per-node x nnodes; 0: not given
  std::string world_unread;          // why not, where the launch gives them: "--nproc-per-node ${N}" ...
  std::vector<std::string> ignored;  // flags read but not modelled, in order of appearance
  // Those among them that change the step time or the memory (CUDA graphs, unfused kernels,
  // the FP8 recipe, ...), and absent flags whose Megatron default strata does not model:
  // each said, never cut from a list.
  std::vector<std::string> costly;
  // The if blocks whose condition strata does not evaluate (an unset variable, a command's
  // status, arithmetic): every branch's flags were read; each "if CONDITION (--flags ...)".
  // Those it evaluates (tests of the text's own variables and their defaults) have their
  // untaken branches skipped.
  std::vector<std::string> undecided;
};

// Parses `text`: `#` comments, backslash-newline continuations, single and double quotes,
// `--flag value` and `--flag=value`, bare flags (true). A value that is a shell variable is
// resolved through the text's own `NAME=value` assignments; one that stays unresolved in a
// flag strata reads is an InputError naming the flag, as is a flag given twice with two
// values. A flag that sets a layout strata does not follow is refused. The model and the
// plan get Megatron-LM's meaning of an absent flag (LayerNorm, learned positions, tied
// embeddings, biases, dropout 0.1, fp32, no key/value groups without
// --group-query-attention), not strata's defaults. `source` names the input in messages.
MegatronLaunch parse_megatron_launch(const std::string& text, const std::string& source);

// The model and the plan of a launch on `gpus` GPUs (0: the launcher's count, which must
// then be given): data_parallel = gpus / (tp * pp * cp), and Megatron's
// --num-layers-per-virtual-pipeline-stage turned into virtual_pipeline_stages.
struct LaunchInputs {
  ModelSpec model;
  Plan plan;
};
LaunchInputs launch_inputs(const MegatronLaunch& launch, int64_t gpus, const std::string& source,
                           int64_t seq_length_override = 0);

// A readable file's contents, or the argument itself when it names no file (flags given
// inline).
std::string megatron_launch_text(const std::string& file_or_flags);

}  // namespace strata
