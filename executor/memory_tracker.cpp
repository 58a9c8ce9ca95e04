// Live and peak byte counts per memory category.
#include "executor/memory_tracker.h"

#include <unistd.h>

#include <algorithm>

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

Buf::Buf(MemoryTracker* tracker, MemCategory c, int64_t n, int element_bytes)
    : v_(static_cast<size_t>(n), 0.0f), tracker_(tracker), cat_(c), bytes_(n * element_bytes) {
  if (tracker_) tracker_->add(cat_, bytes_);
}

Buf& Buf::operator=(Buf&& o) noexcept {
  if (this != &o) {
    release();
    v_ = std::move(o.v_);
    tracker_ = o.tracker_;
    cat_ = o.cat_;
    bytes_ = o.bytes_;
    o.tracker_ = nullptr;
    o.bytes_ = 0;
    o.v_.clear();
  }
  return *this;
}

void Buf::zero() { std::fill(v_.begin(), v_.end(), 0.0f); }

void Buf::release() {
  if (tracker_) tracker_->sub(cat_, bytes_);
  tracker_ = nullptr;
  bytes_ = 0;
  std::vector<float>().swap(v_);
}

}  // namespace strata
