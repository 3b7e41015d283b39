"""Tensor parallel for the Llama family (Llama, Mistral, Qwen2): each of N ranks holds 1/N of every layer.

Launched as `torchrun --nproc_per_node=N run_inference.py ...` with `runconfig.tensor_parallel: N`.
The N ranks of a group run the same engine on the same inputs in lockstep. The split is applied
from outside the family's code (as gpt-fast does): the model is built at one rank's size, a few
modules are swapped, and hooks add the collectives; llama.py itself stays single-process.

What rank r of N holds (H query heads, KV key/value heads, I MLP columns, V vocabulary rows):
- attention: query heads [r*H/N, (r+1)*H/N) and kv heads [r*KV/N, (r+1)*KV/N). Its fused qkv_proj
  rows are its q heads | its k heads | its v heads (column parallel), biases split alike. With
  grouped-query attention query head h reads kv head h // (H/KV), so a rank's query heads read only
  its own kv heads, and its KV cache holds only those. o_proj keeps the matching input columns (row
  parallel): each rank's product is a partial sum of the layer's output; an all-reduce completes it.
- MLP: gate and up columns [r*I/N, (r+1)*I/N) (column parallel), down_proj the matching input
  columns (row parallel), then the second all-reduce of the layer.
- row-parallel biases (o_proj with attention_bias, down_proj with mlp_bias) live on rank 0 only:
  added once, before the all-reduce.
- embedding and LM head: vocabulary rows [r*V//N, (r+1)*V//N). The embedding looks up the ids it
  holds (zeros for the others) and all-reduces, which is exact (x + 0 = x); the LM head computes its
  rows' logits and all-gathers them, so every rank has the same full logits and picks the same
  token whatever rounding its partial sums had. A tied LM head stays tied to the same rows.
  Why split rather than replicate: the embedding is the largest single matrix (SmolLM2-135M: 28 M of
  135 M weights; Llama 3 8B: 0.5 B, twice when untied); replicated, it would stay whole on every
  rank. The cost is one all-reduce of (B, T, hidden) and one all-gather of (B, V) per forward.
- RMSNorm weights and rotary tables: replicated (hidden-size vectors).

Each rank reads only its rows or columns from disk: `index()` tells the loader which part of each
Hugging Face weight it needs (safetensors `get_slice`; `.bin` files are loaded whole and sliced).
In float32 the partial sums add up in another order than in one process, so logits differ in the
last bits; greedy tokens are the same unless two logits are within that noise of each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from modelzoo.models.checkpoint import SKIP, load_hf_config
from modelzoo.errors import UserError
from modelzoo.models import REGISTRY, model_class, registered_class

if TYPE_CHECKING:
    from modelzoo.models.llama import LlamaFamilyConfig

@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in its tensor-parallel group and the collectives the split model runs.

    group: the torch.distributed process group of the N ranks; None when size is 1, or in tests
    that only load one rank's weights and never run them.
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduces x over the group in place (every rank ends with the same bits) and returns it."""
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x of every rank, in rank order (all the same shape)."""
        import torch.distributed as dist

        pieces = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(pieces, x.contiguous(), group=self.group)
        return pieces

    def first_ranks_choice(self, chosen: list[int], among: list[int]) -> list[int]:
        """Rank 0's `chosen` (a subset of `among`), on every rank: one decision for the whole group."""
        import torch.distributed as dist

        picked = set(chosen)
        mask = torch.tensor([item in picked for item in among], dtype=torch.int64, device=self.device)
        dist.broadcast(mask, group=self.group, group_src=0)
        return [item for item, keep in zip(among, mask.tolist()) if keep]


def split_architectures() -> list[str]:
    """The `architectures` strings whose family declares it can be split (`splits_over_ranks`)."""
    return sorted(name for name in REGISTRY if getattr(registered_class(name), "splits_over_ranks", False))


def check_split(config: LlamaFamilyConfig, size: int) -> None:
    """Heads, kv heads and MLP columns must divide by the number of ranks (one-line error otherwise)."""
    counts = {"num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
              "intermediate_size": config.intermediate_size}
    bad = [f"{key}={value}" for key, value in counts.items() if value % size]
    if bad:
        have = ", ".join(f"{key}={value}" for key, value in counts.items())
        raise UserError(f"runconfig.tensor_parallel {size} must divide the model's num_attention_heads, "
                        f"num_key_value_heads and intermediate_size; it has {have} ({', '.join(bad)}: not divisible "
                        f"by {size})")
    if config.vocab_size < size:
        raise UserError(f"runconfig.tensor_parallel {size} is more than the vocabulary size {config.vocab_size}")


def check_tensor_parallel(checkpoint_path: str | None, size: int) -> None:
    """Whether the checkpoint's model can be split over `size` ranks: the family, then the head
    counts. Needs only config.json, so a bad setup fails before any process group is opened."""
    if size == 1 or not checkpoint_path:
        return  # nothing to split; a missing checkpoint is reported by the job
    hf_config = load_hf_config(checkpoint_path)
    cls = model_class(hf_config)
    _check_family(cls, hf_config)
    check_split(cls.config_from_hf(hf_config), size)


