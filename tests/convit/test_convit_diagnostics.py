"""Locality diagnostics: known configurations give their known values; oracles are hand-computed
closed forms, brute-force loops and timm's own ConViT `get_attention_map`."""

import json
import math
from pathlib import Path

import pytest
import timm
import torch
from matplotlib.image import imread
from timm.models import convit as timm_convit
from torch import nn

from convbias.engine import read_log
from convbias.evaluation.figures import metric_history, plot_attention_maps, plot_nonlocality, plot_per_head
from convbias.gpsa import kernel_offsets
from convit import diagnostics
from convit.attention import GPSA, MHSA

GRID = (5, 7)  # non-square on purpose


class OneLayer(nn.Module):
    """A (B, C, Hp, Wp) 'image' read as a patch grid, optional class tokens, one attention layer."""

    def __init__(self, attn: nn.Module, class_tokens: int = 0):
        super().__init__()
        self.attn = attn
        self.class_tokens = class_tokens

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.flatten(2).transpose(1, 2)
        x = torch.cat([x[:, :1].mul(0).add(1).expand(-1, self.class_tokens, -1), x], dim=1)
        return self.attn(x, tuple(images.shape[-2:]))


def position_only_gpsa(dim: int, heads: int, alpha: float = 50.0) -> GPSA:
    layer = GPSA(dim, heads)
    layer.local_init(alpha, offsets="integer")  # one target pixel per head
    layer.gate_override = 1.0
    return layer


def clamped_offset_nonlocality(offset, grid) -> float:
    """Brute force: a sharp position-only head looks at the grid cell nearest to query + offset
    (the clamp of that point to the grid); the mean distance to it over all queries."""
    rows, cols = grid
    total = 0.0
    for r in range(rows):
        for c in range(cols):
            tc = min(max(c + offset[0], 0), cols - 1)
            tr = min(max(r + offset[1], 0), rows - 1)
            total += math.hypot(tc - c, tr - r)
    return total / (rows * cols)


def mean_pairwise_distance(grid) -> float:
    cells = [(r, c) for r in range(grid[0]) for c in range(grid[1])]
    return sum(math.dist(a, b) for a in cells for b in cells) / len(cells) ** 2


# -- nonlocality of known configurations --------------------------------------------------------
def test_position_only_heads_have_the_nonlocality_of_their_offset():
    layer = position_only_gpsa(36, 9)
    images = torch.randn(3, 36, *GRID)
    per_head = diagnostics.nonlocality(OneLayer(layer), images)[1]
    offsets = kernel_offsets(9).tolist()
    expected = torch.tensor([clamped_offset_nonlocality(o, GRID) for o in offsets])
    torch.testing.assert_close(per_head, expected, atol=1e-4, rtol=0)
    # the examples: offset (1, 0) is one patch away except from the last column, (0, 0) is 0
    right, center = offsets.index([1.0, 0.0]), offsets.index([0.0, 0.0])
    assert per_head[right].item() == pytest.approx((GRID[1] - 1) / GRID[1], abs=1e-4)
    assert per_head[center].item() == pytest.approx(0.0, abs=1e-4)


def test_uniform_content_attention_with_class_token_is_mean_patch_distance():
    # zero queries and keys: uniform attention over the class token and all patches. With the class
    # token dropped and rows renormalized, each query spreads evenly over the patches.
    layer = MHSA(16, 4)
    nn.init.zeros_(layer.qkv.weight)
    images = torch.randn(2, 16, *GRID)
    per_head = diagnostics.nonlocality(OneLayer(layer, class_tokens=1), images)[1]
    torch.testing.assert_close(per_head, torch.full((4,), mean_pairwise_distance(GRID)), atol=1e-4, rtol=0)


def timm_gpsa_with_weights_of(ours: GPSA) -> timm_convit.GPSA:
    theirs = timm_convit.GPSA(ours.dim, ours.num_heads)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return theirs


def test_gpsa_nonlocality_matches_timm_get_attention_map():
    torch.manual_seed(0)
    ours = GPSA(32, 4)
    with torch.no_grad():
        ours.gating_param.normal_()
        ours.pos_proj.weight.mul_(3)
    images = torch.randn(4, 32, 6, 6)  # timm's ConViT knows square grids only
    per_head = diagnostics.nonlocality(OneLayer(ours), images)[1]

    theirs = timm_gpsa_with_weights_of(ours)
    tokens = images.flatten(2).transpose(1, 2)
    with torch.no_grad():
        theirs.rel_indices = theirs.get_rel_indices(36)
        expected = theirs.get_attention_map(tokens)
    torch.testing.assert_close(per_head, expected, atol=1e-5, rtol=1e-5)


