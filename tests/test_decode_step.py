"""The fixed-shape decode step (modelzoo/generation/step.py): compiled whole, never recompiled, no host sync,
state at fixed addresses, and the same tokens as the eager step."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

from harness import save_tiny_model
from modelzoo.models.checkpoint import load_model
from modelzoo.generation.engine import GenerationEngine, PromptSpan, Request
from modelzoo.generation.options import GenerationOptions
from modelzoo.generation.step import LENGTH_BUCKET, length_bucket, length_buckets, reachable_buckets
from tiny_configs import VOCAB, tiny_llama_config

SLOTS, MAX_SEQ_LEN, MAX_TOKENS = 4, 96, 8
JOB = GenerationOptions(max_tokens=MAX_TOKENS, stop_sequences=((7, 8),))
NUM_PROMPTS = 64  # 64 rows of 2-8 tokens in 4 slots: 80-odd steps, rows finishing and joining all along
# Ops that read a tensor's value on the host, or give a shape that depends on values.
HOST_SYNC_OPS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten._assert_async",
                 "aten.unique")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> Path:
    """A tiny Llama with positions for 512 tokens: rows that cross length buckets."""
    return save_tiny_model(tiny_llama_config(max_position_embeddings=512), tmp_path_factory.mktemp("long_llama"))


def requests(job: GenerationOptions = JOB) -> list[Request]:
    """Prompts of 1-20 tokens; a stop sequence and each row's own max_tokens end rows at different steps."""
    rng = np.random.default_rng(5)
    return [Request(i, rng.integers(3, VOCAB, size=int(rng.integers(1, 21))),
                    job.overridden(max_tokens=int(rng.integers(2, 9)))) for i in range(NUM_PROMPTS)]


def engine_for(path: Path, options: GenerationOptions = JOB) -> GenerationEngine:
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    return GenerationEngine(model, SLOTS, MAX_SEQ_LEN, torch.device("cpu"), torch.float32, options)


def outputs(engine: GenerationEngine) -> dict[int, tuple]:
    """index -> (tokens, reason, logprobs, top ids, top logprobs), None where not kept."""
    def listed(array: np.ndarray | None) -> list | None:
        return None if array is None else array.tolist()

    return {c.index: (c.tokens.tolist(), c.reason, listed(c.logprobs), listed(c.top_ids), listed(c.top_logprobs))
            for c in engine.generate(requests(engine.defaults))}


def buffer_addresses(engine: GenerationEngine) -> list[int]:
    """data_ptr of everything the step reads or writes: cache, slot state, stop state."""
    state, stops = engine.state, engine.stops
    tensors = [*engine.cache.keys, *engine.cache.values, state.sequences, state.seq_len, state.prompt_len,
               state.last_token, state.sample_index, state.active, state.reason, stops.history, stops.limit,
               stops.enabled, state.sampling.temperature, state.sampling.top_p_cut, state.sampling.seed_key]
    kept = [t for t in (state.logprobs, state.top_ids, state.top_values) if t is not None]
    return [t.data_ptr() for t in tensors + kept]


