"""The gated delta rule, one step of one head per (row, head): a matrix memory corrected rather than accumulated.

    S'_t = alpha_t S_{t-1}                                   the decay, alpha_t = exp(g_t), g_t <= 0
    u_t  = beta_t (v_t - S'_t^T k_t)                         what the memory gets wrong about v_t, beta_t in (0, 1)
    S_t  = S'_t + k_t u_t^T                                  [d_k, d_v]: the key's row corrected toward v_t
    o_t  = S_t^T q_t

Below the recurrence, the layer around it (`project`, `read_out`, `gdn_layer_step`): per head a query, key and
value after a short causal convolution and SiLU, keys and queries L2-normalised (the query also scaled by
1/sqrt(d_k)); the decay g = -exp(A_log) softplus(a + dt_bias) as Mamba2 forms it; the write strength beta =
sigmoid(b); the read normalised per head (RMS, a learned scale), gated by SiLU of an output gate, projected back.
The zero state is the initial state and what a reset at a document boundary restores (the convolution's inputs
included). Plain torch only: the readable reference the other forms are tested against, the step generation
runs, and the file `rpt export` will ship.
"""

import torch
import torch.nn.functional as F
from torch import nn

NORM_EPS = 1e-6


def gdn_step(q, k, v, g, beta, S):
    """q, k: [..., d_k]; v: [..., d_v]; g, beta: [...]; S: [..., d_k, d_v]. Returns o [..., d_v] and the new S."""
    S = torch.exp(g)[..., None, None] * S
    u = beta[..., None] * (v - (k[..., None, :] @ S)[..., 0, :])
    S = S + k[..., :, None] * u[..., None, :]
    return (q[..., None, :] @ S)[..., 0, :], S


def conv_step(x_t, inputs, weight):
    """The short causal convolution for one token: x_t [B, C]; inputs, its last width - 1 inputs [B, width - 1, C];
    weight [C, width] (the last tap on x_t). Returns y_t [B, C] and the new inputs."""
    window = torch.cat([inputs.to(x_t.dtype), x_t[:, None]], dim=1)  # [B, width, C]
    return (window * weight.T).sum(1), window[:, 1:]


def split(x, heads: int, d_k: int, d_v: int):
    """The projection's columns: q, k and v together [..., heads * (2 d_k + d_v)] (what the convolution reads),
    the output gate [..., heads * d_v], a, b [..., heads] (the decay's and the write strength's pre-activations)."""
    return x.split([heads * (2 * d_k + d_v), heads * d_v, heads, heads], dim=-1)


def heads_of(qkv, a, b, A_log, dt_bias, heads: int, d_k: int):
    """From the convolved q, k, v [..., 2 heads d_k + heads d_v]: q, k [..., heads, d_k] (SiLU, L2-normalised,
    q scaled by d_k^-0.5), v [..., heads, d_v] (SiLU), the log decay g and beta [..., heads]."""
    q, k, v = F.silu(qkv).split([heads * d_k, heads * d_k, qkv.shape[-1] - 2 * heads * d_k], dim=-1)
    q, k, v = (t.unflatten(-1, (heads, -1)) for t in (q, k, v))
    q = F.normalize(q, dim=-1) * d_k ** -0.5
    k = F.normalize(k, dim=-1)
    g = -torch.exp(A_log) * F.softplus(a + dt_bias)
    return q, k, v, g, torch.sigmoid(b)


def read_out(o, gate, norm_weight, out_weight, linear=F.linear):
    """From o [..., heads, d_v]: each head's RMS norm, a learned scale, the SiLU output gate, the projection back."""
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    return linear(o.flatten(-2) * norm_weight * F.silu(gate), out_weight)


def gdn_layer_step(x_t, state, proj_weight, conv_weight, A_log, dt_bias, norm_weight, out_weight, heads: int,
                   d_k: int, linear=F.linear):
    """The whole layer for one token x_t [B, d_model]; state (S [B, heads, d_k, d_v], the convolution's last
    inputs [B, width - 1, channels])."""
    S, inputs = state
    d_v = S.shape[-1]
    qkv, gate, a, b = split(linear(x_t, proj_weight), heads, d_k, d_v)
    qkv, inputs = conv_step(qkv, inputs, conv_weight)
    q, k, v, g, beta = heads_of(qkv, a, b, A_log, dt_bias, heads, d_k)
    o, S = gdn_step(q, k, v, g, beta, S)
    return read_out(o, gate, norm_weight, out_weight, linear), (S, inputs)


class Layer(nn.Module):
    """The layer `rpt export` builds from this file (modeling_rpt.py imports it as spec_cell.Layer): its weights by
    the names rpt's cell gives them, so a checkpoint loads unchanged; a zero state (the reset's); one step."""

    def __init__(self, cfg, conv_width: int = 4):
        super().__init__()
        H, D, self.heads = cfg.d_hidden, cfg.d_model, cfg.heads
        self.head_dim = H // cfg.heads
        self.proj = nn.Linear(D, 4 * H + 2 * cfg.heads, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(3 * H, conv_width))
        self.A_log = nn.Parameter(torch.zeros(cfg.heads))
        self.dt_bias = nn.Parameter(torch.zeros(cfg.heads))
        self.norm_weight = nn.Parameter(torch.ones(H))
        self.out_proj = nn.Linear(H, D, bias=False)

    def init_state(self, batch: int, like: torch.Tensor) -> tuple:
        d, width = self.head_dim, self.conv_weight.shape[-1]
        return like.new_zeros(batch, self.heads, d, d), like.new_zeros(batch, width - 1, self.conv_weight.shape[0])

    def step(self, x, state):
        return gdn_layer_step(x, state, self.proj.weight, self.conv_weight, self.A_log, self.dt_bias,
                              self.norm_weight, self.out_proj.weight, self.heads, self.head_dim)
