// The minGRU / minLSTM recurrence on the CPU in one pass over time each way (sequence.py beside this file).
//
// The Python form builds the scan's coefficients a, b with a handful of elementwise ops, runs the chunked
// scan of rpt/ops/minrnn/scan.py (about five passes over [B, T, H] forward and eight backward, plus the
// coefficients' own autograd): the whole layer's forward and backward ran 1.1-1.25x longer with it than with
// this file (benchmarks/cells/speed.py; the projections' GEMMs are the rest of the step). Here the gates
// (computed by the caller with ATen's vectorised sigmoid, the only transcendental) and the candidate are read
// once, the state is carried along time in a block of L1, and the backward writes the gradient of the projected
// input u directly: one read of each input and one write of each output per direction.
//
//   kind 0, minGRU:  z = gates[..., :H]                       h_t = keep_t (1 - z) h_{t-1} + z h~
//   kind 1, minLSTM: f = gates[..., :H], i = gates[..., H:]  a = f / (f + i)
//                                                            h_t = keep_t a h_{t-1} + (1 - a) h~
// with h~ = u[..., n H:] (n = 1 gate for minGRU, 2 for minLSTM) and keep_t = 0 where a reset falls.
// The work splits over (batch row, block of channels); time runs in order within each.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

constexpr int64_t kMaxBlock = 4096;  // channels per work item, at most: the carried state stays in L1

struct Shapes {
  int64_t B, T, H, n_gates;
};

Shapes check(const Tensor& gates, const Tensor& u, const Tensor& h0, const OptTensor& keep, int64_t kind) {
  TORCH_CHECK(kind == 0 || kind == 1, "min_scan: kind is 0 (minGRU) or 1 (minLSTM)");
  TORCH_CHECK(gates.is_cpu() && u.is_cpu() && h0.is_cpu(), "min_scan: CPU tensors only");
  TORCH_CHECK(gates.is_contiguous() && u.is_contiguous() && h0.is_contiguous(), "min_scan: contiguous inputs");
  const int64_t n = kind + 1, B = u.size(0), T = u.size(1), H = h0.size(1);
  TORCH_CHECK(u.dim() == 3 && u.size(2) == (n + 1) * H, "min_scan: u is [B, T, (gates + 1) * H]");
  TORCH_CHECK(gates.sizes() == at::IntArrayRef({B, T, n * H}), "min_scan: gates are [B, T, gates * H]");
  TORCH_CHECK(u.scalar_type() == gates.scalar_type() && u.scalar_type() == h0.scalar_type(),
              "min_scan: one dtype");
  if (keep) {
    TORCH_CHECK(keep->is_contiguous() && keep->scalar_type() == u.scalar_type() &&
                keep->sizes() == at::IntArrayRef({B, T}), "min_scan: keep is [B, T] of u's dtype");
  }
  return {B, T, H, n};
}

// Calls fn(b, j0, j1) for every batch row and block of channels, spread over ATen's threads. Blocks are as
// wide as the threads allow, so each time step reads long contiguous runs of every stream.
template <typename Fn>
void over_rows_and_blocks(const Shapes& s, Fn fn) {
  if (s.B == 0 || s.H == 0 || s.T == 0) {
    return;
  }
  const int64_t wanted = std::max((s.H + kMaxBlock - 1) / kMaxBlock, (at::get_num_threads() + s.B - 1) / s.B);
  const int64_t width = std::min(kMaxBlock, ((s.H + wanted - 1) / wanted + 15) / 16 * 16);
  const int64_t blocks = (s.H + width - 1) / width;
  at::parallel_for(0, s.B * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / blocks, j0 = (w % blocks) * width;
      fn(b, j0, std::min(s.H, j0 + width));
    }
  });
}

