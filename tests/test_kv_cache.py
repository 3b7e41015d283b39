"""The KV cache's and the packed weights' memory: advised to transparent huge pages before its first touch (Linux)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from modelzoo.cpu.memory import HUGE_PAGE_BYTES
from modelzoo.models.kv_cache import KVCache

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
transparent_huge_pages = pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                                            reason="this kernel has no transparent huge pages")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(bound, 16) for bound in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@linux
@transparent_huge_pages
def test_the_caches_whole_huge_pages_are_advised_and_zeroed():
    cache = KVCache(2, 8, 4, 1024, 64, torch.bfloat16, torch.device("cpu"))  # 4 MiB a tensor
    for tensor in (*cache.keys, *cache.values):
        assert not tensor.any()
        first_whole_page = -(-tensor.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        assert "hg" in vm_flags(first_whole_page)  # MADV_HUGEPAGE's mark on the mapping


@linux
def test_a_cache_smaller_than_a_huge_page_is_zeroed_and_writable():
    cache = KVCache(1, 2, 1, 16, 8, torch.float32, torch.device("cpu"))
    assert not cache.keys[0].any() and cache.keys[0].shape == (2, 1, 24, 8)  # 16 positions, 8 never read
    cache.keys[0][1, 0, 3] = 1.0
    assert cache.keys[0].sum() == 8 and not cache.values[0].any()


@linux
@transparent_huge_pages
def test_packed_weights_are_gathered_on_huge_pages_and_multiply_as_before():
    """gather_packed_weights moves every packed weight into one mapping advised to huge pages, side by side at 64-byte
    boundaries; the layers' outputs keep their bits, and a model without packed layers is left alone."""
    from torch import nn

    from modelzoo.cpu.kernels import cpu_kernels
    from modelzoo.cpu.precision import HalfLinear, gather_packed_weights

    if cpu_kernels() is None:
        pytest.skip("the C++ kernels cannot be built here")
    torch.manual_seed(0)
    model = nn.Sequential(HalfLinear(nn.Linear(1024, 1040)), HalfLinear(nn.Linear(1040, 24)))  # 4 MiB + 97.5 KiB
    x = torch.randn(5, 1024)
    with torch.inference_mode():
        before = model(x)
        sizes = [layer.packed_bytes() for layer in model]
        assert gather_packed_weights(model) == sum(sizes)
        assert torch.equal(model(x), before)
    first, second = (layer.packed.data_ptr() for layer in model)
    assert first % HUGE_PAGE_BYTES == 0 and second - first == -(-sizes[0] // 64) * 64
    assert "hg" in vm_flags(first)  # the whole 2 MiB pages (the last, partial one is not advised)
    assert gather_packed_weights(nn.Sequential(nn.Linear(4, 4))) == 0
