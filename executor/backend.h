// The ops every backend implements, on float buffers of that backend's memory; the model
// (gpt.cpp) is written against this interface only. Row-major throughout. Dimension
// letters as in costmodel/model_spec.h; N = rows of tokens (S*B in the (S, B, ...) order
// the executor keeps, as Megatron does). Backward ops ACCUMULATE into parameter
// gradients (dw, db) and into dx where noted; layers_ref.h holds the naive twins.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "costmodel/hardware.h"
#include "costmodel/model_spec.h"
#include "executor/zero.h"

namespace strata {

// Memory pools of a backend: one per MemCategory (memory_tracker.h) and one for buffers
// charged to none.
constexpr int kMemPools = 6;

// An op's input in either storage (Backend::gemm_mixed's operands, the kept inputs of the
// *_stored backwards): `type` fp32 for float values, bf16 or fp16 for 16-bit values as
// Backend::pack16 stores them (fp8 stands for bf16 there, as in pack16).
struct Operand {
  const void* p = nullptr;
  Precision type = Precision::fp32;
  static Operand floats(const float* x) { return {x, Precision::fp32}; }
  static Operand sixteen(const uint16_t* x, Precision t) { return {x, t}; }
  bool is_16bit() const { return type != Precision::fp32; }
  // The operand `elements` values on.
  Operand offset(int64_t elements) const {
    return is_16bit() ? Operand{static_cast<const uint16_t*>(p) + elements, type}
                      : Operand{static_cast<const float*>(p) + elements, type};
  }
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // Whether a batch of like products (the attention core's, one per head) runs one product
  // after another, each at its own size's efficiency (the CPU backend), rather than as one
  // batched kernel at the whole batch's (cuBLASLt's strided batch): the cost model's
  // batched_gemm, which strata profile writes from it.
  virtual bool batched_gemm_per_matrix() const { return true; }

  // This backend's memory (host memory for the CPU backend, device memory for CUDA), where
  // the executor's buffers live (memory_tracker.h): n floats, zeroed; freeing; zeroing; and
  // copies to and from host memory, complete when they return.
  virtual float* allocate(int64_t n) = 0;
  // The same from the pool of memory category `pool` (memory_tracker.h's MemCategory index;
  // kMemCategories for buffers charged to none), so a backend with pools per category can
  // report each one's peak (device_memory).
  virtual float* allocate_in(int64_t n, int pool) {
    (void)pool;
    return allocate(n);
  }
  // The same without zeroing, for storage the caller overwrites whole at once (a GPU
  // backend skips the memset).
  virtual float* allocate_uninitialised_in(int64_t n, int pool) { return allocate_in(n, pool); }
  virtual void deallocate(float* p) = 0;
  virtual void fill_zero(float* p, int64_t n) = 0;
  virtual void to_host(float* host_dst, const float* src, int64_t n) = 0;
  virtual void to_device(float* dst, const float* host_src, int64_t n) = 0;
  // Byte arrays in the same memory (token ids, masks): allocated (not zeroed), freed, filled.
  virtual void* allocate_bytes(size_t bytes) = 0;
  virtual void deallocate_bytes(void* p) = 0;
  virtual void bytes_to_device(void* dst, const void* host_src, size_t bytes) = 0;
  // Waits until the work queued on this backend is done (a GPU's stream; nothing on the CPU,
  // whose ops finish when they return). The executor's clocks call it, so phase times are
  // the device's, as Megatron's timers synchronise.
  virtual void synchronise() {}
  // A clock for per-op times (executor/op_log.h, strata train --ops): mark() stamps the
  // point the work queued so far reaches and returns the stamp's index; once synchronise()
  // has returned, mark_seconds(i) is that point's time in seconds from a fixed origin;
  // reset_marks() forgets the stamps. The CPU's ops are done when they return, so the host
  // clock serves (this default); a GPU backend records events on its stream, so nothing waits.
  virtual int64_t mark() {
    marks_.push_back(static_cast<double>(std::chrono::steady_clock::now().time_since_epoch().count()) *
                     std::chrono::steady_clock::period::num / std::chrono::steady_clock::period::den);
    return static_cast<int64_t>(marks_.size()) - 1;
  }
  virtual double mark_seconds(int64_t i) { return marks_[static_cast<size_t>(i)]; }
  virtual void reset_marks() { marks_.clear(); }
  // The device's own memory accounting, for backends that have one (false on the CPU): free
  // and total bytes now, and for each pool (MemCategory index, then the untracked pool) the
  // peak bytes in use and reserved since the start; and the most that the backend's own
  // workspaces, grown on demand while it trains, may take beyond what it holds now (a GPU's
  // 16-bit GEMM operand copies and unfused attention scores: strata profile counts them
  // with the framework's memory).
  struct DeviceMemory {
    int64_t free = 0, total = 0;
    int64_t used_peak[kMemPools] = {}, reserved_peak[kMemPools] = {};
    int64_t workspace_growth = 0;
  };
  virtual bool device_memory(DeviceMemory* out) {
    (void)out;
    return false;
  }

