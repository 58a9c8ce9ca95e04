// The Markov token source with its exact entropy rate, uint16 token files, and the
// seeded per-epoch sample order.
#include "executor/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "costmodel/json_input.h"
#include "executor/hash.h"

namespace strata {
namespace {

double uniform(uint64_t h) { return static_cast<double>(mix(h) >> 11) / 9007199254740992.0; }  // [0, 1)

constexpr int64_t kSyntheticSamples = 1 << 16;

}  // namespace

MarkovChain make_markov_chain(int64_t states, int64_t branch, uint64_t seed) {
  MarkovChain c;
  c.states = states;
  c.branch = branch;
  c.next.resize(static_cast<size_t>(states * branch));
  c.prob.resize(static_cast<size_t>(states * branch));
  std::vector<int32_t> all(static_cast<size_t>(states));
  for (int64_t i = 0; i < states; ++i) {
    std::iota(all.begin(), all.end(), 0);
    for (int64_t k = 0; k < branch; ++k) {  // distinct successors by a partial Fisher-Yates
      const int64_t j = k + static_cast<int64_t>(uniform(seed ^ mix(static_cast<uint64_t>(i * 7919 + k))) *
                                                 static_cast<double>(states - k));
      std::swap(all[static_cast<size_t>(k)], all[static_cast<size_t>(j)]);
      c.next[static_cast<size_t>(i * branch + k)] = all[static_cast<size_t>(k)];
    }
    double sum = 0;
    for (int64_t k = 0; k < branch; ++k) {  // exponential weights: a Dirichlet(1) row
      const double w = -std::log(1.0 - uniform(mix(seed + 1) ^ mix(static_cast<uint64_t>(i * 104729 + k))));
      c.prob[static_cast<size_t>(i * branch + k)] = w;
      sum += w;
    }
    for (int64_t k = 0; k < branch; ++k) c.prob[static_cast<size_t>(i * branch + k)] /= sum;
  }
  // Stationary distribution by power iteration (the chain is random and mixes fast).
  std::vector<double> pi(static_cast<size_t>(states), 1.0 / static_cast<double>(states)), nx(pi.size());
  for (int it = 0; it < 10000; ++it) {
    std::fill(nx.begin(), nx.end(), 0.0);
    for (int64_t i = 0; i < states; ++i)
      for (int64_t k = 0; k < branch; ++k)
        nx[static_cast<size_t>(c.next[static_cast<size_t>(i * branch + k)])] +=
            pi[static_cast<size_t>(i)] * c.prob[static_cast<size_t>(i * branch + k)];
    double diff = 0;
    for (size_t i = 0; i < pi.size(); ++i) diff += std::fabs(nx[i] - pi[i]);
    pi.swap(nx);
    if (diff < 1e-15) break;
  }
  c.stationary = pi;
  c.entropy_rate_nats = 0;
  for (int64_t i = 0; i < states; ++i) {
    double h = 0;
    for (int64_t k = 0; k < branch; ++k) {
      const double q = c.prob[static_cast<size_t>(i * branch + k)];
      if (q > 0) h -= q * std::log(q);
    }
    c.entropy_rate_nats += pi[static_cast<size_t>(i)] * h;
  }
  return c;
}

TokenSource::TokenSource(const std::string& spec, int64_t V, int64_t S, uint64_t seed) : V_(V), S_(S), seed_(seed) {
  if (spec == "synthetic" || spec.rfind("synthetic:", 0) == 0) {
    int64_t states = std::min<int64_t>(V, 64);
    if (spec.size() > 10) {
      size_t used = 0;
      try {
        states = std::stoll(spec.substr(10), &used);
      } catch (...) {
        used = 0;
      }
      if (used == 0 || used != spec.size() - 10)
        throw InputError("--data: '" + spec + "' must be synthetic or synthetic:STATES with STATES an integer");
      if (states < 2 || states > V)
        throw InputError("--data: synthetic:" + std::to_string(states) + " needs 2 <= STATES <= vocab size " +
                         std::to_string(V));
    }
    chain_ = make_markov_chain(states, std::min<int64_t>(4, states), seed ^ 0x5eedULL);
    samples_ = kSyntheticSamples;
    return;
  }
  synthetic_ = false;
  std::error_code ec;
  if (std::filesystem::is_directory(spec, ec))
    throw InputError("--data: '" + spec + "' is a folder; expected a file of uint16 tokens (or synthetic)");
  // (A pipe or a device would block or never end: a token file is a regular file.)
  if (std::filesystem::exists(spec, ec) && !std::filesystem::is_regular_file(spec, ec))
    throw InputError("--data: '" + spec + "' is not a regular file (a pipe or a device?); expected a file of uint16 tokens");
  // Mapped, not read: the ranks of a node share the file's pages in the page cache (each
  // read its own copy before: a node's memory for the tokens times its ranks), and a file
  // larger than the memory streams through it.
  const int fd = ::open(spec.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InputError("--data: cannot open token file '" + spec + "': " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InputError("--data: '" + spec + "' is not a readable token file (a folder?)");
  }
  const auto bytes = static_cast<int64_t>(st.st_size);
  auto refuse = [&](const std::string& why) {
    ::close(fd);
    throw InputError("--data: token file '" + spec + "' " + why);
  };
  if (bytes % 2 != 0)
    refuse("has " + std::to_string(bytes) + " bytes; a file of uint16 tokens has an even number (truncated?)");
  const int64_t n = bytes / 2;
  if (n < S + 1)
    refuse("holds " + std::to_string(n) + " tokens; seq_length " + std::to_string(S) + " needs at least " +
           std::to_string(S + 1));
  void* at = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);  // (the mapping keeps the file)
  if (at == MAP_FAILED) throw InputError("--data: cannot map token file '" + spec + "': " + std::strerror(errno));
  const size_t len = static_cast<size_t>(bytes);
  map_ = std::shared_ptr<const void>(at, [len](const void* p) { ::munmap(const_cast<void*>(p), len); });
  tokens_ = static_cast<const uint16_t*>(at);
  for (int64_t i = 0; i < n; ++i)
    if (tokens_[i] >= V)
      throw InputError("--data: token file '" + spec + "' has token " + std::to_string(tokens_[i]) + " at position " +
                       std::to_string(i) + "; the model's vocab_size is " + std::to_string(V) + " (tokens 0 to " +
                       std::to_string(V - 1) + ")");
  samples_ = (n - 1) / S;
}

int64_t TokenSource::index_of(int64_t g) {
  const int64_t epoch = g / samples_;
  if (epoch != epoch_) {  // Fisher-Yates from (seed, epoch)
    order_.resize(static_cast<size_t>(samples_));
    std::iota(order_.begin(), order_.end(), 0);
    for (int64_t i = samples_ - 1; i > 0; --i) {
      const uint64_t h = mix(seed_ ^ mix(static_cast<uint64_t>(epoch) * 0x100000001b3ULL + static_cast<uint64_t>(i)));
      std::swap(order_[static_cast<size_t>(i)], order_[static_cast<size_t>(h % static_cast<uint64_t>(i + 1))]);
    }
    epoch_ = epoch;
  }
  return order_[static_cast<size_t>(g % samples_)];
}

void TokenSource::sample(int64_t g, int32_t* out) {
  const int64_t idx = index_of(g);
  if (!synthetic_) {
    for (int64_t i = 0; i <= S_; ++i) out[i] = tokens_[idx * S_ + i];
    return;
  }
  const MarkovChain& c = chain_;
  const uint64_t base = mix(seed_ ^ 0xda7aULL) ^ mix(static_cast<uint64_t>(idx));
  double u = uniform(base);
  int64_t state = c.states - 1;
  for (int64_t i = 0; i < c.states; ++i) {  // start from the stationary distribution
    u -= c.stationary[static_cast<size_t>(i)];
    if (u < 0) { state = i; break; }
  }
  out[0] = static_cast<int32_t>(state);
  for (int64_t pos = 1; pos <= S_; ++pos) {
    double r = uniform(base + static_cast<uint64_t>(pos) * 0x9e3779b97f4a7c15ULL);
    int64_t k = c.branch - 1;
    for (int64_t j = 0; j < c.branch; ++j) {
      r -= c.prob[static_cast<size_t>(state * c.branch + j)];
      if (r < 0) { k = j; break; }
    }
    state = c.next[static_cast<size_t>(state * c.branch + k)];
    out[pos] = static_cast<int32_t>(state);
  }
}

void TokenSource::micro_batch(int64_t k, int64_t gbs, int64_t d, int64_t dp, int64_t j, int64_t B,
                              std::vector<int32_t>* inputs, std::vector<int32_t>* targets) {
  inputs->resize(static_cast<size_t>(B * S_));
  targets->resize(static_cast<size_t>(B * S_));
  std::vector<int32_t> seq(static_cast<size_t>(S_ + 1));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t g = k * gbs + dp * (gbs / d) + j * B + b;
    sample(g, seq.data());
    std::copy(seq.begin(), seq.end() - 1, inputs->begin() + b * S_);
    std::copy(seq.begin() + 1, seq.end(), targets->begin() + b * S_);
  }
}

}  // namespace strata
