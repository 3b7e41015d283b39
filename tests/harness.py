"""Shared test helpers: tiny Hugging Face checkpoints, .h5 prompt files, the runner, and the oracle.

The oracle is `transformers` itself: `generate()` with greedy decoding, one prompt at a time (no
padding, so nothing but the model's own arithmetic decides the tokens).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import h5py
import numpy as np
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"


def save_tiny_model(config: Any, folder: Path, seed: int = 0) -> Path:
    """Random-initialised transformers model of `config`, saved as a checkpoint folder.

    Weights are drawn with a wide std so logits are decisive: with the default 0.02 the top two
    logits of a random model are often within float noise of each other, and "token-exact" would
    test the noise rather than the arithmetic.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # norm weights around 1, biases around 0
                param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, param.shape[-1] ** -0.5)
    model.save_pretrained(folder)  # transformers >= 5 always writes safetensors
    return folder


def prompt_rows(prompts: Sequence[Sequence[int]], max_seq_len: int, start_token: int) -> np.ndarray:
    """Rows as the data tool writes them: prompt, then the start token to the end. (N, max_seq_len) int32."""
    rows = np.full((len(prompts), max_seq_len), start_token, dtype=np.int32)
    for i, prompt in enumerate(prompts):
        rows[i, : len(prompt)] = prompt
    return rows


def write_h5(folder: Path, rows: np.ndarray, loop_dim: int = 1, name: str = "data.h5", **attrs: Any) -> Path:
    """Writes `rows` (N, S) as the `data` dataset (transposed when loop_dim is 0)."""
    folder.mkdir(parents=True, exist_ok=True)
    with h5py.File(folder / name, "w") as handle:
        handle.create_dataset("data", data=rows if loop_dim == 1 else rows.T)
        for key, value in attrs.items():
            handle.attrs[key] = value
    return folder / name


def write_params(path: Path, checkpoint: Path, data_dir: Path, batch_size: int, start_token: int | list[int],
                 stop_sequences: list[list[int]] | None = None, max_tokens: int | None = None, loop_dim: int = 1,
                 dtype: str = "float32", weight_dtype: str | None = None, model_keys: dict[str, Any] | None = None,
                 **runconfig: Any) -> Path:
    """A params.yaml for the runner (`model_keys`: more model: keys; the keyword arguments: runconfig: keys)."""
    params = {
        "model": {"checkpoint_path": str(checkpoint), "dtype": dtype, "start_token": start_token,
                  "stop_sequences": stop_sequences or [], "max_tokens": max_tokens, "loop_dim": loop_dim,
                  **({"weight_dtype": weight_dtype} if weight_dtype else {}), **(model_keys or {})},
        "inference_input": {"data_processor": "GptHDF5MapDataProcessor", "data_dir": str(data_dir),
                            "batch_size": batch_size},
        "runconfig": {"device": "cpu", **runconfig},
    }
    path.write_text(yaml.safe_dump(params))
    return path


def run_job(params: Path, model_dir: Path, *flags: str) -> int:
    """Runs run_inference.py's main in this process; returns its exit code."""
    from modelzoo.job.cli import main

    return main(["--params", str(params), "--model_dir", str(model_dir), *flags])


def load_predictions(model_dir: Path) -> dict[int, dict[str, np.ndarray]]:
    """{global_step: arrays} of every predictions file of a run."""
    folder = model_dir / "artifacts" / "predictions"
    out = {}
    for path in folder.glob("predictions_*.npz"):
        with np.load(path, allow_pickle=False) as npz:
            out[int(npz["global_step"])] = {key: npz[key] for key in npz.files}
    return out


def stacked_predictions(model_dir: Path) -> np.ndarray:
    """Every step's predictions (batch_size, S), stacked in step order: (steps * batch_size, S)."""
    runs = load_predictions(model_dir)
    return np.concatenate([runs[step]["predictions"] for step in sorted(runs)])


def truncate_at_stop(tokens: list[int], stop_sequences: Sequence[Sequence[int]]) -> list[int]:
    """Cuts generated tokens right after the first complete stop sequence (the sequence is kept)."""
    for end in range(1, len(tokens) + 1):
        for seq in stop_sequences:
            if end >= len(seq) and tokens[end - len(seq): end] == list(seq):
                return tokens[:end]
    return tokens


def hf_greedy(checkpoint: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
              stop_sequences: Sequence[Sequence[int]] = (), dtype: torch.dtype = torch.float32,
              adapter: Path | None = None, device: str = "cpu") -> list[list[int]]:
    """Greedy continuations by transformers `generate()` on `device`, one prompt at a time, cut after stop sequences;
    with a PEFT LoRA `adapter` folder, through peft's unmerged PeftModel."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval().to(device)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    model.generation_config.eos_token_id = None  # stopping is ours to decide, through stop_sequences
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                              pad_token_id=0, use_cache=True)
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], device=device)
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            out.append(truncate_at_stop(generated[0, len(prompt):].tolist(), stop_sequences))
    return out


def expected_rows(prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], max_seq_len: int,
                  pad: int) -> np.ndarray:
    """Output rows as the README's "What the job writes" says: prompt, generated tokens, then the pad
    (first start) token. (N, S)."""
    rows = np.full((len(prompts), max_seq_len), pad, dtype=np.int32)
    for i, (prompt, tokens) in enumerate(zip(prompts, continuations)):
        row = list(prompt) + list(tokens)
        rows[i, : len(row)] = row[:max_seq_len]
    return rows


def family_prompts(vocab_size: int, lengths: Sequence[int] = (3, 11, 1, 23, 6, 40, 2), seed: int = 0) -> list[list[int]]:
    """Random prompts of mixed lengths (the 40-token one is longer than a small sliding window)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]