  // C(M, N) = alpha * op(A) op(B) + beta * C, op(A) (M, K), op(B) (K, N); ld* = row strides.
  virtual void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                    const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                    int64_t ldc) = 0;
  // The same product with operands in either storage (Operand): floats, or 16-bit values
  // as pack16 stores them. The default unpacks a 16-bit operand into floats (the rows it
  // spans, in this backend's memory) and calls gemm(): the same values, so the same C.
  virtual void gemm_mixed(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, Operand A,
                          int64_t lda, Operand B, int64_t ldb, float beta, float* C, int64_t ldc);
  // Whether gemm_mixed reads a 16-bit operand as it is stored (a GPU's 16-bit GEMMs, whose
  // float operands are converted first) rather than unpacking it (the CPU's fp32 GEMMs):
  // the executor then hands its 16-bit tensors to the GEMMs in 16 bits. The cost model's
  // Device::gemm_reads_16bit, which strata profile writes from it.
  virtual bool gemm_reads_16bit() const { return false; }
  // out, x (N, H); mean, rstd (N); w, b (H). Backward: dx +=, dw +=, db +=.
  // `round` (the forwards here, the activation's backward, add, add_bias): the output
  // rounded to it as round_to() rounds (fp32 leaves it), in the op's own pass: the
  // executor's 16-bit tensors rounded where they are made, with no pass of their own.
  virtual void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w,
                                 const float* b, int64_t N, int64_t H, Precision round = Precision::fp32) = 0;
  virtual void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x,
                                  const float* mean, const float* rstd, const float* w, int64_t N,
                                  int64_t H) = 0;
  virtual void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t N, int64_t H,
                               Precision round = Precision::fp32) = 0;
  virtual void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* rstd,
                                const float* w, int64_t N, int64_t H) = 0;
  // u (N, F) for gelu, (N, 2F) = [gate | up] for swiglu/geglu; out (N, F). Backward: du =.
  virtual void activation_forward(Activation a, float* out, const float* u, int64_t N, int64_t F,
                                  Precision round = Precision::fp32) = 0;
  virtual void activation_backward(Activation a, float* du, const float* dout, const float* u, int64_t N, int64_t F,
                                   Precision round = Precision::fp32) = 0;
  // The same three backwards with their kept input (x; u) in either storage (Operand): where
  // gemm_reads_16bit the executor keeps those inputs packed through the backward. The
  // defaults unpack a 16-bit input (in this backend's memory) and call the ops above.
  virtual void layernorm_backward_stored(float* dx, float* dw, float* db, const float* dout, Operand x,
                                         const float* mean, const float* rstd, const float* w, int64_t N, int64_t H);
  virtual void rmsnorm_backward_stored(float* dx, float* dw, const float* dout, Operand x, const float* rstd,
                                       const float* w, int64_t N, int64_t H);
  virtual void activation_backward_stored(Activation a, float* du, const float* dout, Operand u, int64_t N, int64_t F,
                                          Precision round = Precision::fp32);
  // The forwards and the activation's backward writing their output in 16-bit storage
  // (pack16's layout, rounded to p: bf16 or fp16) instead of floats, and the activation's
  // forward also its input u into u16 where not null (the fc1 output the executor keeps):
  // where gemm_reads_16bit, the executor stores a GEMM input so where it is made. The
  // defaults run the float op into scratch (this backend's memory) and pack16 it; the
  // values are those of the float op rounded to p, then packed.
  virtual void layernorm_forward_packed(uint16_t* out, float* mean, float* rstd, const float* x, const float* w,
                                        const float* b, int64_t N, int64_t H, Precision p);
  virtual void rmsnorm_forward_packed(uint16_t* out, float* rstd, const float* x, const float* w, int64_t N, int64_t H,
                                      Precision p);
  virtual void activation_forward_packed(Activation a, uint16_t* out, uint16_t* u16, const float* u, int64_t N,
                                         int64_t F, Precision p);
  virtual void activation_backward_packed(Activation a, uint16_t* du, const float* dout, Operand u, int64_t N,
                                          int64_t F, Precision p);
  // Rotates heads [0, heads) of each row of x (S*B rows of stride ld, D per head), row
  // s*B + b at position s; inverse = true applies the transpose (the backward).
  virtual void rope(float* x, int64_t S, int64_t B, int64_t heads, int64_t D, int64_t ld, bool inverse) = 0;
  // qkv (S, B, (A+2G)*D): q heads, k groups, v groups; out (S, B, A*D); probs (B, A, S, S)
  // or null (then backward recomputes them). Causal, scale 1/sqrt(D). Backward: dqkv =.
  virtual void attention_forward(float* out, float* probs, const float* qkv, int64_t S, int64_t B, int64_t A,
                                 int64_t G, int64_t D) = 0;
  virtual void attention_backward(float* dqkv, const float* dout, const float* probs, const float* qkv,
                                  int64_t S, int64_t B, int64_t A, int64_t G, int64_t D) = 0;
  // The same attention fused (FlashAttention-2's algorithm, a plan's `attention: flash`): no
  // S x S buffer, lse (B, A, S) keeps each query's log-sum-exp for the backward, which takes
  // the forward's output and overwrites dqkv. Head dim <= 128 on the CUDA backend.
  virtual void flash_attention_forward(float* out, float* lse, const float* qkv, int64_t S, int64_t B, int64_t A,
                                       int64_t G, int64_t D) = 0;
  virtual void flash_attention_backward(float* dqkv, const float* dout, const float* out, const float* lse,
                                        const float* qkv, int64_t S, int64_t B, int64_t A, int64_t G, int64_t D) = 0;
  // The same with qkv and (the backward's) the forward's output in either storage (Operand).
  // Where flash_reads_16bit(D, p) the backend's kernels read 16-bit qkv of precision p as it
  // is stored (the CUDA backend's tensor-core kernels, in their own type), and the executor
  // keeps qkv and the output packed from their making through the backward. The defaults
  // unpack a 16-bit input (in this backend's memory) and call the ops above.
  virtual bool flash_reads_16bit(int64_t D, Precision p) const {
    (void)D;
    (void)p;
    return false;
  }
  virtual void flash_attention_forward_stored(float* out, float* lse, Operand qkv, int64_t S, int64_t B, int64_t A,
                                              int64_t G, int64_t D);
  virtual void flash_attention_backward_stored(float* dqkv, const float* dout, Operand out, const float* lse,
                                               Operand qkv, int64_t S, int64_t B, int64_t A, int64_t G, int64_t D);
  // Context parallelism (a plan's cp > 1, the CPU backend): the attention of Sq queries at
  // global positions [q0, q0 + Sq) against the keys and values of positions [0, q0 + Sq),
  // causal (query q0 + i sees keys 0..q0 + i). q: (Sq, B) rows of stride ldq, query heads
  // first; kv: (q0 + Sq, B) rows of stride ldkv, key groups at 0, value groups at G*D; out
  // (Sq, B, A*D). Unfused: probs (B, A, Sq, ldp) or null (ldp >= q0 + Sq; columns past a
  // query's last key are zero); fused: lse (B, A, Sq). The backwards ACCUMULATE into dq
  // (stride ldq) and dkv (stride ldkv, every row up to q0 + Sq). The plain attention ops
  // above are the case Sq = S, q0 = 0, q = qkv, kv = qkv + A*D. A backend without them
  // throws; the engine refuses cp > 1 there first.
  virtual void attention_forward_cp(float* out, float* probs, int64_t ldp, const float* q, int64_t ldq, const float* kv,
                                    int64_t ldkv, int64_t Sq, int64_t q0, int64_t B, int64_t A, int64_t G, int64_t D);
  virtual void attention_backward_cp(float* dq, int64_t ldq, float* dkv, int64_t ldkv, const float* dout,
                                     const float* probs, int64_t ldp, const float* q, const float* kv, int64_t Sq,
                                     int64_t q0, int64_t B, int64_t A, int64_t G, int64_t D);
  virtual void flash_attention_forward_cp(float* out, float* lse, const float* q, int64_t ldq, const float* kv,
                                          int64_t ldkv, int64_t Sq, int64_t q0, int64_t B, int64_t A, int64_t G,
                                          int64_t D);
  virtual void flash_attention_backward_cp(float* dq, int64_t ldq, float* dkv, int64_t ldkv, const float* dout,
                                           const float* out, const float* lse, const float* q, const float* kv,
                                           int64_t Sq, int64_t q0, int64_t B, int64_t A, int64_t G, int64_t D);
  // RoPE of rows at positions pos0.. (a context-parallel rank's chunk of the sequence);
  // rope() is pos0 = 0. The default handles pos0 = 0 only.
  virtual void rope_at(float* x, int64_t S, int64_t B, int64_t heads, int64_t D, int64_t ld, bool inverse,
                       int64_t pos0);
  // dst rows (stride ld_dst) = src rows (stride ld_src), `cols` values each: the key and
  // value columns of the QKV rows in and out of their context-parallel exchange. The
  // default copies row by row.
  virtual void copy_rows(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t cols) {
    for (int64_t i = 0; i < rows; ++i) copy(dst + i * ld_dst, src + i * ld_src, cols);
  }
  // Elementwise pieces of the layer: dst = src (n values); out = a + b (the residual adds;
  // out may alias a or b); y (N, F) += b (F) on every row; db (F) += the column sums of dy
  // (N, F).
  virtual void copy(float* dst, const float* src, int64_t n) = 0;
  virtual void add(float* out, const float* a, const float* b, int64_t n, Precision round = Precision::fp32) = 0;
  virtual void add_bias(float* y, const float* b, int64_t N, int64_t F, Precision round = Precision::fp32) = 0;
  virtual void bias_grad(float* db, const float* dy, int64_t N, int64_t F) = 0;
  // The same from dy in either storage (the default unpacks a 16-bit dy first).
  virtual void bias_grad_stored(float* db, Operand dy, int64_t N, int64_t F);
  // The token embedding of a tensor-parallel vocabulary slice [lo, lo + Vt): x (S*B, H) row
  // s*B + b = wte row (token - lo) for tokens (B, S) in the slice, zero otherwise; the
  // backward adds dx's rows into dwte. Learned positions: out (n, H) row i = x row i + P row
  // (row0 + i) / B, and dP rows += dx rows alike (row0: the first row this rank holds).
  virtual void embedding_forward(float* x, const float* wte, const int32_t* tokens, int64_t S, int64_t B, int64_t H,
                                 int64_t lo, int64_t Vt) = 0;
  virtual void embedding_backward(float* dwte, const float* dx, const int32_t* tokens, int64_t S, int64_t B, int64_t H,
                                  int64_t lo, int64_t Vt) = 0;
  virtual void add_positions(float* out, const float* x, const float* P, int64_t n, int64_t H, int64_t B,
                             int64_t row0) = 0;
  virtual void position_grad(float* dP, const float* dx, int64_t n, int64_t H, int64_t B, int64_t row0) = 0;
  // Vocab-parallel cross-entropy (Megatron's), in the phases between which the caller
  // reduces over the tensor-parallel ranks. z (N, Vt) holds this rank's logits, vocabulary
  // columns [lo, lo + Vt); targets (N) are global token ids; st (N, 2).
  //   max:       mx (N) = each row's maximum                              (then all-reduce max)
  //   exp_sum:   st[i] = {sum_j exp(z - mx), z[target] - mx if the target is in the slice
  //              else 0}; z is only read                                  (then all-reduce sum)
  //              (the loss is log st[i][0] - st[i][1])
  //   backward:  z = ((exp(z - mx) * (1 / st[i][0])) - 1 at the target, in the slice) * scale,
  //              rounded to `p` (round_to's rounding; fp32 leaves it): dlogits, in one pass
  //              over the logits the forward left (the probabilities are not kept: each is
  //              computed again, bit for bit as exp_sum summed it)
  virtual void cross_entropy_max(float* mx, const float* z, int64_t N, int64_t Vt) = 0;
  virtual void cross_entropy_exp_sum(float* st, const float* z, const float* mx, const int32_t* targets, int64_t N,
                                     int64_t Vt, int64_t lo) = 0;
  virtual void cross_entropy_backward(float* z, const float* mx, const float* st, const int32_t* targets, int64_t N,
                                      int64_t Vt, int64_t lo, float scale, Precision p) = 0;
  // The forward's two phases in one pass over the logits, where the backend has it
  // (cross_entropy_one_pass; Device::cross_entropy_one_pass, which strata profile writes from
  // it): mx (N) each row's maximum over this rank's slice, st as exp_sum gives it against
  // that maximum (the sum of exponentials reckoned online, rescaled as the maximum grows).
  // With tensor parallelism the caller then takes the maximum over the ranks into mg, and
  // cross_entropy_rescale moves st to it (the sum times exp(mx - mg), the target's logit
  // less mg where it is in the slice) before the sums' all-reduce; mg is then the maximum
  // the backward takes. The default forward runs max and exp_sum; the default rescale
  // throws std::logic_error (only a one-pass backend is asked for it).
  virtual bool cross_entropy_one_pass() const { return false; }
  virtual void cross_entropy_forward(float* mx, float* st, const float* z, const int32_t* targets, int64_t N,
                                     int64_t Vt, int64_t lo);
  virtual void cross_entropy_rescale(float* st, const float* mx, const float* mg, const int32_t* targets, int64_t N,
                                     int64_t Vt, int64_t lo);
  // The same gradient written into dz in 16-bit storage (pack16's layout, rounded to p:
  // bf16 or fp16) for GEMMs that read it so (gemm_reads_16bit), in the same one pass; z is
  // left undefined. The default runs the float op over z and pack16s it.
  virtual void cross_entropy_backward_packed(uint16_t* dz, float* z, const float* mx, const float* st,
                                             const int32_t* targets, int64_t N, int64_t Vt, int64_t lo, float scale,
                                             Precision p);
  // The optimizer on an owned shard (executor/zero.h's adamw_update) and the clipping
  // norm's terms (zero.h's grad_norm_terms; acc on the host, added to); decay and counted
  // are bit masks (zero.h's FlagBits) in this backend's memory.
  virtual void adamw(float* p, const float* g, float* m, float* v, FlagBits decay, int64_t n, const AdamW& opt,
                     double lr, int64_t step, float grad_mul) = 0;
  virtual void grad_norm_terms(const float* g, FlagBits counted, int64_t n, double acc[2]) = 0;
  // Rounds n values to the nearest value of `p` (bf16, fp16; fp32 leaves them), as the
  // inputs of a low-precision GEMM are. fp16 overflows to inf.
  virtual void round_to(float* x, int64_t n, Precision p) = 0;
  // dst = src rounded as round_to() rounds (fp32: a copy), in one pass over both.
  virtual void round_copy(float* dst, const float* src, int64_t n, Precision p) = 0;
  // 16-bit storage of the activations a layer keeps for its backward (memory_tracker.h's
  // Buf::pack): n values rounded to `p` (bf16, fp16; fp8 as bf16) as round_to() does, 2
  // bytes each; and back to floats, exactly the rounded values.
  virtual void pack16(uint16_t* dst, const float* src, int64_t n, Precision p) = 0;
  virtual void unpack16(float* dst, const uint16_t* src, int64_t n, Precision p) = 0;
 private:
  std::vector<double> marks_;  // the default clock's stamps
};

std::unique_ptr<Backend> make_cpu_backend();

}  // namespace strata
