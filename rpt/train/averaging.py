"""Polyak averaging of the weights over the end of a run (`train.average`): the mean of the weights after every
step of the last `average` share of the budget, as the small-corpus LSTM recipes average SGD's iterates.

Once averaging has begun, the run's weights are the average: the periodic validations score it (so selection
chooses among averages), every checkpoint holds it as the model (so `rpt eval`, `export` and `generate` use it),
and the run ends with it; the optimiser goes on from the raw iterate, which a checkpoint keeps beside the average
(this part's state), so a resume continues both exactly. The mean is torch.optim.swa_utils' averaging function;
its AveragedModel is not used, since the average must live in the model's own parameters (a DDP replica's, an
FSDP shard's, a pipeline stage's) while it is validated and saved, not in a second model.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import get_swa_multi_avg_fn


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class WeightAverage:
    def __init__(self, share: float, params: list[torch.nn.Parameter]):
        self.share, self.params = share, [_local(p) for p in params]
        self.average: list[torch.Tensor] | None = None  # the mean of the iterates since averaging began
        self.count = 0
        self.iterate: list[torch.Tensor] | None = None  # the raw weights while the average is in the model
        self._mean = get_swa_multi_avg_fn()

    @property
    def active(self) -> bool:
        return self.count > 0

    def describe(self) -> str | None:
        return f"the weights are averaged over the last {self.share:.0%} of the budget (train.average)" \
            if self.share else None

    @torch.no_grad()
    def step(self, progress: float) -> None:
        """After an optimiser step, with the share of the budget spent: the iterate joins the mean."""
        if not self.share or progress < 1.0 - self.share:
            return
        if self.average is None:
            self.average, self.count = [p.detach().clone() for p in self.params], 1
            return
        self._mean(self.average, [p.detach() for p in self.params], self.count)
        self.count += 1

    @torch.no_grad()
    def put_in(self) -> None:
        """The average into the model; the iterate kept aside."""
        if self.active and self.iterate is None:
            self.iterate = [p.detach().clone() for p in self.params]
            torch._foreach_copy_(self.params, self.average)

    @torch.no_grad()
    def take_out(self) -> None:
        """The iterate back into the model, to train on."""
        if self.iterate is not None:
            torch._foreach_copy_(self.params, self.iterate)
            self.iterate = None

    @contextmanager
    def in_model(self):
        """The model holds the average inside (a validation, a checkpoint), its iterate after."""
        held = self.iterate is not None
        self.put_in()
        try:
            yield
        finally:
            if not held:
                self.take_out()

    def state_dict(self) -> dict:
        """Saved while the average is in the model (which the checkpoint holds): the count and the iterate."""
        if self.active and self.iterate is None:
            raise RuntimeError("a checkpoint of an averaged run is written with the average in the model")
        return {"count": self.count, "iterate": None if self.iterate is None else [t.cpu() for t in self.iterate]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """After the checkpoint's model (the average) is loaded: it becomes the mean, the iterate the weights."""
        self.count = state["count"]
        if self.count:
            self.average = [p.detach().clone() for p in self.params]
            torch._foreach_copy_(self.params, [t.to(p.device) for t, p in zip(state["iterate"], self.params)])
