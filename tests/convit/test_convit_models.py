"""ConViT models: timm interchange, registry, pretrained loading, resolutions, ablation switches, bad input."""

import copy

import pytest
import timm
import torch
from safetensors.torch import save_file
from support.fresh_registry import fresh_registry
from timm.layers import resample_abs_pos_embed
from timm.models import convit as timm_convit
from timm.optim import create_optimizer_v2

import convit
from convbias.gpsa import kernel_offsets, paper_kernel_offsets
from convit import ConViT

# name: (heads, width, GPSA blocks, millions of parameters in Table 7.1)
ARCHITECTURES = {
    "convit_tiny": (4, 192, 10, 6),
    "convit_tiny_plus": (4, 256, 10, 10),
    "convit_small": (9, 432, 10, 27),
    "convit_small_plus": (9, 576, 10, 48),
    "convit_base": (16, 768, 10, 86),
    "convit_base_plus": (16, 1024, 10, 152),
    "deit_tiny_plus": (4, 256, 0, 10),
    "deit_small_plus": (9, 576, 0, 48),
    "deit_base_plus": (16, 1024, 0, 152),
}
SMALL = dict(img_size=32, patch_size=8, num_classes=10)  # 4x4 tokens: fast

pytestmark = pytest.mark.usefixtures("single_thread")


def _timm_convit_tiny(**kwargs) -> torch.nn.Module:
    """timm's own ConViT-Ti (its embed_dim is per head), randomly initialized."""
    return timm_convit.ConVit(embed_dim=48, num_heads=4, local_up_to_layer=10, **kwargs).eval()


