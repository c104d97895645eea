"""Transformed CNN conversion: exactness against the CNN itself, paths, paper init, errors."""

import copy
import re

import pytest
import timm
import torch
from sklearn.datasets import load_digits
from timm.models.resnet import BasicBlock, Bottleneck, ResNet
from torch import nn

from transformed_cnn import GPSAConv2d, gpsa_layers, query_attention_maps, remove_stage_stride, transform

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module", params=["resnet18", "resnet50"])
def cnn(request, randomize_norms):
    torch.manual_seed(0)
    return randomize_norms(timm.create_model(request.param))


@torch.no_grad()
def test_exact_init_with_kept_stride_reproduces_the_cnn(cnn, tcnn_images, relative_error):
    tcnn = transform(copy.deepcopy(cnn), init="exact", keep_stride=True).eval()
    assert relative_error(tcnn.forward_features(tcnn_images), cnn.forward_features(tcnn_images)) < 1e-4
    assert relative_error(tcnn(tcnn_images), cnn(tcnn_images)) < 1e-4


@torch.no_grad()
def test_exact_init_without_stride_reproduces_the_cnn_with_the_same_stride_change(cnn, tcnn_images, relative_error):
    unstrided = copy.deepcopy(cnn)
    remove_stage_stride(unstrided, 4)
    expected = unstrided.forward_features(tcnn_images)
    assert expected.shape[-1] == 2 * cnn.forward_features(tcnn_images).shape[-1]  # the stride change is real
    tcnn = transform(copy.deepcopy(cnn), init="exact").eval()
    assert relative_error(tcnn.forward_features(tcnn_images), expected) < 1e-4


@torch.no_grad()
def test_exact_init_with_the_default_stride_is_as_far_from_the_cnn_as_the_readme_says(
    cnn, tcnn_images, relative_error, repo
):
    """README: init="exact" computes the CNN's function only with keep_stride=True; with the default the logits
    are off by the range it states at 64 px (these two models, random weights and BatchNorm statistics)."""
    readme = " ".join((repo / "README.md").read_text().split())
    assert (
        '`init="exact"`: alpha = lambda = 16; with `keep_stride=True` the T-CNN computes the CNN\'s function' in readme
    )
    low, high = map(
        float, re.search(r"with the default, its logits are (\d+)-(\d+)% off the CNN's at 64 px", readme).groups()
    )
    default = transform(copy.deepcopy(cnn), init="exact").eval()
    error = relative_error(default(tcnn_images), cnn(tcnn_images))
    assert low <= round(100 * error) <= high, error


@torch.no_grad()
def test_exact_init_of_every_stage_reproduces_the_cnn(tcnn_images, randomize_norms, relative_error):
    cnn = randomize_norms(timm.create_model("resnet18"))
    tcnn = transform(copy.deepcopy(cnn), stages=[1, 2, 3, 4], init="exact", keep_stride=True).eval()
    assert len(gpsa_layers(tcnn)) == 16
    assert relative_error(tcnn(tcnn_images), cnn(tcnn_images)) < 1e-4


@torch.no_grad()
def test_average_pool_shortcut_loses_its_stride_too(tcnn_images, randomize_norms, relative_error):
    """ResNet-D / ResNet-RS shortcut: avg-pool + 1x1 conv; keep_stride=False drops the pool."""
    cnn = randomize_norms(timm.create_model("resnet26d"))
    tcnn = transform(copy.deepcopy(cnn), init="exact").eval()
    assert isinstance(tcnn.layer4[0].downsample[0], nn.Identity)
    unstrided = copy.deepcopy(cnn)
    remove_stage_stride(unstrided, 4)
    assert relative_error(tcnn(tcnn_images), unstrided(tcnn_images)) < 1e-4


