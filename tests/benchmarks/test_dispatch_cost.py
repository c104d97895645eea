"""The cost counters against closed-form counts: two element-wise ops on a known tensor, views, saved tensors."""

from __future__ import annotations

import torch

from benchmarks.dispatch_cost import DispatchCost, SavedForBackward


def test_ops_and_bytes_of_element_wise_ops_and_views():
    x = torch.randn(4, 8)
    with DispatchCost() as cost:
        y = x * 2 + 1  # two kernels, each writes 4 * 8 fp32 values
        y.view(32).unsqueeze(0)  # views launch nothing
        y.add_(1)  # in place: writes the tensor again
    assert cost.ops == 3
    assert cost.bytes_written == 3 * 4 * 8 * 4
    assert cost.by_op == {"aten::mul.Tensor": 1, "aten::add.Tensor": 1, "aten::add_.Tensor": 1}


def test_in_place_multi_tensor_ops_count_the_tensors_they_write():
    """``_foreach_*_`` ops return nothing: what they write is the list their schema marks as written."""
    targets, sources = [torch.zeros(3, 5), torch.zeros(7)], [torch.ones(3, 5), torch.ones(7)]
    with DispatchCost() as cost:
        torch._foreach_lerp_(targets, sources, 0.5)  # one kernel on a GPU, writes the targets only
    assert cost.ops == 1
    assert cost.bytes_written == (15 + 7) * 4


def test_saved_for_backward_counts_distinct_activations_not_parameters():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(16, 8, requires_grad=True)
    with SavedForBackward() as saved:
        hidden = x @ weight  # saves x (16 x 8) and the weight (a parameter: not counted)
        (hidden * hidden).sum()  # saves hidden (16 x 8) once, though twice by reference
    assert saved.bytes == 2 * 16 * 8 * 4
