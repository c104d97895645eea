"""R_f = D_f / G_f against an independent implementation of the published definitions (the authors' mode set,
mean over images, per-image noise radius) and of the robust variant, closed forms (identity, a linear filter
through its spectrum, a constant model) and explicit per-layer computations, for a timm model and for ours;
draws and their standard errors, seeds, chunking and bad input."""

import json
import math

import pytest
import timm
import torch
from torch import nn

from convbias.engine.config.options import Config
from convbias.evaluation import diffeo
from convbias.evaluation.stability import relative_stability
from convbias.families import load_families

pytestmark = pytest.mark.usefixtures("single_thread")


def _draws(images, cut, T, seed, draws=1, modes="published"):
    """The perturbations relative_stability draws, per draw: (tau x - x, unit noise directions). Each draw has
    its generator, seeded from `seed`, that draws every field first, then one noise direction per image."""
    seeds = torch.randint(0, 2**62, (draws,), generator=torch.Generator().manual_seed(seed)).tolist()
    out = []
    for s in seeds:
        generator = torch.Generator().manual_seed(s)
        fields = diffeo.sample_fields(len(images), cut, generator, modes)
        moved = diffeo.deform(images, T, cut, coefficients=fields) - images
        noise = torch.stack([torch.randn(images.shape[1:], generator=generator) for _ in images])
        out.append((moved, noise / noise.flatten(1).norm(dim=1).view(-1, 1, 1, 1)))
    return out[0] if draws == 1 else out


def _published_draws(images, cut, T, seed, draws, remap):
    """The same random numbers turned into perturbations by the authors' formulas, not by the package: modes
    sqrt(i^2 + j^2) < c + 1/2 with std 1 / sqrt(i^2 + j^2) (pcsl-epfl/diffeomorphism, scalar_field_modes),
    tau = sqrt(T) n sum C_ij sin(i pi x) sin(j pi y), and their floor/ceil bilinear remap."""
    n = images.shape[-1]
    k = torch.arange(1, cut + 1, dtype=torch.float64)
    r = (k[:, None] ** 2 + k[None, :] ** 2).sqrt()
    e = (r < cut + 0.5) / r
    s = torch.sin(math.pi * torch.linspace(0, 1, n, dtype=torch.float64)[:, None] * k[None, :])
    seeds = torch.randint(0, 2**62, (draws,), generator=torch.Generator().manual_seed(seed)).tolist()
    out = []
    for seed_k in seeds:
        generator = torch.Generator().manual_seed(seed_k)
        c = torch.randn(len(images), 2, cut, cut, generator=generator).double() * e
        deformed = []
        for image, (cu, cv) in zip(images, c):
            dx = T**0.5 * n * torch.einsum("ij,xi,yj->yx", cu, s, s)
            dy = T**0.5 * n * torch.einsum("ij,xi,yj->yx", cv, s, s)
            deformed.append(remap(image.double(), torch.stack([dx, dy])))
        noise = torch.stack([torch.randn(images.shape[1:], generator=generator) for _ in images]).double()
        out.append((torch.stack(deformed), noise / noise.pow(2).sum([1, 2, 3], keepdim=True).sqrt()))
    return out


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(6 * 64, 10)
        )

    def forward(self, x):
        return self.net(x.float())


