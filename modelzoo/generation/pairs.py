"""A scoring pair's text as token ids, split as lm-evaluation-harness splits it: one rule for the data tool
(`create_inference_h5.py --continuation_field`) and the Python API (`ZooModel.score`). Torch-free."""
from __future__ import annotations

from typing import Any


def split_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids): trailing spaces of the context move to the continuation, the whole text is
    encoded and the continuation is what follows the context's own encoding (with the tokenizer's own special tokens:
    a BOS where the model expects one); an empty context is the tokenizer's BOS, else its EOS (lm-eval's hf backend's
    prefix token), so that its continuation has a position to be scored from."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        return [prefix], list(tokenizer(continuation, add_special_tokens=False)["input_ids"])
    head = list(tokenizer(context)["input_ids"])
    return head, list(tokenizer(context + continuation)["input_ids"][len(head):])
