"""eFCN embedding: the eFCN computes its CNN's function; masks, deviation and errors."""

import itertools

import pytest
import timm
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from support.fresh_registry import fresh_registry
from torch import nn

import efcn

pytestmark = pytest.mark.usefixtures("single_thread")

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)  # torch's (timm's subclass them)


def _randomize_batchnorm(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, BATCH_NORMS):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
            nn.init.normal_(m.weight)
            nn.init.normal_(m.bias)
    return model.eval()


def _assert_equivalent(cnn: nn.Module, input_shape, batch: int = 3) -> efcn.EmbeddedFCN:
    cnn = _randomize_batchnorm(cnn)
    model = efcn.embed(cnn, input_shape).eval()
    x = torch.randn(batch, *input_shape)
    with torch.no_grad():
        expected, actual = cnn(x), model(x)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    return model


CONV_SETTINGS = list(itertools.product([1, 2], [0, 1, 2], [1, 2], [(3, 3), (2, 3)], [True, False]))


@pytest.mark.parametrize("stride,padding,dilation,kernel,bias", CONV_SETTINGS)
def test_conv_equivalence_all_settings(stride, padding, dilation, kernel, bias):
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(2, 3, kernel, stride=stride, padding=padding, dilation=dilation, bias=bias),
        nn.ReLU(),
        nn.Conv2d(3, 4, 3, stride=stride, padding=padding, dilation=dilation, bias=bias),
        nn.Flatten(),
    )
    with torch.no_grad():
        n_features = cnn(torch.zeros(1, 2, 15, 13)).shape[1]
    cnn.append(nn.Linear(n_features, 5))
    _assert_equivalent(cnn, (2, 15, 13))


