// gru's time loops (the fused kernel of sequence.py: gru_sequence and its backward),
// step for step the Python loops of loops.py beside this file on the same buffers, called from C++ instead of Python
// (on the CPU each step's elementwise part as one pass: gru_steps.h; elsewhere the same ATen ops). At few rows
// each loop runs in one parallel region instead (threaded_loops.h, and gru_forward_threaded below).
// Why this file exists, and how it is built: rpt/kernels/cpu/build.py. The Python loop is the readable form; a
// change there is made here too, and tests/ops/test_native_loops.py holds the two equal.
//
// Buffers are time-major ([T, B, ...]); every step writes its slice of the caller's buffers in place.
// build.py builds with AVX2 (CPU_CAPABILITY=AVX2) where the CPU has it; elsewhere ATen's vector type
// is its portable one.

#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#endif

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <vector>

#include "project.h"
#include "threaded_loops.h"
#include "gru_steps.h"

namespace rpt_native::threaded {

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

}  // namespace rpt_native::threaded

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using rpt_native::project;             // each step's product
using namespace rpt_native::steps;     // each step's elementwise pass
using namespace rpt_native::threaded;  // the loops at few rows

// gru_sequence's forward loop; fills HP (h W_hh^T + b_hh), gates (r, z, n) and hs. Returns the last h.
// `fuse`: as for modlstm_forward.
Tensor gru_forward(const Tensor& XP, const Tensor& w, int64_t layout, const Tensor& bias, const OptTensor& keep,
                   Tensor h, const Tensor& HP, const Tensor& gates, const Tensor& hs, bool fuse) {
  const int64_t T = gates.size(0), B = gates.size(1), H = gates.size(3);
  const bool fused = fuse && gates.is_cpu() && XP.is_contiguous() && HP.is_contiguous() && gates.is_contiguous() &&
                     hs.is_contiguous();
  if (fused && layout == 2 && gates.scalar_type() == at::kFloat && T > 0 && (!keep || keep->is_contiguous())) {
    return gru_forward_threaded(XP, w, bias, keep, h, HP, gates, hs);
  }
  for (int64_t t = 0; t < T; ++t) {
    if (keep) {
      h = h * keep->select(0, t).unsqueeze(1);
    }
    Tensor xp = XP.select(0, t), hp = HP.select(0, t), g = gates.select(0, t), out = hs.select(0, t);
    hp.copy_(project(h, bias, w, layout, 3 * H).view({B, 3, H}));
    if (fused) {  // the three lines below in one pass
      h = h.contiguous();
      AT_DISPATCH_FLOATING_TYPES(XP.scalar_type(), "gru_forward", [&] {
        gru_step(xp.data_ptr<scalar_t>(), hp.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(),
                 out.data_ptr<scalar_t>(), B, H, 0, H);
      });
      h = out;
      continue;
    }
    Tensor rz = g.slice(1, 0, 2), n = g.select(1, 2);
    at::sigmoid_out(rz, xp.slice(1, 0, 2) + hp.slice(1, 0, 2));
    at::tanh_out(n, at::addcmul(xp.select(1, 2), g.select(1, 0), hp.select(1, 2)));
    h = at::addcmul_out(out, n, g.select(1, 1), h - n);
  }
  return h;
}

