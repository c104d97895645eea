"""tcnn_* registry entries: names, kwargs, offline pretrained loading through timm, bad checkpoints."""

import subprocess
import sys

import pytest
import timm
import torch
from safetensors.torch import save_file

import transformed_cnn  # noqa: F401  (registers the models)
from transformed_cnn import gpsa_layers


@pytest.mark.integration
@pytest.mark.slow
def test_import_registers_the_resnets_without_warnings():
    code = "import transformed_cnn, timm; print(' '.join(timm.list_models('tcnn_*')))"
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stderr == ""
    names = set(result.stdout.split())
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
