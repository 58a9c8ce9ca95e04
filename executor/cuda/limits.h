// Limits of the CUDA backend's kernels, shared by the kernels and by the checks that refuse a
// plan before a run starts (cli/train_cmd.cpp). No includes: nvcc and the host compiler both
// read it.
#pragma once

namespace strata::cuda {

// The unfused attention's S x S matrices (B A of them kept when a layer keeps its
// probabilities, and a workspace of at least one): S is bounded.
constexpr long long kUnfusedAttentionMaxSeq = 8192;
// Its workspace: each batched product covers the query groups of one micro-batch row (for
// one place of a head in its group), as many S x S fp32 matrices at a time as this holds
// (at least one). The cost model charges the products at the size of such a batch.
constexpr long long kUnfusedAttentionWorkspaceBytes = 64ll << 20;
// flash_attention.cu keeps a tile's rows of D values in registers and shared memory.
constexpr long long kFlashMaxHeadDim = 128;
// The head dims flash_attention_tc.cu's tensor-core kernels are built for (16-bit plans on
// sm_80 or later); others run flash_attention.cu's fp32 kernels. The cost model charges them
// accordingly.
constexpr bool flash_tc_head_dim(long long D) { return D == 16 || D == 32 || D == 64 || D == 128; }

}  // namespace strata::cuda
