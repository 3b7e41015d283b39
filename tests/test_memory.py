"""The host memory a job may use: MemAvailable, capped by a cgroup limit when lower (a Slurm --mem); malloc keeping
freed memory for reuse while generating."""
from __future__ import annotations

import sys

import pytest

import modelzoo.cpu.memory as memory


def meminfo_available() -> int:
    with open("/proc/meminfo") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("MemAvailable:"))


def cgroup(tmp_path, limit: str, usage: int) -> tuple[tuple[str, str]]:
    (tmp_path / "memory.max").write_text(limit + "\n")
    (tmp_path / "memory.current").write_text(f"{usage}\n")
    return ((str(tmp_path / "memory.max"), str(tmp_path / "memory.current")),)


def test_a_lower_cgroup_limit_caps_it(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "_CGROUP_FILES", cgroup(tmp_path, str(3 << 30), 1 << 30))
    assert memory.available_host_memory() == min(2 << 30, meminfo_available())


def test_no_limit_or_a_higher_one_leaves_meminfo(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "_CGROUP_FILES", cgroup(tmp_path, "max", 1 << 30))
    first = memory.available_host_memory()
    assert abs(first - meminfo_available()) < 256 << 20  # MemAvailable moves a little between reads
    monkeypatch.setattr(memory, "_CGROUP_FILES", cgroup(tmp_path, str(1 << 50), 1 << 30))
    assert abs(memory.available_host_memory() - meminfo_available()) < 256 << 20
    monkeypatch.setattr(memory, "_CGROUP_FILES", ((str(tmp_path / "absent"), str(tmp_path / "absent")),))
    assert abs(memory.available_host_memory() - meminfo_available()) < 256 << 20


# Allocates and frees a step's worth of tensors (118 MiB in 1 to 48 MiB, written whole) nine times and prints the minor
# page faults of the last eight rounds; with "keep", after keep_freed_memory.
STEPS_SCRIPT = """
import resource, sys, torch
import modelzoo.cpu.memory as memory
if sys.argv[1] == "keep":
    assert memory.keep_freed_memory() is not None
def step():
    tensors = [torch.empty(mib << 18).fill_(1.0) for mib in (1, 6, 48, 12, 48, 3)]  # float32: mib << 18 = mib MiB
    del tensors
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def step_faults(mode: str) -> int:
    """Minor page faults of eight rounds of STEPS_SCRIPT's allocations, in a process of their own (the setting is
    process-wide)."""
    import subprocess
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", STEPS_SCRIPT, mode], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1])
    return int(done.stdout.strip())


@pytest.mark.skipif(memory._mallopt() is None or not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_kept_freed_memory_is_reused_without_page_faults():
    pages = (48 << 20) // 4096  # one 48 MiB tensor's 4 KiB pages
    # the rounds reuse the first one's pages (the heap grows now and then, as its free chunks split differently: 0 to
    # 37k pages over the eight rounds measured)
    assert step_faults("keep") < 3 * (118 << 20) // 4096
    # malloc's default maps anything over 32 MiB afresh: both 48 MiB tensors of every round fault in again
    assert step_faults("default") > 8 * 2 * pages * 9 // 10


def test_keep_freed_memory_says_what_it_set(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_mallopt", lambda: lambda parameter, value: calls.append((parameter, value)) or 1)
    monkeypatch.setattr(memory.sys, "platform", "linux")
    assert memory.keep_freed_memory() == ("malloc keeps freed memory for reuse (allocations under 256 MiB from its "
                                          "heap, up to 1024 MiB of it kept free)")
    assert calls == [(memory.M_MMAP_THRESHOLD, 256 << 20), (memory.M_TRIM_THRESHOLD, 1 << 30)]
    monkeypatch.setattr(memory, "_mallopt", lambda: lambda parameter, value: 0)  # refused: nothing claimed
    assert memory.keep_freed_memory() is None
    monkeypatch.setattr(memory, "_mallopt", lambda: None)  # no glibc
    assert memory.keep_freed_memory() is None
