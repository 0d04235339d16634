"""The modified LSTM: gate functions chosen by name, optional gate layer norm, coupled gates, peepholes.

One step is the spec, `modlstm_step` in rpt/ops/modlstm/spec.py (its docstring writes the recurrence out): the
sigmoid-family gates (sigmoid, hard_sigmoid, or one registered with register_gate) and the stabilised exponential
gate of xLSTM's sLSTM, with gate layer norm, coupled gates and peepholes as options.

The fast path (`modlstm_sequence`) is a fused sequence kernel with a hand-written backward:
the input projection for all steps is one GEMM, the loop does only what depends on h_{t-1}
(one packed small-batch product and a few elementwise ops, no autograd graph), the backward
loop's factors that do not depend on the recurrence are precomputed for all steps at once
(`backward_factors`), and the weight gradients are one GEMM each after it. torch.compile would
unroll the time loop, and a Python loop through autograd records every op of every step.
The two time loops (`forward_steps`, `backward_steps`, at the end of this file) run in C++
where rpt.kernels.cpu's loops could be built, which halves their dispatch cost at small batch;
on the CPU there each step's elementwise part is one vector pass, the backward's deriving its
factors in that pass. On a GPU the loops are its Triton forms (rpt/ops/modlstm/): the whole sequence in one
kernel for heads of 16-64 units (`triton_loop`), else a cuBLAS product and one fused Triton kernel a step,
replayed as one CUDA graph (`triton_steps`).
"""

import math
import warnings
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rpt import kernels
from rpt.errors import RptError
from rpt.kernels.cpu.backend import Gate
from rpt.kernels.cpu.products import PackedLinear, matmul
from rpt.kernels.triton import available as triton_available, on_chip
from rpt.models.cells.base import Cell, as_fp32, block_diagonal, full_precision, head_width
from rpt.models.registry import GateFunction, default_forget_bias, get_gate, register_cell
from rpt.ops.modlstm.spec import LN_EPS, gate_groups, modlstm_step

# The gates the native loops know; a user-registered gate runs the Python loops.
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


