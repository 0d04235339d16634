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

// modlstm_forward's loop at few rows (above); gate as for modlstm_forward (recurrent_loops.cpp). With the gate norm,
// a third phase between the two: each thread normalises the rows of its share of the gates.
inline std::vector<Tensor> modlstm_forward_threaded(const Tensor& XP, const Tensor& w, const OptTensor& keep,
                                             const Tensor& h0, const Tensor& c0, const OptTensor& n0,
                                             const OptTensor& m0, const Tensor& acts, const OptTensor& pre,
                                             const Tensor& cs, const Tensor& hs, const OptTensor& ns,
                                             const OptTensor& ln_in, const OptTensor& ln_stats,
                                             const OptTensor& ln_w, const OptTensor& ln_b, const OptTensor& peep,
                                             int64_t gate, bool coupled) {
  const int64_t T = acts.size(0), B = acts.size(1), G = acts.size(2), H = acts.size(3), N = G * H;
  const bool exp_gate = gate < 0;
  // The state the next step reads, after its reset: h (the product's input), c, and n, m for the exponential gate.
  Tensor h = first_read(h0, keep), c = first_read(c0, keep);
  Tensor n = exp_gate ? first_read(*n0, keep) : Tensor(), m = exp_gate ? first_read(*m0, keep) : Tensor();
  Tensor P = at::empty({B, N}, acts.options()), peep_c = peep ? peep->contiguous() : Tensor();
  const Tensor ln_w_c = ln_w ? ln_w->contiguous() : Tensor(), ln_b_c = ln_w ? ln_b->contiguous() : Tensor();
  const float* W = w.data_ptr<float>();
  const float* xp = XP.data_ptr<float>();
  const float* kp = keep ? keep->data_ptr<float>() : nullptr;
  const float* pp = peep ? peep_c.data_ptr<float>() : nullptr;
  float *Pp = P.data_ptr<float>(), *hp = h.data_ptr<float>(), *cp = c.data_ptr<float>();
  float *np = exp_gate ? n.data_ptr<float>() : nullptr, *mp = exp_gate ? m.data_ptr<float>() : nullptr;
  float *a_all = acts.data_ptr<float>(), *c_all = cs.data_ptr<float>(), *h_all = hs.data_ptr<float>();
  float* n_all = exp_gate ? ns->data_ptr<float>() : nullptr;
  float* pre_all = pre ? pre->data_ptr<float>() : nullptr;
  float* ln_in_all = ln_w ? ln_in->data_ptr<float>() : nullptr;
  float* stats_all = ln_w ? ln_stats->data_ptr<float>() : nullptr;
  const float *ln_w_p = ln_w ? ln_w_c.data_ptr<float>() : nullptr, *ln_b_p = ln_w ? ln_b_c.data_ptr<float>() : nullptr;
  on_each_thread([&](int k, int threads) {
    const auto [g0, g1] = share(w.size(0), 1, k, threads);
    const auto [j0, j1] = share(H, Vec<float>::size(), k, threads);
    const auto [q0, q1] = share(G, 1, k, threads);  // gates, for the norm's rows
    for (int64_t t = 0; t < T; ++t) {
      rpt_native::small_batch_groups(hp, B, W, xp + t * B * N, N, Pp, N, H, g0, g1);
      wait_for_all();
      if (ln_in_all) {
        float* stats = stats_all + t * 2 * B * G;
        gate_norm_step(Pp, ln_in_all + t * B * N, stats, stats + B * G, ln_w_p, ln_b_p, Pp, B, G, H, q0, q1);
        wait_for_all();
      }
      float *c_out = c_all + t * B * H, *h_out = h_all + t * B * H;
      const float* k_next = kp && t + 1 < T ? kp + (t + 1) * B : nullptr;
      if (exp_gate) {
        float* n_out = n_all + t * B * H;
        modlstm_exp_step(Pp, a_all + t * B * N, cp, np, mp, c_out, n_out, mp, h_out, B, H, j0, j1);
        scaled_rows(n_out, k_next, np, B, H, j0, j1);
        scaled_rows(mp, k_next, mp, B, H, j0, j1);
      } else {
        modlstm_sigmoid_step(Pp, a_all + t * B * N, cp, pp, c_out, h_out, pre_all ? pre_all + t * B * N : nullptr, B,
                             G, H, gate, coupled, j0, j1);
      }
      scaled_rows(c_out, k_next, cp, B, H, j0, j1);
      scaled_rows(h_out, k_next, hp, B, H, j0, j1);
      wait_for_all();
    }
  });
  const Tensor h_last = hs.select(0, T - 1), c_last = cs.select(0, T - 1);
  if (exp_gate) {
    return {h_last, c_last, ns->select(0, T - 1), m};
  }
  return {h_last, c_last};
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

// gru_forward's loop at few rows (as modlstm's above).
inline Tensor gru_forward_threaded(const Tensor& XP, const Tensor& w, const Tensor& bias, const OptTensor& keep,
                            const Tensor& h0, const Tensor& HP, const Tensor& gates, const Tensor& hs) {
  const int64_t T = gates.size(0), B = gates.size(1), H = gates.size(3), N = 3 * H;
  Tensor h = first_read(h0, keep), bias_rows = bias.expand({B, N}).contiguous();
  const float *W = w.data_ptr<float>(), *xp = XP.data_ptr<float>(), *b_hh = bias_rows.data_ptr<float>();
  const float* kp = keep ? keep->data_ptr<float>() : nullptr;
  float *hp = h.data_ptr<float>(), *HP_all = HP.data_ptr<float>(), *g_all = gates.data_ptr<float>();
  float* h_all = hs.data_ptr<float>();
  on_each_thread([&](int k, int threads) {
    const auto [g0, g1] = share(w.size(0), 1, k, threads);
    const auto [j0, j1] = share(H, Vec<float>::size(), k, threads);
    for (int64_t t = 0; t < T; ++t) {
      rpt_native::small_batch_groups(hp, B, W, b_hh, N, HP_all + t * B * N, N, H, g0, g1);
      wait_for_all();
      float* h_out = h_all + t * B * H;
      gru_step(xp + t * B * N, HP_all + t * B * N, hp, g_all + t * B * N, h_out, B, H, j0, j1);
      scaled_rows(h_out, kp && t + 1 < T ? kp + (t + 1) * B : nullptr, hp, B, H, j0, j1);
      wait_for_all();
    }
  });
  return hs.select(0, T - 1);
}

}  // namespace threaded
}  // namespace rpt_native
