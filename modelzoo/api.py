"""zoo-infer as a Python library: load a checkpoint once, then generate from prompts and score continuations.

    from modelzoo.api import ZooModel

    model = ZooModel("models/smollm2-135m-instruct", dtype="float32")
    answers = model.generate(["What is 2 + 2?"], model.default_options(max_tokens=32), chat_template=True)
    print(answers[0].text, answers[0].finish_reason)
    scores = model.score([("The capital of France is", " Paris"), ("The capital of France is", " Rome")])
    print([s.total for s in scores], [s.is_greedy for s in scores])

Everything a job does holds here: the same engine (rows in flight, in-flight refill, shared prefixes, prompts
repeated for n samples prefilled once), the GEMM path measured for this machine, the same token choice, stop
rules and response formats. Lists of any size; results in input order.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from modelzoo.generation.engine import Request
from modelzoo.generation.options import GenerationOptions
from modelzoo.generation.pairs import split_pair
from modelzoo.generation.scoring import Score, ScoreRequest
from modelzoo.runtime import Runtime, RuntimePlan
from modelzoo.runtime_spec import RuntimeSpec

Prompt = str | Sequence[int]  # text, or token ids


@dataclass
class Generated:
    """One prompt's completion: its text (special tokens left out), token ids, why it ended (`stop_sequence`,
    `max_tokens`, `max_seq_len`) and, where asked, each token's log-probability."""

    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[float] | None = None


