"""The job's tensor-parallel group: its process group, opened from this rank's shard, and stop requests that the
whole group obeys at the same step (modelzoo/models/tensor_parallel.py splits the model)."""
from __future__ import annotations

from datetime import timedelta

import torch

from modelzoo.job.distributed import Shard
from modelzoo.job.preemption import StopRequest
from modelzoo.models.tensor_parallel import TensorParallelGroup


def open_group(shard: Shard, device: torch.device) -> TensorParallelGroup:
    """The process group of this rank's tensor-parallel group (NCCL on CUDA, gloo on CPU).

    Groups are consecutive ranks, [d*N, (d+1)*N) for group d (one node's ranks when N divides
    --nproc_per_node). torch.distributed wants every rank to create every group, in the same order.
    """
    if shard.tp_size == 1:
        return TensorParallelGroup(device=device)
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = None
    for first in range(0, world, shard.tp_size):
        ranks = list(range(first, first + shard.tp_size))
        # An hour: ranks meet first after loading their weights, which may take a while on slow disks.
        group = dist.new_group(ranks, backend="nccl" if device.type == "cuda" else "gloo",
                               timeout=timedelta(hours=1))
        if rank in ranks:
            mine = group
    return TensorParallelGroup(shard.tp_rank, shard.tp_size, mine, device)


class AgreedStop:
    """A stop request the whole group obeys at the same step.

    Ranks get a signal at slightly different moments; one that stopped a step before the others
    would leave them waiting forever in their next all-reduce. So every poll all-reduces (max) the
    signal number any rank has received, and all stop on the same poll with the same `signum`.
    """

    def __init__(self, stop: StopRequest, tp: TensorParallelGroup) -> None:
        self.stop, self.tp = stop, tp
        self.signum: int | None = None
        self._flag = torch.zeros(1, dtype=torch.int64, device=tp.device)

    def __call__(self) -> bool:
        if self.signum is None:  # once set, it is set on every rank: no more polls, on any of them
            self._flag.fill_(self.stop.signum or 0)
            self.signum = int(self.tp.all_reduce(self._flag, op="max").item()) or None
        return self.signum is not None
