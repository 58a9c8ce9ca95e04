// Live and peak byte counts per memory category.
#include "executor/memory_tracker.h"

#include <unistd.h>

#include <algorithm>
#include <stdexcept>

#include "executor/backend.h"

namespace strata {

double physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
}

const char* to_string(MemCategory c) {
  switch (c) {
    case MemCategory::weights: return "weights";
    case MemCategory::gradients: return "gradients";
    case MemCategory::optimizer_states: return "optimizer_states";
    case MemCategory::activations: return "activations";
    case MemCategory::comm_buffers: return "comm_buffers";
  }
  return "?";
}

const char* mem_pool_name(int pool) {
  return pool >= 0 && pool < kMemCategories ? to_string(static_cast<MemCategory>(pool)) : "untracked";
}

void MemoryTracker::add(MemCategory c, int64_t bytes) {
  const size_t i = static_cast<size_t>(c);
  live_[i] += bytes;
  peak_[i] = std::max(peak_[i], live_[i]);
  live_total_ += bytes;
  peak_total_ = std::max(peak_total_, live_total_);
}

void MemoryTracker::sub(MemCategory c, int64_t bytes) {
  live_[static_cast<size_t>(c)] -= bytes;
  live_total_ -= bytes;
}

static_assert(kMemPools == kMemCategories + 1, "a backend pool per category, and one for untracked buffers");

Buf::Buf(MemoryTracker* tracker, MemCategory c, int64_t n, int element_bytes) {
  *this = allocated(tracker ? tracker->backend() : nullptr, n, static_cast<int>(c));
  tracker_ = tracker;
  cat_ = c;
  bytes_ = n_ * element_bytes;
  if (tracker_) tracker_->add(cat_, bytes_);
}

Buf Buf::untracked(Backend* be, int64_t n) { return allocated(be, n, kMemCategories); }

Buf Buf::uninitialised(MemoryTracker* tracker, MemCategory c, int64_t n, int element_bytes) {
  Buf b = allocated(tracker ? tracker->backend() : nullptr, n, static_cast<int>(c), false);
  b.tracker_ = tracker;
  b.cat_ = c;
  b.bytes_ = b.n_ * element_bytes;
  if (b.tracker_) b.tracker_->add(b.cat_, b.bytes_);
  return b;
}

Buf Buf::allocated(Backend* be, int64_t n, int pool, bool zeroed) {
  Buf b;
  b.n_ = n > 0 ? n : 0;
  b.be_ = be;
  b.pool_ = pool;
  if (b.n_ > 0 && be) b.p_ = zeroed ? be->allocate_in(b.n_, pool) : be->allocate_uninitialised_in(b.n_, pool);
  else if (b.n_ > 0) b.p_ = new float[static_cast<size_t>(b.n_)]();
  return b;
}

void Buf::pack(Precision p) {
  if (p == Precision::fp32 || !be_ || !p_ || packed_) return;
  packed_ = be_->allocate_uninitialised_in((n_ + 1) / 2, pool_);
  be_->pack16(reinterpret_cast<uint16_t*>(packed_), p_, n_, p);
  packed_as_ = p;
  be_->deallocate(p_);
  p_ = nullptr;
}

Buf Buf::packed_copy(MemoryTracker* tracker, MemCategory c, const float* src, int64_t n, Precision p,
                     int element_bytes) {
  Backend* be = tracker ? tracker->backend() : nullptr;
  if (!be && p != Precision::fp32) throw std::logic_error("Buf::packed_copy: 16-bit storage needs a backend's memory");
  if (p == Precision::fp32 || n <= 0) {
    Buf b = uninitialised(tracker, c, n, element_bytes);
    if (be) be->copy(b.data(), src, b.size());
    else std::copy(src, src + b.size(), b.data());
    return b;
  }
  Buf b = packed_out(tracker, c, n, p, element_bytes);
  be->pack16(b.data16(), src, n, p);
  return b;
}

Buf Buf::packed_out(MemoryTracker* tracker, MemCategory c, int64_t n, Precision p, int element_bytes) {
  Backend* be = tracker ? tracker->backend() : nullptr;
  if (!be || p == Precision::fp32) throw std::logic_error("Buf::packed_out: 16-bit storage in a backend's memory only");
  Buf b = uninitialised(tracker, c, 0, element_bytes);
  b.be_ = be;
  b.n_ = n;
  b.bytes_ = n * element_bytes;
  if (b.tracker_) b.tracker_->add(b.cat_, b.bytes_);
  if (n > 0) b.packed_ = be->allocate_uninitialised_in((n + 1) / 2, b.pool_);
  b.packed_as_ = p;
  return b;
}

void Buf::unpack() {
  if (!packed_) return;
  p_ = be_->allocate_uninitialised_in(n_, pool_);
  be_->unpack16(p_, reinterpret_cast<const uint16_t*>(packed_), n_, packed_as_);
  be_->deallocate(packed_);
  packed_ = nullptr;
}

int64_t Buf::storage_bytes() const {
  if (packed_) return 4 * ((n_ + 1) / 2);
  return p_ ? 4 * n_ : 0;
}

ByteBuf::ByteBuf(Backend* be, const void* host, size_t bytes) : be_(be), p_(be->allocate_bytes(bytes)) {
  be_->bytes_to_device(p_, host, bytes);
}

ByteBuf::~ByteBuf() {
  if (p_) be_->deallocate_bytes(p_);
}

ByteBuf& ByteBuf::operator=(ByteBuf&& o) noexcept {
  if (this != &o) {
    if (p_) be_->deallocate_bytes(p_);
    be_ = o.be_;
    p_ = o.p_;
    o.p_ = nullptr;
  }
  return *this;
}

Buf& Buf::operator=(Buf&& o) noexcept {
  if (this != &o) {
    release();
    p_ = o.p_;
    n_ = o.n_;
    be_ = o.be_;
    tracker_ = o.tracker_;
    cat_ = o.cat_;
    bytes_ = o.bytes_;
    pool_ = o.pool_;
    packed_ = o.packed_;
    packed_as_ = o.packed_as_;
    o.p_ = nullptr;
    o.n_ = 0;
    o.tracker_ = nullptr;
    o.bytes_ = 0;
    o.packed_ = nullptr;
  }
  return *this;
}

void Buf::zero() {
  if (n_ == 0) return;
  unpack();
  if (be_) be_->fill_zero(p_, n_);
  else std::fill(p_, p_ + n_, 0.0f);
}

void Buf::release() {
  if (tracker_) tracker_->sub(cat_, bytes_);
  tracker_ = nullptr;
  bytes_ = 0;
  if (p_) {
    if (be_) be_->deallocate(p_);
    else delete[] p_;
  }
  if (packed_) be_->deallocate(packed_);
  p_ = nullptr;
  packed_ = nullptr;
  n_ = 0;
}

}  // namespace strata