def test_default_is_the_published_definition(authors_remap):
    """Published: D_k = mean_x ||f(tau x) - f(x)||^2, G_k the same with ||eta|| = ||tau x - x|| per image,
    normalized by the mean of ||f(x) - f(z)||^2 over all pairs (torch.cdist, as the authors' code), over 3
    draws: D, G their means, R = D / G, standard errors over draws."""
    images, model, cut, seed, draws = _digits(12), SmallCNN().eval(), 3, 5, 3
    result = relative_stability(model, images, delta=1.0, cut=cut, seed=seed, draws=draws, normalize=True, chunk_size=5)
    assert (result.convention, result.modes, result.draws) == ("published", "published", 3)
    with torch.no_grad():
        f0 = model(images).double()
        deno = torch.cdist(f0, f0).pow(2).mean()
        per_draw = []
        for deformed, directions in _published_draws(images, cut, result.T, seed, draws, authors_remap):
            sigma = (deformed - images.double()).pow(2).sum([1, 2, 3], keepdim=True).sqrt()
            fd, fq = model(deformed).double(), model(images.double() + directions * sigma).double()
            per_draw.append(((fd - f0).pow(2).mean(0).sum() / deno, (fq - f0).pow(2).mean(0).sum() / deno))
    d, g = (torch.stack([p[i] for p in per_draw]) for i in (0, 1))
    assert pytest.approx(d.mean().item(), rel=1e-4) == result.D
    assert pytest.approx(g.mean().item(), rel=1e-4) == result.G
    assert pytest.approx((d.mean() / g.mean()).item(), rel=1e-4) == result.R
    assert result.D_se == pytest.approx((d.std() / math.sqrt(draws)).item(), rel=1e-3)
    assert result.R_se == pytest.approx(((d / g).std() / math.sqrt(draws)).item(), rel=1e-3)


def test_robust_variant_is_medians_with_a_shared_radius():
    """Robust: medians over images; one radius, the median of ||tau x - x||; disc modes when asked."""
    images, model, cut, seed, draws = _digits(13), SmallCNN().eval(), 3, 2, 2
    result = relative_stability(model, images, cut=cut, seed=seed, draws=draws, convention="robust", modes="disc")
    assert (result.convention, result.modes) == ("robust", "disc")
    per_draw = []
    with torch.no_grad():
        f0 = model(images)
        for moved, directions in _draws(images, cut, result.T, seed, draws, modes="disc"):
            radius = moved.flatten(1).norm(dim=1).median()
            d = (model(images + moved) - f0).pow(2).sum(1).median()
            g = (model(images + directions * radius) - f0).pow(2).sum(1).median()
            per_draw.append((d.item(), g.item()))
    d, g = (sum(p[i] for p in per_draw) / draws for i in (0, 1))
    assert pytest.approx(d, rel=1e-4) == result.D
    assert pytest.approx(g, rel=1e-4) == result.G
    assert pytest.approx(d / g, rel=1e-4) == result.R


def test_draws_do_not_depend_on_chunks_and_reduce_the_error():
    images, model = _digits(10), SmallCNN().eval()
    one = relative_stability(model, images, draws=1)
    assert math.isnan(one.R_se) and math.isnan(one.D_se)
    many = relative_stability(model, images, draws=4, chunk_size=3)
    again = relative_stability(model, images, draws=4, chunk_size=10)
    assert (many.D, many.G, many.R, many.R_se) == pytest.approx((again.D, again.G, again.R, again.R_se), rel=1e-5)
    assert 0 < many.R_se < many.R


def _digits(count, size=16):
    """Smooth-ish test images: sklearn digits upsampled to `size`."""
    from sklearn.datasets import load_digits

    images = torch.tensor(load_digits().images[:count], dtype=torch.float32)[:, None] / 16
    return nn.functional.interpolate(images, size=size, mode="bilinear", align_corners=False)


@pytest.mark.parametrize("convention", ["published", "robust"])
def test_identity_has_unit_relative_stability(convention):
    """||eta|| = ||tau x - x|| per image (published), or the median radius with the median (robust, odd
    number of images), makes D_f = G_f exactly for f = identity."""
    result = relative_stability(nn.Identity(), _digits(33), delta=1.0, cut=3, chunk_size=10, convention=convention)
    assert pytest.approx(1.0, abs=1e-5) == result.R
    if convention == "robust":
        assert pytest.approx(result.noise_radius**2, rel=1e-5) == result.D


