"""The KV cache's and the packed weights' memory: advised to transparent huge pages before its first touch (Linux)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from modelzoo.cpu.memory import HUGE_PAGE_BYTES
from modelzoo.models.kv_cache import KVCache

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
transparent_huge_pages = pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                                            reason="this kernel has no transparent huge pages")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(bound, 16) for bound in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@linux
@transparent_huge_pages
def test_the_caches_whole_huge_pages_are_advised_and_zeroed():
    cache = KVCache(2, 8, 4, 1024, 64, torch.bfloat16, torch.device("cpu"))  # 4 MiB a tensor
    for tensor in (*cache.keys, *cache.values):
        assert not tensor.any()
        first_whole_page = -(-tensor.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        assert "hg" in vm_flags(first_whole_page)  # MADV_HUGEPAGE's mark on the mapping


@linux
def test_a_cache_smaller_than_a_huge_page_is_zeroed_and_writable():
    cache = KVCache(1, 2, 1, 16, 8, torch.float32, torch.device("cpu"))
    assert not cache.keys[0].any() and cache.keys[0].shape == (2, 1, 24, 8)  # 16 positions, 8 never read
    cache.keys[0][1, 0, 3] = 1.0
    assert cache.keys[0].sum() == 8 and not cache.values[0].any()


def status_kib(field: str) -> int:
    """A KiB figure of /proc/self/status (VmRSS, VmHWM: the peak since the last reset)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} line in /proc/self/status")


