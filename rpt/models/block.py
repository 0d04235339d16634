"""One block of the stack: gated pre-norm residual sub-layers around a recurrent cell.

    x = x + gamma_cell * dropout(cell(norm(x)))                  always
    x = x + gamma_attn * attention(norm(x))                      every `attention_every`-th block
    x = x + gamma_mlp  * dropout(mlp(norm(x)))                   when mlp_ratio > 0 (gated SiLU MLP)

The residual gates gamma are learned per channel and start at 1/sqrt(n_layers), so a deep
stack starts close to the identity and every block's contribution grows as it learns: a
48-block stack trains from the first step (a test holds it to that).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rpt.config import ModelConfig
from rpt.errors import RptError
from rpt.models.attention import SlidingWindowAttention
from rpt.models.cells.base import Cell
from rpt.models.registry import get_cell, import_user_modules


def build_cell(cfg: ModelConfig) -> Cell:
    import_user_modules(cfg.imports)
    cls = get_cell(cfg.cell)
    options = {name: getattr(cfg, name) for name in cls.options}  # what the cell declares it takes
    if options.get("forget_bias") == "auto":
        options["forget_bias"] = None  # the cell's (its gate's) own
    cell = cls(cfg.d_model, cfg.d_hidden, **options)
    if cfg.weight_norm:
        apply_weight_norm(cell)
    return cell


def apply_weight_norm(cell: nn.Module) -> None:
    """Weight normalisation (Salimans & Kingma 2016) on every matrix of the cell, kept as a parametrization."""
    for module in list(cell.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dim() == 2:
                torch.nn.utils.parametrizations.weight_norm(module, name, dim=0)


def make_norm(cfg: ModelConfig) -> nn.Module:
    return nn.RMSNorm(cfg.d_model) if cfg.norm == "rmsnorm" else nn.LayerNorm(cfg.d_model)


class GatedMLP(nn.Module):
    def __init__(self, d_model: int, ratio: float):
        super().__init__()
        hidden = max(8, int(round(d_model * ratio / 8)) * 8)
        self.up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        a, b = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(a) * b)

    def flops_per_token(self) -> int:
        return 2 * 3 * self.up.in_features * self.down.in_features


def has_attention(cfg: ModelConfig, index: int) -> bool:
    """Whether block `index` holds the attention sub-layer: every `attention_every`-th block."""
    return bool(cfg.attention_every) and (index + 1) % cfg.attention_every == 0


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        D, gain = cfg.d_model, 1 / math.sqrt(cfg.n_layers)
        self.cell_norm, self.cell = make_norm(cfg), build_cell(cfg)
        self.cell_gate = nn.Parameter(torch.full((D,), gain))
        self.attn = None
        if has_attention(cfg, index):
            self.attn_norm = make_norm(cfg)
            self.attn = SlidingWindowAttention(D, cfg.attention_heads, cfg.attention_window)
            self.attn_gate = nn.Parameter(torch.full((D,), gain))
        self.mlp = None
        if cfg.mlp_ratio > 0:
            self.mlp_norm, self.mlp = make_norm(cfg), GatedMLP(D, cfg.mlp_ratio)
            self.mlp_gate = nn.Parameter(torch.full((D,), gain))
        self.dropout = nn.Dropout(cfg.dropout)

    def init_state(self, batch, device=None, dtype=None):
        cell = self.cell.init_state(batch, device, dtype)
        attn = self.attn.init_state(batch, device, dtype) if self.attn is not None else ()
        return (cell, attn)

    def forward(self, x, state, reset=None, step: bool = False):
        cell_state, attn_state = state
        if step:  # one token, x: [B, D]
            y, cell_state = self.cell.step(self.cell_norm(x), cell_state)
        else:
            y, cell_state = self.cell(self.cell_norm(x), cell_state, reset)
        x = x + self.cell_gate * self.dropout(y)
        if self.attn is not None:
            a_in = self.attn_norm(x)
            y, attn_state = self.attn(a_in[:, None] if step else a_in, attn_state, None if step else reset)
            x = x + self.attn_gate * (y[:, 0] if step else y)
        if self.mlp is not None:
            x = x + self.mlp_gate * self.dropout(self.mlp(self.mlp_norm(x)))
        return x, (cell_state, attn_state)

    def flops_per_token(self) -> int:
        total = self.cell.flops_per_token()
        total += self.attn.flops_per_token() if self.attn is not None else 0
        total += self.mlp.flops_per_token() if self.mlp is not None else 0
        return total