class GraphRecorder:
    """A torch.compile backend that keeps every forward graph AOT autograd hands it (functionalized ATen ops,
    where an `.item()` or a data-dependent shape would show) and runs it as it is."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.backend = aot_autograd(fw_compiler=self.record)

    def record(self, graph: torch.fx.GraphModule, example_inputs) -> object:
        self.graphs.append(graph)
        return graph.forward

    def targets(self) -> set[str]:
        return {str(node.target) for graph in self.graphs for node in graph.graph.nodes if node.op == "call_function"}

    def unbacked_symbols(self) -> list[str]:
        """Symbols the graphs would have to read from the device (u0, u1, ...)."""
        found = []
        for graph in self.graphs:
            for node in graph.graph.nodes:
                value = node.meta.get("val")
                shapes = value.shape if isinstance(value, torch.Tensor) else ()
                found += [str(d) for d in shapes if isinstance(d, torch.SymInt) and str(d).startswith("u")]
        return found


def masked(engine: GenerationEngine, mask: torch.Tensor | None) -> GenerationEngine:
    """The engine with its decode step under a fixed token bitmask (S, ceil(V / 32)), as structured output sets."""
    engine.decode.token_mask = mask
    return engine


@pytest.mark.parametrize("options", ["greedy", "sampled_logprobs", "token_mask"])
def test_compiled_step_runs_without_break_recompile_or_sync(tiny_llama, options):
    """Compiled with fullgraph=True, dynamic=False and warmed up, the step runs 64+ steps with rows stopping
    and joining under fail_on_recompile; its buffers keep their addresses; its graph holds no host sync; the
    tokens and reasons equal the eager step's, the log-probabilities to float32 rounding. Under a token mask
    (structured output's) every decoded token is one the mask allows."""
    job, mask = JOB, None
    if options == "sampled_logprobs":
        job = JOB.overridden(temperature=0.8, top_k=20, top_p=0.9, seed=3, repetition_penalty=1.3, logprobs=True,
                             top_logprobs=3)
    if options == "token_mask":  # every slot allows the same random half of the vocabulary, the stop sequence too
        words = -(-VOCAB // 32)
        row = torch.randint(-2 ** 31, 2 ** 31 - 1, (1, words), generator=torch.Generator().manual_seed(2),
                            dtype=torch.int64).to(torch.int32) | ((1 << 7) | (1 << 8))
        mask = row.expand(SLOTS, -1).clone()
    eager = outputs(masked(engine_for(tiny_llama, job), mask))
    if mask is not None:
        allowed = ((row[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()[:VOCAB]
        assert all(bool(allowed[t]) for out in eager.values() for t in out[0][1:])  # after the prefilled first
        assert sum(len(out[0]) for out in eager.values()) > NUM_PROMPTS  # tokens were decoded under the mask

    engine = masked(engine_for(tiny_llama, job), mask)
    recorder = GraphRecorder()
    engine.decode.compile(len(engine.step_shapes()), backend=recorder.backend)
    engine.warm_up()
    assert len(recorder.graphs) == len(engine.step_shapes()) == 1  # one length bucket of 96, every slot
    addresses = buffer_addresses(engine)
    steps = 0
    decode = engine._decode_step

    def counted() -> None:
        nonlocal steps
        steps += 1
        decode()

    engine._decode_step = counted
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled = outputs(engine)
    assert steps >= 64, steps
    assert len(recorder.graphs) == 1  # nothing compiled after the warm-up
    assert buffer_addresses(engine) == addresses
    # Compiled, attention and the small ops are PyTorch's rather than our C++ kernels: log-probabilities agree
    # to float32 rounding, tokens and reasons exactly.
    exact = (0, 1, 3)  # tokens, reasons, top ids
    assert {i: [out[k] for k in exact] for i, out in compiled.items()} == {
        i: [out[k] for k in exact] for i, out in eager.items()}
    assert len(compiled) == NUM_PROMPTS
    if job.logprobs:
        for index, out in compiled.items():
            np.testing.assert_allclose(out[2], eager[index][2], rtol=0, atol=1e-5)
            np.testing.assert_allclose(out[4], eager[index][4], rtol=0, atol=1e-5)
    assert {out[1] for out in compiled.values()} >= {"max_tokens"}
    assert not [t for t in recorder.targets() if t.startswith(HOST_SYNC_OPS)], recorder.targets()
    assert not recorder.unbacked_symbols()


def test_inductor_compiled_step_gives_the_eager_tokens(tiny_llama):
    """The step compiled by inductor (the default backend: fused kernels, no C++ kernels of ours) gives the
    eager step's tokens."""
    eager = outputs(engine_for(tiny_llama))
    engine = engine_for(tiny_llama)
    engine.decode.compile(len(engine.step_shapes()))
    engine.warm_up()
    assert outputs(engine) == eager


def test_idle_step_changes_only_position_zero_of_the_cache(tiny_llama):
    """A step while every slot is idle (what warm_up runs) leaves the slot and stop state as they were."""
    engine = engine_for(tiny_llama)
    state = engine.state
    state.sequences.random_(0, VOCAB)
    state.seq_len.fill_(9)
    state.last_token.fill_(5)
    engine.stops.history.fill_(4)
    before = [t.clone() for t in (state.sequences, state.seq_len, state.last_token, state.reason, state.active,
                                  engine.stops.history)]
    for layer in range(len(engine.cache.keys)):
        engine.cache.keys[layer].fill_(1.5)
    engine.decode.warm_up(engine.step_shapes())
    after = (state.sequences, state.seq_len, state.last_token, state.reason, state.active, engine.stops.history)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    keys = engine.cache.keys[0]
    assert torch.all(keys[:, :, 1:] == 1.5) and not torch.all(keys[:, :, 0] == 1.5)


def test_eager_cpu_step_is_not_warmed_up_but_a_compiled_one_is(tiny_llama):
    """An eager step on the CPU has nothing to warm (a GEMM shape's first call costs about a millisecond more): no
    step runs before generation, and none of the cache is written; a compiled step warms every shape it can take."""
    engine = engine_for(tiny_llama)
    for layer in range(len(engine.cache.keys)):
        engine.cache.keys[layer].fill_(1.5)
    assert engine.warm_up_shapes(None, 0) == []
    engine.warm_up()
    assert all(torch.all(keys == 1.5) for keys in engine.cache.keys)
    compiled = engine_for(tiny_llama)
    compiled.decode.compile(len(compiled.step_shapes()), backend=GraphRecorder().backend)
    assert compiled.warm_up_shapes(None, 0) == compiled.step_shapes()


def test_warm_up_refuses_active_slots(tiny_llama):
    engine = engine_for(tiny_llama)
    engine.state.active[1] = True
    with pytest.raises(RuntimeError, match="idle"):
        engine.decode.warm_up([(None, MAX_SEQ_LEN)])


def test_length_buckets():
    """The longest row rounded up to LENGTH_BUCKET, capped at the cache's length; every bucket listed."""
    assert length_bucket(1, 512) == LENGTH_BUCKET
    assert length_bucket(LENGTH_BUCKET, 512) == LENGTH_BUCKET
    assert length_bucket(LENGTH_BUCKET + 1, 512) == 2 * LENGTH_BUCKET
    assert length_bucket(500, 500) == 500
    assert length_buckets(96) == [96]
    assert length_buckets(512) == [128, 256, 384, 512]
    assert length_buckets(300) == [128, 256, 300]
    assert all(length_bucket(n, 300) in length_buckets(300) for n in range(1, 301))


def test_reachable_buckets():
    """A step of every slot reads the bucket of its longest row: from the longest prompt's (every row in flight from
    the start) or the shortest's (rows refilled as others finish) up to the longest prompt plus what it generates,
    capped at the cache's length."""
    assert reachable_buckets(64, 319, 131, True, 448) == [384, 448]
    assert reachable_buckets(64, 319, 131, False, 448) == [128, 256, 384, 448]
    assert reachable_buckets(5, 9, 3, True, 448) == [128]
    assert reachable_buckets(100, 2000, 10, True, 2048) == [2048]
    assert reachable_buckets(300, 900, 2000, False, 2048) == list(range(384, 2049, LENGTH_BUCKET))
    assert reachable_buckets(1, 1, 0, True, 96) == [96]


class RecordedStep:
    """A decode step that records the (rows, length) of every call (rows -1: every slot), then runs it."""

    def __init__(self, step) -> None:
        self.step, self.taken = step, set()

    def __call__(self, slots: torch.Tensor | None, length: int) -> None:
        self.taken.add((-1 if slots is None else len(slots), length))
        self.step(slots, length)

    def __getattr__(self, name: str):
        return getattr(self.step, name)


@pytest.mark.parametrize("rows, steps_per_read", [(3, 1), (3, 4), (40, 1), (40, 4)])
def test_warm_up_captures_every_bucket_the_rows_reach(long_llama, rows, steps_per_read):
    """Given the rows' prompt span and max_tokens, a captured step's warm-up takes every (rows, length) the job's
    steps then take, rows all in flight at once (3 in 4 slots) or refilled (40), the host reading finished rows every
    step (then exactly those) or every 4 (CUDA's): nothing is left to capture while rows are in flight."""
    model, _ = load_model(long_llama, torch.float32, torch.device("cpu"))
    engine = GenerationEngine(model, SLOTS, 300, torch.device("cpu"), torch.float32, GenerationOptions(max_tokens=40))
    engine.steps_per_read = steps_per_read
    rng = np.random.default_rng(rows)
    lengths = [*rng.integers(60, 200, size=rows - 1), 217]  # the longest row's last reads cross 256 in 4-step reads
    prompts = [rng.integers(3, VOCAB, size=int(n)) for n in rng.permutation(lengths)]
    engine.decode = recorded = RecordedStep(engine.decode)
    recorded.step.mode = "cuda_graph"  # what the warm-up would capture, asked of the CPU's eager step
    span = PromptSpan(min(map(len, prompts)), max(map(len, prompts)), 40, sum(map(len, prompts)))
    warmed = {(-1 if slots is None else len(slots), length) for slots, length in engine.warm_up_shapes(span, rows)}
    recorded.step.mode = "eager"
    assert len(list(engine.generate(Request(i, p) for i, p in enumerate(prompts)))) == rows
    assert recorded.taken <= warmed, (recorded.taken, warmed)
    if rows <= SLOTS and steps_per_read == 1:  # all at once, read every step: the bound is tight
        assert recorded.taken == warmed


def test_capture_needs_cuda(tiny_llama):
    with pytest.raises(ValueError, match="CUDA"):
        engine_for(tiny_llama).decode.capture(1)


def test_more_length_buckets_than_dynamos_recompile_limit(tiny_llama):
    """A long max_seq_len has more length buckets (11 here) than dynamo's default recompile limit (8): every one
    compiles in the warm-up, with fullgraph, and none after."""
    model, _ = load_model(tiny_llama, torch.float32, torch.device("cpu"))  # rows stay within its 128 positions
    engine = GenerationEngine(model, 2, 1300, torch.device("cpu"), torch.float32, GenerationOptions(max_tokens=3))
    recorder = GraphRecorder()
    engine.decode.compile(len(engine.step_shapes()), backend=recorder.backend)
    engine.warm_up()
    assert len(recorder.graphs) == len(engine.step_shapes()) == 11
    with torch.compiler.set_stance("fail_on_recompile"):
        done = list(engine.generate([Request(0, np.arange(3, 9)), Request(1, np.arange(4, 7))]))
    assert len(done) == 2 and len(recorder.graphs) == 11


def test_symbolic_length_compiles_one_graph_for_every_bucket(tmp_path):
    """Compiled with the cache length symbolic (what CUDA graphs are captured from), one graph serves every length
    bucket (128, 256 and 304 here, rows crossing them in flight) and the tokens are the eager step's; a second engine
    over another model in the same process compiles its own graph, its head counts unaffected."""
    checkpoint = save_tiny_model(tiny_llama_config(max_position_embeddings=512), tmp_path / "long")
    other = save_tiny_model(tiny_llama_config(num_attention_heads=2, num_key_value_heads=2,
                                              max_position_embeddings=512), tmp_path / "mha")
    prompts = [Request(i, np.random.default_rng(i).integers(3, VOCAB, size=n)) for i, n in enumerate((120, 250, 5))]

    def run(path: Path, recorder: GraphRecorder | None, max_seq_len: int) -> dict[int, list[int]]:
        model, _ = load_model(path, torch.float32, torch.device("cpu"))
        engine = GenerationEngine(model, 2, max_seq_len, torch.device("cpu"), torch.float32,
                                  GenerationOptions(max_tokens=40))
        assert [length for _, length in engine.step_shapes()] == length_buckets(engine.read_limit)
        if recorder is not None:
            engine.decode.compile(len(engine.step_shapes()), backend=recorder.backend, symbolic_length=True)
        engine.warm_up()
        return {c.index: c.tokens.tolist() for c in engine.generate(prompts)}

    first, second = GraphRecorder(), GraphRecorder()
    assert run(checkpoint, first, 300) == run(checkpoint, None, 300)
    assert len(first.graphs) == 1
    assert run(other, second, 300) == run(other, None, 300)
    assert len(second.graphs) == 1 and len(first.graphs) == 1


def test_cache_lengths_are_aligned_and_never_read_whole(tiny_llama):
    """The cache stores max_seq_len rounded up to a multiple of 8, plus 8 positions no step reads: every length
    bucket is a multiple of 8 and shorter than the cache."""
    model, _ = load_model(tiny_llama, torch.float32, torch.device("cpu"))
    engine = GenerationEngine(model, 2, 99, torch.device("cpu"), torch.float32, GenerationOptions(max_tokens=3))
    assert engine.cache.max_len == 99 and engine.cache.keys[0].shape[2] == 112
    assert engine.read_limit == 104
    assert [length for _, length in engine.step_shapes()] == [104]


@pytest.mark.parametrize("kv_heads", [2, 8], ids=["grouped", "a_kv_head_each"])
@pytest.mark.parametrize("bias", [False, True], ids=["bool_mask", "additive_bias"])
def test_grouped_query_attention_equals_expanded_heads(bias, kv_heads):
    """Decode attention over grouped queries equals attention with K/V expanded to every query head; over a cache
    slice (strided keys, as a step reads them) and in bfloat16 too."""
    from modelzoo.models.layers import grouped_query_attention

    torch.manual_seed(0)
    batch, heads, length, head_dim = 5, 8, 37, 16
    q = torch.randn(batch, heads, 1, head_dim)
    keys, values = torch.randn(2, batch, kv_heads, length + 11, head_dim)[:, :, :, :length]  # a cache's first L
    lengths = torch.tensor([1, 9, 37, 20, 3])
    mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, L)
    if bias:
        mask = torch.randn(batch, heads, 1, length).masked_fill(~mask, float("-inf"))  # (B, heads, 1, L)
    expanded = [t.repeat_interleave(heads // kv_heads, dim=1) for t in (keys, values)]
    want = torch.nn.functional.scaled_dot_product_attention(q, *expanded, attn_mask=mask, scale=0.3)[:, :, 0]
    got = grouped_query_attention(q, keys, values, mask, 0.3)
    half = grouped_query_attention(q.bfloat16(), keys.bfloat16(), values.bfloat16(),
                                   mask if mask.dtype == torch.bool else mask.bfloat16(), 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), want, rtol=0, atol=3e-2)


def test_compiled_code_is_cached_beside_the_kernels(tmp_path, tiny_llama):
    """A compiled job keeps inductor's code in the kernel root's machine folder (where TORCHINDUCTOR_CACHE_DIR
    is unset), so the next job on this machine type finds it: a process of its own, as torch fixes the folder
    the first time it is asked."""
    import os
    import subprocess
    import sys

    from harness import REPO_ROOT, prompt_rows, write_h5, write_params

    write_h5(tmp_path / "data", prompt_rows([[5, 6, 7], [8, 9]], 24, VOCAB))
    params = write_params(tmp_path / "params.yaml", tiny_llama, tmp_path / "data", batch_size=2, start_token=VOCAB,
                          max_tokens=3, decode_step="compiled")
    env = {key: value for key, value in os.environ.items() if key != "TORCHINDUCTOR_CACHE_DIR"}
    env["ZOO_INFER_KERNEL_DIR"] = str(tmp_path / "kernels")
    done = subprocess.run([sys.executable, str(REPO_ROOT / "run_inference.py"), "--params", str(params),
                           "--model_dir", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    [machine] = list((tmp_path / "kernels").iterdir())
    assert any((machine / "inductor").rglob("*.py")), sorted(p.name for p in machine.iterdir())
