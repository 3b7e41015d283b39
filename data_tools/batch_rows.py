"""An OpenAI batch file's requests as rows of the .h5 (modelzoo/job/rows.py): their prompts, token ids and per-row
datasets, the `requests` table decode_predictions.py answers from, and the requests that cannot run."""
from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from data_tools.openai_batch import SAMPLING_KEYS, BatchRequest, prompt_text, read_batch_file, stop_token_ids
from data_tools.prompts import PromptFile, read_text
from modelzoo.generation.options import MAX_TOP_LOGPROBS, OPENAI_KEYS, GenerationOptions
from modelzoo.generation.formats import FormatError
from modelzoo.generation.structured import FormatCompiler
from modelzoo.job.params import load_params
from modelzoo.job.rows import ROW_DATASETS, column, repeat_rows, repeated_for_samples
from modelzoo.models.lora import base_names


def openai_rows(args: argparse.Namespace, tokenizer: Any) -> tuple[PromptFile, list[list[int]], dict[str, Any],
                                                                 list[str], list[BatchRequest], dict[str, Any]]:
    """An OpenAI batch file's runnable requests as prompts with ids, their token ids, their per-row datasets
    (max_tokens, 0 = none; stop_sequences, JSON token-id lists; the sampling options where a request
    has its own), the `requests` table (every request, runnable
    or not, in input order: what decode_predictions.py --format openai_batch answers), the rejected ones and the
    params' model: keys the requests need (model_keys_needed)."""
    params = None if args.params is None else load_params(args.params).model
    # Without the run's params, a request may ask any logprobs: the summary says which model: keys the run needs.
    run = (GenerationOptions(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS) if params is None
           else params.generation_defaults())
    requests = read_batch_file(args.input, read_text(args.input), run)
    adapters = params.adapters if params is not None else {}
    if adapters:  # a request's model picks its LoRA adapter
        bare = base_names(params.checkpoint_path or "")
        for request in requests:
            if request.runs and request.model not in adapters and request.model not in bare:
                request.error = (f"model {request.model!r} is neither an adapter of this run ({', '.join(adapters)}) "
                                 f"nor its base model ({params.checkpoint_path})")
    check_response_formats(tokenizer, [request for request in requests if request.runs])
    runnable: list[BatchRequest] = []
    stops: list[list[list[int]]] = []
    texts: list[str] = []
    token_lists: list[list[int]] = []
    room = args.max_seq_len - args.min_new_tokens
    for request in requests:
        sequences = stop_token_ids(tokenizer, request.stop) if request.runs else []
        if isinstance(sequences, str):
            request.error = sequences
        if not request.runs:
            continue
        text = prompt_text(tokenizer, request)
        # The chat template writes the special tokens itself; a raw completion prompt gets the tokenizer's own.
        ids = (request.prompt_ids if request.prompt_ids is not None
               else list(tokenizer(text, add_special_tokens=request.kind == "completion")["input_ids"]))
        request.error = prompt_ids_error(request, ids, len(tokenizer), room)
        if request.runs:
            runnable.append(request)
            stops.append(sequences)
            texts.append(text)
            token_lists.append(ids)
    samples = np.array([r.option("n") for r in runnable])
    first_rows = np.cumsum(samples) - samples  # each request's first row: its n samples are consecutive rows
    rows = {request.custom_id: int(row) for row, request in zip(first_rows, runnable)}
    table = [json.dumps({"line": r.line, "custom_id": r.custom_id, "kind": r.kind, "model": r.model, "stop": r.stop,
                         "echo": r.echo, "logprobs": r.option("logprobs"), "top_logprobs": r.option("top_logprobs"),
                         "error": r.error, "row": rows.get(r.custom_id, -1), "n": r.option("n")})
             for r in requests]
    per_row = {"max_tokens": column("max_tokens", [r.option("max_tokens") or 0 for r in runnable]),
               "stop_sequences": column("stop_sequences", [json.dumps(s) for s in stops])}
    if adapters:
        per_row["adapter"] = [r.model for r in runnable]
    if any(r.echo for r in runnable):  # a scored prompt: every token after the first is its continuation
        per_row["continuation_length"] = column("continuation_length", [len(ids) - 1 if r.echo else 0
                                                                        for ids, r in zip(token_lists, runnable)])
    if any(r.option("response_format") for r in runnable):
        per_row["response_format"] = [r.option("response_format") or "" for r in runnable]
    # Each request's own sampling options, where some request has one (its dataset's missing value: the params').
    for name in (OPENAI_KEYS[key] for key in SAMPLING_KEYS):
        if any(name in r.options for r in runnable):
            per_row[name] = column(name, [r.options.get(name, ROW_DATASETS[name].missing) for r in runnable])
    if (samples > 1).any():  # a request's n samples: n rows, numbered
        per_row = repeated_for_samples(per_row, samples)
        texts, token_lists = repeat_rows(texts, samples), repeat_rows(token_lists, samples)
        runnable = repeat_rows(runnable, samples)
    rejected = [request for request in requests if not request.runs]
    return (PromptFile(texts, [r.custom_id for r in runnable]), token_lists, per_row, table, rejected,
            model_keys_needed(requests))


def model_keys_needed(requests: list[BatchRequest]) -> dict[str, Any]:
    """The params' model: keys that the runnable requests need beyond the defaults: logprobs, and top_logprobs as
    many as the most any request asks."""
    asked = [r for r in requests if r.runs and r.option("logprobs")]
    if not asked:
        return {}
    return {"logprobs": True, "top_logprobs": max(r.option("top_logprobs") for r in asked)}


def prompt_ids_error(request: BatchRequest, ids: list[int], vocab_size: int, room: int) -> str:
    """Why a request's prompt token ids cannot run (its own ids outside the vocabulary, or a prompt to score that
    has no second token or does not fit the row whole), or its error so far."""
    if request.prompt_ids is not None and max(ids) >= vocab_size:
        return f"prompt token id {max(ids)} is outside the vocabulary of {vocab_size} tokens"
    if request.echo and len(ids) < 2:
        return "echo scores a prompt's tokens after its first: the prompt needs at least 2 tokens"
    if request.echo and len(ids) > room:
        return (f"the prompt to score has {len(ids)} tokens, more than max_seq_len - min_new_tokens = {room} "
                "(a scored prompt is not truncated)")
    return request.error


def check_response_formats(tokenizer: Any, requests: list[BatchRequest]) -> None:
    """Compiles each distinct response format of the requests once; a request whose format does not compile becomes
    an error record."""
    formats = {r.option("response_format") for r in requests if r.option("response_format")}
    if not formats:
        return
    errors: dict[str, str] = {}
    try:
        compiler = FormatCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id or 0])
    except FormatError as error:
        errors = dict.fromkeys(formats, str(error))
    else:
        for text in formats:
            try:
                compiler.compile(text)
            except FormatError as error:
                errors[text] = str(error)
    for request in requests:
        if request.option("response_format") in errors:
            request.error = errors[request.option("response_format")]
