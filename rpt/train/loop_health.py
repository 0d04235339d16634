"""Warnings against a looped model's two known failures (docs/depth.md), read from its validations.

Huginn's authors saw both at scale: a run that ignored its state (the same loss at depth 1 and at depth 32) and a
run whose token representations became identical. Here: the validation at model.loop_mean not better than at
depth 1 once train.loop_ignored_after of the budget is spent, and the tokens' states' spread (LoopWatch) below
COLLAPSED. Each is said once per run.
"""

from __future__ import annotations

COLLAPSED = 0.05  # the tokens' spread (their states' distance from the mean state, over the states' RMS) below it


class LoopHealth:
    def __init__(self, after: float):
        self.after, self.said = after, set()

    def check(self, result: dict, spent: float) -> list[str]:
        """The warnings a validation `result` (with `by_depth`, and `loop` where this rank holds the loop) calls for,
        at `spent` of the budget."""
        by_depth, loop = result.get("by_depth"), result.get("loop")
        if not by_depth:
            return []
        lines = []
        default, shallow = by_depth.get(result["depth"]), by_depth.get(1)
        if spent >= self.after and default and shallow and default["bpb"] >= shallow["bpb"] and "ignored" not in self.said:
            self.said.add("ignored")
            lines.append(f"warning: the loop is being ignored: validation at depth {result['depth']} (model.loop_mean) "
                         f"is {default['bpb']:.4f} bits per byte, no better than at depth 1 ({shallow['bpb']:.4f}), "
                         f"after {spent:.0%} of the budget; more iterations buy nothing (docs/depth.md, 'Reading "
                         "the depth curve', says what helps)")
        if loop and loop["token_spread"] < COLLAPSED and "collapse" not in self.said:
            self.said.add("collapse")
            lines.append(f"warning: the tokens' states have collapsed: their spread is {loop['token_spread']:.3f} "
                         f"of their size (below {COLLAPSED}): every token ends the loop in nearly the same state")
        return lines
