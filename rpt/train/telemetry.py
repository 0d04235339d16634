"""The monitor section as a component of the trainer: what each log interval records and where it goes.

Every `monitor.log_interval` steps the ranks gather one vector each (rpt.monitor.metrics) with their phase
times, communication, memory, recurrent-state RMS and gate saturation per layer; rank 0 writes the train line
to metrics.jsonl, the store (metrics.sqlite, which the dashboard reads) and the sinks (TensorBoard, W&B), and
shows the progress on the terminal (a bar, or plain lines off a terminal). Evaluations, the profiled steps and
summary.json go the same ways.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from rpt.monitor import sinks
from rpt.monitor.metrics import (InputProbe, gate_saturation, gather_rows, memory_bytes, pack, state_rms, stragglers,
                                 unpack)
from rpt.monitor.store import MetricsWriter
from rpt.models.lm import rows

log = logging.getLogger("rpt.train")


class Telemetry:
    def __init__(self, trainer, show_progress: bool):
        self.tr, self.cfg = trainer, trainer.cfg.monitor
        self.d, self.run_dir = trainer.d, trainer.run_dir
        self.show_progress = show_progress and self.d.is_main
        self.comm_window: list[dict] = []  # per-step communication figures since the last log line
        self.last_train_loss: float | None = None
        pipe = trainer.pipe  # the gate probe: each stage's first input of a logged step, through its blocks
        self.probed = [(st.lm, st.state_of) for st in pipe.stages] if pipe else [(trainer.model, lambda s: s)]
        if trainer.sync.mode == "fsdp":  # its step forms would all-gather every block once per probed token
            self.probed = []
        self.probe = InputProbe([lm for lm, _ in self.probed])
        self.store: MetricsWriter | None = None
        self.sinks: list = []
        self.bar = None

    def should_log(self, step: int) -> bool:
        return step % self.cfg.log_interval == 0

    def open(self) -> None:
        """After the run directory is written: the store, the sinks, the bar and the start lines."""
        tr, t = self.tr, self.tr.cfg.train
        if self.d.is_main:
            self.store = MetricsWriter(self.run_dir)
            self.sinks = sinks.open_sinks(self.cfg, self.run_dir, tr.cfg.to_dict())
            self.store.set_meta(world_size=self.d.world_size, n_layers=tr.cfg.model.n_layers, params=tr.params,
                                pp=tr.pipe.plan.pp if tr.pipe else 1, dp=tr.dp_size, config=tr.cfg.to_toml(),
                                tokens_per_rank_step=t.batch_size * t.seq_len, budget=tr.budget.describe(),
                                eval_tokens=t.eval_tokens if t.eval_interval else 0)
        # The bar counts per mille of the budget spent (steps, tokens or time, whichever ends the run first), so it
        # shows an ETA for every kind of budget.
        self.bar = tqdm(total=1000, initial=0, disable=not self.show_progress or None, dynamic_ncols=True, desc="train",
                        bar_format="{desc} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]")
        self.started, self.spent_at_start = time.perf_counter(), tr.spent()
        self.window = (tr.step, time.perf_counter(), 0)  # first step, start time, tokens of this log interval
        start = f"training {tr.params:,} parameters on {tr.device}, world size {self.d.world_size}"
        log.info(start)
        self.say(start, *tr.cfg.notes, *self._chosen_comm(), tr.budget.describe(), tr.checkpoints.describe(),
                 *[line for line in [tr.averaging.describe()] if line])
        self.arm_probe()

    def _chosen_comm(self) -> list[str]:
        """What comm.mode = "auto" chose, and the timings it chose by."""
        chosen = self.tr.sync.predictions
        if not chosen:
            return []
        timed = ", ".join(f"{mode} {seconds * 1000:.1f} ms" for mode, seconds in chosen["timed"].items())
        return [f"comm.mode = auto chose {self.tr.sync.mode} with compression {chosen['compression']} (each mode's "
                f"traffic timed on this job's links, per step: {timed}; rpt topology shows the links)"]

    def say(self, *lines: str) -> None:
        """Lines for the terminal (rank 0), above the bar."""
        if self.d.is_main:
            for line in lines:
                tqdm.write(line)

    def step_done(self, tokens: int) -> None:
        first, began, window_tokens = self.window
        self.window = (first, began, window_tokens + tokens)
        self.bar.update(int(1000 * min(1.0, self.tr.spent())) - self.bar.n)
        self.arm_probe()

    def arm_probe(self) -> None:
        """Before a step that will be logged: its first input is kept for the gate probe."""
        if self.should_log(self.tr.step + 1):
            self.probe.arm()

    # ------------------------------------------------------------------ log intervals
    def log_interval(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        tr = self.tr
        tr.mark_phase("log")
        first, began, window_tokens = self.window
        steps, wall = max(1, tr.step - first), time.perf_counter() - began
        self.window = (tr.step, time.perf_counter(), 0)
        mean_loss = self.last_train_loss = mean_across_ranks(loss, self.d)
        comm = self._comm_window_figures()
        pipe = {"pipeline_bubble": tr.pipe.take_bubble()} if tr.pipe else {}
        by_source = getattr(tr.loader, "tokens_by_source", None)  # a mixture: tokens read from each source
        sources = {f"tokens/{name}": n for name, n in by_source().items()} if by_source else {}
        record = {"kind": "train", "step": tr.step, "tokens": tr.tokens, "loss": mean_loss,
                  "grad_norm": grad_norm.item(), "lr": lr, "tokens_per_s": window_tokens / wall,
                  "skipped_steps": tr.skipped_steps, "time": time.time(), **comm, **pipe, **sources}
        log.info(json.dumps(record))
        self._store_interval(record, loss.item(), comm, pipe, steps, wall)
        if self.d.is_main:
            self.bar.set_postfix(step=tr.step, loss=f"{mean_loss:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                                 lr=f"{lr:.2e}")
            where = self.where()
            if self.bar.disable and self.show_progress:  # stdout is no terminal (tee, nohup, SLURM): a plain line instead
                print(progress_line(where, mean_loss, lr, record["tokens_per_s"]), flush=True)
            self.store.set_meta(progress=where)  # the dashboard's "step X of Y, ETA"
            self._append_jsonl(record)

    def where(self) -> dict:
        """How far the run is: step (of max_steps), the spent share of the budget nearest its end, the ETA."""
        tr = self.tr
        spent, ran = min(1.0, tr.spent()), time.perf_counter() - self.started
        eta = ran * (1 - spent) / (spent - self.spent_at_start) if spent > self.spent_at_start else None
        return {"step": tr.step, "max_steps": tr.cfg.train.max_steps, "spent": spent, "eta_s": eta,
                "budget": tr.budget.leading(tr.step, tr.tokens, tr.elapsed())}

    def _comm_window_figures(self) -> dict:
        w, self.comm_window = self.comm_window, []
        if not w or not self.d.enabled:
            return {}
        seconds, exposed = sum(f["comm_seconds"] for f in w), sum(f["exposed_comm_seconds"] for f in w)
        return {"comm_bytes_per_step": sum(f["comm_bytes"] for f in w) / len(w),
                "comm_seconds_per_step": seconds / len(w), "exposed_comm_seconds_per_step": exposed / len(w),
                "hidden_comm_fraction": 1.0 - exposed / seconds if seconds > 0 else None,
                "comm_bytes_by_bucket": w[-1]["comm_bytes_by_bucket"],
                "comm_seconds_by_bucket": _mean_by_key([f["comm_seconds_by_bucket"] for f in w]),
                **self.tr.sync.schedule_in_force()}

    def _store_interval(self, record: dict, my_loss: float, comm: dict, pipe: dict, steps: int, wall: float) -> None:
        """Every rank's figures for this log interval, gathered in one collective; rank 0 writes them."""
        tr = self.tr
        per_step = {f"{phase}_s": seconds / steps for phase, seconds in tr.clock.take().items()}
        exposed = comm.get("exposed_comm_seconds_per_step") or 0.0
        busy = per_step["forward_s"] + per_step["backward_s"] + per_step["optimizer_s"]
        mine = {"step": tr.step, "time": record["time"], "loss": my_loss, "tokens_per_s": record["tokens_per_s"],
                "step_s": wall / steps, **per_step, "exposed_comm_s": exposed,
                "comm_s": comm.get("comm_seconds_per_step", 0.0), "comm_bytes": comm.get("comm_bytes_per_step", 0.0),
                "compute_s": max(0.0, busy - exposed), "memory_bytes": memory_bytes(tr.device),
                "stage": tr.pipe.index if tr.pipe else 0,
                "bubble": pipe.get("pipeline_bubble") if pipe.get("pipeline_bubble") is not None else math.nan}
        n = tr.cfg.model.n_layers
        norms = state_rms(tr.state, tr.pipe.layers if tr.pipe else range(n), n)
        every = gather_rows(pack(mine, norms + self._gate_saturation(n)), self.d.world_size, self.d.enabled)
        if self.store is None:
            return
        ranks, layers = [], {}
        for rank, vector in enumerate(every):
            row, state = unpack(vector)
            ranks.append({**row, "rank": rank})
            for layer, (rms, sat) in enumerate(zip(state[:n], state[n:])):
                if math.isfinite(rms):
                    layers.setdefault(layer, []).append((rms, sat))
        mean = lambda vs: sum(vs) / len(vs) if vs and all(map(math.isfinite, vs)) else math.nan  # noqa: E731
        self.store.write_interval(record, ranks, {k: (mean([r for r, _ in v]), mean([s for _, s in v]))
                                                 for k, v in layers.items()},
                                  comm.get("comm_bytes_by_bucket", {}), stragglers(ranks),
                                  comm.get("comm_seconds_by_bucket", {}))
        for sink in self.sinks:
            sink.scalars(sinks.interval_scalars(record, ranks), tr.step)

    def _gate_saturation(self, n: int) -> list[float]:
        """A few tokens of the logged step through the step forms (~5 ms per log line); each pipeline stage probes
        its own blocks with the activations it received."""
        first_row = rows(self.tr.state, slice(0, 1))
        saturated = [math.nan] * n
        for (lm, state_of), inputs in zip(self.probed, self.probe.inputs):
            shares = gate_saturation(lm, inputs, state_of(first_row), n, int(next(iter(lm.blocks))))
            saturated = [b if math.isnan(a) else a for a, b in zip(shares, saturated)]
        return saturated

    # ------------------------------------------------------------------ evaluations, profile, summary
    def evaluation(self, step: int, result: dict, final: bool, weights_step: int | None = None) -> None:
        """A validation at `step`, of the weights of `weights_step` (the selected ones, in a final evaluation)."""
        weights_step = step if weights_step is None else weights_step
        record = {"kind": "eval", "step": step, "final": final, **result, "weights_step": weights_step,
                  "time": time.time()}
        log.info(json.dumps(record))
        if self.store:
            self.store.write_eval(record)
        for sink in self.sinks:
            sink.scalars(sinks.eval_scalars(record), step)
        self.say(f"step {step}: val loss {result['loss']:.4f}, ppl {result['ppl']:.2f}, bpb {result['bpb']:.4f}"
                 + (" (final, whole split" + (f", the weights of step {weights_step}" if weights_step != step else "")
                    + ")" if final else ""))
        if self.d.is_main:
            self._append_jsonl(record)

    def profile(self) -> list[dict] | None:
        """The profiled steps' timeline summary of every rank (all ranks take part when a range was asked for)."""
        profiler = self.tr.profiler
        if profiler is None:
            return None
        profiler.finish()  # a run that ended inside the range
        keys = ("steps", "wall_s", "compute_s", "comm_s", "overlap_s", "idle_s")
        mine = profiler.summary or dict.fromkeys(keys, 0.0)
        every = gather_rows(torch.tensor([float(mine[k]) for k in keys], dtype=torch.float64), self.d.world_size,
                            self.d.enabled)
        by_rank = [dict(zip(keys, row.tolist())) for row in every]
        if self.store:
            self.store.write_profile(self.tr.step, by_rank)
        return by_rank

    def summary(self, wall: float, final: dict, profile: list[dict] | None, selected: dict) -> dict:
        tr, ev = self.tr, self.tr.evaluation
        per_rank = self._comm_totals_by_rank()  # [world, 4]: steps, bytes, seconds, exposed
        steps = max(1.0, float(per_rank[:, 0].max()))
        total_bytes = float(per_rank[:, 1].sum()) / self.d.world_size
        seconds, exposed = float(per_rank[:, 2].mean()), float(per_rank[:, 3].mean())
        summary = {
            "steps": tr.step, "tokens": tr.tokens, "wall_seconds": round(wall, 3),
            "tokens_per_second": tr.tokens / max(tr.elapsed(), 1e-9),
            "train_loss": self.last_train_loss, "val_loss": final["loss"], "val_ppl": final["ppl"],
            "val_bpb": final["bpb"], "val_tokens": final["tokens"], "val_bytes": final["bytes"],
            "world_size": self.d.world_size, "comm_mode": tr.sync.mode,
            "comm_auto": tr.sync.predictions,  # comm.mode auto: seconds per step, by model and timed
            "compression": tr.cfg.comm.compression, "comm_bytes_total": total_bytes,
            "comm_bytes_per_step": total_bytes / steps,
            "comm_bytes_per_step_by_rank": [float(b) / steps for b in per_rank[:, 1]],
            "comm_seconds_per_step": seconds / steps, "exposed_comm_seconds_per_step": exposed / steps,
            "exposed_comm_fraction": exposed / seconds if seconds > 0 else None,
            "params": tr.params, "flops_per_token": tr.flops_per_token,
            "pp": tr.pipe.plan.pp if tr.pipe else 1, "dp": tr.dp_size, **self._bubble_by_stage(),
            "ended_by": tr.ended_by, "skipped_steps": tr.skipped_steps, "precision": tr.cfg.train.precision,
            "device": str(tr.device), "profile_by_rank": profile, **selected,
            "best_periodic_val_loss": ev.best["loss"] if ev.best else None,
            "eval_seconds": round(ev.seconds, 3), "eval_share": ev.seconds / max(wall, 1e-9),
            "recipe_seconds": round(tr.cfg.recipe_seconds, 3),
            "selection_share": (ev.seconds + tr.cfg.recipe_seconds) / max(wall + tr.cfg.recipe_seconds, 1e-9),
        }
        if self.d.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.store.set_meta(summary=summary)
        for sink in self.sinks:
            sink.finish(summary)
        return summary

    def _comm_totals_by_rank(self) -> torch.Tensor:
        m = self.tr.sync.meter
        mine = torch.tensor([[m.steps, m.total_bytes, m.total_seconds, m.total_exposed]], dtype=torch.float64)
        if not self.d.enabled:
            return mine
        every = [torch.zeros_like(mine) for _ in range(self.d.world_size)]
        dist.all_gather(every, mine)  # gloo carries CPU tensors; on NCCL-only groups this goes through cpu:gloo
        return torch.cat(every)

    def _bubble_by_stage(self) -> dict:
        """Pipeline idle share per stage over the run (the first step, which sets up the links, left out), and
        what the schedule would leave idle with these stage costs and no overhead: with c_s the compute of
        rank s per micro-batch and v stages per rank, a step takes m max(c) + (sum(c) - max(c)) / v, so
        rank s idles 1 - m c_s / that (equal ranks: (p - 1) / (v m + p - 1))."""
        pipe = self.tr.pipe
        if pipe is None:
            return {}
        steps = pipe.history[1:] or pipe.history
        mine = torch.tensor([sum(c for c, _ in steps), sum(w for _, w in steps), len(steps)], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(self.d.world_size)]
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

    def _append_jsonl(self, record: dict) -> None:
        with open(Path(self.run_dir) / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.store:  # the last connection closing folds the WAL into metrics.sqlite: one file to copy
            self.store.close()
            self.store = None


def mean_across_ranks(value: torch.Tensor, d) -> float:
    if d.enabled:
        value = value.detach().clone()
        dist.all_reduce(value)
        value /= d.world_size
    return value.item()


def progress_line(where: dict, loss: float, lr: float, tokens_per_s: float) -> str:
    step = f"step {where['step']:,}" + (f"/{where['max_steps']:,}" if where["max_steps"] else "")
    eta = where["eta_s"]
    eta_text = "?" if eta is None else f"{int(eta // 60)}:{int(eta % 60):02d}"
    return (f"{step}  {100 * where['spent']:.0f}% of {where['budget']}  loss {loss:.4f}  lr {lr:.2e}  "
            f"{tokens_per_s:,.0f} tokens/s  ETA {eta_text}")


def _mean_by_key(dicts: list[dict]) -> dict:
    """Per key, the mean over the steps of a log interval (a key missing in a step counts as 0 there)."""
    keys = sorted({k for d in dicts for k in d})
    return {k: sum(d.get(k, 0.0) for d in dicts) / len(dicts) for k in keys}
