"""LoRA adapters in PEFT's format: read and checked against the base checkpoint, merged into its weights for a job
with one adapter, or held side by side for rows that each name their own.

An adapter folder holds `adapter_config.json` (peft_type LORA, r, lora_alpha, use_rslora, target_modules,
rank_pattern / alpha_pattern) and `adapter_model.safetensors` (or `adapter_model.bin`) with, for each adapted
projection `M` of the base model, `base_model.model.M.lora_A.weight` (r, in) and `...lora_B.weight` (out, r).
The update of M is scaling * B A: scaling = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA.

Our families fuse some projections (q | k | v into `qkv_proj`, gate | up into `gate_up_proj`): an adapted piece
adds to its rows of the fused weight (merged), or its B sits in those rows of a stacked update (per row).
Per row (`AdapterBank`): the base GEMM once for every token, then each token's own adapter's update, every adapter's
A and B of the projection stacked side by side: on the CPU one C++ call per projection (kernels/lora_update.cpp) takes
each token's adapter's rows only, in tiles of tokens sharing an adapter; elsewhere x times all the A's at once, the
columns of the adapters a token does not use zeroed, times the B's. Fixed shapes and no host sync either way.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modelzoo.errors import UserError
from modelzoo.models.layers import fused_kernels

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[^.]+)?\.weight$")
# Config switches of LoRA variants whose weights we would read wrongly.
UNSUPPORTED_SWITCHES = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "use_qalora": "QA-LoRA"}


@dataclass(frozen=True)
class Projection:
    """Where a base projection (by its Hugging Face module name) sits in our model: `module`, our module holding it;
    `rows`, its output rows there (a piece of a fused weight) of `width`; `in_features`; `in_out`, whether our
    weight is stored (in, out) (GPT-2's Conv1D)."""

    module: str
    rows: tuple[int, int]
    width: int
    in_features: int
    in_out: bool

    @property
    def out_features(self) -> int:
        return self.rows[1] - self.rows[0]


@dataclass
class LoraAdapter:
    """One adapter: per adapted base projection (HF module name), A (r, in) and B (out, r) in float32 and its
    scaling."""

    name: str
    folder: Path
    base_model: str
    updates: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)

    def delta(self, projection: str, in_out: bool) -> torch.Tensor:
        """scaling * B A of a projection in the shape of its HF weight: (out, in), or (in, out) for a Conv1D."""
        a, b, scaling = self.updates[projection]
        delta = (b @ a) * scaling
        return delta.T if in_out else delta