@linux
@transparent_huge_pages
@pytest.mark.parametrize("layout", ["half_linear", "bf16_linear", "packed"])
def test_packed_weights_are_laid_out_side_by_side_on_huge_pages(layout):
    """Each C++ GEMM layout's weights (half_linear's and bf16_linear's layers, the float32 candidate `packed`) are
    written as they are packed into one mapping advised to huge pages, side by side at 64-byte boundaries, each with
    the values its layout gives in new memory; the layers multiply as ever."""
    from torch import nn

    from modelzoo.cpu.gemm import apply_gemm_backend
    from modelzoo.cpu.kernels import cpu_kernels
    from modelzoo.cpu.precision import (PackedLinear, apply_bf16_gemm, apply_half_gemm, pack_bf16_weight,
                                        pack_half_weight)

    if cpu_kernels() is None or (layout == "bf16_linear" and not cpu_kernels().bf16_dot_available()):
        pytest.skip("the C++ kernels cannot be built here" if cpu_kernels() is None else "bf16_linear needs AVX512-BF16")
    torch.manual_seed(0)
    dtype = torch.float32 if layout == "packed" else torch.bfloat16
    model = nn.Sequential(nn.Linear(1024, 1040, bias=False, dtype=dtype), nn.Linear(1040, 24, bias=False, dtype=dtype))
    weights = [layer.weight.detach().clone() for layer in model]
    x = torch.randn(5, 1024)
    if layout == "packed":
        apply_gemm_backend(model, dtype, torch.device("cpu"), "packed")
    else:
        (apply_half_gemm if layout == "half_linear" else apply_bf16_gemm)(model)
    assert all(isinstance(layer, PackedLinear) for layer in model)
    pack = pack_bf16_weight if layout == "bf16_linear" else pack_half_weight
    for layer, weight in zip(model, weights):
        assert torch.equal(layer.packed, pack(weight))
    first, second = (layer.packed.data_ptr() for layer in model)  # in the order a forward pass reads them
    assert first % HUGE_PAGE_BYTES == 0 and second - first == -(-model[0].packed_bytes() // 64) * 64
    assert "hg" in vm_flags(first)  # the whole 2 MiB pages (the last, partial one is not advised)
    inputs = x.bfloat16() if layout == "bf16_linear" else x  # bf16_linear multiplies bfloat16 inputs
    with torch.inference_mode():
        want = inputs.double() @ weights[0].double().T
        torch.testing.assert_close(model[0](x).double(), want, rtol=1e-5, atol=1e-5)


@linux
@transparent_huge_pages
def test_int8_weights_are_laid_out_side_by_side_on_huge_pages():
    """vnni16's packed int8 weights, and their scales, each written in turn into a mapping of their own advised to huge
    pages, at 64-byte boundaries in the order a forward pass reads them, with pack_weight's values in new memory."""
    from torch import nn

    from modelzoo.cpu.int8_compute import apply_int8_backend, available_int8_backends, pack_weight
    from modelzoo.cpu.quantization import Int8Linear, quantize_rows

    if "vnni16" not in available_int8_backends(torch.device("cpu")):
        pytest.skip("the C++ kernels cannot be built here")
    torch.manual_seed(0)
    model = nn.Sequential()
    for in_features, out_features in ((1024, 2056), (2056, 24)):  # rows and inputs padded: to 16, to the group
        layer = Int8Linear(in_features, out_features, False, torch.float32, group_size=32)
        layer.weight, layer.weight_scale = quantize_rows(torch.randn(out_features, in_features), 32)
        model.append(layer)
    expected = [pack_weight(layer.weight, layer.weight_scale, 32) for layer in model]
    apply_int8_backend(model, torch.float32, torch.device("cpu"), "vnni16")
    for layer, (packed, scales) in zip(model, expected):
        assert torch.equal(layer.packed, packed) and torch.equal(layer.scales, scales)
    for name in ("packed", "scales"):
        first, second = (getattr(layer, name).data_ptr() for layer in model)
        assert first % HUGE_PAGE_BYTES == 0 and second - first == -(-getattr(model[0], name).nbytes // 64) * 64
    assert "hg" in vm_flags(model[0].packed.data_ptr())  # 2 MiB and more


def bfloat16_checkpoint(tmp_path, num_key_value_heads: int):
    """A 4-layer Llama (hidden 512, MLP 2048, 8 heads, vocabulary 4096, untied) saved in bfloat16: 20+ MiB of weights."""
    from harness import save_tiny_model
    from safetensors.torch import load_file, save_file
    from tiny_configs import narrow_llama_config

    config = narrow_llama_config(hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                                 num_key_value_heads=num_key_value_heads, num_hidden_layers=4, vocab_size=4096,
                                 tie_word_embeddings=False)
    folder = save_tiny_model(config, tmp_path / "ckpt")
    weights = folder / "model.safetensors"
    save_file({name: tensor.to(torch.bfloat16) for name, tensor in load_file(weights).items()}, weights)
    return folder


def sixteen_bit_layout(gemm: str) -> tuple:
    """(lay out (model, shape keys read in place), packed layer class, in-place layer class) of a 16-bit GEMM, or a
    skip where it is not built here."""
    from modelzoo.cpu.kernels import cpu_kernels
    from modelzoo.cpu import precision

    if cpu_kernels() is None:
        pytest.skip("the C++ kernels cannot be built here")
    if gemm == "half_linear":
        return precision.apply_half_gemm, precision.HalfLinear, precision.InPlaceHalfLinear
    if not cpu_kernels().bf16_dot_available():
        pytest.skip("bf16_linear needs AVX512-BF16")
    return ((lambda model, in_place=(): precision.apply_bf16_gemm(model, in_place=in_place)), precision.BF16Linear,
            precision.InPlaceBF16Linear)


@linux
@pytest.mark.parametrize("gemm", ["half_linear", "bf16_linear"])
@pytest.mark.parametrize("keep_parts", [False, True])
def test_laying_out_16_bit_weights_holds_one_copy_of_them(tmp_path, keep_parts, gemm):
    """half_linear's or bf16_linear's layout of a loaded bfloat16 checkpoint (its weights views of the file's pages
    or, fused, of their own memory): the peak resident memory grows by the packed weights and a layer or two in
    flight, never by a second copy of the model; with the fused weights' parts kept apart (keep_parts), by the packed
    weights alone."""
    from modelzoo.models.checkpoint import load_model

    lay_out, packed_layer, _ = sixteen_bit_layout(gemm)
    folder = bfloat16_checkpoint(tmp_path, num_key_value_heads=8)
    lay_out(load_model(folder, torch.bfloat16, torch.device("cpu"))[0])  # code and allocator warmed up
    model, _ = load_model(folder, torch.bfloat16, torch.device("cpu"), keep_parts=keep_parts)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current resident size
    before = status_kib("VmRSS")
    lay_out(model)
    packed_kib = sum(layer.packed_bytes() for layer in model.modules() if isinstance(layer, packed_layer)) // 1024
    largest_layer_kib = 2 * 2048 * 512 * 2 // 1024  # a fused gate | up weight
    assert packed_kib > 20 * 1024
    grown = status_kib("VmHWM") - before
    assert grown <= packed_kib + (0 if keep_parts else 2 * largest_layer_kib) + 4 * 1024, (grown, packed_kib)


@linux
@pytest.mark.parametrize("gemm", ["half_linear", "bf16_linear"])
def test_16_bit_weights_read_in_place_are_the_checkpoints_pages(tmp_path, gemm):
    """A bfloat16 checkpoint loaded with its fused weights' parts kept apart (keep_parts) and every layer laid out in
    place (half_linear_rows, or bf16_linear_rows and bf16_silu_gate_rows): each layer's weight, q | k | v and gate | up
    part by part, is a view of the file's memory map, nothing is copied (the resident memory grows by less than a
    layer from loading to laid out), and the layers multiply as the packed ones do, bit for bit."""
    from modelzoo.cpu.memory import _mapping_of
    from modelzoo.cpu.precision import JoinedLinear, linear_like, linear_shape_key
    from modelzoo.models.checkpoint import load_model

    lay_out, packed_layer, in_place_layer = sixteen_bit_layout(gemm)
    folder = bfloat16_checkpoint(tmp_path, num_key_value_heads=4)
    load = lambda: load_model(folder, torch.bfloat16, torch.device("cpu"), keep_parts=True)[0]
    every_shape = lambda model: {linear_shape_key(m, m.weight.dtype) for m in model.modules() if linear_like(m)}
    warm = load()
    lay_out(warm, every_shape(warm))  # code and allocator warmed up
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current resident size
    before = status_kib("VmRSS")
    model = load()
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, JoinedLinear)
    assert [part.shape[0] for part in model.model.layers[0].mlp.gate_up_proj.parts] == [2048, 2048]
    lay_out(model, every_shape(model))
    grown = status_kib("VmHWM") - before
    layers = [m for m in model.modules() if isinstance(m, in_place_layer)]
    assert len(layers) == 4 * 4 + 1 and not any(isinstance(m, (packed_layer, JoinedLinear)) for m in model.modules())
    assert all(_mapping_of(part) is not None for layer in layers for part in layer.parts)
    assert grown < 2048 * 512 * 2 // 1024, grown  # less than the gate (or up) weight alone, in KiB
    packed = load()
    lay_out(packed)
    with torch.inference_mode():
        for name in ("model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj",
                     "model.layers.1.mlp.down_proj", "lm_head"):
            in_place, laid_out = model.get_submodule(name), packed.get_submodule(name)
            assert isinstance(laid_out, packed_layer)
            x = torch.randn(3, in_place.in_features)
            assert torch.equal(in_place(x), laid_out(x))
