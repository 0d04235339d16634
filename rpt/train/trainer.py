"""The training loop: one process or many, truncated BPTT, mixed precision, budgets, checkpoints.

    for each step:
        batch = next(loader)                                # [B, T] per rank, rows continue the last batch
        for each micro-batch (rows of the batch):           # gradient accumulation, no sync until the last
            logits, state = model(x, state, reset)          # autocast; the state carries over, detached
            scaler.scale(loss / accum).backward()           # gradient transfers start as buckets fill
        wait for the gradients (rpt.comm: all-reduce or parameter server, with its codec)
        unscale, clip the global norm, AdamW step (skipped when the gradients are not finite)
        share the updated parameters (parameter-server modes)
        log / evaluate / checkpoint / check the budgets

Everything a run writes goes into its run directory: config.toml, meta.json of the data,
logs/rank*.log, metrics.jsonl, checkpoints/, summary.json.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from contextlib import closing, nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from rpt.comm.sync import build_sync
from rpt.config import Config
from rpt.data.dataset import PreparedData, raise_bad_id
from rpt.data.stream import TokenStream
from rpt.data.tokenizer import token_byte_lengths
from rpt.errors import RptError
from rpt.models import RecurrentLM
from rpt.models.lm import next_token_loss
from rpt.monitor.metrics import (InputProbe, PhaseClock, gate_saturation, gather_rows, memory_bytes, pack, state_rms,
                                 stragglers, unpack)
from rpt.monitor.profile import StepProfiler
from rpt.monitor.store import MetricsWriter
from rpt.monitor import sinks
from rpt.models.state import all_finite, cat_rows, detach_state, map_state, rows
from rpt.parallel.apply import parallelize
from rpt.parallel.launch import Dist, restart_count
from rpt.parallel.pipeline import PipelineEval, check_layout
from rpt.train import faults
from rpt.train.budget import Budget
from rpt.train.checkpoint import Checkpointer
from rpt.train.evaluate import evaluate
from rpt.parallel.interrupt import StopRequest
from rpt.train.optim import build_optimizer, step_unless
from rpt.train.watchdog import Watchdog

log = logging.getLogger("rpt.train")


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, dist_info: Dist, resume: bool = False, progress: bool = True):
        self.cfg, self.run_dir, self.d = cfg, Path(run_dir), dist_info
        self.device = dist_info.device
        t = cfg.train
        sinks.require(cfg.monitor)  # on every rank, so that all of them stop, not rank 0 alone
        check_layout(cfg, dist_info.world_size)
        check_mixed_devices(cfg, dist_info)
        self.data = PreparedData(cfg.data.path)
        if cfg.model.vocab_size == 0:
            cfg.model.vocab_size = self.data.vocab_size
        elif cfg.model.vocab_size < self.data.vocab_size:
            raise RptError(f"model.vocab_size = {cfg.model.vocab_size} is smaller than the data's vocabulary "
                           f"({self.data.vocab_size})", "set model.vocab_size = 0 to take it from the data")
        self.byte_lengths = token_byte_lengths(self.data.tokenizer)
        for split in ("train", "val"):
            self.data.check_ids(split, cfg.model.vocab_size)

        with torch.device("meta"):  # shapes only: what the run counts
            shape = RecurrentLM(cfg.model)
        self.params, self.flops_per_token = shape.num_params(), shape.flops_per_token()
        par = parallelize(cfg, dist_info.rank, dist_info.world_size, self.device, dist_info.enabled)
        self.model, self.sync, self.pipe, self.dp_rank, self.dp_size = (par.model, par.sync, par.pipe, par.dp_rank,
                                                                        par.dp_size)
        # the gate-saturation probe's inputs: each stage's first input of a logged step
        self.probed = [(st.lm, st.state_of) for st in self.pipe.stages] if self.pipe else [(self.model, lambda s: s)]
        self.probe = InputProbe([lm for lm, _ in self.probed])
        self.optimizer = build_optimizer(self.model, t, self.sync.owned)  # None where a rank owns nothing
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=t.precision == "fp16")
        self.loader = TokenStream(self.data.tokens("train"), t.batch_size, t.seq_len, rank=self.dp_rank,
                                  world_size=self.dp_size, seed=t.seed, mode=cfg.data.loader,
                                  eot_id=self.data.eot_id)
        self.state = self.model.init_state(t.batch_size, self.device)  # a pipeline stage: its blocks' state
        ck = cfg.checkpoint
        self.checkpointer = Checkpointer(ck.path or str(self.run_dir / "checkpoints"), dist_info.rank,
                                         dist_info.world_size, ck.keep_last, ck.keep_best, ck.async_save)
        self.step = self.tokens = self.skipped_steps = self.bad_streak = 0
        self.budget, self.lr, self.ended_by = Budget(t), t.lr, None
        self.pending_skip = None  # on a GPU: the last step's non-finite flag, not read yet
        self.elapsed_before = 0.0  # training seconds of earlier runs of this run directory
        self.last_eval: dict | None = None
        self.last_train_loss: float | None = None
        self.last_saved_step = -1
        self.comm_window: list[dict] = []  # per-step communication figures since the last log line
        self.progress = progress and dist_info.is_main
        self.fault = faults.from_env()
        self.watchdog = Watchdog(dist_info.rank, dist_info.world_size, t.stall_timeout if dist_info.enabled else 0)
        in_step = ("data", "forward", "backward", "optimizer")  # phases of the step being run: step + 1
        self.clock = PhaseClock(self.device, lambda phase: self.watchdog.mark(self.step + (phase in in_step), phase))
        self.profiler = StepProfiler(cfg.monitor.profile, self.run_dir, dist_info.rank, self.device)
        torch.manual_seed(t.seed + 1000 * dist_info.rank)  # dropout differs per rank
        random.seed(t.seed + dist_info.rank)
        np.random.seed(t.seed + dist_info.rank)
        if resume:
            self._resume()
        # Only now, with everything built and any checkpoint loaded, does the run directory get written: a run
        # refused at start (a layout that cannot work, a checkpoint of another shape) leaves it as it was.
        self._write_run_files()
        self.store = MetricsWriter(self.run_dir) if dist_info.is_main else None
        self.sinks = sinks.open_sinks(cfg.monitor, self.run_dir, cfg.to_dict()) if dist_info.is_main else []
        if self.store:
            self.store.set_meta(world_size=dist_info.world_size, n_layers=cfg.model.n_layers, params=self.params,
                                pp=self.pipe.plan.pp if self.pipe else 1, dp=self.dp_size, config=cfg.to_toml(),
                                tokens_per_rank_step=t.batch_size * t.seq_len, budget=self.budget.describe(),
                                eval_tokens=t.eval_tokens if t.eval_interval else 0)

    # ------------------------------------------------------------------ the step
    def train_step(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimiser step over one batch; returns (mean loss, gradient norm)."""
        t = self.cfg.train
        model = self.sync.module
        pin = self.device.type == "cuda"  # a copy from pageable memory would wait for the queued kernels
        x, y, reset = ((v.pin_memory() if pin else v).to(self.device, non_blocking=True) for v in batch)
        reset = reset if self.cfg.data.reset_at_documents else None
        if self.pipe is not None:  # forward and backward of every micro-batch, through the pipeline schedule
            self.pipe.state = self.state
            with self._autocast():
                loss_mean = self.pipe.step(x, y, reset)
            self.state = self.pipe.state
            backward = sum(self.pipe.marks)
            self.clock.add("forward", self.pipe.compute_seconds - backward)
            self.clock.add("backward", backward)
            return self._optimizer_step(loss_mean)
        micro = t.batch_size // t.grad_accum
        loss_sum, new_states = torch.zeros((), device=self.device), []
        for k in range(t.grad_accum):
            part = slice(k * micro, (k + 1) * micro)
            last = k == t.grad_accum - 1
            with nullcontext() if last else self.sync.no_sync():  # forward and backward both inside
                with self._autocast(), self.clock("forward"):
                    logits, state = model(x[part], rows(self.state, part), None if reset is None else reset[part])
                    loss = next_token_loss(logits, y[part])
                    if faults.poisons_loss(self.fault, self.step, self.d.rank):
                        loss = loss * float("nan")
                    faults.maybe_stall(self.fault, self.step + 1, self.d.rank)  # numbered as in the logs
                with self.clock("backward"):
                    self.scaler.scale(loss / t.grad_accum).backward()
            loss_sum += loss.detach()
            new_states.append(detach_state(state))
        self.state = cat_rows(new_states)
        return self._optimizer_step(loss_sum / t.grad_accum)

    def _optimizer_step(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient sync, clipping and the AdamW step (skipped on non-finite gradients)."""
        with self.clock("optimizer"):
            return self._sync_and_step(loss)

    def _sync_and_step(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.cfg.train
        self.sync.wait_gradients()
        if self.optimizer is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = (self.pipe or self.sync).clip_grad_norm(t.grad_clip)  # over every stage's gradients
        nonfinite = ~torch.isfinite(grad_norm)  # the same on every rank: the norm is global
        if self.optimizer is not None:
            if self.scaler.is_enabled():  # fp16: the scaler hands fused AdamW its own overflow flag
                self.scaler.step(self.optimizer)
            else:
                step_unless(self.optimizer, nonfinite)
            self.optimizer.zero_grad(set_to_none=True)
        self.scaler.update()
        self.sync.share_parameters()  # a skipped step shares unchanged parameters
        self.comm_window.append(self.sync.meter.end_step())
        self._count_skip(nonfinite)
        return loss, grad_norm

    def _count_skip(self, nonfinite: torch.Tensor) -> None:
        """Count a skipped step. On a GPU the flag is read one step late, from pinned memory, so no step
        waits for its own gradient norm; on the CPU at once. Only the bookkeeping lags: the skip itself
        happened on the device."""
        if self.device.type == "cuda":
            flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            flag.copy_(nonfinite, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            previous, self.pending_skip = self.pending_skip, (flag, event)
            if previous is not None:
                self._settle_skip(*previous)
        else:
            self._settle_skip(nonfinite, None)

    def _settle_skip(self, flag: torch.Tensor, event) -> None:
        if event is not None:
            event.synchronize()
        skipped = bool(flag)
        self.skipped_steps += skipped
        self.bad_streak = self.bad_streak + 1 if skipped else 0
        if skipped and not all_finite(self.state):  # a step late on a GPU: that step was skipped as well
            self.state = self.model.init_state(self.cfg.train.batch_size, self.device)

    def _settle_pending_skip(self) -> None:
        """Read the last step's flag now (before a checkpoint, a log line, the end)."""
        if self.pending_skip is not None:
            pending, self.pending_skip = self.pending_skip, None
            self._settle_skip(*pending)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        t, ck = self.cfg.train, self.cfg.checkpoint
        started = time.perf_counter()
        self.started, self.progress_at_start = started, self._progress(self.elapsed_before)
        self.window_first_step, self.window_began = self.step, started
        window_tokens, window_start = 0, time.perf_counter()
        # The bar counts per mille of the budget spent (steps, tokens or time, whichever ends the run first),
        # so it shows an ETA for every kind of budget.
        bar = tqdm(total=1000, initial=0, disable=not self.progress or None, dynamic_ncols=True, desc="train",
                   bar_format="{desc} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]")
        log.info("training %s parameters on %s, world size %d", f"{self.params:,}", self.device,
                 self.d.world_size)
        if self.d.is_main:
            for line in [f"training {self.params:,} parameters on {self.device}, world size {self.d.world_size}",
                         *self.cfg.notes, self.budget.describe()]:
                tqdm.write(line)
        with StopRequest(in_worker="TORCHELASTIC_RUN_ID" in os.environ) as stop, closing(bar):
            while True:
                self.watchdog.mark(self.step + 1, "data")
                elapsed, stopping = self._agreed(self.elapsed_before + time.perf_counter() - started, stop)
                self.ended_by = self.budget.ended_by(self.step, self.tokens, elapsed)
                if stopping:
                    self.ended_by = stop.requested or "an interrupt on another rank"
                    return self._stop_interrupted(time.perf_counter() - started, stop)
                if self.ended_by:
                    break
                faults.maybe_kill(self.fault, self.step, self.d.rank)
                lr = self.lr = self.budget.lr(self.step, self._progress(elapsed))
                for group in self.optimizer.param_groups if self.optimizer is not None else ():
                    group["lr"] = lr
                with self.clock("data"):
                    batch = next(self.loader)
                    largest = max(int(batch[0].max()), int(batch[1].max()))  # on the CPU, before the device
                    if largest >= self.cfg.model.vocab_size:
                        raise_bad_id(largest, None, f"the training batch of step {self.step + 1}",
                                     self.cfg.model.vocab_size)
                self.profiler.before_step(self.step + 1)
                if (self.step + 1) % self.cfg.monitor.log_interval == 0:
                    self.probe.arm()
                loss, grad_norm = self.train_step(batch)
                self.step += 1
                self.profiler.after_step(self.step)
                self.tokens += t.batch_size * t.seq_len * self.dp_size
                window_tokens += t.batch_size * t.seq_len * self.dp_size
                if self.bad_streak >= t.max_bad_steps:
                    raise RptError(f"{self.bad_streak} optimiser steps in a row had non-finite gradients "
                                   f"(step {self.step}); the run stopped",
                                   "lower train.lr, raise train.warmup_steps or use precision fp32/bf16; "
                                   f"the last good checkpoint is {self.checkpointer.latest() or 'none'}")
                if self.step % self.cfg.monitor.log_interval == 0:
                    self._settle_pending_skip()
                    rate = window_tokens / (time.perf_counter() - window_start)
                    self._log_step(loss.item(), self._mean_across_ranks(loss), grad_norm.item(), lr, rate, bar)
                    window_tokens, window_start = 0, time.perf_counter()
                done = int(1000 * min(1.0, self._progress(self.elapsed_before + time.perf_counter() - started)))
                bar.update(done - bar.n)
                if t.eval_interval and self.step % t.eval_interval == 0:
                    self._evaluate(final=False)
                if ck.interval and self.step % ck.interval == 0:
                    self._settle_pending_skip()
                    if self.bad_streak == 0:  # keep good ones good
                        self._save(time.perf_counter() - started)
        if self.d.is_main:
            tqdm.write(f"ended by {self.ended_by} at step {self.step:,} ({self.tokens:,} tokens)")
        self._settle_pending_skip()
        wall = time.perf_counter() - started
        self._store_profile()
        log.info("parameter digest %s", param_digest(self.model))  # ranks compare equal under data parallel
        periodic = bool(t.eval_interval and t.eval_tokens)  # periodic evaluations cover fewer tokens than the final
        if periodic and (self.last_eval is None or self.last_eval["step"] != self.step):
            self._evaluate(final=False)  # the measure the checkpoints are ranked by, at the last step too
        final = self._evaluate(final=True)
        measured = self.last_eval if periodic else final
        val = (measured["loss"], measured["tokens"])
        if self.last_saved_step == self.step:  # saved by the interval at this very step: record its loss
            self.checkpointer.finish_pending()
            self.checkpointer.set_val_loss(self.step, val)
        else:
            self._save(wall, val)
        self.checkpointer.finish_pending()
        summary = self._summary(wall, final)
        self.watchdog.stop()
        if self.store:  # the last connection closing folds the WAL into metrics.sqlite: one file to copy
            self.store.close()
        return summary

    def _stop_interrupted(self, seconds: float, stop: StopRequest) -> dict:
        """After an interrupt: a checkpoint of this step (no final evaluation, no summary: the run goes on
        with --resume), and the command that continues it. A second signal meanwhile stops at once."""
        if self.d.is_main:
            tqdm.write(f"stopping after step {self.step:,} ({self.ended_by}): writing a checkpoint; "
                       "Ctrl-C again stops at once")
        self._settle_pending_skip()
        if self.last_saved_step != self.step and self.step > 0:
            self._save(seconds)
        self.checkpointer.finish_pending()
        self.watchdog.stop()
        if self.store:
            self.store.close()
        if self.d.is_main:
            saved = self.checkpointer.latest()
            tqdm.write(f"interrupted at step {self.step:,}; " + (f"the checkpoint {saved} holds it. " if saved else "")
                       + f"Continue with: rpt train --run-dir {self.run_dir} --resume"
                       + (f" --nproc {os.environ['RPT_NPROC']}" if "RPT_NPROC" in os.environ else
                          " (launched as before)" if self.d.enabled else ""))
        return {"interrupted": True, "steps": self.step, "signal": stop.requested}

    # ------------------------------------------------------------------ pieces
    def _autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _agreed(self, elapsed: float, stop: StopRequest) -> tuple[float, bool]:
        """One clock and one stop decision for every rank, in one small collective (a CPU tensor: gloo, no
        device sync). The largest clock: the time budget ends the run on all ranks at the same step, and the
        learning rate (which follows the spent fraction of the budget) stays identical across replicas; and
        a stop asked of any rank stops them all after the same step. Without a time budget the ranks agree
        at each log interval only (whose loss is all-reduced anyway), so a stop waits for that step."""
        if not self.d.enabled:
            return elapsed, stop.requested is not None
        if not self.cfg.train.max_time and self.step % self.cfg.monitor.log_interval:
            return elapsed, False
        agreed = torch.tensor([elapsed, float(stop.requested is not None)], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return agreed[0].item(), bool(agreed[1].item())

    def _progress(self, elapsed: float) -> float:
        return self.budget.progress(self.step, self.tokens, elapsed)

    def _mean_across_ranks(self, value: torch.Tensor) -> float:
        if self.d.enabled:
            value = value.detach().clone()
            dist.all_reduce(value)
            value /= self.d.world_size
        return value.item()

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
                **self.sync.schedule_in_force()}

    def _pipeline_figures(self) -> dict:
        return {"pipeline_bubble": self.pipe.take_bubble()} if self.pipe else {}

    def _log_step(self, my_loss: float, loss: float, grad_norm: float, lr: float, tokens_per_s: float, bar) -> None:
        self.watchdog.mark(self.step, "log")
        self.last_train_loss = loss
        comm, pipe = self._comm_window_figures(), self._pipeline_figures()
        record = {"kind": "train", "step": self.step, "tokens": self.tokens, "loss": loss, "grad_norm": grad_norm,
                  "lr": lr, "tokens_per_s": tokens_per_s, "skipped_steps": self.skipped_steps, "time": time.time(),
                  **comm, **pipe}
        log.info(json.dumps(record))
        self._store_interval(record, my_loss, comm, pipe)
        if self.d.is_main:
            bar.set_postfix(step=self.step, loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", lr=f"{lr:.2e}")
            where = self._where()
            if bar.disable and self.progress:  # stdout is no terminal (tee, nohup, SLURM): a plain line instead
                print(self._progress_line(where, loss, lr, tokens_per_s), flush=True)
            self.store.set_meta(progress=where)  # the dashboard's "step X of Y, ETA"
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def _where(self) -> dict:
        """How far the run is: step (of max_steps), the spent share of the budget nearest its end, the ETA."""
        elapsed = self.elapsed_before + time.perf_counter() - self.started
        spent = min(1.0, self._progress(elapsed))
        ran = time.perf_counter() - self.started
        eta = ran * (1 - spent) / (spent - self.progress_at_start) if spent > self.progress_at_start else None
        return {"step": self.step, "max_steps": self.cfg.train.max_steps, "spent": spent, "eta_s": eta,
                "budget": self.budget.leading(self.step, self.tokens, elapsed)}

    @staticmethod
    def _progress_line(where: dict, loss: float, lr: float, tokens_per_s: float) -> str:
        step = f"step {where['step']:,}" + (f"/{where['max_steps']:,}" if where["max_steps"] else "")
        eta = where["eta_s"]
        eta_text = "?" if eta is None else f"{int(eta // 60)}:{int(eta % 60):02d}"
        return (f"{step}  {100 * where['spent']:.0f}% of {where['budget']}  loss {loss:.4f}  lr {lr:.2e}  "
                f"{tokens_per_s:,.0f} tokens/s  ETA {eta_text}")

    def _store_interval(self, record: dict, my_loss: float, comm: dict, pipe: dict) -> None:
        """Every rank's figures for this log interval, gathered in one collective; rank 0 writes them."""
        steps = max(1, self.step - self.window_first_step)
        wall = time.perf_counter() - self.window_began
        self.window_first_step, self.window_began = self.step, time.perf_counter()
        per_step = {f"{phase}_s": seconds / steps for phase, seconds in self.clock.take().items()}
        exposed = comm.get("exposed_comm_seconds_per_step") or 0.0
        mine = {"step": self.step, "time": record["time"], "loss": my_loss, "tokens_per_s": record["tokens_per_s"],
                "step_s": wall / steps, **per_step, "exposed_comm_s": exposed,
                "comm_s": comm.get("comm_seconds_per_step", 0.0), "comm_bytes": comm.get("comm_bytes_per_step", 0.0),
                "compute_s": max(0.0, per_step["forward_s"] + per_step["backward_s"] + per_step["optimizer_s"] - exposed),
                "memory_bytes": memory_bytes(self.device), "stage": self.pipe.index if self.pipe else 0,
                "bubble": pipe.get("pipeline_bubble") if pipe.get("pipeline_bubble") is not None else math.nan}
        n = self.cfg.model.n_layers
        norms = state_rms(self.state, self.pipe.layers if self.pipe else range(n), n)
        # gate saturation: a few tokens of the last batch through the step forms (~5 ms per log line); each
        # pipeline stage probes its own blocks with the activations it received
        first_row = rows(self.state, slice(0, 1))
        saturated = [math.nan] * n
        for (lm, state_of), inputs in zip(self.probed, self.probe.inputs):
            shares = gate_saturation(lm, inputs, state_of(first_row), n, int(next(iter(lm.blocks))))
            saturated = [b if math.isnan(a) else a for a, b in zip(shares, saturated)]
        every = gather_rows(pack(mine, norms + saturated), self.d.world_size, self.d.enabled)
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
            sink.scalars(sinks.interval_scalars(record, ranks), self.step)

    def _store_profile(self) -> None:
        """The profiled steps' timeline summary of every rank (all ranks take part when a range was asked for)."""
        if self.profiler.range is None:
            return
        self.profiler.finish()  # a run that ended inside the range
        keys = ("steps", "wall_s", "compute_s", "comm_s", "overlap_s", "idle_s")
        mine = self.profiler.summary or dict.fromkeys(keys, 0.0)
        every = gather_rows(torch.tensor([float(mine[k]) for k in keys], dtype=torch.float64), self.d.world_size,
                            self.d.enabled)
        by_rank = [dict(zip(keys, row.tolist())) for row in every]
        self.profile_by_rank = by_rank
        if self.store:
            self.store.write_profile(self.step, by_rank)

    def _evaluate(self, final: bool) -> dict:
        with self.clock("eval"):
            return self._run_evaluation(final)

    def _run_evaluation(self, final: bool) -> dict:
        t = self.cfg.train
        model = PipelineEval(self.pipe) if self.pipe else self.model
        result = evaluate(model, self.data.tokens("val"), self.byte_lengths, batch_size=t.batch_size,
                          seq_len=t.seq_len, device=self.device, rank=self.dp_rank, world_size=self.dp_size,
                          max_tokens=0 if final else t.eval_tokens,
                          eot_id=self.data.eot_id if self.cfg.data.reset_at_documents else None,
                          autocast=self._autocast)
        if not final:
            self.last_eval = {**result, "step": self.step}
        record = {"kind": "eval", "step": self.step, "final": final, **result, "time": time.time()}
        log.info(json.dumps(record))
        if self.store:
            self.store.write_eval(record)
        for sink in self.sinks:
            sink.scalars(sinks.eval_scalars(record), self.step)
        if self.d.is_main:
            tqdm.write(f"step {self.step}: val loss {result['loss']:.4f}, ppl {result['ppl']:.2f}, "
                       f"bpb {result['bpb']:.4f}" + (" (final, whole split)" if final else ""))
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        return result

    def _save(self, seconds_this_run: float, val: tuple[float, int] | None = None) -> None:
        """A checkpoint of this step; `val` ranks it (default: the periodic evaluation of this step, if any)."""
        extras = {
            "step": self.step, "tokens": self.tokens, "skipped_steps": self.skipped_steps,
            "elapsed": self.elapsed_before + seconds_this_run, "loader": self.loader.state_dict(),
            "state": self.state, "scaler": self.scaler.state_dict(), "last_eval": self.last_eval,
            "sync": self.sync.state_dict(), "budget": self.budget.state_dict(self.lr),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None},
        }
        if val is None and self.last_eval and self.last_eval["step"] == self.step:
            val = (self.last_eval["loss"], self.last_eval["tokens"])
        with self.clock("checkpoint"):
            path = self.checkpointer.save(self.step, self.model, self.optimizer, extras, val=val,
                                          before_commit=lambda: faults.maybe_kill(self.fault, self.step, self.d.rank,
                                                                                  "killsave"))
            faults.maybe_corrupt(self.fault, self.step, self.d.rank, path if not self.checkpointer.async_save else None)
        self.last_saved_step = self.step

    def _resume(self) -> None:
        path = self.checkpointer.latest()
        if self.d.is_main:
            for damaged, problem in self.checkpointer.damaged.items():
                tqdm.write(f"skipping the damaged checkpoint {damaged}: {problem}")
        if path is None:
            log.info("no complete checkpoint to resume from; starting fresh")
            if self.d.is_main:
                tqdm.write(f"no complete checkpoint in {self.checkpointer.root}: this run starts fresh from step 0")
            return
        extras = self.checkpointer.load(path, self.model, self.optimizer, partial=self.pipe is not None)
        self.step, self.tokens = extras["step"], extras["tokens"]
        self.skipped_steps, self.elapsed_before = extras["skipped_steps"], extras["elapsed"]
        self.loader.load_state_dict(extras["loader"])
        self.state = map_state(lambda t: t.to(self.device), extras["state"])
        self.scaler.load_state_dict(extras["scaler"])
        self.sync.load_state_dict(extras.get("sync", {}))
        self.last_eval = extras["last_eval"]
        extending = self.budget.resume(extras.get("budget"), self.step, self.tokens, self.elapsed_before,
                                       refuse_spent=restart_count() == 0)
        rng = extras["rng"]
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        if rng["cuda"] is not None:
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        log.info("resumed from %s at step %d", path, self.step)
        if self.d.is_main:
            tqdm.write(f"resumed from {path} at step {self.step}")
            if extending:
                tqdm.write(extending)

    def _write_run_files(self) -> None:
        if not self.d.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg.save(self.run_dir / "config.toml")
        for name in ("meta.json", "tokenizer.json"):  # the run directory stands on its own
            shutil.copyfile(self.data.path / name, self.run_dir / name)

    def _comm_totals_by_rank(self) -> torch.Tensor:
        m = self.sync.meter
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
        if self.pipe is None:
            return {}
        steps = self.pipe.history[1:] or self.pipe.history
        mine = torch.tensor([sum(c for c, _ in steps), sum(w for _, w in steps), len(steps)], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(self.d.world_size)]
        dist.all_gather(every, mine)
        layout = self.pipe.mesh.mesh.mesh.tolist()  # [stage][replica] -> rank
        compute = [sum(float(every[r][0] / every[r][2]) for r in reps) / len(reps) for reps in layout]  # per step
        wall = [sum(float(every[r][1] / every[r][2]) for r in reps) / len(reps) for reps in layout]
        m = self.pipe.plan.microbatches
        ideal_step = max(compute) + (sum(compute) - max(compute)) / (m * self.pipe.plan.stages_per_rank)
        by_stage = [max(0.0, 1.0 - c / w) for c, w in zip(compute, wall)]
        return {"pipeline_bubble": sum(by_stage) / len(by_stage), "pipeline_bubble_by_stage": by_stage,
                "pipeline_bubble_theory": self.pipe.plan.bubble_theory,
                "pipeline_bubble_ideal_by_stage": [1.0 - c / ideal_step for c in compute],
                "pipeline_compute_seconds_by_stage": compute, "pipeline_step_seconds": sum(wall) / len(wall),
                "microbatches": m, "pipeline_schedule": self.pipe.schedule_name}

    def _summary(self, wall: float, final: dict) -> dict:
        per_rank = self._comm_totals_by_rank()  # [world, 4]: steps, bytes, seconds, exposed
        steps = max(1.0, float(per_rank[:, 0].max()))
        tot = {"bytes": float(per_rank[:, 1].sum()) / self.d.world_size, "seconds": float(per_rank[:, 2].mean()),
               "exposed": float(per_rank[:, 3].mean())}
        summary = {
            "steps": self.step, "tokens": self.tokens, "wall_seconds": round(wall, 3),
            "tokens_per_second": self.tokens / max(wall + self.elapsed_before, 1e-9),
            "train_loss": self.last_train_loss, "val_loss": final["loss"], "val_ppl": final["ppl"],
            "val_bpb": final["bpb"], "val_tokens": final["tokens"], "val_bytes": final["bytes"],
            "world_size": self.d.world_size, "comm_mode": self.sync.mode,
            "comm_auto": self.sync.predictions,  # comm.mode auto: seconds per step, by model and timed
            "compression": self.cfg.comm.compression, "comm_bytes_total": tot["bytes"],
            "comm_bytes_per_step": tot["bytes"] / steps,
            "comm_bytes_per_step_by_rank": [float(b) / steps for b in per_rank[:, 1]],
            "comm_seconds_per_step": tot["seconds"] / steps,
            "exposed_comm_seconds_per_step": tot["exposed"] / steps,
            "exposed_comm_fraction": tot["exposed"] / tot["seconds"] if tot["seconds"] > 0 else None,
            "params": self.params, "flops_per_token": self.flops_per_token,
            "pp": self.pipe.plan.pp if self.pipe else 1, "dp": self.dp_size, **self._bubble_by_stage(),
            "ended_by": self.ended_by, "skipped_steps": self.skipped_steps, "precision": self.cfg.train.precision,
            "device": str(self.device),
            "profile_by_rank": getattr(self, "profile_by_rank", None),
        }
        if self.d.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.store.set_meta(summary=summary)
        for sink in self.sinks:
            sink.finish(summary)
        return summary


def _mean_by_key(dicts: list[dict]) -> dict:
    """Per key, the mean over the steps of a log interval (a key missing in a step counts as 0 there)."""
    keys = sorted({k for d in dicts for k in d})
    return {k: sum(d.get(k, 0.0) for d in dicts) / len(dicts) for k in keys}


def param_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's bytes, in order: equal digests mean bit-identical replicas."""
    import hashlib

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def check_mixed_devices(cfg: Config, dist_info: Dist) -> None:
    """A job of CPU and GPU ranks runs on gloo, whose CUDA support is all-reduce and broadcast: the modes that
    send, all-gather or pipeline CUDA tensors need ranks of one kind, and comm.mode "auto" resolves to
    all-reduce here (the only choice left) rather than measuring the links."""
    if not dist_info.mixed_devices:
        return
    if cfg.comm.mode == "auto":  # the servers' sends are not among gloo's CUDA collectives: all-reduce is the choice
        cfg.comm.mode = "allreduce"
    uses = [what for what, on in (("comm.mode = " + repr(cfg.comm.mode), cfg.comm.mode in ("ps", "ps-sharded")),
                                  ("comm.compression = 'topk'", cfg.comm.compression == "topk"),
                                  (f"parallel.pp = {cfg.parallel.pp}", cfg.parallel.pp != 1)) if on]
    if uses:
        raise RptError(f"this job mixes CPU and GPU ranks (gloo for all), which cannot carry {', '.join(uses)}",
                       "run every rank on one kind of device (--device cpu on all, or GPUs on all), or use "
                       "comm.mode = 'allreduce' with compression none, fp16, bf16 or powersgd and parallel.pp = 1")