// One time step over a block of channels. Separate functions with restrict-qualified pointers: the buffers
// never overlap, and saying so lets the compiler vectorise the loops.
template <typename T>
inline void mingru_step(int64_t len, T k, const T* __restrict__ z, const T* __restrict__ cand, T* __restrict__ carry,
                     T* __restrict__ out) {
  for (int64_t j = 0; j < len; ++j) {
    carry[j] = k * (1 - z[j]) * carry[j] + z[j] * cand[j];
    out[j] = carry[j];
  }
}

template <typename T>
inline void minlstm_step(int64_t len, T k, const T* __restrict__ f, const T* __restrict__ i, const T* __restrict__ cand,
                      T* __restrict__ carry, T* __restrict__ out) {
  for (int64_t j = 0; j < len; ++j) {
    const T a = f[j] / (f[j] + i[j]);
    carry[j] = k * a * carry[j] + (1 - a) * cand[j];
    out[j] = carry[j];
  }
}

// g_t = grad_h_t + carry (what flows back into h_t from step t + 1); writes the gradients of this step's gate
// pre-activations (through the saved sigmoids) and candidate, and leaves keep_t a_t g_t in carry.
template <typename T>
inline void mingru_step_back(int64_t len, T k, const T* __restrict__ z, const T* __restrict__ cand,
                          const T* __restrict__ prev, const T* __restrict__ grad_h, T* __restrict__ carry,
                          T* __restrict__ dz, T* __restrict__ dcand) {
  for (int64_t j = 0; j < len; ++j) {
    const T gt = grad_h[j] + carry[j];
    dz[j] = gt * (cand[j] - k * prev[j]) * z[j] * (1 - z[j]);
    dcand[j] = gt * z[j];
    carry[j] = gt * k * (1 - z[j]);
  }
}

template <typename T>
inline void minlstm_step_back(int64_t len, T k, const T* __restrict__ f, const T* __restrict__ i,
                           const T* __restrict__ cand, const T* __restrict__ prev, const T* __restrict__ grad_h,
                           T* __restrict__ carry, T* __restrict__ df, T* __restrict__ di, T* __restrict__ dcand) {
  for (int64_t j = 0; j < len; ++j) {
    const T total = f[j] + i[j], inv = 1 / total, a = f[j] * inv, gt = grad_h[j] + carry[j];
    const T da = gt * (k * prev[j] - cand[j]) * inv * inv;  // d loss / d a, over (f + i)^2
    df[j] = da * i[j] * f[j] * (1 - f[j]);                   // da/df = i / (f + i)^2
    di[j] = -da * f[j] * i[j] * (1 - i[j]);                  // da/di = -f / (f + i)^2
    dcand[j] = gt * (1 - a);
    carry[j] = gt * k * a;
  }
}

Tensor min_scan_forward(const Tensor& gates, const Tensor& u, const Tensor& h0, const OptTensor& keep,
                        int64_t kind) {
  const Shapes s = check(gates, u, h0, keep, kind);
  Tensor h = at::empty({s.B, s.T, s.H}, u.options());
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "min_scan_forward", [&] {
    const scalar_t* g_p = gates.data_ptr<scalar_t>();
    const scalar_t* u_p = u.data_ptr<scalar_t>();
    const scalar_t* h0_p = h0.data_ptr<scalar_t>();
    const scalar_t* k_p = keep ? keep->data_ptr<scalar_t>() : nullptr;
    scalar_t* h_p = h.data_ptr<scalar_t>();
    over_rows_and_blocks(s, [&](int64_t b, int64_t j0, int64_t j1) {
      scalar_t carry[kMaxBlock];
      const int64_t len = j1 - j0;
      std::copy(h0_p + b * s.H + j0, h0_p + b * s.H + j1, carry);
      for (int64_t t = 0; t < s.T; ++t) {
        const int64_t row = b * s.T + t;
        const scalar_t k = k_p ? k_p[row] : scalar_t(1);
        const scalar_t* g = g_p + row * s.n_gates * s.H + j0;
        const scalar_t* cand = u_p + row * (s.n_gates + 1) * s.H + s.n_gates * s.H + j0;
        scalar_t* out = h_p + row * s.H + j0;
        if (kind == 0) {
          mingru_step(len, k, g, cand, carry, out);
        } else {
          minlstm_step(len, k, g, g + s.H, cand, carry, out);
        }
      }
    });
  });
  return h;
}

