"""Robustness evaluation: attacks on a small CNN trained here on the embedded digits, corruptions on
real photos shipped with scikit-learn, the class mapping of benchmark folders, and the CLI."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file

from convbias.engine.config.options import Config
from convbias.engine.data.factory import build_datasets
from convbias.engine.data.loaders import build_eval_loader
from convbias.studies.robustness.corruptions import CATEGORY_OF, CORRUPTIONS, SEVERITIES, corrupt
from convbias.studies.robustness.measure import (
    Denormalized,
    PixelModel,
    accuracy,
    adversarial_accuracy,
    class_index,
    fgsm,
    pgd,
    read_class_list,
)
from convbias.studies.robustness.report import corruption_errors, relative_improvement

# timm's tiny ResNet on 16-px digits: a second thread costs more than it saves
pytestmark = pytest.mark.usefixtures("single_thread")

MODEL = "test_resnet"  # timm's 0.37M-parameter ResNet
IMG_SIZE = 16
EPOCHS = 3


def _load_cli():
    from convbias.studies.robustness import command as cli

    return cli


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """test_resnet trained for a few epochs on digits (no augmentation), its weights before and
    after training as safetensors files, and the validation set as [0, 1] pixel batches."""
    torch.manual_seed(0)
    bundle = build_datasets(Config(dataset="digits", img_size=IMG_SIZE, no_aug=True))
    model = timm.create_model(MODEL, num_classes=bundle.num_classes, in_chans=bundle.in_chans)
    folder = tmp_path_factory.mktemp("weights")
    save_file(model.state_dict(), folder / "untrained.safetensors")
    loader = torch.utils.data.DataLoader(
        bundle.train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(EPOCHS):
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    save_file(model.state_dict(), folder / "trained.safetensors")
    model.eval()
    eval_loader = build_eval_loader(bundle.val, 128, 0)
    batches = list(Denormalized(eval_loader, bundle.mean, bundle.std))
    return dict(
        model=model,
        pixel_model=PixelModel(model, bundle.mean, bundle.std).eval(),
        bundle=bundle,
        eval_loader=eval_loader,
        batches=batches,
        weights=folder,
    )


def test_pixel_model_applies_the_normalization(trained):
    """Attacks act on [0, 1] pixels: denormalized batches through PixelModel give the logits the
    model gives on the loader's normalized images."""
    images, _ = next(iter(trained["eval_loader"]))
    pixels, _ = trained["batches"][0]
    assert pixels.min() >= 0 and pixels.max() <= 1
    with torch.no_grad():
        torch.testing.assert_close(trained["pixel_model"](pixels), trained["model"](images), atol=1e-4, rtol=1e-4)


def test_pixel_model_from_timm_data_config():
    model = timm.create_model(MODEL, num_classes=10).eval()
    wrapped = PixelModel.from_data_config(model)
    pixels = torch.rand(2, 3, 16, 16)
    mean, std = torch.tensor(model.pretrained_cfg["mean"]), torch.tensor(model.pretrained_cfg["std"])
    with torch.no_grad():
        expected = model((pixels - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1))
        torch.testing.assert_close(wrapped(pixels), expected)


def test_eps_zero_leaves_accuracy_unchanged(trained):
    model, batches = trained["pixel_model"], trained["batches"]
    clean = accuracy(model, batches)
    assert clean > 80, f"the test model did not learn digits ({clean:.1f}%)"
    attacked = adversarial_accuracy(model, batches, eps=0, pgd_steps=5, pgd_step_size=0.5, random_start=True)
    assert attacked == {"FGSM": clean, "PGD": clean}
    pixels, labels = batches[0]
    assert torch.equal(fgsm(model, pixels, labels, 0.0), pixels)
    assert torch.equal(pgd(model, pixels, labels, 0.0, 0.5 / 255, 5, random_start=True), pixels)