def _check_family(cls: type, hf_config: Any) -> None:
    if not getattr(cls, "splits_over_ranks", False):
        got = ", ".join(getattr(hf_config, "architectures", None) or []) or cls.__name__
        raise UserError(f"runconfig.tensor_parallel supports {', '.join(split_architectures())}; got {got}")


def shard_plan(checkpoint: str | Path, tp: TensorParallelGroup | None) -> LlamaTensorParallel | None:
    """This rank's split of the checkpoint's model over the group, for `load_model`; None without a
    group of two or more. A one-line error for families it cannot split."""
    if tp is None or tp.size == 1:
        return None
    hf_config = load_hf_config(checkpoint)
    cls = model_class(hf_config)
    _check_family(cls, hf_config)
    return LlamaTensorParallel(cls.config_from_hf(hf_config), tp)


class VocabParallelEmbedding(nn.Module):
    """The embedding rows [start, start + rows) of the vocabulary; other ids look up zeros, and the
    all-reduce over the group fills them in from the rank that holds them."""

    def __init__(self, start: int, rows: int, hidden: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.start, self.tp = start, tp
        self.weight = nn.Parameter(torch.empty(rows, hidden))  # (rows, hidden): HF's embed_tokens.weight rows

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start  # (B, T)
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(mine, local, 0), self.weight)  # (B, T, hidden)
        return self.tp.all_reduce(x.masked_fill(~mine[..., None], 0.0))


class LlamaTensorParallel:
    """How LlamaForCausalLM splits over a group: the rank's config, the part of each Hugging Face
    weight it reads, and the module swaps and collectives (see the module docstring)."""

    def __init__(self, config: LlamaFamilyConfig, tp: TensorParallelGroup) -> None:
        check_split(config, tp.size)
        self.tp, self.full = tp, config
        n = tp.size
        # Built at this size, the family's own modules have the rank's shapes, and its KV cache
        # (sized from config.num_kv_heads) holds the rank's kv heads only.
        self.config = replace(config, num_heads=config.num_heads // n, num_kv_heads=config.num_kv_heads // n,
                              intermediate_size=config.intermediate_size // n)
        self.vocab_bounds = [r * config.vocab_size // n for r in range(n + 1)]  # rank r: [b[r], b[r+1])

    def _block(self, width: int) -> slice:
        """This rank's share of `width` (which divides by N)."""
        share = width // self.tp.size
        return slice(self.tp.rank * share, (self.tp.rank + 1) * share)

    def index(self, name: str) -> Any:
        """The part of Hugging Face weight `name` this rank holds: a tuple of slices (rows; or all rows
        and some columns), None for all of it, or SKIP for none of it."""
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) > 1 else ("", name)
        c, rank = self.full, self.tp.rank
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if module == "q_proj":
            return (self._block(q_width),)
        if module in ("k_proj", "v_proj"):
            return (self._block(kv_width),)
        if module in ("gate_proj", "up_proj"):
            return (self._block(c.intermediate_size),)
        if module in ("o_proj", "down_proj"):
            if kind == "bias":
                return None if rank == 0 else SKIP  # row-parallel bias: added once, by rank 0
            return (slice(None), self._block(q_width if module == "o_proj" else c.intermediate_size))
        if module in ("embed_tokens", "lm_head"):
            return (slice(self.vocab_bounds[rank], self.vocab_bounds[rank + 1]),)
        return None  # norms: replicated

    def prepare(self, model: nn.Module) -> None:
        """On the meta-device model, before its weights load: drops the row-parallel biases of ranks
        other than 0, swaps in the vocabulary-split embedding and LM head, and adds the collectives
        (forward hooks: they survive the CPU decode path swapping nn.Linear for PackedLinear)."""
        tp, hidden = self.tp, self.full.hidden_size
        for layer in model.model.layers:
            if tp.rank > 0:
                layer.self_attn.o_proj.bias = None
                layer.mlp.down_proj.bias = None
            layer.self_attn.register_forward_hook(self._reduce)  # after o_proj: (B, T, hidden) partial sums
            layer.mlp.register_forward_hook(self._reduce)  # after down_proj
        start, end = self.vocab_bounds[tp.rank], self.vocab_bounds[tp.rank + 1]
        model.model.embed_tokens = VocabParallelEmbedding(start, end - start, hidden, tp)
        model.lm_head = nn.Linear(hidden, end - start, bias=False)
        model.register_forward_hook(self._gather_logits)

    def _reduce(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(output)

    def _gather_logits(self, module: nn.Module, args: Any, logits: torch.Tensor) -> torch.Tensor:
        """(B, rows of this rank) -> (B, vocab): every rank's rows, in order."""
        sizes = [b - a for a, b in zip(self.vocab_bounds, self.vocab_bounds[1:])]
        pieces = self.tp.all_gather(F.pad(logits, (0, max(sizes) - logits.shape[-1])))  # equal shapes for the gather
        return torch.cat([piece[..., :size] for piece, size in zip(pieces, sizes)], dim=-1)