def _randomize_gpsa(model: torch.nn.Module) -> None:
    """Move gates and positional weights off their init so that every term matters."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gating_param", "pos_proj.weight")):
                param.add_(torch.randn_like(param))


def _token_counts(model: ConViT, x: torch.Tensor) -> list:
    counts = []
    hooks = [b.register_forward_pre_hook(lambda m, args: counts.append(args[0].shape[1])) for b in model.blocks]
    model(x)
    for hook in hooks:
        hook.remove()
    return counts


def _train_step(model: torch.nn.Module, x: torch.Tensor) -> None:
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-2, weight_decay=0.05)
    model.train()
    torch.nn.functional.cross_entropy(model(x), torch.arange(len(x)) % model.num_classes).backward()
    optimizer.step()


# -- timm interchange ------------------------------------------------------------------------------
def test_timm_convit_tiny_weights_load_strictly_and_give_the_same_logits():
    torch.manual_seed(0)
    theirs = _timm_convit_tiny()
    _randomize_gpsa(theirs)
    ours = timm.create_model("convit_tiny").eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        expected = theirs(x)
        torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-4)

        # and ours into theirs (our conv init differs from timm's: the function follows the weights)
        ours2 = timm.create_model("convit_tiny").eval()
        _randomize_gpsa(ours2)
        theirs.load_state_dict(ours2.state_dict(), strict=True)
        torch.testing.assert_close(theirs(x), ours2(x), rtol=0, atol=1e-4)


def test_deit_configuration_matches_timm_convit_without_gpsa():
    torch.manual_seed(0)
    theirs = timm_convit.ConVit(embed_dim=64, num_heads=4, local_up_to_layer=0, **SMALL).eval()
    ours = timm.create_model("deit_tiny_plus", **SMALL).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-4)


def test_pretrained_loads_offline_through_timm_from_a_local_file(tmp_path):
    torch.manual_seed(0)
    theirs = _timm_convit_tiny()
    _randomize_gpsa(theirs)
    path = tmp_path / "convit_tiny.safetensors"
    save_file(theirs.state_dict(), str(path))
    x = torch.randn(2, 3, 224, 224)

    ours = timm.create_model("convit_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(path))).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-4)

    # timm's pretrained cfg for the name is followed (same weights on the hub, same preprocessing)
    timm_cfg = timm_convit.default_cfgs["convit_tiny"].cfgs["fb_in1k"]
    our_cfg = ours.pretrained_cfg
    assert our_cfg["hf_hub_id"] == "timm/convit_tiny.fb_in1k"
    for key in (
        "url",
        "num_classes",
        "input_size",
        "mean",
        "std",
        "crop_pct",
        "interpolation",
        "first_conv",
        "classifier",
    ):
        assert our_cfg[key] == getattr(timm_cfg, key), key

    # another resolution and head: pos_embed resampled by checkpoint_filter_fn, classifier dropped
    resized = timm.create_model(
        "convit_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), img_size=160, num_classes=10
    )
    expected_pos = resample_abs_pos_embed(theirs.pos_embed, new_size=(10, 10), old_size=(14, 14), num_prefix_tokens=0)
    torch.testing.assert_close(resized.pos_embed, expected_pos)
    torch.testing.assert_close(resized.blocks[3].attn.pos_proj.weight, theirs.blocks[3].attn.pos_proj.weight)
    assert resized.head.out_features == 10


@pytest.mark.integration
@pytest.mark.slow
def test_registration_names_our_module_without_warnings():
    """In a fresh process, with every warning an error: importing convit points every name of ARCHITECTURES
    (timm's convit_* included) at our module, convit_tiny builds our class, and timm's pretrained tags of
    ConViT-Ti/S/B stay listed."""
    probe = fresh_registry()
    assert probe["stderr"] == ""
    assert {probe["entry_modules"][name] for name in ARCHITECTURES} == {"convit.models"}
    assert probe["built_convit_module"] == "convit.models"
    assert probe["pretrained_convits"] == ["convit_base.fb_in1k", "convit_small.fb_in1k", "convit_tiny.fb_in1k"]


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_registered_architectures(name):
    heads, width, num_gpsa, millions = ARCHITECTURES[name]
    with torch.device("meta"):
        model = timm.create_model(name)
    assert isinstance(model, ConViT)
    assert (model.embed_dim, len(model.blocks), len(model.gpsa_layers())) == (width, 12, num_gpsa)
    assert [b.use_gpsa for b in model.blocks] == [i < num_gpsa for i in range(12)]
    assert all(b.attn.num_heads == heads for b in model.blocks)
    assert model.pos_embed is not None
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(millions, rel=0.05)


def test_class_token_joins_after_the_last_gpsa_block():
    model = timm.create_model("convit_tiny", **SMALL)
    assert _token_counts(model, torch.randn(1, 3, 32, 32)) == [16] * 10 + [17] * 2
    model = timm.create_model("convit_tiny", local_up_to_layer=4, **SMALL)
    assert _token_counts(model, torch.randn(1, 3, 32, 32)) == [16] * 4 + [17] * 8
    assert _token_counts(timm.create_model("deit_tiny_plus", **SMALL), torch.randn(1, 3, 32, 32)) == [17] * 12
    all_gpsa = timm.create_model("convit_tiny", local_up_to_layer=12, global_pool="avg", **SMALL)
    assert all_gpsa.cls_token is None  # no block left for it: average pooling of the patch tokens
    assert _token_counts(all_gpsa, torch.randn(1, 3, 32, 32)) == [16] * 12


@pytest.mark.parametrize("kwargs", [dict(embed_dim=16), dict(embed_dim=16, num_heads=2), dict(num_heads=9)])
def test_width_kwargs_keep_timms_meaning(kwargs):
    """`embed_dim` is per head at the registry entry, as for timm's ConVit: the same call builds the same
    architecture (every parameter's name and shape) with or without `import convit`."""
    ours = timm.create_model("convit_tiny", **SMALL, **kwargs)
    theirs = timm_convit.ConVit(**{**dict(embed_dim=48, num_heads=4, local_up_to_layer=10), **SMALL, **kwargs})
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    assert ours.embed_dim == theirs.embed_dim == kwargs.get("embed_dim", 48) * kwargs.get("num_heads", 4)


def test_common_kwargs_are_accepted():
    model = timm.create_model(
        "convit_small",
        img_size=48,
        patch_size=12,
        in_chans=1,
        num_classes=7,
        drop_path_rate=0.2,
        local_up_to_layer=3,
        locality_strength=2.0,
    )
    assert len(model.gpsa_layers()) == 3
    assert model.blocks[-1].drop_path.drop_prob == pytest.approx(0.2)
    assert model.gpsa_layers()[0].pos_proj.weight[0, 2].item() == pytest.approx(-2.0)  # alpha = 2
    assert model(torch.randn(2, 1, 48, 48)).shape == (2, 7)


def test_feature_extraction_matches_timm_convit():
    torch.manual_seed(0)
    theirs = timm_convit.ConVit(embed_dim=48, num_heads=4, local_up_to_layer=10, **SMALL).eval()
    _randomize_gpsa(theirs)
    ours = timm.create_model("convit_tiny", **SMALL).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        for kwargs in (dict(indices=[2, 9, 11]), dict(indices=3, norm=True, output_fmt="NLC")):
            final, maps = ours.forward_intermediates(x, **kwargs)
            final_ref, maps_ref = theirs.forward_intermediates(x, **kwargs)
            torch.testing.assert_close(final, final_ref, rtol=0, atol=1e-5)
            for got, expected in zip(maps, maps_ref, strict=True):
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        features = timm.create_model("convit_tiny", features_only=True, out_indices=(3, 11), **SMALL)
        kept = features.model.state_dict()
        features.model.load_state_dict({k: v for k, v in theirs.state_dict().items() if k in kept}, strict=True)
        got = features(x)
        expected = theirs.forward_intermediates(x, indices=[3, 11], intermediates_only=True)
        assert [t.shape for t in got] == [(2, 192, 4, 4)] * 2
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


# -- grids and resolutions -------------------------------------------------------------------------
def test_resolution_change_in_forward_equals_a_model_built_at_that_size():
    torch.manual_seed(0)
    small = timm.create_model("convit_tiny", **SMALL).eval()
    _randomize_gpsa(small)
    rect = dict(SMALL, img_size=(48, 64))  # 6x8 tokens: rectangular and larger
    native = timm.create_model("convit_tiny", **rect).eval()
    state = small.state_dict()
    state["pos_embed"] = resample_abs_pos_embed(small.pos_embed, new_size=(6, 8), old_size=(4, 4), num_prefix_tokens=0)
    native.load_state_dict(state, strict=True)
    x = torch.randn(2, 3, 48, 64)
    with torch.no_grad():
        torch.testing.assert_close(small(x), native(x), rtol=0, atol=1e-5)
        assert small(torch.randn(2, 3, 32, 32)).shape == (2, 10)  # and back to its own size


def test_rectangular_model_trains():
    model = timm.create_model("convit_tiny", img_size=(24, 40), patch_size=8, num_classes=3)
    before = copy.deepcopy(model.state_dict())
    _train_step(model, torch.randn(2, 3, 24, 40))
    assert not torch.equal(before["blocks.0.attn.pos_proj.weight"], model.blocks[0].attn.pos_proj.weight)


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = timm.create_model("convit_tiny", **SMALL)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    x = torch.randn(2, 3, 32, 32)
    for model in (plain, ckpt):
        model(x).square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


# -- ablation switches (Table 7.3) ----------------------------------------------------------------
@pytest.mark.parametrize("name,heads", [("convit_tiny", 4), ("convit_base", 16), ("convit_small", 9)])
def test_initial_parameters_equal_timms_convit_for_the_same_seed(name, heads):
    """The paper's init: timm's ConVit built with the same seed and kwargs starts from the same tensors,
    position embedding and half-integer kernel included (2x2 and 4x4 for 4 and 16 heads)."""
    kwargs = dict(img_size=32, patch_size=8, num_classes=10, depth=3, local_up_to_layer=2)
    torch.manual_seed(7)
    ours = timm.create_model(name, **kwargs)
    torch.manual_seed(7)
    theirs = timm_convit.ConVit(embed_dim=48, num_heads=heads, locality_strength=1.0, **kwargs)
    expected = theirs.state_dict()
    assert list(ours.state_dict()) == list(expected)
    for key, value in ours.state_dict().items():
        assert torch.equal(value, expected[key]), key
    k = {4: 2, 9: 3, 16: 4}[heads]
    centers = (ours.blocks[0].attn.pos_proj.weight[:, :2] / 2).unique()
    torch.testing.assert_close(centers, torch.arange(k) - (k - 1) / 2)  # 2x2: -0.5, 0.5


def test_conv_init_switch():
    paper = timm.create_model("convit_tiny", locality_strength=3.0, **SMALL)
    integer = timm.create_model("convit_tiny", locality_strength=3.0, conv_init="integer", **SMALL)
    without = timm.create_model("convit_tiny", conv_init=False, **SMALL)
    assert torch.equal(
        paper.blocks[0].attn.pos_proj.weight,
        timm.create_model("convit_tiny", locality_strength=3.0, conv_init=True, **SMALL).blocks[0].attn.pos_proj.weight,
    )
    for model, offsets in ((paper, paper_kernel_offsets(4)), (integer, kernel_offsets(4))):
        expected = 3.0 * torch.cat([2 * offsets, -torch.ones(4, 1)], dim=1)
        for layer in model.gpsa_layers():
            torch.testing.assert_close(layer.pos_proj.weight, expected)
            assert torch.equal(layer.v.weight, torch.eye(192))
    for layer in without.gpsa_layers():
        assert layer.pos_proj.weight.abs().max() < 0.1  # trunc_normal(std=0.02), like every Linear
        assert not torch.allclose(layer.v.weight, torch.eye(192), atol=0.5)
        # no head is local: positional attention close to uniform over the 16 tokens
        assert layer.positional_attention((4, 4)).max() < 0.2
    with pytest.raises(ValueError, match="conv_init='half'"):
        timm.create_model("convit_tiny", conv_init="half", **SMALL)


def test_gating_frozen_at_zero_stays_there_while_the_rest_trains():
    model = timm.create_model("convit_tiny", train_gating=False, **SMALL)
    pos_before = model.blocks[0].attn.pos_proj.weight.clone()
    _train_step(model, torch.randn(4, 3, 32, 32))
    for layer in model.gpsa_layers():
        assert not layer.gating_param.requires_grad
        assert torch.equal(layer.gating_param, torch.zeros(4))
        torch.testing.assert_close(layer.gate(), torch.full((4,), 0.5))  # equal weight on content and position
    assert not torch.equal(pos_before, model.blocks[0].attn.pos_proj.weight)


def test_frozen_gpsa_keeps_attention_weights_and_trains_the_rest():
    model = timm.create_model("convit_tiny", train_gpsa=False, **SMALL)
    before = copy.deepcopy(model.state_dict())
    _train_step(model, torch.randn(4, 3, 32, 32))
    after = model.state_dict()
    for name in before:
        frozen = name.startswith(tuple(f"blocks.{i}.attn." for i in range(10)))
        assert torch.equal(before[name], after[name]) == frozen, name


def test_local_up_to_layer_zero_is_a_deit():
    model = timm.create_model("convit_tiny", local_up_to_layer=0, **SMALL)
    assert model.gpsa_layers() == [] and not any(isinstance(m, convit.GPSA) for m in model.modules())


# -- test-time masks (Tables F.2, F.3) -------------------------------------------------------------
def _random_convit(**kwargs) -> ConViT:
    torch.manual_seed(0)
    model = timm.create_model("convit_tiny", **SMALL, **kwargs).eval()
    _randomize_gpsa(model)
    return model


def test_mask_pos_embed_equals_a_zero_position_embedding():
    model = _random_convit()
    x = torch.randn(2, 3, 32, 32)
    zeroed = copy.deepcopy(model)
    with torch.no_grad():
        zeroed.pos_embed.zero_()
        model.set_test_masks(pos_embed=True)
        torch.testing.assert_close(model(x), zeroed(x))
        model.set_test_masks()
        assert not torch.allclose(model(x), zeroed(x))


@pytest.mark.parametrize("masked,gate_logit", [("content_layers", 50.0), ("position_layers", -50.0)])
def test_gate_masks_equal_saturated_gates_in_the_first_k_layers(masked, gate_logit):
    model = _random_convit()
    saturated = copy.deepcopy(model)
    with torch.no_grad():
        for layer in saturated.gpsa_layers()[:3]:
            layer.gating_param.fill_(gate_logit)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        unmasked = model(x)
        model.set_test_masks(**{masked: 3})
        torch.testing.assert_close(model(x), saturated(x), rtol=0, atol=1e-5)
        assert not torch.allclose(model(x), unmasked, atol=1e-3)
    as_kwarg = timm.create_model("convit_tiny", **SMALL, **{f"mask_{masked}": 3})
    assert [layer.gate_override for layer in as_kwarg.gpsa_layers()][:4] == [gate_logit > 0] * 3 + [None]


def test_mask_errors_name_the_parameter():
    model = timm.create_model("convit_tiny", local_up_to_layer=5, **SMALL)
    with pytest.raises(ValueError, match=r"mask_content_layers=6 must be in 0\.\.5"):
        model.set_test_masks(content_layers=6)
    with pytest.raises(ValueError, match="not both"):
        model.set_test_masks(content_layers=2, position_layers=2)


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_heads=0), r"embed_dim=48 \(per head\) and num_heads=0 must be >= 1"),
        (dict(img_size=30, patch_size=16), r"img_size=\(30, 30\) must be a positive multiple of patch_size=\(16, 16\)"),
        (dict(img_size=(32, 36), patch_size=8), r"img_size=\(32, 36\)"),
        (dict(local_up_to_layer=13), r"local_up_to_layer=13 must be in 0\.\.depth=12"),
        (dict(local_up_to_layer=12), r"no block after the GPSA blocks for the class token"),
        (dict(locality_strength=0.0), r"locality_strength=0.0 must be > 0"),
        (dict(global_pool="max"), r"global_pool='max' must be one of"),
        (dict(mask_position_layers=11), r"mask_position_layers=11"),
    ],
)
def test_bad_configuration_is_a_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        timm.create_model("convit_tiny", **kwargs)


def test_unknown_kwarg_is_a_type_error_naming_the_allowed_ones():
    """timm's builders raise TypeError for an unknown kwarg; ours too, with the allowed names."""
    with pytest.raises(
        TypeError, match=r"convit_tiny: .*unexpected keyword argument 'locality'; model kwargs: .*locality_strength"
    ):
        timm.create_model("convit_tiny", locality=2.0)


def test_input_size_not_a_multiple_of_the_patch_is_a_value_error():
    model = timm.create_model("convit_tiny", **SMALL)
    with pytest.raises(ValueError, match=r"input size \(32, 30\) must be a multiple of patch_size=\(8, 8\)"):
        model(torch.randn(1, 3, 32, 30))
