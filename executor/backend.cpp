// The defaults of Backend's optional ops: backends without context-parallel attention
// say so (the engine refuses cp > 1 on them before any of these is reached).
#include "executor/backend.h"

#include <stdexcept>
#include <string>

namespace strata {
namespace {

[[noreturn]] void no_cp(const Backend& be, const char* op) {
  throw std::logic_error(std::string("the ") + be.name() + " backend has no " + op +
                         " (context parallelism runs on the CPU backend)");
}

}  // namespace

void Backend::attention_forward_cp(float*, float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t,
                                   int64_t, int64_t, int64_t, int64_t, int64_t) {
  no_cp(*this, "attention_forward_cp");
}
void Backend::attention_backward_cp(float*, int64_t, float*, int64_t, const float*, const float*, int64_t,
                                    const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                    int64_t) {
  no_cp(*this, "attention_backward_cp");
}
void Backend::flash_attention_forward_cp(float*, float*, const float*, int64_t, const float*, int64_t, int64_t,
                                         int64_t, int64_t, int64_t, int64_t, int64_t) {
  no_cp(*this, "flash_attention_forward_cp");
}
void Backend::flash_attention_backward_cp(float*, int64_t, float*, int64_t, const float*, const float*, const float*,
                                          const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                          int64_t) {
  no_cp(*this, "flash_attention_backward_cp");
}
void Backend::rope_at(float* x, int64_t S, int64_t B, int64_t heads, int64_t D, int64_t ld, bool inverse,
                      int64_t pos0) {
  if (pos0 != 0) no_cp(*this, "rope_at with a position offset");
  rope(x, S, B, heads, D, ld, inverse);
}

}  // namespace strata