def test_attacks_lower_accuracy_and_pgd_is_at_least_as_strong(trained):
    model, batches = trained["pixel_model"], trained["batches"]
    clean = accuracy(model, batches)
    eps = 8.0  # 0-255 scale; the paper's PGD step/eps ratio (0.5 / 1) and 5 steps
    attacked = adversarial_accuracy(model, batches, eps=eps, pgd_steps=5, pgd_step_size=eps / 2, random_start=True)
    assert attacked["FGSM"] < clean - 10, (clean, attacked)
    assert attacked["PGD"] <= attacked["FGSM"], attacked
    # smaller budgets do less damage
    weaker = adversarial_accuracy(model, batches, eps=2.0, pgd_steps=5, pgd_step_size=1.0)
    assert attacked["FGSM"] < weaker["FGSM"] < clean and attacked["PGD"] < weaker["PGD"] < clean


def test_pgd_stays_in_the_budget_and_the_pixel_range(trained):
    model = trained["pixel_model"]
    pixels, labels = trained["batches"][0]
    eps = 4 / 255
    for random_start in (True, False):
        adversarial = pgd(model, pixels, labels, eps, 2 / 255, 5, random_start, torch.Generator().manual_seed(0))
        assert (adversarial - pixels).abs().max() <= eps + 1e-6
        assert adversarial.min() >= 0 and adversarial.max() <= 1
        assert (adversarial != pixels).any()


# ------------------------------------------------------------------------------ corruptions


@pytest.fixture(scope="module")
def photos() -> torch.Tensor:
    """Eight 48x48 crops of the two photographs shipped with scikit-learn, (8, 3, 48, 48) in [0, 1]."""
    from sklearn.datasets import load_sample_images

    crops = [
        image[y : y + 200, x : x + 200]
        for image in load_sample_images().images
        for y, x in ((0, 0), (100, 200), (200, 400), (220, 100))
    ]
    batch = torch.stack([torch.from_numpy(np.ascontiguousarray(c)).permute(2, 0, 1).float() / 255 for c in crops])
    return F.interpolate(batch, size=(48, 48), mode="bilinear", antialias=True).clamp(0, 1)


@pytest.fixture(scope="module")
def corrupted(photos) -> dict[tuple[str, int], torch.Tensor]:
    return {
        (name, severity): corrupt(photos, name, severity, torch.Generator().manual_seed(severity))
        for name in CORRUPTIONS
        for severity in SEVERITIES
    }


def test_there_are_15_corruptions_in_4_categories():
    assert len(CORRUPTIONS) == 15
    assert sorted(set(CATEGORY_OF.values())) == ["blur", "digital", "noise", "weather"]


def test_corruptions_keep_shape_dtype_and_range(photos, corrupted):
    for (name, severity), out in corrupted.items():
        assert out.shape == photos.shape and out.dtype == photos.dtype, (name, severity)
        assert out.min() >= 0 and out.max() <= 1, (name, severity)
        assert not torch.equal(out, photos) or (name, severity) == ("defocus_blur", 1), (name, severity)
    gray = torch.rand(2, 1, 20, 28, dtype=torch.float64)  # one channel, not square, float64
    for name in CORRUPTIONS:
        out = corrupt(gray, name, 5, torch.Generator().manual_seed(0))
        assert out.shape == gray.shape and out.dtype == torch.float64, name
        assert out.min() >= 0 and out.max() <= 1, name


def test_filters_match_scipy_with_mirrored_borders():
    """The blur helpers against scipy.ndimage (the Gaussian of ImageNet-C's skimage calls), on the
    direct and the FFT path, with kernels wider than the image."""
    from scipy import ndimage

    from convbias.studies.robustness.filters import filter2d, gaussian_blur

    generator = torch.Generator().manual_seed(0)
    image = torch.rand(1, 1, 20, 23, generator=generator, dtype=torch.float64)
    for shape in ((5, 7), (15, 13), (3, 61)):
        kernel = torch.rand(shape, generator=generator, dtype=torch.float64)
        expected = ndimage.correlate(image[0, 0].numpy(), kernel.numpy(), mode="reflect")
        np.testing.assert_allclose(filter2d(image, kernel)[0, 0].numpy(), expected, atol=1e-5)
    for sigma in (0.7, 3.0, 30.0):
        expected = ndimage.gaussian_filter(image[0, 0].numpy(), sigma, mode="reflect", truncate=4.0)
        np.testing.assert_allclose(gaussian_blur(image, sigma)[0, 0].numpy(), expected, atol=1e-5)


