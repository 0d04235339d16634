// The time loops of rpt's fused recurrent kernels (modlstm, gru), step for step the Python loops in
// modlstm.py and gru.py on the same buffers, called from C++ instead of Python (on the CPU each step's
// elementwise part as one pass, below; elsewhere the same ATen ops).
// Why this file exists, and how it is built: native/__init__.py. The Python loop is the readable form; a change
// there is made here too, and tests/models/test_native_loops.py holds the two equal.
//
// Buffers are time-major ([T, B, ...]); every step writes its slice of the caller's buffers in place.
//
// On the CPU each step's pointwise part (forward: gates and state update; backward: the gradient through them)
// runs as one pass of ATen's vector type, where ATen's ops would take 6-8 calls a step, each paying its
// dispatch (~3 us) on a few thousand numbers. native/__init__.py builds with AVX2 (CPU_CAPABILITY=AVX2)
// where the CPU has it; elsewhere the vector type is ATen's portable one.

#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace rpt_native {  // small_batch_product.cpp
at::Tensor small_batch_product(const at::Tensor& x, const at::Tensor& P, int64_t N,
                               const std::optional<at::Tensor>& add);
void small_batch_groups(const float* x, int64_t B, const float* P, const float* add, int64_t ld_add, float* out,
                        int64_t N, int64_t K, int64_t g0, int64_t g1);
}

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

constexpr double kLayerNormEps = 1e-5;  // modlstm.LN_EPS

template <typename scalar_t>
using Vec = at::vec::Vectorized<scalar_t>;

template <typename scalar_t>
inline Vec<scalar_t> sigmoid(Vec<scalar_t> x) {
  return (Vec<scalar_t>(1) + x.neg().exp()).reciprocal();
}

// Sum of x[0:len] and of f(x[j]) over it: the vector type for whole vectors, then the scalar rest.
template <typename scalar_t, typename VecFn, typename ScalarFn>
inline scalar_t row_sum(const scalar_t* x, int64_t len, VecFn vf, ScalarFn sf) {
  using V = Vec<scalar_t>;
  V acc(0);
  int64_t j = 0;
  for (; j + V::size() <= len; j += V::size()) {
    acc = acc + vf(V::loadu(x + j));
  }
  scalar_t lanes[V::size()];
  acc.store(lanes);
  scalar_t total = 0;
  for (int64_t k = 0; k < V::size(); ++k) {
    total += lanes[k];
  }
  for (; j < len; ++j) {
    total += sf(x[j]);
  }
  return total;
}

template <typename scalar_t>
inline scalar_t row_sum(const scalar_t* x, int64_t len) {
  return row_sum(x, len, [](Vec<scalar_t> v) { return v; }, [](scalar_t v) { return v; });
}

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

// acc[0:len] += v[0:len], one vector at a time (n: how many of v's lanes are in range).
template <typename scalar_t>
inline void accumulate(scalar_t* acc, const Vec<scalar_t>& v, int n) {
  (Vec<scalar_t>::loadu(acc, n) + v).store(acc, n);
}

// The gate layer norm's backward for one step: from the gradient at its output (dp) to its input (dp_raw),
// dx = rstd (dy - mean(dy) - x_hat mean(dy x_hat)) with dy = w_g dp and x_hat = (x - mean) rstd; and the norm's
// own gradients, summed into grad_w (dp x_hat) and grad_b (dp), [G, H] each, while dp is in the cache (summed
// over all T x B rows afterwards, in ATen ops, they were 5-7% of a step's time). The rows of the gates [g0, g1):
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

// One step of the gru after its product hp = h W_hh^T + b_hh ([B, 3, H], as xp), on the columns [j0, j1) of
// every row: writes r, z, n to g and h_t = n + z (h - n).
template <typename scalar_t>
void gru_step(const scalar_t* xp, const scalar_t* hp, const scalar_t* h, scalar_t* g, scalar_t* h_out, int64_t B,
              int64_t H, int64_t j0, int64_t j1) {
  using V = Vec<scalar_t>;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row = b * 3 * H;
    for (int64_t j = j0; j < j1; j += V::size()) {
      const int n = static_cast<int>(std::min<int64_t>(V::size(), j1 - j));
      const int64_t at_r = row + j, at_z = row + H + j, at_n = row + 2 * H + j;
      const V r = sigmoid(V::loadu(xp + at_r, n) + V::loadu(hp + at_r, n));
      const V z = sigmoid(V::loadu(xp + at_z, n) + V::loadu(hp + at_z, n));
      const V nn = (V::loadu(xp + at_n, n) + r * V::loadu(hp + at_n, n)).tanh();
      const V h_prev = V::loadu(h + b * H + j, n);
      r.store(g + at_r, n);
      z.store(g + at_z, n);
      nn.store(g + at_n, n);
      (nn + z * (h_prev - nn)).store(h_out + b * H + j, n);
    }
  }
}

// h @ W^T (+ add), n = W's rows, with W in the layout PackedLinear (rpt/models/cells/packed_linear.py) chose:
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

// The loops at few rows: PackedLinear's small-batch layout (float32) with the steps fused, on the CPU. The whole
// sequence runs in one parallel region: each step, every thread computes its share of the product (groups of W's
// columns: small_batch_groups), waits for the others, computes its share of the pointwise part (columns of every
// row; the gate norm, a phase of its own: rows of its share of the gates), and waits again. Calling the product
// each step instead (small_batch_product's at::parallel_for) left the second thread idle through the pointwise
// part and paid a fork and ATen's per-call costs every step: 42 against 32 us a step of modlstm's forward at B=2,
// H=512 on the build machine (benchmarks/RESULTS.md). Without OpenMP (or inside a parallel region already) one
// thread runs it all. A race here shows as a wrong number: test_native_loops.py runs these on 2 threads.
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
Tensor first_read(const Tensor& state, const OptTensor& keep) {
  return keep ? (state * keep->select(0, 0).unsqueeze(1)).contiguous() : state.contiguous().clone();
}

// modlstm_forward's loop at few rows (above); gate as for modlstm_forward. With the gate norm, a third phase between
// the two: each thread normalises the rows of its share of the gates.
std::vector<Tensor> modlstm_forward_threaded(const Tensor& XP, const Tensor& w, const OptTensor& keep,
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

// ModLSTMFunction.forward's loop. gate: -1 the stabilised exponential gate, 0 sigmoid, 1 hard sigmoid
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

// ModLSTMFunction.backward's loop over factors K_* precomputed for all steps (backward_factors in modlstm.py), as
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

// ModLSTMFunction.backward's loop on the CPU, each step's pointwise part in one pass. Where modlstm_backward reads
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

// gru_forward's loop at few rows (above modlstm_forward_threaded).
Tensor gru_forward_threaded(const Tensor& XP, const Tensor& w, const Tensor& bias, const OptTensor& keep,
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

// GRUFunction.forward's loop; fills HP (h W_hh^T + b_hh), gates (r, z, n) and hs. Returns the last h.
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

// GRUFunction.backward's loop; fills dXP and dHP. Returns the gradient of the initial h. CPU only (gru's GPU
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
