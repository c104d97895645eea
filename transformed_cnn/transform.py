"""Recast the late 3x3 convolutions of a timm ResNet as GPSA layers (Transformed CNN, chapter 8).

`transform(cnn)` modifies the ResNet in place and returns it: every 3x3 convolution of the chosen
stages becomes a `GPSAConv2d` with 9 heads loaded from the filter; BatchNorm, shortcuts and every
other module stay the same objects, so an optimizer can keep their state (reparametrization during
training, Table 8.2).
"""

from __future__ import annotations

from collections.abc import Iterable

from timm.models.resnet import ResNet
from torch import nn

from .gpsa_conv import GPSAConv2d

# Initial (locality strength alpha, gating lambda) of the GPSA layers.
# 'paper' (Sec. 8.2): between convolution and free attention, so the T-CNN can leave locality.
# 'exact': sharp enough that each GPSA layer computes its convolution in float32: a head puts a
# weight about 4 exp(-alpha) on pixels next to its tap and the content attention gets
# 1 - sigmoid(lambda) ~ exp(-lambda), both about 1e-7 at 16.
INITS = {"paper": (1.0, 1.0), "exact": (16.0, 16.0)}

SUPPORTED = "a timm ResNet (resnet*, resnet*d, resnetrs*: timm.models.resnet.ResNet)"


def _stage_names(cnn: ResNet) -> list[str]:
    names = []
    while hasattr(cnn, f"layer{len(names) + 1}"):
        names.append(f"layer{len(names) + 1}")
    return names


def resolve_stages(cnn: ResNet, stages: int | str | Iterable[int] | None) -> list[int]:
    count = len(_stage_names(cnn))
    if stages is None:
        return [count]
    if isinstance(stages, str):  # command line: --model-kwargs stages=3,4
        try:
            stages = [int(part) for part in stages.split(",")]
        except ValueError:
            raise ValueError(f"stages must be stage numbers like 4 or '3,4', got {stages!r}") from None
    stages = [stages] if isinstance(stages, int) else list(stages)
    for stage in stages:
        if isinstance(stage, bool) or not isinstance(stage, int) or not 1 <= stage <= count:
            raise ValueError(
                f"stage {stage!r} is out of range: this ResNet has stages 1-{count} (layer1..layer{count})"
            )
    return sorted(set(stages))


def _strided_blocks(cnn: ResNet, stage: int):
    return [
        (name, block)
        for name, block in getattr(cnn, f"layer{stage}").named_children()
        if getattr(block, "stride", 1) != 1
    ]


def _check_strides_removable(cnn: ResNet, stage: int) -> None:
    """Raise a ValueError naming the block if `remove_stage_stride` cannot handle it."""
    for block_name, block in _strided_blocks(cnn, stage):
        where = f"layer{stage}.{block_name}"
        if not isinstance(getattr(block, "aa", nn.Identity()), nn.Identity):
            raise ValueError(
                f"{where} downsamples with an anti-aliasing layer ({type(block.aa).__name__}); "
                "keep_stride=False supports only strided convolutions: use keep_stride=True"
            )
        for index, module in enumerate(block.downsample or []):
            if not isinstance(
                module, (nn.AvgPool2d, nn.Conv2d, nn.Identity, nn.modules.batchnorm._NormBase, nn.GroupNorm)
            ):
                raise ValueError(
                    f"{where}.downsample[{index}] is a {type(module).__name__}: cannot remove its "
                    "stride (expected AvgPool2d, Conv2d or a norm layer)"
                )


def remove_stage_stride(cnn: ResNet, stage: int) -> None:
    """Turn the stride-2 convolution of `layer{stage}` and its shortcut into stride 1 (Sec. 8.2).

    This changes the network's function (the stage and all later ones run at twice the resolution);
    it is what the paper does before transforming a stage, following BoTNet. A ResNet-D / ResNet-RS
    shortcut (average pool + 1x1 conv) loses its pool, as timm builds it for stride 1."""
    _check_strides_removable(cnn, stage)
    for _, block in _strided_blocks(cnn, stage):
        for module in block.modules():
            if isinstance(module, nn.Conv2d) and module.stride != (1, 1):
                module.stride = (1, 1)
        for index, module in enumerate(block.downsample or []):
            if isinstance(module, nn.AvgPool2d):
                block.downsample[index] = nn.Identity()
        block.stride = 1
    for info in getattr(cnn, "feature_info", []):  # this stage and the later ones now run at twice the resolution
        if _stage_of(info.get("module", "")) >= stage:
            info["reduction"] //= 2


def _stage_of(module_name: str) -> int:
    """The stage number of a `layerN` feature module; 0 for the stem."""
    head = module_name.split(".")[0]
    return int(head[len("layer") :]) if head.startswith("layer") and head[len("layer") :].isdigit() else 0


def transform(
    cnn: nn.Module,
    stages: int | str | Iterable[int] | None = None,
    init: str = "paper",
    keep_stride: bool = False,
    locality_strength: float | None = None,
    gating: float | None = None,
) -> nn.Module:
    """Replace every 3x3 convolution of the chosen stages of a timm ResNet by a 9-head GPSA layer.

    Args:
        cnn: a timm ResNet (modified in place and returned).
        stages: stage numbers 1..4 (the `layerN` modules), an int, a list or a string '3,4';
            default: the last stage.
        init: 'paper' (alpha = 1, lambda = 1, Sec. 8.2) or 'exact' (sharp attention and gating: the
            T-CNN computes the CNN's function with keep_stride=True; with the default, the function of the CNN
            with the stride change below, which is another function).
        keep_stride: False (paper) turns each chosen stage's stride-2 conv and its shortcut into
            stride 1; True converts the strided conv exactly, with queries on the strided grid.
        locality_strength, gating: override the init's alpha and lambda.
    """
    if not isinstance(cnn, ResNet):
        raise ValueError(f"transform expects {SUPPORTED}; got {type(cnn).__module__}.{type(cnn).__name__}")
    if init not in INITS:
        raise ValueError(f"init must be one of {sorted(INITS)}, got {init!r}")
    default_alpha, default_lambda = INITS[init]
    alpha = default_alpha if locality_strength is None else float(locality_strength)
    lam = default_lambda if gating is None else float(gating)

    plan = {}  # checked for every stage before the model is touched
    for stage in resolve_stages(cnn, stages):
        name = f"layer{stage}"
        convs = [
            (n, m)
            for n, m in getattr(cnn, name).named_modules()
            if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)
        ]
        if not convs:
            raise ValueError(f"{name} has no 3x3 convolution left to transform (already transformed?)")
        for conv_name, conv in convs:
            if conv.groups != 1:
                raise ValueError(
                    f"{name}.{conv_name} is a grouped convolution (groups={conv.groups}); "
                    "a GPSA layer replaces only groups=1 convolutions"
                )
        if not keep_stride:
            _check_strides_removable(cnn, stage)
        plan[stage] = convs

    for stage, convs in plan.items():
        if not keep_stride:
            remove_stage_stride(cnn, stage)
        stage_module = getattr(cnn, f"layer{stage}")
        for conv_name, conv in convs:
            parent_name, _, attr = conv_name.rpartition(".")
            parent = stage_module.get_submodule(parent_name) if parent_name else stage_module
            setattr(parent, attr, GPSAConv2d.from_conv(conv, locality_strength=alpha, gating=lam))
    return cnn


def gpsa_layers(model: nn.Module) -> dict[str, GPSAConv2d]:
    """The GPSA layers of a Transformed CNN by module name, in network order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, GPSAConv2d)}
