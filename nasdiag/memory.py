"""Memory free on this machine's CPU side, read from the kernel (no torch, no h5py: any layer may ask)."""

from __future__ import annotations

from typing import Optional

#: where a CPU's free memory is read: the kernel's estimate, and the limit and usage of this process's cgroup
#: (v2), which a container may set far below the machine's memory while ``MemAvailable`` still shows the host's
MEMINFO = "/proc/meminfo"
CGROUP_MEMORY = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def free_cpu_memory() -> Optional[int]:
    """Bytes free for new allocations: the kernel's ``MemAvailable`` (Linux), or what the process's cgroup limit
    leaves if that is less; None where neither can be read. Checked before a large allocation because a kernel
    that overcommits hands out any size, and the process is killed without a message when it is written."""
    found = []
    try:
        with open(MEMINFO) as info:
            found += [int(line.split()[1]) * 1024 for line in info if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit, used = (_read(path) for path in CGROUP_MEMORY)
        if limit != "max":
            found.append(max(int(limit) - int(used), 0))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
