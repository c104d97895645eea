"""Every registered family through timm's pretrained path: save_for_hf, then timm.create_model('local-dir:DIR',
pretrained=True) or pretrained_cfg_overlay=dict(file=...), rebuilds the architecture from config.json's
model_args and gives the same logits (non-default sizes, class counts and transform options); T-CNN entries
tell a T-CNN checkpoint from a plain ResNet one by its keys; torch.export and timm's feature wrappers."""

import json
import re

import pytest
import timm
import torch
from support.models import CHECKED, build_tiny, tiny_input, tiny_kwargs_and_side
from timm.models import save_for_hf

pytestmark = pytest.mark.usefixtures("single_thread")

# non-default constructor arguments per family, on top of the contract's tiny sizes; T-CNNs: one ResNet-B
# (resnet18, stride on the 3x3 conv) and one ResNet-D (resnet26d, average-pool shortcut) with other options
TCNN_VARIANTS = {
    "tcnn_resnet18": dict(stages="3,4", keep_stride=True, init="exact"),
    "tcnn_resnet26d": dict(stages=[3, 4], locality_strength=2.0, gating=3.0),
}
# one name per model class: every other registered name is one of these classes at another width or
# depth (test_model_contract builds them all); tracing and saving cost seconds per model on 2 cores
REPRESENTATIVES = (
    "convit_tiny",
    "deit_tiny_plus",
    "vanilla_cnn",
    "alexnet_cifar",
    "efcn_vanilla_cnn",
    "fcn_vanilla_cnn",
)
ROUNDTRIP = [*REPRESENTATIVES, *TCNN_VARIANTS]
EXPORTED = [*REPRESENTATIVES, "tcnn_resnet18"]


def test_representatives_are_registered():
    assert set(ROUNDTRIP) <= set(CHECKED)


def _other_kwargs(name: str) -> dict:
    if name.startswith(("convit_", "deit_")):
        return dict(img_size=24, patch_size=6)  # the contract's tiny ViTs are 16/4
    if name.startswith("tcnn_"):
        return TCNN_VARIANTS[name]
    return {}


def _same_model(name: str, kwargs: dict, randomize_norms) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_tiny(name, num_classes=5, **kwargs)
    return randomize_norms(model) if any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) else model


@torch.no_grad()
@pytest.mark.parametrize("name", ROUNDTRIP)
def test_save_for_hf_then_local_dir_gives_the_same_logits(name, tmp_path, randomize_norms):
    kwargs = _other_kwargs(name)
    model = _same_model(name, kwargs, randomize_norms)
    tiny, tiny_side = tiny_kwargs_and_side(name)
    side = kwargs.get("img_size", tiny_side)
    x = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(1))
    save_for_hf(model, tmp_path, safe_serialization=True)
    saved = json.loads((tmp_path / "config.json").read_text())["model_args"]
    given = json.loads(json.dumps({**tiny, **kwargs, "num_classes": 5}))  # tuples as JSON lists
    assert {k: saved[k] for k in given} == {k: [v, v] if k == "img_size" else v for k, v in given.items()}
    loaded = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    assert type(loaded) is type(model) and loaded.pretrained_cfg["architecture"] == name
    assert torch.equal(loaded(x), model(x))
    # the same file through pretrained_cfg_overlay (what train.py --pretrained-file does), kwargs given again;
    # the overlay's num_classes says the file's head fits (timm resets a head of another class count)
    file = str(tmp_path / "model.safetensors")
    overlay = build_tiny(
        name, num_classes=5, pretrained=True, pretrained_cfg_overlay=dict(file=file, num_classes=5), **kwargs
    )
    assert torch.equal(overlay(x), model(x))


@torch.no_grad()
def test_tcnn_records_its_transform_options_in_full(tmp_path):
    """Defaults too: a saved config rebuilds the same T-CNN even if a default changes."""
    save_for_hf(timm.create_model("tcnn_resnet18", num_classes=3), tmp_path)
    args = json.loads((tmp_path / "config.json").read_text())["model_args"]
    assert {k: args[k] for k in ("stages", "init", "keep_stride", "num_classes")} == dict(
        stages=[4], init="paper", keep_stride=False, num_classes=3
    )


@torch.no_grad()
def test_tcnn_checkpoint_of_other_options_names_what_was_expected(tmp_path):
    save_for_hf(timm.create_model("tcnn_resnet18", stages="3,4"), tmp_path, safe_serialization=True)
    file = tmp_path / "model.safetensors"
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors does not fit this model \(tcnn_resnet18\): missing keys: layer3\.0\.conv1\.weight.*"
        r"\(expected tcnn_resnet18 \(stages=\[4\], init=paper, keep_stride=False\) or its CNN resnet18\)$",
    ):
        timm.create_model("tcnn_resnet18", pretrained=True, pretrained_cfg_overlay=dict(file=str(file)))


@torch.no_grad()
def test_a_plain_resnet_in_a_local_dir_is_transformed_as_from_a_file(tmp_path, randomize_norms):
    """A user's ResNet shared with save_for_hf loads into a T-CNN: CNN weights first, then the transform."""
    torch.manual_seed(0)
    cnn = randomize_norms(timm.create_model("resnet18", num_classes=4))
    save_for_hf(cnn, tmp_path)  # pytorch_model.bin, as timm writes by default
    config = json.loads((tmp_path / "config.json").read_text())
    config["architecture"] = "tcnn_resnet18"  # the same weights, offered to the T-CNN entry
    config["model_args"].update(init="exact", keep_stride=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tcnn = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    assert ((tcnn(x) - cnn(x)).norm() / cnn(x).norm()).item() < 1e-4


# timm's builder accepts these for its ResNets; 'getter' runs ResNet.forward_intermediates
FEATURE_CLASSES = ("list", "dict", "hook", "fx", "getter")


@torch.no_grad()
def test_tcnn_features_only_with_every_feature_cls_gives_the_forward_intermediates():
    torch.manual_seed(0)
    model = timm.create_model("tcnn_resnet18").eval()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    want = model.forward_intermediates(x, indices=[1, 3, 4], intermediates_only=True)
    for feature_cls in FEATURE_CLASSES:
        torch.manual_seed(0)  # the same initialization
        features = timm.create_model(
            "tcnn_resnet18", features_only=True, feature_cls=feature_cls, out_indices=(1, 3, 4)
        )
        maps = features.eval()(x)
        maps = list(maps.values()) if isinstance(maps, dict) else maps
        assert features.feature_info.reduction() == [4, 16, 16], feature_cls  # the last stage's stride removed
        for got, expected in zip(maps, want, strict=True):
            torch.testing.assert_close(got, expected)


def test_tcnn_unknown_feature_cls_fails_as_for_timms_resnet():
    """timm's builder makes the feature wrapper of both: the same refusal."""
    with pytest.raises(Exception) as refused:  # whatever timm raises
        timm.create_model("resnet18", features_only=True, feature_cls="nope")
    with pytest.raises(type(refused.value), match=re.escape(str(refused.value))):
        timm.create_model("tcnn_resnet18", features_only=True, feature_cls="nope")


@torch.no_grad()
@pytest.mark.parametrize("name", EXPORTED)
def test_torch_export_matches_eager_with_a_dynamic_batch(name):
    """torch.export (the graph ONNX and AOTInductor start from) for every family, batch left dynamic."""
    model = build_tiny(name)
    x = tiny_input(name)
    program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    other = tiny_input(name, batch=3)
    torch.testing.assert_close(program.module()(other), model(other), rtol=1e-5, atol=1e-5)
