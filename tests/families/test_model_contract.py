"""The timm model contract for every model this project registers: parametrized over the
registry, so registering a model puts it under these checks. Tiny sizes; the oracle is the model's
own full forward (forward_head(forward_features(x)) == forward(x)) and timm's own behavior."""

import math
import re

import pytest
import timm
import torch
from support.fresh_registry import fresh_registry
from timm.models import get_pretrained_cfg, model_entrypoint

import convit.diagnostics
from convbias.base.timm_compat import feature_take_indices
from convbias.families import FAMILIES, load_families

pytestmark = pytest.mark.usefixtures("single_thread")

load_families()  # every family's models in timm's registry: convit_*, deit_*_plus, tcnn_*, vanilla_cnn, efcn_*, ...
OURS = sorted(n for n in timm.list_models() if model_entrypoint(n).__module__.split(".")[0] in FAMILIES)
TCNN_CHECKED = ("tcnn_resnet18", "tcnn_resnet26d", "tcnn_resnet50", "tcnn_resnetrs50")
# a T-CNN entry is timm's ResNet plus the same transform: the listed depths stand for the family
CHECKED = [n for n in OURS if not n.startswith("tcnn_") or n in TCNN_CHECKED]


def _tiny(name: str) -> tuple[dict, int]:
    """Model kwargs and input side small enough for a unit test."""
    if name.startswith(("convit_", "deit_")):
        local = 0 if name.startswith("deit") else 1  # embed_dim per head: 8 instead of 48-64
        return dict(img_size=16, patch_size=4, depth=2, embed_dim=8, local_up_to_layer=local), 16
    if name.startswith("tcnn_"):  # a quarter of timm's widths: the contract is the same, building is 8x faster
        return dict(channels=(16, 32, 64, 128)), 32
    if "vanilla_cnn" in name:
        return dict(channels=4, img_size=8), 8
    return {}, 32  # alexnet_cifar family: built for 32x32


def _build(name: str, **kwargs) -> torch.nn.Module:
    tiny, _ = _tiny(name)
    return timm.create_model(name, **{**tiny, **kwargs}).eval()


def _input(name: str, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, _tiny(name)[1], _tiny(name)[1], generator=torch.Generator().manual_seed(0))


def test_registry_lists_every_family():
    assert {
        "convit_tiny",
        "deit_tiny_plus",
        "tcnn_resnet18",
        "vanilla_cnn",
        "efcn_vanilla_cnn",
        "fcn_alexnet_cifar",
    } <= set(OURS)


@pytest.mark.parametrize("name", CHECKED)
def test_registered_with_a_default_cfg(name):
    """timm's test selection (name_matches_cfg) needs a registered cfg; its input size runs the model."""
    cfg = get_pretrained_cfg(name)
    assert cfg is not None and cfg.input_size[0] == 3
    assert name in timm.list_models(name, name_matches_cfg=True)


@pytest.mark.parametrize("name", CHECKED)
def test_unknown_kwarg_is_a_type_error_naming_it(name):
    with pytest.raises(TypeError, match="not_a_model_arg"):
        timm.create_model(name, not_a_model_arg=1)


@pytest.mark.parametrize("name", CHECKED)
def test_device_and_dtype_kwargs(name):
    model = _build(name, device="cpu", dtype=torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}


@pytest.mark.parametrize("name", CHECKED)
def test_builds_on_the_meta_device_with_the_structure_of_a_real_model(name):
    """timm reads a model's structure on the meta device (no memory, no values): same names and shapes."""
    with torch.device("meta"):  # as timm's test_model_default_cfgs builds
        meta = _build(name, device="meta", dtype=torch.float64)
    assert {p.device.type for p in meta.parameters()} == {"meta"} and {p.dtype for p in meta.parameters()} == {
        torch.float64
    }
    assert {k: v.shape for k, v in meta.state_dict().items()} == {
        k: v.shape for k, v in _build(name).state_dict().items()
    }


@pytest.mark.parametrize("name", CHECKED)
def test_forward_on_the_meta_device_gives_the_shapes_of_a_real_forward(name):
    """timm's model tests run on the device TORCH_DEVICE names, the meta device included (as a meta-device
    initialization, FSDP's, meets it): forward_features, forward_head and forward compute shapes only there."""
    x = _input(name)
    with torch.no_grad():
        real = _build(name)
        want = (real.forward_features(x).shape, real(x).shape)
        meta = _build(name, device="meta")
        meta_x = x.to("meta")
        features = meta.forward_features(meta_x)
        got = (features.shape, meta(meta_x).shape)
        assert meta.forward_head(features).shape == want[1]
    assert got == want and features.device.type == "meta"


