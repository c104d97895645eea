"""convbias.engine.model.aten_kernels: the modules `--compile` routes through ATen's kernels on a CPU compute
exactly what the unswapped modules compute (outputs and every gradient, bit for bit), eagerly and under
inductor with no graph break, in fp32 and under bf16 autocast; their parameters, keys and classes stay
what they were, and only the exact module classes named there are touched."""

import copy
import pickle

import pytest
import timm
import torch
from timm.layers import LayerNorm, LayerNorm2d
from torch import nn

from convbias.engine.model import aten_kernels
from convbias.engine.model.aten_kernels import use_aten_kernels

pytestmark = pytest.mark.usefixtures("single_thread")

# (module, input shape); integer-valued inputs, so max-pool windows hold ties and ReLU sees exact zeros
MODULES = {
    "gelu": (nn.GELU(), (4, 7, 24)),
    "gelu_tanh": (nn.GELU(approximate="tanh"), (4, 7, 24)),
    "layer_norm": (nn.LayerNorm(24), (4, 7, 24)),
    "timm_layer_norm": (LayerNorm(24, eps=1e-6), (4, 7, 24)),
    "relu": (nn.ReLU(inplace=True), (4, 3, 9, 11)),
    "max_pool_2x2": (nn.MaxPool2d(2), (4, 3, 9, 11)),  # non-overlapping windows, odd sides cropped
    "max_pool_2x3": (nn.MaxPool2d((2, 3)), (4, 3, 9, 11)),
    "max_pool_3s2p1": (nn.MaxPool2d(3, stride=2, padding=1), (4, 3, 9, 11)),  # ResNet's stem: ATen's op
    "max_pool_ceil": (nn.MaxPool2d(2, ceil_mode=True), (4, 3, 9, 11)),
}


def _with_grads(module: nn.Module, fn, x: torch.Tensor, autocast: bool):
    """Output, input gradient and parameter gradients of a fixed weighting of fn(x)."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(x * 1)  # not the leaf itself: ReLU(inplace=True) writes into its input
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out.float() * weights).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODULES))
def test_swapped_module_computes_what_the_original_does(name, autocast):
    original, shape = MODULES[name]
    torch.manual_seed(0)
    if isinstance(original, nn.LayerNorm):
        with torch.no_grad():
            original.weight.normal_(), original.bias.normal_()
    x = torch.randint(-3, 4, shape).float() + (0.25 * torch.randn(shape) if "norm" in name else 0)
    swapped = copy.deepcopy(original)
    assert use_aten_kernels(swapped) == 1
    assert isinstance(swapped, type(original)) and type(swapped) is not type(original)
    assert swapped.state_dict().keys() == original.state_dict().keys()
    assert type(pickle.loads(pickle.dumps(swapped))) is type(swapped)  # torch.save of a whole model works

    torch._dynamo.reset()
    compiled = torch.compile(swapped, fullgraph=True, backend="inductor")  # fullgraph: a break raises
    expected = _with_grads(original, original, x, autocast)
    for fn in (swapped, compiled):
        for got, want in zip(_with_grads(swapped, fn, x, autocast), expected, strict=True):
            assert got.dtype == want.dtype
            assert torch.equal(got, want), name


def test_inference_graph_and_training_graph_both_match():
    """Max-pool takes a different path without autograd (no indices needed): both agree with eager."""
    pool = nn.Sequential(nn.ReLU(), nn.MaxPool2d(2))
    swapped = copy.deepcopy(pool)
    use_aten_kernels(swapped)
    compiled = torch.compile(swapped, fullgraph=True)
    x = torch.randint(-3, 4, (2, 3, 8, 8)).float()
    with torch.no_grad():
        assert torch.equal(compiled(x), pool(x))
    assert torch.equal(compiled(x.requires_grad_()), pool(x))


def test_only_the_named_module_classes_are_swapped():
    model = nn.Sequential(
        LayerNorm2d(3),
        nn.LayerNorm(4, elementwise_affine=False),
        nn.MaxPool2d(2, return_indices=True),
        nn.SiLU(),
        nn.GELU(),
        nn.ReLU(),
    )
    assert use_aten_kernels(model) == 2  # LayerNorm2d permutes first; no affine; indices returned; SiLU
    assert [type(m).__name__ for m in model] == [
        "LayerNorm2d",
        "LayerNorm",
        "MaxPool2d",
        "SiLU",
        "AtenGELU",
        "AtenReLU",
    ]
    assert use_aten_kernels(model) == 0  # a second call changes nothing


def test_a_swapped_vit_keeps_its_weights_and_outputs():
    torch.manual_seed(0)
    model = timm.create_model(
        "deit_tiny_patch16_224", img_size=16, patch_size=4, depth=2, embed_dim=24, num_heads=2, num_classes=3
    ).eval()
    swapped = copy.deepcopy(model)
    assert use_aten_kernels(swapped) == 2 * 3 + 1  # per block: 2 LayerNorms and a GELU; the final norm
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(swapped(x), model(x))
    swapped.load_state_dict(model.state_dict())  # same keys, same shapes


def _layouts(shape):
    """A contiguous, a channels-last and a transposed (non-contiguous) tensor of `shape`."""
    x = torch.randn(shape)
    return {
        "contiguous": x,
        "channels_last": x.contiguous(memory_format=torch.channels_last),
        "transposed": torch.randn(shape[:-2] + shape[-2:][::-1]).transpose(-1, -2),
    }


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_custom_ops_pass_torch_opcheck(layout):
    """torch.library.opcheck: each op's fake gives the real op's shapes and strides (inductor trusts
    them), its schema and autograd registration hold, whatever the inputs' memory layout."""
    x = _layouts((2, 4, 6, 6))[layout]
    grad = _layouts((2, 4, 6, 6))[layout]
    weight, bias = torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True)
    _out, mean, rstd = torch.ops.aten.native_layer_norm(x, [6], weight, bias, 1e-5)
    pooled, indices = torch.ops.aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1], [1, 1], False)
    samples = [
        (aten_kernels.gelu, (x.requires_grad_(), "none")),
        (aten_kernels.gelu_backward, (grad, x.detach(), "tanh")),
        (aten_kernels.layer_norm, (x, [6], weight, bias, 1e-5)),
        (aten_kernels.layer_norm_backward, (grad, x.detach(), [6], mean, rstd, weight.detach(), bias.detach())),
        (aten_kernels.relu_backward, (grad, x.detach().relu())),
        (
            aten_kernels.relu_backward,
            (grad.contiguous(), x.detach().relu().contiguous(memory_format=torch.channels_last)),
        ),
        (aten_kernels.max_pool2d, (x, [3, 3], [2, 2], [1, 1], [1, 1], False)),
        (
            aten_kernels.max_pool2d_backward,
            (torch.randn_like(pooled), x.detach(), [3, 3], [2, 2], [1, 1], [1, 1], False, indices),
        ),
    ]
    for op, args in samples:
        torch.library.opcheck(op, args)
