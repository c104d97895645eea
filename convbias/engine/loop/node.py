"""The node a process runs on: its cores, this launch's processes on it, and the intra-op threads each gets."""

from __future__ import annotations

import os

import torch


def node_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_processes() -> int:
    """The processes of this launch on this node (torchrun and accelerate's launcher set LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def set_threads() -> None:
    """Intra-op threads per process: the node's cores shared among its processes, unless OMP_NUM_THREADS
    says otherwise (accelerate's --num_cpu_threads_per_process sets it)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, node_cores() // local_processes()))
