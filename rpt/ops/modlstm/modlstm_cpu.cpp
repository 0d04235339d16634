// modlstm's time loops (the fused kernel of sequence.py: modlstm_sequence and its backward),
// step for step the Python loops of loops.py beside this file on the same buffers, called from C++ instead of Python
// (on the CPU each step's elementwise part as one pass: modlstm_steps.h; elsewhere the same ATen ops). At few rows
// each loop runs in one parallel region instead (threaded_loops.h, and modlstm_forward_threaded below).
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
#include "modlstm_steps.h"

namespace rpt_native::threaded {

// modlstm_forward's loop at few rows (above); gate as for modlstm_forward (below). With the gate norm,
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

}  // namespace rpt_native::threaded

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using rpt_native::project;             // each step's product
using namespace rpt_native::steps;     // each step's elementwise pass
using namespace rpt_native::threaded;  // the loops at few rows

// modlstm_sequence's forward loop (sequence.py).
// gate: -1 the stabilised exponential gate, 0 sigmoid, 1 hard sigmoid
// (clamp(x / 6 + 0.5, 0, 1), as registered in rpt/models/registry.py). Returns the state after the last step:
// (h, c), or (h, c, n, m) for the exponential gate. `fuse`: on the CPU, run each step's pointwise part as one pass
// (the backend's Form.NATIVE turns it off, so that the tests check the ATen form a GPU runs).
std::vector<Tensor> modlstm_forward(
    const Tensor& XP, const Tensor& w, int64_t layout, const OptTensor& keep, Tensor h, Tensor c, OptTensor n_in,
    OptTensor m_in, const Tensor& acts, const OptTensor& pre, const Tensor& cs, const Tensor& hs,
    const OptTensor& ns, const OptTensor& ln_in, const OptTensor& ln_stats, const OptTensor& ln_w,
    const OptTensor& ln_b, const OptTensor& peep, int64_t gate, bool coupled, bool fuse) {
  const int64_t T = acts.size(0), B = acts.size(1), G = acts.size(2), H = acts.size(3);
  const bool exp_gate = gate < 0;
  const bool fused = fuse && acts.is_cpu();  // elsewhere (CUDA) the step as ATen ops
  const int64_t n_dc = G - 1;            // gates driven by dc: (i, f, z) or (f, z); the output gate is last
  const int64_t f_index = coupled ? 0 : 1;
  TORCH_CHECK(!(fused && ln_w) || (ln_in->is_contiguous() && ln_stats->is_contiguous()),
              "modlstm_forward: ln_in and ln_stats must be contiguous");
  const bool threaded = fused && layout == 2 && acts.scalar_type() == at::kFloat && T > 0 &&
                        XP.is_contiguous() && acts.is_contiguous() && cs.is_contiguous() && hs.is_contiguous() &&
                        (!ns || ns->is_contiguous()) && (!keep || keep->is_contiguous()) &&
                        (!pre || pre->is_contiguous()) &&
                        (!ln_w || (ln_in->is_contiguous() && ln_stats->is_contiguous()));
  if (threaded) {
    return modlstm_forward_threaded(XP, w, keep, h, c, n_in, m_in, acts, pre, cs, hs, ns, ln_in, ln_stats, ln_w,
                                    ln_b, peep, gate, coupled);
  }
  Tensor n = exp_gate ? *n_in : Tensor(), m = exp_gate ? *m_in : Tensor();
  for (int64_t t = 0; t < T; ++t) {
    if (keep) {
      Tensor kt = keep->select(0, t).unsqueeze(1);
      h = h * kt;
      c = c * kt;
      if (exp_gate) {
        n = n * kt;
        m = m * kt;
      }
    }
    Tensor P = project(h, XP.select(0, t), w, layout, G * H).view({B, G, H});
    if (ln_w && fused) {  // the "else" below in one pass
      Tensor normed = at::empty_like(P), Pc = P.contiguous(), w_c = ln_w->contiguous(), b_c = ln_b->contiguous();
      AT_DISPATCH_FLOATING_TYPES(P.scalar_type(), "modlstm_gate_norm", [&] {
        scalar_t* stats = ln_stats->data_ptr<scalar_t>() + t * 2 * B * G;
        gate_norm_step(Pc.data_ptr<scalar_t>(), ln_in->data_ptr<scalar_t>() + t * B * G * H, stats, stats + B * G,
                       w_c.data_ptr<scalar_t>(), b_c.data_ptr<scalar_t>(), normed.data_ptr<scalar_t>(), B, G, H, 0, G);
      });
      P = normed;
    } else if (ln_w) {
      ln_in->select(0, t).copy_(P);
      auto [y, mean, rstd] = at::native_layer_norm(P, {H}, std::nullopt, std::nullopt, kLayerNormEps);
      ln_stats->select(0, t).select(0, 0).copy_(mean);
      ln_stats->select(0, t).select(0, 1).copy_(rstd);
      P = at::addcmul(*ln_b, y, *ln_w);
    }
    Tensor a = acts.select(0, t), c_out = cs.select(0, t), h_out = hs.select(0, t);
    if (exp_gate && fused) {  // the "else" below in one pass
      Tensor n_out = ns->select(0, t), m_next = at::empty_like(m), Pc = P.contiguous();
      c = c.contiguous(), n = n.contiguous(), m = m.contiguous();
      AT_DISPATCH_FLOATING_TYPES(P.scalar_type(), "modlstm_forward_exp", [&] {
        modlstm_exp_step(Pc.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(),
                         n.data_ptr<scalar_t>(), m.data_ptr<scalar_t>(), c_out.data_ptr<scalar_t>(),
                         n_out.data_ptr<scalar_t>(), m_next.data_ptr<scalar_t>(), h_out.data_ptr<scalar_t>(), B, H,
                         0, H);
      });
      c = c_out, n = n_out, m = m_next, h = h_out;
      continue;
    }
    if (fused && !exp_gate) {  // the "else" below for the sigmoid family, in one pass
      Tensor Pc = P.contiguous();
      c = c.contiguous();
      Tensor pc = peep ? peep->contiguous() : Tensor();
      AT_DISPATCH_FLOATING_TYPES(P.scalar_type(), "modlstm_forward_sigmoid", [&] {
        modlstm_sigmoid_step(Pc.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(),
                             peep ? pc.data_ptr<scalar_t>() : nullptr, c_out.data_ptr<scalar_t>(),
                             h_out.data_ptr<scalar_t>(), pre ? pre->data_ptr<scalar_t>() + t * B * G * H : nullptr,
                             B, G, H, gate, coupled, 0, H);
      });
      c = c_out, h = h_out;
      continue;
    }
    if (exp_gate) {
      Tensor P_i = P.select(1, 0), P_f = P.select(1, 1), P_z = P.select(1, 2), P_o = P.select(1, 3);
      Tensor a_i = a.select(1, 0), a_f = a.select(1, 1), a_z = a.select(1, 2), a_o = a.select(1, 3);
      Tensor m_prev = at::where(n > 0, m, at::full_like(m, -std::numeric_limits<double>::infinity()));
      m = at::maximum(P_f + m_prev, P_i);
      at::exp_out(a_i, P_i - m);
      at::exp_out(a_f, P_f + m_prev - m);
      at::tanh_out(a_z, P_z);
      at::sigmoid_out(a_o, P_o);
      Tensor n_out = ns->select(0, t);
      c = at::addcmul_out(c_out, a_f * c, a_i, a_z);
      n = at::addcmul_out(n_out, a_i, a_f, n);
      h = at::mul_out(h_out, a_o, c / n);
      continue;
    }
    if (peep) {  // i (and f) read c_{t-1}
      P.slice(1, 0, n_dc - 1).add_(peep->slice(0, 0, G - 2) * c.unsqueeze(1));
    }
    Tensor gate_in = P.slice(1, 0, n_dc - 1), gate_out = a.slice(1, 0, n_dc - 1);
    if (gate == 0) {
      at::sigmoid_out(gate_out, gate_in);
    } else {
      gate_out.copy_(at::clamp(gate_in / 6 + 0.5, 0.0, 1.0));
    }
    Tensor a_z = a.select(1, n_dc - 1);
    at::tanh_out(a_z, P.select(1, n_dc - 1));
    Tensor a_f = a.select(1, f_index);
    Tensor a_i = coupled ? 1 - a_f : a.select(1, 0);
    c = at::addcmul_out(c_out, a_f * c, a_i, a_z);
    if (peep) {
      P.select(1, G - 1).add_(peep->select(0, G - 2) * c);
    }
    Tensor a_o = a.select(1, G - 1);
    at::sigmoid_out(a_o, P.select(1, G - 1));
    h = at::mul_out(h_out, a_o, at::tanh(c));
    if (pre) {
      pre->select(0, t).copy_(P);
    }
  }
  if (exp_gate) {  // views of the buffers: modlstm_sequence copies them
    return {h, c, n, m};
  }
  return {h, c};
}