def test_brightness_is_the_published_hsv_value_shift(photos):
    """ImageNet-C adds c to the HSV value; matplotlib's HSV conversion is the oracle."""
    from matplotlib.colors import hsv_to_rgb, rgb_to_hsv

    for severity in (1, 5):
        shift = (0.1, 0.2, 0.3, 0.4, 0.5)[severity - 1]
        hsv = rgb_to_hsv(photos.permute(0, 2, 3, 1).double().numpy())
        hsv[..., 2] = np.clip(hsv[..., 2] + shift, 0, 1)
        expected = torch.from_numpy(hsv_to_rgb(hsv)).permute(0, 3, 1, 2).float()
        torch.testing.assert_close(corrupt(photos, "brightness", severity), expected, atol=1e-5, rtol=0)


def test_noise_follows_the_published_parameters():
    """On a mid-gray image (little clipping): Gaussian noise has std c, shot noise is Poisson with
    c photons per unit (variance x / c), impulse noise flips a fraction c of the values."""
    gray = torch.full((4, 3, 64, 64), 0.5)
    for severity, std in zip((1, 2, 3), (0.08, 0.12, 0.18)):
        noisy = corrupt(gray, "gaussian_noise", severity, torch.Generator().manual_seed(severity))
        assert (noisy - gray).std().item() == pytest.approx(std, rel=0.03)
    for severity, photons in zip((1, 2), (60, 25)):
        noisy = corrupt(gray, "shot_noise", severity, torch.Generator().manual_seed(severity))
        assert noisy.mean().item() == pytest.approx(0.5, abs=0.01)
        assert noisy.var().item() == pytest.approx(0.5 / photons, rel=0.05)
        assert torch.allclose(noisy * photons, (noisy * photons).round(), atol=1e-4)
    for severity, amount in zip((1, 5), (0.03, 0.27)):
        noisy = corrupt(gray, "impulse_noise", severity, torch.Generator().manual_seed(severity))
        flipped = noisy != gray
        assert flipped.float().mean().item() == pytest.approx(amount, rel=0.05)
        assert noisy[flipped].eq(1).float().mean().item() == pytest.approx(0.5, abs=0.03)


def test_pixelate_is_a_box_resize_to_the_published_fraction():
    image = torch.rand(1, 1, 40, 40, generator=torch.Generator().manual_seed(0))
    out = corrupt(image, "pixelate", 4)  # fraction 0.3: 12 x 12 blocks of 40 / 12 pixels
    assert len(torch.unique(out[0, 0, 0])) == 12
    assert out.mean().item() == pytest.approx(image.mean().item(), abs=0.01)


def test_corruptions_are_reproducible(photos):
    for name in ("snow", "elastic_transform", "glass_blur"):
        first = corrupt(photos[:2], name, 3, torch.Generator().manual_seed(7))
        again = corrupt(photos[:2], name, 3, torch.Generator().manual_seed(7))
        other = corrupt(photos[:2], name, 3, torch.Generator().manual_seed(8))
        assert torch.equal(first, again) and not torch.equal(first, other), name


def _mean_distance(out: torch.Tensor, clean: torch.Tensor) -> float:
    return (out - clean).abs().mean().item()


def _unexplained_variance(out: torch.Tensor, clean: torch.Tensor) -> float:
    """1 - r^2 of corrupted vs clean pixels, per image, averaged: the share of the corrupted image
    that an affine function of the clean one does not explain."""
    x, y = clean.flatten(1), out.flatten(1)
    x, y = x - x.mean(1, keepdim=True), y - y.mean(1, keepdim=True)
    r = (x * y).sum(1) / (x.norm(dim=1) * y.norm(dim=1))
    return (1 - r**2).mean().item()


