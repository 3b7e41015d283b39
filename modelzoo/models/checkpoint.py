"""Hugging Face checkpoint folder -> config + our model with its weights, loaded by name.

Accepted: model.safetensors, sharded safetensors with model.safetensors.index.json,
pytorch_model.bin (and its sharded index), read with `weights_only=True`. Every missing or
unexpected weight is named in the error.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from modelzoo.errors import UserError
from modelzoo.cpu.memory import map_private, release_freed_memory, release_mapped
from modelzoo.models import model_class
from modelzoo.cpu.precision import JoinedLinear
from modelzoo.cpu.quantization import quantize_modules, quantize_rows, scale_name

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Buffers some older checkpoints saved that we recompute ourselves.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias", ".attention.bias",
                    ".attention.masked_bias")


def load_hf_config(path: str | Path) -> Any:
    """The transformers config of a checkpoint folder; never contacts a model hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"checkpoint folder {folder} does not exist")
    if not (folder / "config.json").is_file():
        raise UserError(f"checkpoint folder {folder} has no config.json")
    try:
        raw = json.loads((folder / "config.json").read_text())
    except ValueError as exc:
        raise UserError(f"{folder / 'config.json'} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise UserError(f"{folder / 'config.json'} must hold a JSON object")
    if raw.get("model_type") not in CONFIG_MAPPING:
        # Families whose config class lives only in remote code (BTLM): read the fields as they are,
        # never executing the checkpoint's code.
        return PretrainedConfig(**raw)
    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as exc:  # transformers raises ValueError / OSError / KeyError for bad configs
        raise UserError(f"cannot read {folder / 'config.json'}: {exc}".splitlines()[0]) from exc


def resolve_dtype(name: str, hf_config: Any) -> torch.dtype:
    """`auto` -> the dtype the checkpoint declares (float32 when it declares none)."""
    if name != "auto":
        return DTYPES[name]
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(declared, torch.dtype):
        return declared
    return DTYPES.get(str(declared).replace("torch.", ""), torch.float32)


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a checkpoint folder, safetensors preferred."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError) as exc:
                raise UserError(f"{index} is not a valid weight index: {exc}") from exc
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise UserError(f"{index} lists shards that are missing: {', '.join(missing)}")
            return [folder / s for s in shards]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).is_file():
            return [folder / single]
    raise UserError(f"checkpoint folder {folder} has no model.safetensors, pytorch_model.bin or shard index")


# safetensors dtype names -> torch dtypes
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def read_safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a .safetensors file, in file order, each a view of a private memory map of the file.

    Nothing is read twice: a weight the loader converts, fuses or re-lays out is read once, from the page cache, by
    that conversion, which then drops the source's pages from this process (release_mapped), so the file is never
    resident beside the converted copies of its weights. A weight kept as it is stays a view of the map
    (copy-on-write: writing to it never touches the file). The format: an 8-byte little-endian header size, a JSON
    header {name: {dtype, shape, data_offsets [begin, end) counted from the end of the header}}, then the data.
    """
    with open(file, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
        length = os.fstat(handle.fileno()).st_size
        mapping = map_private(handle)
    header.pop("__metadata__", None)
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):  # file order
        begin, end = (8 + size + offset for offset in info["data_offsets"])
        if end > length:
            raise ValueError(f"the file ends inside {name}")
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        count = (end - begin) // dtype.itemsize
        tensor = torch.frombuffer(mapping, dtype=dtype, count=count, offset=begin) if count else torch.empty(0, dtype=dtype)
        yield name, tensor.reshape(info["shape"])


# What `select` may answer for a weight that this process does not hold at all (tensor parallel).
SKIP = "skip"
Select = Callable[[str], Any]  # weight name -> None (all of it), a tuple of slices (that part), or SKIP


def iter_tensors(files: list[Path], select: Select | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight in the files, one shard file at a time.

    `select(name)` narrows what is read: a tensor-parallel rank takes only its rows or columns
    (safetensors reads just those bytes; a .bin file is loaded whole and sliced), or skips a weight.
    Without it, safetensors tensors view a memory map of the file (read_safetensors).
    """
    for file in files:
        try:
            if file.suffix == ".safetensors" and select is None:
                yield from read_safetensors(file)
            elif file.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(file), framework="pt") as shard:
                    for name in shard.keys():
                        index = select(name)
                        if index is None:
                            yield name, shard.get_tensor(name)
                        elif index != SKIP:
                            yield name, shard.get_slice(name)[index]
            else:
                for name, tensor in torch.load(file, map_location="cpu", weights_only=True).items():
                    index = select(name) if select else None
                    if index is None:
                        yield name, tensor
                    elif index != SKIP:
                        yield name, tensor[index].clone()  # a copy: the whole tensor can be freed
        except UserError:
            raise
        except Exception as exc:  # corrupt or truncated file: name it
            raise UserError(f"cannot read weights from {file}: {exc}".splitlines()[0]) from exc


