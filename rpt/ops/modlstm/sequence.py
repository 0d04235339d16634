"""modlstm over a sequence: which form runs it (`forms`, asked of the backend once per call) and the fused sequence
kernel, a pair of torch custom operators whose loops are the chosen form's: the Python loops (loops.py), rpt's
C++ loops (modlstm_cpu.cpp) or the wide cell's Triton step kernels (triton_steps.py). The one-kernel Triton loop
(triton.py) is a form of its own, called from `forward`.

The kernel: the input projection for all steps is one GEMM, the loop does only what depends on h_{t-1} (one
packed small-batch product and a few elementwise ops, no autograd graph), the backward loop's factors that do not
depend on the recurrence are precomputed for all steps at once (`backward_factors`; the C++ one-pass form derives
them inside each step instead), and the weight gradients are one GEMM each after it. torch.compile would unroll
the time loop, and a Python loop through autograd records every op of every step.
"""

import warnings
from enum import IntEnum
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from rpt import kernels
from rpt.kernels.backend import Form
from rpt.kernels.cpu.products import PackedLinear, matmul
from rpt.kernels.triton import on_chip
from rpt.ops.modlstm.gates import GateFunction, get_gate
from rpt.ops.modlstm.loops import backward_factors, backward_steps, forward_steps, previous
from rpt.ops.modlstm.spec import gate_groups
from rpt.ops.precision import as_fp32, full_precision


class Gate(IntEnum):
    """The gate functions the C++ loops know, by the code they take."""
    EXP = -1  # the stabilised exponential gate
    SIGMOID = 0
    HARD_SIGMOID = 1


# The gates the C++ loops know; a user-registered gate runs the Python loops.
NATIVE_GATES = ((get_gate("sigmoid"), Gate.SIGMOID), (get_gate("hard_sigmoid"), Gate.HARD_SIGMOID))


class Variant(NamedTuple):
    """What the kernel needs to know of a cell's configuration: the custom operators below take the gate's name
    and `coupled`, and see the rest (layer norm, peepholes) from the tensors they are given."""
    gate: str
    coupled: bool
    gate_norm: bool
    peepholes: bool

    @property
    def gate_fn(self) -> GateFunction | None:
        return get_gate(self.gate)

    @property
    def exp(self) -> bool:
        return self.gate == "exp"

    @property
    def native_gate(self) -> int | None:
        """The native loops' code for the gate, None for a gate they do not know."""
        code = Gate.EXP if self.exp else next((code for g, code in NATIVE_GATES if g is self.gate_fn), None)
        return None if code is None else int(code)

    @property
    def groups(self) -> tuple[str, ...]:
        return gate_groups(self.coupled)


def has_triton_form(gate: str) -> bool:
    return gate in ("sigmoid", "hard_sigmoid", "exp") or get_gate(gate).triton is not None


def forms(v: Variant, d_hidden: int, heads: int, on_gpu: bool) -> set[Form]:
    """The forms that can run this cell. The one-kernel Triton loop: a built-in gate (or a registered one with its
    Triton form), a head of 16-64 units, and the gate norm only with one head of 16, 32 or 64 (it normalises a
    group's H units together, unpadded); any other cell with a Triton-formed gate: the step kernels. The C++ loops:
    a built-in gate. A registered gate without a Triton form runs on a GPU in a Python loop, and says so."""
    offered = {Form.ATEN}
    if has_triton_form(v.gate):
        offered.add(Form.TRITON_STEPS)
        if not (v.gate_norm and heads > 1) and on_chip(d_hidden, heads, power_of_two=v.gate_norm):
            offered.add(Form.TRITON_LOOP)
    elif on_gpu:
        warnings.warn(f"model.gate = '{v.gate}' has no Triton form: the modlstm runs its Python step loop on "
                      "the GPU (about ten kernel launches a step, several times slower than rpt's Triton loops); "
                      "register_gate(..., triton=(fn, grad)) gives it one", stacklevel=4)
    if v.native_gate is not None:
        offered |= {Form.NATIVE_ONE_PASS, Form.NATIVE}
    return offered


