// The time loops at few rows: PackedLinear's small-batch layout (float32) with the steps fused, on the CPU. The whole
// sequence runs in one parallel region: each step, every thread computes its share of the product (groups of W's
// columns: small_batch_groups), waits for the others, computes its share of the pointwise part (columns of every
// row; the gate norm, a phase of its own: rows of its share of the gates), and waits again. Calling the product
// each step instead (small_batch_product's at::parallel_for) left the second thread idle through the pointwise
// part and paid a fork and ATen's per-call costs every step (benchmarks/RESULTS.md). Without OpenMP (or inside a parallel region already) one
// thread runs it all. A race here shows as a wrong number: test_native_loops.py runs these on 2 threads.
#pragma once

#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "step_passes.h"

namespace rpt_native {

void small_batch_groups(const float* x, int64_t B, const float* P, const float* add, int64_t ld_add, float* out,
                        int64_t N, int64_t K, int64_t g0, int64_t g1);  // small_batch_product.cpp

namespace threaded {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using namespace rpt_native::steps;

// body(thread, threads) once on each of torch's intra-op threads, in one parallel region.
template <typename Body>
void on_each_thread(const Body& body) {
#ifdef _OPENMP
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(threads)
  body(omp_get_thread_num(), omp_get_num_threads());
#else
  body(0, 1);
#endif
}

inline void wait_for_all() {
#ifdef _OPENMP
#pragma omp barrier
#endif
}

// Thread k's share [lo, hi) of [0, n), in whole units (but the last share's end).
inline std::pair<int64_t, int64_t> share(int64_t n, int64_t unit, int k, int threads) {
  const int64_t units = (n + unit - 1) / unit;
  return {std::min(n, units * k / threads * unit), std::min(n, units * (k + 1) / threads * unit)};
}

// dst[b, j0:j1] = src[b, j0:j1] * keep[b] (keep null: 1) over the B rows of [B, H] buffers.
inline void scaled_rows(const float* src, const float* keep, float* dst, int64_t B, int64_t H, int64_t j0,
                        int64_t j1) {
  for (int64_t b = 0; b < B; ++b) {
    const float k = keep ? keep[b] : 1.0f;
    for (int64_t j = j0; j < j1; ++j) {
      dst[b * H + j] = src[b * H + j] * k;
    }
  }
}

// A [B, H] state as the first step reads it: after that step's reset, in a buffer of its own.
inline Tensor first_read(const Tensor& state, const OptTensor& keep) {
  return keep ? (state * keep->select(0, 0).unsqueeze(1)).contiguous() : state.contiguous().clone();
}

// The backward loops at few rows (as above, float32 only): for t = T-1 .. 0, each thread runs pointwise(t, j0, j1,
// dh_keep) on its columns of every row; where G > 0, after a barrier, by_gates(t, q0, q1, thread) on its share of
// the G gates; then, after a barrier, its share of dh = dQ[t] @ W (+ add[B, H]), dQ: [T, B, K]. dh_keep: the keep
// of the reset before step t + 1, which dh (step t + 1's product) has not had yet; dh leaves with the first step's.
// dh: contiguous [B, H], the gradient of the last h on entry.
template <typename scalar_t, typename Pointwise, typename ByGates>
void backward_steps_threaded(const Pointwise& pointwise, const ByGates& by_gates, int64_t G, const Tensor& dQ,
                             const Tensor& wT, const OptTensor& add, const Tensor& keep, Tensor& dh) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    const int64_t T = dQ.size(0), B = dQ.size(1), K = dQ.size(2), H = dh.size(1);
    const float *WT = wT.data_ptr<float>(), *dq = dQ.data_ptr<float>();
    const float* kp = keep.defined() ? keep.data_ptr<float>() : nullptr;
    const float* ap = add ? add->data_ptr<float>() : nullptr;
    float* dh_p = dh.data_ptr<float>();
    on_each_thread([&](int k, int threads) {
      const auto [j0, j1] = share(H, Vec<float>::size(), k, threads);
      const auto [g0, g1] = share(wT.size(0), 1, k, threads);
      const auto [q0, q1] = share(G, 1, k, threads);
      for (int64_t t = T - 1; t >= 0; --t) {
        pointwise(t, j0, j1, kp && t + 1 < T ? kp + (t + 1) * B : nullptr);
        wait_for_all();
        if (G > 0) {
          by_gates(t, q0, q1, k);
          wait_for_all();
        }
        rpt_native::small_batch_groups(dq + t * B * K, B, WT, ap, H, dh_p, H, K, g0, g1);
        wait_for_all();
      }
    });
    if (kp) {
      dh.mul_(keep.select(0, 0).view({B, 1}));
    }
  } else {
    TORCH_CHECK(false, "backward_steps_threaded: the small-batch product is float32's");
  }
}

}  // namespace threaded
}  // namespace rpt_native