class CircularFilter(nn.Module):
    """A linear, translation-equivariant f: a fixed 5x5 Gaussian blur with periodic boundaries."""

    def __init__(self, width=1.2):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 5, padding=2, padding_mode="circular", bias=False)
        grid = torch.arange(5.0) - 2
        kernel = torch.exp(-(grid[:, None] ** 2 + grid[None, :] ** 2) / (2 * width**2))
        self.conv.weight.data.copy_(kernel / kernel.sum())

    def forward(self, x):
        return self.conv(x).flatten(1)

    def power_spectrum(self, size):
        """|K(k)|^2 on the size x size frequency grid (the kernel wrapped around the origin)."""
        embedded = torch.zeros(size, size, dtype=torch.float64)
        embedded[:5, :5] = self.conv.weight.detach()[0, 0].double()
        return torch.fft.fft2(torch.roll(embedded, (-2, -2), (0, 1))).abs() ** 2


def test_linear_filter_follows_from_the_spectra():
    """||K * v||^2 = sum_k |K(k)|^2 |v(k)|^2 / n^2: D_f from tau x - x, G_f from the noise, and G_f's
    expectation <r^2> <|K|^2> over the sphere."""
    size, cut, seed = 16, 3, 4
    images, model = _digits(48, size), CircularFilter()
    result = relative_stability(model, images, delta=1.0, cut=cut, seed=seed, chunk_size=20)
    moved, directions = _draws(images, cut, result.T, seed)
    spectrum = model.power_spectrum(size)

    def energy(v):
        return (spectrum * torch.fft.fft2(v[:, 0].double()).abs() ** 2).sum((-1, -2)) / size**2

    radius = moved.flatten(1).norm(dim=1).double().view(-1, 1, 1, 1)
    assert result.noise_radius == pytest.approx(radius.mean().item(), rel=1e-6)
    assert pytest.approx(energy(moved).mean().item(), rel=1e-4) == result.D
    assert pytest.approx(energy(directions * radius).mean().item(), rel=1e-4) == result.G
    assert pytest.approx((radius.pow(2).mean() * spectrum.mean()).item(), rel=0.1) == result.G
    assert result.R > 2  # a blur keeps the smooth tau x - x and removes most of the white noise: R_f > 1


class Constant(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(10))

    def forward(self, x):
        return self.bias.expand(x.shape[0], -1)


def test_constant_model_is_undefined_not_divided_by_zero():
    result = relative_stability(Constant(), _digits(8), normalize=True)
    assert result.D != result.D and result.G != result.G and result.R != result.R  # NaN: undefined
    assert math.isnan(relative_stability(Constant(), _digits(8)).R)


def test_normalization_divides_by_pairs_of_test_images():
    """Robust: the median over consecutive pairs (the published mean over all pairs is checked above)."""
    images = _digits(21)
    plain = relative_stability(nn.Identity(), images, chunk_size=6, convention="robust")
    normalized = relative_stability(nn.Identity(), images, chunk_size=6, normalize=True, convention="robust")
    pairs = (images[1:] - images[:-1]).flatten(1).pow(2).sum(1).double().quantile(0.5).item()
    assert pytest.approx(plain.D / pairs, rel=1e-5) == normalized.D
    assert pytest.approx(plain.G / pairs, rel=1e-5) == normalized.G
    assert pytest.approx(plain.R, rel=1e-6) == normalized.R