@register_cell("modlstm")
class ModLSTM(Cell):
    options = ("gate", "gate_norm", "coupled_gates", "forget_bias", "peepholes", "heads")

    def __init__(self, d_model: int, d_hidden: int = 0, gate: str = "sigmoid", gate_norm: bool = False,
                 coupled_gates: bool = False, forget_bias: float | None = None, peepholes: bool = False,
                 heads: int = 1):
        super().__init__(d_model, d_hidden or d_model)
        H, D = self.d_hidden, d_model
        self.gate_fn: GateFunction | None = get_gate(gate)
        forget_bias = default_forget_bias(gate) if forget_bias is None else forget_bias  # each gate's own
        self.exp = self.gate_fn is None
        if self.exp and coupled_gates:
            raise RptError("model.coupled_gates needs gates in [0, 1]; the exponential gate is not",
                           "use model.gate = 'sigmoid' with coupled gates, or turn coupled_gates off")
        if self.exp and peepholes:
            raise RptError("model.peepholes are not defined for the exponential gate (its cell state is unnormalised)",
                           "use model.gate = 'sigmoid' or 'hard_sigmoid' with peepholes")
        self.gate, self.coupled, self.gate_norm, self.peepholes = gate, coupled_gates, gate_norm, peepholes
        self.variant = Variant(gate, coupled_gates, gate_norm, peepholes)
        self.groups = self.variant.groups
        G = len(self.groups)
        self.heads, d = heads, head_width(H, heads)
        self.w_x = nn.Parameter(torch.empty(G * H, D))
        self.w_h = nn.Parameter(torch.empty(G * H, d))  # the recurrent matrix's blocks (base.block_diagonal)
        nn.init.uniform_(self.w_x, -1 / math.sqrt(D), 1 / math.sqrt(D))
        for block in range(G * heads):  # each gate group's block of each head orthogonal
            nn.init.orthogonal_(self.w_h.data[block * d:(block + 1) * d])
        f = self.groups.index("f")
        if gate_norm:
            self.bias = None
            self.ln_weight = nn.Parameter(torch.ones(G, H))
            self.ln_bias = nn.Parameter(torch.zeros(G, H))
            with torch.no_grad():
                self.ln_bias[f] = forget_bias
        else:
            self.bias = nn.Parameter(torch.zeros(G * H))
            with torch.no_grad():
                self.bias[f * H:(f + 1) * H] = forget_bias
            self.ln_weight = self.ln_bias = None
        # Peephole weights for (i, f, o), or (f, o) with coupled gates.
        self.peep = nn.Parameter(torch.zeros(G - 1, H)) if peepholes else None
        self.proj = nn.Linear(H, D, bias=False) if H != D else None

    def state_sizes(self):
        H = self.d_hidden
        return [H, H, H, H] if self.exp else [H, H]

    def step(self, x_t, state):
        gate = None if self.exp else self.gate_fn.fn
        h, state = modlstm_step(x_t, state, self.w_x, self.recurrent_weight(), self.bias, self.ln_weight, self.ln_bias,
                                self.peep, gate, self.coupled, self.linear)
        return self._out(h), state

    def recurrent_weight(self) -> Tensor:
        """The dense recurrent matrix (block-diagonal with heads)."""
        return block_diagonal(self.w_h, len(self.groups), self.heads)

    # ------------------------------------------------------------------ the fast path
    def forward(self, x, state=None, reset=None):
        state = state if state is not None else self.init_state(x.shape[0], x.device, x.dtype)
        if x.is_cuda and self.triton_loop():  # the whole time loop in one kernel, a program per head
            from rpt.ops.modlstm.triton import modlstm_sequence as loop

            keep = None if reset is None else (~reset).float().t().contiguous()
            y, final = loop(x, self.w_x, self.w_h, self.bias, self.ln_weight, self.ln_bias, self.peep, state, keep,
                            self.gate, self.coupled, self.heads)
            return self._out(y.to(x.dtype)), tuple(s.to(state[0].dtype) for s in final)
        w_x, bias = self.w_x, self.bias
        if triton_steps(x, self.variant):  # a GPU: the input projection in the autocast dtype, the loop in float32
            x, w_x, bias = F.linear(x, w_x, bias), None, None
        with full_precision(x):
            x = as_fp32(x)
            keep = None if reset is None else (~reset).to(x.dtype).transpose(0, 1).contiguous()  # [T, B]
            n_m = state[2:] if self.exp else (None, None)
            y, *final = modlstm_sequence(x, w_x, self.recurrent_weight(), bias, self.ln_weight, self.ln_bias,
                                         self.peep, state[0], state[1], *n_m, keep, self.gate, self.coupled)[:5]
        return self._out(y), tuple(final if self.exp else final[:2])

    def triton_loop(self) -> bool:
        """Whether the one-kernel Triton loop (rpt/ops/modlstm/triton.py) runs this cell on a GPU: a built-in gate
        (or a registered one with its Triton form), a head of 16-64 units, and the gate norm only with one head of 16, 32 or 64 (it
        normalises a group's H units together, unpadded). A wider cell takes modlstm_steps (`triton_steps`)."""
        if not has_triton_form(self.gate):
            warnings.warn(f"model.gate = '{self.gate}' has no Triton form: the modlstm runs its Python step loop on "
                          "the GPU (about ten kernel launches a step, several times slower than rpt's Triton loops); "
                          "register_gate(..., triton=(fn, grad)) gives it one", stacklevel=3)
            return False
        return not (self.gate_norm and self.heads > 1) and on_chip(self.d_hidden, self.heads,
                                                                     power_of_two=self.gate_norm)

    def _out(self, h):
        return self.linear(h, self.proj.weight) if self.proj is not None else h

    def flops_per_token(self):
        H, D, G = self.d_hidden, self.d_model, len(self.groups)
        return 2 * G * H * (D + H // self.heads) + (2 * H * D if self.proj is not None else 0)


# The fused sequence kernel as a pair of torch custom operators (forward; backward, registered as its gradient):
# opaque to torch.compile, which traces a model through them in one graph, where it could not trace the packed
# oneDNN weight and the native loops inside an autograd.Function. Buffers are time-major ([T, B, ...]) so each
# step's slice is contiguous. An operator returns a fixed number of tensors: one it does not have (the
# exponential gate's state for the sigmoid family, a buffer this variant does not keep) is an empty tensor.
@torch.library.custom_op("rpt::modlstm_sequence", mutates_args=())
def modlstm_sequence(x: Tensor, w_x: Optional[Tensor], w_h: Tensor, bias: Optional[Tensor], ln_w: Optional[Tensor],
                     ln_b: Optional[Tensor], peep: Optional[Tensor], h0: Tensor, c0: Tensor, n0: Optional[Tensor],
                     m0: Optional[Tensor], keep: Optional[Tensor], gate: str, coupled: bool) -> tuple[
        Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> y, the final state (h, c, n, m), and the buffers the backward reads (acts, pre, cs, hs, ns, ln_in,
    ln_stats). Without w_x (and bias), x is the input projection x W_x^T + b itself, as a GPU computes it under
    autocast."""
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
    native = backend.loops() if v.native_gate is not None else None
    if triton_steps(x, v):  # a GPU: a product and one Triton kernel a step, the loop one CUDA graph
        from rpt.ops.modlstm import triton_steps as modlstm_steps

        final = modlstm_steps.forward_steps(gate, coupled, XP, w_h, keep, state, *buffers, ln_w, ln_b, peep)
    elif native is not None:
        final = native.modlstm_forward(XP, *W.operand, keep, h0, c0, n0, m0, *buffers, ln_w, ln_b, peep,
                                       v.native_gate, coupled, backend.fused_steps)
    else:
        final = forward_steps(v, XP, W, keep, state, *buffers, ln_w, ln_b, peep)
    final = [t.clone() for t in final] + [x.new_empty(0) for _ in range(4 - len(final))]  # not views of buffers
    y = hs.transpose(0, 1).clone(memory_format=torch.contiguous_format)
    return y, *final, *(t if t is not None else x.new_empty(0) for t in buffers)


@modlstm_sequence.register_fake
def _(x, w_x, w_h, bias, ln_w, ln_b, peep, h0, c0, n0, m0, keep, gate, coupled):
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
        has_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of x, w_x, w_h, bias, ln_w, ln_b, peep, h0, c0 and n0 (empty for those the cell has not)."""
    v = Variant(gate, coupled, ln_w is not None, peep is not None)
    T, B, G, H = acts.shape
    D = x.shape[2]
    grad_y = grad_y.transpose(0, 1)  # [T, B, H]
    keep3 = keep[:, :, None] if keep is not None else None
    state = (h0, c0, n0) if v.exp else (h0, c0)
    h_prev = previous(hs, h0, keep3)
    backend = kernels.current()
    on_gpu = triton_steps(x, v)
    WT = None if on_gpu else PackedLinear(w_h.T.contiguous(), B, backend)  # dh_prev = dP_raw @ W_h
    dP = torch.empty_like(acts)  # gradient at the gate inputs (after layer norm)
    dP_raw = torch.empty_like(acts) if v.gate_norm else dP
    native = backend.loops() if v.native_gate is not None else None
    summed = None  # the gradients of ln_w, ln_b and peep, where the loop sums them
    if on_gpu:
        from rpt.ops.modlstm import triton_steps as modlstm_steps

        factors = backward_factors(v, acts, pre, cs, ns, keep3, state, peep)
        grad_state = modlstm_steps.backward_steps(grad_y, *factors, dP, dP_raw, keep, w_h, dh, dc, dn, ln_w, ln_in,
                                                  ln_stats)
    elif native is not None and backend.fused_steps and x.is_cpu:  # the factors derived inside each step's pass
        norm_sums = [x.new_zeros(G, H), x.new_zeros(G, H)] if v.gate_norm else [None, None]
        summed = [*norm_sums, x.new_zeros(G - 1, H) if v.peepholes else None]
        grad_state = native.modlstm_backward_cpu(grad_y, acts, pre, cs, ns, c0, n0, keep, peep, dP, dP_raw,
                                                 *WT.operand, dh, dc, dn, ln_w, ln_in, ln_stats, v.native_gate,
                                                 coupled, *summed)
    else:
        factors = backward_factors(v, acts, pre, cs, ns, keep3, state, peep)
        if native is not None:
            grad_state = native.modlstm_backward(grad_y, *factors, dP, dP_raw, keep3, *WT.operand, dh, dc, dn,
                                                 ln_w, ln_in, ln_stats)
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
      coupled, has_bias):
    like = lambda t: torch.empty_like(t) if t is not None else x.new_empty(0)  # noqa: E731
    G4 = w_h.shape[0]
    T, B = acts.shape[:2]  # grad_x: a [B, T, D] view of a time-major tensor, as the kernel's
    return (x.new_empty(T, B, x.shape[2]).transpose(0, 1), like(w_x), torch.empty_like(w_h),
            x.new_empty(G4 if has_bias else 0), like(ln_w), like(ln_w), like(peep), torch.empty_like(h0),
            torch.empty_like(c0), like(n0))


def triton_steps(x: Tensor, v: Variant) -> bool:
    """Whether the kernel's loops run rpt.ops.modlstm.triton_steps: on a GPU with triton, for a built-in gate or
    a registered one with its Triton form."""
    return x.is_cuda and has_triton_form(v.gate) and triton_available()


def has_triton_form(gate: str) -> bool:
    return gate in ("sigmoid", "hard_sigmoid", "exp") or get_gate(gate).triton is not None


def _some(t: Tensor) -> Optional[Tensor]:
    return t if t.numel() else None


def _save(ctx, inputs, output):
    x, w_x, w_h, bias, ln_w, ln_b, peep, h0, c0, n0, m0, keep, gate, coupled = inputs
    ctx.save_for_backward(x, w_x, w_h, ln_w, peep, h0, c0, n0, keep, *output[5:])
    ctx.gate, ctx.coupled, ctx.has_bias = gate, coupled, bias is not None


def _gradients(ctx, grad_y, grad_h, grad_c, grad_n, *_):
    x, w_x, w_h, ln_w, peep, h0, c0, n0, keep, acts, pre, cs, hs, ns, ln_in, ln_stats = ctx.saved_tensors
    zeros = lambda t: t if t is not None else torch.zeros_like(h0)  # noqa: E731
    grad_y = grad_y if grad_y is not None else hs.new_zeros(x.shape[0], x.shape[1], hs.shape[2])
    dn = zeros(grad_n) if n0 is not None else None
    grads = modlstm_sequence_backward(grad_y, zeros(grad_h), zeros(grad_c), dn, x, w_x, w_h, ln_w, peep, h0, c0, n0,
                                      keep, acts, _some(pre), cs, hs, _some(ns), _some(ln_in), _some(ln_stats),
                                      ctx.gate, ctx.coupled, ctx.has_bias)
    # m is a constant to differentiation; keep, gate and coupled have none
    return (*(_some(g) for g in grads), None, None, None, None)


modlstm_sequence.register_autograd(_gradients, setup_context=_save)


# ---------------------------------------------------------------------- the time loops
# The Python form of the kernel's two loops; rpt/kernels/cpu/recurrent_loops.cpp is the same loops in
# C++ (used when it is built and the gate is a built-in one), step for step.

def forward_steps(cell: Variant, XP, W: PackedLinear, keep, state, acts, pre, cs, hs, ns, ln_in, ln_stats,
                  ln_w, ln_b, peep):
    """Run the recurrence over XP (the input projections, [T, B, G*H]), filling the buffers step by step;
    returns the state after the last step."""
    T, B, G, H = acts.shape
    h, c = state[0], state[1]
    n, m = (state[2], state[3]) if cell.exp else (None, None)
    gi = {g: k for k, g in enumerate(cell.groups)}
    n_dc = G - 1  # gates driven by dc: (i, f, z) or (f, z); the output gate is last
    use_sigmoid = cell.gate_fn is not None and cell.gate_fn.fn is torch.sigmoid
    keeps = keep[:, :, None].unbind(0) if keep is not None else [None] * T
    ns_t = ns.unbind(0) if cell.exp else [None] * T
    for t, (xp, a, c_out, h_out, n_out, kt) in enumerate(
            zip(XP.unbind(0), acts.unbind(0), cs.unbind(0), hs.unbind(0), ns_t, keeps)):
        if kt is not None:
            h, c = h * kt, c * kt
            if cell.exp:
                n, m = n * kt, m * kt
        P = W(h, xp).view(B, G, H)
        if cell.gate_norm:
            ln_in[t] = P
            P, mean, rstd = torch.native_layer_norm(P, (H,), None, None, LN_EPS)
            ln_stats[t, 0], ln_stats[t, 1] = mean, rstd
            P = torch.addcmul(ln_b, P, ln_w)
        if cell.exp:
            P_i, P_f, P_z, P_o = P.unbind(1)
            a_i, a_f, a_z, a_o = a.unbind(1)
            m_prev = torch.where(n > 0, m, torch.full_like(m, -math.inf))
            m = torch.maximum(P_f + m_prev, P_i)
            torch.exp(P_i - m, out=a_i)
            torch.exp(P_f + m_prev - m, out=a_f)
            torch.tanh(P_z, out=a_z)
            torch.sigmoid(P_o, out=a_o)
            c = torch.addcmul(a_f * c, a_i, a_z, out=c_out)
            n = torch.addcmul(a_i, a_f, n, out=n_out)
            h = torch.mul(a_o, c / n, out=h_out)
            continue
        if cell.peepholes:
            P[:, :n_dc - 1] += peep[:-1] * c[:, None]  # i (and f) read c_{t-1}
        gate_in = P[:, :n_dc - 1]  # (i, f) or (f)
        if use_sigmoid:
            torch.sigmoid(gate_in, out=a[:, :n_dc - 1])
        else:
            a[:, :n_dc - 1] = cell.gate_fn.fn(gate_in)
        torch.tanh(P[:, n_dc - 1], out=a[:, n_dc - 1])
        a_f, a_z = a[:, gi["f"]], a[:, n_dc - 1]
        a_i = 1 - a_f if cell.coupled else a[:, 0]
        c = torch.addcmul(a_f * c, a_i, a_z, out=c_out)
        if cell.peepholes:
            P[:, G - 1] += peep[-1] * c  # o reads c_t
        torch.sigmoid(P[:, G - 1], out=a[:, G - 1])
        h = torch.mul(a[:, G - 1], torch.tanh(c), out=h_out)
        if pre is not None:
            pre[t] = P
    return (h, c, n, m) if cell.exp else (h, c)  # (views of the buffers: the operator copies them)


def previous(xs, x0, keep3):
    """The state each step read ([T, B, H]): x0, then xs shifted by one step, after each step's reset."""
    prev = torch.cat([x0[None], xs[:-1]])
    return prev * keep3 if keep3 is not None else prev


def backward_factors(cell: Variant, acts, pre, cs, ns, keep3, state, peep):
    """Everything of the backward that does not depend on its recurrence, for all steps at once:
        dP_o = dh * K_o;  dc += dh * K_c;  dP[dc-driven gates] = dc * K_dc (+ dn * K_dn);  dc_prev = dc * K_cc
    Returns (K_c, K_o, K_dc, K_cc, K_n, K_dn), the last two None but for the exponential gate. (The native loops'
    CPU form derives these inside each step's pass instead: modlstm_backward_cpu in recurrent_loops.cpp.)"""
    gi = {g: k for k, g in enumerate(cell.groups)}
    o, z, f = acts[:, :, gi["o"]], acts[:, :, gi["z"]], acts[:, :, gi["f"]]
    c_prev = previous(cs, state[1], keep3)
    K_n = K_dn = None
    if cell.exp:
        n = ns
        n_prev = previous(ns, state[2], keep3)
        i = acts[:, :, gi["i"]]
        hhat = cs / n
        K_o = hhat * o * (1 - o)
        K_c = o / n
        K_n = -o * hhat / n
        K_dc = torch.stack([z * i, c_prev * f, i * (1 - z * z)], dim=2)  # (i, f, z)
        K_dn = torch.stack([i, n_prev * f], dim=2)  # (i, f)
        K_cc = f
    else:
        tc = torch.tanh(cs)
        K_o = tc * o * (1 - o)
        K_c = o * (1 - tc * tc)
        if cell.peepholes:
            K_c = K_c + K_o * peep[-1]
        gate_input = (lambda g: pre[:, :, gi[g]]) if pre is not None else (lambda g: None)
        gf = cell.gate_fn.grad(gate_input("f"), f)
        if cell.coupled:
            i = 1 - f
            K_f = (c_prev - z) * gf
            K_dc = torch.stack([K_f, i * (1 - z * z)], dim=2)  # (f, z)
            K_cc = f + K_f * peep[0] if cell.peepholes else f
        else:
            i = acts[:, :, gi["i"]]
            K_i = z * cell.gate_fn.grad(gate_input("i"), i)
            K_f = c_prev * gf
            K_dc = torch.stack([K_i, K_f, i * (1 - z * z)], dim=2)  # (i, f, z)
            K_cc = f + K_i * peep[0] + K_f * peep[1] if cell.peepholes else f
    if keep3 is not None:
        K_cc = K_cc * keep3
    return K_c, K_o, K_dc, K_cc, K_n, K_dn


def backward_steps(grad_y, K_c, K_o, K_dc, K_cc, K_n, K_dn, dP, dP_raw, keep3, WT: PackedLinear, dh, dc, dn,
                   ln_w, ln_in, ln_stats):
    """Run the gradient back through time over the precomputed factors, filling dP (and dP_raw, the gradient
    before the gate layer norm); returns the gradient of the initial state: (dh, dc), or (dh, dc, dn)."""
    T, B, G, H = dP.shape
    keeps = keep3.unbind(0) if keep3 is not None else [None] * T
    per_step = zip(range(T), grad_y.unbind(0), K_c.unbind(0), K_o.unbind(0), K_dc.unbind(0), K_cc.unbind(0),
                   dP.unbind(0), dP_raw.unbind(0), keeps)
    for t, gy, k_c, k_o, k_dc, k_cc, dp, dp_raw, kt in reversed(list(per_step)):
        dh = dh + gy
        dc = torch.addcmul(dc, dh, k_c)
        torch.mul(dh, k_o, out=dp[:, G - 1])
        torch.mul(dc[:, None], k_dc, out=dp[:, :G - 1])
        if K_n is not None:  # the exponential gate's normaliser
            dn = torch.addcmul(dn, dh, K_n[t])
            dp[:, :2].addcmul_(dn[:, None], K_dn[t])
            dn = dn * k_cc  # K_cc is f (with the reset folded in)
        if ln_w is not None:
            dp_raw.copy_(torch.ops.aten.native_layer_norm_backward(
                dp * ln_w, ln_in[t], (H,), ln_stats[t, 0], ln_stats[t, 1], None, None, (True, False, False))[0])
        dc = dc * k_cc
        dh = WT(dp_raw.view(B, G * H))
        if kt is not None:
            dh = dh * kt
    return (dh, dc, dn) if K_n is not None else (dh, dc)
