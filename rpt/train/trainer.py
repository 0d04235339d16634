"""`rpt train`: what every rank runs (`train_worker`), and the Trainer's loop: one process or many, truncated
BPTT, mixed precision, budgets, checkpoints.

    for each step:
        batch = next(loader)                                # [B, T] per rank, rows continue the last batch
        record, state = runner.train_step(batch, state)     # rpt/parallel/runner.py:
            for each micro-batch (rows of the batch):       #   gradient accumulation, no sync until the last
                nats, state = model(x, state, reset, y)     #   autocast; the state carries over, detached
                scaler.scale(loss / accum).backward()       #   gradient transfers start as buckets fill
            wait for the gradients (rpt.comm: all-reduce or parameter server, with its codec)
            unscale, clip the global norm, AdamW step (skipped when the gradients are not finite)
            share the updated parameters (parameter-server modes)
        log / evaluate / checkpoint / check the budgets     # each component is handed the record and values

The loop is here; the step is the runner's, which `rpt.parallel.apply.parallelize` builds for how the model
runs on the ranks (pipeline, DDP, comm modes, FSDP): the trainer holds that one handle. What happens around the
step are components that own their config section and their timing: Telemetry (monitor), Evaluation
(train.eval_*), Checkpointing (checkpoint), Budget (train.max_* and the learning rate), and the step hooks a run
installs (rpt/train/hooks.py: the stall watchdog, the profiler; fault injection, which rpt/cli.py hands in).
Everything a run writes goes into its run directory: config.toml, meta.json of the data, logs/rank*.log,
metrics.jsonl, checkpoints/, summary.json.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from contextlib import closing, contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rpt import kernels
from rpt.config import Config
from rpt.data.dataset import raise_bad_id, token_counts
from rpt.data.stream import TokenStream
from rpt.data.tokenizer import token_byte_lengths
from rpt.errors import RptError
from rpt.models import RecurrentLM
from rpt.models.registry import CELLS
from rpt.models.shapes import on_meta
from rpt.models.state import all_finite, map_state, shapes
from rpt.monitor import sinks
from rpt.monitor.metrics import PHASES
from rpt.parallel import launch
from rpt.parallel.apply import parallelize
from rpt.parallel.fsdp import param_digest
from rpt.parallel.launch import Dist, restart_count
from rpt.runtime.command_clock import command_started
from rpt.runtime.peak import peak_flops
from rpt.parallel.runner import StepRecord, autocast_for
from rpt.runtime.signals import StopRequest
from rpt.runtime.version import rpt_commit
from rpt.train.averaging import WeightAverage
from rpt.train.budget import Budget
from rpt.train.checkpoint.manager import Checkpointing, RandomState
from rpt.train.evaluate import Evaluation
from rpt.train.hooks import StepHooks
from rpt.train.init_from import load_weights, read_weights
from rpt.train.optim import build_optimizer
from rpt.train.progress import Progress
from rpt.train.resolve import resolve
from rpt.train.run_dir import setup_logging
from rpt.train.step_profiler import StepProfiler
from rpt.train.telemetry import Telemetry
from rpt.train.watchdog import Watchdog

log = logging.getLogger("rpt.train")
IN_STEP = ("data", "forward", "backward", "optimizer")  # the phases of a step
ExtraHooks = Callable[[int], list[StepHooks]]  # rank -> step hooks


def train(cfg: Config, run_dir: Path, resume: bool, nproc: int, max_restarts: int, device: str | None,
          extra_hooks: ExtraHooks | None = None) -> dict | None:
    """Run training here (one process, or this rank under torchrun) or launch `nproc` local workers.
    `extra_hooks(rank)`: step hooks to install besides the run's own (a module-level function, since workers
    start in fresh processes: fault injection)."""
    if nproc > 1:
        interrupted = launch.launch_local(nproc, max_restarts, train_worker, cfg, str(run_dir), resume, device,
                                          True, extra_hooks)
        if interrupted:
            return {"interrupted": True, "signal": interrupted}
        summary_path = run_dir / "summary.json"
        return json.loads(summary_path.read_text()) if summary_path.exists() else None
    return train_worker(cfg, str(run_dir), resume, device, extra_hooks=extra_hooks)


def train_worker(cfg: Config, run_dir: str, resume: bool, device: str | None,
                 show_progress: bool = True, extra_hooks: ExtraHooks | None = None) -> dict:
    """What every rank runs, alone, under torchrun or as one of the workers `--nproc` launches (a top-level
    function, so that the launcher can start it in a fresh process). Each rank logs to RUN_DIR/logs/rankR.log."""
    d = launch.setup(device)
    if d.device.type == "cpu" and getattr(CELLS.get(cfg.model.cell), "native_loops", False):
        kernels.current().loops()  # built (once per machine, ~25 s) before anything is timed: the recipe, the budget
    launch.choose_allocator(d.device, cfg.parallel, cfg.train.bptt_chunk)
    run_dir = Path(run_dir)
    setup_logging(run_dir, d.rank)
    try:
        return Trainer(cfg, run_dir, d, resume=resume, show_progress=show_progress, extra_hooks=extra_hooks).run()
    except RptError as exc:
        if (run_dir / "config.toml").exists():  # a run that exists keeps the record; a refused new one leaves nothing
            logging.getLogger("rpt").error("%s", exc)
        raise
    except Exception:
        logging.getLogger("rpt").exception("training failed")  # the traceback, in RUN_DIR/logs/rankR.log
        raise
    finally:
        launch.teardown()


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, dist_info: Dist, resume: bool = False,
                 show_progress: bool = True, extra_hooks: ExtraHooks | None = None):
        """`cfg`: the user's configuration, resolved here (rpt/train/resolve.py) into `self.resolved`, whose frozen
        `cfg` everything after reads. `resume`: --resume (an elastic restart resumes too)."""
        self.run_dir, self.d, self.device = Path(run_dir), dist_info, dist_info.device
        self.command_started = command_started(time.time())  # what summary.json's `seconds` count from
        self.marks: dict[str, float] = {}  # when this command's phases began and ended (epoch seconds)
        sinks.require(cfg.monitor)  # on every rank, so that all of them stop, not rank 0 alone
        restarted = restart_count() > 0
        self.resolved, self.data = resolve(cfg, dist_info, self.run_dir, resume, restarted)
        self.cfg = cfg = self.resolved.cfg
        resume, t = resume or restarted, cfg.train
        # the two-level softmax's shortlist: this corpus's most frequent tokens
        counts = token_counts(self.data.tokens("train"), cfg.model.vocab_size) if cfg.model.head_shortlist else None
        with on_meta():  # shapes only: what the run counts
            shape = RecurrentLM(cfg.model)
            if counts is not None:
                shape.order_head(counts)
        self.runner = runner = parallelize(cfg, self.resolved.plan, dist_info.rank, dist_info.world_size,
                                           self.device, dist_info.enabled, self.resolved.comm_choice, counts)
        self.layout = layout = runner.layout
        runner.bind(partial(build_optimizer, cfg=t))  # None where a rank owns nothing
        self.held = runner.checkpoint_state()  # the model and what else a checkpoint holds (parts join below)
        self.initialised_from = self._init_from(t) if t.init_from and not resume else None  # (a resumed run's
        # checkpoint holds them already)
        self.params, self.flops_per_token = shape.num_params(), shape.flops_per_token()
        self.dp_rank, self.dp_size = layout.dp_rank, layout.dp_size
        make_loader = self.data.stream if cfg.data.mix else partial(TokenStream, self.data.tokens("train"))
        self.loader = make_loader(t.batch_size, t.seq_len, rank=self.dp_rank, world_size=self.dp_size, seed=t.seed,
                                  mode=cfg.data.loader, eot_id=self.data.eot_id)
        # how far the run is, and the recurrent state it carries (a pipeline stage: its blocks' state)
        self.progress = Progress(runner.init_state(t.batch_size), {**layout.shape, "rank": dist_info.rank},
                                 self.device, self.resolved.recipe_seconds)
        self.bad_streak = 0
        self.agreed_clock: float | None = None  # elapsed() as every rank agreed it this step, where they did
        self.budget, self.ended_by, self.spent_share = Budget(t, self.flops_per_token), None, 0.0
        self.pending_skip = None  # on a GPU: the last step's non-finite flag, not read yet
        self.hooks = [*(extra_hooks(dist_info.rank) if extra_hooks else []),
                      *step_hooks(t, cfg.monitor, dist_info, self.run_dir)]
        self.profiler = next((h for h in self.hooks if isinstance(h, StepProfiler)), None)
        self.clock = PhaseClock(self.device, self.mark_phase)
        self.averaging = WeightAverage(t.average, list(self.held.model.parameters()))
        self.eval_align = cfg.comm.diloco_steps if cfg.comm.mode == "diloco" else 1  # (replicas agree there)
        self.evaluation = Evaluation(t, self.data, token_byte_lengths(self.data.tokenizer), self.device,
                                     self.dp_rank, self.dp_size, cfg.data.reset_at_documents,
                                     partial(autocast_for, layout.precision, layout.device))
        self.telemetry = Telemetry(cfg.monitor, layout, self.run_dir, runner.probes(), show_progress)
        self.peak = peak_flops(self.device, layout.precision)  # one device's, in the run's precision (cached)
        self.telemetry.flops = (self.flops_per_token, self.peak * layout.world_size)
        # what a checkpoint holds beside the model, the optimiser and the runner's parts: save and resume walk this
        # one provider (the parts a rank's place owns start afresh on another layout)
        self.held = self.held.with_parts({"progress": self.progress, "loader": self.loader, "budget": self.budget,
                                          "evaluation": self.evaluation, "averaging": self.averaging,
                                          "telemetry": self.telemetry,
                                          "rng": RandomState(self.device)}, per_rank=("rng", "averaging"))
        self.checkpoints = Checkpointing(cfg.checkpoint, str(self.run_dir / "checkpoints"), dist_info.rank,
                                         dist_info.world_size, dist_info.is_main, self.hooks, self.held, layout.shape)
        if self.initialised_from:
            self.telemetry.say(self.initialised_from)
        torch.manual_seed(t.seed + 1000 * dist_info.rank)  # dropout differs per rank
        random.seed(t.seed + dist_info.rank)
        np.random.seed(t.seed + dist_info.rank)
        # The run directory is written only once everything is built: a new run refused at start (a layout that
        # cannot work) leaves nothing; a resume, only once its first step has run, so that settings which fail
        # there (or a checkpoint of another shape) leave the run's config.toml as it was, resumable as before.
        self.recorded = False
        self.resumed_at: int | None = None  # the step a resume continued from (None: a new run)
        if resume:
            self._resume()
        else:
            self._write_run_files()

    # ------------------------------------------------------------------ the step
    def train_step(self, batch, lr: float | None = None) -> StepRecord:
        """One optimiser step over one batch at learning rate `lr` (the runner's; None: the optimiser's as it is),
        and its skip counted."""
        x, y, reset = batch
        p = self.progress
        record, p.state = self.runner.train_step(x, y, reset if self.cfg.data.reset_at_documents else None,
                                                 p.state, p.step, lr, self.clock, self._in_forward)
        self._count_skip(record.nonfinite)
        return record

    def _in_forward(self, loss: torch.Tensor) -> torch.Tensor:
        for hook in self.hooks:
            loss = hook.in_forward(self.progress.step, loss)
        return loss

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
        self.progress.skipped_steps += skipped
        self.bad_streak = self.bad_streak + 1 if skipped else 0
        if skipped and not all_finite(self.progress.state):  # a step late on a GPU: that step was skipped as well
            self.progress.state = self.runner.init_state(self.cfg.train.batch_size)

    def _settle_pending_skip(self) -> None:
        """Read the last step's flag now (before a checkpoint, a log line, the end)."""
        if self.pending_skip is not None:
            pending, self.pending_skip = self.pending_skip, None
            self._settle_skip(*pending)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        tel = self.telemetry
        self.marks["training"] = time.time()
        self.progress.start()
        t = self.cfg.train
        tel.open(self.params, self.progress.step, self.spent(), self.resolved.notes, self.budget.describe(),
                 [self.checkpoints.describe(), *[line for line in [self.averaging.describe()] if line]],
                 config=self.cfg.to_dict(), meta={"config": self.cfg.to_toml(),
                                                  "tokens_per_rank_step": t.batch_size * t.seq_len,
                                                  "eval_tokens": t.eval_tokens if t.eval_interval else 0})
        with StopRequest(in_worker="TORCHELASTIC_RUN_ID" in os.environ) as stop, closing(tel.bar):
            while True:
                self.mark_phase("data")
                elapsed, stopping = self._agreed(stop)
                if stopping:
                    return self._stop_interrupted(stop)
                self.spent_share = self.budget.progress(self.progress.step, self.progress.tokens, elapsed)
                self.ended_by = (self.budget.ended_by(self.progress.step, self.progress.tokens, elapsed)
                                 or self.evaluation.stale)
                if self.ended_by:
                    break
                lr = self.budget.lr(self.progress.step, self.spent_share)
                with self.clock("data"):
                    batch = self._next_batch()
                for hook in self.hooks:
                    hook.step_begins(self.progress.step)
                record = self.train_step(batch, lr)
                self.averaging.step(self.spent_share)
                self.progress.step += 1
                if not self.recorded:
                    self._write_run_files()
                for hook in self.hooks:
                    hook.step_ends(self.progress.step)
                self.progress.tokens += record.tokens
                tel.step_done(self.progress.step, record, self.spent())
                self._check_bad_streak()
                if tel.should_log(self.progress.step):
                    self._settle_pending_skip()
                    self.mark_phase("log")
                    tel.log_interval(record, lr, self.where(), self.progress.skipped_steps, self.clock.take(),
                                     self.progress.state,
                                     self._tokens_by_source())
                if self.evaluation.should_evaluate(self.progress.step, self.spent_share, self.eval_align):
                    self._evaluate(final=False)
                if self.checkpoints.should_save(self.progress.step, self.agreed_clock):
                    self._settle_pending_skip()
                    if self.bad_streak == 0:  # keep good ones good
                        self._save()
        return self._finish()

    def _finish(self) -> dict:
        """After the last step: the evaluations, the last checkpoint (ranked by the periodic measure), the summary."""
        tel = self.telemetry
        if self.resumed_at == self.progress.step:
            return self._nothing_trained()
        tel.say(f"ended by {self.ended_by} at step {self.progress.step:,} ({self.progress.tokens:,} tokens)")
        if not self.recorded:
            self._write_run_files()
        self._settle_pending_skip()
        segment = self.progress.stop()
        self.marks["trained"] = time.time()
        profile = tel.profile(self.profiler, self.progress.step)
        ending = self.runner.finish()
        self.averaging.put_in()  # the run ends with the average (its iterate kept for a resume)
        log.info("parameter digest %s", param_digest(self.held.model))  # ranks compare equal under data parallel
        ev = self.evaluation
        if ev.last is not None and ev.ranking(self.progress.step) is None:
            self._evaluate(final=False)  # the measure checkpoints are ranked and the best chosen by, at the last step
        if ev.last is None:  # no periodic evaluation: the final one ranks the last checkpoint
            selected = {"selected_step": self.progress.step, "selected_by": "the last step (no periodic validation)"}
            final = self._final_evaluation(segment, profile, selected, ending)
            val = (final["loss"], final["tokens"])
        else:
            val = ev.ranking(self.progress.step)
        with self.clock("checkpoint"):
            self.checkpoints.finish(self.progress.step, val)
        if ev.last is not None:
            selected = self._select_best()
            final = self._final_evaluation(segment, profile, selected, ending, selected["selected_step"])
        summary = tel.summary(self._run_figures(segment, profile, selected), final, ending)
        for hook in self.hooks:
            hook.run_ends()
        tel.close()
        return summary

    def _final_evaluation(self, segment: float, profile, selected: dict, ending: dict,
                          weights_step: int | None = None) -> dict:
        """The final evaluation, with summary.json written before it (its figures but the final ones, marked
        pending: a run stopped during it keeps them) and its seconds counted (`seconds.final_eval`)."""
        self.telemetry.summary(self._run_figures(segment, profile, selected), None, ending)
        self.marks["final_eval"] = time.time()
        final = self._evaluate(final=True, weights_step=weights_step)
        self.marks["final_evaluated"] = time.time()
        return final

    def _seconds(self, segment: float) -> dict:
        """Where this command's seconds went, from its start to now: `start` (imports, data, the model, the recipe,
        before the first step), `training` (the steps, with their periodic validations and checkpoints),
        `final_eval`, and `closing` (the rest after the last step: the last checkpoint, the selection). A resumed
        run's earlier segments are in wall_seconds, not here."""
        now, m = time.time(), self.marks
        began = m.get("training", now)
        final = m.get("final_evaluated", now) - m["final_eval"] if "final_eval" in m else 0.0
        command = now - self.command_started
        start = began - self.command_started
        return {"command": round(command, 3), "start": round(start, 3), "training": round(segment, 3),
                "final_eval": round(final, 3), "closing": round(command - start - segment - final, 3)}

    def _nothing_trained(self) -> dict:
        """A resumed run that ended before its first step (an elastic restart of a run that had ended): its
        config.toml, summary.json and checkpoints stay as they were."""
        self.telemetry.say(f"ended by {self.ended_by} before any step: the run's files are left as they were")
        for hook in self.hooks:
            hook.run_ends()
        self.telemetry.close()
        summary = self.run_dir / "summary.json"
        if summary.is_file():
            return json.loads(summary.read_text())
        return {"interrupted": True, "steps": self.progress.step}

    def _next_batch(self):
        batch = next(self.loader)
        largest = max(int(batch[0].max()), int(batch[1].max()))  # on the CPU, before the device
        if largest >= self.cfg.model.vocab_size:
            raise_bad_id(largest, None, f"the training batch of step {self.progress.step + 1}",
                         self.cfg.model.vocab_size)
        return batch

    def _check_bad_streak(self) -> None:
        if self.bad_streak >= self.cfg.train.max_bad_steps:
            raise RptError(f"{self.bad_streak} optimiser steps in a row had non-finite gradients "
                           f"(step {self.progress.step}); the run stopped",
                           "lower train.lr, raise train.warmup_steps or use precision fp32/bf16; "
                           f"the last good checkpoint is {self.checkpoints.latest() or 'none'}")

    def _stop_interrupted(self, stop: StopRequest) -> dict:
        """After an interrupt: a checkpoint of this step (no final evaluation, no summary: the run goes on
        with --resume), and the command that continues it. A second signal meanwhile stops at once."""
        tel = self.telemetry
        self.ended_by = stop.requested or "an interrupt on another rank"
        tel.say(f"stopping after step {self.progress.step:,} ({self.ended_by}): writing a checkpoint; "
                "Ctrl-C again stops at once")
        self._settle_pending_skip()
        if self.checkpoints.last_saved_step != self.progress.step and self.progress.step > 0:
            self._save()
        self.checkpoints.finish_pending()
        for hook in self.hooks:
            hook.run_ends()
        tel.close()
        saved = self.checkpoints.latest()
        tel.say(f"interrupted at step {self.progress.step:,}; "
                + (f"the checkpoint {saved} holds it. " if saved else "")
                + f"Continue with: rpt train --run-dir {self.run_dir} --resume"
                + (f" --nproc {os.environ['RPT_NPROC']}" if "RPT_NPROC" in os.environ else
                   " (launched as before)" if self.d.enabled else ""))
        return {"interrupted": True, "steps": self.progress.step, "signal": stop.requested}

    # ------------------------------------------------------------------ pieces
    def mark_phase(self, phase: str) -> None:
        """Tell the step hooks (the stall watchdog) which phase this rank enters; a phase of the step being run
        counts as step + 1."""
        for hook in self.hooks:
            hook.phase(self.progress.step + (phase in IN_STEP), phase)

    def spent(self) -> float:
        """The spent share of the budget."""
        return self.budget.progress(self.progress.step, self.progress.tokens, self.progress.elapsed())

    def _agreed(self, stop: StopRequest) -> tuple[float, bool]:
        """One clock and one stop decision for every rank, in one small collective (a CPU tensor: gloo, no
        device sync). The largest clock: the time budget ends the run on all ranks at the same step, and the
        learning rate (which follows the spent fraction of the budget) stays identical across replicas; and
        a stop asked of any rank stops them all after the same step. Without a time budget the ranks agree
        at each log interval only (whose loss is all-reduced anyway), so a stop waits for that step."""
        elapsed, self.agreed_clock = self.progress.elapsed(), None
        if self.d.world_size == 1:
            self.agreed_clock = elapsed
            return elapsed, stop.requested is not None
        if not self.cfg.train.max_time and self.progress.step % self.cfg.monitor.log_interval:
            return elapsed, False
        agreed = torch.tensor([elapsed, float(stop.requested is not None)], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        self.agreed_clock = agreed[0].item()  # what timed checkpoints go by: the same on every rank
        return self.agreed_clock, bool(agreed[1].item())

    def where(self) -> dict:
        """How far the run is: its step (of train.max_steps), the spent share of the budget, and the budget nearest
        its end."""
        return {"step": self.progress.step, "tokens": self.progress.tokens, "max_steps": self.cfg.train.max_steps,
                "spent": min(1.0, self.spent()),
                "budget": self.budget.leading(self.progress.step, self.progress.tokens, self.progress.elapsed())}

    def _tokens_by_source(self) -> dict:
        """A mixture's tokens read from each source so far (empty for one dataset)."""
        by_source = getattr(self.loader, "tokens_by_source", None)
        return by_source() if by_source else {}

    def _run_figures(self, segment: float, profile: list[dict] | None, selected: dict) -> dict:
        """What the run's summary says of the run itself (telemetry adds the losses and the communication): every
        figure over the whole run, all its segments (resumes) together, but those named `segment_*`."""
        ev, recipe, wall = self.evaluation, self.progress.recipe_seconds, self.progress.elapsed()
        tokens_per_second = self.progress.tokens / max(wall, 1e-9)
        return {"steps": self.progress.step, "tokens": self.progress.tokens, "wall_seconds": round(wall, 3),
                "tokens_per_second": tokens_per_second, "params": self.params,
                "flops_per_token": self.flops_per_token, "peak_flops_per_device": self.peak,
                "mfu": self.telemetry.mfu(tokens_per_second), "ended_by": self.ended_by,
                "skipped_steps": self.progress.skipped_steps, "precision": self.cfg.train.precision,
                "compression": self.cfg.comm.compression, "device": str(self.device), "rpt_commit": rpt_commit(),
                "profile_by_rank": profile,
                **selected, "best_periodic_val_loss": ev.best["loss"] if ev.best else None,
                "eval_seconds": round(ev.seconds, 3), "eval_share": ev.seconds / max(wall, 1e-9),
                "recipe_seconds": round(recipe, 3),
                "selection_share": (ev.seconds + recipe) / max(wall + recipe, 1e-9),
                "segment_first_step": self.resumed_at or 0, "segment_wall_seconds": round(segment, 3),
                "seconds": self._seconds(segment),
                "final_eval_scope": ev.final_scope() if "final_evaluated" in self.marks else "pending: it runs now"}

    def _evaluate(self, final: bool, weights_step: int | None = None) -> dict:
        """A validation of the model's weights (those of `weights_step` where they were loaded back)."""
        with self.clock("eval"), self.averaging.in_model():  # averaging: the average is what is validated
            result = self.evaluation.run(self.runner.eval_model(), self.progress.step, final,
                                         self.telemetry.say if final else None)
            if not final:
                self.evaluation.keep_if_best(self._weights, self.spent_share)
        self.telemetry.evaluation(self.progress.step, result, final, weights_step)
        self.telemetry.say(*self.evaluation.take_warnings())
        return result

    def _weights(self) -> dict:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.held.model.state_dict().items()}

    def _select_best(self) -> dict:
        """The weights the run ends with (its final evaluation, the checkpoint `best`): those of the best periodic
        validation, loaded back (rpt/train/checkpoint/manager.py: Checkpointing.select_best); else the last step's."""
        best = self.evaluation.best
        if best is None or not self.cfg.train.select_best:
            return {"selected_step": self.progress.step, "selected_by": "the last step"}
        with self.clock("checkpoint"):
            selected = self.checkpoints.select_best(self.progress.step, best, self.evaluation.best_weights)
        if selected["selected_step"] != self.progress.step:
            self.telemetry.say(f"selected the weights of step {best['step']:,}: the best periodic validation loss "
                               f"{best['loss']:.4f}, against {self.evaluation.last['loss']:.4f} at step "
                               f"{self.progress.step:,}")
        return selected

    def _save(self, val: tuple[float, int] | None = None) -> None:
        """A checkpoint of this step, ranked by its periodic evaluation when it has one."""
        with self.clock("checkpoint"), self.averaging.in_model():  # a checkpoint's model is what the run stands at
            self.checkpoints.save(self.progress.step, val or self.evaluation.ranking(self.progress.step))

    def _init_from(self, t) -> str:
        weights = read_weights(t.init_from)
        loaded = load_weights(self.held.model, weights, t.init_fresh, self.cfg.model.tie_embeddings,
                              partial=self.held.partial, tokenizer_sha256=self.data.meta.get("tokenizer_sha256", ""))
        fresh = f"; fresh: {', '.join(t.init_fresh)}" if t.init_fresh else ""
        log.info("initialised %d tensors from %s%s", len(loaded), weights.source, fresh)
        return f"initialised from {weights.source} ({len(loaded)} tensors{fresh})"

    def _resume(self) -> None:
        path = self.checkpoints.resume()
        if path is None:  # nothing saved yet: a restarted new run starts as it did
            if self.cfg.train.init_from:
                self.telemetry.say(self._init_from(self.cfg.train))
            return
        first_look = restart_count() == 0  # an elastic restart goes on as the run was
        p = self.progress
        extending = self.budget.resume(p.step, p.tokens, p.elapsed_before, refuse_spent=first_look)
        lines = [f"resumed from {path} at step {p.step}", *([extending] if extending else []),
                 *([p.afresh] if p.afresh else [])]
        ev = self.evaluation
        if self.budget.rescale != 1.0:
            ev.rescale_progress(self.budget.rescale)
        if ev.stale and first_look:
            if self.budget.rescale >= 1.0:  # not extended
                raise RptError(f"this run was ended by {ev.stale}: resumed as it is, it would stop before its first "
                               "step", f"extend its budget ({self.budget.larger(p.step, p.elapsed_before)}), "
                               "which starts the early stop's patience afresh, or turn it off with --set "
                               "train.early_stop=0")
            ev.restart_patience(self.budget.progress(p.step, p.tokens, p.elapsed_before))
            lines.append(f"the run had stopped early (train.early_stop = {self.cfg.train.early_stop:g}): its patience "
                         "starts afresh here, so it stops again only after that share of the extended budget without "
                         f"a validation better than the best ({ev.best['loss']:.4f}, step {ev.best['step']:,})")
        self.resumed_at = self.progress.step
        log.info("resumed from %s at step %d", path, self.progress.step)
        self.telemetry.say(*lines)

    def _write_run_files(self) -> None:
        self.recorded = True
        if not self.d.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(self.resolved.to_toml())
        for name in ("meta.json", "tokenizer.json"):  # the run directory stands on its own
            shutil.copyfile(self.data.path / name, self.run_dir / name)


