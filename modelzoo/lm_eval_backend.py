"""zoo-infer as a model of EleutherAI's lm-evaluation-harness: `--model zoo-infer`.

    zoo-lm-eval --model zoo-infer --model_args pretrained=models/smollm2-135m-instruct,dtype=float32 \\
        --tasks hellaswag --batch_size auto --output_path results/

or, in Python, `lm_eval.simple_evaluate(model=ZooInferLM(pretrained=...), tasks=[...])` (importing this module
registers the name `zoo-infer` too). lm-eval has no plugin discovery: `zoo-lm-eval` is lm-eval's own command
line with this model registered first.

The three request types run on the engine, each type's requests handed over at once: `loglikelihood` as
teacher-forced scoring (the choices of a question share their context's prefill), `loglikelihood_rolling` as
lm-eval's disjoint rolling windows of the model's length scored the same way, and `generate_until` as
generation (greedy unless the request samples), cut at its `until` strings as lm-eval's Hugging Face backend
cuts. Tokenisation is lm-eval's (TemplateLM: trailing spaces of a context move to its continuation, an empty
context takes the prefix token); a context too long for the window is left-truncated, as lm-eval's backends do,
and counted (`truncated_contexts`, logged at the end of each call). Model arguments: pretrained, dtype, device,
max_length (the window: default the model's positions, at most 2048), max_gen_toks (256), add_bos_token,
num_threads, peft (a PEFT LoRA adapter folder, merged into the weights at load, as with lm-eval's `hf`
backend's peft); `--batch_size` caps the rows run together (auto: as many as memory holds).
"""
from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any

import torch
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from modelzoo.api import ZooModel
from modelzoo.models.checkpoint import load_hf_config
from modelzoo.generation.options import PER_ROW_OPTIONS, GenerationOptions

log = logging.getLogger("zoo-infer")

DEFAULT_MAX_LENGTH = 2048


