"""tcnn_* registry entries: names, kwargs, cfgs, offline pretrained loading and features_only through timm's
builder, bad checkpoints."""

import copy

import pytest
import timm
import torch
from safetensors.torch import save_file
from support.fresh_registry import fresh_registry
from timm.models import FeatureListNet, get_pretrained_cfg

import transformed_cnn  # noqa: F401  (registers the models)
from transformed_cnn import gpsa_layers, transform

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.integration
@pytest.mark.slow
def test_import_registers_the_resnets_without_warnings():
    """In a fresh process, with every warning an error, importing transformed_cnn registers a tcnn_ for the
    plain ResNets (ResNet-B/C/D/S/T, ResNet-RS) and none for the anti-aliased or group-norm ones."""
    probe = fresh_registry()
    assert probe["stderr"] == ""
    names = {name for name in probe["models"]["transformed_cnn"] if name.startswith("tcnn_")}
    assert {"tcnn_resnet18", "tcnn_resnet50", "tcnn_resnet50d", "tcnn_resnetrs50", "tcnn_resnetrs350"} <= names
    assert not any("resnetaa" in name or "resnetblur" in name or "_gn" in name for name in names)


def test_model_kwargs_go_to_the_transform_and_to_the_cnn():
    model = timm.create_model("tcnn_resnet18", num_classes=7, drop_path_rate=0.1, stages="3,4", keep_stride=True)
    assert sorted({name.split(".")[0] for name in gpsa_layers(model)}) == ["layer3", "layer4"]
    assert model.fc.out_features == 7
    assert model.layer4[1].drop_path.drop_prob > 0
    assert model.layer4[0].conv1.stride == (2, 2)  # kept


@pytest.fixture(scope="module")
def resnet18_file(tmp_path_factory, randomize_norms):
    torch.manual_seed(0)
    cnn = randomize_norms(timm.create_model("resnet18"))
    path = tmp_path_factory.mktemp("weights") / "resnet18.safetensors"
    save_file(cnn.state_dict(), str(path))
    return cnn, path


@torch.no_grad()
def test_pretrained_loads_the_cnn_weights_offline_from_a_local_file(resnet18_file, tcnn_images, relative_error):
    cnn, path = resnet18_file
    tcnn = timm.create_model(
        "tcnn_resnet18", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), init="exact", keep_stride=True
    ).eval()
    assert relative_error(tcnn(tcnn_images), cnn(tcnn_images)) < 1e-4
    # another number of classes: timm drops the checkpoint's classifier, the trunk still loads
    finetune = timm.create_model(
        "tcnn_resnet18", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), num_classes=10
    )
    assert finetune.fc.out_features == 10
    assert torch.equal(finetune.layer3[1].bn2.running_var, cnn.layer3[1].bn2.running_var)
    assert finetune.pretrained_cfg["mean"] == cnn.pretrained_cfg["mean"]


def test_a_checkpoint_of_another_cnn_or_a_missing_file_is_a_clear_error(tmp_path):
    other = tmp_path / "resnet10t.pth"
    torch.save(timm.create_model("resnet10t").state_dict(), other)
    with pytest.raises(
        ValueError,
        match=r"resnet10t\.pth does not fit this model .*missing keys: conv1\.weight, .*unexpected keys: "
        r"conv1\.0\.weight.*\(the CNN resnet18 of tcnn_resnet18, or tcnn_resnet18 with stages=\[4\]",
    ):
        timm.create_model("tcnn_resnet18", pretrained=True, pretrained_cfg_overlay=dict(file=str(other)))
    missing = tmp_path / "nothing.safetensors"
    with pytest.raises(ValueError, match=r"pretrained file .*nothing\.safetensors' does not exist"):
        timm.create_model("tcnn_resnet18", pretrained=True, pretrained_cfg_overlay=dict(file=str(missing)))


def test_state_dict_is_the_transformed_resnets():
    """The keys and shapes of transform(timm's ResNet): weights saved by any version of the entries load."""
    for name, kwargs in (("resnet18", {}), ("resnet26d", dict(stages="3,4", keep_stride=True))):
        tcnn = timm.create_model(f"tcnn_{name}", num_classes=5, **kwargs).state_dict()
        reference = transform(timm.create_model(name, num_classes=5), **kwargs).state_dict()
        assert {k: v.shape for k, v in tcnn.items()} == {k: v.shape for k, v in reference.items()}