class ZooModel:
    """A checkpoint loaded once for generation and scoring.

    checkpoint: a Hugging Face folder; dtype: auto, float32, bfloat16, float16; device: auto, cpu, cuda;
    max_seq_len: the longest prompt + completion (or context + continuation) a row may hold; rows_in_flight:
    rows run together (auto: as the job's `runconfig.rows_in_flight` sizes them); num_threads: CPU threads
    (default: every core available); adapter: a PEFT LoRA adapter folder of the checkpoint, merged into the
    weights as they load (checked as a job checks `model.adapter`); weight_cache: a folder where the model laid out
    for the CPU's GEMMs is saved once and mapped by later loads (as a job's `runconfig.weight_cache`).
    """

    def __init__(self, checkpoint: str | Path, dtype: str = "auto", device: str = "auto", max_seq_len: int = 2048,
                 rows_in_flight: int | str = "auto", num_threads: int | None = None,
                 adapter: str | Path | None = None, weight_cache: str | Path | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.checkpoint = str(checkpoint)
        self.tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
        adapters = {Path(adapter).name: str(adapter)} if adapter else {}
        spec = RuntimeSpec(self.checkpoint, dtype=dtype, device=device, max_seq_len=max_seq_len,
                           rows_in_flight=rows_in_flight, num_threads=num_threads, adapters=adapters,
                           adapter=Path(adapter).name if adapter else None,
                           weight_cache=str(weight_cache) if weight_cache else None)
        rows = rows_in_flight if rows_in_flight != "auto" else 1 << 30  # auto: as many as memory holds, capped
        self.runtime = Runtime(RuntimePlan.of(spec), rows_to_do=rows)
        self.model, self.device, self.max_seq_len = self.runtime.model, self.runtime.device, max_seq_len
        self.eos_token_id = self.tokenizer.eos_token_id

    @property
    def rows_in_flight(self) -> int:
        return self.runtime.rows_in_flight

    # ---- generation ---------------------------------------------------------------------------------------------

    def default_options(self, max_tokens: int | None = None) -> GenerationOptions:
        """Greedy, stopping at the tokenizer's EOS, at most `max_tokens` tokens."""
        stops = ((self.eos_token_id,),) if self.eos_token_id is not None else ()
        return GenerationOptions(max_tokens=max_tokens, stop_sequences=stops)

    def encode(self, prompt: Prompt, chat_template: bool = False) -> np.ndarray:
        """A prompt's token ids: ids as given; text through the chat template (as one user turn) or encoded with the
        tokenizer's special tokens."""
        if not isinstance(prompt, str):
            return np.asarray(prompt, dtype=np.int64)
        if chat_template:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True, tokenize=False)
        return np.asarray(self.tokenizer(prompt, add_special_tokens=not chat_template)["input_ids"], dtype=np.int64)

    def generate(self, prompts: Sequence[Prompt], options: GenerationOptions | Sequence[GenerationOptions] | None = None,
                 chat_template: bool = False, progress: bool = False) -> list[Generated]:
        """Completes every prompt, in input order. options: one for all (default: `default_options()`), or one per
        prompt (their sampling, stops and limits may differ row by row; the others must be the first's). A prompt
        whose options ask n > 1 gives n completions in a row, each drawn from its own stream: the rows a job writes
        for it (`create_inference_h5.py --n`), prefilled once."""
        per_prompt = list(options) if isinstance(options, (list, tuple)) else [options or self.default_options()] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} options for {len(prompts)} prompts")
        engine = self.runtime.engine_for(per_prompt) if per_prompt else self.runtime.engine
        rows = sum(o.n for o in per_prompt)
        first_rows = np.cumsum([0] + [o.n for o in per_prompt])  # each prompt's first row: a sample index, as in a job
        requests = (Request(int(first) + sample, ids, o) for first, p, o in zip(first_rows, prompts, per_prompt)
                    for ids in [self.encode(p, chat_template)] for sample in range(o.n))
        out: dict[int, Generated] = {}
        with _progress(rows, progress, "generating") as bar:
            for completion in engine.generate(requests):
                ids = completion.tokens.tolist()
                out[completion.index] = Generated(self.tokenizer.decode(ids, skip_special_tokens=True), ids,
                                                  completion.reason,
                                                  None if completion.logprobs is None else completion.logprobs.tolist())
                bar.update(1)
        return [out[i] for i in range(rows)]

    # ---- scoring ------------------------------------------------------------------------------------------------

    def encode_pair(self, context: Prompt, continuation: Prompt) -> tuple[np.ndarray, np.ndarray]:
        """(context ids, continuation ids). Text pairs are split as lm-evaluation-harness splits them (trailing spaces of
        the context move to the continuation; an empty context is BOS, else EOS: modelzoo/generation/pairs.py), as the
        job's data tool does, so the continuation's tokens are those the model would read after the context."""
        if not isinstance(context, str) or not isinstance(continuation, str):
            ids = [self.encode(part) if isinstance(part, str) else np.asarray(part, dtype=np.int64)
                   for part in (context, continuation)]
            return ids[0], ids[1]
        head, tail = split_pair(self.tokenizer, context, continuation)
        return np.asarray(head, dtype=np.int64), np.asarray(tail, dtype=np.int64)

    def score(self, pairs: Sequence[tuple[Prompt, Prompt]], progress: bool = False) -> list[Score]:
        """Teacher-forced log-probabilities of each continuation after its context, in input order (`Score`: per
        token log-probabilities and argmax flags, `total`, `is_greedy`)."""
        return self.score_tokens([self.encode_pair(c, x) for c, x in pairs], progress)

    def score_tokens(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], progress: bool = False) -> list[Score]:
        """`score` of token-id pairs. Pairs sharing a context are run next to each other, so it is prefilled once."""
        requests = [ScoreRequest(i, np.asarray(c, dtype=np.int64), np.asarray(x, dtype=np.int64))
                    for i, (c, x) in enumerate(pairs)]
        # The choices of a question together, contexts beginning alike next to each other, the longest continuations
        # of a context first (rounds of rows alike in width).
        order = sorted(requests, key=lambda r: (r.context.tobytes(), -len(r.continuation), r.index))
        scorer = self.runtime.scorer()
        out: dict[int, Score] = {}
        with _progress(len(requests), progress, "scoring") as bar:
            for score in scorer.score(order):
                out[score.index] = score
                bar.update(1)
        return [out[i] for i in range(len(requests))]


def _progress(total: int, show: bool, what: str) -> Any:
    """A tqdm bar when `show`, else a stand-in that counts nothing."""
    from tqdm import tqdm

    return tqdm(total=total, desc=what, disable=not show)
