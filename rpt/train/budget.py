"""The run's budgets (steps, tokens, seconds, training FLOPs): which are in force, how much of them is spent, which one
ended the run, and the learning rate over that progress.

Extending a run (resuming with other budgets than the checkpoint was written under) never makes the
learning rate jump: from the rate at the checkpoint, the schedule's shape continues down to its floor
over what remains of the new budget (a run that ended at the floor stays there). The segment is saved
with every checkpoint, so a later resume of the extended run continues it exactly.
"""

from __future__ import annotations

import math

from rpt.config import TrainConfig
from rpt.errors import RptError

KEYS = ("max_steps", "max_tokens", "max_time", "max_flops")


class Budget:
    def __init__(self, cfg: TrainConfig, flops_per_token: float = 0.0):
        """`flops_per_token`: the model's training FLOPs a token, what train.max_flops counts in."""
        self.cfg, self.flops_per_token = cfg, flops_per_token
        self.segment: tuple[float, float] | None = None  # (progress, lr) where an extension began
        self.current_lr = cfg.lr  # the rate of the last step
        self.saved: dict | None = None  # a checkpoint's budget state, until resume() continues from it
        self.rescale = 1.0  # a resumed run's share of its new budget per share of the old (resume())

    def limits(self) -> dict:
        return {k: getattr(self.cfg, k) for k in KEYS if getattr(self.cfg, k)}

    def describe(self) -> str:
        """The budgets in force, as the start of a run states them."""
        units = {"max_steps": "{:,} steps", "max_tokens": "{:,} tokens", "max_time": "{:g} s of training",
                 "max_flops": "{:.3g} training FLOPs"}
        parts = [units[k].format(v) + f" (train.{k})" for k, v in self.limits().items()]
        return "budget: " + " or ".join(parts) + ("; whichever comes first ends the run" if len(parts) > 1 else "")

    def _shares(self, step: int, tokens: int, elapsed: float) -> dict[str, float]:
        """The spent share of each budget set."""
        spent = self._spent(step, tokens, elapsed)
        return {k: spent[k] / v for k, v in self.limits().items()}

    def _spent(self, step: int, tokens: int, elapsed: float) -> dict[str, float]:
        return {"max_steps": step, "max_tokens": tokens, "max_time": elapsed, "max_flops": tokens * self.flops_per_token}

    def progress(self, step: int, tokens: int, elapsed: float) -> float:
        """The spent share of the budget: the largest over the budgets set."""
        return max(self._shares(step, tokens, elapsed).values())

    def leading(self, step: int, tokens: int, elapsed: float) -> str:
        """The budget nearest its end ('train.max_time'): the one that will end the run at this pace."""
        shares = self._shares(step, tokens, elapsed)
        return "train." + max(shares, key=shares.get)

    def ended_by(self, step: int, tokens: int, elapsed: float) -> str | None:
        """The budget that is spent ('train.max_steps = 20'), or None while the run goes on."""
        spent = [k for k, share in self._shares(step, tokens, elapsed).items() if share >= 1.0]
        if not spent:
            return None
        value = getattr(self.cfg, spent[0])
        return f"train.{spent[0]} = {value:g}" if isinstance(value, float) else f"train.{spent[0]} = {value}"

    def lr(self, step: int, progress: float) -> float:
        self.current_lr = self._lr(step, progress)
        return self.current_lr

    def _lr(self, step: int, progress: float) -> float:
        if self.segment is None or self.cfg.schedule == "constant":
            return lr_at(step, progress, self.cfg)
        start, lr0 = self.segment  # an extension: from the checkpoint's rate down to the floor over the rest
        floor = min(lr0, self.cfg.lr * self.cfg.min_lr_ratio)
        return floor + (lr0 - floor) * decay((progress - start) / max(1e-12, 1.0 - start), self.cfg.schedule)

    def state_dict(self) -> dict:
        return {"limits": self.limits(), "segment": self.segment, "lr": self.current_lr}

    def load_state_dict(self, state: dict) -> None:
        self.saved = state

    def resume(self, step: int, tokens: int, elapsed: float, refuse_spent: bool) -> str | None:
        """Continue from the loaded budget state; returns a line to print when the run is being extended (then
        `rescale` is what turns a share of the old budget into one of the new). `refuse_spent`: a run whose budget
        is already spent is refused (resuming it would only re-evaluate)."""
        saved, self.rescale = self.saved, 1.0
        ended = self.ended_by(step, tokens, elapsed)
        if ended and refuse_spent:
            raise RptError(f"this run already spent its budget ({ended}; it is at step {step:,}, {tokens:,} tokens, "
                           f"{elapsed:.0f} s)", f"extend it with a larger budget, e.g. {self.larger(step, elapsed)}")
        if saved is None:  # nothing loaded: the schedule as configured
            return None
        self.segment = saved["segment"]
        if saved["limits"] == self.limits():
            return None
        start = self.progress(step, tokens, elapsed)
        spent = self._spent(step, tokens, elapsed)
        before = max(spent[k] / v for k, v in saved["limits"].items())
        self.rescale = start / before if before > 0 else 1.0
        if step < self.cfg.warmup_steps:
            return None
        self.segment = (start, saved["lr"])
        old = ", ".join(f"train.{k} = {v:g}" for k, v in saved["limits"].items())
        floor = min(saved["lr"], self.cfg.lr * self.cfg.min_lr_ratio)
        rule = ("stays constant" if self.cfg.schedule == "constant" else
                f"continues from {saved['lr']:.2e} down to {floor:.2e} over the rest ({self.cfg.schedule})")
        verb = "extending" if start < before else "shortening" if start > before else "changing"
        return (f"{verb} the run from {old} to {self.describe().removeprefix('budget: ')}: the learning rate "
                f"{rule}; it never jumps back up")

    def larger(self, step: int, elapsed: float) -> str:
        """The --set that doubles the budget in force (what the fix of a spent or stopped run suggests)."""
        if self.cfg.max_time:
            return f"--set train.max_time={max(60, round(2 * max(elapsed, self.cfg.max_time)))}"
        if self.cfg.max_tokens:
            return f"--set train.max_tokens={2 * self.cfg.max_tokens}"
        if self.cfg.max_flops:
            return f"--set train.max_flops={2 * self.cfg.max_flops:.3g}"
        return f"--set train.max_steps={2 * max(step, self.cfg.max_steps)}"


def lr_at(step: int, progress: float, cfg: TrainConfig) -> float:
    """Linear warm-up over warmup_steps, then cosine or linear decay to min_lr_ratio * lr.

    `progress` in [0, 1] is how much of the run's budget is spent: the largest of
    steps / max_steps, tokens / max_tokens, seconds / max_time and FLOPs / max_flops among the budgets set, so the
    decay ends with the run whichever budget ends it. The warm-up's rise ends where it meets the decay: a run
    whose budget gives fewer steps than its warm-up was sized for (a slower machine) still decays.
    """
    floor = cfg.lr * cfg.min_lr_ratio
    curve = floor + (cfg.lr - floor) * decay(progress, cfg.schedule)
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return min(cfg.lr * (step + 1) / cfg.warmup_steps, curve)
    return curve


def decay(progress: float, schedule: str) -> float:
    """The schedule's shape: 1 at the start of the decay, 0 at its end (constant: always 1)."""
    progress = min(1.0, max(0.0, progress))
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1 - progress
    return 0.5 * (1 + math.cos(math.pi * progress))
