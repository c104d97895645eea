"""The families' registry modules (convit.models, transformed_cnn.models, efcn.models) and the diagnostics of the
T-CNN and the eFCN (transformed_cnn.diagnostics, efcn.diagnostics), each against an oracle: timm's registry and
its builder's contract (the cfg names the model's own first layer and classifier), the model each entry is the
seeded image of (timm's ResNet transformed, the CNN the eFCN embeds), and closed forms of the diagnostics at
init (a sharp GPSA head selects its tap's pixel; one changed weight gives a deviation computed by hand)."""

from __future__ import annotations

import math

import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed
from timm.models import get_model_args, get_pretrained_cfg, model_entrypoint
from timm.models.resnet import ResNet

import convit.models
import efcn.diagnostics
import efcn.models
import transformed_cnn.diagnostics
import transformed_cnn.models
from convbias.families import load_families
from efcn.embedding import EmbeddedFCN
from transformed_cnn.gpsa_conv import GPSAConv2d
from transformed_cnn.transform import transform

pytestmark = pytest.mark.usefixtures("single_thread")

TINY_CONVIT = dict(patch_size=2, depth=2, local_up_to_layer=1, embed_dim=8, img_size=8)


@pytest.fixture(scope="module", autouse=True)
def registered():
    load_families()  # every family's models in timm's registry, as every command does first


# -- the registry entries ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "module, built",
    [
        (convit.models, lambda arch: convit.models.ConViT),
        (
            efcn.models,
            lambda arch: {"vanilla_cnn": efcn.models.VanillaCNN, "alexnet_cifar": efcn.models.AlexNetCIFAR}.get(
                arch, EmbeddedFCN
            ),
        ),
    ],
)
def test_every_entry_of_the_module_is_timms_and_builds_its_class(module, built):
    assert module.default_cfgs  # the table the module registers from
    for arch, default in module.default_cfgs.items():
        assert timm.is_model(arch) and model_entrypoint(arch).__module__ == module.__name__, arch
        with torch.device("meta"):  # the class only: no memory, no init time
            model = timm.create_model(arch)
        assert type(model) is built(arch), arch
        registered = get_pretrained_cfg(arch).to_dict()
        table = default.cfgs[default.tags[0]].to_dict()
        named = ("architecture", "tag", "hf_hub_id")  # filled in by timm's registration ('timm/' expanded)
        assert {k: v for k, v in registered.items() if k not in named} == {
            k: v for k, v in table.items() if k not in named
        }


def test_the_pretrained_cfgs_are_the_published_weights_and_the_papers_preprocessing():
    for size in ("tiny", "small", "base"):  # timm's ConViT weights on the Hub; any input size a patch multiple
        cfg = get_pretrained_cfg(f"convit_{size}")
        assert (cfg.tag, cfg.hf_hub_id, cfg.fixed_input_size) == ("fb_in1k", f"timm/convit_{size}.fb_in1k", False)
    for arch in efcn.models.default_cfgs:  # fully connected: the 32x32 input the eFCN was built for
        cfg = get_pretrained_cfg(arch)
        assert (cfg.input_size, cfg.fixed_input_size, cfg.mean, cfg.std) == ((3, 32, 32), True, (0.5,) * 3, (0.5,) * 3)


@pytest.mark.parametrize(
    "name, kwargs, side",
    [
        ("convit_tiny", TINY_CONVIT, 8),
        ("deit_tiny_plus", dict(TINY_CONVIT, local_up_to_layer=0), 8),
        ("tcnn_resnet18", {}, 32),
        ("vanilla_cnn", dict(channels=2), 32),
        ("alexnet_cifar", {}, 32),
        ("efcn_vanilla_cnn", dict(channels=2, depth=1, img_size=8), 8),
        ("fcn_vanilla_cnn", dict(channels=2, depth=1, img_size=8), 8),
    ],
)
def test_the_cfg_names_the_models_first_layer_and_classifier(name, kwargs, side):
    """What timm's load_pretrained adapts (the input channels, the classifier) is found by these names."""
    model = timm.create_model(name, num_classes=5, **kwargs).eval()
    cfg = model.pretrained_cfg
    assert model.get_submodule(cfg["classifier"]) is model.get_classifier()
    first = []
    hooks = [
        module.register_forward_pre_hook(lambda module, _: first.append(module))
        for module in model.modules()
        if not any(True for _ in module.children()) and any(True for _ in module.parameters())  # a layer
    ]
    with torch.no_grad():
        model(torch.randn(1, 3, side, side))
    for hook in hooks:
        hook.remove()
    assert first[0] is model.get_submodule(cfg["first_conv"])


