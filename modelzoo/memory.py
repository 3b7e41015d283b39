"""Memory this process may still use on the host: MemAvailable, capped by a cgroup limit (a Slurm job's
--mem, a container's) when that is lower."""
from __future__ import annotations

import os
from pathlib import Path

# (limit, usage) files of cgroup v2, then v1
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available_host_memory() -> int:
    """Bytes: MemAvailable of /proc/meminfo (else physical memory), or the cgroup's room if lower."""
    available = 0
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if not available:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_path, usage_path in _CGROUP_FILES:
        try:
            limit = Path(limit_path).read_text().strip()
            if limit == "max":
                continue
            room = int(limit) - int(Path(usage_path).read_text().strip())
        except (OSError, ValueError):
            continue
        if 0 < room < available:
            available = room
    return available
