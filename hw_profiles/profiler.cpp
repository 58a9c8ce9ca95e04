// The profiler's sweeps, checks and fits (see profiler.h).
#include "hw_profiles/profiler.h"

#include "executor/memory_tracker.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>

#include <fmt/format.h>

#include "executor/zero.h"

namespace strata {
namespace {

// Query rows (sequence x heads x sequences) the fused attention is measured over on a
// device: gpt2-124m's micro-batch of 8 (1024 x 12 x 8).
constexpr int64_t kFlashFillRows = int64_t{96} << 10;

Group world_of(const Comm& comm) {
  ProcessGrid grid;
  grid.d = comm.size();
  return grid.group(kWorld, comm.rank());
}

// Runs fn() enough times for min_time_s (every rank the same count); returns the mean
// seconds per call on the slowest rank. The backend's queued work is waited for before each
// clock reading (a GPU's stream), so the time is the device's.
double time_calls(Comm& comm, Backend& be, double min_time_s, const std::function<void()>& fn) {
  const Group w = world_of(comm);
  fn();  // warm-up
  be.synchronise();
  comm.barrier(w);
  double t0 = comm.wtime();
  fn();
  be.synchronise();
  double one = comm.wtime() - t0;
  comm.all_reduce(&one, 1, w, ReduceOp::max);
  const int64_t iters = std::clamp<int64_t>(static_cast<int64_t>(min_time_s / std::max(one, 1e-9)), 3, 2000);
  comm.barrier(w);
  t0 = comm.wtime();
  for (int64_t i = 0; i < iters; ++i) fn();
  be.synchronise();
  double mean = (comm.wtime() - t0) / static_cast<double>(iters);
  comm.all_reduce(&mean, 1, w, ReduceOp::max);
  return mean;
}

// n floats in the backend's memory holding a copy of `host` (or `value` everywhere).
Buf on_backend(Backend& be, const std::vector<float>& host) {
  Buf b = Buf::untracked(&be, static_cast<int64_t>(host.size()));
  be.to_device(b.data(), host.data(), b.size());
  return b;
}
Buf on_backend(Backend& be, int64_t n, float value) {
  return on_backend(be, std::vector<float>(static_cast<size_t>(std::max<int64_t>(n, 0)), value));
}

const char* op_name(Collective c) {
  switch (c) {
    case Collective::all_reduce: return "all_reduce";
    case Collective::all_gather: return "all_gather";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::send_recv: return "sendrecv";
    case Collective::all_to_all: return "alltoall";
  }
  return "?";
}

// One collective at one size: fills the buffers with exact small integers, runs it,
// counts wrong elements, then times it.
CollectiveRow measure(Comm& comm, Backend& be, Collective op, int64_t bytes, double min_time_s) {
  const Group w = world_of(comm);
  const int n = comm.size(), me = comm.rank();
  CollectiveRow row;
  row.op = op;
  // Per-rank element counts: the gathered output and the scattered input hold n blocks.
  const bool blocks = op == Collective::all_gather || op == Collective::reduce_scatter;
  const int64_t block = std::max<int64_t>(1, bytes / 4 / (blocks ? n : 1));
  row.count = blocks ? block * n : block;
  row.bytes = row.count * 4;
  // Buffers in the backend's memory (device memory for CUDA), as the executor's are.
  std::vector<float> host_in(static_cast<size_t>(blocks ? block * n : block)), out_host(host_in.size());
  for (size_t i = 0; i < host_in.size(); ++i) {
    if (op == Collective::all_gather) host_in[i] = static_cast<float>(me * 1000 + static_cast<int>(i % 17));
    else if (op == Collective::send_recv) host_in[i] = static_cast<float>(me * 100 + static_cast<int>(i % 19));
    else host_in[i] = static_cast<float>(me + 1 + static_cast<int>(i % 13));
  }
  Buf in = on_backend(be, host_in), out = Buf::untracked(&be, static_cast<int64_t>(host_in.size()));
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  auto run = [&] {
    switch (op) {
      case Collective::all_reduce:
        be.copy(out.data(), in.data(), block);
        comm.all_reduce(out.data(), block, w);
        break;
      case Collective::all_gather: comm.all_gather(in.data(), out.data(), block, w); break;
      case Collective::reduce_scatter: comm.reduce_scatter(in.data(), out.data(), block, w); break;
      case Collective::send_recv: {
        Request r = comm.irecv(out.data(), block, prev, 77);
        Request s = comm.isend(in.data(), block, next, 77);
        comm.wait(r);
        comm.wait(s);
        break;
      }
      case Collective::all_to_all:  // (not swept: a profile's all-to-all is its all-gather's, hardware.cpp)
        throw std::logic_error("strata profile does not measure all-to-all");
    }
  };
  run();
  be.synchronise();
  be.to_host(out_host.data(), out.data(), out.size());
  int64_t wrong = 0;
  const float tri = static_cast<float>(n * (n + 1) / 2);
  for (int64_t i = 0; i < (op == Collective::all_gather ? block * n : block); ++i) {
    float want = 0;
    switch (op) {
      case Collective::all_reduce: want = tri + static_cast<float>(n * static_cast<int>(i % 13)); break;
      case Collective::all_gather: want = static_cast<float>((i / block) * 1000 + (i % block) % 17); break;
      case Collective::reduce_scatter:
        want = tri + static_cast<float>(n * static_cast<int>((me * block + i) % 13));
        break;
      case Collective::send_recv: want = static_cast<float>(prev * 100 + static_cast<int>(i % 19)); break;
      case Collective::all_to_all: break;
    }
    if (out_host[static_cast<size_t>(i)] != want) ++wrong;
  }
  double wr = static_cast<double>(wrong);
  comm.all_reduce(&wr, 1, w);
  row.wrong = static_cast<int64_t>(wr);
  // Timed: the collective alone. The all-reduce (in place) runs on a buffer of zeros, so
  // no copy of the input joins the timing and repeated sums stay finite.
  Buf zeros = Buf::untracked(&be, block);
  row.time_s = op == Collective::all_reduce
                   ? time_calls(comm, be, min_time_s, [&] { comm.all_reduce(zeros.data(), block, w); })
                   : time_calls(comm, be, min_time_s, run);
  row.algbw_gbps = static_cast<double>(row.bytes) / row.time_s / 1e9;
  row.busbw_gbps = row.algbw_gbps * bus_factor_of(op, n);
  return row;
}

// Least squares of time = alpha + x * beta weighted by 1 / time^2 (relative errors),
// x = bytes * bus factor.
CollectiveFit fit(Collective op, const std::vector<CollectiveRow>& rows, int n) {
  double sw = 0, swx = 0, swxx = 0, swt = 0, swxt = 0;
  for (const CollectiveRow& r : rows) {
    if (r.op != op) continue;
    const double x = static_cast<double>(r.bytes) * bus_factor_of(op, n), t = r.time_s, w = 1.0 / (t * t);
    sw += w;
    swx += w * x;
    swxx += w * x * x;
    swt += w * t;
    swxt += w * x * t;
  }
  CollectiveFit f;
  f.op = op;
  const double det = sw * swxx - swx * swx;
  if (det <= 0) return f;
  double beta = (sw * swxt - swx * swt) / det, alpha = (swt - beta * swx) / sw;
  if (alpha < 0) {  // refit through the origin
    alpha = 0;
    beta = swxt / swxx;
  }
  f.latency_s = alpha;
  f.busbw_bytes_per_s = beta > 0 ? 1.0 / beta : 0;
  return f;
}

// One memory-bound kernel of the executor on buffers of its size; seconds per call on the
// slowest rank. A `rounded` one rounds its output to bf16 as it writes it.
double time_kernel(Comm& comm, Backend& be, const MemoryKernel& k, double min_time_s) {
  const Precision r = k.rounded ? Precision::bf16 : Precision::fp32;
  const int64_t n = k.rows * k.width;
  const bool two_halves = gated(k.act);  // a gated activation reads [gate | up]
  const bool activation = k.kind == KernelKind::activation_forward || k.kind == KernelKind::activation_backward;
  const int64_t un = two_halves && activation ? 2 * n : n;
  std::vector<float> xh(static_cast<size_t>(un));
  for (size_t i = 0; i < xh.size(); ++i) xh[i] = 0.001f * static_cast<float>(static_cast<int64_t>(i % 2001) - 1000);
  // Every buffer in the backend's memory.
  Buf x = on_backend(be, xh), y = Buf::untracked(&be, un), dy = on_backend(be, n, 0.01f),
      w = on_backend(be, k.width, 1.0f), bias = Buf::untracked(&be, k.width), dw = Buf::untracked(&be, k.width),
      db = Buf::untracked(&be, k.width), mean = Buf::untracked(&be, k.rows), rstd = Buf::untracked(&be, k.rows);
  const bool ln = k.norm == Norm::layernorm;
  if (k.kind == KernelKind::norm_backward) {  // the statistics the backward reads
    if (ln) be.layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), bias.data(), k.rows, k.width);
    else be.rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), k.rows, k.width);
  }
  Buf m, v;
  ByteBuf decay, counted;
  if (k.kind == KernelKind::optimizer) {
    m = Buf::untracked(&be, n);
    v = Buf::untracked(&be, n);
    const std::vector<uint8_t> ones = pack_flags(std::vector<uint8_t>(static_cast<size_t>(n), 1));
    decay = ByteBuf(&be, ones.data(), ones.size());
    counted = ByteBuf(&be, ones.data(), ones.size());
  }
  int64_t step = 0;
  return time_calls(comm, be, min_time_s, [&] {
    switch (k.kind) {
      case KernelKind::norm_forward:
        if (ln) be.layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), bias.data(), k.rows, k.width, r);
        else be.rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), k.rows, k.width, r);
        break;
      case KernelKind::norm_backward:
        if (ln)
          be.layernorm_backward(y.data(), dw.data(), db.data(), dy.data(), x.data(), mean.data(), rstd.data(), w.data(),
                                k.rows, k.width);
        else be.rmsnorm_backward(y.data(), dw.data(), dy.data(), x.data(), rstd.data(), w.data(), k.rows, k.width);
        break;
      case KernelKind::activation_forward: be.activation_forward(k.act, y.data(), x.data(), k.rows, k.width, r); break;
      case KernelKind::activation_backward:
        be.activation_backward(k.act, y.data(), dy.data(), x.data(), k.rows, k.width, r);
        break;
      case KernelKind::optimizer: {  // what Engine::optimizer_step runs per parameter
        double acc[2] = {0, 0};
        be.grad_norm_terms(x.data(), FlagBits{counted.data(), 0}, n, acc);
        be.adamw(y.data(), x.data(), m.data(), v.data(), FlagBits{decay.data(), 0}, n, AdamW{}, 1e-4, ++step, 1.0f);
        break;
      }
      case KernelKind::round16: be.round_to(x.data(), n, Precision::bf16); break;  // (idempotent: the same work each call)
    }
  });
}

}  // namespace

