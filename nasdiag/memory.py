"""Memory free on this machine's CPU side, read from the kernel (no torch, no h5py: any layer may ask)."""

from __future__ import annotations

import os
from typing import Optional

#: where a CPU's free memory is read: the kernel's estimate, and the limit and usage of this process's cgroup
#: (v2), which a container may set far below the machine's memory while ``MemAvailable`` still shows the host's
MEMINFO = "/proc/meminfo"
CGROUP_MEMORY = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")
#: the process's cgroup (v2: the line ``0::<path>``), relative to the folder of ``CGROUP_MEMORY``: ``/`` in a container
#: with its own cgroup namespace; a batch job's (Slurm's ``/system.slice/.../job_N/step_0``) sits below the root, whose
#: ``memory.max`` does not exist, and its limit may be set on any level above the process (the job's, not the step's)
PROC_CGROUP = "/proc/self/cgroup"
#: the key of the cgroup's ``memory.stat`` (beside ``memory.current``) whose bytes ``memory.current`` counts but the kernel
#: reclaims first when the limit is reached: inactive page cache (a dataset read, a record written). The usage less it is
#: the working set, as cAdvisor and the kubelet count it
RECLAIMABLE = "inactive_file"


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _reclaimable(stat: str) -> int:
    """Bytes of the cgroup's usage the kernel reclaims for new allocations (``inactive_file`` of ``stat``), 0 where
    unknown."""
    try:
        with open(stat) as f:
            return next((int(line.split()[1]) for line in f if line.split()[:1] == [RECLAIMABLE]), 0)
    except (OSError, ValueError, IndexError):
        return 0


def free_cpu_memory() -> Optional[int]:
    """Bytes free for new allocations: the kernel's ``MemAvailable`` (Linux), or what the limit of the process's cgroup
    or of a cgroup above it (:data:`PROC_CGROUP`) leaves if that is less; None where neither can be read. Checked
    before a large allocation because a kernel that overcommits hands out any size, and the process is killed without
    a message when it is written.
    The cgroup's usage (``memory.current``) counts its page cache too, which a run that reads a dataset and writes a
    record fills up to the limit; the inactive part of it (:data:`RECLAIMABLE`) is reclaimed for new allocations, so
    it counts as free (limit − usage alone was near 0 there, and refused a record's buffer or an exact curvature)."""
    found = []
    try:
        with open(MEMINFO) as info:
            found += [int(line.split()[1]) * 1024 for line in info if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    names = [os.path.basename(path) for path in CGROUP_MEMORY]
    for level in _cgroup_levels():
        try:
            limit, used = (_read(os.path.join(level, name)) for name in names)
            if limit != "max":
                working = max(int(used) - _reclaimable(os.path.join(level, "memory.stat")), 0)
                found.append(max(int(limit) - working, 0))
        except (OSError, ValueError):
            pass
    return min(found) if found else None


def _cgroup_levels() -> list:
    """The folders of the process's cgroup and of every cgroup above it, up to the root (the folder of
    ``CGROUP_MEMORY``): a limit on any of them bounds the process."""
    root = os.path.dirname(CGROUP_MEMORY[0])
    try:
        with open(PROC_CGROUP) as f:
            path = next((line.strip()[3:] for line in f if line.startswith("0::")), "/")
    except OSError:
        path = "/"
    parts = [p for p in path.split("/") if p and p != "."]
    if ".." in parts:  # a cgroup outside this namespace's root: none of the folders here is it
        parts = []
    return [os.path.join(root, *parts[:n]) for n in range(len(parts), -1, -1)]
