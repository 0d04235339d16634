"""How ranks agree on a backend: NCCL only when every rank has a GPU; a mixed job runs on gloo and refuses
what gloo cannot carry for CUDA tensors. (The rendezvous itself runs in every multi-process test.)"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from rpt.errors import RptError
from rpt.parallel.launch import Dist, device_kinds
from rpt.train.resolve import check_world, resolve_comm
from rpt.train.trainer import Trainer


@pytest.mark.parametrize("devices, expected", [(["cpu", "cpu"], {"cpu"}), (["cuda", "cuda", "cuda"], {"cuda"}),
                                               (["cuda", "cpu", "cuda"], {"cpu", "cuda"})])
def test_every_rank_reads_every_ranks_device_kind(devices, expected):
    store = dist.HashStore()
    seen = [None] * len(devices)

    def rank(r):
        seen[r] = device_kinds(store, r, len(devices), torch.device(devices[r]))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(devices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen == [expected] * len(devices)


@pytest.mark.parametrize("setting", ["comm.compression=topk", "comm.mode=ps", "comm.mode=ps-sharded"])
def test_a_mixed_job_refuses_what_gloo_cannot_carry_for_cuda_tensors(make_cfg, tmp_path, setting):
    mixed = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mixed_devices=True)
    with pytest.raises(RptError, match="mixes CPU and GPU ranks") as info:
        Trainer(make_cfg(setting), tmp_path / "r", mixed, show_progress=False)
    assert setting.split("=")[0] in info.value.message and not (tmp_path / "r").exists()
    check_world(make_cfg("comm.compression=powersgd"), mixed)  # all-reduce based: allowed
    auto = make_cfg("comm.mode=auto").thawed()
    resolve_comm(auto, mixed, None)
    assert auto.comm.mode == "allreduce"  # the only mode a mixed job can run
    assert "CPU and GPU" in auto.origins["comm.mode"]
