// The recurrent product h @ W^T (+ add) of one time step when h has few rows: a matrix-vector product in all
// but name, bound by reading W from memory, which oneDNN and MKL both run below what the memory allows.
//
// oneDNN's packed product pays a fixed cost per call, and MKL's GEMM reads W well below the memory's speed at
// these shapes; this loop reads W near it (figures: benchmarks/RESULTS.md). The time loops call the product
// once a step each way, so at few rows it is about half of gru's and modlstm's forward and backward.
//
// The layout: W [N, K] is stored as ceil(N / 32) groups of 32 output columns, each group K rows of 32 numbers
// (zero past N), so that one group's products read one contiguous stretch of memory, two cache lines a row. The
// threads split the groups; each pass over a group serves three rows of h (their accumulators, three rows by four
// vectors, and the group's four vectors of W fill the 16 AVX2 registers), then a pair, then a last single row. So
// W is read once per three rows, and each read feeds 12 multiply-adds (faster than pairs; a 4 x 4 block spills
// registers). PackedLinear (rpt/kernels/cpu/products.py)
// chooses this layout only while that traffic stays small (few rows, or a W that stays in the cache), and
// oneDNN's GEMM beyond.

#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

namespace rpt_native {

using at::Tensor;
using V = at::vec::Vectorized<float>;
constexpr int64_t kGroup = 32;  // output columns per group
constexpr int64_t kVecs = kGroup / V::size();

// W [N, K] -> [ceil(N / 32), K, 32].
Tensor pack_for_small_batch(const Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_cpu(), "pack_for_small_batch: a 2-D float32 "
              "CPU weight");
  const int64_t N = w.size(0), K = w.size(1), groups = (N + kGroup - 1) / kGroup;
  Tensor padded = at::zeros({groups * kGroup, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({groups, kGroup, K}).transpose(1, 2).contiguous();
}

namespace {

// Rows [0, R) of x times the groups [g0, g1) of P, into out (+ add): R rows share each read of a group row.
template <int R>
void rows_times_groups(const float* x, const float* P, const float* add, int64_t ld_add, float* out, int64_t N,
                       int64_t K, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    V acc[R][kVecs];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < kVecs; ++v) {
        acc[r][v] = V(0);
      }
    }
    const float* p = P + g * K * kGroup;
    for (int64_t k = 0; k < K; ++k, p += kGroup) {
      V w[kVecs];
      for (int v = 0; v < kVecs; ++v) {
        w[v] = V::loadu(p + v * V::size());
      }
      for (int r = 0; r < R; ++r) {
        const V xr(x[r * K + k]);
        for (int v = 0; v < kVecs; ++v) {
          acc[r][v] = at::vec::fmadd(xr, w[v], acc[r][v]);
        }
      }
    }
    const int64_t n0 = g * kGroup, cols = std::min(kGroup, N - n0);
    for (int r = 0; r < R; ++r) {
      float sums[kGroup];
      for (int v = 0; v < kVecs; ++v) {
        acc[r][v].store(sums + v * V::size());
      }
      float* o = out + r * N + n0;
      const float* a = add ? add + r * ld_add + n0 : nullptr;
      for (int64_t j = 0; j < cols; ++j) {
        o[j] = a ? sums[j] + a[j] : sums[j];
      }
    }
  }
}

}  // namespace

// Rows [0, B) of x [B, K] times the groups [g0, g1) of P into out [B, N] (+ add, rows ld_add apart; null: none):
// one thread's share of small_batch_product, for the time loops that split the groups over threads themselves.
void small_batch_groups(const float* x, int64_t B, const float* P, const float* add, int64_t ld_add, float* out,
                        int64_t N, int64_t K, int64_t g0, int64_t g1) {
  for (int64_t b = 0; b < B;) {
    const float* a = add ? add + b * ld_add : nullptr;
    if (B - b >= 3) {
      rows_times_groups<3>(x + b * K, P, a, ld_add, out + b * N, N, K, g0, g1);
      b += 3;
    } else if (B - b == 2) {
      rows_times_groups<2>(x + b * K, P, a, ld_add, out + b * N, N, K, g0, g1);
      b += 2;
    } else {
      rows_times_groups<1>(x + b * K, P, a, ld_add, out + b * N, N, K, g0, g1);
      b += 1;
    }
  }
}

// x [B, K] @ W^T (+ add [B, N]) with W as pack_for_small_batch left it; N: W's rows (the output's width).
Tensor small_batch_product(const Tensor& x_in, const Tensor& P, int64_t N, const std::optional<Tensor>& add_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && P.dim() == 3 && P.size(1) == x_in.size(1) &&
                  P.size(2) == kGroup && P.size(0) * kGroup >= N && P.is_contiguous(),
              "small_batch_product: x [B, K] float32 and W packed by pack_for_small_batch");
  const Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), K = x.size(1), groups = P.size(0);
  std::optional<Tensor> add;
  if (add_in) {
    add = add_in->reshape({B, N});
    if (add->stride(1) != 1) {
      add = add->contiguous();
    }
  }
  Tensor out = at::empty({B, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = P.data_ptr<float>();
  const float* ap = add ? add->data_ptr<float>() : nullptr;
  const int64_t ld_add = add ? add->stride(0) : 0;
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (K * kGroup * 4));  // at least 64 KB of W a task
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    small_batch_groups(xp, B, pp, ap, ld_add, op, N, K, g0, g1);
  });
  return out;
}

}  // namespace rpt_native

TORCH_LIBRARY(rpt_loops, m) {  // the one definition of the namespace; each recurrence adds its fragment
  m.def("pack_for_small_batch", &rpt_native::pack_for_small_batch);
  m.def("small_batch_product", &rpt_native::small_batch_product);
}
