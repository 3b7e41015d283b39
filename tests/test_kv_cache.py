"""The KV cache's host memory: zeroed, and advised to transparent huge pages before its first touch (Linux)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from modelzoo.models.kv_cache import HUGE_PAGE_BYTES, KVCache

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