double bus_factor_of(Collective c, int n) {
  switch (c) {
    case Collective::all_reduce: return 2.0 * (n - 1) / n;
    case Collective::all_gather:
    case Collective::reduce_scatter:
    case Collective::all_to_all: return static_cast<double>(n - 1) / n;
    case Collective::send_recv: return 1.0;
  }
  return 1.0;
}

double kernel_bytes(const MemoryKernel& k) {
  const double n = static_cast<double>(k.rows) * static_cast<double>(k.width), e = 4.0;
  const bool two_halves = gated(k.act);
  switch (k.kind) {
    case KernelKind::norm_forward: return 2.0 * e * n;
    case KernelKind::norm_backward: return 3.0 * e * n;
    case KernelKind::activation_forward: return (two_halves ? 3.0 : 2.0) * e * n;
    case KernelKind::activation_backward: return (two_halves ? 5.0 : 3.0) * e * n;
    case KernelKind::optimizer: return 40.0 * static_cast<double>(k.width);
    case KernelKind::round16: return 8.0 * n;  // as the cost model charges it (compute.cpp)
  }
  return 0;
}

const char* kernel_name(KernelKind k) {
  switch (k) {
    case KernelKind::norm_forward: return "norm forward";
    case KernelKind::norm_backward: return "norm backward";
    case KernelKind::activation_forward: return "activation forward";
    case KernelKind::activation_backward: return "activation backward";
    case KernelKind::optimizer: return "optimizer";
    case KernelKind::round16: return "round16";
  }
  return "?";
}