def test_per_layer_values_of_a_timm_model_match_an_explicit_computation():
    """resnet18's forward_intermediates (stem, 4 stages) against forward hooks on the same modules."""
    torch.manual_seed(0)
    model = timm.create_model("resnet18", num_classes=10, in_chans=1).eval()
    images, cut, seed = _digits(12, 32), 3, 1
    result = relative_stability(model, images, cut=cut, per_layer=True, seed=seed, chunk_size=5)
    assert len(result.layers) == 5
    moved, directions = _draws(images, cut, result.T, seed)
    modules = [model.act1, model.layer1, model.layer2, model.layer3, model.layer4, model]
    captured = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().flatten(1).clone())) for m in modules
    ]
    with torch.no_grad():
        outputs = []
        for x in (images, images + moved, images + directions * moved.flatten(1).norm(dim=1).view(-1, 1, 1, 1)):
            captured.clear()
            model(x)
            outputs.append(list(captured))
    for hook in hooks:
        hook.remove()
    for depth, (d, g, r) in enumerate(result.layers + [(result.D, result.G, result.R)]):
        ref, deformed, noisy = (o[depth] for o in outputs)
        expected_d = (deformed - ref).double().pow(2).sum(1).mean().item()
        expected_g = (noisy - ref).double().pow(2).sum(1).mean().item()
        assert d == pytest.approx(expected_d, rel=1e-3)
        assert g == pytest.approx(expected_g, rel=1e-3)
        assert r == pytest.approx(expected_d / expected_g, rel=2e-3)


def test_efcn_has_the_per_layer_values_of_the_cnn_it_embeds():
    """Our eFCN computes the CNN's function layer by layer, so it has the same R_f at every depth."""
    load_families()
    from efcn.embedding import embed

    torch.manual_seed(0)
    cnn = timm.create_model("vanilla_cnn", channels=4, in_chans=1, img_size=16, num_classes=10).eval()
    efcn = embed(cnn, cnn.input_shape)
    images = _digits(16)
    of_cnn, of_efcn = (relative_stability(m, images, per_layer=True, chunk_size=8) for m in (cnn, efcn))
    assert len(of_cnn.layers) == len(of_efcn.layers) == 3
    for a, b in zip(
        of_cnn.layers + [(of_cnn.D, of_cnn.G, of_cnn.R)], of_efcn.layers + [(of_efcn.D, of_efcn.G, of_efcn.R)]
    ):
        assert a == pytest.approx(b, rel=1e-4)


def test_convit_per_layer_reproduces_across_seeds_and_chunks():
    load_families()
    torch.manual_seed(0)
    model = timm.create_model(
        "convit_tiny", img_size=16, patch_size=4, num_classes=10, depth=3, local_up_to_layer=2, in_chans=1
    )
    images = _digits(10)
    first = relative_stability(model, images, per_layer=True, chunk_size=10, seed=3)
    again = relative_stability(model, images, per_layer=True, chunk_size=4, seed=3)
    other = relative_stability(model, images, per_layer=True, chunk_size=10, seed=4)
    assert len(first.layers) == 3
    assert [v for layer in first.layers for v in layer] == pytest.approx(
        [v for layer in again.layers for v in layer], rel=1e-4
    )
    assert pytest.approx(again.R, rel=1e-4) == first.R
    assert pytest.approx(other.R, rel=1e-3) != first.R


class Untouchable(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        raise AssertionError("the model ran before the input was checked")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(images=torch.zeros(0, 1, 28, 28)),
            r"images must be a non-empty \(N, C, H, W\) tensor, got \(0, 1, 28, 28\)",
        ),
        (dict(delta=4.0), r"delta=4.0 is outside the diffeomorphism region \[0.5, 2.97\] pixels for cut=3 on a 28x28"),
        (dict(cut=40), r"cut=40 must be an integer in \[2, 28\]"),
        (dict(T=1.0), r"T=1.0 is outside the diffeomorphism region"),
        (dict(convention="mode"), r"convention='mode' must be one of \('published', 'robust'\)"),
        (dict(modes="square"), r"modes='square' must be one of \('published', 'disc'\)"),
        (dict(draws=0), r"draws=0 must be a positive integer"),
        (dict(chunk_size=0), r"chunk_size=0 must be a positive integer"),
        (dict(per_layer=True), r"per-layer R_f needs a model with forward_intermediates or activation modules"),
        (dict(images=torch.rand(1, 1, 28, 28), normalize=True), r"normalize=True needs at least 2 images"),
    ],
)
def test_bad_input_is_refused_before_any_work(kwargs, message):
    images = kwargs.pop("images", torch.rand(4, 1, 28, 28))
    with pytest.raises(ValueError, match=message):
        relative_stability(Untouchable(), images, **kwargs)