def _fail(name: str, folder: Path, why: str) -> UserError:
    return UserError(f"adapter {name!r} ({folder}): {why}")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the end of the module's dotted name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def read_adapter(name: str, folder: str | Path) -> LoraAdapter:
    """Reads an adapter folder, checking its format; every problem is one UserError line."""
    folder = Path(folder)
    if not folder.is_dir():
        raise _fail(name, folder, "the folder does not exist")
    if not (folder / CONFIG_FILE).is_file():
        raise _fail(name, folder, f"no {CONFIG_FILE} (a PEFT adapter folder has one)")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except ValueError as exc:
        raise _fail(name, folder, f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise _fail(name, folder, f"{CONFIG_FILE} must hold a JSON object")
    kind = str(config.get("peft_type", "")).upper()
    if kind != "LORA":
        raise _fail(name, folder, f"peft_type {config.get('peft_type')!r} is not read: only LoRA adapters are")
    for switch, what in UNSUPPORTED_SWITCHES.items():
        if config.get(switch):
            raise _fail(name, folder, f"{what} ({switch}: true) is not read: only plain LoRA and rsLoRA are")
    if config.get("modules_to_save"):
        raise _fail(name, folder, f"modules_to_save {config['modules_to_save']} (whole trained modules) are not read")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise _fail(name, folder, f"r must be an integer >= 1 and lora_alpha a number, got r {rank!r}, "
                    f"lora_alpha {alpha!r}")
    weights = _read_weights(name, folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = KEY.match(key)
        if match is None:
            raise _fail(name, folder, f"weight {key} is not a LoRA A or B matrix (embedding LoRA, DoRA magnitudes and "
                        "other kinds are not read)")
        pairs.setdefault(match["module"], {})[match["side"]] = tensor.float()
    if not pairs:
        raise _fail(name, folder, "the weights hold no LoRA matrix")
    adapter = LoraAdapter(name, folder, str(config.get("base_model_name_or_path") or ""))
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise _fail(name, folder, f"{module} has lora_{'A' if 'A' in pair else 'B'} but no "
                        f"lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"], pair["B"]
        r = _pattern_value(config.get("rank_pattern") or {}, module, rank)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise _fail(name, folder, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not have "
                        f"rank r = {r} (lora_A (r, in), lora_B (out, r))")
        a_alpha = _pattern_value(config.get("alpha_pattern") or {}, module, alpha)
        scaling = a_alpha / math.sqrt(r) if config.get("use_rslora") else a_alpha / r
        adapter.updates[module] = (a, b, float(scaling))
    _check_targets(adapter, config.get("target_modules"))
    return adapter


def _read_weights(name: str, folder: Path) -> dict[str, torch.Tensor]:
    for file_name in WEIGHT_FILES:
        path = folder / file_name
        if path.is_file():
            try:
                if path.suffix == ".safetensors":
                    from safetensors.torch import load_file

                    return load_file(str(path))
                return torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # a corrupt or truncated file: name it
                raise _fail(name, folder, f"cannot read {file_name}: {exc}".splitlines()[0]) from None
    raise _fail(name, folder, f"no {' or '.join(WEIGHT_FILES)}")


def _check_targets(adapter: LoraAdapter, targets: Any) -> None:
    """Every module the config names (a list of names) has weights: a target with none was never trained here."""
    if not isinstance(targets, list):
        return  # a regular expression or "all-linear": the weights say which modules
    missing = [t for t in targets if not any(m == t or m.endswith(f".{t}") for m in adapter.updates)]
    if missing:
        raise _fail(adapter.name, adapter.folder, f"target_modules {missing} have no LoRA weights in the file")


def base_projections(model: nn.Module, weight_shapes: dict[str, tuple[int, ...]]) -> dict[str, Projection]:
    """Every projection of a (meta) model a LoRA may adapt, by Hugging Face module name: our linear layers, fused
    ones split into their HF pieces (rows from the checkpoint's `weight_shapes`, HF weight name -> shape)."""
    modules = dict(model.named_modules())
    fused = getattr(model, "fused_weights", dict)()
    projections: dict[str, Projection] = {}
    for name, module in modules.items():
        in_out = bool(getattr(module, "weight_is_in_out", False))
        if not (isinstance(module, nn.Linear) or in_out):
            continue
        in_features, width = module.weight.shape[::-1] if not in_out else module.weight.shape
        pieces = fused.get(f"{name}.weight")
        if pieces is None:
            projections[name] = Projection(name, (0, width), width, in_features, in_out)
            continue
        begin = 0
        for piece in pieces:
            stored = weight_shapes.get(piece) or weight_shapes.get(piece.split(".", 1)[-1])  # saved without `model.`
            if stored is None:
                raise UserError(f"the checkpoint has no weight {piece}")
            rows = stored[0]
            projections[piece.removesuffix(".weight")] = Projection(name, (begin, begin + rows), width, in_features,
                                                                    False)
            begin += rows
    head = getattr(model, "head_name", None)
    projections.pop(head, None)  # the LM head (tied to the embedding in many models) is not adapted
    return projections


def check_adapter(adapter: LoraAdapter, projections: dict[str, Projection], family: str) -> None:
    """The adapter fits the base: each adapted module is a projection of the family, with its shapes."""
    for module, (a, b, _) in adapter.updates.items():
        where = projections.get(module)
        if where is None:
            raise _fail(adapter.name, adapter.folder, f"adapts {module}, which {family} does not have (or whose LoRA "
                        "is not read: embeddings, the LM head)")
        if a.shape[1] != where.in_features or b.shape[0] != where.out_features:
            made_for = f" (made for {adapter.base_model}?)" if adapter.base_model else ""
            raise _fail(adapter.name, adapter.folder, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                        f"do not fit the base's ({where.out_features}, {where.in_features}) weight{made_for}")


class AdapterBank:
    """The adapters' names, and the adapter of each token of the forward running now, read by every LoraLinear of
    the model. Which adapter a row uses is its KV-cache slot's (KVCache.slot_adapter, -1: the bare base), so the
    engine's cache and a scorer's each say it for their own slots."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.current: torch.Tensor | None = None  # (B, 1) or (1, T) long: each row's (or packed token's) adapter
        self.read: torch.Tensor | None = None  # (B, 1) or (1, N): the same at the positions the last layer reads

    def select(self, slot_adapter: torch.Tensor, slots: torch.Tensor | None, shape: torch.Size,
               read: torch.Tensor | None = None) -> None:
        """Before a forward of tokens `shape` (B, T) over a cache whose slots run `slot_adapter` (S,): slots (B,)
        cache rows, None for every slot in order, or (1, T) packed tokens' slots; read: (B, N) positions into T
        where the last layer alone computes (CausalLM.positions_read), or None. No host sync."""
        if slots is None:
            self.current = slot_adapter[: shape[0], None]
        elif slots.dim() == 2:
            self.current = slot_adapter[slots]
        else:
            self.current = slot_adapter[slots][:, None]
        packed = self.current.shape[1] > 1
        self.read = self.current.gather(1, read) if packed and read is not None else self.current

    def adapters(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter of each token of x (B, T', in) or of each row of x (B, in): (B, T') or (B,) long. A packed
        forward's last layer runs some projections at every position and the rest at the read ones alone."""
        if x.dim() == 2:
            return self.current[:, 0]
        tokens = self.current if self.current.shape[1] in (1, x.shape[1]) else self.read
        return tokens.expand(x.shape[:-1])


class LoraLinear(nn.Module):
    """base(x) + the LoRA update of the adapter each token uses, every adapter's update of the projection stacked:
    A (C, K padded to 16) and B^T (C, N) times its scaling, in float32 on the CPU (the base's dtype elsewhere), and
    `segments` (S, 5): for each adapter and piece of a fused projection (q | k | v), its adapter, columns of C and
    output rows of N. On the CPU one C++ call adds each token's own adapter's update (lora_update.cpp); elsewhere
    (x A^T * mask) B^T, the columns of the adapters a token does not use zeroed: fixed shapes, no host sync."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b_t: torch.Tensor, segments: torch.Tensor,
                 in_features: int, bank: AdapterBank) -> None:
        super().__init__()
        self.base, self.bank = base, bank
        self.a, self.b_t, self.segments = a, b_t, segments  # (C, Kp), (C, N), (S, 5) long
        self.in_features = in_features
        owner = torch.empty(a.shape[0], dtype=torch.long)
        for adapter, first, end, _, _ in segments.tolist():
            owner[first:end] = adapter
        self.owner = owner.to(a.device)  # (C,) each column's adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapter = self.bank.adapters(x)  # x.shape[:-1]
        out = self.base(x)  # (..., N)
        kernels = fused_kernels(x)
        if kernels is not None and out.dtype == x.dtype and out.is_contiguous():
            kernels.lora_update_(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]).contiguous(),
                                 adapter.reshape(-1).contiguous(), self.a, self.b_t, self.segments)
            return out
        mask = (adapter[..., None] == self.owner).to(self.a.dtype)  # (..., C)
        update = F.linear(F.linear(x.to(self.a.dtype), self.a[:, : self.in_features]) * mask, self.b_t.T)
        return out + update.to(out.dtype)


def rank_share(a: torch.Tensor, b: torch.Tensor, where: Projection, part: Any,
               ranks: int) -> tuple[torch.Tensor, torch.Tensor, Projection]:
    """A tensor-parallel rank's share of an update A (r, in), B (out, r), split like its base weight: `part` is the
    part of the Hugging Face weight the rank holds (LlamaTensorParallel.index): None, all of it; (rows,), a column-
    parallel projection's output rows (B's rows, and 1/ranks of every piece of a fused weight); (all, columns), a
    row-parallel one's inputs (A's columns: the rank's update is a partial sum, completed by the layer's all-reduce
    like the base's product)."""
    if part is None:
        return a, b, where
    if len(part) == 1:
        rows = (where.rows[0] // ranks, where.rows[1] // ranks)
        return a, b[part[0]], replace(where, rows=rows, width=where.width // ranks)
    return a[:, part[1]], b, replace(where, in_features=where.in_features // ranks)


def attach_adapters(model: nn.Module, adapters: list[LoraAdapter], projections: dict[str, Projection],
                    dtype: torch.dtype, device: torch.device, shard: Any = None) -> AdapterBank:
    """Wraps every adapted module of `model` in a LoraLinear holding all `adapters`' updates of it (adapter i of the
    bank is adapters[i]); returns the bank. Under tensor parallel, `shard` (modelzoo.models.tensor_parallel.
    LlamaTensorParallel) says which share of each update this rank holds."""
    bank = AdapterBank([adapter.name for adapter in adapters])
    update_dtype = torch.float32 if device.type == "cpu" else dtype  # the C++ kernel's, on the CPU
    columns: dict[str, list[tuple[int, Projection, torch.Tensor, torch.Tensor, float]]] = {}
    for index, adapter in enumerate(adapters):
        for projection, (a, b, scaling) in adapter.updates.items():
            where = projections[projection]
            if shard is not None:
                a, b, where = rank_share(a, b, where, shard.index(f"{projection}.weight"), shard.tp.size)
            columns.setdefault(where.module, []).append((index, where, a, b, scaling))
    for module_name, parts in columns.items():
        parent_name, _, attribute = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        in_features, width = parts[0][1].in_features, parts[0][1].width
        rank_total = sum(a.shape[0] for _, _, a, _, _ in parts)
        stacked_a = torch.zeros(rank_total, -(-in_features // 16) * 16)  # (C, Kp)
        stacked_b_t = torch.zeros(rank_total, width)  # (C, N)
        segments = []
        column = 0
        for index, where, a, b, scale in sorted(parts, key=lambda part: part[0]):
            rank = a.shape[0]
            stacked_a[column: column + rank, :in_features] = a
            stacked_b_t[column: column + rank, where.rows[0]: where.rows[1]] = b.T * scale
            segments.append((index, column, column + rank, *where.rows))
            column += rank
        setattr(parent, attribute, LoraLinear(getattr(parent, attribute), stacked_a.to(device, update_dtype),
                                              stacked_b_t.to(device, update_dtype),
                                              torch.tensor(segments, dtype=torch.long), in_features, bank))
    model.adapter_bank = bank
    return bank


@dataclass
class AdapterPlan:
    """How a job runs its adapters: `merged`, the one adapter every row uses, merged into the weights at load time;
    or `bank`, the adapters rows name, held apart (row adapter index i: bank[i]; -1 the bare base). `names` maps a
    row's adapter field to that index; `projections` are the base's (base_projections)."""

    merged: LoraAdapter | None
    bank: list[LoraAdapter]
    names: dict[str, int]
    projections: dict[str, Projection]

    def index(self, field_value: str) -> int:
        """A row's adapter index from its adapter field (checked by plan_adapters)."""
        return self.names[field_value]

    def resolved(self, field_value: str) -> str:
        """The adapter a row runs with, by name ("" for the bare base)."""
        if self.merged is not None:
            return self.merged.name
        index = self.names[field_value]
        return self.bank[index].name if index >= 0 else ""

    def merge_update(self) -> Any:
        """The load-time update of the merged adapter (checkpoint.load_model's `update`), or None."""
        if self.merged is None:
            return None
        adapter, projections = self.merged, self.projections
        targets = {f"{module}.weight": module for module in adapter.updates}
        return lambda name: (adapter.delta(targets[name], projections[targets[name]].in_out)
                             if name in targets else None)


def base_names(checkpoint: str | Path) -> set[str]:
    """What a row's adapter field may say to mean the bare base model: nothing, the checkpoint as given, or its
    folder's name."""
    return {"", str(checkpoint), Path(checkpoint).name}


def plan_adapters(adapters: dict[str, str], default: str | None, row_fields: list[str] | None,
                  checkpoint: str | Path) -> AdapterPlan | None:
    """Reads and checks every adapter of the params against the checkpoint, and the rows' adapter fields
    (`row_fields`: each distinct value, or None when the data has none) against the params; one UserError line per
    problem. None when the job runs the bare base."""
    if not adapters:
        named = sorted(set(row_fields or []) - base_names(checkpoint))
        if named:
            raise UserError(f"rows name adapters {named[:8]} but the params list none (model.adapters)")
        return None
    from modelzoo.models.checkpoint import load_hf_config, weight_shapes
    from modelzoo.models import model_class

    hf_config = load_hf_config(checkpoint)
    cls = model_class(hf_config)
    with torch.device("meta"):
        meta = cls(cls.config_from_hf(hf_config))
    projections = base_projections(meta, weight_shapes(Path(checkpoint)))
    read = {name: read_adapter(name, folder) for name, folder in adapters.items()}
    for adapter in read.values():
        check_adapter(adapter, projections, cls.__name__)
    bare = base_names(checkpoint)
    fields = row_fields if row_fields is not None else [""]
    unknown = sorted(f for f in fields if f not in read and f not in bare)
    if unknown:
        raise UserError(f"rows name adapters the params do not list: {unknown[:8]} (model.adapters: "
                        f"{', '.join(read)})")
    chosen = {f: (f if f in read else default if f == "" else None) for f in fields}  # field -> adapter name
    used = [name for name in read if name in chosen.values()]
    if not used:
        return None
    if len(used) == 1 and None not in chosen.values():  # every row the same adapter: merged, the base's speed
        return AdapterPlan(read[used[0]], [], {f: -1 for f in fields}, projections)
    names = {f: (used.index(name) if name is not None else -1) for f, name in chosen.items()}
    return AdapterPlan(None, [read[name] for name in used], names, projections)
