"""`rpt topology`: measure the links between the ranks of this job and predict each mode's cost.

Runs under torchrun on every node (or `--nproc N` here, through the same elastic launcher as
training). Every rank measures; rank 0 prints the table and the prediction for the configured
model's gradient bytes, and writes it as JSON when asked.
"""

from __future__ import annotations

import json
from pathlib import Path


from rpt.config import Config
from rpt.errors import RptError
from rpt.comm import links
from rpt.parallel import launch
from rpt.parallel.plan import gradient_bytes


def with_data_vocabulary(cfg: Config) -> Config:
    """`cfg` itself, or where model.vocab_size = 0 (the data's vocabulary) a frozen copy with the vocabulary of
    data.path/meta.json: what `rpt topology` and `rpt plan` count the model with."""
    if cfg.model.vocab_size:
        return cfg
    meta = Path(next(iter(cfg.data.mix), cfg.data.path)) / "meta.json"  # a mixture's folders share one
    if not meta.is_file():
        raise RptError("model.vocab_size is 0 and data.path has no meta.json to take it from",
                       "set model.vocab_size, or point data.path at a prepared dataset")
    copy = cfg.thawed()
    copy.set("model.vocab_size", json.loads(meta.read_text())["vocab_size"], origin="the data (meta.json)")
    return copy.freeze()


def topology_worker(cfg: Config, message_mb: float, out: str | None) -> dict:
    d = launch.setup("cpu")
    try:
        if not d.enabled:
            raise RptError("rpt topology needs several ranks", "run it under torchrun on every node, or with --nproc N")
        topo = links.measure(message_mb=message_mb)
        n = gradient_bytes(with_data_vocabulary(cfg))
        predictions = links.predict(topo, n)
        timed = links.time_modes(n)
        if d.is_main:
            print(links.format_table(topo, predictions, n, timed), flush=True)
            if out:
                Path(out).write_text(json.dumps({
                    "world_size": topo.world_size, "nodes": topo.nodes, "gradient_bytes": n,
                    "links": [{"pair": [i, j], "kind": topo.kind(i, j), "latency_s": topo.latency[(i, j)],
                               "bandwidth_Bps": topo.bandwidth[(i, j)]} for (i, j) in sorted(topo.latency)],
                    "predicted_seconds": predictions, "timed_seconds": timed,
                    "chosen": links.fastest(timed)}, indent=2) + "\n")
        return predictions
    finally:
        launch.teardown()


def run_topology(cfg: Config, nproc: int, message_mb: float, out: str | None) -> None:
    if nproc > 1:
        launch.launch_local(nproc, 0, topology_worker, cfg, message_mb, out)
    else:
        topology_worker(cfg, message_mb, out)