std::vector<MemoryKernel> model_memory_kernels(const ModelSpec& m, int64_t t) {
  std::vector<MemoryKernel> out;
  for (int64_t B : {1, 2, 4, 8, 16}) {
    const int64_t N = B * m.S;
    // (The norm's forward and the activation's also as 16-bit training runs them: rounding
    // their outputs as they write them.)
    for (KernelKind k : {KernelKind::norm_forward, KernelKind::norm_backward}) {
      out.push_back({k, N, m.H, m.normalization, m.activation});
      if (k == KernelKind::norm_forward) out.push_back({k, N, m.H, m.normalization, m.activation, true});
    }
    for (KernelKind k : {KernelKind::activation_forward, KernelKind::activation_backward}) {
      out.push_back({k, N, m.F / t, m.normalization, m.activation});
      out.push_back({k, N, m.F / t, m.normalization, m.activation, true});
    }
  }
  for (int64_t B : {1, 2, 4, 8, 16})  // the 16-bit rounding pass over tensors of the hidden and the ffn width
    for (int64_t width : {m.H, m.F / t}) out.push_back({KernelKind::round16, B * m.S, width, m.normalization, m.activation});
  const int64_t layer = m.layer_params(t), all = std::min<int64_t>(m.total_params() / t, int64_t{1} << 26);
  out.push_back({KernelKind::optimizer, 1, layer, m.normalization, m.activation});
  if (all > 2 * layer) out.push_back({KernelKind::optimizer, 1, all, m.normalization, m.activation});
  return out;
}