def forward(cell, x: Tensor, state: tuple, reset: Optional[Tensor]):
    """The cell (rpt.models.cells.modlstm.ModLSTM: its parameters and variant) over x, from `state`: (y, state)."""
    form = kernels.current().form(x, forms(cell.variant, cell.d_hidden, cell.heads, x.is_cuda))
    if form is Form.TRITON_LOOP:  # the whole time loop in one kernel, a program per head
        from rpt.ops.modlstm.triton import modlstm_triton_loop as loop

        keep = None if reset is None else (~reset).float().t().contiguous()
        y, final = loop(x, cell.w_x, cell.w_h, cell.bias, cell.ln_weight, cell.ln_bias, cell.peep, state, keep,
                        cell.gate, cell.coupled, cell.heads)
        return y.to(x.dtype), tuple(s.to(state[0].dtype) for s in final)
    w_x, bias = cell.w_x, cell.bias
    if form is Form.TRITON_STEPS:  # the input projection in the autocast dtype, the loop in float32
        x, w_x, bias = F.linear(x, w_x, bias), None, None
    with full_precision(x):
        x = as_fp32(x)
        keep = None if reset is None else (~reset).to(x.dtype).transpose(0, 1).contiguous()  # [T, B]
        n_m = state[2:] if cell.exp else (None, None)
        y, *final = modlstm_sequence(x, w_x, cell.recurrent_weight(), bias, cell.ln_weight, cell.ln_bias,
                                     cell.peep, state[0], state[1], *n_m, keep, cell.gate, cell.coupled,
                                     form.value)[:5]
    return y, tuple(final if cell.exp else final[:2])


