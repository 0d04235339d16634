"""Running `rpt prepare`'s units on N processes of this machine, with one progress bar over all of them.

One worker encodes in this process (HF tokenizers already spreads `encode_batch` over the cores). More are
spawned processes of multiprocessing's Pool, each given whole units; reading, cutting and writing in Python then
overlap with other workers' encoding, and each worker's memory is that of one unit's batch and table. Each
worker's encoder gets its share of the cores (RAYON_NUM_THREADS), so N workers do not run N x cores threads.
A worker's error reaches the caller as it was raised (an RptError keeps its message and fix); the pool is
terminated then, and on an interrupt, leaving only complete units behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os

from rpt.data.units import Unit, UnitJob, encode_unit

_worker: dict = {}


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
    pool = ctx.Pool(workers, initializer=_init, initargs=(job, counter, threads))
    try:
        pending = [pool.apply_async(_encode, (unit,)) for unit in units]
        shown = 0.0
        while pending:
            pending[0].wait(0.25)
            bar.update(counter.value - shown)
            shown = counter.value
            for result in [r for r in pending if r.ready()]:
                result.get()  # a worker's error, raised here
                pending.remove(result)
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _init(job: UnitJob, counter, threads: int) -> None:
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when the encoder first starts its threads
    from rpt.data.tokenizer import load_tokenizer

    _worker.update(job=job, counter=counter, tok=load_tokenizer(job.tokenizer))


def _encode(unit: Unit) -> dict:
    counter = _worker["counter"]

    def progress(n: float) -> None:
        with counter.get_lock():
            counter.value += n

    return encode_unit(_worker["job"], unit, _worker["tok"], progress)