@pytest.mark.parametrize("name, pool", [("vanilla_cnn", (4, 4)), ("alexnet_cifar", (1, 1))])
def test_the_cnns_pool_size_is_their_last_maps(name, pool):
    """The paper's CNNs flatten their last map: its size at the cfg's 32x32 input, 32 / 2^3 for the VanillaCNN."""
    model = timm.create_model(name, channels=2) if name == "vanilla_cnn" else timm.create_model(name)
    with torch.no_grad():
        features = model.eval().forward_features(torch.randn(1, *model.pretrained_cfg["input_size"]))
    assert model.pretrained_cfg["pool_size"] == pool == tuple(features.shape[-2:])


# -- convit.models ------------------------------------------------------------------------------------------------
def test_convit_checkpoints_resample_pos_embed_as_the_forward_does():
    """Weights of a 4x4 token grid loaded into a 6x6 model (checkpoint_filter_fn) compute what the 4x4 model
    computes on the larger input, where it resamples its position embedding at run time."""
    small = dict(patch_size=4, depth=2, local_up_to_layer=1, embed_dim=8)
    torch.manual_seed(0)
    source = timm.create_model("convit_tiny", img_size=16, **small).eval()
    target = timm.create_model("convit_tiny", img_size=24, **small).eval()
    filtered = convit.models.checkpoint_filter_fn(source.state_dict(), target)
    expected = resample_abs_pos_embed(source.pos_embed, new_size=[6, 6], old_size=[4, 4], num_prefix_tokens=0)
    torch.testing.assert_close(filtered["pos_embed"], expected, rtol=0, atol=0)
    target.load_state_dict(filtered)
    x = torch.randn(2, 3, 24, 24)
    with torch.no_grad():
        torch.testing.assert_close(target(x), source(x))
    not_square = dict(source.state_dict(), pos_embed=torch.zeros(1, 12, source.embed_dim))
    with pytest.raises(ValueError, match="12 tokens, not a square grid"):
        convit.models.checkpoint_filter_fn(not_square, target)


def test_convit_refuses_a_pool_as_timms_vits_do_and_as_this_project_does():
    model = timm.create_model("convit_tiny", **TINY_CONVIT)
    for caught in (AssertionError, ValueError):  # timm's ViTs assert; this project raises ValueErrors
        with pytest.raises(caught, match="global_pool='max' must be one of"):
            model.reset_classifier(0, "max")
    with pytest.raises(convit.models.PoolError, match=r"\('avg', ''\)"):  # no class token: no 'token' pool
        timm.create_model("convit_tiny", **dict(TINY_CONVIT, local_up_to_layer=2), global_pool="avg").reset_classifier(
            0, "token"
        )


# -- transformed_cnn.models ---------------------------------------------------------------------------------------
def equal_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(
    "kwargs, stages, defaults",
    [
        ({}, [4], dict(stages=[4], init="paper", keep_stride=False)),
        (dict(stages="3,4", init="exact"), [3, 4], dict(keep_stride=False)),
    ],
)
def test_a_tcnn_entry_is_timms_seeded_resnet_transformed_and_rebuilds_from_its_args(kwargs, stages, defaults):
    """The reconstruction arguments (what save_for_hf writes) hold the transform's defaults resolved beside the
    options given (timm's create_model keeps those as they were given), and rebuild the same T-CNN."""
    torch.manual_seed(0)
    tcnn = timm.create_model("tcnn_resnet18", num_classes=5, **kwargs)
    torch.manual_seed(0)
    reference = transform(timm.create_model("resnet18", num_classes=5), **kwargs)
    assert isinstance(tcnn, ResNet) and equal_state(tcnn, reference)
    rebuilt_from = get_model_args(tcnn)  # with the model's pooling, as timm records every model's
    assert rebuilt_from == dict(num_classes=5, in_chans=3, global_pool="avg", **kwargs, **defaults)
    torch.manual_seed(0)
    assert equal_state(timm.create_model("tcnn_resnet18", **rebuilt_from), tcnn)
    transformed = {name for name, m in tcnn.named_modules() if isinstance(m, GPSAConv2d)}
    assert {name.split(".")[0] for name in transformed} == {f"layer{s}" for s in stages}


