// The per-step product of the recurrent kernels' C++ loops (rpt/ops/CELL/CELL_cpu.cpp), whichever layout
// PackedLinear (products.py) packed the recurrent weight in. How it is built: build.py.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace rpt_native {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

at::Tensor small_batch_product(const at::Tensor& x, const at::Tensor& P, int64_t N,
                               const std::optional<at::Tensor>& add);  // small_batch_product.cpp

// h @ W^T (+ add), n = W's rows, with W in the layout PackedLinear (rpt/kernels/cpu/products.py) chose:
// 0 the plain [n, H] weight (addmm), 1 reordered for oneDNN (whose ops these are), 2 grouped for
// small_batch_product (small_batch_product.cpp: few rows).
inline Tensor project(const Tensor& h, const OptTensor& add, const Tensor& w, int64_t layout, int64_t n) {
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

}  // namespace rpt_native
