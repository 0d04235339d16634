"""Processes, devices and the process group.

Three ways to run `rpt train`, one code path:
- one process: no process group, world size 1;
- under `torchrun` (on each node): the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...);
- `--nproc N`: rpt launches N local workers itself through torch's elastic launcher, the
  same machinery torchrun uses, so `--max-restarts` behaves exactly as under torchrun. The workers are
  forked from a fork server that has imported the worker's module once (torch and rpt), not spawned: each
  spawned worker imported them again, a third of the start-up's CPU time. The server forks before any
  thread pool or device exists, so the workers start as clean as spawned ones.

Each rank takes `cuda:LOCAL_RANK` when CUDA is there, else the CPU; `--device` overrides. The
ranks tell each other their device through the rendezvous store before the group is made: NCCL
(with gloo beside it for CPU tensors) when every rank has a GPU, gloo for all of them otherwise,
so a job that mixes CPU and GPU ranks runs (gloo takes CUDA tensors through host memory).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rpt.errors import RptError
from rpt.net import port_from_env

COLLECTIVE_TIMEOUT = timedelta(minutes=10)
STALL_EXIT = 3  # the exit status of a rank that rpt.train.watchdog stopped: the launcher names the stall
log = logging.getLogger("rpt.launch")


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mixed_devices: bool = False  # some ranks on a GPU, some on the CPU: every rank on gloo

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str | None, local_rank: int) -> torch.device:
    if requested in (None, "", "auto"):
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise RptError("--device cuda was asked for, but CUDA is not available", "use --device cpu, or auto")
        return torch.device(f"cuda:{local_rank}")
    if requested == "cpu":
        return torch.device("cpu")
    raise RptError(f"unknown device '{requested}'", "use --device auto, cpu or cuda")


def setup(device: str | None = None) -> Dist:
    """Join the process group when launched as one of several ranks; otherwise run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if dev.type == "cpu" and local_world > 1 and "OMP_NUM_THREADS" not in os.environ:
        # N workers on one machine each take a share of its cores; oversubscribed they thrash (measured:
        # 2 workers x 2 threads on 2 cores ran at 0.17 of one process's speed each).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        store = rendezvous_store(rank, world)
        kinds = device_kinds(store, rank, world, dev)
        mixed = kinds == {"cpu", "cuda"}
        if mixed and rank == 0:
            log.warning("this job mixes CPU and GPU ranks: every rank uses gloo (CUDA tensors pass through host memory)")
        backend = "cpu:gloo,cuda:nccl" if kinds == {"cuda"} else "gloo"
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
        return Dist(rank, world, local_rank, dev, mixed)
    return Dist(rank, world, local_rank, dev)


def choose_allocator(device: torch.device, parallel, bptt_chunk: int) -> None:
    """The CPU allocator's setting for how this run frees memory (rpt/runtime/memory.py): exact BPTT in chunks
    (`bptt_chunk`) and FSDP's units (the parallel section's fsdp) free large blocks in turn, which would fragment a
    heap that keeps every block, so on the CPU rpt's page pool reuses them; otherwise the heap keeps freed memory
    mapped across steps."""
    from rpt.runtime.memory import keep_freed_memory, pool_large_blocks

    if bptt_chunk or parallel.fsdp != 1:
        if device.type == "cpu":
            pool_large_blocks()
    else:
        keep_freed_memory()


def rendezvous_store(rank: int, world: int) -> dist.Store:
    """The store at MASTER_ADDR:MASTER_PORT (the elastic agent's under torchrun and --nproc, else rank 0's),
    with keys of this attempt only.

    A restarted group must not read the previous attempt's connection keys: with torch's default setup
    the new ranks were handed the dead workers' gloo addresses (seen here: "connectFullMesh ... Connection
    refused", or a hang, in most restarts after a SIGKILL). The prefix gives each attempt its own keys
    (8 of 8 restarts resumed)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), port_from_env("MASTER_PORT", 29500),
                          world, is_master=not agent and rank == 0, timeout=COLLECTIVE_TIMEOUT)
    return dist.PrefixStore(f"rpt-attempt-{restart_count()}", store)


def device_kinds(store: dist.Store, rank: int, world: int, device: torch.device) -> set[str]:
    """Every rank publishes its device type and reads all of them (NCCL is for jobs where all are "cuda")."""
    store.set(f"device/{rank}", device.type)
    keys = [f"device/{r}" for r in range(world)]
    store.wait(keys)
    return {store.get(k).decode() for k in keys}


def teardown() -> None:
    if dist.is_initialized():
        # A gloo worker thread destroys each finished work object just after the caller's wait() has
        # returned, and releasing a tensor made in Python takes the GIL. If the group's last reference goes
        # (DDP's reducer holds one) while such a destructor waits for the GIL, the group's destructor joins
        # that thread while holding the GIL: a deadlock at exit (seen in 2-rank runs, about 1 in 10).
        # Sleeping releases the GIL, so the destructors of the barrier and of every earlier work finish first.
        dist.barrier()
        time.sleep(0.1)
        dist.destroy_process_group()


def restart_count() -> int:
    """How many times the elastic launcher has restarted this worker group (0 on the first run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(nproc: int, max_restarts: int, entrypoint, *args) -> str | None:
    """Run `entrypoint(*args)` in `nproc` local workers through torch's elastic launcher. Returns the name of
    the signal that interrupted them (they stopped after a step, with a checkpoint), or None."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from rpt.runtime.signals import AGENT_SIGNALS, forward_to_workers

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"rpt-{os.getpid()}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts,
                          monitor_interval=0.5, start_method="forkserver", signals_to_handle=AGENT_SIGNALS)
    multiprocessing.set_forkserver_preload([entrypoint.__module__])  # (module docstring)
    # torch's elastic agent logs every failed worker's traceback to stderr; rpt reports the failure itself
    # (a user error as its one message, anything else with the rank's log, which holds the traceback)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ["RPT_NPROC"] = str(nproc)  # the workers' resume hint names it
    try:
        with forward_to_workers() as stop:
            elastic_launch(config, entrypoint)(*args)
        return stop["requested"]
    except ChildFailedError as exc:
        first = next(iter(exc.failures.values()), None)
        if first is not None and first.exitcode == STALL_EXIT:
            raise RptError("a rank stalled: the job stopped instead of waiting for it "
                           f"(after {max_restarts} restart(s))",
                           "the stall message in RUN_DIR/logs/rank*.log names the rank behind and the operation; "
                           "raise train.stall_timeout if that phase is legitimately long") from None
        message = first.message.get("message", "") if first is not None and isinstance(first.message, dict) \
            else str(first.message if first is not None else "")
        if message.startswith("RptError: "):  # the same user error on a worker: say it as one process would
            what, _, fix = message[len("RptError: "):].partition("\n  fix: ")
            raise RptError(what, fix or None) from None
        detail = f" (rank {first.local_rank}: {message.splitlines()[0] if message else 'exit ' + str(first.exitcode)})" \
            if first is not None else ""
        raise RptError(f"a training worker failed after {max_restarts} restart(s){detail}",
                       "read the rank's log in RUN_DIR/logs/; --max-restarts N retries from the newest checkpoint") from None