// modlstm_sequence_backward's loop over factors K_* precomputed for all steps (backward_factors in loops.py), as
// ATen ops: what a GPU runs (modlstm_backward_cpu below is the CPU's). Fills dP (and dP_raw under gate norm).
// Returns the gradients of the initial state: (dh, dc), or (dh, dc, dn) for the exponential gate.
std::vector<Tensor> modlstm_backward(
    const Tensor& grad_y, const Tensor& K_c, const Tensor& K_o, const Tensor& K_dc, const Tensor& K_cc,
    const OptTensor& K_n, const OptTensor& K_dn, const Tensor& dP, const Tensor& dP_raw, const OptTensor& keep3,
    const Tensor& wT, int64_t layout, Tensor dh, Tensor dc, OptTensor dn_in, const OptTensor& ln_w,
    const OptTensor& ln_in, const OptTensor& ln_stats) {
  const int64_t T = dP.size(0), B = dP.size(1), G = dP.size(2), H = dP.size(3);
  const bool exp_gate = K_n.has_value();
  Tensor dn = exp_gate ? *dn_in : Tensor();
  for (int64_t t = T - 1; t >= 0; --t) {
    Tensor dp = dP.select(0, t), dp_raw = dP_raw.select(0, t);
    dh = dh + grad_y.select(0, t);
    dc = at::addcmul(dc, dh, K_c.select(0, t));
    Tensor dp_o = dp.select(1, G - 1), dp_dc = dp.slice(1, 0, G - 1);
    at::mul_out(dp_o, dh, K_o.select(0, t));
    at::mul_out(dp_dc, dc.unsqueeze(1), K_dc.select(0, t));
    if (exp_gate) {
      dn = at::addcmul(dn, dh, K_n->select(0, t));
      dp.slice(1, 0, 2).addcmul_(dn.unsqueeze(1), K_dn->select(0, t));
      dn = dn * K_cc.select(0, t);
    }
    if (ln_w) {
      Tensor in_t = ln_in->select(0, t), stats = ln_stats->select(0, t);
      dp_raw.copy_(std::get<0>(at::native_layer_norm_backward(
          dp * *ln_w, in_t, {H}, stats.select(0, 0), stats.select(0, 1), std::nullopt, std::nullopt,
          {true, false, false})));
    }
    dc = dc * K_cc.select(0, t);
    dh = project(dp_raw.view({B, G * H}), std::nullopt, wT, layout, H);
    if (keep3) {
      dh = dh * keep3->select(0, t);
    }
  }
  if (exp_gate) {
    return {dh, dc, dn};
  }
  return {dh, dc};
}

