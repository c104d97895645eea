"""The node a process runs on: its cores, this launch's processes on it, and the intra-op threads each gets."""

from __future__ import annotations

import os

import torch

# torch's intra-op threads when the engine was imported: a different value later, which the engine did not set,
# was set by the user (torch.set_num_threads)
TORCH_THREADS_AT_IMPORT = torch.get_num_threads()
_threads_set: set[int] = set()  # the values the engine set in this process


def node_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_processes() -> int:
    """The processes of this launch on this node (torchrun and accelerate's launcher set LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def intra_op_threads(cores: int, processes: int, workers: int) -> int:
    """A training process's intra-op threads: its share of the node's cores less its loader workers, at least
    one. A busy worker holds a core; a second compute thread competing with it for that core slows every op
    that waits for its slowest thread."""
    return max(1, cores // max(1, processes) - workers)


def set_threads(workers: int) -> str:
    """Sets each process's intra-op threads by ``intra_op_threads`` unless the user chose them (OMP_NUM_THREADS,
    which accelerate's --num_cpu_threads_per_process sets, or torch.set_num_threads); returns where the number
    came from, for the start-up block."""
    if "OMP_NUM_THREADS" in os.environ:
        return f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    current = torch.get_num_threads()
    if current != TORCH_THREADS_AT_IMPORT and current not in _threads_set:
        return "torch.set_num_threads"
    cores, processes = node_cores(), local_processes()
    threads = intra_op_threads(cores, processes, workers)
    torch.set_num_threads(threads)
    _threads_set.add(threads)
    share = f"{cores} cores / {processes} processes" if processes > 1 else f"{cores} core{'s' if cores > 1 else ''}"
    return f"{share} less {workers} loader worker{'s' if workers != 1 else ''}"


def load_average() -> float | None:
    """The node's load average over the last minute: the processes running or waiting for a core (None where the
    system does not report it)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_cores_warning(threads: int) -> str | None:
    """The warning of more intra-op threads on this node (``threads`` per process, this launch's processes) than the
    cores its load average leaves free: each op waits for its slowest thread, and a thread that waits for a busy
    core slows every step. None when they fit, or with one thread per process (nothing to lower). The load average
    is the machine's: on cores of a machine's share (an affinity mask) it counts in proportion to that share."""
    load = load_average()
    if load is None or threads <= 1:
        return None
    cores, processes = node_cores(), local_processes()
    free = max(0, round(cores - load * cores / max(cores, os.cpu_count() or cores)))
    if threads * processes <= free:
        return None
    fits = max(1, free // processes)
    each = f" per process x {processes} processes" if processes > 1 else ""
    return (
        f"{threads} intra-op threads{each}, and the load average ({load:.1f} over the last minute) leaves about "
        f"{free} of {cores} cores free: threads waiting for a busy core slow every step; set OMP_NUM_THREADS={fits} "
        f"(convbias-launch, accelerate launch: --num_cpu_threads_per_process {fits})"
    )