def test_chunking_does_not_change_the_result():
    torch.manual_seed(1)
    model = OneLayer(GPSA(16, 4))
    images = torch.randn(5, 16, *GRID)
    torch.testing.assert_close(
        diagnostics.nonlocality(model, images, chunk_size=2)[1],
        diagnostics.nonlocality(model, images, chunk_size=32)[1],
    )


# -- gating and span ----------------------------------------------------------------------------
def test_gating_is_sigmoid_of_lambda_and_follows_test_time_override():
    layer = GPSA(16, 4)
    with torch.no_grad():
        layer.gating_param.copy_(torch.tensor([-3.0, -0.5, 0.0, 2.0]))
    torch.testing.assert_close(diagnostics.gating(layer), torch.sigmoid(layer.gating_param.detach()))
    layer.gate_override = 0.0
    torch.testing.assert_close(diagnostics.gating(layer), torch.zeros(4))


@pytest.mark.parametrize("alpha", [0.5, 1.0, 4.0])
def test_span_is_inverse_locality_strength_after_local_init(alpha):
    layer = GPSA(36, 9)
    layer.local_init(alpha)
    torch.testing.assert_close(diagnostics.attention_span(layer), torch.full((9,), 1 / alpha))


def test_gating_and_span_work_on_foreign_gated_layers():
    # timm's GPSA: same parameters, no gate() method, called without a grid
    theirs = timm_convit.GPSA(32, 4, locality_strength=2.0)
    theirs.local_init()
    with torch.no_grad():
        theirs.gating_param.copy_(torch.tensor([0.3, -1.0, 1.5, 4.0]))
    torch.testing.assert_close(diagnostics.gating(theirs), torch.sigmoid(theirs.gating_param.detach()))
    torch.testing.assert_close(diagnostics.attention_span(theirs), torch.full((4,), 0.5))
    with pytest.raises(ValueError, match="gating_param"):
        diagnostics.gating(MHSA(16, 4))


def test_gating_and_span_of_transformed_cnn_layers():
    from transformed_cnn.gpsa_conv import GPSAConv2d

    layer = GPSAConv2d(8, 8, 3, locality_strength=2.0, gating=0.5)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), layer)
    stats = diagnostics.summary(model, torch.randn(2, 3, 6, 6))
    assert stats["gating/layer1/head9"] == pytest.approx(torch.sigmoid(torch.tensor(0.5)).item())
    assert stats["span/layer1"] == pytest.approx(0.5)
    assert not any(key.startswith("nonlocality") for key in stats)  # feature-map input: no token grid


# -- whole models -------------------------------------------------------------------------------
def small_deit() -> nn.Module:
    return timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=10, depth=3)


def test_summary_of_a_timm_deit_covers_every_layer_and_head():
    model = small_deit()
    stats = diagnostics.summary(model, torch.randn(2, 3, 32, 32))
    expected = {f"nonlocality/layer{i}" for i in (1, 2, 3)} | {
        f"nonlocality/layer{i}/head{h}" for i in (1, 2, 3) for h in (1, 2, 3)
    }
    assert set(stats) == expected
    grid_max = math.dist((0, 0), (3, 3))
    assert all(0 < value < grid_max for value in stats.values())


def test_summary_is_empty_for_a_model_without_attention():
    model = timm.create_model("resnet18", num_classes=10)
    assert diagnostics.summary(model, torch.randn(1, 3, 32, 32)) == {}


def test_summary_restores_each_module_mode_and_keeps_no_graph():
    model = small_deit().train()
    model.blocks[1].eval()
    images = torch.randn(2, 3, 32, 32)
    diagnostics.summary(model, images)
    assert model.training and model.blocks[0].training and not model.blocks[1].training
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        diagnostics.summary(model, images[0])


def test_attention_maps_of_position_only_heads_point_at_their_offset():
    layer = position_only_gpsa(36, 9)
    query = (2, 3)
    maps = diagnostics.attention_maps(OneLayer(layer), torch.randn(1, 36, *GRID), query=query)[1]
    assert maps.shape == (9, *GRID)
    for head, (dx, dy) in enumerate(kernel_offsets(9).int().tolist()):
        assert maps[head, query[0] + dy, query[1] + dx] > 0.999
    with pytest.raises(ValueError, match="outside"):
        diagnostics.attention_maps(OneLayer(layer), torch.randn(1, 36, *GRID), query=(5, 0))


