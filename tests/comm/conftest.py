from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank in this process (DDP and the hooks run; nothing leaves it)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