# ------------------------------------------------------------------ a short training run and the command
RUN = dict(
    model="vanilla_cnn",
    model_kwargs=dict(channels=4),
    img_size=16,
    batch_size=32,
    lr=3e-3,
    drop_path=0,
    epochs=2,
    diagnostics_images=24,
    save_epochs=[0, 2],
)


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory, cli_argv):
    from convbias.cli import train

    output = tmp_path_factory.mktemp("stability") / "run"
    return output, train.run(cli_argv(cli_argv.DEIT_RECIPE, cli_argv.PLAIN_DIGITS, RUN, output=output))


def _val_images(count):
    from convbias.engine.data.factory import build_datasets

    val = build_datasets(Config(dataset="digits", img_size=16, crop_pct=1.0, no_aug=True)).val
    return torch.stack([val[i][0] for i in range(count)])


def _snapshot_model(run, name):
    from convbias.base.weights import load_weights

    model = timm.create_model("vanilla_cnn", channels=4, in_chans=1, img_size=16, num_classes=10)
    return load_weights(model, run / "checkpoints" / f"{name}.safetensors").eval()


def test_training_logs_rf_each_evaluation_and_at_initialization(digits_run):
    """`--diagnostics` logs R_f (logits and every layer) after each epoch and, as init_*, before training:
    the values relative_stability gives for the saved initial and final weights on the same images."""
    run, _ = digits_run
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert {"init_rf", "init_rf_layer2", "rf", "rf_layer2"} <= set(records[0])
    assert "init_rf" not in records[1] and "rf_layer2" in records[1]
    images = _val_images(24)
    for prefix, snapshot, record in (("init_rf", "epoch_0", records[0]), ("rf", "epoch_2", records[1])):
        expected = relative_stability(_snapshot_model(run, snapshot), images, per_layer=True).as_dict(prefix)
        assert {k: record[k] for k in expected} == pytest.approx(expected, rel=1e-4)
    assert records[0]["init_rf"] != pytest.approx(records[1]["rf"], rel=1e-3)  # training changed R_f