def test_higher_severity_does_more_damage(photos, corrupted):
    def damage(name, metric=_mean_distance):
        return [metric(corrupted[name, severity], photos) for severity in SEVERITIES]

    for name in (
        "gaussian_noise",
        "shot_noise",
        "impulse_noise",
        "defocus_blur",
        "glass_blur",
        "motion_blur",
        "zoom_blur",
        "snow",
        "brightness",
        "contrast",
        "pixelate",
        "jpeg_compression",
    ):
        d = damage(name)
        assert all(a < b for a, b in itertools.pairwise(d)), (name, d)
    # frost and fog blend an overlay with a falling image/overlay ratio; the mean distance also
    # moves with the brightness shift, so the damage is measured by the unexplained variance
    for name in ("frost", "fog"):
        d = damage(name, _unexplained_variance)
        assert all(a < b for a, b in itertools.pairwise(d)), (name, d)
    # the published elastic table has two regimes: large smooth warps (1-2), then local jitter (3-5)
    d = damage("elastic_transform")
    assert d[0] < d[1] and d[2] < d[3] < d[4], d


# ------------------------------------------------------------------------- class mapping


def test_class_index_maps_a_subset_and_names_unmatched_classes(tmp_path):
    wnids = ["n01440764", "n01443537", "n01484850", "n01491361"]
    (tmp_path / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for wnid in wnids:
        (tmp_path / "train" / wnid).mkdir(parents=True)
    assert read_class_list(tmp_path / "wnids.txt") == wnids == read_class_list(tmp_path / "train")
    assert class_index("imagenet-a", ["n01443537", "n01491361"], wnids) == [1, 3]
    with pytest.raises(ValueError, match=r"imagenet-r.*n09999999") as error:
        class_index("imagenet-r", ["n01443537", "n09999999"], wnids)
    assert "n01443537" not in str(error.value).split(":")[-1]


def test_imagenet_c_folders_flat_or_inside_their_category(tmp_path):
    from convbias.studies.robustness.measure import imagenet_c_folders

    (tmp_path / "gaussian_noise" / "1").mkdir(parents=True)
    (tmp_path / "blur" / "zoom_blur" / "1").mkdir(parents=True)
    folders = imagenet_c_folders(tmp_path, ["gaussian_noise", "zoom_blur"], [1])
    assert folders == {
        ("gaussian_noise", 1): tmp_path / "gaussian_noise" / "1",
        ("zoom_blur", 1): tmp_path / "blur" / "zoom_blur" / "1",
    }
    with pytest.raises(ValueError, match=r"lacks .*zoom_blur/2"):
        imagenet_c_folders(tmp_path, ["gaussian_noise", "zoom_blur"], [1, 2])


def test_subset_logits_predict_among_the_folder_classes_only():
    from convbias.studies.robustness.measure import correct

    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [9.0, 0.0, 3.0, 1.0]])
    # dataset label 0 -> logit 2, label 1 -> logit 3
    assert correct(logits, torch.tensor([1, 0]), [2, 3]).tolist() == [True, True]
    assert (
        correct(logits, torch.tensor([1, 0])).tolist() == [True, True] != correct(logits, torch.tensor([3, 2])).tolist()
    )


def test_corruption_errors_and_relative_improvement():
    rows = [
        dict(model=m, corruption=c, category=CATEGORY_OF[c], severity=s, top1=top1)
        for m, base in (("tcnn", 60.0), ("cnn", 50.0))
        for c in ("gaussian_noise", "contrast")
        for s, top1 in ((1, base), (5, base - 20))
    ]
    errors = {(r["model"], r["category"]): r for r in corruption_errors(rows, baseline="cnn")}
    assert errors["cnn", "noise"]["ce"] == pytest.approx(60.0)  # errors 50 and 70
    assert errors["tcnn", "all"]["relative_ce"] == pytest.approx(100 * 100 / 120)
    per_category, per_severity = relative_improvement(rows, "tcnn", "cnn")
    assert per_category == {"noise": pytest.approx(25.0), "digital": pytest.approx(25.0)}  # 50 vs 40
    assert per_severity == {1: pytest.approx(20.0), 5: pytest.approx(100 * 10 / 30)}


# ---------------------------------------------------------------------------------- CLI


