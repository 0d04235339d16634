"""The optimiser: AdamW with parameter groups, or SGD with momentum (its learning rate: rpt/train/budget.py).

Weight decay applies to the matrices of the cells, attention, MLP and head; not to norms,
biases, residual gates, peepholes or the embedding (decaying a tied embedding decays the
head too, and decaying gates and norms pulls them towards zero, not towards their init). The last
pipeline stage's copy of a tied embedding (named head.weight there) is the embedding too.
"""

from __future__ import annotations

import torch

from rpt.config import TrainConfig

NO_DECAY_NAMES = ("embed", "norm", "gate", "bias", "peep", "ln_")


def param_groups(model: torch.nn.Module, weight_decay: float, only=None) -> list[dict]:
    """AdamW groups over the model's trainable parameters (those in `only`, when given)."""
    keep = None if only is None else {id(p) for p in only}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or (keep is not None and id(p) not in keep):
            continue
        leaf = name.rsplit(".", 1)[-1]
        tied_copy = name == "head.weight" and getattr(getattr(model, "cfg", None), "tie_embeddings", False)
        if tied_copy or p.dim() < 2 or any(k in name for k in NO_DECAY_NAMES) or leaf.startswith(("b_", "original0")):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, only=None) -> torch.optim.Optimizer | None:
    """`cfg.optimizer` over `only` (default: every parameter); None when that is empty (a parameter-server worker).

    SGD takes no weight decay: torch's is coupled to the learning rate, which at SGD's rates (1-20) would shrink
    the weights by whole multiples of wd each step."""
    groups = [g for g in param_groups(model, cfg.weight_decay, only) if g["params"]]
    if not groups:
        return None
    # fused: one kernel per parameter group on GPU and CPU alike, and it can skip a step on the device (below)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), fused=True)
    optimizer = torch.optim.SGD([{**g, "weight_decay": 0.0} for g in groups], lr=cfg.lr, momentum=cfg.momentum,
                                fused=True)
    if cfg.momentum:  # fused SGD makes its buffers on the first step even when it skips it, then reads them unset
        for p in (p for g in groups for p in g["params"]):
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return optimizer