def test_command_measures_runs_and_writes_table_and_plots(digits_run, tmp_path):
    import csv

    from convbias.studies.stability import command as stability

    run, results = digits_run
    out = tmp_path / "out"
    assert (
        stability.main(
            [
                str(run),
                "--checkpoints",
                "init",
                "last",
                "--images",
                "24",
                "--deltas",
                "0.5",
                "1",
                "--cuts",
                "3",
                "4",
                "--draws",
                "2",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    rows = list(csv.DictReader((out / "stability.csv").read_text().splitlines()))
    assert len(rows) == 2 * 2 * 2  # checkpoints x cuts x deltas
    init = next(r for r in rows if r["checkpoint"] == "init" and float(r["delta"]) == 1 and r["cut"] == "3")
    expected = relative_stability(_snapshot_model(run, "epoch_0"), _val_images(24), delta=1.0, cut=3, draws=2)
    assert float(init["R"]) == pytest.approx(expected.R, rel=1e-5)
    assert float(init["R_se"]) == pytest.approx(expected.R_se, rel=1e-4)
    assert (init["convention"], init["modes"], init["images"], init["draws"]) == ("published", "published", "24", "2")
    summary = list(csv.DictReader((out / "summary.csv").read_text().splitlines()))
    assert len(summary) == 2 * 2 * 2 and {s["n"] for s in summary} == {"1"}  # one seed: no interval
    assert "convention published, modes published, 24 test images, 2 draws" in (out / "summary.md").read_text()
    grid = ["--checkpoints", "init", "last", "--deltas", "0.5", "1", "--cuts", "3", "4"]
    assert stability.main(["--combine", str(out), *grid, "--output", str(tmp_path / "again")]) == 0
    for name in ("summary.csv", "stability.md", "summary.md"):  # the same tables from the rows alone
        assert (tmp_path / "again" / name).read_text() == (out / name).read_text()
    final = next(r for r in rows if r["checkpoint"] == "last")  # through the engine's run_dir
    assert float(final["test_error"]) == pytest.approx(100 - results["final_top1"], abs=1e-6)
    layers = list(csv.DictReader((out / "stability_layers.csv").read_text().splitlines()))
    assert [r["depth"] for r in layers] == ["0", "1", "2", "3"] * 2  # 3 activations + logits, per checkpoint
    assert "| run | model | P | seed |" in (out / "stability.md").read_text()
    for name in ("rf_vs_delta", "rf_per_layer", "rf_vs_error", "deformed_examples"):
        assert (out / f"{name}.png").stat().st_size > 5000
    contrasts = list(csv.DictReader((out / "contrasts.csv").read_text().splitlines()))
    assert [(c["group"], c["n_reference"]) for c in contrasts] == [("vanilla_cnn f=1", "0")]  # not with itself


def test_command_refuses_bad_input_before_any_work(digits_run, tmp_path, capsys):
    from convbias.studies.stability import command as stability

    run, _ = digits_run
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.yaml").write_text((run / "config.yaml").read_text().replace("channels: 4", "channels: 8"))
    (other / "checkpoints").symlink_to(run / "checkpoints")
    cases = [
        ([str(run), "--cuts", "4", "--deltas", "1.5"], "delta=1.5 is outside the diffeomorphism region [0.5, 1.27]"),
        ([str(run), "--checkpoints", "epoch_7"], "has no checkpoint 'epoch_7'"),
        ([str(other)], "does not fit this model"),
        ([str(run), "--images", "0"], "argument --images: must be a positive integer, got 0"),
        ([str(run), "--draws", "0"], "argument --draws: must be a positive integer, got 0"),
        ([str(run), "--combine", str(tmp_path)], "give either RUN folders to measure or --combine DIR"),
        (["--combine", str(tmp_path)], "stability.csv not found: measure the runs with convbias-stability first"),
        ([str(tmp_path)], "is not a run directory: no config.yaml"),
        (
            [str(run), "--checkpoints", "last", "bestest"],
            "argument --checkpoints: must be best, last, init (= epoch_0) or epoch_N (a --save-epochs snapshot), got bestest",
        ),
    ]
    for argv, message in cases:
        out = tmp_path / "out"
        grid = [] if "--cuts" in argv else ["--cuts", "3", "--deltas", "1"]
        assert stability.main(argv + grid + ["--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
        assert not out.exists()


def test_command_refuses_a_damaged_checkpoint_before_any_output(digits_run, tmp_path, capsys):
    """A truncated --save-epochs snapshot: one line naming it, exit 65, and no output folder."""
    import shutil

    from convbias.base.errors import EXIT_DAMAGED
    from convbias.studies.stability import command as stability

    run, _ = digits_run
    damaged = tmp_path / "run"
    shutil.copytree(run, damaged, symlinks=True)
    snapshot = damaged / "checkpoints" / "epoch_0.safetensors"
    snapshot.write_bytes(snapshot.read_bytes()[:-8])
    out = tmp_path / "out"
    argv = [str(damaged), "--checkpoints", "init", "last", "--cuts", "3", "--deltas", "1", "--output", str(out)]
    assert stability.main(argv) == EXIT_DAMAGED
    assert capsys.readouterr().err.splitlines() == [
        f"error: {snapshot} is damaged: it does not match its entry in snapshots.json; it was not loaded"
    ]
    assert not out.exists()
