"""OpenAI batch files (the JSONL of the OpenAI Batch API and `vllm run-batch`): requests in, responses out.

Input, one request per line:
    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64, "stop": ["\\n\\n"]}}
`/v1/chat/completions` bodies go through the tokenizer's chat template; `/v1/completions` bodies are raw
prompts. Per request: `max_tokens` (or `max_completion_tokens`), `stop` strings, the sampling options that
GenerationOptions declares an OpenAI key for (SAMPLING_KEYS: temperature, top-p, seed; greedy and sampled requests
side by side, each drawn from its own seed's streams), `n`
(up to MAX_SAMPLES samples, n rows of the data, the prompt prefilled once) and `response_format` (`json_object` or
`json_schema`: the answer follows the schema's grammar; a schema that cannot be compiled is that request's
error record), honoured by the runner. A `/v1/completions` body with `echo: true` and `max_tokens: 0` scores its
prompt (a string or token ids): the runner writes each prompt token's log-probability, no token generated. An option the
runner cannot honour for one request (`logit_bias`, tools, `logprobs` other than the params', ...) makes
that request an error record of the output, not a failed job; so does a stop string that does not map to
token ids. A malformed line or a repeated `custom_id` is an error for
the whole file (the OpenAI Batch API rejects such a file too).

Output, one line per request in the input's order (`decode_predictions.py --format openai_batch`):
    {"id": "batch_req_1", "custom_id": "q1", "response": {"status_code": 200, "request_id": "...", "body": {...}},
     "error": null}
with a chat.completion or text_completion body (`finish_reason` `stop` or `length`, `usage`), or
`"response": null, "error": {"code": ..., "message": ...}` for a request that could not run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from data_tools.prompts import json_records
from modelzoo.errors import UserError
from modelzoo.generation.options import BOUNDS, MAX_SAMPLES, OPENAI_KEYS, ROW_OPTION_DATASETS, GenerationOptions
from modelzoo.generation.formats import FormatError, canonical_format

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
KINDS = {CHAT_URL: "chat", COMPLETIONS_URL: "completion"}
# Body keys read or allowed as they are.
READ_KEYS = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stop", "n", "echo"}
# Each request's own sampling options, honoured row by row: GenerationOptions' OpenAI keys held in a row dataset.
SAMPLING_KEYS = tuple(key for key, name in OPENAI_KEYS.items() if name in ROW_OPTION_DATASETS and key not in READ_KEYS)
IGNORED_KEYS = {"user", "metadata", "store", "service_tier"}
# Body keys the runner applies to every row alike: allowed where the request asks for the run's value.
# name -> the GenerationOptions field it must equal (None: `stream`, which must be false).
RUN_WIDE = {"stream": None, "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# What a request asks that no run here does (e.g. logit_bias, tools, response_format): its error record.


@dataclass
class BatchRequest:
    """One line of an OpenAI batch file: what to run, or why it cannot run here."""

    line: int  # 1-based, in the input file
    custom_id: str
    kind: str = "chat"  # chat or completion
    model: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: str = ""
    prompt_ids: list[int] | None = None  # a completions prompt given as token ids
    echo: bool = False  # a completions request scoring its prompt (echo, max_tokens 0): no token generated
    stop: list[str] = field(default_factory=list)
    # The request's own GenerationOptions values by field name (max_tokens, the sampling options, n,
    # logprobs, top_logprobs, response_format); the others are the run's.
    options: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # non-empty: the request's error record, nothing is generated for it

    @property
    def runs(self) -> bool:
        return not self.error

    def option(self, name: str) -> Any:
        """The request's own value of GenerationOptions field `name`, or that field's default."""
        return self.options.get(name, GenerationOptions.__dataclass_fields__[name].default)


def _text_content(content: Any) -> str | None:
    """A message's content as text: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return None


def _sampling_option(key: str, value: Any) -> tuple[float | int | None, str]:
    """A request's value of a SAMPLING_KEYS key, checked against its option's declared range: (value, "") or
    (None, why it cannot run)."""
    bound = BOUNDS[OPENAI_KEYS[key]]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = number and (float(value).is_integer() if bound.integer else True) and bound.holds(value)
    if not ok:
        return None, f"{key} must be {bound.text()}, got {value!r}"
    return (int(value) if bound.integer else float(value)), ""


