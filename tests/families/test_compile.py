"""torch.compile(fullgraph=True) of whole vision transformers: inductor on CPU, forward and backward,
no graph break (fullgraph raises on the first one, the GPSA hot path's autograd Function included),
compiled outputs and gradients equal to eager's; both as plain torch.compile and as the engine's
--compile does it on a CPU (convbias.engine.model.compile.compile_model: ATen's kernels for some modules).
The CNN families are in test_compile_cnn.py: compiling is the slowest part of the suite, and two files
let pytest-xdist's --dist loadfile put them on two workers."""

import pytest

import convit  # noqa: F401  (registers the models)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

# tiny configurations; (model kwargs, input side)
CASES = {
    "convit_tiny": (dict(img_size=16, patch_size=4, depth=2, local_up_to_layer=1, embed_dim=8), 16),
    "deit_tiny_plus": (dict(img_size=16, patch_size=4, depth=2, embed_dim=8), 16),
}
# (model, compiled as the engine does on a CPU?): ConViT as CPU users compile it (GPSA under inductor, its
# GELUs and LayerNorms through ATen's kernels), DeiT as plain torch.compile does (inductor's own GELU and
# LayerNorm); one way each, since every compile of a model costs the suite tens of seconds on a cold cache
VARIANTS = [
    ("convit_tiny", True),
    ("deit_tiny_plus", False),
]


@pytest.mark.parametrize("name, engine", VARIANTS, ids=[f"{n}-{'engine' if e else 'torch'}" for n, e in VARIANTS])
def test_compiled_forward_backward_match_eager(name, engine, compiled_matches_eager):
    kwargs, side = CASES[name]
    compiled_matches_eager(name, kwargs, side, aten_kernels=engine)
