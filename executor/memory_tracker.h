// The executor's allocator: every buffer is a Buf charged to one of the SPEC memory
// categories, and the tracker keeps live and peak bytes per category and in total, so a
// measured run compares term by term with the cost model's memory_bytes. Bytes are
// counted at the element size of the precision the buffer holds: bf16/fp16 values are
// computed on in float storage, rounded, and the saved ones kept in 16 bits (Buf::pack).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "costmodel/hardware.h"

namespace strata {

enum class MemCategory { weights, gradients, optimizer_states, activations, comm_buffers };
constexpr int kMemCategories = 5;
const char* to_string(MemCategory c);
// A backend memory pool's name (backend.h's kMemPools): its category's, or "untracked".
const char* mem_pool_name(int pool);

// This machine's physical memory, bytes (0 when the system does not say).
double physical_memory_bytes();

class Backend;

class MemoryTracker {
 public:
  // Where the Bufs charged here live: the backend's memory (Backend::allocate: host memory
  // for the CPU backend, device memory for CUDA), or host memory when none is set.
  void set_backend(Backend* be) { be_ = be; }
  Backend* backend() const { return be_; }
  void add(MemCategory c, int64_t bytes);
  void sub(MemCategory c, int64_t bytes);
  int64_t live(MemCategory c) const { return live_[static_cast<size_t>(c)]; }
  int64_t peak(MemCategory c) const { return peak_[static_cast<size_t>(c)]; }
  int64_t live_total() const { return live_total_; }
  int64_t peak_total() const { return peak_total_; }

 private:
  std::array<int64_t, kMemCategories> live_{}, peak_{};
  int64_t live_total_ = 0, peak_total_ = 0;
  Backend* be_ = nullptr;
};

// A float buffer charged to a category, zeroed, in its tracker's backend memory (host
// memory without one); movable, not copyable. element_bytes is the size of the value type it
// stands for (4 fp32, 2 bf16/fp16). operator[] reads host memory: CPU-backend buffers only.
class Buf {
 public:
  Buf() = default;
  Buf(MemoryTracker* tracker, MemCategory c, int64_t n, int element_bytes = 4);
  // n zeroed floats in `be`'s memory (host memory when null), charged to no category:
  // staging for dumps and checkpoints, blocks in flight outside the cost model's terms.
  static Buf untracked(Backend* be, int64_t n);
  // Like the constructor, but not zeroed: for a buffer that the op which follows writes
  // whole before anything reads it (a GEMM's C with beta 0, a norm's or an activation's
  // output), sparing a device a pass over it. The CPU backend fills such memory with NaN
  // in the tests and under the sanitizers (STRATA_POISON_BUFFERS), so a read before that
  // write shows there.
  static Buf uninitialised(MemoryTracker* tracker, MemCategory c, int64_t n, int element_bytes = 4);
  ~Buf() { release(); }
  Buf(Buf&& o) noexcept { *this = static_cast<Buf&&>(o); }
  Buf& operator=(Buf&& o) noexcept;
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;

  float* data() { return p_; }
  const float* data() const { return p_; }
  int64_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  float& operator[](int64_t i) { return p_[i]; }
  float operator[](int64_t i) const { return p_[i]; }
  void zero();
  void release();
  // 16-bit storage while the values wait for the backward (Backend::pack16): pack() keeps
  // the values rounded to `p` (bf16, fp16) at 2 bytes each and frees the float storage, so
  // a 16-bit activation takes in the backend's memory what the tracker charges for it;
  // unpack() gives floats back, equal to the rounded values. fp32, an empty buffer and a
  // buffer in host memory without a backend stay as they are. data() is null while packed
  // (operator[] must not be used then); zero() unpacks first.
  void pack(Precision p);
  void unpack();
  bool packed() const { return packed_ != nullptr; }
  // The 16-bit values while packed (null otherwise) and the precision they were rounded to.
  const uint16_t* data16() const { return reinterpret_cast<const uint16_t*>(packed_); }
  uint16_t* data16() { return reinterpret_cast<uint16_t*>(packed_); }
  Precision packed_as() const { return packed_as_; }
  // A buffer holding src's n values rounded to `p` in 16-bit storage from the start, as
  // pack() would leave a copy of them (one pass, no float storage); fp32 gives a float copy.
  // 16-bit storage needs a backend's memory (none: std::logic_error).
  static Buf packed_copy(MemoryTracker* tracker, MemCategory c, const float* src, int64_t n, Precision p,
                         int element_bytes);
  // n values in 16-bit storage rounded to `p` (bf16, fp16), not yet written: for an op that
  // writes its output so (Backend::*_packed). 16-bit storage needs a backend's memory (none,
  // or p fp32: std::logic_error).
  static Buf packed_out(MemoryTracker* tracker, MemCategory c, int64_t n, Precision p, int element_bytes);
  // Bytes this buffer holds in its memory now: 4 per value, 2 while packed.
  int64_t storage_bytes() const;

 private:
  // From the backend's pool `pool`, zeroed or not.
  static Buf allocated(Backend* be, int64_t n, int pool, bool zeroed = true);
  float* p_ = nullptr;
  int64_t n_ = 0;
  Backend* be_ = nullptr;  // whose memory p_ is; null: host (new[])
  MemoryTracker* tracker_ = nullptr;
  MemCategory cat_ = MemCategory::activations;
  int64_t bytes_ = 0;
  int pool_ = kMemCategories;  // the backend pool p_ came from
  float* packed_ = nullptr;    // the 16-bit values, in floats of that pool (2 per float)
  Precision packed_as_ = Precision::fp32;
};

// Bytes in a backend's memory holding a copy of host bytes (masks the backend's kernels
// read); movable, not copyable.
class ByteBuf {
 public:
  ByteBuf() = default;
  ByteBuf(Backend* be, const void* host, size_t bytes);
  ~ByteBuf();
  ByteBuf(ByteBuf&& o) noexcept { *this = static_cast<ByteBuf&&>(o); }
  ByteBuf& operator=(ByteBuf&& o) noexcept;
  ByteBuf(const ByteBuf&) = delete;
  ByteBuf& operator=(const ByteBuf&) = delete;
  const uint8_t* data() const { return static_cast<const uint8_t*>(p_); }

 private:
  Backend* be_ = nullptr;
  void* p_ = nullptr;
};

}  // namespace strata