def _read_body(request: BatchRequest, body: dict[str, Any], run: GenerationOptions) -> None:
    """Fills `request` from its body (`run`: the run's options), or sets its error."""
    for key, value in body.items():
        if key in READ_KEYS or key in IGNORED_KEYS:
            continue
        if key == "response_format":
            try:
                request.options["response_format"] = None if value is None else canonical_format(value)
            except FormatError as error:
                request.error = str(error)
                return
            continue
        if key == "top_logprobs":
            most = run.top_logprobs
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= most):
                request.error = (f"top_logprobs {value!r} is more than this run keeps: at most {most} "
                                 f"(model.top_logprobs in the params)")
                return
            request.options["top_logprobs"] = value or 0
            continue
        if key in SAMPLING_KEYS:
            if value is not None:
                own, why = _sampling_option(key, value)
                if why:
                    request.error = why
                    return
                request.options[OPENAI_KEYS[key]] = own
            continue
        if key == "logprobs" and request.kind == "completion" and isinstance(value, int) and not isinstance(value, bool):
            # The completions API's logprobs is a count: that many likeliest tokens at each position. A scored
            # prompt (echo) always has its tokens' log-probabilities; generated tokens need model.logprobs.
            most = run.top_logprobs
            if not (run.logprobs or body.get("echo") is True) or not 0 <= value <= most:
                request.error = (f"logprobs {value!r} asks for more than this run keeps: model.logprobs with at most "
                                 f"{most} top_logprobs in the params")
                return
            request.options["top_logprobs"] = value
            request.options["logprobs"] = True
            continue
        if key == "logprobs":
            if value not in (None, False, True):
                request.error = f"logprobs must be true or false, got {value!r}"
                return
            if value and not run.logprobs:
                request.error = "logprobs asks for more than this run keeps: model.logprobs: true in the params"
                return
            continue
        if key in RUN_WIDE:
            name = RUN_WIDE[key]
            wanted = getattr(run, name) if name else False
            if value is not None and value != wanted:
                request.error = (f"{key} {value!r} is not supported per request: this run uses {wanted!r} for every "
                                 f"request" + (f" (model.{name} in the params)" if name else ""))
                return
            continue
        request.error = f"{key} is not supported by zoo-infer"
        return
    n = body.get("n")
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SAMPLES:
            request.error = f"n must be an integer from 1 to {MAX_SAMPLES}, got {n!r}"
            return
        request.options["n"] = n
    request.model = str(body.get("model") or "")
    if body.get("logprobs") is not None and body.get("logprobs") is not False:
        request.options["logprobs"] = True
    if request.kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            request.error = "messages must be a non-empty list"
            return
        for message in messages:
            text = _text_content(message.get("content")) if isinstance(message, dict) else None
            if text is None or not isinstance(message.get("role"), str):
                request.error = "each message needs a role and text content"
                return
            request.messages.append({"role": message["role"], "content": text})
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt, as text or as token ids
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                      for t in prompt):
            request.prompt_ids = prompt
        elif isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.error = ("prompt must be one string or one list of token ids (several prompts in one request are "
                             "not supported)")
            return
    echo = body.get("echo", False)
    if not isinstance(echo, bool) or (echo and request.kind != "completion"):
        request.error = f"echo must be true or false, and only on {COMPLETIONS_URL}; got {echo!r}"
        return
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if echo and limit != 0:
        request.error = (f"echo is supported to score a prompt: with max_tokens 0 (got {limit!r}); the answer is the "
                         "prompt's token log-probabilities")
        return
    if echo and (body.get("n", 1) != 1 or body.get("response_format") is not None):
        request.error = "echo with max_tokens 0 scores the prompt: n and response_format do not apply"
        return
    request.echo = echo
    if limit is not None and not echo:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            request.error = f"max_tokens must be an integer >= 1 (0 only with echo: true), got {limit!r}"
            return
        request.options["max_tokens"] = limit
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        request.error = f"stop must be a non-empty string or a list of them, got {stop!r}"
        return
    request.stop = stops or []


