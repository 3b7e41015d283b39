"""Group-wise int8 and the VNNI paths (modelzoo/cpu/quantization.py, modelzoo/cpu/int8_compute.py,
modelzoo/cpu/kernels/int8_gemm.cpp): the group-wise quantizer's bound, the kernel against the arithmetic it
documents at 8- and 16-bit activations, batch invariance, every family through every backend, the choice,
the params and the runner.

The kernel tests need the C++ kernels (16-bit activations: every AVX2 CPU, both code paths where the CPU has
AVX512-VNNI; 8-bit activations: AVX512-VNNI only); elsewhere they are skipped and the float path, the only one
there, is what the other tests check.
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import modelzoo.cpu.int8_compute as int8_compute
from harness import (family_prompts, last_logits, prompt_rows, relative_error, run_job, save_tiny_model,
                     stacked_predictions, write_h5, write_params)
from modelzoo.models.checkpoint import load_model
from modelzoo.errors import UserError
from modelzoo.cpu.int8_compute import TiedInt8Embedding, VnniInt8Linear, apply_int8_backend, available_int8_backends
from modelzoo.cpu.kernels import cpu_kernels
from modelzoo.cpu.quantization import Int8Embedding, Int8Linear, dequantize_rows, quantize_rows
from tiny_configs import INT8_FAMILIES, INT8_LOGITS_REL_TOL, VOCAB

CPU = torch.device("cpu")
HAS_VNNI = "vnni8" in available_int8_backends(CPU)
needs_vnni = pytest.mark.skipif(not HAS_VNNI, reason="no AVX512-VNNI int8 kernel on this CPU / build")
needs_kernel = pytest.mark.skipif("vnni16" not in available_int8_backends(CPU), reason="the C++ kernels are not built")
# int8_linear's code paths ("avx2", then "vnni" and "amx" where the CPU and build have them)
CODE_PATHS = cpu_kernels().int8_gemm_paths() if "vnni16" in available_int8_backends(CPU) else ["avx2"]


def int8_layer(out_features: int, in_features: int, group_size: int, bias: bool = True,
               dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Int8Linear, torch.Tensor]:
    """An Int8Linear quantized from a random float weight (rows of very different ranges); and its bias."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * torch.logspace(-2, 1, out_features)[:, None]
    layer = Int8Linear(in_features, out_features, bias, dtype, group_size=group_size)
    layer.weight, layer.weight_scale = quantize_rows(weight, group_size)
    if bias:
        layer.bias = torch.randn(out_features, generator=generator).to(dtype)
    return layer, layer.bias


