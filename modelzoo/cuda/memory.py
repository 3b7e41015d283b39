"""Device memory sizing: the bytes free on a device, and how many tokens one prefill forward may run on a GPU."""
from __future__ import annotations

import logging
from typing import Any

import torch

from modelzoo.cpu.memory import available_host_memory

log = logging.getLogger("zoo-infer")

# Tokens of one prefill forward: the CPU's packed prompts (its attention kernel is fastest on groups about this
# size); on a GPU, padded rows up to this many tokens, within PREFILL_MEMORY_SHARE of the free memory.
PREFILL_TOKENS_CPU = 1024
PREFILL_TOKENS_CUDA = 16384
PREFILL_MEMORY_SHARE = 0.25


def available_memory(device: torch.device) -> int:
    """Bytes free on the device (CPU: the host's, cgroup limits included)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_memory()


def prefill_token_budget(config: Any, dtype: torch.dtype, device: torch.device) -> int:
    """Tokens one prefill forward runs at most (padding included where prompts are padded) for a model of `config`
    computing in `dtype`: on the CPU PREFILL_TOKENS_CPU; on a GPU as many as PREFILL_MEMORY_SHARE of the memory left
    free holds (each token's activations within a layer, at most PREFILL_TOKENS_CUDA)."""
    if device.type != "cuda":
        return PREFILL_TOKENS_CPU
    c = config
    element = torch.empty((), dtype=dtype).element_size()
    per_token = element * (4 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                           + 3 * c.intermediate_size)
    free = available_memory(device)
    budget = int(min(PREFILL_TOKENS_CUDA, free * PREFILL_MEMORY_SHARE // per_token))
    log.info("prefill: prompts right-padded in groups of up to %d tokens (%.2f GiB of activations at most)", budget,
             budget * per_token / 2**30)
    return max(budget, 1)
