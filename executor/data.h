// Token sources for training. The default is a synthetic Markov chain over `states`
// tokens whose entropy rate is computed exactly (a trained model's loss floor); the
// other is a binary file of little-endian uint16 tokens (llm.c / nanoGPT format).
// Samples are sequences of S + 1 tokens (inputs and shifted targets); the order is a
// permutation of the samples drawn from (seed, epoch), and global batch k holds samples
// [k*gbs, (k+1)*gbs) of that order, so every plan sees the same batches.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace strata {

struct MarkovChain {
  int64_t states = 0, branch = 0;
  std::vector<int32_t> next;        // (states, branch) successor tokens
  std::vector<double> prob;         // (states, branch) transition probabilities
  std::vector<double> stationary;   // (states)
  double entropy_rate_nats = 0;     // sum_i pi_i * H(P_i)
};
MarkovChain make_markov_chain(int64_t states, int64_t branch, uint64_t seed);

class TokenSource {
 public:
  // "synthetic" or "synthetic:STATES" or a file path. Throws InputError (exit 2) when the
  // file is missing or not a regular file, has an odd number of bytes, fewer than S + 1
  // tokens, or a token >= V (the model's vocab_size, not the embedding's padded rows).
  TokenSource(const std::string& spec, int64_t V, int64_t S, uint64_t seed);
  int64_t samples() const { return samples_; }
  bool synthetic() const { return synthetic_; }
  const MarkovChain& chain() const { return chain_; }
  // Sample g of the shuffled order (g counts across epochs): S + 1 tokens into out.
  void sample(int64_t g, int32_t* out);
  // Micro-batch j of data-parallel rank `dp` in step k (0-based): inputs and targets (B, S).
  void micro_batch(int64_t k, int64_t gbs, int64_t d, int64_t dp, int64_t j, int64_t B, std::vector<int32_t>* inputs,
                   std::vector<int32_t>* targets);

 private:
  int64_t index_of(int64_t g);
  int64_t V_, S_;
  uint64_t seed_;
  bool synthetic_ = true;
  MarkovChain chain_;
  std::shared_ptr<const void> map_;  // the token file, mapped read-only (shared by copies)
  const uint16_t* tokens_ = nullptr;
  int64_t samples_ = 0;
  int64_t epoch_ = -1;
  std::vector<int64_t> order_;  // permutation of the current epoch
};

}  // namespace strata
