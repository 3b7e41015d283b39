"""Which global steps this process owns: data parallel over steps, on engines that already exist.

Rank r of W owns steps r+1, r+1+W, ... The rank comes from, in order: `--num_shards/--shard_index`
(Slurm job arrays), torchrun's RANK / WORLD_SIZE (a gloo process group is opened for barriers),
or srun's SLURM_PROCID / SLURM_NTASKS. All ranks write into one predictions folder; that is safe
because every step has exactly one owner and files are renamed into place.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta

from modelzoo.errors import UserError


@dataclass(frozen=True)
class Shard:
    """This process's share of the steps; `local_count` ranks share this machine's cores."""

    index: int = 0
    count: int = 1
    local_count: int = 1
    process_group: bool = False

    def owns(self, step: int) -> bool:
        """Whether 1-based global `step` belongs to this shard."""
        return (step - 1) % self.count == self.index

    @property
    def is_first(self) -> bool:
        return self.index == 0

    def barrier(self) -> None:
        """Waits for every rank, where a process group exists (torchrun); a no-op otherwise."""
        if self.process_group:
            import torch.distributed as dist

            dist.barrier()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    match = re.match(r"\d+", value.strip())  # SLURM_STEP_TASKS_PER_NODE looks like "2(x3)"
    if not match:
        raise UserError(f"environment variable {name}={value!r} is not an integer")
    return int(match.group())


def detect_shard(num_shards: int | None = None, shard_index: int | None = None) -> Shard:
    """The shard from the command line, else torchrun's environment, else srun's, else a single one."""
    if num_shards is not None or shard_index is not None:
        if num_shards is None or shard_index is None:
            raise UserError("--num_shards and --shard_index go together")
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise UserError(f"--shard_index must be in 0..{num_shards - 1} and --num_shards >= 1, "
                            f"got {shard_index} of {num_shards}")
        return Shard(shard_index, num_shards)
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is not None and world is not None:
        local = _env_int("LOCAL_WORLD_SIZE") or 1
        if world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                # gloo on every device: only barriers go through it. Ranks finish hours apart on
                # skewed data, so the barrier must not time out like a collective would.
                dist.init_process_group("gloo", timeout=timedelta(days=7))
        return Shard(rank, world, local, process_group=world > 1)
    rank, world = _env_int("SLURM_PROCID"), _env_int("SLURM_NTASKS")
    if rank is not None and world is not None:
        return Shard(rank, world, _env_int("SLURM_STEP_TASKS_PER_NODE") or 1)
    return Shard()
