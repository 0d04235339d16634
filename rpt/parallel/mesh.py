"""The ranks as a mesh `pp x dp x fsdp`: pipeline stages outermost, then replicas, then the shards of FSDP.

Pipeline outermost as torchtitan lays it out, so the data dimensions (the heavier traffic) run among
neighbouring ranks, and the shards innermost, since their all-gathers and reduce-scatters come every block.
The data ranks of a stage are its `dp x fsdp` ranks together: each reads its own rows of the batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Mesh:
    """This rank's place in the layout and the process groups along each dimension."""

    def __init__(self, device: torch.device, world_size: int, pp: int, fsdp: int = 1):
        from torch.distributed.device_mesh import init_device_mesh

        self.pp, self.fsdp = pp, fsdp
        self.replicas = world_size // (pp * fsdp)
        self.mesh = init_device_mesh(device.type, (pp, self.replicas, fsdp), mesh_dim_names=("pp", "dp", "fsdp"))
        self.pp_group = self.mesh.get_group("pp")
        self.pp_rank = self.mesh.get_local_rank("pp")
        self.dp = self.replicas * fsdp  # data-parallel ranks of a stage
        self.dp_rank = self.mesh.get_local_rank("dp") * fsdp + self.mesh.get_local_rank("fsdp")
        grid = self.mesh.mesh.tolist()  # [pp][dp][fsdp] -> global rank
        self.layout = [[r for replica in stage for r in replica] for stage in grid]  # [pp][data rank] -> rank
        self.dp_group = self.tie_group = None
        for s, stage in enumerate(self.layout):  # every rank creates every group, in the same order
            group = dist.new_group(stage) if len(stage) > 1 else None
            if s == self.pp_rank:
                self.dp_group = group
        for j in range(self.dp):
            ends = sorted({self.layout[0][j], self.layout[-1][j]})
            group = dist.new_group(ends) if len(ends) > 1 else None
            if j == self.dp_rank and self.pp_rank in (0, pp - 1):
                self.tie_group = group

    @property
    def shard_mesh(self):
        """The data dimensions FSDP2 runs over: `(dp, fsdp)`, HSDP when both exceed 1."""
        return self.mesh["dp", "fsdp"] if self.replicas > 1 else self.mesh["fsdp"]

    @property
    def shard_group(self):
        """The ranks that hold one parameter's shards between them."""
        return self.mesh.get_group("fsdp")
