"""The last layer computes its outputs only at the positions the head reads (CausalLM.positions_read), every
position's keys and values still stored: the same logits (and greedy picks), bit for bit, and the same cache as
when it computes every position, in every family, padded and packed, float32 and the bfloat16 policy, and with
LoRA adapters per row; and the benchmark's workload counts what a prefill runs."""
from __future__ import annotations

import pytest
import torch
from transformers import OPTConfig

from harness import family_prompts, save_tiny_model
from lora_adapters import make_adapter
from precision_policies import needs_bf16
from tiny_configs import INT8_FAMILIES, VOCAB, bloom_config, falcon_config, neox_config

FAMILIES = {
    **INT8_FAMILIES,
    "bloom_residual_post_layernorm": lambda: bloom_config(apply_residual_connection_post_layernorm=True),
    "falcon_parallel_attention": falcon_config,  # one norm, attention and MLP side by side
    "gpt_neox_sequential": lambda: neox_config(parallel=False),
    "opt_pre_norm": lambda: OPTConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      ffn_dim=96, max_position_embeddings=80, pad_token_id=1,
                                      do_layer_norm_before=True, architectures=["OPTForCausalLM"]),
}
PROMPTS = family_prompts(VOCAB)[:4]  # 3, 11, 1 and 23 tokens


def open_job(checkpoint, dtype: str, adapters: dict[str, str] | None = None):
    """The model and its engine's KV cache as the runner opens them (4 rows in flight, max_seq_len 64); `adapters`:
    LoRA adapters per row (name -> folder), the four slots running the first, none, the second and the first."""
    from modelzoo.runtime import Runtime, RuntimePlan
    from modelzoo.runtime_spec import RuntimeSpec

    row_adapters = tuple(adapters) if adapters else None
    spec = RuntimeSpec(str(checkpoint), dtype=dtype, device="cpu", max_seq_len=64, rows_in_flight=4,
                       adapters=adapters or {}, row_adapters=row_adapters)
    runtime = Runtime(RuntimePlan.of(spec), rows_to_do=4)
    cache = runtime.engine.cache
    if adapters:
        cache.slot_adapter[:] = torch.tensor([0, -1, 1, 0])
    return runtime.model, cache


