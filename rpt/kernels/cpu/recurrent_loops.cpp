// The time loops of rpt's fused recurrent kernels (modlstm, gru), step for step the Python loops in
// modlstm.py and gru.py on the same buffers, called from C++ instead of Python (on the CPU each step's
// elementwise part as one pass: step_passes.h; elsewhere the same ATen ops). At few rows each loop runs in
// one parallel region instead (threaded_loops.h).
// Why this file exists, and how it is built: build.py. The Python loop is the readable form; a change
// there is made here too, and tests/models/test_native_loops.py holds the two equal.
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

#include "step_passes.h"
#include "threaded_loops.h"

namespace rpt_native {  // small_batch_product.cpp
at::Tensor small_batch_product(const at::Tensor& x, const at::Tensor& P, int64_t N,
                               const std::optional<at::Tensor>& add);
}

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using namespace rpt_native::steps;     // each step's elementwise pass
using namespace rpt_native::threaded;  // the loops at few rows

// h @ W^T (+ add), n = W's rows, with W in the layout PackedLinear (rpt/kernels/cpu/products.py) chose:
// 0 the plain [n, H] weight (addmm), 1 reordered for oneDNN (whose ops these are), 2 grouped for
// small_batch_product (small_batch_product.cpp: few rows).
Tensor project(const Tensor& h, const OptTensor& add, const Tensor& w, int64_t layout, int64_t n) {
  if (layout == 2) {
    return rpt_native::small_batch_product(h, w, n, add);
  }
  if (layout == 1) {
    if (add) {
      static auto binary = c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
          .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, c10::string_view)>();
      return binary.call(h, *add, w, std::nullopt, "add");
    }
    static auto plain = c10::Dispatcher::singleton()
        .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
        .typed<Tensor(const Tensor&, const Tensor&, const OptTensor&, c10::string_view,
                      c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
    return plain.call(h, w, std::nullopt, "none", c10::List<std::optional<c10::Scalar>>(), std::nullopt);
  }
  return add ? at::addmm(*add, h, w.t()) : at::mm(h, w.t());
}

// modlstm_sequence's forward loop (rpt/models/cells/modlstm.py). gate: -1 the stabilised exponential gate, 0 sigmoid, 1 hard sigmoid
// (clamp(x / 6 + 0.5, 0, 1), as registered in rpt/models/registry.py). Returns the state after the last step:
// (h, c), or (h, c, n, m) for the exponential gate. `fuse`: on the CPU, run each step's pointwise part as one pass
// (native.unfused_steps() turns it off, so that the tests check the ATen form a GPU runs).
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

// modlstm_sequence_backward's loop over factors K_* precomputed for all steps (backward_factors in modlstm.py), as
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
// path is cuDNN). The Python loop (backward_steps in gru.py) reads factors K precomputed for all steps at once,
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

TORCH_LIBRARY(rpt_loops, m) {
  m.def("modlstm_forward", &modlstm_forward);
  m.def("modlstm_backward", &modlstm_backward);
  m.def("modlstm_backward_cpu", &modlstm_backward_cpu);
  m.def("gru_forward", &gru_forward);
  m.def("gru_backward", &gru_backward);
}