# -- efcn.models --------------------------------------------------------------------------------------------------
def test_an_efcn_entry_computes_the_seeded_cnn_it_embeds():
    kwargs = dict(channels=3, in_chans=1, img_size=8, num_classes=4)
    torch.manual_seed(0)
    cnn = timm.create_model("vanilla_cnn", **kwargs).eval()
    torch.manual_seed(0)
    lifted = timm.create_model("efcn_vanilla_cnn", **kwargs).eval()
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(lifted(x), cnn(x), rtol=1e-5, atol=1e-5)
    c, side = kwargs["channels"], 8 // 2**3  # Sec. 6.2.2: three (3x3 conv, ReLU, 2x2 pool) stages, one Linear
    assert sum(p.numel() for p in cnn.parameters()) == (9 * 1 * c + c) + 2 * (9 * c * c + c) + (c * side**2 * 4 + 4)
    torch.manual_seed(0)
    fcn = timm.create_model("fcn_vanilla_cnn", **kwargs)  # the same architecture, PyTorch's default init
    assert {k: v.shape for k, v in fcn.state_dict().items()} == {k: v.shape for k, v in lifted.state_dict().items()}
    assert not equal_state(fcn, lifted)


# -- transformed_cnn.diagnostics ----------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("query, at", [((0.0, 0.0), (0, 0)), ((0.9, 0.9), (3, 3))])
def test_a_sharp_tcnn_heads_map_is_its_taps_pixel_or_nothing_off_the_map(tcnn_images, query, at):
    """With the 'exact' init each head's attention sits on its tap (about 1e-7 elsewhere): a query in a corner
    of the 4x4 maps of layer4 (its stride removed) sees its tap's pixel, or only padding where the tap is off
    the map, whose mass the maps leave out."""
    tcnn = timm.create_model("tcnn_resnet18", init="exact")
    maps = transformed_cnn.diagnostics.query_attention_maps(tcnn, tcnn_images, query=query)
    assert list(maps) == [f"layer4.{b}.conv{c}" for b in (0, 1) for c in (1, 2)]  # every 3x3 conv of layer4
    for name, attn in maps.items():
        assert attn.shape == (2, 9, 4, 4)
        offsets = tcnn.get_submodule(name).tap_offsets().long().tolist()
        for head, (dx, dy) in enumerate(offsets):
            row, col = at[0] + dy, at[1] + dx
            expected = torch.zeros(2, 4, 4)
            if 0 <= row < 4 and 0 <= col < 4:
                expected[:, row, col] = 1.0
            torch.testing.assert_close(attn[:, head], expected, rtol=0, atol=1e-5)
    drawn, queries, gates = transformed_cnn.diagnostics.query_maps(tcnn, tcnn_images[0], query)
    assert queries == {name: (4 * query[0], 4 * query[1]) for name in maps}
    assert gates == {name: [pytest.approx(1 / (1 + math.exp(-16.0)))] * 9 for name in maps}  # sigmoid(lambda=16)
    assert all(torch.equal(drawn[name], maps[name][0]) for name in maps)


@torch.no_grad()
def test_the_familys_maps_are_the_centres_for_a_tcnn_and_none_for_another_model(tcnn_images):
    tcnn = timm.create_model("tcnn_resnet18")
    image = tcnn_images[0]
    maps, queries, gates = transformed_cnn.diagnostics.query_maps_or_none(tcnn, image, query=(2, 5), layers=[1])
    centre = transformed_cnn.diagnostics.query_maps(tcnn, image)
    assert queries == centre[1] and gates == centre[2]
    assert all(torch.equal(maps[name], centre[0][name]) for name in centre[0])
    for other in (timm.create_model("resnet18"), timm.create_model("convit_tiny", **TINY_CONVIT)):
        assert transformed_cnn.diagnostics.query_maps_or_none(other, image[:, :8, :8]) is None
    with pytest.raises(ValueError, match=r"query must be a relative \(row, col\) position in \[0, 1\)"):
        transformed_cnn.diagnostics.query_attention_maps(tcnn, tcnn_images, query=(1.0, 0.5))


