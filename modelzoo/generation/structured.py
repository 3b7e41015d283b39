"""Structured output: rows decoded under a JSON grammar, with xgrammar (the grammar engine of vLLM, SGLang and
TensorRT-LLM).

A row's response format is canonical JSON text (`formats.canonical_format`): `{"type": "json_object"}` (any JSON object)
or `{"type": "json_schema", "schema": {...}}`. Each distinct format is compiled once per job. A constrained row
owns a grammar matcher; before each token the matchers of the step's constrained rows fill their rows of one
token bitmask together (xgrammar's batch matcher, on its threads), the bitmask is copied to the device once, and
the decode step applies it to the logits in one op (`apply_token_bitmask`), before penalties and sampling, so
a row only ever picks a token that keeps its output a prefix of a valid document. Unconstrained rows keep an
all-ones bitmask row. Once a row's document is complete, its grammar allows only the stop tokens (the job's
one-token stop sequences), which end the row.
"""
from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

import torch

from modelzoo.errors import UserError
from modelzoo.generation.formats import JSON_OBJECT, FormatError

log = logging.getLogger("zoo-infer")

_LOG_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " before its message


def xgrammar_module() -> Any:
    """xgrammar, imported on first use (the project's set-up installs it)."""
    try:
        import xgrammar
    except ImportError as error:
        raise FormatError(f"structured output needs the xgrammar package ({error}); install it with "
                          "`pip install --no-deps xgrammar apache-tvm-ffi`") from None
    return xgrammar


class FormatCompiler:
    """Compiles response formats for one tokenizer, each distinct one once (compact JSON: no free whitespace,
    so a small model cannot loop on blank lines inside a document)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = xgrammar_module()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info)
        self.compiled: dict[str, Any] = {}

    def compile(self, text: str) -> Any:
        """The compiled grammar of a canonical response format (FormatError when it cannot be compiled)."""
        if text not in self.compiled:
            spec = json.loads(text)
            try:
                if spec["type"] == JSON_OBJECT:
                    grammar = self.compiler.compile_builtin_json_grammar()
                else:
                    grammar = self.compiler.compile_json_schema(json.dumps(spec["schema"]), any_whitespace=False)
            except RuntimeError as error:
                message = _LOG_PREFIX.sub("", str(error).strip().splitlines()[0] if str(error).strip() else "")
                raise FormatError(f"the JSON schema cannot be compiled: {message or type(error).__name__}") from None
            self.compiled[text] = grammar
        return self.compiled[text]


def compile_formats(checkpoint: str, vocab_size: int, stop_sequences: tuple[tuple[int, ...], ...],
                    formats: list[str]) -> FormatCompiler:
    """The grammar compiler of the checkpoint's tokenizer with every response format compiled; a UserError line for
    the first that cannot be, or for a job that cannot end a row once its document is complete (no one-token stop
    sequence)."""
    stop_ids = [seq[0] for seq in stop_sequences if len(seq) == 1]
    if not stop_ids:
        raise UserError("rows that follow a response format need a one-token stop sequence (the EOS, e.g. "
                        "model.stop_sequences: [[2]]) to end once their JSON is complete")
    start = time.perf_counter()
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    except (OSError, ValueError) as error:
        raise UserError(f"rows that follow a response format need the checkpoint's tokenizer, which "
                        f"{checkpoint} lacks ({str(error).splitlines()[0][:120]})") from None
    try:
        compiler = FormatCompiler(tokenizer, vocab_size, stop_ids)
    except FormatError as error:
        raise UserError(str(error)) from None
    for text in formats:
        try:
            compiler.compile(text)
        except FormatError as error:
            raise UserError(f"response format {text[:120]}: {error}") from None
    log.info("structured output: %d response format(s) compiled in %.1fs (xgrammar); a row's document ends on "
             "stop token(s) %s", len(formats), time.perf_counter() - start, stop_ids)
    return compiler


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits (R, V) with -inf wherever bit v of row r of `bitmask` (R, ceil(V / 32)) int32 is 0 (xgrammar's
    layout: token v is bit v % 32 of word v // 32). Shape-static and sync-free, so it compiles and captures."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, : logits.shape[-1]]  # (R, V)
    return logits.masked_fill(~allowed, -float("inf"))


class StructuredRows:
    """The grammar state of every slot: a matcher per constrained slot and the device bitmask (S, W) int32 the
    decode step applies (all ones for slots without a format)."""

    def __init__(self, compiler: FormatCompiler, num_slots: int, vocab_size: int, device: torch.device) -> None:
        xgr = xgrammar_module()
        self.xgr, self.compiler = xgr, compiler
        self.batch_matcher = xgr.BatchGrammarMatcher()
        self.host_mask = xgr.allocate_token_bitmask(num_slots, vocab_size)  # (S, W) int32, all ones
        self.all_allowed = self.host_mask[0].clone()
        self.mask = self.host_mask.to(device)  # its fixed device copy
        self.matchers: dict[int, Any] = {}  # slot -> matcher of its row's format
        self.rejected = 0  # tokens a matcher refused (none expected: the mask allows only what it accepts)

    def admit(self, slots: list[int], formats: list[str | None]) -> None:
        """New rows in `slots`, each under its format (None: unconstrained); fills their bitmask rows."""
        for slot, text in zip(slots, formats):
            self.matchers.pop(slot, None)
            if text is not None:
                self.matchers[slot] = self.xgr.GrammarMatcher(self.compiler.compile(text))
            else:
                self.host_mask[slot] = self.all_allowed
        self._fill([slot for slot in slots if slot in self.matchers])

    def release(self, slot: int) -> None:
        """The slot's row ended: it becomes unconstrained."""
        if self.matchers.pop(slot, None) is not None:
            self.host_mask[slot] = self.all_allowed
            self.mask[slot] = self.all_allowed.to(self.mask.device)

    def advance(self, last_token: torch.Tensor, slots: list[int] | None = None) -> None:
        """Feeds the newest token (`last_token` (S,), one read of the device) of each constrained slot among `slots`
        (None: every constrained slot) to its matcher and fills its next bitmask row."""
        slots = [slot for slot in (self.matchers if slots is None else slots) if slot in self.matchers]
        if not slots:
            return
        tokens = last_token[slots].tolist()
        for slot, token in zip(slots, tokens):
            if not self.matchers[slot].accept_token(token):
                self.rejected += 1
                log.warning("the grammar of slot %d refused token %d; the row goes on unconstrained", slot, token)
                self.release(slot)
        self._fill([slot for slot in slots if slot in self.matchers and not self.matchers[slot].is_terminated()])

    def _fill(self, slots: list[int]) -> None:
        """Fills the bitmask rows of `slots` on xgrammar's threads and copies them to the device."""
        if not slots:
            return
        self.batch_matcher.batch_fill_next_token_bitmask([self.matchers[s] for s in slots], self.host_mask, slots)
        index = torch.tensor(slots)
        self.mask[index.to(self.mask.device)] = self.host_mask[index].to(self.mask.device)