def test_pretrained_cfgs_are_the_cnns_tag_for_tag():
    """tcnn_<cnn>.<tag> reads the CNN's weights (hub id, URL) with its preprocessing; the pool size is the
    default transform's, and follows the options given."""
    for tag in ("", ".tv_in1k"):
        cnn, tcnn = get_pretrained_cfg(f"resnet50{tag}"), get_pretrained_cfg(f"tcnn_resnet50{tag}")
        assert (tcnn.hf_hub_id, tcnn.url, tcnn.tag, tcnn.mean, tcnn.input_size) == (
            cnn.hf_hub_id,
            cnn.url,
            cnn.tag,
            cnn.mean,
            cnn.input_size,
        )
        assert tcnn.architecture == "tcnn_resnet50" and tcnn.pool_size == (14, 14) == tuple(
            2 * p for p in cnn.pool_size
        )
    assert [n.split(".")[1] for n in timm.list_pretrained("tcnn_resnet18.*")] == [
        n.split(".")[1] for n in timm.list_pretrained("resnet18.*")
    ]
    assert timm.create_model("tcnn_resnet18", keep_stride=True).pretrained_cfg["pool_size"] == (7, 7)


@torch.no_grad()
def test_pretrained_is_the_transform_of_the_resnet_with_those_weights(resnet18_file, tcnn_images):
    """timm's pretrained path with the ResNet's file gives transform(that ResNet), bit for bit, with the default
    options (the stride removed: another function than the CNN's) as with the exact ones (the CNN's function);
    only the queries and keys of the content attention are random (ConViT's init), in both."""
    cnn, path = resnet18_file
    for kwargs in ({}, dict(stages="3,4", init="exact")):
        tcnn = timm.create_model(
            "tcnn_resnet18", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **kwargs
        ).eval()
        reference = transform(copy.deepcopy(cnn), **kwargs).eval()
        assert tcnn.pretrained_cfg["file"] == str(path) and tcnn.pretrained_cfg["architecture"] == "tcnn_resnet18"
        state, expected = tcnn.state_dict(), reference.state_dict()
        random = {k for k in expected if k.endswith(".qk.weight")}
        assert random and all(torch.equal(state[k], v) for k, v in expected.items() if k not in random)
        reference.load_state_dict({k: state[k] for k in random}, strict=False)
        assert torch.equal(tcnn(tcnn_images), reference(tcnn_images))


@torch.no_grad()
def test_features_only_is_timms_wrapper_around_the_transformed_model(resnet18_file, tcnn_images):
    """timm's builder wraps the transformed model: the reductions of the removed stride, the pretrained
    weights loaded first (the maps are the pretrained T-CNN's forward_intermediates)."""
    _, path = resnet18_file
    overlay = dict(file=str(path))
    torch.manual_seed(0)  # the same random init of the content attention as the T-CNN below
    features = timm.create_model("tcnn_resnet18", features_only=True, pretrained=True, pretrained_cfg_overlay=overlay)
    assert type(features) is FeatureListNet
    assert features.feature_info.channels() == [64, 64, 128, 256, 512]
    assert features.feature_info.reduction() == [2, 4, 8, 16, 16]
    assert "num_classes" not in features.pretrained_cfg  # timm's cfg of a feature backbone
    torch.manual_seed(0)
    tcnn = timm.create_model("tcnn_resnet18", pretrained=True, pretrained_cfg_overlay=overlay).eval()
    want = tcnn.forward_intermediates(tcnn_images, intermediates_only=True)
    for got, expected in zip(features.eval()(tcnn_images), want, strict=True):
        torch.testing.assert_close(got, expected)
    kept = timm.create_model("tcnn_resnet18", features_only=True, out_indices=(3, 4), keep_stride=True, stages="3,4")
    assert kept.feature_info.reduction() == [16, 32]  # strides kept: the CNN's
