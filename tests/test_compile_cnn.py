"""torch.compile(fullgraph=True) of the CNN families (T-CNN, eFCN, the plain CNN): inductor on CPU,
forward and backward, no graph break, compiled outputs and gradients equal to eager's; as plain
torch.compile and as the engine's --compile does it on a CPU (ATen's kernels for ReLU, BatchNorm and
max-pool, the tiled max-pool). The vision transformers are in test_compile.py."""

import pytest

import efcn  # noqa: F401  (registers the models)
import transformed_cnn  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

# tiny configurations; (model kwargs, input side)
CASES = {
    # one block a stage and a one-conv stem without pooled shortcuts: the fewest kernels to compile of the
    # ResNets; 32 px, since at 16 px the last stage is 1x1 (BatchNorm over 2 values, gradients ill-conditioned)
    "tcnn_resnet10t": (dict(stem_type="", avg_down=False), 32),
    "efcn_vanilla_cnn": (dict(channels=4, img_size=8), 8),
    "vanilla_cnn": (dict(channels=4, img_size=8), 8),
}
# (model, compiled as the engine does on a CPU?)
VARIANTS = [
    ("tcnn_resnet10t", True),
    ("efcn_vanilla_cnn", False),
    ("vanilla_cnn", True),
]


@pytest.mark.parametrize("name, engine", VARIANTS, ids=[f"{n}-{'engine' if e else 'torch'}" for n, e in VARIANTS])
def test_compiled_forward_backward_match_eager(name, engine, compiled_matches_eager):
    kwargs, side = CASES[name]
    compiled_matches_eager(name, kwargs, side, aten_kernels=engine)