@pytest.mark.parametrize("name", CHECKED)
def test_forward_features_and_head_compose_to_forward(name):
    model = _build(name, num_classes=7)
    x = _input(name)
    with torch.no_grad():
        out = model(x)
        features = model.forward_features(x)
        pre_logits = model.forward_head(features, pre_logits=True)
        torch.testing.assert_close(model.forward_head(features), out)
    assert out.shape == (2, 7)
    assert pre_logits.shape == (2, model.head_hidden_size)
    channel_dim = -1 if features.ndim == 3 else 1  # token models: (B, N, C); CNNs: (B, C, H, W)
    assert features.shape[channel_dim] == model.num_features


@pytest.mark.parametrize("name", CHECKED)
def test_reset_classifier_follows_mode_and_removes_the_head(name):
    model = _build(name)
    model.reset_classifier(5)
    assert not model.get_classifier().training  # the model is in eval mode: a new head too
    x = _input(name)
    with torch.no_grad():
        assert model(x).shape == (2, 5)
        model.reset_classifier(0)
        pooled = model(x)
        assert pooled.shape == (2, model.head_hidden_size)
        torch.testing.assert_close(pooled, model.forward_head(model.forward_features(x), pre_logits=True))


# the models whose pre-logits are not a pooled map: a sequence (ViTs), flat layers (eFCN), an MLP after
# the flatten (AlexNet; timm's VGG is exempt from this check for the same reason)
NO_UNPOOLED_MAP = ("convit_", "deit_", "alexnet_cifar", "efcn_alexnet_cifar", "fcn_alexnet_cifar")


@pytest.mark.parametrize("name", [n for n in CHECKED if not n.startswith(NO_UNPOOLED_MAP)])
def test_removing_classifier_and_pooling_returns_the_last_map(name):
    """timm's contract: reset_classifier(0, '') and num_classes=0, global_pool='' give forward_features' map."""
    model = _build(name)
    x = _input(name)
    with torch.no_grad():
        features = model.forward_features(x)
        model.reset_classifier(0, "")
        torch.testing.assert_close(model(x), features)
        built = _build(name, num_classes=0, global_pool="")
        built.load_state_dict(model.state_dict())
        torch.testing.assert_close(built(x), features)
    assert features.dim() == 4


def test_alexnet_refuses_to_drop_the_flatten_its_mlp_reads():
    with pytest.raises(ValueError, match="after its flatten come drop1, fc1"):
        _build("alexnet_cifar").reset_classifier(0, "")