// modlstm_sequence_backward's loop on the CPU, each step's pointwise part in one pass. Where modlstm_backward reads
// factors precomputed for all steps, this pass derives each step's from what the forward saved: the gates (acts),
// the gate inputs (pre: the hard sigmoid's derivative needs them), the cell states (cs, c0 before the first step)
// and the normalisers (ns, n0); it reads less memory than the factors would fill and skips the passes that make
// them. With u' the gate's derivative at its output and c_prev, n_prev the state the step read (after its reset):
//   sigmoid family: K_o = tanh(c) o (1 - o), K_c = o (1 - tanh(c)^2) + K_o p_o, K_z = i (1 - z^2),
//     K_i = z i', K_f = c_prev f' (coupled: (c_prev - z) f'), K_cc = f + K_i p_i + K_f p_f (peepholes: p_*)
//   exponential: h^ = c / n, K_o = h^ o (1 - o), K_c = o / n, K_n = -o h^ / n, K_i = z i, K_f = c_prev f,
//     K_z = i (1 - z^2), dn reaching (i, f): (i, n_prev f), K_cc = f
// gate: as for modlstm_forward. The gradients of the peepholes and of the gate norm's weight and bias are summed
// here too, into peep_grad ([G - 1, H]), ln_w_grad and ln_b_grad ([G, H]), zeros on entry: each step's share,
// dP times c or x_hat, is made while dP is in the cache.
// Returns the gradients of the initial state: (dh, dc), or (dh, dc, dn).
std::vector<Tensor> modlstm_backward_cpu(
    const Tensor& grad_y, const Tensor& acts, const OptTensor& pre, const Tensor& cs, const OptTensor& ns,
    const Tensor& c0, const OptTensor& n0, const OptTensor& keep, const OptTensor& peep, const Tensor& dP,
    const Tensor& dP_raw, const Tensor& wT, int64_t layout, Tensor dh, Tensor dc, OptTensor dn_in,
    const OptTensor& ln_w, const OptTensor& ln_in, const OptTensor& ln_stats, int64_t gate, bool coupled,
    const OptTensor& ln_w_grad, const OptTensor& ln_b_grad, const OptTensor& peep_grad) {
  const int64_t T = dP.size(0), B = dP.size(1), G = dP.size(2), H = dP.size(3);
  const bool exp_gate = gate < 0;
  TORCH_CHECK(dP.is_cpu(), "modlstm_backward_cpu: CPU tensors only");
  TORCH_CHECK(dP.is_contiguous() && dP_raw.is_contiguous() && acts.is_contiguous() && cs.is_contiguous() &&
                  (!pre || pre->is_contiguous()) && (!ns || ns->is_contiguous()),
              "modlstm_backward_cpu: acts, pre, cs, ns, dP and dP_raw must be contiguous");
  TORCH_CHECK((!ln_w || (ln_w_grad && ln_b_grad && ln_w_grad->is_contiguous() && ln_b_grad->is_contiguous())) &&
                  (!peep || (peep_grad && peep_grad->is_contiguous())),
              "modlstm_backward_cpu: contiguous gradient sums for the gate norm's parameters and the peepholes");
  const Tensor gy_all = grad_y.contiguous(), c0_c = c0.contiguous();
  const Tensor n0_c = exp_gate ? n0->contiguous() : Tensor(), keep_c = keep ? keep->contiguous() : Tensor();
  const Tensor peep_c = peep ? peep->contiguous() : Tensor();
  Tensor ln_in_c, ln_stats_c, ln_w_c, ln_scratch;
  if (ln_w) {
    ln_in_c = ln_in->contiguous(), ln_stats_c = ln_stats->contiguous(), ln_w_c = ln_w->contiguous();
    ln_scratch = at::empty({at::get_num_threads(), 2 * H}, dP.options());  // one row a thread
  }
  dh = dh.contiguous().clone(), dc = dc.contiguous().clone();
  Tensor dn = exp_gate ? dn_in->contiguous().clone() : Tensor();
  const int64_t f_at = coupled ? 0 : H, z_at = (G - 2) * H, o_at = (G - 1) * H;
  const bool threaded = layout == 2 && dP.scalar_type() == at::kFloat && T > 0;
  AT_DISPATCH_FLOATING_TYPES(dP.scalar_type(), "modlstm_backward_cpu", [&] {
    using V = Vec<scalar_t>;
    const int64_t BH = B * H;
    // Step t's pointwise part on the columns [j0, j1) of every row; dh_keep: the rows' keep of the reset before
    // step t + 1, which dh (the product's output from step t + 1) has not had yet (null: none, or applied).
    auto pointwise = [&](int64_t t, int64_t j0, int64_t j1, const scalar_t* dh_keep) {
      scalar_t* dp_p = dP.data_ptr<scalar_t>() + t * B * G * H;
      const scalar_t* a_t = acts.data_ptr<scalar_t>() + t * B * G * H;
      const scalar_t* pre_t = pre ? pre->data_ptr<scalar_t>() + t * B * G * H : nullptr;
      const scalar_t* c_t = cs.data_ptr<scalar_t>() + t * BH;
      const scalar_t* c_prev = t > 0 ? c_t - BH : c0_c.data_ptr<scalar_t>();
      const scalar_t* n_t = exp_gate ? ns->data_ptr<scalar_t>() + t * BH : nullptr;
      const scalar_t* n_prev = exp_gate ? (t > 0 ? n_t - BH : n0_c.data_ptr<scalar_t>()) : nullptr;
      const scalar_t* gy = gy_all.data_ptr<scalar_t>() + t * BH;
      const scalar_t* pp = peep ? peep_c.data_ptr<scalar_t>() : nullptr;
      scalar_t* pg = peep ? peep_grad->data_ptr<scalar_t>() : nullptr;
      scalar_t* dh_p = dh.data_ptr<scalar_t>();
      scalar_t* dc_p = dc.data_ptr<scalar_t>();
      scalar_t* dn_p = exp_gate ? dn.data_ptr<scalar_t>() : nullptr;
      const V one(1);
      // u' from the gate's output u (sigmoid) or its input x (hard sigmoid: 1/6 on (-3, 3), else 0).
      auto grad_gate = [&](const V& u, const scalar_t* x, int64_t at, int n) {
        if (gate == 0) {
          return u * (one - u);
        }
        const V xv = V::loadu(x + at, n);
        return V::blendv(V(0), V(scalar_t(1) / 6), (xv > V(-3)) & (xv < V(3)));
      };
      for (int64_t b = 0; b < B; ++b) {
        const V kb(keep ? keep_c.data_ptr<scalar_t>()[t * B + b] : scalar_t(1));
        const V dhk(dh_keep ? dh_keep[b] : scalar_t(1));  // the reset before step t + 1
        const scalar_t* a = a_t + b * G * H;
        const scalar_t* x = pre_t ? pre_t + b * G * H : nullptr;
        scalar_t* d = dp_p + b * G * H;
        for (int64_t j = j0; j < j1; j += V::size()) {
          const int n = static_cast<int>(std::min<int64_t>(V::size(), j1 - j));
          const int64_t at = b * H + j;
          const V dh_v = V::loadu(dh_p + at, n) * dhk + V::loadu(gy + at, n);
          const V f = V::loadu(a + f_at + j, n), z = V::loadu(a + z_at + j, n), o = V::loadu(a + o_at + j, n);
          const V i = coupled ? one - f : V::loadu(a + j, n);
          const V c = V::loadu(c_t + at, n), cp = V::loadu(c_prev + at, n) * kb;
          const V k_z = i * (one - z * z);
          if (exp_gate) {
            const V nv = V::loadu(n_t + at, n), np = V::loadu(n_prev + at, n) * kb;
            const V hhat = c / nv;
            const V dc_v = V::loadu(dc_p + at, n) + dh_v * (o / nv);
            const V dn_v = V::loadu(dn_p + at, n) - dh_v * (o * hhat / nv);
            (dh_v * hhat * o * (one - o)).store(d + 3 * H + j, n);
            (dc_v * z * i + dn_v * i).store(d + j, n);
            (dc_v * cp * f + dn_v * np * f).store(d + H + j, n);
            (dc_v * k_z).store(d + 2 * H + j, n);
            (dn_v * f * kb).store(dn_p + at, n);
            (dc_v * f * kb).store(dc_p + at, n);
            continue;
          }
          const V tc = c.tanh();
          const V k_o = tc * o * (one - o);
          V k_c = o * (one - tc * tc);
          if (pp) {
            k_c = k_c + k_o * V::loadu(pp + z_at + j, n);
          }
          const V dc_v = V::loadu(dc_p + at, n) + dh_v * k_c;
          const V gf = grad_gate(f, x, f_at + j, n);
          V k_cc = f;
          const V d_o = dh_v * k_o;
          if (coupled) {
            const V k_f = (cp - z) * gf, d_f = dc_v * k_f;
            d_f.store(d + j, n);
            if (pp) {
              k_cc = k_cc + k_f * V::loadu(pp + j, n);
              accumulate(pg + j, d_f * cp, n);
            }
          } else {
            const V k_i = z * grad_gate(i, x, j, n), k_f = cp * gf, d_i = dc_v * k_i, d_f = dc_v * k_f;
            d_i.store(d + j, n);
            d_f.store(d + H + j, n);
            if (pp) {
              k_cc = k_cc + k_i * V::loadu(pp + j, n) + k_f * V::loadu(pp + H + j, n);
              accumulate(pg + j, d_i * cp, n);
              accumulate(pg + H + j, d_f * cp, n);
            }
          }
          if (pp) {  // the output gate's peephole reads c_t
            accumulate(pg + z_at + j, d_o * c, n);
          }
          (dc_v * k_z).store(d + z_at + j, n);
          d_o.store(d + o_at + j, n);
          (dc_v * k_cc * kb).store(dc_p + at, n);
        }
      }
    };
    // Step t's gate norm backward on the rows of the gates [q0, q1), with the scratch of thread k.
    auto norm_back = [&](int64_t t, int64_t q0, int64_t q1, int k) {
      const scalar_t* stats = ln_stats_c.data_ptr<scalar_t>() + t * 2 * B * G;
      const int64_t at = t * B * G * H;
      gate_norm_step_back(dP.data_ptr<scalar_t>() + at, ln_in_c.data_ptr<scalar_t>() + at, stats, stats + B * G,
                          ln_w_c.data_ptr<scalar_t>(), dP_raw.data_ptr<scalar_t>() + at,
                          ln_scratch.data_ptr<scalar_t>() + k * 2 * H, ln_w_grad->data_ptr<scalar_t>(),
                          ln_b_grad->data_ptr<scalar_t>(), B, G, H, q0, q1);
    };
    if (threaded) {
      backward_steps_threaded<scalar_t>(pointwise, norm_back, ln_w ? G : 0, dP_raw.view({T, B, G * H}), wT,
                                        std::nullopt, keep_c, dh);
      return;
    }
    for (int64_t t = T - 1; t >= 0; --t) {
      pointwise(t, 0, H, nullptr);
      if (ln_w) {
        norm_back(t, 0, G, 0);
      }
      Tensor dp_raw = dP_raw.select(0, t);
      Tensor dh_prev = project(dp_raw.view({B, G * H}), std::nullopt, wT, layout, H);
      dh.copy_(keep ? dh_prev * keep_c.select(0, t).unsqueeze(1) : dh_prev);
    }
  });
  if (exp_gate) {
    return {dh, dc, dn};
  }
  return {dh, dc};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rpt_loops, m) {
  m.def("modlstm_forward", &modlstm_forward);
  m.def("modlstm_backward", &modlstm_backward);
  m.def("modlstm_backward_cpu", &modlstm_backward_cpu);
}