def _listed(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


class ShardPlan(Protocol):
    """One tensor-parallel rank's share of a model (modelzoo.models.tensor_parallel.shard_plan makes one)."""

    config: Any  # the family config at one rank's size

    def prepare(self, model: nn.Module) -> None:
        """Swaps in the rank's parallel modules (on the meta device)."""

    def index(self, name: str) -> Any:
        """The part of Hugging Face weight `name` this rank reads (SKIP for none)."""


def weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every weight's shape in a checkpoint folder, without reading the weights (safetensors headers; a .bin file
    memory-mapped)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(folder):
        try:
            if file.suffix == ".safetensors":
                with open(file, "rb") as handle:
                    header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
                shapes.update((name, tuple(info["shape"])) for name, info in header.items() if name != "__metadata__")
            else:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                shapes.update((name, tuple(tensor.shape)) for name, tensor in state.items())
        except Exception as exc:  # corrupt or truncated file: name it
            raise UserError(f"cannot read weights from {file}: {exc}".splitlines()[0]) from exc
    return shapes


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device, plan: ShardPlan | None = None,
               weight_dtype: str | None = None, int8_group_size: int = 0,
               update: Callable[[str], torch.Tensor | None] | None = None,
               keep_parts: bool = False) -> tuple[nn.Module, Any]:
    """Builds our implementation of the checkpoint's family and fills it with the checkpoint's weights.

    Weights load by Hugging Face name. A family may fuse several HF weights into one of its own
    (`fused_weights()`: ours -> the HF names concatenated along dim 0); errors still name HF weights.
    With a shard `plan` (tensor parallel) the model is built at one rank's size and each weight is
    read only in the part this rank holds (modelzoo/models/tensor_parallel.py), fused weights included.
    weight_dtype "int8": the linear layers and the token embedding are swapped for int8 ones before
    loading (modelzoo/cpu/quantization.py) and each of their weights is quantized as soon as it (or its
    fused concatenation) is complete, so at most one of them is ever held in full precision.
    update: HF weight name -> a tensor of its full shape to add to it as it is read (a merged LoRA adapter's
    scaling * B A), or None; added in float32 before any cast, slicing or quantization.
    keep_parts: a fused linear layer's weight is not concatenated: the layer becomes a JoinedLinear holding its parts
    as read (views of the checkpoint's memory map where no cast was needed), for a layout that packs or reads them
    where they lie (modelzoo/cpu/precision.py's apply_half_gemm or apply_bf16_gemm, which must follow); not with int8
    or a shard plan.
    """
    if weight_dtype not in (None, "int8"):
        raise ValueError(f"weight_dtype must be None or 'int8', got {weight_dtype!r}")
    if weight_dtype and plan is not None:
        raise UserError("model.weight_dtype int8 cannot be combined with runconfig.tensor_parallel > 1 yet")
    folder = Path(path)
    hf_config = load_hf_config(folder)
    cls = model_class(hf_config)
    config = plan.config if plan is not None else cls.config_from_hf(hf_config)
    with torch.device("meta"):
        model = cls(config)  # no memory, no random init: every weight comes from the checkpoint
        if plan is not None:
            plan.prepare(model)
    expected = dict(model.state_dict())  # names and full-precision shapes, as the checkpoint stores them
    # int8 weight name -> stored transposed (Conv1D); the model now expects int8 weights and their scales
    quantized = quantize_modules(model, dtype, int8_group_size) if weight_dtype == "int8" else {}
    fused = {k: v for k, v in getattr(model, "fused_weights", dict)().items() if k in expected}
    part_of = {source: (target, i) for target, sources in fused.items() for i, source in enumerate(sources)}
    # Checkpoints saved from a base model (GPT-2's `h.0...`, OPT's `decoder...`) lack the prefix
    # the LM-head class puts in front (`transformer.`, `model.`); accept them as transformers does.
    known = set(expected) | set(part_of)
    prefixes = sorted({key.split(".", 1)[0] + "." for key in known if "." in key})
    loaded: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[int, torch.Tensor]] = {}  # fused weights still waiting for some parts
    joined: dict[str, list[torch.Tensor]] = {}  # keep_parts: fused weights as their parts, in order
    unexpected: list[str] = []

    def canonical(name: str) -> str:
        return name if name in known else next((p + name for p in prefixes if p + name in known), name)

    def place(name: str, tensor: torch.Tensor, what: str) -> None:
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise UserError(f"weight {what} has shape {tuple(tensor.shape)} in the checkpoint but the config "
                            f"implies {tuple(expected[name].shape)}")
        if name in quantized:  # quantized from the checkpoint's precision; the full tensor is dropped here
            loaded[name], loaded[scale_name(name)] = quantize_rows(tensor.T if quantized[name] else tensor,
                                                                   int8_group_size)
            release_mapped(tensor)
            release_freed_memory()
        else:
            loaded[name] = tensor

    select = (lambda name: plan.index(canonical(name))) if plan is not None else None
    for name, tensor in iter_tensors(weight_files(folder), select):
        name = canonical(name)
        delta = update(name) if update is not None else None
        source = tensor  # as read: a view of the file's memory map, whose pages go once it is copied
        if delta is not None:
            index = plan.index(name) if plan is not None else None  # this rank's part of the weight, as read
            tensor = (tensor.float() + (delta if index is None else delta[index])).to(tensor.dtype)
        # Cast tensor by tensor, so peak memory stays low; a weight to quantize keeps its precision until then.
        to_quantize = part_of.get(name, (name,))[0] in quantized
        tensor = tensor.to(device=device, dtype=None if to_quantize else dtype)
        if tensor is not source:
            release_mapped(source)
        del source
        if name in part_of:
            target, index = part_of[name]
            pieces.setdefault(target, {})[index] = tensor
            if len(pieces[target]) == len(fused[target]):
                parts = pieces.pop(target)
                if keep_parts and plan is None and not quantized and tensor.dim() == 2:
                    joined[target] = [parts[i] for i in range(len(parts))]
                    for i, part in enumerate(joined[target]):
                        if tuple(part.shape[1:]) != tuple(expected[target].shape[1:]):
                            raise UserError(f"weight {fused[target][i]} has shape {tuple(part.shape)} in the "
                                            f"checkpoint but the config implies {tuple(expected[target].shape[1:])} "
                                            "columns")
                    del parts, tensor
                    continue
                whole = torch.cat([parts[i] for i in range(len(parts))])
                for i in parts:
                    release_mapped(parts[i])
                del parts, tensor  # no full-precision part outlives the cat
                place(target, whole, " + ".join(fused[target]))
                del whole
        elif name in expected:
            place(name, tensor, name)
        elif not name.endswith(IGNORED_SUFFIXES):
            unexpected.append(name)
    tied = model.tied_weights()
    for name, source in tied.items():
        if name not in loaded and source in loaded:
            loaded[name] = loaded[source]
            if name in quantized:  # one int8 tensor and one scale vector for both
                loaded[scale_name(name)] = loaded[scale_name(source)]
    missing = []
    for name in sorted(set(expected) - set(loaded) - set(joined)):
        got = pieces.get(name, {})
        missing += [s for i, s in enumerate(fused[name]) if i not in got] if name in fused else [name]
    if missing or unexpected:
        problems = ([f"missing weights: {_listed(missing)}"] if missing else []) + (
            [f"unexpected weights: {_listed(unexpected)}"] if unexpected else [])
        raise UserError(f"checkpoint {folder} does not match its config ({type(model).__name__}): " + "; ".join(problems))
    for target, parts in joined.items():  # fused layers whose parts stay apart: JoinedLinear
        rows = sum(part.shape[0] for part in parts)
        if rows != expected[target].shape[0]:
            raise UserError(f"weights {' + '.join(fused[target])} have {rows} rows in the checkpoint but the config "
                            f"implies {expected[target].shape[0]}")
        owner, attribute = target.removesuffix(".weight").rsplit(".", 1)
        bias = loaded.get(f"{owner}.{attribute}.bias")  # loaded as ever: load_state_dict assigns it again
        setattr(model.get_submodule(owner), attribute, JoinedLinear(parts, bias))
    model.load_state_dict(loaded, assign=True)
    for name, source in tied.items():  # keep the tie after assign (one tensor, not two copies)
        if name in loaded and loaded[name] is loaded[source]:
            model.get_submodule(name.rsplit(".", 1)[0]).weight = model.get_submodule(source.rsplit(".", 1)[0]).weight
    model.build_buffers(device)
    return model.eval().requires_grad_(False), hf_config
