"""Adaptive depth per token at inference: a looped model ends a token's iterations once another would change little.

Three criteria, from the dearest to the cheapest, each with a threshold:
- "kl": the KL divergence between successive iterations' next-token distributions (the coda and the whole head run
  after every iteration, from the coda's state before the token), as Huginn exits;
- "shortlist": the same KL over the clustered head's first level (its shortlist's tokens and the rarer-token
  entry: the coda and a fraction of the head);
- "change": the state's change from the previous iteration relative to its size (nothing beyond the loop).
A row's iterations end at the first iteration whose criterion is below the threshold, at the latest at the depth
given; its later slots take the state of its last iteration (rpt/ops/loop/spec.py). It runs one token at a time
(the step form): the sequence form (a prompt, an evaluation window) runs every row to the depth given.
"""

from __future__ import annotations

import torch

from rpt.errors import RptError
from rpt.models.heads import ClusteredHead

CRITERIA = ("kl", "shortlist", "change")


def example(name: str, rule: str) -> str:
    """A rule as the interface called `name` takes it: the CLI's flag (--exit kl:5e-4) or the API's field."""
    return f"{name} {rule}" if name.startswith("-") else f'"{name}": "{rule}"'


def how(name: str) -> str:
    return (f"give it as CRITERION:THRESHOLD, e.g. {example(name, 'kl:5e-4')} or {example(name, 'change:0.01')} "
            f"(criteria: {', '.join(CRITERIA)})")


class Exit:
    """An exit rule, and what it saw: `iterations` (summed over the rows of every step it ran), `tokens`, and
    `depths`, the iterations each row of the last step ran."""

    def __init__(self, criterion: str, threshold: float, name: str = "--exit"):
        """`name`: how the interface that received the rule calls it (the CLI's --exit, the API's "exit"), for the
        messages."""
        if criterion not in CRITERIA:
            raise RptError(f"{name}: the criterion {criterion!r} is not one of {', '.join(CRITERIA)}", how(name))
        if not threshold >= 0:
            raise RptError(f"{name}: the threshold {threshold} is negative", "give a threshold of 0 (never exit) or more")
        self.criterion, self.threshold = criterion, threshold
        self.tokens, self.depths, self._iterations = 0, None, torch.zeros((), dtype=torch.long)

    @classmethod
    def parse(cls, text: str, name: str = "--exit") -> "Exit":
        """"kl:5e-4" -> Exit("kl", 5e-4)."""
        criterion, _, threshold = text.partition(":")
        try:
            value = float(threshold)
        except ValueError:
            problem = f"its threshold {threshold.strip()!r} is not a number" if threshold.strip() else \
                "it has no threshold after the criterion"
            raise RptError(f"{name} {text!r}: {problem}", how(name)) from None
        return cls(criterion.strip(), value, name)

    def check(self, model_cfg, name: str = "--exit") -> None:
        """Refuse, before anything runs, a rule the model cannot take (`model_cfg`: its ModelConfig)."""
        if self.criterion == "shortlist" and not model_cfg.head_shortlist:
            raise RptError(f"{name} shortlist: this model's head has no shortlist (model.head_shortlist = 0)",
                           "use the criterion kl or change instead, e.g. " + example(name, "kl:5e-4"))

    @property
    def iterations(self) -> int:
        return int(self._iterations)

    @property
    def mean_depth(self) -> float:
        return self.iterations / max(1, self.tokens)

    def stop(self, model, state: list):
        """The `stop(i, h, previous)` of one step of `model` from `state` (the state before the token)."""
        loop = model.loop
        coda = list(model.blocks.values())[loop.prelude + loop.core:]
        coda_state = state[len(state) - len(coda):]
        if self.criterion == "shortlist" and not isinstance(model.head, ClusteredHead):
            raise RptError("--exit shortlist: this model's head has no shortlist (model.head_shortlist = 0)",
                           "use --exit kl:THRESHOLD or --exit change:THRESHOLD")
        seen = {"previous": None}

        def log_probs(h):
            for block, s in zip(coda, coda_state):
                h, _ = block(h, s, None, True)
            h = model.norm(h) if model.norm is not None else h
            logits = model.head._head_logits(h) if self.criterion == "shortlist" else model.head(h)
            return logits.float().log_softmax(-1)

        def stop(i: int, h: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
            if self.criterion == "change":  # |h - previous| < threshold |h|, squared
                ended = (h - previous).float().pow(2).sum(-1) < self.threshold ** 2 * h.float().pow(2).sum(-1)
            else:
                now, before = log_probs(h), seen["previous"]
                ended = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device) if before is None else \
                    (now.exp() * (now - before)).sum(-1).clamp_min(0) < self.threshold  # 0: never
                seen["previous"] = now
            if i == 0:
                seen["depth"] = self.depths = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
                seen["running"] = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
                self.tokens += h.shape[0]
            seen["depth"] += seen["running"]  # rows that ran iteration i
            self._iterations = self._iterations.to(h.device) + seen["running"].sum()  # (no wait for the device)
            seen["running"] &= ~ended
            return ended

        return stop


class RowDepths:
    """A depth and an exit rule per row (a server's streams, each with its own request): row b runs at most
    `depths[b]` iterations, and its rule, where it has one, may end it earlier. The step runs to the largest depth;
    the loop's `stop` (rpt/ops/loop/spec.py) ends each row where its own limits say, so a row's result does not
    depend on the depths beside it."""

    def __init__(self, depths: torch.Tensor, rules: list[Exit | None]):
        self.depths, self.rules = depths, rules

    def stop(self, model, state: list):
        by_rule = {}  # one criterion's computation per distinct rule, for the rows that asked for it
        for row, rule in enumerate(self.rules):
            if rule is not None:
                by_rule.setdefault((rule.criterion, rule.threshold), (rule, []))[1].append(row)
        checks = [(rule.stop(model, state), torch.tensor(rows, device=self.depths.device))
                  for rule, rows in by_rule.values()]

        def stop(i: int, h: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
            ended = self.depths <= i + 1
            for check, rows in checks:
                ended = ended.index_put((rows,), ended[rows] | check(i, h, previous)[rows])
            return ended

        return stop