def _write_digit_folder(root: Path, bundle, classes: list[str], per_class: int = 6) -> None:
    """An ImageNet-A-style folder: root/<class>/<image>.png with digits of those classes."""
    images, targets = bundle.val.images, bundle.val.targets
    for name in classes:
        (root / name).mkdir(parents=True)
        if name not in bundle.class_names:
            Image.fromarray(images[0]).save(root / name / "0.png")
            continue
        picks = [i for i, t in enumerate(targets) if bundle.class_names[t] == name][:per_class]
        for i in picks:
            Image.fromarray(images[i]).convert("RGB").save(root / name / f"{i}.png")


def _read_csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_cli_writes_the_table_and_the_comparison_plot(trained, tmp_path, capsys, cli_argv):
    cli = _load_cli()
    _write_digit_folder(tmp_path / "A", trained["bundle"], ["3", "7"])
    out = tmp_path / "out"
    weights = trained["weights"] / "trained.safetensors"
    code = cli.main(
        [str(weights)]
        + cli_argv(
            model=MODEL,
            compare_model=MODEL,
            compare_checkpoint=trained["weights"] / "untrained.safetensors",
            img_size=IMG_SIZE,
            max_images=64,
            eps=8,
            pgd_step_size=4,
            corruptions=["gaussian_noise", "contrast", "zoom_blur"],
            severities=[1, 5],
            imagenet_a=tmp_path / "A",
            workers=0,
            output=out,
        )
    )
    assert code == 0
    table = _read_csv(out / "robustness.csv")
    assert [row["model"] for row in table] == [f"{MODEL} (trained)", f"{MODEL} (untrained)"]
    trained_row, untrained_row = table
    assert list(table[0]) == [
        *("model", "checkpoint", "img_size", "params_m", "clean", "C", "A", "R", "FGSM", "PGD"),
        *("eps_255", "eps_fraction", "pgd_steps", "pgd_step_255", "pgd_random_start"),
    ]
    assert trained_row["checkpoint"] == str(weights)  # a weights file, not a run: its path
    assert trained_row["R"] == "" and float(trained_row["params_m"]) == pytest.approx(0.37, abs=0.01)
    assert float(trained_row["clean"]) > 80 > float(untrained_row["clean"])
    assert float(trained_row["PGD"]) <= float(trained_row["FGSM"]) < float(trained_row["clean"])
    # A: the 12 images of classes 3 and 7, predicted among logits 3 and 7 only
    assert float(trained_row["A"]) >= 90
    markdown = (out / "robustness.md").read_text()
    assert markdown.startswith(
        "| model | checkpoint | img_size | params_m | clean | C | A | R "
        "| FGSM eps 8/255 (0.03137) | PGD eps 8/255 (0.03137), 5 steps |"
    )
    assert f"| {MODEL} (trained) | {weights} | 16 |" in markdown
    assert "| - |" in markdown  # R not evaluated
    corruptions = _read_csv(out / "corruptions.csv")
    assert len(corruptions) == 2 * 3 * 2
    mean_c = np.mean([float(r["top1"]) for r in corruptions if r["model"] == trained_row["model"]])
    assert float(trained_row["C"]) == pytest.approx(mean_c, abs=0.01)
    errors = _read_csv(out / "corruption_errors.csv")
    assert {r["category"] for r in errors} == {"noise", "blur", "digital", "all"}
    png = (out / "improvement.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    assert "wrote" in capsys.readouterr().out


def test_cli_reads_an_imagenet_c_folder(trained, tmp_path, cli_argv):
    """Stored corrupted images are evaluated as they are: a folder made of gaussian_noise at
    severity 5 gives the accuracy of the model on exactly those images."""
    cli = _load_cli()
    bundle = trained["bundle"]
    pixels, labels = trained["batches"][0]
    pixels, labels = pixels[:40], labels[:40]
    noisy = corrupt(pixels, "gaussian_noise", 5, torch.Generator().manual_seed(0))
    stored = (noisy * 255).round().to(torch.uint8)
    for i, (image, label) in enumerate(zip(stored, labels)):
        folder = tmp_path / "C" / "gaussian_noise" / "5" / bundle.class_names[label]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[0].numpy()).save(folder / f"{i}.png")
    for name in bundle.class_names:  # classes without images still have their folder
        (tmp_path / "C" / "gaussian_noise" / "5" / name).mkdir(parents=True, exist_ok=True)
    out = tmp_path / "out"
    code = cli.main(
        [str(trained["weights"] / "trained.safetensors")]
        + cli_argv(
            model=MODEL,
            img_size=IMG_SIZE,
            max_images=64,
            attacks="none",
            imagenet_c=tmp_path / "C",
            corruptions="gaussian_noise",
            severities=5,
            workers=0,
            output=out,
        )
    )
    assert code == 0
    expected = accuracy(trained["pixel_model"], [(stored.float() / 255, labels)])
    rows = _read_csv(out / "corruptions.csv")
    assert [(r["source"], r["corruption"], r["severity"]) for r in rows] == [("imagenet-c", "gaussian_noise", "5")]
    assert float(rows[0]["top1"]) == pytest.approx(expected, abs=0.01)
    assert float(_read_csv(out / "robustness.csv")[0]["C"]) == pytest.approx(expected, abs=0.01)
    assert "| R | FGSM | PGD |" in (out / "robustness.md").read_text()  # no attack: no eps to state