// Returns (grad of u, grad of h0). g_t = grad_h_t + keep_{t+1} a_{t+1} g_{t+1} runs backwards in time; each
// step turns g_t into the gradients of that step's gate pre-activations (through the saved sigmoids) and of
// its candidate.
std::vector<Tensor> min_scan_backward(const Tensor& grad_h, const Tensor& gates, const Tensor& u, const Tensor& h,
                                      const Tensor& h0, const OptTensor& keep, int64_t kind) {
  const Shapes s = check(gates, u, h0, keep, kind);
  const Tensor gh = grad_h.contiguous();
  TORCH_CHECK(h.is_contiguous() && gh.sizes() == h.sizes(), "min_scan_backward: h and grad_h are [B, T, H]");
  Tensor du = at::empty_like(u);
  Tensor dh0 = at::empty_like(h0);
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "min_scan_backward", [&] {
    const scalar_t* g_p = gates.data_ptr<scalar_t>();
    const scalar_t* u_p = u.data_ptr<scalar_t>();
    const scalar_t* h_p = h.data_ptr<scalar_t>();
    const scalar_t* h0_p = h0.data_ptr<scalar_t>();
    const scalar_t* gh_p = gh.data_ptr<scalar_t>();
    const scalar_t* k_p = keep ? keep->data_ptr<scalar_t>() : nullptr;
    scalar_t* du_p = du.data_ptr<scalar_t>();
    scalar_t* dh0_p = dh0.data_ptr<scalar_t>();
    const int64_t n = s.n_gates, H = s.H;
    over_rows_and_blocks(s, [&](int64_t b, int64_t j0, int64_t j1) {
      scalar_t carry[kMaxBlock];  // keep_{t+1} a_{t+1} g_{t+1}: what flows back into h_t from the step after it
      const int64_t len = j1 - j0;
      std::fill(carry, carry + len, scalar_t(0));
      for (int64_t t = s.T - 1; t >= 0; --t) {
        const int64_t row = b * s.T + t;
        const scalar_t k = k_p ? k_p[row] : scalar_t(1);
        const scalar_t* g = g_p + row * n * H + j0;
        const scalar_t* cand = u_p + row * (n + 1) * H + n * H + j0;
        const scalar_t* prev = t > 0 ? h_p + (row - 1) * H + j0 : h0_p + b * H + j0;
        const scalar_t* up = gh_p + row * H + j0;
        scalar_t* d = du_p + row * (n + 1) * H + j0;  // d[j]: first gate, d[H + j]: second, d[n H + j]: candidate
        if (kind == 0) {
          mingru_step_back(len, k, g, cand, prev, up, carry, d, d + H);
        } else {
          minlstm_step_back(len, k, g, g + H, cand, prev, up, carry, d, d + H, d + 2 * H);
        }
      }
      std::copy(carry, carry + len, dh0_p + b * H + j0);
    });
  });
  return {du, dh0};
}

}  // namespace

// Declared with their schemas and implemented for the CPU only (not as catch-all kernels): that leaves room for
// the shape rules that torch.compile's tracing needs (build.py registers them).
TORCH_LIBRARY_FRAGMENT(rpt_loops, m) {
  m.def("min_scan_forward(Tensor gates, Tensor u, Tensor h0, Tensor? keep, int kind) -> Tensor");
  m.def("min_scan_backward(Tensor grad_h, Tensor gates, Tensor u, Tensor h, Tensor h0, Tensor? keep, int kind) "
        "-> Tensor[]");
}

TORCH_LIBRARY_IMPL(rpt_loops, CPU, m) {
  m.impl("min_scan_forward", &min_scan_forward);
  m.impl("min_scan_backward", &min_scan_backward);
}
