"""The adaptive schedule in one process (a world of one): what a minor group sends, and when."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rpt.comm.accounting import CommMeter
from rpt.comm.adaptive import AdaptiveSchedule
from rpt.config import CommConfig


class FakeBucket:
    """DDP's GradBucket interface over a list of parameters whose .grad is set."""

    def __init__(self, params):
        self.params = params
        self.flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def gradients(self):
        return self.views

    def parameters(self):
        return self.params

    def buffer(self):
        return self.flat

    def index(self):
        return 0


def test_a_minor_group_sends_the_mean_of_its_gradients_every_period_steps(world_of_one):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    cfg = CommConfig(adaptive=True, adaptive_interval=1, adaptive_period=3, adaptive_keep=0.3, adaptive_pin=["0"])
    sched = AdaptiveSchedule(model, cfg, CommMeter(), world_size=1)
    params = list(model.parameters())
    scale = {0: 1.0, 1: 10.0, 2: 0.1}  # group "1" has the largest gradients: important; "2" becomes minor
    sent_for_minor = []
    for step in range(7):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, scale[i // 2] * (step + 1))
        bucket = FakeBucket(params)
        sched.hook(None, bucket).wait()
        for p, v in zip(params, bucket.views):
            p.grad = v.clone()
        sched.after_backward()
        if step >= 1:
            assert sched.period == {"0": 1, "1": 1, "2": 3}
            sent_for_minor.append(None if params[4].grad is None else float(params[4].grad[0, 0]))
    # steps 1..6 under the schedule: group "2" (offset 0) syncs when step % 3 == 0, i.e. at steps 3 and 6,
    # sending the mean of what it accumulated: steps 1-3 -> 0.1 * (2+3+4)/3, steps 4-6 -> 0.1 * (5+6+7)/3
    assert sent_for_minor == [None, None, pytest.approx(0.3), None, None, pytest.approx(0.6)]
    assert sched.in_force()["adaptive_minor"] == ["2"]