def test_surviving_parameters_are_the_same_objects_and_the_count_matches(cnn):
    copied = copy.deepcopy(cnn)
    before = dict(copied.named_parameters())
    tcnn = transform(copied)
    after = dict(tcnn.named_parameters())
    converted = [name for name in before if name not in after]
    assert converted and all(name.startswith("layer4") and name.endswith(".weight") for name in converted)
    assert all(after[name] is before[name] for name in before if name in after)
    # Added per layer: queries/keys 2 * 9 * (C_in // 9) * C_in, W_val C_in^2, pos_proj 3*9+9, gating 9
    added = sum(
        2 * 9 * (m.in_channels // 9) * m.in_channels + m.in_channels**2 + 45 for m in gpsa_layers(tcnn).values()
    )
    assert sum(p.numel() for p in tcnn.parameters()) == sum(p.numel() for p in cnn.parameters()) + added


# channels < queries (7x9 map: 63 queries, 20 at stride 2) take the factored schedule of the hot path,
# channels >= queries (3x4 map: 12 queries; 7x9 at stride 2 with 20 channels) the mixed one
@pytest.mark.parametrize(
    "channels,size,stride,dilation",
    [
        (20, (7, 9), 1, 1),
        (12, (7, 9), 2, 1),
        (20, (7, 9), 1, 2),
        (20, (7, 9), 2, 1),
        (40, (3, 4), 1, 1),
        (40, (3, 4), 2, 1),
    ],
)
def test_fused_and_explicit_paths_agree_in_outputs_and_gradients(channels, size, stride, dilation):
    torch.manual_seed(0)
    layer = GPSAConv2d(channels, 24, stride=stride, padding=dilation, dilation=dilation)
    with torch.no_grad():  # content attention far from uniform, gates away from 0 and 1
        layer.qk.weight.normal_(0, 0.5)
        layer.gating_param.uniform_(-2, 2)
    x = torch.randn(3, channels, *size)
    results = []
    for fused in (True, False):
        layer.fused = fused
        layer.zero_grad()
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), inputs.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (out_f, gx_f, grads_f), (out_e, gx_e, grads_e) = results
    conv_shape = nn.Conv2d(channels, 24, 3, stride, dilation, dilation)(x).shape
    assert out_f.shape == conv_shape
    torch.testing.assert_close(out_f, out_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_f, gx_e, rtol=1e-4, atol=1e-5)
    for name in grads_f:
        torch.testing.assert_close(grads_f[name], grads_e[name], rtol=1e-4, atol=1e-5, msg=name)


def test_paper_init_puts_about_a_third_of_the_mass_on_the_tap_and_differs_from_the_cnn(
    tcnn_images, randomize_norms, relative_error
):
    layer = GPSAConv2d(16, 16)
    attn = layer.positional_attention((9, 9))  # (9 heads, 81 queries, 121 keys)
    center_query, padded_width = 4 * 9 + 4, 11
    for head, (dx, dy) in enumerate(layer.tap_offsets().long().tolist()):
        tap = (5 + dy) * padded_width + (5 + dx)
        assert 0.25 < attn[head, center_query, tap] < 0.4
    cnn = randomize_norms(timm.create_model("resnet18"))
    with torch.no_grad():
        paper = transform(copy.deepcopy(cnn), keep_stride=True).eval()(tcnn_images)
        assert relative_error(paper, cnn(tcnn_images)) > 1e-2


