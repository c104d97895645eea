"""torch.compile(fullgraph=True) of the CNN families (T-CNN, eFCN, the plain CNN): inductor on CPU,
forward and backward, no graph break, compiled outputs and gradients equal to eager's; as plain
torch.compile and as the engine's --compile does it on a CPU (ATen's kernels for ReLU, BatchNorm and
max-pool, the tiled max-pool). The vision transformers are in test_compile.py.

The T-CNN's inductor numerics are checked on its transformed stage (GPSA layers inside timm's ResNet block),
the code this package adds; that the whole T-CNN compiles without a graph break and trains as eager does is
test_train_compile.py's. Each kernel costs the suite about 1.5 s on a cold cache: the stage has 32, the
whole ResNet 52."""

import pytest

import efcn  # noqa: F401  (registers the models)
import transformed_cnn  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

# tiny configurations; (model kwargs, input side, the part compiled: None for the whole model)
CASES = {
    # one block a stage and a one-conv stem; 64 px, so that the transformed stage sees 4x4 activations (at
    # 16 px it would see 1x1: BatchNorm over 2 values, gradients ill-conditioned)
    "tcnn_resnet10t": (dict(stem_type="", avg_down=False), 64, "layer4"),
    "efcn_vanilla_cnn": (dict(channels=4, img_size=8), 8, None),
    "vanilla_cnn": (dict(channels=4, img_size=8), 8, None),
}
# (model, compiled as the engine does on a CPU?)
VARIANTS = [
    ("tcnn_resnet10t", True),
    ("efcn_vanilla_cnn", False),
    ("vanilla_cnn", True),
]


@pytest.mark.parametrize("name, engine", VARIANTS, ids=[f"{n}-{'engine' if e else 'torch'}" for n, e in VARIANTS])
def test_compiled_forward_backward_match_eager(name, engine, compiled_matches_eager):
    kwargs, side, part = CASES[name]
    compiled_matches_eager(name, kwargs, side, aten_kernels=engine, part=part)