class PhaseClock:
    """Each phase's seconds (rpt.monitor.metrics.PHASES), summed until `take()`: on the CPU by the clock, on a
    GPU by event pairs resolved only at `take()` (once per log line), so the step never waits for the device
    because of the measurement. `on_phase(name)` hears each phase begin (the step hooks)."""

    def __init__(self, device: torch.device, on_phase):
        self.cuda = device.type == "cuda"
        self.sums = dict.fromkeys(PHASES, 0.0)
        self.events: list[tuple[str, object, object]] = []  # CUDA: (phase, start, end), resolved in take()
        self.on_phase = on_phase

    @contextmanager
    def __call__(self, phase: str):
        self.on_phase(phase)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self.events.append((phase, start, end))
            return
        began = time.perf_counter()
        try:
            yield
        finally:
            self.sums[phase] += time.perf_counter() - began

    def add(self, phase: str, seconds: float) -> None:
        self.sums[phase] += seconds

    def take(self) -> dict[str, float]:
        if self.events:
            self.events[-1][2].synchronize()  # the last phase's end: every earlier event has happened too
            for phase, start, end in self.events:
                self.sums[phase] += start.elapsed_time(end) / 1000.0
            self.events = []
        sums, self.sums = self.sums, dict.fromkeys(PHASES, 0.0)
        return sums


def step_hooks(train, monitor, d: Dist, run_dir: Path) -> list[StepHooks]:
    """The step hooks (rpt/train/hooks.py) this run's configuration asks for: the stall watchdog on several
    processes (the train section's stall_timeout), the profiler when steps are to be traced (monitor.profile)."""
    hooks: list[StepHooks] = []
    if d.world_size > 1 and train.stall_timeout:
        hooks.append(Watchdog(d.rank, d.world_size, train.stall_timeout))
    if monitor.profile:
        hooks.append(StepProfiler(monitor.profile, run_dir, d.rank, d.device))
    return hooks