// gru_sequence_backward's loop; fills dXP and dHP. Returns the gradient of the initial h. CPU only (gru's GPU
// path is cuDNN). The Python loop (backward_steps in loops.py) reads factors K precomputed for all steps at once,
// which suits ATen; here each step derives them from the saved gates in its one pass, which reads less memory
// than the precomputed factors would and skips the passes that make them:
//   dpre_r = dh K_r, dpre_z = dh K_z, dpre_n = dh K_n (the h-projection's n part: dh K_n r), dh_prev = dh z + ...
//   K_n = (1 - z)(1 - n^2), K_z = (h_{t-1} - n) z (1 - z), K_r = K_n hp_n r (1 - r).
Tensor gru_backward(const Tensor& grad_y, const Tensor& gates, const Tensor& HP, const Tensor& h_prev,
                    const Tensor& dXP, const Tensor& dHP, const OptTensor& keep3, const Tensor& wT, int64_t layout,
                    Tensor dh) {
  const int64_t T = dXP.size(0), B = dXP.size(1), H = dXP.size(3);
  TORCH_CHECK(dXP.is_cpu(), "gru_backward: CPU tensors only");
  TORCH_CHECK(dXP.is_contiguous() && dHP.is_contiguous() && gates.is_contiguous() && HP.is_contiguous(),
              "gru_backward: gates, HP, dXP and dHP must be contiguous");
  const Tensor gy_all = grad_y.contiguous(), hp_all = h_prev.contiguous();
  dh = dh.contiguous().clone();
  Tensor dh_z = at::empty_like(dh);
  const Tensor keep_c = keep3 ? keep3->contiguous() : Tensor();
  AT_DISPATCH_FLOATING_TYPES(dXP.scalar_type(), "gru_backward", [&] {
    using V = Vec<scalar_t>;
    // Step t's pointwise part on the columns [j0, j1) of every row (dh_keep: as in modlstm_backward_cpu).
    auto pointwise = [&](int64_t t, int64_t j0, int64_t j1, const scalar_t* dh_keep) {
      const int64_t off = t * B * H, off3 = t * B * 3 * H;
      scalar_t* dh_p = dh.data_ptr<scalar_t>();
      scalar_t* dhz_p = dh_z.data_ptr<scalar_t>();
      scalar_t* dxp_p = dXP.data_ptr<scalar_t>() + off3;
      scalar_t* dhp_p = dHP.data_ptr<scalar_t>() + off3;
      const scalar_t* gy = gy_all.data_ptr<scalar_t>() + off;
      const scalar_t* prev = hp_all.data_ptr<scalar_t>() + off;
      const scalar_t* g = gates.data_ptr<scalar_t>() + off3;
      const scalar_t* hp = HP.data_ptr<scalar_t>() + off3;
      const V one(1);
      for (int64_t b = 0; b < B; ++b) {
        const V dhk(dh_keep ? dh_keep[b] : scalar_t(1));
        for (int64_t j = j0; j < j1; j += V::size()) {
          const int n = static_cast<int>(std::min<int64_t>(V::size(), j1 - j));
          const int64_t i = b * H + j, at_r = b * 3 * H + j, at_z = at_r + H, at_n = at_r + 2 * H;
          const V r = V::loadu(g + at_r, n), z = V::loadu(g + at_z, n), nn = V::loadu(g + at_n, n);
          const V dh_v = V::loadu(dh_p + i, n) * dhk + V::loadu(gy + i, n);
          const V d_n = dh_v * (one - z) * (one - nn * nn);
          const V d_z = dh_v * (V::loadu(prev + i, n) - nn) * z * (one - z);
          const V d_r = d_n * V::loadu(hp + at_n, n) * r * (one - r);
          d_r.store(dxp_p + at_r, n);
          d_z.store(dxp_p + at_z, n);
          d_n.store(dxp_p + at_n, n);
          d_r.store(dhp_p + at_r, n);
          d_z.store(dhp_p + at_z, n);
          (d_n * r).store(dhp_p + at_n, n);
          (dh_v * z).store(dhz_p + i, n);
        }
      }
    };
    if (layout == 2 && dXP.scalar_type() == at::kFloat && T > 0) {
      backward_steps_threaded<scalar_t>(pointwise, [](int64_t, int64_t, int64_t, int) {}, 0, dHP.view({T, B, 3 * H}),
                                        wT, dh_z, keep_c, dh);
      return;
    }
    for (int64_t t = T - 1; t >= 0; --t) {
      pointwise(t, 0, H, nullptr);
      Tensor dh_prev = project(dHP.select(0, t).view({B, 3 * H}), dh_z, wT, layout, H);
      dh.copy_(keep3 ? dh_prev * keep_c.select(0, t) : dh_prev);
    }
  });
  return dh;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rpt_loops, m) {
  m.def("gru_forward", &gru_forward);
  m.def("gru_backward", &gru_backward);
}
