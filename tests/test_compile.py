"""torch.compile(fullgraph=True) of whole models: inductor on CPU, forward and backward,
no graph break (fullgraph raises on the first one, the GPSA hot path's autograd Function included),
compiled outputs and gradients equal to eager's; both as plain torch.compile and as the engine's
--compile does it on a CPU (convbias.engine.compile.compile_model: ATen's kernels for some modules)."""

import pytest
import timm
import torch

import convit  # noqa: F401  (registers the models)
import efcn  # noqa: F401
import transformed_cnn  # noqa: F401
from convbias.engine.compile import compile_model

pytestmark = pytest.mark.slow

# tiny configurations; (model kwargs, input side)
CASES = {
    "convit_tiny": (dict(img_size=16, patch_size=4, depth=2, local_up_to_layer=1, embed_dim=8), 16),
    "deit_tiny_plus": (dict(img_size=16, patch_size=4, depth=2, embed_dim=8), 16),
    # one block a stage: the fewest kernels to compile of the ResNets; 32 px, since at 16 px the last
    # stage is 1x1 (BatchNorm over 2 values, gradients ill-conditioned)
    "tcnn_resnet10t": (dict(), 32),
    "efcn_vanilla_cnn": (dict(channels=4, img_size=8), 8),
    "vanilla_cnn": (dict(channels=4, img_size=8), 8),
}
# (model, compiled as the engine does on a CPU?): the engine's way where it swaps modules in a new way
# (GELU and LayerNorm; ReLU, BatchNorm and ATen's max-pool; the tiled max-pool), plain torch.compile for
# the others (compiling is the slowest part of the suite, so not every model both ways)
VARIANTS = [
    ("convit_tiny", False),
    ("convit_tiny", True),
    ("deit_tiny_plus", False),
    ("tcnn_resnet10t", True),
    ("efcn_vanilla_cnn", False),
    ("vanilla_cnn", True),
]


def _loss_and_grads(model: torch.nn.Module, fn, x: torch.Tensor):
    model.zero_grad(set_to_none=True)
    out = fn(x)
    out.square().mean().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name, engine", VARIANTS, ids=[f"{n}-{'engine' if e else 'torch'}" for n, e in VARIANTS])
def test_compiled_forward_backward_match_eager(name, engine):
    torch.manual_seed(0)
    kwargs, side = CASES[name]
    model = timm.create_model(name, num_classes=5, **kwargs).train()
    x = torch.randn(2, 3, side, side)
    eager_out, eager_grads = _loss_and_grads(model, model, x)
    torch._dynamo.reset()
    compiled = compile_model(model, "cpu", aten_kernels=engine, fullgraph=True)
    out, grads = _loss_and_grads(model, compiled, x)
    torch.testing.assert_close(out, eager_out, rtol=1e-4, atol=1e-4)
    assert grads.keys() == eager_grads.keys()
    for key in grads:
        scale = eager_grads[key].abs().max().item()  # relative to the tensor's own size: BN grads are large
        torch.testing.assert_close(grads[key], eager_grads[key], rtol=1e-4, atol=1e-4 * max(scale, 1.0), msg=key)
