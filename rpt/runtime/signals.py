"""Ctrl-C and SIGTERM (which SLURM sends before a time limit): the first asks the run to stop after the
step in flight, every rank at the same step, with a checkpoint; a second stops at once.

A worker of `--nproc` also takes SIGUSR1 and SIGUSR2 as the first request: the launcher forwards a SIGINT it
receives as SIGUSR1 and a SIGTERM as SIGUSR2 (`FORWARDED`), so that a worker which got the same Ctrl-C from the
terminal does not count it twice, and still names the signal the user sent.
The launcher keeps torch's elastic agent off these signals (LaunchConfig.signals_to_handle = AGENT_SIGNALS),
which would otherwise kill the workers at once with a traceback of its own.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
FORWARDED = {signal.SIGINT: signal.SIGUSR1, signal.SIGTERM: signal.SIGUSR2}  # how the launcher passes each on
AGENT_SIGNALS = "SIGHUP,SIGQUIT"  # what torch's elastic agent still handles under `--nproc`


class StopRequest:
    """Installed around the training loop; `requested` names the first signal once one arrived."""

    def __init__(self, in_worker: bool):
        self.in_worker = in_worker  # under an elastic launcher: a second signal ends the process by that signal
        self.requested: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (*STOP_SIGNALS, *FORWARDED.values()):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        forwarded = {copy: sent for sent, copy in FORWARDED.items()}
        if self.requested is None:
            self.requested = signal.Signals(forwarded.get(signum, signum)).name  # the signal the user sent
            return
        if signum in forwarded:  # the launcher's copy of a request already taken
            return
        if self.in_worker:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        raise KeyboardInterrupt


@contextmanager
def forward_to_workers():
    """In the `--nproc` launcher: a first SIGINT/SIGTERM goes to the workers as SIGUSR1/SIGUSR2 (each then
    stops after its step with a checkpoint); a second raises KeyboardInterrupt here, and the agent stops them."""
    state = {"requested": None}

    def handle(signum, frame):
        if state["requested"] is not None:
            raise KeyboardInterrupt
        state["requested"] = signal.Signals(signum).name
        for pid in _children():
            try:
                os.kill(pid, FORWARDED[signal.Signals(signum)])
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        yield state
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _children() -> list[int]:
    """The workers: this process's child processes (Linux /proc), or the children of the fork server that
    launch.py starts them from (they share its command line); multiprocessing's resource tracker and the fork
    server left out (SIGUSR1 and SIGUSR2 would end them)."""
    workers = []
    for child in _child_pids(os.getpid()):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.forkserver" in cmdline:
            workers += _child_pids(child)
        elif b"resource_tracker" not in cmdline:
            workers.append(child)
    return workers


def _child_pids(pid: int) -> list[int]:
    pids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids
