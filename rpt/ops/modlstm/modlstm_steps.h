// modlstm's elementwise passes of one step, on ATen's vector type (step_passes.h): the gate layer norm, forward and
// backward, and the sigmoid-family and exponential steps. modlstm_cpu.cpp's loops call them; loops.py is the same
// arithmetic as ATen ops.
#pragma once

#include "step_passes.h"

namespace rpt_native::steps {

constexpr double kLayerNormEps = 1e-5;  // spec.LN_EPS

// Gate layer norm of one step, each of the B x G rows of P ([B, G, H]) of the gates [g0, g1) over its H values:
// keeps the input (ln_in) and the statistics (mean, rstd: [B, G]) for the backward, writes w_g (x - mean) rstd + b_g
// to out (which may be P).
template <typename scalar_t>
void gate_norm_step(const scalar_t* P, scalar_t* ln_in, scalar_t* mean, scalar_t* rstd, const scalar_t* w,
                    const scalar_t* bias, scalar_t* out, int64_t B, int64_t G, int64_t H, int64_t g0, int64_t g1) {
  using V = Vec<scalar_t>;
  for (int64_t r = 0; r < B * G; ++r) {
    if (r % G < g0 || r % G >= g1) {
      continue;
    }
    const scalar_t* x = P + r * H;
    const scalar_t* wg = w + (r % G) * H;
    const scalar_t* bg = bias + (r % G) * H;
    const scalar_t mu = row_sum(x, H) / H;
    const V mu_v(mu);
    const scalar_t var = row_sum(x, H, [&](V v) { return (v - mu_v) * (v - mu_v); },
                                 [&](scalar_t v) { return (v - mu) * (v - mu); }) / H;
    const scalar_t rs = scalar_t(1) / std::sqrt(var + scalar_t(kLayerNormEps));
    mean[r] = mu, rstd[r] = rs;
    const V rs_v(rs);
    for (int64_t j = 0; j < H; j += V::size()) {
      const int n = static_cast<int>(std::min<int64_t>(V::size(), H - j));
      const V xv = V::loadu(x + j, n);
      xv.store(ln_in + r * H + j, n);
      ((xv - mu_v) * rs_v * V::loadu(wg + j, n) + V::loadu(bg + j, n)).store(out + r * H + j, n);
    }
  }
}

// The gate layer norm's backward for one step: from the gradient at its output (dp) to its input (dp_raw),
// dx = rstd (dy - mean(dy) - x_hat mean(dy x_hat)) with dy = w_g dp and x_hat = (x - mean) rstd; and the norm's
// own gradients, summed into grad_w (dp x_hat) and grad_b (dp), [G, H] each, while dp is in the cache (summed
// over all T x B rows afterwards, in ATen ops, they cost a noticeable share of a step). The rows of the gates [g0, g1):
// threads that split a step by gates add to parts of grad_w and grad_b of their own. scratch: 2 H numbers.
template <typename scalar_t>
void gate_norm_step_back(const scalar_t* dp, const scalar_t* ln_in, const scalar_t* mean, const scalar_t* rstd,
                         const scalar_t* w, scalar_t* dp_raw, scalar_t* scratch, scalar_t* grad_w, scalar_t* grad_b,
                         int64_t B, int64_t G, int64_t H, int64_t g0, int64_t g1) {
  using V = Vec<scalar_t>;
  for (int64_t r = 0; r < B * G; ++r) {
    if (r % G < g0 || r % G >= g1) {
      continue;
    }
    const scalar_t* wg = w + (r % G) * H;
    scalar_t* gw = grad_w + (r % G) * H;
    scalar_t* gb = grad_b + (r % G) * H;
    const V mu(mean[r]), rs(rstd[r]);
    scalar_t* dy = scratch;            // w_g dp
    scalar_t* dy_xhat = scratch + H;  // w_g dp x_hat
    for (int64_t j = 0; j < H; j += V::size()) {
      const int n = static_cast<int>(std::min<int64_t>(V::size(), H - j));
      const V g = V::loadu(dp + r * H + j, n), x_hat = (V::loadu(ln_in + r * H + j, n) - mu) * rs;
      const V d = g * V::loadu(wg + j, n);
      d.store(dy + j, n);
      (d * x_hat).store(dy_xhat + j, n);
      accumulate(gw + j, g * x_hat, n);
      accumulate(gb + j, g, n);
    }
    const V m_dy(row_sum(dy, H) / H), m_dyx(row_sum(dy_xhat, H) / H);
    for (int64_t j = 0; j < H; j += V::size()) {
      const int n = static_cast<int>(std::min<int64_t>(V::size(), H - j));
      const V x_hat = (V::loadu(ln_in + r * H + j, n) - mu) * rs;
      (rs * (V::loadu(dy + j, n) - m_dy - x_hat * m_dyx)).store(dp_raw + r * H + j, n);
    }
  }
}

// One step of the sigmoid-family modlstm after its product P = x W_x + h W_h + b ([B, G, H]), on the columns
// [j0, j1) of every row: writes the gates to `a` (i, f, z, o; coupled: f, z, o with i = 1 - f), c_t and
// h_t = o tanh(c_t). Peepholes (`peep`, [G - 1, H], or null): the gates before z read c_{t-1}, the output gate c_t.
// gate: 0 sigmoid, 1 hard sigmoid for the gates before z (the output gate is a sigmoid); `pre` (or null): where
// the gate inputs go, peepholes added, for the backward (the hard sigmoid's derivative reads them).
template <typename scalar_t>
void modlstm_sigmoid_step(const scalar_t* P, scalar_t* a, const scalar_t* c, const scalar_t* peep, scalar_t* c_out,
                          scalar_t* h_out, scalar_t* pre, int64_t B, int64_t G, int64_t H, int64_t gate, bool coupled,
                          int64_t j0, int64_t j1) {
  using V = Vec<scalar_t>;
  const int64_t f_at = coupled ? 0 : H, z_at = (G - 2) * H, o_at = (G - 1) * H;
  auto gate_fn = [&](const V& x) {
    return gate == 0 ? sigmoid(x) : at::vec::minimum(at::vec::maximum(x / V(6) + V(0.5), V(0)), V(1));
  };
  for (int64_t b = 0; b < B; ++b) {
    const scalar_t* Pb = P + b * G * H;
    scalar_t* ab = a + b * G * H;
    scalar_t* xb = pre ? pre + b * G * H : nullptr;
    for (int64_t j = j0; j < j1; j += V::size()) {
      const int n = static_cast<int>(std::min<int64_t>(V::size(), j1 - j));
      const V c_prev = V::loadu(c + b * H + j, n);
      V p_f = V::loadu(Pb + f_at + j, n), p_i = coupled ? V(0) : V::loadu(Pb + j, n), p_o = V::loadu(Pb + o_at + j, n);
      if (peep) {
        p_f = p_f + V::loadu(peep + f_at + j, n) * c_prev;
        p_i = coupled ? p_i : p_i + V::loadu(peep + j, n) * c_prev;
      }
      const V f = gate_fn(p_f);
      const V i = coupled ? V(1) - f : gate_fn(p_i);
      const V p_z = V::loadu(Pb + z_at + j, n), z = p_z.tanh();
      const V c_new = f * c_prev + i * z;
      if (peep) {
        p_o = p_o + V::loadu(peep + z_at + j, n) * c_new;
      }
      const V o = sigmoid(p_o);
      if (!coupled) {
        i.store(ab + j, n);
      }
      f.store(ab + f_at + j, n);
      z.store(ab + z_at + j, n);
      o.store(ab + o_at + j, n);
      if (xb) {
        if (!coupled) {
          p_i.store(xb + j, n);
        }
        p_f.store(xb + f_at + j, n);
        p_z.store(xb + z_at + j, n);
        p_o.store(xb + o_at + j, n);
      }
      c_new.store(c_out + b * H + j, n);
      (o * c_new.tanh()).store(h_out + b * H + j, n);
    }
  }
}

// One step of the exponential-gated modlstm (xLSTM's sLSTM stabiliser) after its product P ([B, 4, H]):
// m_t = max(P_f + m_{t-1}, P_i), with m_{t-1} read as -inf where n_{t-1} = 0 (a fresh or reset state);
// i = exp(P_i - m_t), f = exp(P_f + m_{t-1} - m_t); c_t = f c + i z, n_t = f n + i, h_t = o c_t / n_t.
// On the columns [j0, j1) of every row (m_out may be m: each column is read before it is written).
template <typename scalar_t>
void modlstm_exp_step(const scalar_t* P, scalar_t* a, const scalar_t* c, const scalar_t* n, const scalar_t* m,
                      scalar_t* c_out, scalar_t* n_out, scalar_t* m_out, scalar_t* h_out, int64_t B, int64_t H,
                      int64_t j0, int64_t j1) {
  using V = Vec<scalar_t>;
  const V none(-std::numeric_limits<scalar_t>::infinity());
  for (int64_t b = 0; b < B; ++b) {
    const scalar_t* Pb = P + b * 4 * H;
    scalar_t* ab = a + b * 4 * H;
    for (int64_t j = j0; j < j1; j += V::size()) {
      const int k = static_cast<int>(std::min<int64_t>(V::size(), j1 - j));
      const int64_t at = b * H + j;
      const V n_prev = V::loadu(n + at, k);
      const V m_prev = V::blendv(none, V::loadu(m + at, k), n_prev > V(0));
      const V p_i = V::loadu(Pb + j, k), p_f = V::loadu(Pb + H + j, k) + m_prev;
      const V m_new = at::vec::maximum(p_f, p_i);
      const V i = (p_i - m_new).exp(), f = (p_f - m_new).exp();
      const V z = V::loadu(Pb + 2 * H + j, k).tanh(), o = sigmoid(V::loadu(Pb + 3 * H + j, k));
      const V c_new = f * V::loadu(c + at, k) + i * z, n_new = i + f * n_prev;
      i.store(ab + j, k);
      f.store(ab + H + j, k);
      z.store(ab + 2 * H + j, k);
      o.store(ab + 3 * H + j, k);
      m_new.store(m_out + at, k);
      c_new.store(c_out + at, k);
      n_new.store(n_out + at, k);
      (o * (c_new / n_new)).store(h_out + at, k);
    }
  }
}

}  // namespace rpt_native::steps