# -- efcn.diagnostics ---------------------------------------------------------------------------------------------
def embedded_cnn() -> tuple[torch.nn.Module, EmbeddedFCN]:
    """A VanillaCNN of two (3x3 conv, pool) stages on 8x8 maps and its eFCN (conv1 on 8x8, conv2 on 4x4)."""
    torch.manual_seed(0)
    cnn = timm.create_model("vanilla_cnn", channels=2, depth=2, in_chans=1, img_size=8, num_classes=3).eval()
    return cnn, efcn.embed(cnn, (1, 8, 8))


def squared_norm(conv: torch.nn.Conv2d, side: int) -> float:
    """||W||^2 of a 3x3, padding 1 conv embedded on a side x side map: tap (dy, dx) is copied onto
    (side - |dy|) (side - |dx|) pixel pairs."""
    w = conv.weight.detach().double()
    return sum(
        (side - abs(ky - 1)) * (side - abs(kx - 1)) * w[:, :, ky, kx].square().sum().item()
        for ky in range(3)
        for kx in range(3)
    )


@torch.no_grad()
def test_one_off_local_weight_gives_the_deviation_computed_by_hand():
    cnn, model = embedded_cnn()
    assert efcn.diagnostics.deviation(model) == {"conv1": 0.0, "conv2": 0.0, "total": 0.0}  # right after embedding
    n1, n2, v = squared_norm(cnn.conv1, 8), squared_norm(cnn.conv2, 4), 0.3
    layer = efcn.diagnostics.local_layers(model)["layers.conv1"]
    layer.weight4d()[1, 0, 0, 63] += v  # out pixel (0, 0), in pixel (7, 7): far outside the 3x3 window
    deviation = efcn.diagnostics.deviation(model)
    assert deviation["conv1"] == pytest.approx(v / math.sqrt(n1 + v**2), rel=1e-6)
    assert deviation["conv2"] == 0.0
    assert deviation["total"] == pytest.approx(v / math.sqrt(n1 + v**2 + n2), rel=1e-6)
    assert efcn.diagnostics.weight_sharing_violation(model)["total"] == 0.0  # the local weights are untouched


@torch.no_grad()
def test_one_changed_copy_of_a_tap_gives_the_weight_sharing_violation_computed_by_hand():
    """Changing one of the 64 copies of conv1's centre tap by u leaves a residual u^2 (1 - 1/64) off the
    weight-sharing subspace (the projection replaces each copy by the mean of its tap's copies)."""
    cnn, model = embedded_cnn()
    n1, n2, u = squared_norm(cnn.conv1, 8), squared_norm(cnn.conv2, 4), 0.2
    w0 = cnn.conv1.weight[0, 0, 1, 1].double().item()
    pixel = 3 * 8 + 3
    efcn.diagnostics.local_layers(model)["layers.conv1"].weight4d()[0, pixel, 0, pixel] += u
    local = n1 - w0**2 + (w0 + u) ** 2
    residual = u**2 * (1 - 1 / 64)
    violation = efcn.diagnostics.weight_sharing_violation(model)
    assert violation["conv1"] == pytest.approx(math.sqrt(residual / local), rel=1e-5)
    assert violation["conv2"] == 0.0
    assert violation["total"] == pytest.approx(math.sqrt(residual / (local + n2)), rel=1e-5)
    assert efcn.diagnostics.deviation(model)["total"] == 0.0  # still local
    summary = efcn.diagnostics.summary(model)
    assert summary == {
        "deviation/conv1": 0.0,
        "deviation/conv2": 0.0,
        "deviation/total": 0.0,
        "weight_sharing/total": violation["total"],
    }
    assert efcn.diagnostics.summary(cnn) == {}  # not an eFCN
    with pytest.raises(ValueError, match="VanillaCNN has no embedded conv layers"):
        efcn.diagnostics.deviation(cnn)