def read_batch_file(path: Path, text: str, run: GenerationOptions = GenerationOptions()) -> list[BatchRequest]:
    """Every request of an OpenAI batch file, in order; `run`: the run's options (its params' model section)."""
    requests: list[BatchRequest] = []
    seen: dict[str, int] = {}
    for line_no, record in json_records(path, text):
        if not isinstance(record.get("custom_id"), str) or not record["custom_id"]:
            raise UserError(f"{path}: line {line_no} is not a batch request: it needs a non-empty string custom_id")
        custom_id = record["custom_id"]
        if custom_id in seen:
            seen_line = seen[custom_id]
            raise UserError(f"{path}: custom_id {custom_id!r} is used on lines {seen_line} and {line_no}; "
                            "each request needs its own")
        seen[custom_id] = line_no
        request = BatchRequest(line_no, custom_id)
        url, body = record.get("url"), record.get("body")
        if record.get("method", "POST") != "POST":
            request.error = f"method {record.get('method')!r} is not supported (POST only)"
        elif url not in KINDS:
            request.error = f"url {url!r} is not supported ({CHAT_URL} or {COMPLETIONS_URL})"
        elif not isinstance(body, dict):
            request.error = "body must be a JSON object"
        else:
            request.kind = KINDS[url]
            _read_body(request, body, run)
        requests.append(request)
    if not requests:
        raise UserError(f"{path}: no requests found")
    return requests


def stop_token_ids(tokenizer: Any, stops: Sequence[str]) -> list[list[int]] | str:
    """Each stop string as the token ids it encodes to, or an error when one does not round-trip (the
    runner matches ids, so a string that only appears inside other tokens would never stop a row)."""
    sequences = []
    for stop in stops:
        try:
            ids = tokenizer.encode(stop, add_special_tokens=False)
        except (TypeError, ValueError, UnicodeError):  # e.g. a lone surrogate, which JSON allows
            ids = []
        if not ids or tokenizer.decode(ids) != stop:
            return f"stop string {stop!r} does not map to token ids of this tokenizer"
        sequences.append(list(ids))
    return sequences


def prompt_text(tokenizer: Any, request: BatchRequest) -> str:
    """The text a request's prompt is: its messages in the chat template, or its raw prompt."""
    if request.kind == "completion":
        return request.prompt if request.prompt_ids is None else tokenizer.decode(request.prompt_ids)
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError("the batch file holds /v1/chat/completions requests but the tokenizer has no chat template")
    return tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=False)


def _choice(request: dict[str, Any], completion: dict[str, Any], index: int) -> dict[str, Any]:
    """One choice of an answer: sample `index` of the request, decoded (see `response_line`)."""
    choice: dict[str, Any] = {"index": index, "finish_reason": completion["finish_reason"], "logprobs": None}
    pieces = completion.get("token_logprobs") if request.get("logprobs") else None  # [(token text, logprob)]
    most = request.get("top_logprobs", 0) if pieces is not None else 0
    tops = ([None if position is None else position[:most] for position in completion.get("top_logprobs", [])]
            if most else [[]] * len(pieces or []))  # None: a scored prompt's first token
    if request["kind"] == "chat":
        choice["message"] = {"role": "assistant", "content": completion["text"]}
        if pieces is not None:
            choice["logprobs"] = {"content": [
                {"token": text, "logprob": value, "bytes": list(text.encode()),
                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top]}
                for (text, value), top in zip(pieces, tops)]}
    else:
        choice["text"] = completion["text"]
        if pieces is not None:
            choice["logprobs"] = {"tokens": [text for text, _ in pieces],
                                  "token_logprobs": [value for _, value in pieces],
                                  "top_logprobs": [None if top is None else dict(top) for top in tops] if most else None}
    return choice


def response_line(number: int, request: dict[str, Any], completions: Sequence[dict[str, Any]] | None,
                  created: int) -> dict:
    """One output line. request: the row's record (custom_id, kind, model, logprobs, error); completions: each
    sample's decoded row, in sample order (completion text without its stop sequence, finish_reason, prompt /
    completion token counts, token_logprobs: (token text, log-probability) of each generated token where the
    run has them), or None when the run has no prediction for some sample (an incomplete run). The usage counts
    the prompt once and every sample's tokens, as the OpenAI API does."""
    base = {"id": f"batch_req_{number}", "custom_id": request["custom_id"]}
    if request.get("error") or completions is None:
        message = request.get("error") or "no prediction for this request: the run has not finished it"
        code = "invalid_request" if request.get("error") else "not_generated"
        return {**base, "response": None, "error": {"code": code, "message": message}}
    choices = [_choice(request, completion, index) for index, completion in enumerate(completions)]
    kind = "chat.completion" if request["kind"] == "chat" else "text_completion"
    prompt_tokens = completions[0]["prompt_tokens"]
    generated = sum(completion["completion_tokens"] for completion in completions)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}
    body = {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{request['custom_id']}", "object": kind,
            "created": created, "model": request.get("model", ""), "choices": choices, "usage": usage}
    return {**base, "response": {"status_code": 200, "request_id": f"req_{number}", "body": body}, "error": None}