def test_every_layer_type_with_batchnorm_folded():
    torch.manual_seed(1)
    cnn = nn.Sequential(
        nn.ZeroPad2d((1, 0, 2, 1)),
        nn.Conv2d(3, 6, 3, padding="same", bias=False),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(6, 5, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
        nn.BatchNorm2d(5),
        nn.GELU(),
        nn.AvgPool2d(2, ceil_mode=True),
        nn.Dropout2d(0.3),
        nn.Conv2d(5, 4, 1),
        nn.LeakyReLU(0.1),
        nn.AdaptiveAvgPool2d((2, 1)),
        nn.Dropout(0.5),
        nn.Flatten(),
        nn.Linear(8, 7),
        nn.BatchNorm1d(7),
        nn.Tanh(),
        nn.Linear(7, 3),
    )
    model = _assert_equivalent(cnn, (3, 13, 12))
    assert len(model.local_layers()) == 3
    assert not any(isinstance(m, BATCH_NORMS) for m in model.modules())


class FunctionalCNN(nn.Module):
    """Uses functional relu and x.view(x.size(0), -1), as many CNN scripts do."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, stride=2)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 2 * 2, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv(x)))
        return self.fc(x.view(x.size(0), -1))


def test_functional_forward_and_registered_models():
    torch.manual_seed(2)
    _assert_equivalent(FunctionalCNN(), (1, 10, 10))
    _assert_equivalent(timm.create_model("vanilla_cnn", channels=4, in_chans=1, img_size=16), (1, 16, 16))
    _assert_equivalent(timm.create_model("alexnet_cifar", num_classes=10), (3, 32, 32), batch=2)


def test_locality_mask_matches_receptive_fields():
    """Oracle: an input pixel is local to an output pixel iff the conv's Jacobian entry is nonzero
    for a conv with all-positive weights (computed by applying the conv to the identity basis)."""
    conv = nn.Conv2d(1, 1, (3, 2), stride=(2, 1), padding=(1, 1), dilation=(2, 1), bias=False)
    nn.init.constant_(conv.weight, 1.0)
    cnn = nn.Sequential(conv, nn.Flatten(), nn.Linear(4 * 8, 2))
    layer = efcn.embed(cnn, (1, 9, 7)).local_layers()["0"]
    basis = torch.eye(9 * 7).view(-1, 1, 9, 7)
    jacobian = conv(basis).flatten(1).t()  # (out pixels, in pixels)
    assert torch.equal(layer.locality_mask, jacobian != 0)
    assert torch.equal(layer.full_mask(), layer.weight != 0)


def test_masks_partition_the_weights_and_masked_evaluation():
    torch.manual_seed(3)
    cnn = timm.create_model("vanilla_cnn", channels=4, in_chans=1, img_size=8).eval()
    model = efcn.embed(cnn, (1, 8, 8)).eval()
    layer = model.local_layers()["conv1"]
    with torch.no_grad():
        layer.weight.add_(0.01 * torch.randn_like(layer.weight))  # some off-local weight
    mask = layer.full_mask()
    local, off_local = layer.weight * mask, layer.weight * ~mask
    assert torch.equal(local + off_local, layer.weight)
    assert not (mask & ~mask).any() and (mask | ~mask).all()
    x = torch.randn(5, 64)
    outputs = {}
    for keep in ("all", "local", "off_local"):
        with efcn.masked(model, keep):
            outputs[keep] = layer(x)
    assert layer.keep == "all"
    torch.testing.assert_close(outputs["local"] + outputs["off_local"] - layer.bias, outputs["all"])
    torch.testing.assert_close(outputs["local"], x @ local.t() + layer.bias)


def test_deviation_is_zero_after_embedding_and_positive_after_one_training_step():
    torch.manual_seed(4)
    digits = load_digits()
    images = torch.tensor(digits.images[:250], dtype=torch.float32).unsqueeze(1) / 16
    labels = torch.tensor(digits.target[:250])
    cnn = timm.create_model("vanilla_cnn", channels=4, in_chans=1, img_size=8)
    model = efcn.embed(cnn, (1, 8, 8))
    assert efcn.deviation(model)["total"] == 0.0
    assert efcn.weight_sharing_violation(model)["total"] == 0.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()
    deviation = efcn.deviation(model)
    assert set(deviation) == {"conv1", "conv2", "conv3", "total"}
    assert 0 < deviation["conv1"] < 1 and 0 < deviation["conv2"] < 1 and 0 < deviation["total"] < 1
    assert deviation["conv3"] == 0.0  # a 3x3 conv on a 2x2 map: every entry is local
    assert efcn.weight_sharing_violation(model)["total"] > 0
    # delta against its definition computed directly with the dense masks
    layers = model.local_layers().values()
    off = sum((layer.weight * ~layer.full_mask()).square().sum() for layer in layers)
    total = sum(layer.weight.square().sum() for layer in layers)
    assert deviation["total"] == pytest.approx((off / total).sqrt().item(), rel=1e-5)
    summary = efcn.diagnostics.summary(model, images)
    assert summary["deviation/total"] == deviation["total"] and "deviation/conv2" in summary
    assert efcn.diagnostics.summary(cnn, images) == {}


def test_standard_fcn_is_far_from_the_cnn_subspace():
    torch.manual_seed(5)
    fcn = timm.create_model("fcn_vanilla_cnn", channels=4, in_chans=1, img_size=16)
    assert efcn.deviation(fcn)["total"] > 0.9


@pytest.mark.parametrize(
    "layers,input_shape,message",
    [
        ([nn.Conv2d(4, 4, 3, groups=2)], (4, 8, 8), r"'0' \(Conv2d, groups=2\).*groups=1"),
        ([nn.ConvTranspose2d(3, 4, 3)], (3, 8, 8), r"'0' \(ConvTranspose2d\) is not supported; supported: Conv2d"),
        ([nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")], (3, 8, 8), "padding_mode='reflect'"),
        ([nn.Conv2d(3, 4, 3)], (1, 8, 8), r"'0' \(Conv2d\) expects 3 input channels, gets 1"),
        ([nn.Conv2d(3, 4, 5)], (3, 4, 4), r"'0' \(Conv2d kernel \(5, 5\).*does not fit a 4x4"),
        (
            [nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(10, 2)],
            (3, 8, 8),
            r"'2' \(Linear\) expects 10 features, gets 144",
        ),
        ([nn.Conv2d(3, 4, 3), nn.ReLU(), nn.BatchNorm2d(4)], (3, 8, 8), r"'2' \(BatchNorm2d\) can only be folded"),
        ([nn.Conv2d(3, 4, 3), nn.LSTM(4, 4)], (3, 8, 8), r"'1' \(LSTM\) is not supported"),
        ([nn.Conv2d(3, 4, 3)], (3, 8), r"input_shape must be \(C, H, W\)"),
    ],
)
def test_bad_input_errors_name_the_layer(layers, input_shape, message):
    with pytest.raises(ValueError, match=message):
        efcn.embed(nn.Sequential(*layers), input_shape)


def test_max_params_is_checked_before_allocating():
    cnn = timm.create_model("vanilla_cnn")  # 64 channels: ~0.49 B weights at 32x32
    with pytest.raises(
        ValueError,
        match=r"has 48\d,\d{3},\d{3} parameters, more than max_params=1,000,000 "
        r"\(largest layer 'conv2'",
    ):
        efcn.embed(cnn, (3, 32, 32), max_params=1_000_000)


@pytest.mark.integration
@pytest.mark.slow
def test_import_registers_models_without_warnings():
    """In a fresh process, with every warning an error, importing efcn registers the two CNNs, their eFCNs
    and their FCNs, and no other name of those CNNs."""
    probe = fresh_registry()
    assert probe["stderr"] == ""
    registered = sorted(m for m in probe["models"]["efcn"] if "vanilla" in m or "alexnet" in m)
    assert registered == sorted(
        [
            "vanilla_cnn",
            "alexnet_cifar",
            "efcn_vanilla_cnn",
            "efcn_alexnet_cifar",
            "fcn_vanilla_cnn",
            "fcn_alexnet_cifar",
        ]
    )


def test_efcn_model_from_a_cnn_checkpoint_and_from_its_own_weights_file(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(6)
    cnn = timm.create_model("vanilla_cnn", channels=4, in_chans=1, img_size=8).eval()
    cnn_file = tmp_path / "cnn.safetensors"
    save_file(cnn.state_dict(), str(cnn_file))
    model = timm.create_model("efcn_vanilla_cnn", channels=4, in_chans=1, img_size=8, cnn_checkpoint=str(cnn_file))
    x = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(model.eval()(x), cnn(x), atol=1e-5, rtol=1e-5)
    # an eFCN's own weights (e.g. a train.py checkpoint) load through timm's pretrained-file path
    with torch.no_grad():
        model.layers.conv1.weight.add_(0.01)
    efcn_file = tmp_path / "efcn.safetensors"
    save_file(model.state_dict(), str(efcn_file))
    reloaded = timm.create_model(
        "efcn_vanilla_cnn",
        channels=4,
        in_chans=1,
        img_size=8,
        pretrained=True,
        pretrained_cfg_overlay=dict(file=str(efcn_file)),
    )
    torch.testing.assert_close(reloaded.eval()(x), model(x))
    with pytest.raises(ValueError, match="does not fit this model"):
        timm.create_model("efcn_vanilla_cnn", channels=8, in_chans=1, img_size=8, cnn_checkpoint=str(cnn_file))


@torch.no_grad()
def test_cnn_checkpoint_is_timms_pretrained_loading_of_the_cnns_weights(tmp_path):
    """cnn_checkpoint=PATH is pretrained=True with that file: timm reads it and the filter lifts the CNN (a
    checkpoint directory too); with other classes timm resets the head and the rest is the CNN's."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    cnn = timm.create_model("vanilla_cnn", channels=4, img_size=8).eval()
    (tmp_path / "epoch_0001").mkdir()
    save_file(cnn.state_dict(), str(tmp_path / "epoch_0001" / "model.safetensors"))
    file = str(tmp_path / "epoch_0001" / "model.safetensors")
    x = torch.randn(3, 3, 8, 8)
    lifted = efcn.embed(cnn, cnn.input_shape).eval()
    for model in (
        timm.create_model("efcn_vanilla_cnn", channels=4, img_size=8, cnn_checkpoint=file),
        timm.create_model("efcn_vanilla_cnn", channels=4, img_size=8, cnn_checkpoint=tmp_path / "epoch_0001"),
        timm.create_model(
            "efcn_vanilla_cnn", channels=4, img_size=8, pretrained=True, pretrained_cfg_overlay=dict(file=file)
        ),
    ):
        assert model.pretrained_cfg["file"] == file
        assert model.state_dict().keys() == lifted.state_dict().keys()
        assert all(torch.equal(v, lifted.state_dict()[k]) for k, v in model.state_dict().items())
        assert torch.equal(model.eval()(x), lifted(x))
    other = timm.create_model(
        "efcn_vanilla_cnn",
        channels=4,
        img_size=8,
        num_classes=3,
        pretrained=True,
        pretrained_cfg_overlay=dict(file=file),
    ).eval()
    assert other(x).shape == (3, 3)
    torch.testing.assert_close(other.forward_features(x), lifted.forward_features(x))


@torch.no_grad()
def test_an_exported_efcn_loads_without_the_cnn_it_was_lifted_from(tmp_path):
    """cnn_checkpoint is among the recorded model_args; the exported weights replace it, so it is not read."""
    from safetensors.torch import save_file
    from timm.models import save_for_hf

    cnn_file = tmp_path / "cnn.safetensors"
    save_file(timm.create_model("vanilla_cnn", channels=4, img_size=8).state_dict(), str(cnn_file))
    model = timm.create_model("efcn_vanilla_cnn", channels=4, img_size=8, cnn_checkpoint=str(cnn_file)).eval()
    model.layers.conv1.weight.add_(0.01)  # trained after the lift
    save_for_hf(model, tmp_path / "exported", safe_serialization=True)
    cnn_file.unlink()
    loaded = timm.create_model(f"local-dir:{tmp_path / 'exported'}", pretrained=True).eval()
    x = torch.randn(2, 3, 8, 8)
    assert loaded.pretrained_model_args["cnn_checkpoint"] == str(cnn_file)
    assert torch.equal(loaded(x), model(x))


class ResidualCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        return self.fc((x + self.conv(x)).flatten(1))


def test_non_chain_forward_is_rejected():
    with pytest.raises(ValueError, match="chain of layers; node 'add' of ResidualCNN.forward"):
        efcn.embed(ResidualCNN(), (2, 4, 4))


@pytest.mark.parametrize(
    "cnn_name,kwargs,side",
    [("vanilla_cnn", dict(channels=4, img_size=16), 16), ("alexnet_cifar", dict(num_classes=10), 32)],
)
def test_features_and_pre_logits_are_the_cnns(cnn_name, kwargs, side):
    """timm's split of the eFCN matches its CNN's: forward_features is the CNN's last map (viewed from the
    flat activation), forward_head(pre_logits=True) the classifier's input."""
    torch.manual_seed(0)
    cnn = timm.create_model(cnn_name, **kwargs).eval()
    fcn = efcn.embed(cnn, cnn.input_shape)
    x = torch.randn(3, 3, side, side)
    with torch.no_grad():
        features = fcn.forward_features(x)
        torch.testing.assert_close(features, cnn.forward_features(x), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(
            fcn.forward_head(features, pre_logits=True),
            cnn.forward_head(cnn.forward_features(x), pre_logits=True),
            atol=1e-5,
            rtol=1e-4,
        )
    assert (fcn.num_features, fcn.head_hidden_size) == (cnn.num_features, cnn.head_hidden_size)
