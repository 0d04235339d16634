// What each step's elementwise pass of the recurrent kernels is written with: ATen's vector type, the sigmoid on it,
// sums over a row, accumulation. The passes themselves are each recurrence's own (rpt/ops/CELL/CELL_steps.h: the
// gate norm and modlstm's sigmoid-family and exponential steps, gru's step), where ATen's ops would take 6-8 calls a
// step, each paying its dispatch on a few thousand numbers; each works on a range of columns (or of gates, for the
// norm), so that threads can split a step (threaded_loops.h). How they are built: build.py.
#pragma once

#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#endif

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace rpt_native::steps {

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

// acc[0:len] += v[0:len], one vector at a time (n: how many of v's lanes are in range).
template <typename scalar_t>
inline void accumulate(scalar_t* acc, const Vec<scalar_t>& v, int n) {
  (Vec<scalar_t>::loadu(acc, n) + v).store(acc, n);
}
}  // namespace rpt_native::steps