# T-CNN: one ResNet with basic blocks, one with bottlenecks (scripting every depth would be slow; what else
# differs among the depths is timm's own scriptable code)
SCRIPTED = [n for n in CHECKED if not n.startswith("tcnn_") or n in ("tcnn_resnet18", "tcnn_resnet50")]


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
@pytest.mark.parametrize("name", SCRIPTED)
def test_torchscript_matches_eager(name):
    """timm's models script; so do ours, also once they have run (eager forwards and the training's
    diagnostics fill the layers' caches of the token grid). A scripted GPSA layer runs the explicit path (the
    hot path's autograd Function does not script), the same function up to rounding."""
    model = _build(name)
    x = _input(name)
    with torch.no_grad():
        eager = model(x)
    convit.diagnostics.summary(model, x)  # the explicit path's caches too (attention maps, nonlocality)
    scripted = torch.jit.script(model)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), eager, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_torchscript_keeps_convit_test_time_masks():
    """A masked gate (a float gate_override instead of None) compiles and gives the eager output."""
    model = _build("convit_tiny", depth=3, local_up_to_layer=2)
    model.set_test_masks(content_layers=1)
    x = _input("convit_tiny")
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.script(model)(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
@pytest.mark.parametrize("name", ["convit_tiny", "deit_tiny_plus"])
def test_torchscript_features_only(name):
    """timm's getter wrapper scripts forward_intermediates, as timm's test_pruned_features_torchscript does."""
    model = _build(name, features_only=True, out_indices=(0,))
    x = _input(name, batch=1)
    with torch.no_grad():
        for got, want in zip(torch.jit.script(model)(x), model(x)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_efcn_masked_refuses_a_scripted_model():
    """`masked` switches LocalLinear layers, which a scripted model no longer has: one line, not a silent no-op."""
    from efcn.embedding import masked

    scripted = torch.jit.script(_build("efcn_vanilla_cnn"))
    with pytest.raises(ValueError, match="masked needs the eager model"), masked(scripted, "local"):
        pass


FEATURE_MODELS = [n for n in CHECKED if n.startswith(("convit_", "deit_", "tcnn_", "vanilla_cnn", "alexnet_cifar"))]


@pytest.mark.parametrize("name", FEATURE_MODELS)
def test_features_only_maps_match_feature_info_and_intermediates(name):
    token_model = name.startswith(("convit_", "deit_"))
    kwargs = dict(out_indices=2) if token_model else {}  # the tiny ViTs have 2 blocks (timm's default: last 3)
    torch.manual_seed(0)
    model = _build(name)
    torch.manual_seed(0)  # the same initialization: the wrapper only prunes what follows the taps
    features = _build(name, features_only=True, **kwargs)
    x = _input(name, batch=1)
    with torch.no_grad():
        maps = features(x)
    if not token_model:  # timm's test_model_forward_features: a CNN's default taps are at least three levels
        assert len(features.feature_info.channels()) >= 3
    assert [m.shape[1] for m in maps] == features.feature_info.channels()
    for m, reduction in zip(maps, features.feature_info.reduction()):  # timm's bounds (unpadded pools round down)
        assert x.shape[-1] / (2 * reduction) < m.shape[-1] <= math.ceil(x.shape[-1] / reduction) + 1
    if token_model:  # the getter wrapper is forward_intermediates on the same weights
        with torch.no_grad():
            taps = model.forward_intermediates(x, indices=2, intermediates_only=True)
        for got, want in zip(maps, taps):
            torch.testing.assert_close(got, want)


def test_feature_take_indices_is_timms_contract():
    """convbias.base.timm_compat's private timm import: fails loudly if timm changes it."""
    assert feature_take_indices(4, None) == ([0, 1, 2, 3], 3)
    assert feature_take_indices(4, 2) == ([2, 3], 3)
    assert feature_take_indices(4, [0, -1]) == ([0, 3], 3)


@pytest.mark.integration
@pytest.mark.slow
def test_importing_a_family_registers_exactly_its_names():
    """Each family's import adds (or, for convit, replaces) exactly its documented names in timm's registry:
    efcn the paper's two CNNs and their eFCN/FCN, transformed_cnn a tcnn_ for every ResNet of timm's resnet
    module (resnet<depth>[variant], resnetrs<depth>), convit ConViT-Ti/S/B (replacing timm's), their '+'
    sizes and the DeiT+ baselines. Imported one after the other in a fresh process, with warnings as errors."""
    probe = fresh_registry()
    added = {family: set(names) for family, names in probe["added"].items()}
    cnns = {"vanilla_cnn", "alexnet_cifar"}
    assert added["efcn"] == cnns | {f"{kind}_{cnn}" for kind in ("efcn", "fcn") for cnn in cnns}
    resnets = {n for n in probe["resnets"] if re.fullmatch(r"resnet\d+[a-z]?|resnetrs\d+", n)}
    assert {"resnet18", "resnet26d", "resnet50", "resnetrs50"} <= resnets
    assert added["transformed_cnn"] == {f"tcnn_{n}" for n in resnets}
    sizes = ("tiny", "small", "base")
    assert set(probe["timm_convits"]) == {f"convit_{size}" for size in sizes}  # the names replaced
    assert added["convit"] == {
        f"{kind}_{size}{plus}"
        for size in sizes
        for kind, plus in (("convit", ""), ("convit", "_plus"), ("deit", "_plus"))
    }


@pytest.mark.parametrize("name", [n for n in CHECKED if n.startswith(("efcn_", "fcn_"))])
def test_efcn_features_only_is_refused_with_one_line(name):
    with pytest.raises(ValueError, match=f"{name}: features_only is not supported: an eFCN is fully connected"):
        timm.create_model(name, features_only=True)
