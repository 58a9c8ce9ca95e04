// The tensor-core flash attention's kernels (flash_attention_tc.cu has the algorithm and the
// launchers), kept apart so that a CPU emulation of the CUDA names they use runs the very
// same code (tests/flash_tc_emulation_test.cpp, tests/cuda_emulation.h: a block's threads
// as fibers, WMMA by its documented layouts). No includes and no namespace of its
// own: the includer opens its namespace and provides, before including it,
//   Dims (FlashDims, flash_dims.cuh); from_float<T> (round.cuh); namespace wmma (mma.h's);
//   STRATA_DYNAMIC_SHARED(name) (check.h; the emulation's own): `unsigned char name[]`-like
//   dynamic shared memory aligned to 128 bytes; STRATA_UNROLL: nvcc's `#pragma unroll` (or nothing);
//   and CUDA's builtins (threadIdx, __syncthreads, __shfl_xor_sync, atomicAdd, float4,
//   expf, ...).

constexpr int kTile = 64;  // queries of a forward block, keys of a backward block, and the tiles streamed
constexpr int kWarps = kTile / 16;
constexpr int kThreads = 32 * kWarps;

template <class T, class Layout>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, Layout>;
template <class T, class Layout>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, Layout>;
using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// kTile rows of D values from rows [first, first + kTile) of src (zeros past S) into shared
// memory in 16 bits, row stride ldh: src floats (converted), or with `sixteen` T values as
// pack16 stores them (copied). Row lengths and offsets are multiples of D (of 16), so where
// float src itself is 16-byte aligned every row is read as float4s.
template <class T, int D>
__device__ void load16(T* dst, int ldh, const void* src_any, bool sixteen, const Dims& d, long long first, long long b,
                       long long off, long long row_len) {
  if (sixteen) {
    const T* src = static_cast<const T*>(src_any);
    for (int t = threadIdx.x; t < kTile * D; t += blockDim.x) {
      const int r = t / D, e = t % D;
      const long long s = first + r;
      dst[r * ldh + e] = s < d.S ? src[d.row(s, b) * row_len + off + e] : from_float<T>(0.0f);
    }
    return;
  }
  const float* src = static_cast<const float*>(src_any);
  if ((reinterpret_cast<unsigned long long>(src) & 15) == 0) {
    constexpr int V = D / 4;
    for (int t = threadIdx.x; t < kTile * V; t += blockDim.x) {
      const int r = t / V, e = (t % V) * 4;
      const long long s = first + r;
      float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (s < d.S) x = *reinterpret_cast<const float4*>(src + d.row(s, b) * row_len + off + e);
      T* o = dst + r * ldh + e;
      o[0] = from_float<T>(x.x);
      o[1] = from_float<T>(x.y);
      o[2] = from_float<T>(x.z);
      o[3] = from_float<T>(x.w);
    }
    return;
  }
  for (int t = threadIdx.x; t < kTile * D; t += blockDim.x) {
    const int r = t / D, e = t % D;
    const long long s = first + r;
    dst[r * ldh + e] = from_float<T>(s < d.S ? src[d.row(s, b) * row_len + off + e] : 0.0f);
  }
}

// Shared memory of the kernels, in bytes; every array starts 32-byte aligned, as WMMA's
// loads and stores need (row strides: multiples of 8 16-bit or 4 fp32 values).
template <int D>
struct ForwardLayout {
  static constexpr int LH = D + 8, LP = kTile + 8, LS = kTile + 4, LO = D + 4;
  static constexpr int q = 0, k = q + 2 * kTile * LH, v = k + 2 * kTile * LH, p = v + 2 * kTile * LH;
  static constexpr int s = p + 2 * kTile * LP, o = s + 4 * kTile * LS, m = o + 4 * kTile * LO, l = m + 4 * kTile;
  static constexpr int bytes = l + 4 * kTile;
};
template <int D>
struct BackwardLayout {
  static constexpr int LH = D + 8, LP = kTile + 8, LW = (D > kTile ? D : kTile) + 4;
  static constexpr int k = 0, v = k + 2 * kTile * LH, q = v + 2 * kTile * LH, dout = q + 2 * kTile * LH;
  static constexpr int p = dout + 2 * kTile * LH, ds = p + 2 * kTile * LP, w = ds + 2 * kTile * LP;
  static constexpr int lse = w + 4 * kWarps * 2 * 16 * LW, delta = lse + 4 * kTile;
  static constexpr int bytes = delta + 4 * kTile;
};