def test_paper_init_trains():
    digits = load_digits()
    images = torch.tensor(digits.images[:32], dtype=torch.float32).div(16).unsqueeze(1).expand(-1, 3, -1, -1)
    images = nn.functional.interpolate(images, size=32, mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target[:32])
    torch.manual_seed(0)
    tcnn = transform(timm.create_model("resnet18", num_classes=10), init="paper")
    optimizer = torch.optim.AdamW(tcnn.parameters(), lr=1e-3)
    losses = []
    for _ in range(8):
        loss = nn.functional.cross_entropy(tcnn(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    for layer in gpsa_layers(tcnn).values():  # the attention parameters learn too
        for param in (layer.gating_param, layer.pos_proj.weight, layer.qk.weight, layer.v.weight):
            assert param.grad.abs().sum() > 0


@torch.no_grad()
def test_exact_attention_map_of_a_query_selects_the_tap_pixel(tcnn_images):
    tcnn = transform(timm.create_model("resnet18"), init="exact", keep_stride=True)
    maps = query_attention_maps(tcnn, tcnn_images, query=(0.5, 0.5))
    assert list(maps) == ["layer4.0.conv1", "layer4.0.conv2", "layer4.1.conv1", "layer4.1.conv2"]
    attn = maps["layer4.0.conv2"]  # stride 1 on a 2x2 map: query (1, 1)
    assert attn.shape == (2, 9, 2, 2)
    for head, (dx, dy) in enumerate(tcnn.layer4[0].conv2.tap_offsets().long().tolist()):
        row, col = 1 + dy, 1 + dx
        inside = 0 <= row < 2 and 0 <= col < 2
        assert attn[:, head].sum(dim=(-2, -1)).allclose(torch.tensor(float(inside)), atol=1e-5)
        if inside:
            assert attn[:, head, row, col].allclose(torch.tensor(1.0), atol=1e-5)


def test_bad_inputs_get_clear_errors():
    resnet = timm.create_model("resnet18")
    with pytest.raises(ValueError, match="timm ResNet"):
        transform(nn.Sequential(nn.Conv2d(3, 8, 3)))
    with pytest.raises(ValueError, match=r"stage 5 is out of range: this ResNet has stages 1-4"):
        transform(resnet, stages=5)
    with pytest.raises(ValueError, match=r"stage 0 is out of range"):
        transform(resnet, stages=[0, 4])
    with pytest.raises(ValueError, match="init must be one of"):
        transform(resnet, init="conv")
    transform(resnet, stages=4)
    with pytest.raises(ValueError, match="layer4 has no 3x3 convolution left"):
        transform(resnet, stages="3,4")
    assert not any(name.startswith("layer3") for name in gpsa_layers(resnet))  # all checks come first
    assert resnet.layer3[0].conv1.stride == (2, 2)
    resnext = ResNet(Bottleneck, [1, 1, 1, 1], cardinality=4, base_width=4)
    with pytest.raises(ValueError, match=r"layer4\.0\.conv2 is a grouped convolution \(groups=4\)"):
        transform(resnext)
    antialiased = ResNet(BasicBlock, [1, 1, 1, 1], aa_layer=nn.AvgPool2d)
    with pytest.raises(ValueError, match=r"layer4\.0 downsamples with an anti-aliasing layer"):
        transform(antialiased)
    transform(antialiased, keep_stride=True)  # exact conversion keeps the blur pool: fine


# Table G.1: (ResNet-RS, T-ResNet-RS) parameter counts in millions
TABLE_G1_PARAMS = {
    "resnetrs50": (36, 38),
    "resnetrs101": (64, 66),
    "resnetrs152": (87, 89),
    "resnetrs200": (93, 96),
    "resnetrs270": (130, 133),
    "resnetrs350": (164, 167),
}


def test_parameter_counts_match_table_g1():
    for name, (cnn_millions, tcnn_millions) in TABLE_G1_PARAMS.items():
        with torch.device("meta"):  # shapes only: no memory, no init time
            model = timm.create_model(name)
            cnn_count = sum(p.numel() for p in model.parameters())
            tcnn_count = sum(p.numel() for p in transform(model).parameters())
        assert (round(cnn_count / 1e6), round(tcnn_count / 1e6)) == (cnn_millions, tcnn_millions), name


def test_attention_map_figure_has_one_row_per_layer_and_one_column_per_head(tmp_path, tcnn_images):
    from PIL import Image

    from convbias.evaluation.figures import plot_attention_maps
    from transformed_cnn import query_maps

    tcnn = transform(timm.create_model("resnet18"))
    with torch.no_grad():
        tcnn.layer4[0].conv1.gating_param.copy_(torch.linspace(-2, 2, 9))
    maps, queries, gates = query_maps(tcnn, tcnn_images[0])
    assert list(maps) == ["layer4.0.conv1", "layer4.0.conv2", "layer4.1.conv1", "layer4.1.conv2"]
    assert all(m.shape[0] == 9 for m in maps.values())
    torch.testing.assert_close(torch.tensor(gates["layer4.0.conv1"]), torch.linspace(-2, 2, 9).sigmoid())
    width, height = Image.open(
        plot_attention_maps(tcnn_images[0], maps, queries, tmp_path / "maps.png", gates=gates)
    ).size
    assert width > 2 * height  # 10 panels a row (the image and 9 heads), 4 rows