def kernel_reference(x: torch.Tensor, layer: Int8Linear, bits: int) -> torch.Tensor:
    """int8_gemm.cpp's documented arithmetic in float64: x quantized per row and chunk to `bits` (absmax / qmax,
    round half to even; the per-channel group is the whole row rounded up to 16; the 16-bit chunk the largest
    multiple of 16 up to 256 dividing the group), integer dot products, both scales, the bias."""
    group = layer.group_size or -(-layer.in_features // 16) * 16
    chunk = group if bits == 8 else max(c for c in range(16, min(group, 256) + 1, 16) if group % c == 0)
    qmax = 2 ** (bits - 1) - 1
    rows = x.reshape(-1, layer.in_features).float()
    padded = F.pad(rows, (0, -(-layer.in_features // group) * group - layer.in_features))
    chunks = padded.view(rows.shape[0], -1, chunk)  # (M, C, chunk)
    absmax = chunks.abs().amax(dim=2)
    inverse = torch.where(absmax > 0, qmax / absmax, torch.zeros_like(absmax))  # float32, as the kernel
    xq = torch.round(chunks * inverse[..., None]).clamp(-qmax, qmax)
    q = F.pad(layer.weight.float(), (0, padded.shape[1] - layer.in_features)).view(layer.out_features, -1, chunk)
    dots = torch.einsum("mck,nck->mnc", xq.double(), q.double())  # exact integers
    weight_scales = layer.weight_scale.double().reshape(layer.out_features, -1).repeat_interleave(group // chunk, 1)
    y = (dots * weight_scales[None] * (absmax / qmax).double()[:, None]).sum(dim=2)
    if layer.bias is not None:
        y = y + layer.bias.double()
    return y.reshape(*x.shape[:-1], layer.out_features)


# --- the group-wise quantizer ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_wise_round_trip_is_within_half_a_step_of_each_group(dtype):
    torch.manual_seed(0)
    weight = torch.randn(12, 70) * torch.logspace(-3, 2, 70)[None, :]  # groups of very different ranges
    weight[3, 32:64] = 0  # an all-zero group
    weight = weight.to(dtype)
    q, scale = quantize_rows(weight, 32)
    assert q.shape == (12, 70) and scale.shape == (12, 3)  # 70 columns: groups of 32, 32 and 6
    for g, columns in enumerate((slice(0, 32), slice(32, 64), slice(64, 70))):
        absmax = weight[:, columns].float().abs().amax(dim=1)
        nonzero = absmax > 0
        torch.testing.assert_close(scale[nonzero, g], absmax[nonzero] / 127, rtol=0, atol=0)
        assert (q[nonzero, columns].abs().amax(dim=1) == 127).all()
    assert scale[3, 1] == 1 and not q[3, 32:64].any()
    error = (dequantize_rows(q, scale, group_size=32) - weight.float()).abs()
    steps = scale.repeat_interleave(32, dim=1)[:, :70]
    assert (error <= steps * (0.5 + 1e-4)).all()
    assert (error / steps).max() > 0.45  # the bound is tight, not vacuous


def test_group_wise_is_closer_than_per_channel():
    torch.manual_seed(0)
    weight = torch.randn(64, 256) * torch.logspace(-2, 1, 256)[None, :]  # inputs of different ranges
    per_channel = (dequantize_rows(*quantize_rows(weight)) - weight).norm()
    grouped = (dequantize_rows(*quantize_rows(weight, 32), group_size=32) - weight).norm()
    assert grouped < 0.5 * per_channel


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_group_wise_int8_linear_equals_linear_on_the_dequantized_weight(dtype, tol):
    layer, bias = int8_layer(80, 48, 32, dtype=dtype)
    x = torch.randn(3, 5, 48)
    want = F.linear(x, dequantize_rows(layer.weight, layer.weight_scale, group_size=32), bias.float())
    got = layer(x.to(dtype))
    assert got.dtype == dtype and got.shape == (3, 5, 80)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * float(want.abs().max()))


def test_group_wise_embedding_gathers_dequantized_rows():
    q, scale = quantize_rows(torch.randn(30, 40), 16)
    embedding = Int8Embedding(30, 40, dtype=torch.bfloat16, group_size=16)
    embedding.weight, embedding.weight_scale = q, scale
    tokens = torch.tensor([[3, 29, 0], [3, 7, 7]])
    assert torch.equal(embedding(tokens), dequantize_rows(q, scale, torch.bfloat16, 16)[tokens])


# --- the kernel -----------------------------------------------------------------------------------

@contextlib.contextmanager
def int16_path(path: str):
    """int8_linear on code path `path` (the one chosen before restored after)."""
    kernels = cpu_kernels()
    chosen = kernels.int8_gemm_path()
    assert kernels.int8_gemm_path(path) == path
    try:
        yield
    finally:
        kernels.int8_gemm_path(chosen)


# (activation bits, code path): 8 bits on VNNI and AMX; 16 bits on every path
KERNEL_PATHS = ([(8, path) for path in CODE_PATHS if path != "avx2"]
                + [pytest.param(16, path, marks=needs_kernel) for path in CODE_PATHS])


@pytest.mark.parametrize("out_features, in_features, group_size", [
    (40, 64, 32),   # N not a multiple of 16
    (96, 48, 32),   # K not a multiple of the group: a zero-padded last group
    (64, 128, 64),
    (20, 100, 0),   # per-channel: one group per row, K rounded up to 112
    (24, 600, 0),   # per-channel over 256 inputs: 16-bit chunks of 32 (608 = 19 x 32)
    (16, 1024, 0),  # 16-bit chunks of 256
    (33, 576, 32),  # two 16-row blocks and a partial third
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits, path", KERNEL_PATHS)
def test_kernel_computes_its_documented_arithmetic(out_features, in_features, group_size, dtype, bits, path):
    layer, _ = int8_layer(out_features, in_features, group_size, dtype=dtype)
    x = torch.randn(2, 5, in_features).to(dtype)
    x[0, 1, :16] = 0  # an all-zero group of activations
    with int16_path(path):
        got = VnniInt8Linear(layer, bits)(x)
    want = kernel_reference(x, layer, bits)
    assert got.dtype == dtype and got.shape == (2, 5, out_features)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # integer sums exact; a float32 multiply-add per group
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


@needs_kernel
@pytest.mark.parametrize("group_size", [0, 32, 48, 128])
@pytest.mark.parametrize("bits", [16, pytest.param(8, marks=needs_vnni)])
def test_every_path_gives_the_same_bits(bits, group_size):
    """AMX tile products, vpdpwssd / vpdpbusd (VNNI) and, at 16 bits, vpmaddwd + vpaddd (AVX2) make the same integer
    sums: the same outputs, whichever is timed fastest (on every tile shape: 1-4 rows and 1-2 blocks on VNNI, 1-16 rows
    of a 16-row AMX tile, a partial last block; AMX windows of 16 (group 48), 32 (600 inputs per channel: 16-bit
    chunks of 32) and 64 inputs)."""
    kernels = cpu_kernels()
    layer, _ = int8_layer(72, 600, group_size)
    int8 = VnniInt8Linear(layer, bits)
    x = torch.randn(37, 600) * torch.logspace(-1, 1, 600)
    outputs = []
    for path in CODE_PATHS if bits == 16 else [path for path in CODE_PATHS if path != "avx2"]:
        with int16_path(path):
            outputs.append([int8(x[:rows]) for rows in (1, 2, 3, 4, 11, 16, 17, 37)])
    assert all(torch.equal(a, b) for other in outputs[1:] for a, b in zip(outputs[0], other))
    with pytest.raises(RuntimeError, match="path is avx2"):
        kernels.int8_gemm_path("sse4")
    with pytest.raises(RuntimeError, match="group must be a positive multiple of 16, not 20"):
        kernels.int8_gemm_path("", 20)


@pytest.mark.parametrize("group_size", [0, 32])
@pytest.mark.parametrize("bits, path", KERNEL_PATHS)
def test_kernel_rows_do_not_depend_on_the_batch(group_size, bits, path):
    layer, _ = int8_layer(200, 576, group_size)
    vnni = VnniInt8Linear(layer, bits)
    x = torch.randn(64, 576)
    with int16_path(path):
        full = vnni(x)
        for rows in (1, 2, 3, 5, 7, 32):
            assert torch.equal(vnni(x[:rows]), full[:rows]), rows
            assert torch.equal(vnni(x[-rows:]), full[-rows:]), rows


@pytest.mark.parametrize("bits, tolerance", [pytest.param(8, 1e-2, marks=needs_vnni),
                                             pytest.param(16, 2e-4, marks=needs_kernel)])
def test_kernel_is_close_to_the_float_layer(bits, tolerance):
    """Activation quantization costs a little precision: 8 bits within 1% of the float path, 16 bits 0.02%."""
    layer, _ = int8_layer(256, 576, 32)
    x = torch.randn(16, 576) * torch.logspace(-1, 1, 576)  # inputs of different ranges
    assert relative_error(VnniInt8Linear(layer, bits)(x), layer(x)).max() < tolerance


@needs_kernel
def test_packed_rows_read_back_the_int8_weight():
    for group_size in (0, 32):
        layer, _ = int8_layer(50, 80, group_size)
        q, scales = VnniInt8Linear(layer, 16).rows(torch.tensor([[0, 49], [17, 17]]))
        assert torch.equal(q, layer.weight[torch.tensor([[0, 49], [17, 17]])])
        assert torch.equal(scales, layer.weight_scale[torch.tensor([[0, 49], [17, 17]])])


# --- every family, both backends ------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int8_compute_checkpoints")
    return {name: save_tiny_model(make(), root / name) for name, make in INT8_FAMILIES.items()}


@pytest.mark.parametrize("family", list(INT8_FAMILIES))
@pytest.mark.parametrize("group_size", [0, 32])
@pytest.mark.parametrize("backend", [pytest.param("vnni8", marks=needs_vnni),
                                     pytest.param("vnni16", marks=needs_kernel)])
def test_vnni_backend_is_close_to_float32(family, group_size, backend, checkpoints):
    prompts = family_prompts(VOCAB)
    model, _ = load_model(checkpoints[family], torch.float32, CPU, weight_dtype="int8", int8_group_size=group_size)
    weight_only, _ = load_model(checkpoints[family], torch.float32, CPU, weight_dtype="int8",
                                int8_group_size=group_size)  # the `float` backend: activations exact
    plan = apply_int8_backend(model, torch.float32, CPU, backend)
    assert set(plan.layers.values()) == {backend} and plan.batch_invariant
    assert not any(isinstance(m, Int8Linear) for m in model.modules())  # every int8 layer repacked
    reference, _ = load_model(checkpoints[family], torch.float32, CPU)
    logits = last_logits(model, prompts)
    assert relative_error(logits, last_logits(reference, prompts)).max() < INT8_LOGITS_REL_TOL
    if backend == "vnni16":  # 16-bit activations: the weight-only int8 model's logits
        assert relative_error(logits, last_logits(weight_only, prompts)).max() < 1e-3


@needs_kernel
@pytest.mark.parametrize("family, head, embedding", [
    ("llama_tied", "lm_head", "model.embed_tokens"), ("gpt2", "lm_head", "transformer.wte")])
def test_tied_embedding_reads_the_packed_head(family, head, embedding, checkpoints):
    model, _ = load_model(checkpoints[family], torch.float32, CPU, weight_dtype="int8", int8_group_size=32)
    plain = model.get_submodule(embedding)
    tokens = torch.tensor([[1, 5, VOCAB - 1]])
    want = plain(tokens)
    apply_int8_backend(model, torch.float32, CPU, "vnni16")
    tied = model.get_submodule(embedding)
    assert isinstance(tied, TiedInt8Embedding) and tied.head[0] is model.get_submodule(head)
    assert torch.equal(tied(tokens), want)
    assert not [name for name, _ in model.named_buffers() if name.startswith(embedding)]  # one copy of the table


def test_vnni_refused_where_unavailable(checkpoints, monkeypatch):
    monkeypatch.setattr(int8_compute, "available_int8_backends", lambda device: ["float"])
    model, _ = load_model(checkpoints["llama_tied"], torch.float32, CPU, weight_dtype="int8")
    with pytest.raises(UserError, match="runconfig.int8_backend vnni16 needs the C\\+\\+ kernels built \\(a C\\+\\+ "
                                        "compiler\\); available here: float"):
        apply_int8_backend(model, torch.float32, CPU, "vnni16")
    monkeypatch.setattr(int8_compute, "available_int8_backends", lambda device: ["vnni16", "float"])
    with pytest.raises(UserError, match="runconfig.int8_backend vnni8 needs the C\\+\\+ kernels built with "
                                        "AVX512-VNNI on a CPU that has it; available here: vnni16, float"):
        apply_int8_backend(model, torch.float32, CPU, "vnni8")
    monkeypatch.setattr(int8_compute, "available_int8_backends", lambda device: ["float"])
    plan = apply_int8_backend(model, torch.float32, CPU, "auto")  # auto: the float path, measured alone
    assert set(plan.layers.values()) == {"float"} and isinstance(model.lm_head, Int8Linear)


def test_auto_keeps_the_fastest_measured(checkpoints, monkeypatch):
    model, _ = load_model(checkpoints["llama_tied"], torch.float32, CPU, weight_dtype="int8", int8_group_size=32)
    plan = apply_int8_backend(model, torch.float32, CPU, "auto")
    assert plan.layers and set(plan.layers) == set(plan.measured)
    for key, backend in plan.layers.items():
        rates = plan.measured[key]["gflops"]
        assert set(rates) == set(available_int8_backends(CPU))
        choices = [b for b in rates if b != "vnni8"]  # 8-bit activations only when asked for
        invariant = [b for b in choices if plan.measured[key]["invariant"][b]] or choices
        cost = {b: sum(1 / r for r in rates[b].values()) for b in invariant}
        assert backend == min(cost, key=cost.__getitem__) == plan.measured[key]["backend"]  # summary.json agrees


# --- params and the runner ------------------------------------------------------------------------

@pytest.mark.parametrize("value, message", [
    (20, "model.int8_group_size must be 0 (one scale per output channel) or a positive multiple of 16 "
         "(inputs per scale), got 20"),
    (-16, "model.int8_group_size must be 0 (one scale per output channel) or a positive multiple of 16 "
          "(inputs per scale), got -16"),
    ("32", "model.int8_group_size must be 0 (one scale per output channel) or a positive multiple of 16 "
           "(inputs per scale), got '32'"),
])
def test_bad_group_size_is_a_one_line_error(tmp_path, capsys, value, message, checkpoints):
    write_h5(tmp_path / "data", prompt_rows([[5, 6, 7]], 16, VOCAB))
    params = write_params(tmp_path / "params.yaml", checkpoints["llama_tied"], tmp_path / "data", batch_size=1,
                          start_token=VOCAB, weight_dtype="int8", model_keys={"int8_group_size": value})
    assert run_job(params, tmp_path / "run") == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_bad_int8_backend_is_a_one_line_error(tmp_path, capsys, checkpoints):
    write_h5(tmp_path / "data", prompt_rows([[5, 6, 7]], 16, VOCAB))
    params = write_params(tmp_path / "params.yaml", checkpoints["llama_tied"], tmp_path / "data", batch_size=1,
                          start_token=VOCAB, weight_dtype="int8", int8_backend="amx")
    assert run_job(params, tmp_path / "run") == 2
    assert capsys.readouterr().err == ("error: runconfig.int8_backend must be one of auto, vnni16, vnni8, float, "
                                       "got 'amx'\n")


MAX_SEQ_LEN, MAX_TOKENS = 64, 12


def run_int8(tmp_path: Path, checkpoint: Path, name: str, batch_size: int, backend: str, group_size: int = 32,
             **keys) -> Path:
    prompts = family_prompts(VOCAB)
    if not (tmp_path / "data").exists():
        write_h5(tmp_path / "data", prompt_rows(prompts, MAX_SEQ_LEN, VOCAB))
    params = write_params(tmp_path / f"{name}.yaml", checkpoint, tmp_path / "data", batch_size=batch_size,
                          start_token=VOCAB, max_tokens=MAX_TOKENS, weight_dtype="int8",
                          model_keys={"int8_group_size": group_size}, int8_backend=backend, **keys)
    assert run_job(params, tmp_path / name) == 0
    return tmp_path / name


@pytest.mark.parametrize("backend", [pytest.param("vnni16", marks=needs_kernel),
                                     pytest.param("vnni8", marks=needs_vnni), "float"])
def test_runner_records_the_int8_choice(backend, checkpoints, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="zoo-infer"):
        run = run_int8(tmp_path, checkpoints["llama_tied"], "run", 3, backend)
    summary = json.loads((run / "artifacts" / "summary.json").read_text())
    int8_layers = {key: value for key, value in summary["gemm"]["layers"].items() if key.startswith("int8 g32 ")}
    assert int8_layers and set(int8_layers.values()) == {backend}
    assert summary["gemm"]["requested"].endswith(f"; int8 {backend}")
    assert "quantized in groups of 32 inputs" in caplog.text
    assert f"int8 backends ({backend}): int8 g32 float32 64x" in caplog.text
    if backend != "float":  # the C++ kernel's code paths, timed on the model's group
        assert re.search(rf"; kernel path ({'|'.join(CODE_PATHS)}) \(((avx2|vnni|amx) at 4 rows or fewer; )?"
                         rf"fastest of {', '.join(CODE_PATHS)}\)", caplog.text)
    else:  # the kernel is not used, nor timed
        assert "kernel path" not in caplog.text


@pytest.mark.parametrize("backend", [pytest.param("vnni16", marks=needs_kernel),
                                     pytest.param("vnni8", marks=needs_vnni)])
def test_vnni_files_do_not_depend_on_the_batch_size(backend, checkpoints, tmp_path):
    """Each row's tokens are the same whichever rows share its batch: identical predictions at batch 1, 2, 7."""
    runs = [run_int8(tmp_path, checkpoints["llama_tied"], f"b{b}", b, backend) for b in (1, 2, 7)]
    n = len(family_prompts(VOCAB))
    first = stacked_predictions(runs[0])[:n]
    for run in runs[1:]:
        np.testing.assert_array_equal(stacked_predictions(run)[:n], first)


def test_changing_the_group_size_is_refused_on_resume(checkpoints, tmp_path, capsys):
    run_int8(tmp_path, checkpoints["llama_tied"], "run", 3, "float", group_size=32)
    params = write_params(tmp_path / "g64.yaml", checkpoints["llama_tied"], tmp_path / "data", batch_size=3,
                          start_token=VOCAB, max_tokens=MAX_TOKENS, weight_dtype="int8",
                          model_keys={"int8_group_size": 64})
    assert run_job(params, tmp_path / "run") == 2
    assert "changed: model.int8_group_size" in capsys.readouterr().err


def test_group_size_stays_out_of_float_manifests(checkpoints, tmp_path):
    write_h5(tmp_path / "data", prompt_rows([[5, 6, 7]], 16, VOCAB))
    params = write_params(tmp_path / "params.yaml", checkpoints["llama_tied"], tmp_path / "data", batch_size=1,
                          start_token=VOCAB, max_tokens=2)
    assert run_job(params, tmp_path / "run") == 0
    manifest = json.loads((tmp_path / "run" / "artifacts" / "manifest.json").read_text())
    assert "int8_group_size" not in manifest["model"] and manifest["model"]["weight_dtype"] is None


@pytest.mark.parametrize("view", ["contiguous", "offset by a byte", "transposed"])
@pytest.mark.parametrize("group_size", [0, 32])
def test_packed_int8_layout(view, group_size):
    """pack_weight: packed[b, c, r, j] = q[16 b + r, 4 c + j] + 128 (the padding rows and inputs: 0 + 128) and
    scales[b, g, r] = the scale of row 16 b + r's group g (padding rows: 0), whatever q's memory (a view at any byte,
    or strided)."""
    from modelzoo.cpu.int8_compute import pack_weight

    rows, columns = 37, 70
    generator = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (rows, columns), dtype=torch.int8, generator=generator)
    groups = -(-columns // group_size) if group_size else 1
    scale = torch.rand(rows, groups, generator=generator) if group_size else torch.rand(rows, generator=generator)
    if view == "offset by a byte":
        q = torch.cat([torch.zeros(1, dtype=torch.int8), q.flatten()])[1:].view(rows, columns)
    elif view == "transposed":
        q = q.t().contiguous().t()
    packed, scales = pack_weight(q, scale, group_size)
    padded_columns = groups * group_size if group_size else 80  # per channel: the row rounded up to 16
    assert packed.shape == (3, padded_columns // 4, 16, 4) and packed.dtype == torch.uint8
    full = torch.zeros(48, padded_columns, dtype=torch.int16)
    full[:rows, :columns] = q.to(torch.int16)
    want = (full + 128).to(torch.uint8).view(3, 16, -1, 4).permute(0, 2, 1, 3)
    assert torch.equal(packed, want)
    full_scale = torch.zeros(48, groups)
    full_scale[:rows] = scale.reshape(rows, groups)
    assert torch.equal(scales, full_scale.view(3, 16, groups).transpose(1, 2))
