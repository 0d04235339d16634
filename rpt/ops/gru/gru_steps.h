// gru's elementwise pass of one step, on ATen's vector type (step_passes.h). gru_cpu.cpp's loops call it; loops.py
// is the same arithmetic as ATen ops.
#pragma once

#include "step_passes.h"

namespace rpt_native::steps {

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

}  // namespace rpt_native::steps