# The fused sequence kernel as a pair of torch custom operators (forward; backward, registered as its gradient):
# opaque to torch.compile, which traces a model through them in one graph, where it could not trace the packed
# oneDNN weight and the native loops inside an autograd.Function. Buffers are time-major ([T, B, ...]) so each
# step's slice is contiguous. An operator returns a fixed number of tensors: one it does not have (the
# exponential gate's state for the sigmoid family, a buffer this variant does not keep) is an empty tensor.
@torch.library.custom_op("rpt::modlstm_sequence", mutates_args=())
def modlstm_sequence(x: Tensor, w_x: Optional[Tensor], w_h: Tensor, bias: Optional[Tensor], ln_w: Optional[Tensor],
                     ln_b: Optional[Tensor], peep: Optional[Tensor], h0: Tensor, c0: Tensor, n0: Optional[Tensor],
                     m0: Optional[Tensor], keep: Optional[Tensor], gate: str, coupled: bool, form: str) -> tuple[
        Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> y, the final state (h, c, n, m), and the buffers the backward reads (acts, pre, cs, hs, ns, ln_in,
    ln_stats). Without w_x (and bias), x is the input projection x W_x^T + b itself, as a GPU computes it under
    autocast. `form`: the backend's choice (a Form's value); the backward runs the same one."""
    v = Variant(gate, coupled, ln_w is not None, peep is not None)
    B, T, D = x.shape
    H, G = w_h.shape[1], len(v.groups)
    xt = x.transpose(0, 1).reshape(T * B, D)
    XP = (xt if w_x is None else matmul(xt, w_x, bias)).view(T, B, G * H)
    backend = kernels.current()
    W = PackedLinear(w_h, B, backend)
    acts = x.new_empty(T, B, G, H)  # gate values
    # Gate inputs, kept only for a gate whose derivative needs its input (sigmoid's needs only its output).
    pre = x.new_empty(T, B, G, H) if not v.exp and v.gate_fn.fn is not torch.sigmoid else None
    cs, hs = x.new_empty(T, B, H), x.new_empty(T, B, H)
    ns = x.new_empty(T, B, H) if v.exp else None
    ln_in = x.new_empty(T, B, G, H) if v.gate_norm else None
    ln_stats = x.new_empty(T, 2, B, G, 1) if v.gate_norm else None
    buffers = (acts, pre, cs, hs, ns, ln_in, ln_stats)
    state = (h0, c0, n0, m0) if v.exp else (h0, c0)
    if form == Form.TRITON_STEPS:  # a product and one Triton kernel a step, the loop one CUDA graph
        from rpt.ops.modlstm import triton_steps as modlstm_steps

        final = modlstm_steps.triton_forward_steps(gate, coupled, XP, w_h, keep, state, *buffers, ln_w, ln_b, peep)
    elif form in (Form.NATIVE_ONE_PASS, Form.NATIVE):
        final = backend.loops().modlstm_forward(XP, *W.operand, keep, h0, c0, n0, m0, *buffers, ln_w, ln_b, peep,
                                                v.native_gate, coupled, form == Form.NATIVE_ONE_PASS)
    else:
        final = forward_steps(v, XP, W, keep, state, *buffers, ln_w, ln_b, peep)
    final = [t.clone() for t in final] + [x.new_empty(0) for _ in range(4 - len(final))]  # not views of buffers
    y = hs.transpose(0, 1).clone(memory_format=torch.contiguous_format)
    return y, *final, *(t if t is not None else x.new_empty(0) for t in buffers)


@modlstm_sequence.register_fake
def _(x, w_x, w_h, bias, ln_w, ln_b, peep, h0, c0, n0, m0, keep, gate, coupled, form):
    v = Variant(gate, coupled, ln_w is not None, peep is not None)
    B, T, _ = x.shape
    H, G = w_h.shape[1], len(v.groups)
    kept = lambda keep_it, *shape: x.new_empty(*shape) if keep_it else x.new_empty(0)  # noqa: E731
    return (x.new_empty(B, T, H), *(kept(k < 2 or v.exp, B, H) for k in range(4)), x.new_empty(T, B, G, H),
            kept(not v.exp and v.gate_fn.fn is not torch.sigmoid, T, B, G, H), x.new_empty(T, B, H),
            x.new_empty(T, B, H), kept(v.exp, T, B, H), kept(v.gate_norm, T, B, G, H), kept(v.gate_norm, T, 2, B, G, 1))


@torch.library.custom_op("rpt::modlstm_sequence_backward", mutates_args=())
def modlstm_sequence_backward(
        grad_y: Tensor, dh: Tensor, dc: Tensor, dn: Optional[Tensor], x: Tensor, w_x: Optional[Tensor], w_h: Tensor,
        ln_w: Optional[Tensor], peep: Optional[Tensor], h0: Tensor, c0: Tensor, n0: Optional[Tensor],
        keep: Optional[Tensor], acts: Tensor, pre: Optional[Tensor], cs: Tensor, hs: Tensor, ns: Optional[Tensor],
        ln_in: Optional[Tensor], ln_stats: Optional[Tensor], gate: str, coupled: bool,
        has_bias: bool, form: str
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of x, w_x, w_h, bias, ln_w, ln_b, peep, h0, c0 and n0 (empty for those the cell has not)."""
    v = Variant(gate, coupled, ln_w is not None, peep is not None)
    T, B, G, H = acts.shape
    D = x.shape[2]
    grad_y = grad_y.transpose(0, 1)  # [T, B, H]
    keep3 = keep[:, :, None] if keep is not None else None
    state = (h0, c0, n0) if v.exp else (h0, c0)
    h_prev = previous(hs, h0, keep3)
    backend = kernels.current()
    steps = form == Form.TRITON_STEPS
    WT = None if steps else PackedLinear(w_h.T.contiguous(), B, backend)  # dh_prev = dP_raw @ W_h
    dP = torch.empty_like(acts)  # gradient at the gate inputs (after layer norm)
    dP_raw = torch.empty_like(acts) if v.gate_norm else dP
    summed = None  # the gradients of ln_w, ln_b and peep, where the loop sums them
    if steps:
        from rpt.ops.modlstm import triton_steps as modlstm_steps

        factors = backward_factors(v, acts, pre, cs, ns, keep3, state, peep)
        grad_state = modlstm_steps.triton_backward_steps(grad_y, *factors, dP, dP_raw, keep, w_h, dh, dc, dn, ln_w, ln_in,
                                                  ln_stats)
    elif form == Form.NATIVE_ONE_PASS:  # the factors derived inside each step's pass
        norm_sums = [x.new_zeros(G, H), x.new_zeros(G, H)] if v.gate_norm else [None, None]
        summed = [*norm_sums, x.new_zeros(G - 1, H) if v.peepholes else None]
        ops = backend.loops_for_backward()
        grad_state = ops.modlstm_backward_cpu(grad_y, acts, pre, cs, ns, c0, n0, keep, peep, dP, dP_raw, *WT.operand,
                                              dh, dc, dn, ln_w, ln_in, ln_stats, v.native_gate, coupled, *summed)
    else:
        factors = backward_factors(v, acts, pre, cs, ns, keep3, state, peep)
        if form == Form.NATIVE:
            grad_state = backend.loops_for_backward().modlstm_backward(grad_y, *factors, dP, dP_raw, keep3, *WT.operand,
                                                                       dh, dc, dn, ln_w, ln_in, ln_stats)
        else:
            grad_state = backward_steps(grad_y, *factors, dP, dP_raw, keep3, WT, dh, dc, dn, ln_w, ln_in, ln_stats)
    dPf = dP_raw.view(T * B, G * H)
    if w_x is None:  # x was the input projection
        grad_x, grad_wx = dP_raw.view(T, B, D).transpose(0, 1), x.new_empty(0)
    else:
        grad_x = matmul(dPf, w_x.t()).view(T, B, D).transpose(0, 1)
        grad_wx = dPf.T @ x.transpose(0, 1).reshape(T * B, D)
    grad_wh = dPf.T @ h_prev.reshape(T * B, H)
    grad_bias = dPf.sum(0) if has_bias else x.new_empty(0)
    grad_ln_w, grad_ln_b, grad_peep = x.new_empty(0), x.new_empty(0), x.new_empty(0)
    if v.gate_norm:
        if summed is not None:
            grad_ln_w, grad_ln_b = summed[:2]
        else:
            hat = (ln_in - ln_stats[:, 0]) * ln_stats[:, 1]
            grad_ln_w = (dP * hat).sum((0, 1))
            grad_ln_b = dP.sum((0, 1))
    if v.peepholes:
        if summed is not None:
            grad_peep = summed[2]
        else:
            c_prev = previous(cs, c0, keep3)
            rows = [(dP[:, :, k] * c_prev).sum((0, 1)) for k in range(G - 2)]  # i (and f) read c_{t-1}
            rows.append((dP[:, :, G - 1] * cs).sum((0, 1)))  # o reads c_t
            grad_peep = torch.stack(rows)
    grad_state = [t.clone() for t in grad_state] + [x.new_empty(0) for _ in range(3 - len(grad_state))]
    return grad_x, grad_wx, grad_wh, grad_bias, grad_ln_w, grad_ln_b, grad_peep, *grad_state


