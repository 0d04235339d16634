"""A 2-node run over the emulated cluster (network namespaces, shaped links, torchrun with c10d rendezvous).

Skips, saying why, where the machine cannot make namespaces (no root, no iproute2).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "comm"))
from netns import Cluster, available  # noqa: E402

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")


def test_two_nodes_over_shaped_links_train_with_identical_replicas(tmp_path, tiny_data):
    run = tmp_path / "run"
    args = ["-m", "rpt", "train", "--run-dir", str(run), "--set", f"data.path={tiny_data}",
            "--set", "model.d_model=32", "--set", "train.batch_size=4", "--set", "train.seq_len=16",
            "--set", "train.max_steps=6", "--set", "train.eval_interval=0", "--set", "monitor.log_interval=1",
            "--set", "comm.mode=ps-sharded"]
    with Cluster(2, rates_mbit=200) as cluster:
        namespaces = cluster.names + [cluster.switch]
        probe = "import os; print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])"
        seen = [cluster.run(i, [sys.executable, "-c", probe]).stdout.split() for i in cluster.nodes]
        cores = [set(cluster.cores(i)) for i in cluster.nodes]
        assert all(c for c in cores) and (len(os.sched_getaffinity(0)) < 2 or not cores[0] & cores[1])
        assert [" ".join(s[:-1]) for s in seen] == [str(sorted(c)) for c in cores]  # each node on its own cores
        assert [s[-1] for s in seen] == [str(len(c)) for c in cores]  # and torch's threads to match
        procs = [cluster.popen(i, cluster.torchrun(i, 1, args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for i in cluster.nodes]
        outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(o[-3000:] for o in outs)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in namespaces)  # torn down
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6 and summary["comm_mode"] == "ps-sharded"
    assert sum(summary["comm_bytes_per_step_by_rank"]) == 2 * 4 * summary["params"]
    digests = {re.search(r"parameter digest (\w+)", (run / "logs" / f"rank{r}.log").read_text()).group(1) for r in (0, 1)}
    assert len(digests) == 1
    assert sum(str(run / "summary.json") in o for o in outs) == 1  # rank 0 alone reports