def test_attention_maps_drop_the_class_token_and_sum_to_one():
    torch.manual_seed(2)
    maps = diagnostics.attention_maps(OneLayer(MHSA(16, 4), class_tokens=1), torch.randn(3, 16, *GRID))[1]
    torch.testing.assert_close(maps.sum(dim=(1, 2)), torch.ones(4))


# -- drawing ------------------------------------------------------------------------------------
def assert_png(path: Path, min_side: int = 100) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = imread(path)
    assert min(pixels.shape[:2]) >= min_side and pixels.std() > 0  # something was drawn


def write_log(path: Path, model: nn.Module, images: torch.Tensor, epochs: int = 3) -> None:
    """A log.jsonl as the engine writes it, the gates moving between epochs."""
    with path.open("w") as f:
        for epoch in range(epochs):
            record = {"epoch": epoch, "train_loss": 1.0 / (epoch + 1), **diagnostics.summary(model, images)}
            f.write(json.dumps(record) + "\n")
            with torch.no_grad():
                for _, module in diagnostics.attention_layers(model):
                    if diagnostics.is_gated(module):
                        module.gating_param.sub_(torch.linspace(0, 1, module.gating_param.numel()))


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.gpsa, self.sa = GPSA(36, 9), MHSA(36, 9)
        self.gpsa.local_init(1.0)

    def forward(self, images):
        x = images.flatten(2).transpose(1, 2)
        x = x + self.gpsa(x, GRID)
        return self.sa(x, GRID)


def test_history_plots_from_a_log(tmp_path):
    torch.manual_seed(3)
    write_log(tmp_path / "log.jsonl", TwoLayers(), torch.randn(2, 36, *GRID))
    records, dropped = read_log(tmp_path / "log.jsonl")
    assert dropped == 0
    gates = metric_history(records, "gating")
    assert sorted(gates) == [1] and len(gates[1]) == 10 and gates[1][9][0] == [0.0, 1.0, 2.0]
    assert gates[1][9][1][0] > gates[1][9][1][2]  # head 9 lost the most lambda
    assert_png(plot_nonlocality({"two layers": records, "again": records}, tmp_path / "nonlocality.png"))
    assert_png(plot_per_head(records, "gating", tmp_path / "gating.png"))
    assert_png(plot_per_head(records, "span", tmp_path / "span.png"))
    with pytest.raises(ValueError, match="no 'gating/layer"):
        plot_per_head([{"epoch": 0, "train_loss": 1.0}], "gating", tmp_path / "none.png")


