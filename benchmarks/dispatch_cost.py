"""A GPU step's cost counted on any device: aten ops dispatched, bytes written, bytes saved for backward.

On a GPU, a training step's time outside the big GEMMs is set by how many kernels it launches and how many
bytes it writes; both are visible at PyTorch's dispatcher in eager mode on a CPU. `DispatchCost` counts
them for the code run under it; `SavedForBackward` sums the distinct storages autograd keeps for the
backward pass (what sets the activation memory). Benchmarks print these counts beside GPU timings and tests
guard them, so a change that adds passes over a batch shows on the CPU where it is built.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# bookkeeping that launches no kernel and writes no tensor data: allocations, and `_unsafe_view` (a view that
# autograd does not track as one; `func.is_view` is false for it)
NO_KERNEL_OPS = frozenset(
    {
        "aten::_unsafe_view",
        "aten::detach",
        "aten::empty.memory_format",
        "aten::empty_strided",
        "aten::lift_fresh",
        "aten::new_empty",
        "aten::new_empty_strided",
    }
)


def _written_bytes(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> int:
    """Bytes of the op's tensor outputs, or where it returns none (the in-place multi-tensor ops,
    ``_foreach_add_``), of the arguments its schema marks as written; a view writes nothing."""
    if func.is_view:
        return 0
    if not func._schema.returns:
        written = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        out = [named.get(name) for name in written]
    tensors, _ = tree_flatten(out)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class DispatchCost(TorchDispatchMode):
    """Counts the aten ops dispatched (kernels a GPU would launch) and the bytes their outputs write.

    Views (``func.is_view``) and allocation-only ops count as neither. ``by_op`` keeps the count per op name,
    to see where a total comes from."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes_written = 0
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.name()
        if not func.is_view and name not in NO_KERNEL_OPS:
            self.ops += 1
            self.by_op[name] += 1
            self.bytes_written += _written_bytes(func, args, kwargs or {}, out)
        return out


class SavedForBackward(torch.autograd.graph.saved_tensors_hooks):
    """Sums the bytes of the distinct storages autograd saves for backward under it, leaving out parameters
    (``nn.Parameter``: held by the model whatever the backward keeps)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        super().__init__(self._pack, lambda saved: saved)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedForBackward:
        super().__enter__()
        return self

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())