def prefill_inputs(layout: str) -> tuple[torch.Tensor, ...]:
    """(tokens, positions, slots, last) of PROMPTS prefilled in one forward: right-padded rows with one read
    position a row (`padded`), two (`two_a_row`) or the final one (`final`: last None), or side by side (`packed`)."""
    lengths = torch.tensor([len(p) for p in PROMPTS])
    if layout == "packed":
        tokens = torch.tensor([sum(PROMPTS, [])])
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        slots = torch.repeat_interleave(torch.arange(len(PROMPTS)), lengths)[None]
        return tokens, positions, slots, (lengths.cumsum(0) - 1)[None]
    width = int(lengths.max())
    tokens = torch.tensor([p + [0] * (width - len(p)) for p in PROMPTS])
    positions = torch.arange(width).expand(len(PROMPTS), -1)
    last = {"padded": lengths - 1, "two_a_row": torch.stack([lengths // 2, lengths - 1], 1), "final": None}[layout]
    return tokens, positions, torch.arange(len(PROMPTS)), last


def run(model, cache, inputs, greedy: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The forward's output and every layer's keys and values after it, from a zeroed cache."""
    for stored in (*cache.keys, *cache.values):
        stored.zero_()
    tokens, positions, slots, last = inputs
    with torch.inference_mode():
        out = model(tokens, positions, cache, slots, last, greedy=greedy)
    return out, [stored.clone() for stored in (*cache.keys, *cache.values)]


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_bf16)])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_last_layer_runs_at_the_read_positions_alone_with_the_same_outputs(tmp_path, monkeypatch, family, dtype):
    model, cache = open_job(save_tiny_model(FAMILIES[family](), tmp_path / "model"), dtype)
    check_read_positions_alone(model, cache, monkeypatch)


@pytest.mark.parametrize("family", ["llama_tied", "gpt2", "falcon_parallel_attention"])
def test_with_lora_adapters_per_row(tmp_path, monkeypatch, family):
    """Rows running different LoRA adapters (and none): the last layer's projections after attention take each read
    position's own adapter, packed or padded."""
    base = save_tiny_model(FAMILIES[family](), tmp_path / "model")
    adapters = {name: str(make_adapter(base, tmp_path / name, seed=seed)) for name, seed in (("one", 1), ("two", 2))}
    model, cache = open_job(base, "float32", adapters)
    assert model.adapter_bank is not None
    check_read_positions_alone(model, cache, monkeypatch)


def check_read_positions_alone(model, cache, monkeypatch) -> None:
    """Each layout's logits (and greedy picks), and every layer's keys and values, equal to every position computed;
    the last layer hands on the read positions alone."""
    widths = []  # positions a row the last layer handed on, each forward
    model.get_submodule(model.layers_name)[-1].register_forward_hook(lambda _m, _a, out: widths.append(out.shape[1]))
    layouts = ["padded", "two_a_row", "final"] + (["packed"] if model.packs_prompts else [])
    for layout in layouts:
        inputs = prefill_inputs(layout)
        last = inputs[3]
        for greedy in [False] + ([True] if model.fuses_greedy_head() and layout != "two_a_row" else []):
            got, got_cache = run(model, cache, inputs, greedy)
            with monkeypatch.context() as every_position:
                every_position.setattr(model, "positions_read", lambda tokens, last: None)
                want, want_cache = run(model, cache, inputs, greedy)
            assert torch.equal(got, want), (layout, greedy)
            assert all(torch.equal(a, b) for a, b in zip(got_cache, want_cache)), (layout, greedy)
            read = 1 if last is None or last.dim() == 1 else last.shape[1]
            assert widths[-2:] == [read, inputs[0].shape[1]], (layout, widths[-2:])  # read positions, then all
            if not greedy:
                assert got.shape == ((len(PROMPTS), VOCAB) if last is None or last.dim() == 1
                                     else (*last.shape, VOCAB))


def test_a_decode_step_runs_every_position(tmp_path):
    """Nothing to save at one position a row."""
    model, _ = open_job(save_tiny_model(INT8_FAMILIES["llama_tied"](), tmp_path / "model"), "float32")
    tokens = torch.zeros((2, 5), dtype=torch.long)
    assert torch.equal(model.positions_read(tokens, torch.tensor([4, 2])), torch.tensor([[4], [2]]))
    assert torch.equal(model.positions_read(tokens, None), torch.tensor([[4], [4]]))
    assert model.positions_read(tokens[:, :1], None) is None


def test_the_last_layers_context_shares_the_masks_built_for_the_others():
    """The context reading the head's positions is a copy of the one every other layer takes: the additive masks
    built for PyTorch's attention on a GPU (sdpa_mask) are built once for both."""
    from modelzoo.models.kv_cache import KVCache
    from modelzoo.models.layers import ForwardContext

    cache = KVCache(1, 2, 1, 8, 4, torch.float32, torch.device("cpu"))
    ctx = ForwardContext.build(cache, None, torch.arange(5).expand(2, -1))
    reading = ctx.reading(torch.tensor([[4], [2]]))
    assert reading.additive_masks is ctx.additive_masks and reading.mask is ctx.mask
    assert torch.equal(reading.read, torch.tensor([[4], [2]])) and ctx.read is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_benchmarks_workload_counts_the_linears_that_ran_on_one_row(tmp_path, family):
    """benchmarks/machine.py's model_shapes names as read alone (one row a prompt in prefill) exactly the linears
    of the last layer that a prefill forward runs on the read positions, and counts the same weights in its linears
    as transformers' model of the checkpoint has in its own (fused or not, Conv1D or Linear), head aside."""
    from collections import Counter

    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    from modelzoo.cpu.precision import linear_like, linear_shape
    from modelzoo.models.checkpoint import load_model
    from modelzoo.models.kv_cache import KVCache
    from repo_scripts import load_script

    checkpoint = save_tiny_model(FAMILIES[family](), tmp_path / "model")
    model, _ = load_model(checkpoint, torch.float32, torch.device("cpu"))
    c = model.config
    cache = KVCache(c.num_layers, len(PROMPTS), c.num_kv_heads, 64, c.head_dim, torch.float32, torch.device("cpu"))
    rows = {}  # each last-layer linear -> the rows it multiplied

    def record(linear: torch.nn.Module, args: tuple, _out: torch.Tensor) -> None:
        rows[linear] = args[0].reshape(-1, linear_shape(linear)[0]).shape[0]

    for module in model.get_submodule(model.layers_name)[-1].modules():
        if linear_like(module):
            module.register_forward_hook(record)
    tokens, positions, slots, last = prefill_inputs("padded")
    with torch.inference_mode():
        model(tokens, positions, cache, slots, last)
    one_row_a_prompt = Counter(linear_shape(linear) for linear, n in rows.items() if n == len(PROMPTS))
    assert rows and all(n in (len(PROMPTS), tokens.numel()) for n in rows.values())
    shapes = load_script("benchmarks/machine.py").model_shapes(str(checkpoint))
    assert shapes.read_alone == one_row_a_prompt

    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    head = reference.get_output_embeddings()
    hf_weights = sum(m.weight.numel() for m in reference.modules()
                     if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head)
    assert sum(count * i * o for (i, o), count in shapes.body.items()) == hf_weights
    assert shapes.head == (head.in_features, head.out_features)
