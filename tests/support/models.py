"""The families' registered models checked against timm's contract, built tiny, with an input for each."""

import timm
import torch
from timm.models import model_entrypoint

from convbias.families import FAMILIES, load_families

load_families()  # every family's models in timm's registry: convit_*, deit_*_plus, tcnn_*, vanilla_cnn, efcn_*, ...
REGISTERED = sorted(n for n in timm.list_models() if model_entrypoint(n).__module__.split(".")[0] in FAMILIES)
TCNN_CHECKED = ("tcnn_resnet18", "tcnn_resnet26d", "tcnn_resnet50", "tcnn_resnetrs50")
# a T-CNN entry is timm's ResNet plus the same transform: the listed depths stand for the family
CHECKED = [n for n in REGISTERED if not n.startswith("tcnn_") or n in TCNN_CHECKED]


def tiny_kwargs_and_side(name: str) -> tuple[dict, int]:
    """Model kwargs and input side small enough for a unit test."""
    if name.startswith(("convit_", "deit_")):
        local = 0 if name.startswith("deit") else 1  # embed_dim per head: 8 instead of 48-64
        return dict(img_size=16, patch_size=4, depth=2, embed_dim=8, local_up_to_layer=local), 16
    if name.startswith("tcnn_"):  # a quarter of timm's widths: the contract is the same, building is 8x faster
        return dict(channels=(16, 32, 64, 128)), 32
    if "vanilla_cnn" in name:
        return dict(channels=4, img_size=8), 8
    return {}, 32  # alexnet_cifar family: built for 32x32


def build_tiny(name: str, **kwargs) -> torch.nn.Module:
    """The registered model ``name`` at its tiny size (``kwargs`` over it), in eval mode."""
    tiny, _ = tiny_kwargs_and_side(name)
    return timm.create_model(name, **{**tiny, **kwargs}).eval()


def tiny_input(name: str, batch: int = 2) -> torch.Tensor:
    """A seeded random batch of 3-channel images at the tiny input side of ``name``."""
    side = tiny_kwargs_and_side(name)[1]
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(0))
