"""Which global steps this process owns: data parallel over steps, on engines that already exist.

Rank r of W owns steps r+1, r+1+W, ... The rank comes from, in order: `--num_shards/--shard_index`
(Slurm job arrays), torchrun's RANK / WORLD_SIZE (a gloo process group is opened for barriers),
or srun's SLURM_PROCID / SLURM_NTASKS. All ranks write into one predictions folder; that is safe
because every step has exactly one owner and files are renamed into place.

With `runconfig.tensor_parallel: N` (torchrun only), consecutive ranks [d*N, (d+1)*N) form one
tensor-parallel group that owns data shard d of WORLD_SIZE / N: its ranks run every step of the
shard together, and only its rank 0 writes files (modelzoo/models/tensor_parallel.py).
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
    tp_rank: int = 0  # rank within this shard's tensor-parallel group
    tp_size: int = 1  # runconfig.tensor_parallel

    @property
    def writes(self) -> bool:
        """Whether this process writes files and logs progress: rank 0 of its tensor-parallel group."""
        return self.tp_rank == 0

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


def _check_shard_flags(num_shards: int | None, shard_index: int | None) -> bool:
    """Whether --num_shards / --shard_index were given (both, and in range)."""
    if num_shards is None and shard_index is None:
        return False
    if num_shards is None or shard_index is None:
        raise UserError("--num_shards and --shard_index go together")
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise UserError(f"--shard_index must be in 0..{num_shards - 1} and --num_shards >= 1, "
                        f"got {shard_index} of {num_shards}")
    return True


def _open_process_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        # gloo on every device: only barriers go through it. Ranks finish hours apart on
        # skewed data, so the barrier must not time out like a collective would.
        dist.init_process_group("gloo", timeout=timedelta(days=7))


def close_process_group() -> None:
    """Shuts the process group down before the interpreter exits: left to static destructors, gloo's
    threads were once still running at exit (std::terminate, exit -6, after a complete run)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def tensor_parallel_shard(rank: int | None, world: int | None, local: int, tensor_parallel: int,
                          num_shards: int | None = None, shard_index: int | None = None) -> Shard:
    """The shard of torchrun rank `rank` of `world` in groups of `tensor_parallel` ranks: group
    rank // N owns data shard rank // N of world // N (of that times K with --num_shards K, when
    each job of an array is one torchrun)."""
    n = tensor_parallel
    if rank is None or world is None:
        raise UserError(f"runconfig.tensor_parallel {n} needs one process per rank: launch with "
                        f"torchrun --nproc_per_node={n} run_inference.py ... (RANK / WORLD_SIZE are not set)")
    if world % n:
        raise UserError(f"WORLD_SIZE {world} is not a multiple of runconfig.tensor_parallel {n}: start N x D processes "
                        f"for D data-parallel groups of {n} ranks (e.g. torchrun --nproc_per_node={n})")
    groups = world // n
    index, count = rank // n, groups
    if _check_shard_flags(num_shards, shard_index):
        index, count = shard_index * groups + index, num_shards * groups
    return Shard(index, count, local, process_group=True, tp_rank=rank % n, tp_size=n)


def detect_shard(num_shards: int | None = None, shard_index: int | None = None, tensor_parallel: int = 1) -> Shard:
    """The shard from the command line, else torchrun's environment, else srun's, else a single one.

    tensor_parallel > 1 needs torchrun (its RANK / WORLD_SIZE, WORLD_SIZE a multiple of it)."""
    if tensor_parallel > 1:
        shard = tensor_parallel_shard(_env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_WORLD_SIZE") or 1,
                                      tensor_parallel, num_shards, shard_index)
        _open_process_group()
        return shard
    if _check_shard_flags(num_shards, shard_index):
        return Shard(shard_index, num_shards)
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is not None and world is not None:
        local = _env_int("LOCAL_WORLD_SIZE") or 1
        if world > 1:
            _open_process_group()
        return Shard(rank, world, local, process_group=world > 1)
    rank, world = _env_int("SLURM_PROCID"), _env_int("SLURM_NTASKS")
    if rank is not None and world is not None:
        return Shard(rank, world, _env_int("SLURM_STEP_TASKS_PER_NODE") or 1)
    return Shard()
