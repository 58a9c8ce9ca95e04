// Where every parameter lives in one flat buffer. A rank holds the tensors of its model
// chunks (the embedding on the first chunk, the final norm and output layer on the last)
// cut to its tensor-parallel share; each chunk part is a contiguous "unit", the bucket of
// gradient reduction and ZeRO sharding. The single-rank (t = 1, every layer) layout is the
// "global" layout: initialisation, the reference model and gathered checkpoints use it.
// Owns shapes and offsets only; no arithmetic on values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "costmodel/model_spec.h"

namespace strata {

// The tensors of the model. Weights are (out, in), row-major, y = x W^T.
enum class TensorKind {
  wte,     // (V/t, H)          vocab-parallel rows [r*V/t, (r+1)*V/t)
  wpe,     // (S, H)            learned positions; replicated
  ln1_w,   // (H)               replicated
  ln1_b,   // (H)               layernorm only
  qkv_w,   // ((A+2G)*D/t, H)   rows: q heads of rank r, then its k groups, then its v groups
  qkv_b,   // ((A+2G)*D/t)      bias only
  proj_w,  // (H, A*D/t)        row-parallel: columns [r*A*D/t, ...)
  proj_b,  // (H)               replicated, added once after the reduction
  ln2_w,   // (H)
  ln2_b,   // (H)
  fc1_w,   // (fc1_out/t, H)    gelu: F/t rows; gated: F/t gate rows then F/t up rows of rank r
  fc1_b,   // (fc1_out/t)
  fc2_w,   // (H, F/t)          row-parallel: columns [r*F/t, ...)
  fc2_b,   // (H)
  lnf_w,   // (H)
  lnf_b,   // (H)
  lm_head  // (V/t, H)          untied output layer; vocab-parallel like wte
};
const char* to_string(TensorKind k);

struct TensorSlot {
  TensorKind kind = TensorKind::wte;
  int64_t layer = -1;      // global layer index; -1 outside the transformer layers
  int64_t offset = 0;      // into the rank's flat buffer
  int64_t rows = 0, cols = 1;  // local shape; vectors have cols = 1
  bool tp_replicated = false;  // identical on every tensor-parallel rank (norms, row biases, wpe)
  bool decay = false;          // AdamW weight decay applies (the 2-D weights)
  int64_t size() const { return rows * cols; }
};

// A contiguous part of the buffer: wte, wpe, one layer, or the final norm (+ lm_head).
struct Unit {
  int64_t begin = 0, end = 0;
  int64_t layer = -1;  // global layer, or -1 an embedding table (wte, wpe), -2 final norm and lm_head
  int64_t size() const { return end - begin; }
};

struct ParamLayout {
  int64_t t = 1, r = 0;  // tensor-parallel size and this rank's index in it
  std::vector<TensorSlot> tensors;
  std::vector<Unit> units;
  int64_t size = 0;  // floats in the flat buffer
  // The slot of (kind, layer); aborts when absent (a programming error).
  const TensorSlot& at(TensorKind kind, int64_t layer = -1) const;
  bool has(TensorKind kind, int64_t layer = -1) const;
};

// The vocabulary the executor uses: padded to a multiple of 128 (Megatron's divisor) for
// every t alike, so every plan trains the same model. Tensor parallel needs V % t == 0.
int64_t executor_vocab(const ModelSpec& m);

// Layout of the units [wte, wpe?]  [each of `layers`]  [final norm + lm_head?] for
// tensor-parallel rank r of t, in that order. With tied embeddings, a rank with the head
// but not the embedding (the last pipeline stage) holds its own wte unit after the final
// one, kept equal to the first stage's by reducing the two gradients.
ParamLayout make_param_layout(const ModelSpec& m, int64_t t, int64_t r, bool embedding,
                              const std::vector<int64_t>& layers, bool head);
// The single-rank layout of the whole model.
ParamLayout global_param_layout(const ModelSpec& m);

// The global (row, col) of local element (row, col) of a slot of rank r of t. The global
// tensor has t times the rows (column-parallel and vocab-parallel kinds) or t times the
// columns (row-parallel kinds); replicated kinds map to themselves.
void global_coords(const ModelSpec& m, const TensorSlot& s, int64_t t, int64_t r, int64_t row,
                   int64_t col, int64_t* grow, int64_t* gcol);

// Seeded initial value of global element (row, col) of (kind, layer), the same whatever
// the plan: GPT-2's scheme (normal 0.02; output projections 0.02/sqrt(2L); biases 0;
// norm weights 1). A counter-based hash, so any shard is initialised without the rest.
float initial_value(const ModelSpec& m, uint64_t seed, TensorKind kind, int64_t layer, int64_t grow,
                    int64_t gcol);
// Fills a rank's buffer from initial_value.
void initialise(const ModelSpec& m, const ParamLayout& lay, uint64_t seed, float* params);

}  // namespace strata