template <int D>
constexpr int shared_bytes() {
  return ForwardLayout<D>::bytes > BackwardLayout<D>::bytes ? ForwardLayout<D>::bytes : BackwardLayout<D>::bytes;
}

template <class T, int D>
__global__ void __launch_bounds__(kThreads) tc_forward(float* out, float* lse, const void* qkv, Dims d, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // 16-bit WMMA needs sm_80 (the dispatch checks the device first)
#else
  using Lay = ForwardLayout<D>;
  constexpr int LH = Lay::LH, LP = Lay::LP, LS = Lay::LS, LO = Lay::LO, ND = D / 16;
  STRATA_DYNAMIC_SHARED(smem);
  T* Qs = reinterpret_cast<T*>(smem + Lay::q);
  T* Ks = reinterpret_cast<T*>(smem + Lay::k);
  T* Vs = reinterpret_cast<T*>(smem + Lay::v);
  T* Ps = reinterpret_cast<T*>(smem + Lay::p);
  float* Ss = reinterpret_cast<float*>(smem + Lay::s);
  float* Os = reinterpret_cast<float*>(smem + Lay::o);
  float* M = reinterpret_cast<float*>(smem + Lay::m);
  float* L = reinterpret_cast<float*>(smem + Lay::l);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
  // The last query tiles, which stream the most key tiles, first (the grid's tail is then
  // the short ones).
  const long long i0 = static_cast<long long>(gridDim.x - 1 - blockIdx.x) * kTile, h = blockIdx.y, b = blockIdx.z;
  const long long ld = d.ld();
  load16<T, D>(Qs, LH, qkv, d.qkv16, d, i0, b, d.q_off(h), ld);
  for (int t = threadIdx.x; t < kTile * LO; t += blockDim.x) Os[t] = 0.0f;
  for (int r = threadIdx.x; r < kTile; r += blockDim.x) {
    M[r] = -INFINITY;
    L[r] = 0.0f;
  }
  // This warp's rows: its scratch of scores, its probabilities, its output rows.
  float* Sw = Ss + r0 * LS;
  T* Pw = Ps + r0 * LP;
  float* Ow = Os + r0 * LO;
  // Two lanes a row in the softmax, each over half of the tile's columns (and of D).
  const int rr = lane >> 1, half = lane & 1;
  const long long i = i0 + r0 + rr;
  const long long last = i0 + kTile - 1 < d.S - 1 ? i0 + kTile - 1 : d.S - 1;
  for (long long j0 = 0; j0 <= last; j0 += kTile) {
    __syncthreads();  // the previous tile's K and V are no longer read
    load16<T, D>(Ks, LH, qkv, d.qkv16, d, j0, b, d.k_off(h), ld);
    load16<T, D>(Vs, LH, qkv, d.qkv16, d, j0, b, d.v_off(h), ld);
    __syncthreads();
    // S (16 x kTile) = Q K^T: K's rows, read column-major, are K^T's columns.
    for (int n = 0; n < kTile / 16; ++n) {
      Acc acc;
      wmma::fill_fragment(acc, 0.0f);
      for (int k = 0; k < ND; ++k) {
        FragA<T, wmma::row_major> a;
        FragB<T, wmma::col_major> bt;
        wmma::load_matrix_sync(a, Qs + r0 * LH + k * 16, LH);
        wmma::load_matrix_sync(bt, Ks + n * 16 * LH + k * 16, LH);
        wmma::mma_sync(acc, a, bt, acc);
      }
      wmma::store_matrix_sync(Sw + n * 16, acc, LS, wmma::mem_row_major);
    }
    __syncwarp();
    {
      float* srow = Sw + rr * LS + half * (kTile / 2);
      T* prow = Pw + rr * LP + half * (kTile / 2);
      const long long jh = j0 + half * (kTile / 2);
      float mx = -INFINITY;
      for (int c = 0; c < kTile / 2; ++c) {
        const float s = (jh + c <= i && i < d.S) ? srow[c] * scale : -INFINITY;
        srow[c] = s;
        mx = fmaxf(mx, s);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float m_old = M[r0 + rr], m_new = fmaxf(m_old, mx);
      float sum = 0.0f;
      for (int c = 0; c < kTile / 2; ++c) {
        const float s = srow[c];
        const float p = s == -INFINITY ? 0.0f : expf(s - m_new);
        prow[c] = from_float<T>(p);
        sum += p;
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      const float alpha = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
      float* orow = Ow + rr * LO + half * (D / 2);
      for (int e = 0; e < D / 2; ++e) orow[e] *= alpha;
      __syncwarp();  // both lanes of the row have read m_old
      if (half == 0) {
        M[r0 + rr] = m_new;
        L[r0 + rr] = alpha * L[r0 + rr] + sum;
      }
    }
    __syncwarp();
    // O (16 x D) += P V.
    for (int n = 0; n < ND; ++n) {
      Acc acc;
      wmma::load_matrix_sync(acc, Ow + n * 16, LO, wmma::mem_row_major);
      for (int k = 0; k < kTile / 16; ++k) {
        FragA<T, wmma::row_major> a;
        FragB<T, wmma::row_major> bv;
        wmma::load_matrix_sync(a, Pw + k * 16, LP);
        wmma::load_matrix_sync(bv, Vs + k * 16 * LH + n * 16, LH);
        wmma::mma_sync(acc, a, bv, acc);
      }
      wmma::store_matrix_sync(Ow + n * 16, acc, LO, wmma::mem_row_major);
    }
    __syncwarp();
  }
  for (int r = 0; r < 16; ++r) {
    const long long row = i0 + r0 + r;
    if (row >= d.S) break;
    const float l = L[r0 + r];
    float* dst = out + d.row(row, b) * (d.A * D) + h * D;
    for (int e = lane; e < D; e += 32) dst[e] = Ow[r * LO + e] / l;
    if (lane == 0) lse[d.stat(b, h, row)] = M[r0 + r] + logf(l);
  }
#endif
}

template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    tc_backward(float* dqkv, const float* dout, const float* lse, const float* delta, const void* qkv, Dims d,
                float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using Lay = BackwardLayout<D>;
  constexpr int LH = Lay::LH, LP = Lay::LP, LW = Lay::LW, ND = D / 16;
  STRATA_DYNAMIC_SHARED(smem);
  T* Ks = reinterpret_cast<T*>(smem + Lay::k);
  T* Vs = reinterpret_cast<T*>(smem + Lay::v);
  T* Qs = reinterpret_cast<T*>(smem + Lay::q);
  T* dOs = reinterpret_cast<T*>(smem + Lay::dout);
  T* Ps = reinterpret_cast<T*>(smem + Lay::p);
  T* dSs = reinterpret_cast<T*>(smem + Lay::ds);
  float* W = reinterpret_cast<float*>(smem + Lay::w);
  float* Lq = reinterpret_cast<float*>(smem + Lay::lse);
  float* Dq = reinterpret_cast<float*>(smem + Lay::delta);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
  const long long j0 = static_cast<long long>(blockIdx.x) * kTile, h = blockIdx.y, b = blockIdx.z, ld = d.ld();
  const long long ldo = d.A * D;
  load16<T, D>(Ks, LH, qkv, d.qkv16, d, j0, b, d.k_off(h), ld);
  load16<T, D>(Vs, LH, qkv, d.qkv16, d, j0, b, d.v_off(h), ld);
  // This warp's 16 key rows of dK and dV, over every query tile.
  Acc dK[ND], dV[ND];
STRATA_UNROLL
  for (int n = 0; n < ND; ++n) {
    wmma::fill_fragment(dK[n], 0.0f);
    wmma::fill_fragment(dV[n], 0.0f);
  }
  // The warp's two scratch tiles (16 x LW fp32): S and dP, later dQ, and dK and dV at the end.
  float* Sw = W + warp * 2 * 16 * LW;
  float* dPw = Sw + 16 * LW;
  const int rr = lane >> 1, half = lane & 1;
  for (long long i0 = j0; i0 < d.S; i0 += kTile) {
    __syncthreads();  // the previous query tile, P and dS are no longer read
    load16<T, D>(Qs, LH, qkv, d.qkv16, d, i0, b, d.q_off(h), ld);
    load16<T, D>(dOs, LH, dout, false, d, i0, b, h * D, ldo);
    for (int r = threadIdx.x; r < kTile; r += blockDim.x) {
      const long long i = i0 + r;
      Lq[r] = i < d.S ? lse[d.stat(b, h, i)] : 0.0f;
      Dq[r] = i < d.S ? delta[d.stat(b, h, i)] : 0.0f;
    }
    __syncthreads();
    // This warp's 16 query rows against the block's keys: S = Q K^T, dP = dO V^T.
    for (int n = 0; n < kTile / 16; ++n) {
      Acc s, dp;
      wmma::fill_fragment(s, 0.0f);
      wmma::fill_fragment(dp, 0.0f);
      for (int k = 0; k < ND; ++k) {
        FragA<T, wmma::row_major> a;
        FragB<T, wmma::col_major> bt;
        wmma::load_matrix_sync(a, Qs + r0 * LH + k * 16, LH);
        wmma::load_matrix_sync(bt, Ks + n * 16 * LH + k * 16, LH);
        wmma::mma_sync(s, a, bt, s);
        wmma::load_matrix_sync(a, dOs + r0 * LH + k * 16, LH);
        wmma::load_matrix_sync(bt, Vs + n * 16 * LH + k * 16, LH);
        wmma::mma_sync(dp, a, bt, dp);
      }
      wmma::store_matrix_sync(Sw + n * 16, s, LW, wmma::mem_row_major);
      wmma::store_matrix_sync(dPw + n * 16, dp, LW, wmma::mem_row_major);
    }
    __syncwarp();
    {
      const long long i = i0 + r0 + rr, jh = j0 + half * (kTile / 2);
      const float l = Lq[r0 + rr], dl = Dq[r0 + rr];
      const int c0 = half * (kTile / 2);
      for (int c = 0; c < kTile / 2; ++c) {
        float p = 0.0f, ds = 0.0f;
        if (jh + c <= i && i < d.S) {
          p = expf(Sw[rr * LW + c0 + c] * scale - l);
          ds = p * (dPw[rr * LW + c0 + c] - dl);
        }
        Ps[(r0 + rr) * LP + c0 + c] = from_float<T>(p);
        dSs[(r0 + rr) * LP + c0 + c] = from_float<T>(ds);
      }
    }
    __syncthreads();  // every warp's rows of P and dS are in
    // This warp's 16 key rows: dV += P^T dO, dK += dS^T Q over the tile's queries (P and dS
    // read column-major are their transposes).
STRATA_UNROLL
    for (int n = 0; n < ND; ++n)
STRATA_UNROLL
      for (int k = 0; k < kTile / 16; ++k) {
        FragA<T, wmma::col_major> at;
        FragB<T, wmma::row_major> bq;
        wmma::load_matrix_sync(at, Ps + k * 16 * LP + r0, LP);
        wmma::load_matrix_sync(bq, dOs + k * 16 * LH + n * 16, LH);
        wmma::mma_sync(dV[n], at, bq, dV[n]);
        wmma::load_matrix_sync(at, dSs + k * 16 * LP + r0, LP);
        wmma::load_matrix_sync(bq, Qs + k * 16 * LH + n * 16, LH);
        wmma::mma_sync(dK[n], at, bq, dK[n]);
      }
    // This warp's 16 query rows: dQ = dS K, through its scratch, added with atomics.
    for (int n = 0; n < ND; ++n) {
      Acc q;
      wmma::fill_fragment(q, 0.0f);
      for (int k = 0; k < kTile / 16; ++k) {
        FragA<T, wmma::row_major> a;
        FragB<T, wmma::row_major> bk;
        wmma::load_matrix_sync(a, dSs + r0 * LP + k * 16, LP);
        wmma::load_matrix_sync(bk, Ks + k * 16 * LH + n * 16, LH);
        wmma::mma_sync(q, a, bk, q);
      }
      wmma::store_matrix_sync(Sw + n * 16, q, LW, wmma::mem_row_major);
    }
    __syncwarp();
    for (int r = 0; r < 16; ++r) {
      const long long i = i0 + r0 + r;
      if (i >= d.S) break;
      float* dst = dqkv + d.row(i, b) * ld + d.q_off(h);
      for (int e = lane; e < D; e += 32) {
        const float v = Sw[r * LW + e];
        if (v != 0.0f) atomicAdd(dst + e, scale * v);
      }
    }
  }
  __syncwarp();
STRATA_UNROLL
  for (int n = 0; n < ND; ++n) {
    wmma::store_matrix_sync(Sw + n * 16, dK[n], LW, wmma::mem_row_major);
    wmma::store_matrix_sync(dPw + n * 16, dV[n], LW, wmma::mem_row_major);
  }
  __syncwarp();
  for (int r = 0; r < 16; ++r) {
    const long long j = j0 + r0 + r;
    if (j >= d.S) break;
    float* row = dqkv + d.row(j, b) * ld;
    for (int e = lane; e < D; e += 32) {
      atomicAdd(row + d.k_off(h) + e, scale * Sw[r * LW + e]);
      atomicAdd(row + d.v_off(h) + e, dPw[r * LW + e]);
    }
  }
#endif
}

