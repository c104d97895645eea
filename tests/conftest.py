"""Shared pytest fixtures and helpers (import helpers with `from conftest import ...`)."""
import pytest
import torch
import torch.nn as nn


@pytest.fixture(scope="module")
def single_thread():
    """For modules of tiny models: a second thread costs more than it saves (far more on a busy machine).

    Use with `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# -- Transformed CNN exactness: a CNN and its T-CNN on the same images ---------------------------------
IMAGES = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


@torch.no_grad()
def randomize_norms(model: nn.Module) -> nn.Module:
    """Random BatchNorm statistics and affine parameters: timm zero-inits the last BN of each
    residual branch, which would hide the converted convolutions from the output."""
    generator = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.weight.copy_(torch.rand(module.weight.shape, generator=generator) + 0.5)
            module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
            module.running_mean.copy_(0.1 * torch.randn(module.running_mean.shape, generator=generator))
            module.running_var.copy_(torch.rand(module.running_var.shape, generator=generator) + 0.5)
    return model.eval()