AttentionShape model_attention_shape(const ModelSpec& m, int64_t t) {
  AttentionShape a;
  a.S = m.S;
  a.A = m.A / t;
  a.G = m.G / t;
  a.D = m.D();
  return a;
}

std::vector<GemmShape> model_gemm_shapes(const ModelSpec& m, int64_t t) {
  std::vector<GemmShape> out;
  const int64_t H = m.H, D = m.D();
  for (int64_t B : {1, 2, 4, 8, 16}) {
    const int64_t N = B * m.S;
    out.push_back({N, (m.A + 2 * m.G) * D / t, H});
    out.push_back({N, H, m.A * D / t});
    out.push_back({N, m.fc1_out() / t, H});
    out.push_back({N, H, m.F / t});
    out.push_back({N, m.padded_vocab(t) / t, H});
  }
  out.push_back({m.S, m.S, m.D()});  // one head's scores and context products
  out.push_back({m.S, m.D(), m.S});
  return out;
}

ProfileResult run_profile(Comm& comm, Backend& be, const ProfileOptions& o) {
  ProfileResult res;
  res.ranks = comm.size();
  const int n = comm.size();
  // The sweep points, counted first so progress can show an ETA.
  std::vector<GemmShape> shapes;
  const std::vector<int64_t> sizes = o.gemms_only ? std::vector<int64_t>{}
                                     : o.quick    ? std::vector<int64_t>{32, 128, 256, 512, 1024}
                                                  : std::vector<int64_t>{16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048};
  for (int64_t N : sizes) {  // square, and the (N, 4N) x (4N, N) shape of an MLP
    shapes.push_back({N, N, N});
    shapes.push_back({N, N, 4 * N});
  }
  shapes.insert(shapes.end(), o.extra_gemms.begin(), o.extra_gemms.end());
  std::vector<int64_t> stream_bytes;
  for (int64_t bytes = int64_t{12} << 8; bytes <= (o.quick ? int64_t{12} << 22 : int64_t{12} << 24); bytes *= 4)
    stream_bytes.push_back(bytes);
  const int64_t lo = o.quick ? int64_t{4} << 10 : int64_t{1} << 10;
  const int64_t hi = o.quick ? std::min<int64_t>(o.max_message_bytes, int64_t{4} << 20) : o.max_message_bytes;
  std::vector<int64_t> message_bytes;
  for (int64_t bytes = lo; n > 1 && bytes <= hi; bytes *= (o.quick ? 4 : 2)) message_bytes.push_back(bytes);
  std::vector<MemoryKernel> kernels = o.kernels;
  if (kernels.empty()) {  // a generic GPT: hidden 1024, 2048-token micro-batches
    ModelSpec g = load_model("gpt2-124m");
    g.H = 1024;
    g.F = 4096;
    g.S = 512;
    kernels = model_memory_kernels(g, 1);
  }
  if (o.quick) {
    // --quick keeps each memory-bound kernel to 64 MiB: the generic model's largest moved
    // 2.7 GB (the optimizer over 67 M parameters), 30 of the 37 s a quick profile took on
    // the 2-core machine, most of it first touching the pages. An optimizer kernel over
    // the cap is measured at the cap's width instead (once), so the sweep keeps one.
    constexpr double kQuickKernelBytes = 64.0 * (1 << 20);
    const double per_param = kernel_bytes(MemoryKernel{KernelKind::optimizer, 1, 1});
    std::vector<MemoryKernel> kept;
    for (MemoryKernel k : kernels) {
      if (k.kind == KernelKind::optimizer)
        k.width = std::min<int64_t>(k.width, static_cast<int64_t>(kQuickKernelBytes / per_param));
      else if (kernel_bytes(k) > kQuickKernelBytes)
        continue;
      const bool again = std::any_of(kept.begin(), kept.end(), [&](const MemoryKernel& x) {
        return x.kind == k.kind && x.rows == k.rows && x.width == k.width && x.rounded == k.rounded;
      });
      if (!again) kept.push_back(k);
    }
    kernels = std::move(kept);
  }
  const int total = o.gemms_only ? static_cast<int>(shapes.size())
                                 : static_cast<int>(shapes.size() + (o.gemm_precision ? 1 : 0) + stream_bytes.size() +
                                                    kernels.size() + 1 + 4 * message_bytes.size());
  // What the device holds before the profile allocates anything (driver context, library
  // handles and workspaces): the framework's own memory, where the backend can say.
  Backend::DeviceMemory dm0;
  const bool device = be.device_memory(&dm0);
  if (o.gemm_precision) o.gemm_precision(Precision::bf16);
  int done = 0;
  const double t_begin = comm.wtime();
  auto say = [&](const std::string& s) {
    ++done;
    if (!o.progress || comm.rank() != 0) return;
    const double el = comm.wtime() - t_begin;
    o.progress(s, done, total, el, el / done * (total - done));
  };
  // GEMM, every rank at once.
  for (const GemmShape& g : shapes) {
    // Operands rotate through several copies, at least kColdBytes in all, so each call
    // finds them in memory rather than in the caches, as a training step does. Each call
    // runs the shape as a linear layer does in training: forward x W^T (M, N, K), input
    // gradient dY W (M, K, N) and weight gradient dY^T x added into the gradient
    // (N, K, M), the same FLOPs each; the rate is that of the three together.
    constexpr int64_t kColdBytes = int64_t{64} << 20;
    const int64_t sa = std::max(g.M * g.K, g.M * g.N), sb = std::max(g.N * g.K, g.M * g.K),
                  sc = std::max({g.M * g.N, g.M * g.K, g.N * g.K});
    const int64_t one = 4 * (sa + sb + sc);
    const int64_t copies = std::clamp<int64_t>(kColdBytes / std::max<int64_t>(one, 1), 1, 64);
    Buf a = on_backend(be, copies * sa, 0.5f), b = on_backend(be, copies * sb, 0.25f),
        c = Buf::untracked(&be, copies * sc);
    int64_t next = 0;
    const double t = time_calls(comm, be, o.min_time_s, [&] {
      const int64_t i = next++ % copies;
      float *A = a.data() + i * sa, *B = b.data() + i * sb, *C = c.data() + i * sc;
      be.gemm(false, true, g.M, g.N, g.K, 1.0f, A, g.K, B, g.K, 0.0f, C, g.N);   // y = x W^T
      be.gemm(false, false, g.M, g.K, g.N, 1.0f, A, g.N, B, g.K, 0.0f, C, g.K);  // dx = dy W
      be.gemm(true, false, g.N, g.K, g.M, 1.0f, A, g.N, B, g.K, 1.0f, C, g.K);   // dW += dy^T x
    }) / 3.0;
    const double flops = 2.0 * static_cast<double>(g.M * g.K * g.N);
    res.gemm.push_back({flops, flops / t});
    say(fmt::format("gemm {}x{}x{}: {:.1f} GFLOP/s per rank", g.M, g.N, g.K, flops / t / 1e9));
  }
  std::sort(res.gemm.begin(), res.gemm.end());
  if (o.gemms_only) return res;
  // The fp32 GEMM peak, where the sweep ran in 16 bits (CUDA): one large square product in
  // fp32 (no TF32, as the executor runs fp32 plans).
  double fp32_peak = 0;
  if (o.gemm_precision) {
    const int64_t N = 4096;
    Buf a = on_backend(be, N * N, 0.5f), b = on_backend(be, N * N, 0.25f), c = Buf::untracked(&be, N * N);
    o.gemm_precision(Precision::fp32);
    const double t = time_calls(comm, be, o.min_time_s, [&] {
      be.gemm(false, true, N, N, N, 1.0f, a.data(), N, b.data(), N, 0.0f, c.data(), N);
    });
    o.gemm_precision(Precision::bf16);
    fp32_peak = 2.0 * static_cast<double>(N * N * N) / t;
    say(fmt::format("gemm {0}x{0}x{0} fp32: {1:.1f} GFLOP/s per rank", N, fp32_peak / 1e9));
  }
  // Memory: STREAM add a = b + c (12 bytes per element) with the backend's own kernel.
  for (int64_t bytes : stream_bytes) {
    const int64_t e = bytes / 12;
    Buf a = Buf::untracked(&be, e), b = on_backend(be, e, 1.0f), c = on_backend(be, e, 2.0f);
    const double t = time_calls(comm, be, o.min_time_s, [&] { be.add(a.data(), b.data(), c.data(), e); });
    res.memory.push_back({static_cast<double>(bytes), static_cast<double>(bytes) / t});
    say(fmt::format("stream add {} bytes: {:.1f} GB/s per rank", bytes, static_cast<double>(bytes) / t / 1e9));
  }
  // The executor's memory-bound kernels, in the cost model's bytes.
  for (const MemoryKernel& k : kernels) {
    const double bytes = kernel_bytes(k);
    const double t = time_kernel(comm, be, k, o.min_time_s);
    res.kernels.push_back({k, bytes, bytes / t});
    say(fmt::format("{}{} {}x{}: {:.1f} GB/s per rank", kernel_name(k.kind), k.rounded ? " (bf16 out)" : "", k.rows,
                    k.width, bytes / t / 1e9));
  }
  // The fused attention forward and backward (the executor's `attention: flash`).
  {
    // On a device, enough sequences to fill it as a micro-batch of several does (a kernel
    // of one short sequence and few heads leaves most of a GPU's processors idle: on an
    // H100, S=512 with 8 heads ran at a sixth of the rate of S=1024 with 8 x 12 heads).
    // The estimate applies the one rate measured here to every plan's shape, so a plan of
    // far fewer query rows (micro-batch x heads x sequence) than this is estimated fast.
    AttentionShape a = o.attention;
    if (device) a.B = std::max<int64_t>(a.B, kFlashFillRows / std::max<int64_t>(a.S * a.A, 1));
    const int64_t q = a.S * a.B * (a.A + 2 * a.G) * a.D, rows = a.S * a.B * a.A * a.D;
    std::vector<float> h(static_cast<size_t>(q));
    for (size_t i = 0; i < h.size(); ++i) h[i] = 0.01f * static_cast<float>(static_cast<int64_t>(i % 201) - 100);
    Buf qkv = on_backend(be, h), out = Buf::untracked(&be, rows), dout = on_backend(be, rows, 0.01f),
        lse = Buf::untracked(&be, a.B * a.A * a.S), dqkv = Buf::untracked(&be, q);
    const double fwd = time_calls(comm, be, o.min_time_s, [&] {
      be.flash_attention_forward(out.data(), lse.data(), qkv.data(), a.S, a.B, a.A, a.G, a.D);
    });
    const double bwd = time_calls(comm, be, o.min_time_s, [&] {
      be.flash_attention_backward(dqkv.data(), dout.data(), out.data(), lse.data(), qkv.data(), a.S, a.B, a.A, a.G, a.D);
    });
    // costmodel/compute.cpp's counts: forward 4 B A S^2 D / 2, backward 10 B A S^2 D / 2.
    const double f = 2.0 * static_cast<double>(a.B * a.A) * static_cast<double>(a.S) * static_cast<double>(a.S) *
                     static_cast<double>(a.D);
    res.flash_forward_flops_per_s = f / fwd;
    res.flash_backward_flops_per_s = 2.5 * f / bwd;
    say(fmt::format("flash attention S={} B={} A={} D={}: forward {:.1f}, backward {:.1f} GFLOP/s per rank", a.S, a.B,
                    a.A, a.D, res.flash_forward_flops_per_s / 1e9, res.flash_backward_flops_per_s / 1e9));
  }
  // Collectives.
  if (n > 1) {
    for (Collective op : {Collective::all_reduce, Collective::all_gather, Collective::reduce_scatter, Collective::send_recv}) {
      for (int64_t bytes : message_bytes) {
        res.rows.push_back(measure(comm, be, op, bytes, o.min_time_s));
        say(fmt::format("{} {} bytes: busbw {:.2f} GB/s", op_name(op), res.rows.back().bytes, res.rows.back().busbw_gbps));
      }
      res.fits.push_back(fit(op, res.rows, n));
    }
  }
  // The cluster: local-cpu's framework constants, every measured field replaced.
  Cluster c = load_cluster("local-cpu");
  c.name = std::string("measured-") + be.name();
  c.description = fmt::format("measured by strata profile on {} rank(s) of this machine, all ranks at once, {} backend{}",
                              n, be.name(), device ? "; links: host-staged Open MPI between device buffers" : "");
  double peak = 0;
  for (const auto& [f, r] : res.gemm) peak = std::max(peak, r);
  std::vector<std::pair<double, double>> ge;
  for (const auto& [f, r] : res.gemm) {
    const double e = std::max(r / peak, kMinCurveEfficiency);
    if (!ge.empty() && ge.back().first == f) ge.back().second = std::max(ge.back().second, e);
    else ge.push_back({f, e});
  }
  c.device.name = o.device_name.empty() ? "CPU core per rank (Eigen fp32), measured" : o.device_name + ", measured";
  c.device.batched_gemm_per_matrix = be.batched_gemm_per_matrix();
  c.device.gemm_reads_16bit = be.gemm_reads_16bit();
  c.device.cross_entropy_one_pass = be.cross_entropy_one_pass();
  c.device.peak_fp32_flops = c.device.peak_tf32_flops = c.device.peak_bf16_flops = c.device.peak_fp16_flops = peak;
  if (fp32_peak > 0) c.device.peak_fp32_flops = c.device.peak_tf32_flops = fp32_peak;  // the sweep was 16-bit
  // The fused attention as a fraction of the 16-bit peak, what the cost model charges it
  // against in a 16-bit plan (compute.cpp), so the estimate gives back the measured rate: it
  // ran at the sweep's precision (CUDA: bf16, on the tensor cores; the CPU: fp32, whose peak
  // is every precision's). An fp32 plan on a GPU is charged the same fraction of the fp32
  // peak: not measured (its kernels are the CUDA cores' fp32 ones).
  c.device.flash_fwd_efficiency = std::clamp(res.flash_forward_flops_per_s / c.device.peak_bf16_flops, 1e-3, 1.0);
  c.device.flash_bwd_efficiency = std::clamp(res.flash_backward_flops_per_s / c.device.peak_bf16_flops, 1e-3, 1.0);
  c.device.peak_fp8_flops = 0;
  c.device.gemm_efficiency = Curve(ge);
  // The peak: the best any memory kernel reached (STREAM add, unless a slower build or a
  // busy core held it below one of the executor's kernels).
  double bw = 0;
  for (const auto& [b, r] : res.memory) bw = std::max(bw, r);
  // (The rounding pass too, in place on buffers a cache may hold: where it beats STREAM add
  // the bandwidth is its rate, every efficiency below relative to it, and the times alike.)
  for (const auto& k : res.kernels) bw = std::max(bw, k.bytes_per_s);
  // The efficiency curve is that of the kernels training runs (STREAM add gives the peak):
  // points at the same size are averaged.
  // Points of the kernels `of` selects, sorted by size, those within 1 % of a size averaged.
  auto curve_of = [&](auto&& of) {
    std::vector<std::pair<double, double>> kp, out;
    for (const auto& k : res.kernels)
      if (of(k.kernel)) kp.push_back({k.bytes, k.bytes_per_s / bw});
    std::sort(kp.begin(), kp.end());
    for (size_t i = 0; i < kp.size();) {
      size_t j = i;
      double sum = 0;
      while (j < kp.size() && kp[j].first <= kp[i].first * 1.01) sum += kp[j++].second;
      out.push_back({kp[i].first, std::clamp(sum / static_cast<double>(j - i), kMinCurveEfficiency, 1.0)});
      i = j;
    }
    return out;
  };
  // The generic curve: the norm, activation and optimizer kernels together, unrounded (what
  // any other memory-bound op is charged at); and each kind's own (Device::
  // kernel_efficiency), the norm's forward and the activation's as 16-bit training runs them,
  // rounding what they write (an fp32 plan's are so charged a little slow: on the 2-core CPU
  // 12-19 %). Without rounded points (a profile's own kernel list) the unrounded ones serve.
  using K = KernelKind;
  using MK = MemoryKernel;
  std::vector<std::pair<double, double>> me =
      curve_of([](const MK& k) { return k.kind != K::round16 && !k.rounded; });
  auto kind_curve = [&](MemKind mk, auto&& of) {
    const auto pts = curve_of(of);
    if (!pts.empty()) c.device.kernel_efficiency[static_cast<int>(mk)] = Curve(pts);
  };
  auto sixteen_bit = [&](K kind) {  // whether rounded points of the kind were timed
    return std::any_of(res.kernels.begin(), res.kernels.end(),
                       [&](const ProfileResult::KernelPoint& p) { return p.kernel.kind == kind && p.kernel.rounded; });
  };
  const bool norm16 = sixteen_bit(K::norm_forward), act16 = sixteen_bit(K::activation_forward);
  kind_curve(MemKind::norm, [&](const MK& k) {
    return (k.kind == K::norm_forward && k.rounded == norm16) || (k.kind == K::norm_backward && !k.rounded);
  });
  kind_curve(MemKind::activation, [&](const MK& k) {
    return (k.kind == K::activation_forward || k.kind == K::activation_backward) && k.rounded == act16;
  });
  kind_curve(MemKind::round16, [](const MK& k) { return k.kind == K::round16; });
  if (me.empty())
    for (const auto& [b, r] : res.memory) me.push_back({b, r / bw});
  c.device.memory_bandwidth_bytes_per_s = bw;
  c.device.memory_efficiency = Curve(me);
  if (device) {  // the device's memory, and what it held before the profile: the framework's,
    // with the most its workspaces grow to while training (on the CUDA backend 256 MiB of
    // 16-bit GEMM operand copies and 64 MiB of attention scores; a bound: an fp32 plan makes
    // no copies, a flash-attention plan no scores)
    c.device.memory_bytes = static_cast<double>(dm0.total);
    c.framework_overhead_bytes = static_cast<double>(dm0.total - dm0.free + dm0.workspace_growth);
  } else {
    const double ram = physical_memory_bytes();
    c.device.memory_bytes = ram / n;
  }
  // The machine's network (not measured: one machine) is shared by its n ranks, and the
  // cluster JSON holds each device's share.
  c.inter.bandwidth_bytes_per_s *= static_cast<double>(c.devices_per_node) / static_cast<double>(n);
  c.devices_per_node = n;
  // Every rate above was measured with all n ranks busy: where they share fewer processors,
  // the estimate gives a rank more of one while fewer are busy (estimate.h).
  c.processors_per_node = o.processors > 0 && o.processors < n ? o.processors : 0;
  bool fitted = n > 1 && message_bytes.size() >= 3;
  for (const CollectiveFit& f : res.fits) fitted = fitted && f.busbw_bytes_per_s > 0;
  if (n > 1 && !fitted && o.progress && comm.rank() == 0)
    o.progress("too few message sizes (or a non-positive slope) to fit the links: local-cpu's link values kept", total,
               total, comm.wtime() - t_begin, 0.0);
  // One rank has no link to time: the profile says its link values are not measured.
  if (n == 1) {
    c.description += "; links not measured (one rank): local-cpu's values";
    if (o.progress && comm.rank() == 0)
      o.progress("one rank: no links to measure (run it under mpirun -np N for them): local-cpu's link values kept",
                 total, total, comm.wtime() - t_begin, 0.0);
  }
  if (fitted) {
    double link = 0;
    for (const CollectiveFit& f : res.fits) link = std::max(link, f.busbw_bytes_per_s);
    c.intra.bandwidth_bytes_per_s = link;
    const double steps = 2.0 * std::log2(static_cast<double>(n));
    c.intra.latency_s = std::max(1e-7, res.fits[0].latency_s / std::max(1.0, steps));
    for (const CollectiveFit& f : res.fits) {
      const double e = link > 0 ? std::max(0.01, f.busbw_bytes_per_s / link) : 1.0;
      if (f.op == Collective::all_reduce) c.intra.eff_all_reduce = e;
      if (f.op == Collective::all_gather) c.intra.eff_all_gather = c.intra.eff_all_to_all = e;  // (hardware.cpp)
      if (f.op == Collective::reduce_scatter) c.intra.eff_reduce_scatter = e;
      if (f.op == Collective::send_recv) c.intra.eff_send_recv = e;
    }
  }
  res.cluster = c;
  return res;
}

