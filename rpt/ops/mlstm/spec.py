"""The mLSTM (Beck et al. 2024, "xLSTM"), one step of one head per (row, head): an LSTM whose memory is a matrix.

    m_t = max(log f_t + m_{t-1}, i~_t)                     the stabiliser: a running maximum of the log gates
    f'_t = exp(log f_t + m_{t-1} - m_t),  i'_t = exp(i~_t - m_t)
    C_t = f'_t C_{t-1} + i'_t k_t v_t^T                    [d_k, d_v]: the matrix memory
    n_t = f'_t n_{t-1} + i'_t k_t                          [d_k]: the normaliser
    h_t = C_t^T q_t / (max(|n_t . q_t|, exp(-m_t)) + EPS)

with f_t = sigmoid(f~_t) (passed as log f_t = logsigmoid(f~_t)) and the input gate exp(i~_t). Below the
recurrence, the layer around it (`project`, `read_out`, `mlstm_layer_step`): rpt's cell and the exported model both
run these. (C, n) are the true
memory scaled by exp(-m_t), so every weight is at most 1 and nothing overflows; the output does not depend on the
stabiliser (numerator and bound scale alike), which is what lets the other forms choose theirs. The zero state
(C = 0, n = 0, m = 0) is the initial state and what a reset at a document boundary restores.

Plain torch only: the readable reference the other forms are tested against, the step that generation runs, and
the file `rpt export` ships beside modeling_rpt.py.
"""

import torch
import torch.nn.functional as F
from torch import nn

EPS = 1e-6


def mlstm_step(q, k, v, i_pre, log_f, state):
    """q, k: [..., d_k]; v: [..., d_v]; i_pre, log_f: [...]; state (C [..., d_k, d_v], n [..., d_k], m [...]).
    Returns h [..., d_v] and the new state."""
    C, n, m = state
    m_new = torch.maximum(log_f + m, i_pre)
    f = torch.exp(log_f + m - m_new)
    i = torch.exp(i_pre - m_new)
    C = f[..., None, None] * C + i[..., None, None] * (k[..., :, None] * v[..., None, :])
    n = f[..., None] * n + i[..., None] * k
    num = (q[..., :, None] * C).sum(-2)
    bound = torch.maximum((q * n).sum(-1).abs(), torch.exp(-m_new)) + EPS
    return num / bound[..., None], (C, n, m_new)


NORM_EPS = 1e-6


def project(x, qkvo_weight, gates_weight, gates_bias, heads: int, linear=F.linear):
    """The layer's input side, from x [..., d_model]: q, k, v [..., heads, d] (k scaled by 1/sqrt(d)), the gates'
    pre-activations i~ and log f [..., heads], and the output gate's pre-activation o [..., heads * d]."""
    q, k, v, o = linear(x, qkvo_weight).chunk(4, dim=-1)
    i_pre, f_pre = linear(x, gates_weight, gates_bias).chunk(2, dim=-1)
    shape = (*x.shape[:-1], heads, q.shape[-1] // heads)
    k = k * shape[-1] ** -0.5
    return q.reshape(shape), k.reshape(shape), v.reshape(shape), i_pre, F.logsigmoid(f_pre), o


def read_out(h, o, norm_weight, out_weight, linear=F.linear):
    """The layer's output side, from h [..., heads, d]: each head's RMS norm, a learned scale, the sigmoid output
    gate, the projection back to d_model."""
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    return linear(h.flatten(-2) * norm_weight * torch.sigmoid(o), out_weight)


def mlstm_layer_step(x_t, state, qkvo_weight, gates_weight, gates_bias, norm_weight, out_weight, heads: int,
                     linear=F.linear):
    """The whole layer for one token x_t [B, d_model]: what rpt's mlstm cell and the exported model generate with."""
    q, k, v, i_pre, log_f, o = project(x_t, qkvo_weight, gates_weight, gates_bias, heads, linear)
    h, state = mlstm_step(q, k, v, i_pre, log_f, state)
    return read_out(h, o, norm_weight, out_weight, linear), state


class Layer(nn.Module):
    """The layer `rpt export` builds from this file (modeling_rpt.py imports it as spec_cell.Layer): its weights by
    the names rpt's cell gives them, so a checkpoint loads unchanged; a zero state (the reset's); one step."""

    def __init__(self, cfg):
        super().__init__()
        H, D, self.heads = cfg.d_hidden, cfg.d_model, cfg.heads
        self.qkvo = nn.Linear(D, 4 * H, bias=False)
        self.gates = nn.Linear(D, 2 * cfg.heads)
        self.norm_weight = nn.Parameter(torch.ones(H))
        self.out_proj = nn.Linear(H, D, bias=False)

    def init_state(self, batch: int, like: torch.Tensor) -> tuple:
        n, d = self.heads, self.norm_weight.shape[0] // self.heads
        return like.new_zeros(batch, n, d, d), like.new_zeros(batch, n, d), like.new_zeros(batch, n)

    def step(self, x, state):
        return mlstm_layer_step(x, state, self.qkvo.weight, self.gates.weight, self.gates.bias, self.norm_weight,
                                self.out_proj.weight, self.heads)
