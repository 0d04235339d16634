"""The runner of a pipeline rank (rpt/parallel/runner.py): its stages' forward and backward go through the
schedule (rpt/parallel/pipeline.py), the gradient norm adds every stage's share, a validation sends activations
stage to stage; each step's record carries the stages' compute and wall seconds, and `finish` the idle share by
stage over the run."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rpt.comm.gradient_sync import GradientSync
from rpt.parallel.pipeline import Pipeline, PipelineEval
from rpt.parallel.runner import Layout, Runner


class PipelineRunner(Runner):
    partial = True  # a stage holds some of the model's parts: checkpoints load the parts it has

    def __init__(self, pipe: Pipeline, sync: GradientSync, train, layout: Layout, probe: bool = True):
        super().__init__(pipe.model, sync, train, layout, probe)
        self.pipe = pipe

    def _forward_backward(self, x, y, reset, state, depth, clock, in_forward):
        """Every micro-batch through the schedule; its compute split into forward and backward for the clock."""
        pipe = self.pipe
        pipe.state = state
        with self.autocast():
            loss = pipe.step(x, y, reset, depth)
        backward = sum(pipe.marks)
        clock.add("forward", pipe.compute_seconds - backward)
        clock.add("backward", backward)
        return loss, pipe.state

    def _clip_grad_norm(self) -> torch.Tensor:
        return self.pipe.clip_grad_norm(self.grad_clip)  # over every stage's gradients

    def eval_model(self):
        return PipelineEval(self.pipe)

    def probes(self):
        """Each stage probes its own blocks with the activations it received."""
        return [(st.lm, st.state_of) for st in self.pipe.stages] if self._probe else []

    def _stage_seconds(self) -> tuple[float, float] | None:
        """This step's (compute, wall) seconds of this rank's stages: telemetry's idle share per log line."""
        return self.pipe.history[-1] if self.pipe.history else None

    def finish(self) -> dict:
        return {**super().finish(), **self._bubble_by_stage()}

    def _bubble_by_stage(self) -> dict:
        """Pipeline idle share per stage over the run (the first step, which sets up the links, left out), and
        what the schedule would leave idle with these stage costs and no overhead: with c_s the compute of
        rank s per micro-batch and v stages per rank, a step takes m max(c) + (sum(c) - max(c)) / v, so
        rank s idles 1 - m c_s / that (equal ranks: (p - 1) / (v m + p - 1))."""
        pipe = self.pipe
        steps = pipe.history[1:] or pipe.history
        mine = torch.tensor([sum(c for c, _ in steps), sum(w for _, w in steps), len(steps)], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(self.layout.world_size)]
        dist.all_gather(every, mine)
        layout = pipe.mesh.layout  # [stage][data rank] -> rank
        compute = [sum(float(every[r][0] / every[r][2]) for r in reps) / len(reps) for reps in layout]  # per step
        wall = [sum(float(every[r][1] / every[r][2]) for r in reps) / len(reps) for reps in layout]
        m = pipe.plan.microbatches
        ideal_step = max(compute) + (sum(compute) - max(compute)) / (m * pipe.plan.stages_per_rank)
        by_stage = [max(0.0, 1.0 - c / w) for c, w in zip(compute, wall)]
        return {"pipeline_bubble": sum(by_stage) / len(by_stage), "pipeline_bubble_by_stage": by_stage,
                "pipeline_bubble_theory": pipe.plan.bubble_theory,
                "pipeline_bubble_ideal_by_stage": [1.0 - c / ideal_step for c in compute],
                "pipeline_compute_seconds_by_stage": compute, "pipeline_step_seconds": sum(wall) / len(wall),
                "microbatches": m, "pipeline_schedule": pipe.schedule_name}