def test_cli_table_says_what_the_attacks_measured(trained, tmp_path, capsys, cli_argv):
    """The table of weights given as the first argument says what FGSM measured (eps in grey levels and as a
    fraction) and that PGD did not run; without the weights, one error line says where they go."""
    cli = _load_cli()
    weights = str(trained["weights"] / "trained.safetensors")
    options = dict(model=MODEL, img_size=IMG_SIZE, max_images=32, attacks="fgsm", corruptions="none", workers=0)
    assert cli.main([weights, *cli_argv(options, output=tmp_path / "new")]) == 0
    capsys.readouterr()
    row = _read_csv(tmp_path / "new" / "robustness.csv")[0]
    assert (row["eps_255"], row["eps_fraction"], row["pgd_steps"], row["PGD"]) == ("1", "0.00392157", "", "")
    markdown = (tmp_path / "new" / "robustness.md").read_text()
    assert "| FGSM eps 1/255 (0.003922) | PGD |" in markdown
    assert "white-box L-inf attacks on the clean evaluation images, eps 1/255 (0.003922)." in markdown
    assert cli.main(cli_argv(options, output=tmp_path / "none")) == 2
    assert capsys.readouterr().err == (
        "error: give the run or weights to evaluate as the first argument: convbias-robustness RUN ...\n"
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--corruptions", "rain"], "argument --corruptions: invalid choice: 'rain'"),
        (["--severities", "6"], "--severities"),
        (["--eps", "-1"], "--eps"),
        (["--compare-model", MODEL], "--compare-checkpoint"),
        (["--imagenet-c", "MISSING_C"], "lacks"),
        (["--imagenet-a", "UNMAPPED_A"], "x_not_a_digit"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(trained, tmp_path, capsys, cli_argv, extra, message):
    cli = _load_cli()
    extra = [str(tmp_path / "C") if arg == "MISSING_C" else arg for arg in extra]
    if "UNMAPPED_A" in extra:
        _write_digit_folder(tmp_path / "A", trained["bundle"], ["3", "x_not_a_digit"])
        extra = [str(tmp_path / "A") if arg == "UNMAPPED_A" else arg for arg in extra]
    if "--imagenet-c" in extra:
        (tmp_path / "C" / "gaussian_noise" / "1").mkdir(parents=True)
        extra += ["--corruptions", "gaussian_noise", "contrast", "--severities", "1"]
    weights = trained["weights"] / "trained.safetensors"
    code = cli.main([str(weights), *cli_argv(model=MODEL, img_size=IMG_SIZE, output=tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not (tmp_path / "out").exists()
    if "x_not_a_digit" in message:
        assert str(tmp_path / "A") in err and "'3'" not in err


def test_cli_rejects_weights_of_another_model(trained, tmp_path, capsys, cli_argv):
    cli = _load_cli()
    weights = trained["weights"] / "trained.safetensors"
    code = cli.main([str(weights), *cli_argv(model="resnet10t", img_size=IMG_SIZE, output=tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "does not fit this model" in err and "trained.safetensors" in err, err
    assert err.count("\n") == 1
