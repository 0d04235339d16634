"""Running `rpt prepare`'s units on N processes of this machine, with one progress bar over all of them.

One worker encodes in this process (HF tokenizers already spreads `encode_batch` over the cores). More are
spawned processes, each taking whole units from one queue; reading, cutting and writing in Python then overlap
with other workers' encoding, and each worker's memory is that of one unit's batch and table. Each worker's
encoder gets its share of the cores (RAYON_NUM_THREADS), so N workers do not run N x cores threads. A worker's
error reaches the caller as it was raised (an RptError keeps its message and fix); the workers are terminated then,
and on an interrupt, leaving only complete units behind (a unit's files appear whole or not at all).

Plain processes and two queues rather than multiprocessing's Pool: Pool.terminate() hangs for good when it kills a
worker that holds the result queue's lock (its task thread then waits on that lock forever: met under load, a
worker's error while another was reporting). Here nothing touches a queue once the workers are terminated.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue

from rpt.data.units import Unit, UnitJob, encode_unit


def run_units(job: UnitJob, units: list[Unit], workers: int, bar) -> None:
    """Encode `units` with `workers` processes; `bar` (tqdm) counts their bytes on disk as they go."""
    if not units:
        return
    if workers <= 1 or len(units) == 1:
        from rpt.data.tokenizer import load_tokenizer

        tok = load_tokenizer(job.tokenizer)
        for unit in units:
            encode_unit(job, unit, tok, bar.update)
        return
    ctx = mp.get_context("spawn")  # no fork of a process whose encoder threads already run
    counter = ctx.Value("d", 0.0)
    workers = min(workers, len(units))
    threads = max(1, (os.cpu_count() or 1) // workers)
    tasks, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_work, args=(job, counter, threads, tasks, results), daemon=True)
             for _ in range(workers)]
    for p in procs:
        p.start()
    try:
        for unit in [*units, *[None] * workers]:  # a None a worker: no more units
            tasks.put(unit)
        done, shown = 0, 0.0
        while done < len(units):
            try:
                error = results.get(timeout=0.25)
            except queue.Empty:
                lost = [p.exitcode for p in procs if not p.is_alive() and p.exitcode != 0]
                if (lost or not any(p.is_alive() for p in procs)) and results.empty():
                    raise RuntimeError(f"a prepare worker ended without reporting its unit (exit codes {lost})") from None
            else:
                if error is not None:
                    raise error  # as the worker raised it
                done += 1
            bar.update(counter.value - shown)
            shown = counter.value
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
        for q in (tasks, results):  # units not taken stay in the queue: do not wait to flush them at exit
            q.cancel_join_thread()
            q.close()


def _work(job: UnitJob, counter, threads: int, tasks, results) -> None:
    """A worker: units from `tasks` until a None, each reported on `results` (None, or the error it met)."""
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when the encoder first starts its threads
    from rpt.data.tokenizer import load_tokenizer

    tok = load_tokenizer(job.tokenizer)

    def progress(n: float) -> None:
        with counter.get_lock():
            counter.value += n

    while (unit := tasks.get()) is not None:
        try:
            encode_unit(job, unit, tok, progress)
        except Exception as exc:  # noqa: BLE001 (every error goes to the caller, which raises it)
            results.put(exc)
            return
        results.put(None)
