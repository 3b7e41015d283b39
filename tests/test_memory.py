"""The host memory a job may use: MemAvailable, capped by a cgroup limit when lower (a Slurm --mem)."""
from __future__ import annotations

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