@modlstm_sequence_backward.register_fake
def _(grad_y, dh, dc, dn, x, w_x, w_h, ln_w, peep, h0, c0, n0, keep, acts, pre, cs, hs, ns, ln_in, ln_stats, gate,
      coupled, has_bias, form):
    like = lambda t: torch.empty_like(t) if t is not None else x.new_empty(0)  # noqa: E731
    G4 = w_h.shape[0]
    T, B = acts.shape[:2]  # grad_x: a [B, T, D] view of a time-major tensor, as the kernel's
    return (x.new_empty(T, B, x.shape[2]).transpose(0, 1), like(w_x), torch.empty_like(w_h),
            x.new_empty(G4 if has_bias else 0), like(ln_w), like(ln_w), like(peep), torch.empty_like(h0),
            torch.empty_like(c0), like(n0))


def _some(t: Tensor) -> Optional[Tensor]:
    return t if t.numel() else None


def _save(ctx, inputs, output):
    x, w_x, w_h, bias, ln_w, ln_b, peep, h0, c0, n0, m0, keep, gate, coupled, form = inputs
    ctx.save_for_backward(x, w_x, w_h, ln_w, peep, h0, c0, n0, keep, *output[5:])
    ctx.gate, ctx.coupled, ctx.has_bias, ctx.form = gate, coupled, bias is not None, form


def _gradients(ctx, grad_y, grad_h, grad_c, grad_n, *_):
    x, w_x, w_h, ln_w, peep, h0, c0, n0, keep, acts, pre, cs, hs, ns, ln_in, ln_stats = ctx.saved_tensors
    zeros = lambda t: t if t is not None else torch.zeros_like(h0)  # noqa: E731
    grad_y = grad_y if grad_y is not None else hs.new_zeros(x.shape[0], x.shape[1], hs.shape[2])
    dn = zeros(grad_n) if n0 is not None else None
    grads = modlstm_sequence_backward(grad_y, zeros(grad_h), zeros(grad_c), dn, x, w_x, w_h, ln_w, peep, h0, c0, n0,
                                      keep, acts, _some(pre), cs, hs, _some(ns), _some(ln_in), _some(ln_stats),
                                      ctx.gate, ctx.coupled, ctx.has_bias, ctx.form)
    # m is a constant to differentiation; keep, gate, coupled and form have none
    return (*(_some(g) for g in grads), None, None, None, None, None)


modlstm_sequence.register_autograd(_gradients, setup_context=_save)