def test_the_log_reader_drops_and_counts_damaged_lines(tmp_path):
    """The one reader of log.jsonl (the engine's): a killed run's cut line is dropped and counted, never fatal."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"epoch": 0}\n\nnot json\n{"epoch": 1}\n{"epoch": 2, "train_lo')
    assert read_log(log) == ([{"epoch": 0}, {"epoch": 1}], 2)
    assert read_log(tmp_path / "missing.jsonl") == ([], 0)


# -- command line -------------------------------------------------------------------------------
def load_cli():
    from convbias.cli import diagnostics as cli

    return cli


def test_cli_draws_histories_and_attention_maps(tmp_path, capsys):
    from PIL import Image
    from safetensors.torch import save_file

    cli = load_cli()
    run = tmp_path / "run"
    run.mkdir()
    write_log(run / "log.jsonl", TwoLayers(), torch.randn(2, 36, *GRID), epochs=2)
    assert cli.main([str(run)]) == 0
    for name in ("nonlocality.png", "gating_run.png", "span_run.png"):
        assert_png(run / "figures" / name)

    model = small_deit()
    checkpoint = tmp_path / "weights.safetensors"
    save_file(model.state_dict(), checkpoint)
    image = tmp_path / "disc.png"
    disc = (torch.arange(40)[:, None] - 20) ** 2 + (torch.arange(48)[None, :] - 24) ** 2 < 150
    Image.fromarray((disc.numpy() * 255).astype("uint8")).convert("RGB").save(image)
    argv = [
        "--model",
        "deit_tiny_patch16_224",
        "--checkpoint",
        str(checkpoint),
        "--image",
        str(image),
        "--img-size",
        "32",
        "--num-classes",
        "10",
        "--model-kwargs",
        "patch_size=8",
        "depth=3",
        "--output",
        str(tmp_path / "maps"),
    ]
    assert cli.main(argv) == 0
    assert_png(tmp_path / "maps" / "attention_maps.png")


def test_cli_rejects_bad_input_with_one_line(tmp_path, capsys):
    cli = load_cli()
    assert cli.main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'nowhere'}: not a run directory (a timm model's weights: --model NAME --checkpoint FILE)\n"
    )
    assert cli.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}: no log.jsonl in this directory\n"
    (tmp_path / "log.jsonl").write_text('{"epoch": 0, "train_loss": 1.0}\n')
    assert cli.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path}: its log.jsonl holds no nonlocality/, gating/, span/, deviation/ values (and no "
        "readable config.yaml names its model)\n"
    )
    assert cli.main([str(tmp_path), "--image", str(tmp_path / "log.jsonl")]) == 2  # a log, but no model
    assert capsys.readouterr().err == (
        f"error: {tmp_path}: no config.yaml, so no model for the attention maps: give --model\n"
    )


# -- the ConViT models of this package ----------------------------------------------------------
def small_convit(**kwargs) -> nn.Module:
    model = timm.create_model("convit_tiny", img_size=32, patch_size=4, num_classes=10, **kwargs)
    assert type(model).__module__ == "convit.models"
    return model


def test_convit_summary_covers_every_layer_and_head():
    model = small_convit()
    stats = diagnostics.summary(model, torch.randn(2, 3, 32, 32))
    expected = set()
    for layer in range(1, 13):
        expected |= {f"nonlocality/layer{layer}"} | {f"nonlocality/layer{layer}/head{h}" for h in range(1, 5)}
    for layer in range(1, model.local_up_to_layer + 1):
        for metric in ("gating", "span"):
            expected |= {f"{metric}/layer{layer}"} | {f"{metric}/layer{layer}/head{h}" for h in range(1, 5)}
    assert set(stats) == expected
    assert stats["gating/layer1/head1"] == pytest.approx(torch.sigmoid(torch.tensor(1.0)).item())  # lambda = 1 at init
    assert stats["span/layer10/head4"] == pytest.approx(1.0)  # alpha = 1 at init


def test_convit_position_only_layers_have_the_nonlocality_of_their_offsets():
    # locality strength 50 and content masked in every GPSA layer: each head is a sharp shift
    model = small_convit(locality_strength=50.0, conv_init="integer")  # one target pixel per head
    model.set_test_masks(content_layers=model.local_up_to_layer)
    per_layer = diagnostics.nonlocality(model, torch.randn(2, 3, 32, 32))
    expected = torch.tensor([clamped_offset_nonlocality(o, (8, 8)) for o in kernel_offsets(4).tolist()])
    for layer in range(1, model.local_up_to_layer + 1):
        torch.testing.assert_close(per_layer[layer], expected, atol=1e-4, rtol=0)
    assert diagnostics.summary(model, torch.randn(1, 3, 32, 32))["span/layer3/head2"] == pytest.approx(1 / 50)


def test_convit_nonlocality_matches_timm_convit_with_the_same_weights():
    torch.manual_seed(4)
    ours = small_convit()
    with torch.no_grad():
        for layer in ours.gpsa_layers():
            layer.gating_param.normal_()
    theirs = timm_convit.ConVit(
        img_size=32, patch_size=4, num_classes=10, embed_dim=48, num_heads=4, local_up_to_layer=10
    )
    theirs.load_state_dict(ours.state_dict(), strict=True)
    theirs.eval()
    images = torch.randn(3, 3, 32, 32)

    inputs = {}
    hooks = [
        block.attn.register_forward_pre_hook(lambda _, args, i=i: inputs.__setitem__(i, args[0]))
        for i, block in enumerate(theirs.blocks[:10])
    ]
    with torch.no_grad():
        theirs(images)
        expected = {i + 1: theirs.blocks[i].attn.get_attention_map(x) for i, x in inputs.items()}
    for hook in hooks:
        hook.remove()

    ours_per_layer = diagnostics.nonlocality(ours, images)
    for layer in range(1, 11):
        torch.testing.assert_close(ours_per_layer[layer], expected[layer], atol=1e-5, rtol=1e-4)


def test_convit_attention_map_figure(tmp_path):
    model = small_convit()
    image = torch.randn(3, 32, 32)
    maps, queries, gates = diagnostics.query_maps(model, image, query=(2, 5), layers=[2, 11])
    assert list(maps) == ["layer 2", "layer 11"] and queries["layer 2"] == (2, 5)
    torch.testing.assert_close(maps["layer 2"], diagnostics.attention_maps(model, image[None], query=(2, 5))[2])
    assert list(gates) == ["layer 2"]  # layer 2 is GPSA, layer 11 plain self-attention
    assert_png(plot_attention_maps(image, maps, queries, tmp_path / "maps.png", gates=gates))
    with pytest.raises(ValueError, match="available layers"):
        diagnostics.query_maps(model, image, layers=[13])