std::string format_collective_table(const std::vector<CollectiveRow>& rows, int ranks) {
  std::string s = fmt::format("# {} ranks, float, sum; time per call on the slowest rank\n", ranks);
  s += fmt::format("# {:>14} {:>12} {:>6} {:>15} {:>10} {:>8} {:>8} {:>7}\n", "collective", "size(B)", "count", "type",
                   "time(us)", "algbw", "busbw", "#wrong");
  s += fmt::format("# {:>14} {:>12} {:>6} {:>15} {:>10} {:>8} {:>8} {:>7}\n", "", "", "", "", "", "(GB/s)", "(GB/s)", "");
  for (const CollectiveRow& r : rows)
    s += fmt::format("  {:>14} {:>12} {:>6} {:>15} {:>10.1f} {:>8.2f} {:>8.2f} {:>7}\n", op_name(r.op), r.bytes, r.count,
                     "float", r.time_s * 1e6, r.algbw_gbps, r.busbw_gbps, r.wrong);
  return s;
}

std::string format_profile_summary(const ProfileResult& r) {
  std::string s;
  s += "GEMM (per rank, all ranks at once)\n";
  for (const auto& [f, rate] : r.gemm) s += fmt::format("  {:>12.3g} FLOPs  {:>8.1f} GFLOP/s\n", f, rate / 1e9);
  s += "memory, STREAM add a = b + c (per rank, all ranks at once)\n";
  for (const auto& [b, bw] : r.memory) s += fmt::format("  {:>12.3g} bytes  {:>8.2f} GB/s\n", b, bw / 1e9);
  s += fmt::format("fused attention: forward {:.1f} GFLOP/s, backward {:.1f} GFLOP/s (per rank, all ranks at once)\n",
                   r.flash_forward_flops_per_s / 1e9, r.flash_backward_flops_per_s / 1e9);
  s += "memory-bound kernels of the executor, in the cost model's bytes (per rank, all ranks at once)\n";
  for (const auto& k : r.kernels)
    s += fmt::format("  {:<20} {:>7} x {:<7} {:>12.3g} bytes  {:>8.2f} GB/s\n",
                     std::string(kernel_name(k.kernel.kind)) + (k.kernel.rounded ? " (bf16)" : ""), k.kernel.rows,
                     k.kernel.width, k.bytes, k.bytes_per_s / 1e9);
  if (!r.rows.empty()) {
    s += "\n";
    s += format_collective_table(r.rows, r.ranks);
    s += "\nfit: time = latency + size * bus factor / busbw\n";
    for (const CollectiveFit& f : r.fits)
      s += fmt::format("  {:<15} latency {:>7.1f} us   busbw {:>7.2f} GB/s\n", op_name(f.op), f.latency_s * 1e6,
                       f.busbw_bytes_per_s / 1e9);
  }
  return s;
}

}  // namespace strata
