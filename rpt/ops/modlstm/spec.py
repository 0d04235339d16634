"""The modified LSTM's step: gate functions by name, optional gate layer norm, coupled gates, peepholes, and the
stabilised exponential gate (xLSTM's sLSTM gating). The spec rpt's modlstm cell and the exported modeling_rpt.py
both run, and the built-in gate functions they both take. Plain torch only: `rpt export` copies this file.

    P = W_x x_t + b + W_h h_{t-1}                     pre-activations, gate groups (i, f, z, o)
    P = LayerNorm_g(P) * gamma_g + beta_g             if gate_norm (per gate group g)
    P_i += p_i * c_{t-1};  P_f += p_f * c_{t-1}       if peepholes
    sigmoid-family gates (sigmoid, hard_sigmoid, or one registered with register_gate):
        f = gate(P_f);  i = 1 - f if coupled_gates else gate(P_i)
        z = tanh(P_z);  c_t = f * c_{t-1} + i * z
        P_o += p_o * c_t                              if peepholes
        h_t = sigmoid(P_o) * tanh(c_t)
    gate = "exp" (with its log-space stabiliser m):
        m_t = max(P_f + m_{t-1}, P_i)                 (m_{t-1} = -inf for a fresh state)
        i = exp(P_i - m_t);  f = exp(P_f + m_{t-1} - m_t)
        c_t = f * c_{t-1} + i * z;  n_t = f * n_{t-1} + i;  h_t = sigmoid(P_o) * c_t / n_t
      m is a constant to differentiation (the state, initial m included, is read at fixed m): h
      does not depend on the choice of m, since c and n carry the same factor exp(-m).
"""


import torch
import torch.nn.functional as F
from torch import nn

LN_EPS = 1e-5


def hard_sigmoid(x):
    return torch.clamp(x / 6 + 0.5, 0.0, 1.0)


def hard_sigmoid_grad(x, y):
    return ((x > -3) & (x < 3)).to(x.dtype) / 6


def sigmoid_grad(x, y):
    return y * (1 - y)


# The built-in gates: name -> (fn(x), grad(x, y) = dy/dx given y = fn(x)). "exp" is the stabilised special case.
GATES = {"sigmoid": (torch.sigmoid, sigmoid_grad), "hard_sigmoid": (hard_sigmoid, hard_sigmoid_grad)}


def gate_groups(coupled: bool) -> tuple:
    """Gate groups in memory order: the ones driven by dc first, the output gate last."""
    return ("f", "z", "o") if coupled else ("i", "f", "z", "o")


def modlstm_step(x_t, state, w_x, w_h, bias, ln_w, ln_b, peep, gate, coupled, linear=F.linear):
    """One step of the recurrence above: x_t [B, D]; state (h, c), or (h, c, n, m) for the exponential gate;
    w_h the dense recurrent matrix [G H, H]; bias, the gate norm's (ln_w, ln_b) [G, H] and the peepholes
    [G - 1, H] each None where unused; `gate` the gate function, None for "exp". Returns h_t and the state."""
    groups = gate_groups(coupled)
    H, G = w_h.shape[1], len(groups)
    P = linear(x_t, w_x) + linear(state[0], w_h)
    if bias is not None:
        P = P + bias
    P = P.view(-1, G, H)
    if ln_w is not None:
        P = F.layer_norm(P, (H,), eps=LN_EPS) * ln_w + ln_b
    g = dict(zip(groups, P.unbind(1)))
    if gate is None:
        h, c, n, m = state
        m_prev = torch.where(n > 0, m.detach(), torch.full_like(m, float("-inf")))
        m = torch.maximum(g["f"] + m_prev, g["i"]).detach()
        i, f = torch.exp(g["i"] - m), torch.exp(g["f"] + m_prev - m)
        c = f * c + i * torch.tanh(g["z"])
        n = f * n + i
        h = torch.sigmoid(g["o"]) * c / n
        return h, (h, c, n, m)
    h, c = state
    P_f, P_o = g["f"], g["o"]
    if peep is not None:
        P_f = P_f + peep[-2] * c
    f = gate(P_f)
    if coupled:
        i = 1 - f
    else:
        i = gate(g["i"] + peep[0] * c if peep is not None else g["i"])
    c = f * c + i * torch.tanh(g["z"])
    if peep is not None:
        P_o = P_o + peep[-1] * c
    h = torch.sigmoid(P_o) * torch.tanh(c)
    return h, (h, c)


class Layer(nn.Module):
    """The layer `rpt export` builds from this file (modeling_rpt.py imports it as spec_cell.Layer): its weights by
    the names rpt's cell gives them, so a checkpoint loads unchanged; a zero state (the reset's); one step."""

    def __init__(self, cfg):
        super().__init__()
        H, D, self.heads = cfg.d_hidden, cfg.d_model, cfg.heads
        self.coupled, self.gate_norm = cfg.coupled_gates, cfg.gate_norm
        self.gate_fn = None if cfg.gate == "exp" else GATES[cfg.gate][0]
        self.groups = gate_groups(self.coupled)
        G, self.n_state = len(self.groups), 4 if cfg.gate == "exp" else 2
        self.w_x, self.w_h = nn.Parameter(torch.empty(G * H, D)), nn.Parameter(torch.empty(G * H, H // cfg.heads))
        if self.gate_norm:
            self.bias = None
            self.ln_weight, self.ln_bias = nn.Parameter(torch.ones(G, H)), nn.Parameter(torch.zeros(G, H))
        else:
            self.bias = nn.Parameter(torch.zeros(G * H))
        self.peep = nn.Parameter(torch.zeros(G - 1, H)) if cfg.peepholes else None
        self.proj = nn.Linear(H, D, bias=False) if H != D else None

    def init_state(self, batch: int, like: torch.Tensor) -> tuple:
        H = self.w_h.shape[0] // len(self.groups)
        return tuple(like.new_zeros(batch, H) for _ in range(self.n_state))

    def step(self, x, state):
        # w_h holds each head's [d, d] blocks (xLSTM's sLSTM heads); the step multiplies the dense matrix
        w_h = torch.cat([torch.block_diag(*g.chunk(self.heads)) for g in self.w_h.chunk(len(self.groups))])
        ln_w, ln_b = (self.ln_weight, self.ln_bias) if self.gate_norm else (None, None)
        h, state = modlstm_step(x, state, self.w_x, w_h, self.bias, ln_w, ln_b, self.peep, self.gate_fn, self.coupled)
        return (self.proj(h) if self.proj is not None else h), state