@register_model("zoo-infer", "zoo_infer")
class ZooInferLM(TemplateLM):
    """lm-eval's model interface over a `ZooModel`."""

    def __init__(self, pretrained: str, dtype: str = "auto", device: str = "cpu", batch_size: int | str = "auto",
                 max_length: int | None = None, max_gen_toks: int = 256, add_bos_token: bool | None = None,
                 num_threads: int | None = None, peft: str | None = None, **_: Any) -> None:
        super().__init__()
        positions = getattr(load_hf_config(pretrained), "max_position_embeddings", None) or DEFAULT_MAX_LENGTH
        self.max_length = int(max_length or min(positions, DEFAULT_MAX_LENGTH))
        self.max_gen_toks = int(max_gen_toks)
        rows = "auto" if batch_size in (None, "auto") or str(batch_size).startswith("auto") else int(batch_size)
        self.zoo = ZooModel(pretrained, dtype=dtype, device=_device(device), max_seq_len=self.max_length, rows_in_flight=rows,
                            num_threads=int(num_threads) if num_threads else None, adapter=peft or None)
        self.tokenizer = self.zoo.tokenizer
        self.add_bos_token = add_bos_token if add_bos_token is None else str(add_bos_token).lower() in ("true", "1")
        self.truncated_contexts = 0  # contexts left-truncated to fit the window, over this model's life

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: BOS where the tokenizer has one, else EOS (lm-eval's hf backend)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_batch_size(self) -> int:
        return self.zoo.rows_in_flight

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_: Any) -> list[int]:
        """lm-eval's hf backend's encoding: special tokens as asked, else as add_bos_token says, else the tokenizer's
        default; never a second BOS before a string that starts with one."""
        kwargs = {}
        if add_special_tokens is not None or self.add_bos_token is not None:
            kwargs["add_special_tokens"] = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            kwargs["add_special_tokens"] = False
        return self.tokenizer.encode(string, **kwargs)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ---- loglikelihood ------------------------------------------------------------------------------------------

    def _window(self, key: Any, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """The pair cut to the window as lm-eval's causal backends cut it: the last max_length + 1 tokens (the last
        one is never fed), the continuation whole."""
        if len(continuation) > self.max_length:
            raise ValueError(f"request {key!r}: its continuation of {len(continuation)} tokens is longer than the "
                             f"model's window of {self.max_length} (max_length)")
        whole = (list(context) + list(continuation))[-(self.max_length + 1):]
        if len(whole) < len(context) + len(continuation):
            self.truncated_contexts += 1
        return whole[: len(whole) - len(continuation)], list(continuation)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **_: Any) -> list[tuple[float, bool]]:
        """Every (key, context ids, continuation ids) scored at once: (log-likelihood, is_greedy) each."""
        for key, _context, continuation in requests:
            if not continuation:
                raise ValueError(f"request {key!r}: empty continuation: nothing to score")
        before = self.truncated_contexts
        pairs = [self._window(key, context, continuation) for key, context, continuation in requests]
        scores = self.zoo.score_tokens(pairs, progress=not disable_tqdm)
        results = []
        for (key, _, _), score in zip(requests, scores):
            answer = (score.total, score.is_greedy)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            results.append(answer)
        self._log_truncated(before)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over lm-eval's disjoint rolling windows of max_length tokens."""
        windows: list[tuple[None, list[int], list[int]]] = []
        counts = []
        for (text,) in (request.args for request in requests):
            made = [utils.make_disjoint_window(window) for window in utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            windows += [(None, context, continuation) for context, continuation in made]
            counts.append(len(made))
        scored = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals, start = [], 0
        for request, count in zip(requests, counts):
            total = sum(value for value, _ in scored[start: start + count])
            start += count
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            totals.append(total)
        return totals

    # ---- generation ---------------------------------------------------------------------------------------------

    def _options(self, gen_kwargs: dict[str, Any]) -> tuple[GenerationOptions, list[str]]:
        """A request's generation kwargs as GenerationOptions, and its `until` strings (EOS's text added)."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id], False))
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        if max_gen_toks >= self.max_length:
            raise ValueError(f"max_gen_toks {max_gen_toks} leaves no room for a context in the window of "
                             f"{self.max_length} tokens (max_length)")
        sampled = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 0.0) or 0.0) > 0
        options = GenerationOptions(
            max_tokens=max_gen_toks, stop_sequences=self._stop_ids(until),
            temperature=float(kwargs.get("temperature", 1.0)) if sampled else 0.0,
            top_p=float(kwargs.get("top_p") or 1.0) if sampled else 1.0,
            top_k=int(kwargs.get("top_k") or 0) if sampled else 0, seed=int(kwargs.get("seed") or 0))
        return options, until

    def _stop_ids(self, until: list[str]) -> tuple[tuple[int, ...], ...]:
        """EOS, and each `until` string whose token ids decode back to it: a row ends as soon as it writes them (the
        text is cut at the first `until` string anyway, as lm-eval's hf backend cuts it)."""
        stops = [(self.eot_token_id,)]
        for text in until:
            ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
            if ids and self.tokenizer.decode(ids) == text:
                stops.append(tuple(ids))
        return tuple(dict.fromkeys(stops))

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Every request's continuation, up to its `until` strings or max_gen_toks. Each request carries its own
        options (stops, max_gen_toks, sampling), so the requests run on one engine together, whatever their
        generation kwargs; only an option of the whole engine (a top_k) splits them."""
        results: list[str | None] = [None] * len(requests)
        options, untils, prompts = [], [], []
        for request in requests:
            option, until = self._options(request.args[1])
            room = self.max_length - option.max_tokens
            ids = self.tok_encode(request.args[0])
            if len(ids) > room:
                self.truncated_contexts += 1
            options.append(option)
            untils.append(until)
            prompts.append(ids[-room:])
        groups: dict[tuple, list[int]] = {}  # by the options of a whole engine (PER_ROW_OPTIONS are each row's)
        for index, option in enumerate(options):
            engine_wide = tuple(getattr(option, f.name) for f in fields(option) if f.name not in PER_ROW_OPTIONS)
            groups.setdefault(engine_wide, []).append(index)
        for indices in groups.values():
            generated = self.zoo.generate([prompts[i] for i in indices], [options[i] for i in indices],
                                          progress=not disable_tqdm)
            for index, answer in zip(indices, generated):
                text = postprocess_generated_text(self.tok_decode(answer.token_ids), untils[index], None)
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
                results[index] = text
        return results

    def _log_truncated(self, before: int) -> None:
        if self.truncated_contexts > before:
            log.warning("%d context(s) longer than the window of %d tokens were left-truncated (%d so far)",
                        self.truncated_contexts - before, self.max_length, self.truncated_contexts)


def _device(name: str | None) -> str:
    """lm-eval's device argument as zoo-infer's: `cuda:N` is CUDA (the rank's device is picked as in a job); CUDA
    where there is none (lm-eval's command line asks for cuda:0 unless told) is the CPU, with a warning, as lm-eval's
    hf backend does."""
    kind = (name or "auto").split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        log.warning("device %s asked for but no CUDA device is available: running on the CPU", name)
        return "cpu"
    return kind  # anything else: the params check names it


def main() -> None:
    """`zoo-lm-eval`: lm-eval's command line with the `zoo-infer` model registered."""
    import lm_eval.models  # noqa: F401  (lm-eval's own models, registered on import)
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