def shared_prefix_prompts(vocab_size: int, prefix_len: int = 20, seed: int = 1) -> list[list[int]]:
    """Prompts most of which start with one `prefix_len`-token prefix (a chat template's), with tails
    of mixed lengths; also one prompt that is the prefix alone and one that starts otherwise. The
    first three share the prefix, so an engine with 3 slots finds it in its first admission."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab_size, size=prefix_len).tolist()
    tails = [rng.integers(0, vocab_size, size=n).tolist() for n in (4, 9, 1, 15, 30)]
    other = rng.integers(0, vocab_size, size=12).tolist()
    other[0] = (prefix[0] + 1) % vocab_size
    return [prefix + tails[0], prefix + tails[1], prefix + tails[2], other, prefix, prefix + tails[3],
            prefix + tails[4]]


def our_last_logits(checkpoint: Path, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Our model's logits at the last prompt position, one prompt at a time: (vocab,) each."""
    from modelzoo.models.checkpoint import load_model
    from modelzoo.models.kv_cache import KVCache

    model, _ = load_model(checkpoint, torch.float32, torch.device("cpu"))
    c = model.config
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            cache = KVCache(c.num_layers, 1, c.num_kv_heads, len(prompt), c.head_dim, torch.float32, torch.device("cpu"))
            tokens = torch.tensor([list(prompt)])
            out.append(model(tokens, torch.arange(len(prompt))[None], cache, None)[0])
    return out


def hf_last_logits(checkpoint: Path, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """transformers' logits at the last prompt position: (vocab,) each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([list(p)])).logits[0, -1] for p in prompts]


def assert_family_matches_transformers(config: Any, tmp_path: Path, max_seq_len: int = 64, batch_size: int = 3,
                                       max_tokens: int = 16, seed: int = 0,
                                       prompts: Sequence[Sequence[int]] | None = None) -> None:
    """The family contract: a tiny random checkpoint of `config` gives, through run_inference.py with
    each GEMM backend forced in turn, greedy predictions token-exact with transformers (fp32), and
    last-position logits within 1e-4.
    prompts: default family_prompts(vocab, seed)."""
    checkpoint = save_tiny_model(config, tmp_path / "checkpoint", seed=seed)
    vocab = config.vocab_size
    prompts = family_prompts(vocab, seed=seed) if prompts is None else prompts
    for ours, theirs in zip(our_last_logits(checkpoint, prompts), hf_last_logits(checkpoint, prompts)):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    data = tmp_path / "data"
    write_h5(data, prompt_rows(prompts, max_seq_len, vocab))
    reference = hf_greedy(checkpoint, prompts, max_tokens)
    expected = expected_rows(prompts, reference, max_seq_len, vocab)
    from modelzoo.cpu.gemm import available_backends

    for backend in available_backends(torch.device("cpu"), torch.float32):  # every GEMM library gives the same tokens
        params = write_params(tmp_path / f"params_{backend}.yaml", checkpoint, data, batch_size=batch_size,
                              start_token=vocab, max_tokens=max_tokens, gemm_backend=backend)
        assert run_job(params, tmp_path / f"run_{backend}") == 0
        got = stacked_predictions(tmp_path / f"run_{backend}")[: len(prompts)]
        np.testing.assert_array_equal(got, expected, err_msg=f"gemm_backend {backend}")


# small_job's workload: 90 prompts, 23 steps of 4 (the last with 2 dummy rows), vocabulary 80 (start token 80)
SMALL_VOCAB, SMALL_SAMPLES, SMALL_BATCH, SMALL_STEPS = 80, 90, 4, 23


def small_job(root: Path, num_samples: int = SMALL_SAMPLES, batch_size: int = SMALL_BATCH,
              vocab: int = SMALL_VOCAB, dtype: str = "float32") -> dict[str, Any]:
    """A tiny Llama, `num_samples` random prompts (start token = vocab) and their params (`dtype`, max_tokens 40,
    a progress line per step, batch_size rows in flight so that files appear one after another as in
    a long job), plus one uninterrupted run's output in root/reference: the workload of the resume and
    failure tests."""
    from tiny_configs import tiny_llama_config

    config = tiny_llama_config(vocab_size=vocab, num_hidden_layers=2)
    checkpoint = save_tiny_model(config, root / "ckpt")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, vocab, size=rng.integers(1, 20)).tolist() for _ in range(num_samples)]
    write_h5(root / "data", prompt_rows(prompts, 64, vocab))
    params = write_params(root / "params.yaml", checkpoint, root / "data", batch_size=batch_size, start_token=vocab,
                          max_tokens=40, dtype=dtype, log_steps=1, rows_in_flight=batch_size)
    assert run_job(params, root / "reference") == 0
    return {"params": params, "reference": root / "reference", "checkpoint": checkpoint, "data": root / "data",
            "prompts": prompts}


def last_logits(model: torch.nn.Module, prompts: list[list[int]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Last-position logits of each prompt, one at a time, in float32: (prompts, vocab)."""
    from modelzoo.models.kv_cache import KVCache

    c = model.config
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            cache = KVCache(c.num_layers, 1, c.num_kv_heads, len(prompt), c.head_dim, dtype, torch.device("cpu"))
            out.append(model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache, None)[0].float())
    return torch.stack(out)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row: ||got - want|| / ||want||."""
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def torchrun(nproc: int, params: Path, model_dir: Path) -> subprocess.Popen:
    """run_inference.py under torchrun on a free port, as a scheduler would start it."""
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={nproc}",
               str(REPO_ROOT / "run_inference.py"), "--params", str(params), "--model_dir", str(model_dir)]
    return subprocess.Popen(command, cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> str:
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    return output
