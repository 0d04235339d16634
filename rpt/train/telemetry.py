"""The monitor section as a component of the trainer: what each log interval records and where it goes.

Every `monitor.log_interval` steps the ranks gather one vector each (rpt.monitor.metrics) with their phase
times, communication, memory, recurrent-state RMS and gate saturation per layer; rank 0 writes the train line
to metrics.jsonl, the store (metrics.sqlite, which the dashboard reads) and the sinks (TensorBoard, W&B), and
shows the progress on the terminal (a bar, or plain lines off a terminal). Evaluations, the profiled steps and
summary.json go the same ways. It is handed its own section of the configuration (monitor), this rank's Layout
(rpt/parallel/runner.py: ranks, stages, the communication mode; immutable), the blocks the gate probe may run and,
at each call, the step's record (StepRecord), the evaluation's result and the values it reports; it reads nothing
of the runner, the trainer or the rest of the configuration.
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
from rpt.models.state import rows

log = logging.getLogger("rpt.train")


class Telemetry:
    def __init__(self, cfg, layout, run_dir: Path, probes: list, show_progress: bool):
        """`cfg`: the monitor section; `layout`: this rank's place (rpt.parallel.runner.Layout); `probes`: the
        gate probe's (model, state_of) pairs, each of which a logged step's first input goes through."""
        self.cfg, self.layout, self.run_dir = cfg, layout, Path(run_dir)
        self.show_progress = show_progress and layout.is_main
        self.comm_window: list[dict] = []  # per-step communication figures since the last log line
        self.busy_window: list[tuple[float, float]] = []  # this rank's pipeline (compute, wall) since the last line
        self.schedule: dict = {}  # adaptive synchronisation's schedule in force at the last step
        self.last_train_loss: float | None = None
        self.probed = probes
        self.probe = InputProbe([lm for lm, _ in self.probed])
        self.store: MetricsWriter | None = None
        self.sinks: list = []
        self.bar = None
        self.flops: tuple[int, float] | None = None  # (the model's training FLOPs a token, the job's peak FLOP/s)

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOP utilisation at `tokens_per_s` (the job's): its training FLOPs a second over the peak of its
        devices in its precision (rpt/runtime/peak.py)."""
        return None if self.flops is None else self.flops[0] * tokens_per_s / self.flops[1]

    def should_log(self, step: int) -> bool:
        return step % self.cfg.log_interval == 0

    def open(self, params: int, step: int, spent: float, notes: tuple[str, ...], budget: str,
             lines: list[str], config: dict, meta: dict) -> None:
        """After the run directory is written: the store, the sinks, the bar and the start lines (`notes`: what
        resolving the configuration chose or warns of; `budget`: what ends the run; `lines`: what the other
        components say of themselves; `config`: the resolved configuration as the sinks record it; `meta`: what
        the store records of the run besides (the configuration's TOML, tokens a rank steps, validation
        tokens))."""
        layout = self.layout
        if layout.is_main:
            self.store = MetricsWriter(self.run_dir)
            self.sinks = sinks.open_sinks(self.cfg, self.run_dir, config)
            self.store.set_meta(world_size=layout.world_size, n_layers=layout.n_layers, params=params, pp=layout.pp,
                                dp=layout.dp_size, budget=budget, **meta)
        # The bar counts per mille of the budget spent (steps, tokens or time, whichever ends the run first), so it
        # shows an ETA for every kind of budget.
        self.bar = tqdm(total=1000, initial=0, disable=not self.show_progress or None, dynamic_ncols=True,
                        desc="train", bar_format="{desc} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]")
        self.started, self.spent_at_start = time.perf_counter(), spent
        self.window = (step, time.perf_counter(), 0)  # first step, start time, tokens of this log interval
        start = f"training {params:,} parameters on {layout.device}, world size {layout.world_size}"
        log.info(start)
        self.say(start, *notes, *self._chosen_comm(), budget, *lines)
        self.arm_probe(step)

    def _chosen_comm(self) -> list[str]:
        """What comm.mode = "auto" chose, and the timings it chose by."""
        chosen = self.layout.comm_choice
        if not chosen:
            return []
        timed = ", ".join(f"{mode} {seconds * 1000:.1f} ms" for mode, seconds in chosen["timed"].items())
        return [f"comm.mode = auto chose {self.layout.comm_mode} with compression {chosen['compression']} (each "
                f"mode's traffic timed on this job's links, per step: {timed}; rpt topology shows the links)"]

    def say(self, *lines: str) -> None:
        """Lines for the terminal (rank 0), above the bar."""
        if self.layout.is_main:
            for line in lines:
                tqdm.write(line)

    def step_done(self, step: int, record, spent: float) -> None:
        """After step `step` (its StepRecord), with `spent` the share of the budget spent."""
        first, began, window_tokens = self.window
        self.window = (first, began, window_tokens + record.tokens)
        self.comm_window.append(record.comm)
        self.schedule = record.schedule
        if record.stage_seconds is not None:
            self.busy_window.append(record.stage_seconds)
        self.bar.update(int(1000 * min(1.0, spent)) - self.bar.n)
        self.arm_probe(step)

    def arm_probe(self, step: int) -> None:
        """Before a step that will be logged: its first input is kept for the gate probe."""
        if self.should_log(step + 1):
            self.probe.arm()

    # ------------------------------------------------------------------ log intervals
    def log_interval(self, record, lr: float, where: dict, skipped_steps: int, phases: dict, state: list,
                     by_source: dict) -> None:
        """The log line of the step of `record`. `where`: how far the run is (the trainer's where()); `phases`:
        seconds per phase since the last log line; `state`: the recurrent state carried; `by_source`: a
        mixture's tokens read from each source."""
        step = where["step"]
        first, began, window_tokens = self.window
        steps, wall = max(1, step - first), time.perf_counter() - began
        self.window = (step, time.perf_counter(), 0)
        mean_loss = self.last_train_loss = mean_across_ranks(record.loss, self.layout)
        comm = self._comm_window_figures()
        bubble = self._bubble()  # a pipeline's idle share since the last line; {} without one
        sources = {f"tokens/{name}": n for name, n in by_source.items()}
        apart = phases["eval"] + phases["checkpoint"]  # validations and checkpoints: not training, reported apart
        train = {"kind": "train", "step": step, "tokens": where["tokens"], "loss": mean_loss,
                 "grad_norm": record.grad_norm.item(), "lr": lr, "tokens_per_s": window_tokens / max(wall - apart, 1e-9),
                 "eval_s": phases["eval"], "checkpoint_s": phases["checkpoint"],
                 "skipped_steps": skipped_steps, "time": time.time(), **comm, **bubble, **sources,
                 **({} if self.flops is None else {"mfu": self.mfu(window_tokens / max(wall - apart, 1e-9))}),
                 **({} if record.depth is None else {"depth": record.depth})}
        log.info(json.dumps(train))
        self._store_interval(train, record.loss.item(), comm, bubble.get("pipeline_bubble"), steps, wall, phases,
                             state)
        if self.layout.is_main:
            self.bar.set_postfix(step=step, loss=f"{mean_loss:.3f}", tok_s=f"{train['tokens_per_s']:,.0f}",
                                 lr=f"{lr:.2e}", **({"mfu": f"{train['mfu']:.1%}"} if "mfu" in train else {}))
            where = self.with_eta(where)
            if self.bar.disable and self.show_progress:  # stdout is no terminal (tee, nohup, SLURM): a plain line
                print(progress_line(where, mean_loss, lr, train["tokens_per_s"], phases["eval"], train.get("mfu")),
                      flush=True)
            self.store.set_meta(progress=where)  # the dashboard's "step X of Y, ETA"
            self._append_jsonl(train)

    def with_eta(self, where: dict) -> dict:
        """`where` (step, max_steps, spent, budget) with the ETA this run's pace so far gives."""
        spent, ran = where["spent"], time.perf_counter() - self.started
        eta = ran * (1 - spent) / (spent - self.spent_at_start) if spent > self.spent_at_start else None
        return {"step": where["step"], "max_steps": where["max_steps"], "spent": spent, "eta_s": eta,
                "budget": where["budget"]}

    def _bubble(self) -> dict:
        """{"pipeline_bubble": this stage's idle share over the steps since the last line}; {} without a pipeline."""
        if self.layout.pp == 1:
            return {}
        w, self.busy_window = self.busy_window, []
        wall = sum(seconds for _, seconds in w)
        return {"pipeline_bubble": max(0.0, 1.0 - sum(c for c, _ in w) / wall) if w and wall > 0 else None}

    def _comm_window_figures(self) -> dict:
        w, self.comm_window = self.comm_window, []
        if not w or not self.layout.distributed:
            return {}
        seconds, exposed = sum(f["comm_seconds"] for f in w), sum(f["exposed_comm_seconds"] for f in w)
        return {"comm_bytes_per_step": sum(f["comm_bytes"] for f in w) / len(w),
                "comm_seconds_per_step": seconds / len(w), "exposed_comm_seconds_per_step": exposed / len(w),
                "hidden_comm_fraction": 1.0 - exposed / seconds if seconds > 0 else None,
                "comm_bytes_by_bucket": w[-1]["comm_bytes_by_bucket"],
                "comm_seconds_by_bucket": _mean_by_key([f["comm_seconds_by_bucket"] for f in w]),
                **self.schedule}

    def _store_interval(self, record: dict, my_loss: float, comm: dict, bubble: float | None, steps: int,
                        wall: float, phases: dict, state: list) -> None:
        """Every rank's figures for this log interval, gathered in one collective; rank 0 writes them."""
        per_step = {f"{phase}_s": seconds / steps for phase, seconds in phases.items()}
        exposed = comm.get("exposed_comm_seconds_per_step") or 0.0
        busy = per_step["forward_s"] + per_step["backward_s"] + per_step["optimizer_s"]
        mine = {"step": record["step"], "time": record["time"], "loss": my_loss, "tokens_per_s": record["tokens_per_s"],
                "step_s": wall / steps, **per_step, "exposed_comm_s": exposed,
                "comm_s": comm.get("comm_seconds_per_step", 0.0), "comm_bytes": comm.get("comm_bytes_per_step", 0.0),
                "compute_s": max(0.0, busy - exposed), "memory_bytes": memory_bytes(self.layout.device),
                "stage": self.layout.stage_index, "bubble": bubble if bubble is not None else math.nan}
        n = self.layout.n_layers
        norms = state_rms(state, self.layout.state_layers, n)
        every = gather_rows(pack(mine, norms + self._gate_saturation(n, state)), self.layout.world_size,
                            self.layout.distributed)
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
            sink.scalars(sinks.interval_scalars(record, ranks), record["step"])

    def _gate_saturation(self, n: int, state: list) -> list[float]:
        """A few tokens of the logged step through the step forms (~5 ms per log line); each pipeline stage probes
        its own blocks with the activations it received."""
        first_row = rows(state, slice(0, 1))
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
                 + f" on {result['tokens']:,} tokens"
                 + (f" (final, {result.get('scope', 'whole split')}"
                    + (f", the weights of step {weights_step}" if weights_step != step else "")
                    + ")" if final else "")
                 + ("; bpb by depth " + ", ".join(f"{d}: {r['bpb']:.4f}" for d, r in result["by_depth"].items())
                    if "by_depth" in result else ""))
        if self.layout.is_main:
            self._append_jsonl(record)

    def profile(self, profiler, step: int) -> list[dict] | None:
        """The profiled steps' timeline summary of every rank (all ranks take part when a range was asked for);
        `profiler`: the run's StepProfiler hook, or None."""
        if profiler is None:
            return None
        profiler.finish()  # a run that ended inside the range
        keys = ("steps", "wall_s", "compute_s", "comm_s", "overlap_s", "idle_s")
        mine = profiler.summary or dict.fromkeys(keys, 0.0)
        every = gather_rows(torch.tensor([float(mine[k]) for k in keys], dtype=torch.float64),
                            self.layout.world_size, self.layout.distributed)
        by_rank = [dict(zip(keys, row.tolist())) for row in every]
        if self.store:
            self.store.write_profile(step, by_rank)
        return by_rank

    def summary(self, run: dict, final: dict | None, ending: dict) -> dict:
        """summary.json: `run`, what the trainer says of the run (steps, tokens, wall_seconds, the selection, ...),
        with the final validation `final`, the losses and the communication of every rank; `ending`: what the
        runner's finish() gave (this rank's communication totals; a pipeline's idle share by stage). `final` None:
        written before the final evaluation, its figures null (the sinks get the whole summary only)."""
        layout = self.layout
        per_rank = self._comm_totals_by_rank(ending["comm_totals"])  # [world, 4]: steps, bytes, seconds, exposed
        steps = max(1.0, float(per_rank[:, 0].max()))
        total_bytes = float(per_rank[:, 1].sum()) / layout.world_size
        seconds, exposed = float(per_rank[:, 2].mean()), float(per_rank[:, 3].mean())
        final = final or dict.fromkeys(("loss", "ppl", "bpb", "tokens", "bytes"))
        summary = {
            **run, "train_loss": self.last_train_loss, "val_loss": final["loss"], "val_ppl": final["ppl"],
            "val_bpb": final["bpb"], "val_tokens": final["tokens"], "val_bytes": final["bytes"],
            "world_size": layout.world_size, "comm_mode": layout.comm_mode,
            "comm_auto": layout.comm_choice,  # comm.mode auto: seconds per step, by model and timed
            "comm_bytes_total": total_bytes, "comm_bytes_per_step": total_bytes / steps,
            "comm_bytes_per_step_by_rank": [float(b) / steps for b in per_rank[:, 1]],
            "comm_seconds_per_step": seconds / steps, "exposed_comm_seconds_per_step": exposed / steps,
            "exposed_comm_fraction": exposed / seconds if seconds > 0 else None,
            "pp": layout.pp, "dp": layout.dp_size, **{k: v for k, v in ending.items() if k != "comm_totals"},
        }
        if layout.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.store.set_meta(summary=summary)
        if final["loss"] is not None:
            for sink in self.sinks:
                sink.finish(summary)
        return summary

    def _comm_totals_by_rank(self, totals: tuple) -> torch.Tensor:
        mine = torch.tensor([list(totals)], dtype=torch.float64)
        if not self.layout.distributed:
            return mine
        every = [torch.zeros_like(mine) for _ in range(self.layout.world_size)]
        dist.all_gather(every, mine)  # gloo carries CPU tensors; on NCCL-only groups this goes through cpu:gloo
        return torch.cat(every)

    def _append_jsonl(self, record: dict) -> None:
        with open(Path(self.run_dir) / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def state_dict(self) -> dict:
        """Telemetry's part of a checkpoint: the last logged training loss, which a resumed run's summary reports
        until it logs its own."""
        return {"train_loss": self.last_train_loss}

    def load_state_dict(self, saved: dict) -> None:
        self.last_train_loss = saved["train_loss"]

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.store:  # the last connection closing folds the WAL into metrics.sqlite: one file to copy
            self.store.close()
            self.store = None


def mean_across_ranks(value: torch.Tensor, layout) -> float:
    if layout.distributed:
        value = value.detach().clone()
        dist.all_reduce(value)
        value /= layout.world_size
    return value.item()


def progress_line(where: dict, loss: float, lr: float, tokens_per_s: float, eval_s: float = 0.0,
                  mfu: float | None = None) -> str:
    """A log line off a terminal; `tokens_per_s`: training's own (validations and checkpoints left out), and
    `eval_s`: the validations' seconds since the last line; `mfu`: the model FLOP utilisation at that pace."""
    step = f"step {where['step']:,}" + (f"/{where['max_steps']:,}" if where["max_steps"] else "")
    eta = where["eta_s"]
    eta_text = "?" if eta is None else f"{int(eta // 60)}:{int(eta % 60):02d}"
    return (f"{step}  {100 * where['spent']:.0f}% of {where['budget']}  loss {loss:.4f}  lr {lr:.2e}  "
            f"{tokens_per_s:,.0f} tokens/s" + (f", MFU {mfu:.1%}" if mfu is not None else "")
            + (f" (+{eval_s:.1f} s validating)" if eval_s >= 0.05 else "")
            + f"  ETA {eta_text}")


def _mean_by_key(dicts: list[dict]) -> dict:
    """Per key, the mean over the steps of a log interval (a key missing in a step counts as 0 there)."""
    keys = sorted({k for d in dicts for k in d})
    return {k: sum(d.get(k, 0.0) for d in dicts) / len(dicts) for k in keys}
