"""Every family through every command that takes a run or a model (the table of docs/families.md): ConViT, DeiT+,
T-CNN (fine-tuned from a plain ResNet's weights), the eFCN (of a CNN trained first), its FCN and the toy family of
tests/toy_family, each trained for real on the embedded digits at a tiny size, then resumed, evaluated, labelling
images, exported (with --pt2 and --onnx), loaded by timm with and without this package, drawn, ensembled, measured
(relative stability, robustness), with its model card. Each cell works, or is refused with one line that says why, before anything is written; the
docs' table says which.

Then the cases a user met, each its own test on the same runs: a T-CNN's history figures (and a T-CNN beside a
DeiT), an eFCN exported once its CNN's checkpoint is gone, a DeiT+ given a ConViT recipe, and the history figures'
axes (from initialization, shared, color bars). (Attention maps of the run's own evaluation transform:
tests/engine/rundir/test_run_dir.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import yaml
from matplotlib.figure import Figure
from PIL import Image
from safetensors.torch import load_file, save_file
from sklearn.datasets import load_digits
from support import REPO

from convbias import families
from convbias.cli import diagnostics, export, predict, train
from convbias.evaluation import figures
from convbias.sharing.hub import run_model
from convbias.studies.ensembles import command as ensemble
from convbias.studies.robustness import command as robustness
from convbias.studies.stability import command as stability

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY_VIT = dict(patch_size=2, depth=2, embed_dim=8)
CNN = dict(model="vanilla_cnn", model_kwargs=dict(channels=4))  # the eFCN's CNN (Sec. 6.2.2), trained one epoch first
RECIPES = {  # each family's model at a tiny size, on the 8x8 digits (the T-CNN's ResNet at 16x16)
    "ConViT": dict(model="convit_tiny", model_kwargs=dict(TINY_VIT, local_up_to_layer=1)),
    "DeiT+": dict(model="deit_tiny_plus", model_kwargs=TINY_VIT),
    # fine-tuned from a plain ResNet's weights (transformed when loaded), as configs/train/tcnn_finetune.yaml
    "T-CNN": dict(model="tcnn_resnet10t", model_kwargs=dict(channels="8,8,8,8"), img_size=16, pretrained=True),
    "eFCN": dict(model="efcn_vanilla_cnn", model_kwargs=dict(channels=4), drop_path=0),  # + its CNN's checkpoint
    "FCN": dict(model="fcn_vanilla_cnn", model_kwargs=dict(channels=4), drop_path=0),
    "toy": dict(model="toy_net"),
}
COMMANDS = ("train", "resume", "--eval-only", "predict", "export", "timm", "timm alone", "histories", "--image",
            "ensemble", "stability", "robustness", "card")  # fmt: skip
# the exported architectures that timm alone does not have
NOT_TIMMS = {"DeiT+": "deit_tiny_plus", "T-CNN": "tcnn_resnet10t", "eFCN": "efcn_vanilla_cnn", "FCN": "fcn_vanilla_cnn",
             "toy": "toy_net"}  # fmt: skip
# The refusals: (family, command) -> the one line's pattern. Every other cell works.
REFUSED = {
    ("toy", "histories"): r"its model toy_net has no attention layer, gated layer or embedded convolution",
    ("eFCN", "--image"): r"^EmbeddedFCN has no attention layer with explicit attention maps$",
    ("FCN", "--image"): r"^EmbeddedFCN has no attention layer with explicit attention maps$",
    ("toy", "stability"): r"^per-layer R_f needs a model with forward_intermediates or activation modules; ToyNet ",
    # timm alone builds only its own architectures: of these, the ConViT
    **{(family, "timm alone"): rf"^RuntimeError: Unknown model \({model}\)$" for family, model in NOT_TIMMS.items()},
}
FIGURES = {  # what convbias-diagnostics RUN draws for a family that logs what they need
    "ConViT": ["nonlocality.png", "gating_ConViT.png", "span_ConViT.png"],
    "DeiT+": ["nonlocality.png"],
    "T-CNN": ["gating_T-CNN.png", "span_T-CNN.png"],
    "eFCN": ["deviation.png"],
    "FCN": ["deviation.png"],
}
FAMILY_PACKAGE = {"ConViT": "convit", "DeiT+": "convit", "T-CNN": "transformed_cnn", "eFCN": "efcn", "FCN": "efcn",
                  "toy": "toy_family"}  # fmt: skip


@pytest.fixture(scope="module")
def plugged() -> families.Families:
    """The families with the toy family plugged in as a real one is (by its name beside FAMILIES'), handed to
    every command's main and to what the commands call, for the whole module."""
    return families.load_families((*families.FAMILIES, "toy_family"))


@pytest.fixture(scope="module")
def trained(plugged, single_thread, cli_argv, tmp_path_factory):
    """{family: (run, seed-1 run)}: each family trained one epoch, then resumed to two (`--resume auto`), and the
    same two epochs at another seed (an ensemble's second member); the return codes of each step."""
    root = tmp_path_factory.mktemp("matrix")
    runs, codes = {}, {}
    digits = {**cli_argv.PLAIN_DIGITS, "img_size": 8, "batch_size": 64, "train_fraction": 0.2}
    assert train.main(cli_argv(digits, CNN, epochs=1, output=root / "CNN"), plugged) == 0
    torch.manual_seed(0)
    resnet = root / "resnet10t.safetensors"  # a plain ResNet's weights, for the T-CNN to start from
    save_file(timm.create_model("resnet10t", channels=(8, 8, 8, 8)).state_dict(), str(resnet))
    for family, recipe in RECIPES.items():
        if family == "eFCN":  # the eFCN of the CNN trained above
            kwargs = dict(recipe["model_kwargs"], cnn_checkpoint=root / "CNN" / "checkpoints" / "last")
            recipe = dict(recipe, model_kwargs=kwargs)
        if family == "T-CNN":
            recipe = dict(recipe, pretrained_file=resnet)
        recipe = {**digits, **recipe}
        run, seed = root / family, root / f"{family}-seed1"
        codes[family, "train"] = train.main(cli_argv(recipe, epochs=1, output=run), plugged)
        codes[family, "resume"] = train.main(cli_argv(recipe, epochs=2, resume="auto", output=run), plugged)
        codes[family, "seed"] = train.main(cli_argv(recipe, epochs=2, seed=1, output=seed), plugged)
        runs[family] = (run, seed)
    return runs, codes, root


@pytest.fixture(scope="module")
def digit_images(tmp_path_factory) -> Path:
    """Four of the embedded digits as 8x8 grayscale PNGs, light strokes on a dark background (as trained on)."""
    folder = tmp_path_factory.mktemp("digits")
    for index, image in enumerate(load_digits().images[-4:]):
        Image.fromarray((image * 255 / 16).astype(np.uint8)).save(folder / f"digit{index}.png")
    return folder


def _call(capsys, main, argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _refusal(code: int, err: str) -> str:
    """The one `error:` line of a refused command (exit status 2)."""
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, (code, err)
    return errors[0].removeprefix("error: ")


def _no_machine_paths(folder: Path, *paths: Path) -> None:
    """No file of an exported folder names a path of the machine that wrote it."""
    for file in folder.iterdir():
        if file.suffix in (".md", ".json", ".yaml"):
            text = file.read_text()
            for path in paths:
                assert str(path) not in text, f"{file.name} names {path}"


TIMM_ALONE = """
import json, sys, timm, torch
from safetensors.torch import load_file, save_file
folders, inputs = json.loads(sys.argv[1]), load_file(sys.argv[2])
assert not {*json.loads(sys.argv[4]), "convbias"} & set(sys.modules)  # the families and this package
logits, errors = {}, {}
for family, folder in folders.items():
    try:
        model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    except Exception as error:
        errors[family] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        continue
    with torch.no_grad():
        logits[family] = model(inputs[family])
save_file(logits, sys.argv[3])
print(json.dumps(errors))
"""


@torch.no_grad()
def test_every_family_through_every_command(trained, plugged, digit_images, tmp_path, capsys):
    runs, codes, root = trained
    predict_main, export_main, diagnostics_main, ensemble_main, stability_main, robustness_main = (
        partial(command.main, families=plugged)
        for command in (predict, export, diagnostics, ensemble, stability, robustness)
    )
    outcomes: dict[tuple[str, str], str | None] = {}  # None: works; else the refusal's line

    def refused_or_ok(family: str, command: str, code: int, err: str, out_path: Path | None = None) -> None:
        if (family, command) in REFUSED:
            line = _refusal(code, err)
            assert re.search(REFUSED[family, command], line), (family, command, line)
            assert out_path is None or not out_path.exists(), f"{family} {command}: wrote {out_path} and refused"
            outcomes[family, command] = line
        else:
            assert code == 0, (family, command, err)
            outcomes[family, command] = None

    inputs, package_logits, exported = {}, {}, {}
    for family, (run, seed) in runs.items():
        results = json.loads((run / "results.json").read_text())
        log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        for command in ("train", "resume"):
            refused_or_ok(family, command, codes[family, command], "")
        assert codes[family, "seed"] == 0 and [r["epoch"] for r in log if "eval_top1" in r] == [1, 2]

        evaluated = train.run(["--eval-only", str(run)], plugged)
        assert evaluated["eval_top1"] == pytest.approx(results["final_top1"], abs=1e-9)
        outcomes[family, "--eval-only"] = None

        csv = tmp_path / f"{family}.csv"
        code, _, err = _call(capsys, predict_main, [run, digit_images, "--topk", "2", "--output", csv])
        refused_or_ok(family, "predict", code, err)
        assert "input: 1-channel (grayscale) images" in err and "light strokes on a dark background" in err
        assert len(csv.read_text().splitlines()) == 1 + 4

        folder = tmp_path / "exported" / family
        code, out, err = _call(capsys, export_main, [run, "--output", folder, "--pt2", "--onnx"])
        refused_or_ok(family, "export", code, err)
        assert "model.pt2: relative error" in out and "model.onnx: relative error" in out
        _no_machine_paths(folder, root, REPO, Path.home())
        exported[family] = folder
        code, _, err = _call(capsys, predict_main, [folder, digit_images, "--topk", "2", "--output", f"{csv}.json"])
        assert code == 0, err
        from_folder = json.loads(Path(f"{csv}.json").read_text())["predictions"]
        assert [p["top"] for p in from_folder] == [_csv_top(row) for row in csv.read_text().splitlines()[1:]]

        model, info = run_model(run, plugged)
        shape = (3, info["in_chans"], info["img_size"], info["img_size"])
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        inputs[family], package_logits[family] = x, model(x)
        loaded = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
        torch.testing.assert_close(loaded(x), package_logits[family], rtol=0, atol=0)
        timm.create_model(f"local-dir:{folder}")  # the folder alone builds it, without its weights
        outcomes[family, "timm"] = None

        figures_out = tmp_path / "figures" / family
        code, out, err = _call(capsys, diagnostics_main, [run, "--output", figures_out])
        refused_or_ok(family, "histories", code, err, figures_out)
        if code == 0:
            assert sorted(Path(p).name for p in out.split()) == sorted(FIGURES[family])
        maps_out = tmp_path / "maps" / family
        image = next(digit_images.iterdir())
        code, out, err = _call(capsys, diagnostics_main, [run, "--image", image, "--output", maps_out])
        refused_or_ok(family, "--image", code, err, maps_out)
        if code == 0:
            assert (maps_out / "attention_maps.png").stat().st_size > 0

        code, out, err = _call(capsys, ensemble_main, [run, seed, "--which", "last"])
        refused_or_ok(family, "ensemble", code, err)
        assert re.search(r"ensemble of 2 \(logits averaged\): error [\d.]+%", out)

        stability_out = tmp_path / "stability" / family
        argv = [run, "--checkpoints", "last", "--images", "4", "--deltas", "0.5", "--main-delta", "0.5", "--cuts", "3"]
        argv += ["--draws", "1"]
        code, _, err = _call(capsys, stability_main, [*argv, "--output", stability_out])
        refused_or_ok(family, "stability", code, err)

        robustness_out = tmp_path / "robustness" / family
        argv = [run, "--max-images", "16", "--corruptions", "gaussian_noise", "--severities", "1", "--pgd-steps", "2"]
        code, _, err = _call(capsys, robustness_main, [*argv, "--workers", "0", "--output", robustness_out])
        refused_or_ok(family, "robustness", code, err)
        assert (robustness_out / "robustness.csv").is_file()

        config = json.loads((folder / "config.json").read_text())
        _check_card((folder / "README.md").read_text(), family, config, results, plugged)
        outcomes[family, "card"] = None

    save_file(inputs, tmp_path / "inputs.safetensors")
    folders = json.dumps({family: str(folder) for family, folder in exported.items()})
    alone = subprocess.run(
        [
            sys.executable,
            "-c",
            TIMM_ALONE,
            folders,
            tmp_path / "inputs.safetensors",
            tmp_path / "logits.safetensors",
            json.dumps(list(plugged.records)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert alone.returncode == 0, alone.stderr
    errors, logits = json.loads(alone.stdout), load_file(tmp_path / "logits.safetensors")
    for family in RECIPES:
        if family in logits:  # timm's own architecture, from the folder's config.json and weights
            torch.testing.assert_close(logits[family], package_logits[family], rtol=1e-5, atol=1e-5)
            assert (family, "timm alone") not in REFUSED
            outcomes[family, "timm alone"] = None
        else:
            assert re.search(REFUSED[family, "timm alone"], errors[family]), errors[family]
            outcomes[family, "timm alone"] = errors[family]

    assert sorted(outcomes) == sorted((family, command) for family in RECIPES for command in COMMANDS)
    assert documented_matrix() == {cell: outcome is None for cell, outcome in outcomes.items()}


def _csv_top(row: str) -> list[dict]:
    """One CSV row of convbias-predict as the JSON output's top entries."""
    cells = row.split(",")[1:]
    return [
        {"label": cells[i], "index": int(cells[i + 1]), "probability": float(cells[i + 2])}
        for i in range(0, len(cells), 3)
    ]


def _check_card(card: str, family: str, config: dict, results: dict, loaded: families.Families) -> None:
    """A card a reader can act on: the Hub's front matter with the run's top-1, how to get the package that
    registers the model, its intended use and limits, the work it cites, code without a placeholder; and the
    config.json beside it: the run's preprocessing and classes, not timm's published weights."""
    package, architecture = FAMILY_PACKAGE[family], config["architecture"]
    front = yaml.safe_load(card.split("---\n")[1])
    metrics = {m["name"]: m["value"] for m in front["model-index"][0]["results"][0]["metrics"]}
    assert metrics == {"top-1": round(results["final_top1"], 4), "top-5": round(results["final_top5"], 4)}
    assert front["tags"] == ["image-classification", "timm", loaded.hub_tag(package)]
    assert "USER/REPO" not in card and f"timm.create_model('local-dir:{family}', pretrained=True)" in card
    for section in ("## Intended use and limits", "## Getting the package", "## How to load it", "## Citation"):
        assert section in card
    assert "ConViT: Improving Vision Transformers with Soft Convolutional Inductive Biases*, ICML 2021" in card
    assert "*From Architectural Constraints to Inductive Biases*" in card
    assert f"import {package}  # registers {architecture} in timm" in card and "`pip install .`" in card
    assert ("timm alone (without `import convit`) builds its own" in card) == (family == "ConViT")
    assert "left out, as paths of the machine that trained it: output" in card
    assert "light strokes on a dark background" in card  # the input, in words
    cfg = config["pretrained_cfg"]
    assert (cfg["input_size"][0], cfg["mean"], cfg["std"]) == (1, [0.3053], [0.3759])  # the digits'
    assert config["label_names"] == [str(d) for d in range(10)] and "tag" not in cfg
    if family == "T-CNN":  # its transform options in full; the ResNet file it started from is the machine's
        assert (config["model_args"]["stages"], config["model_args"]["init"]) == ([4], "paper")
        assert "pretrained_file" in card.split("left out, as paths")[1].split(")")[0]


def documented_matrix() -> dict[tuple[str, str], bool]:
    """docs/families.md's table (a row per command, a column per family): {(family, command): whether its cell
    says the command works ("yes ...") or is refused ("no ...")}."""
    lines = [line for line in (REPO / "docs" / "families.md").read_text().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header[1:] == list(RECIPES), header
    table = {}
    for line in lines[2:]:
        command, *cells = [cell.strip() for cell in line.strip("|").split("|")]
        for family, cell in zip(RECIPES, cells):
            assert cell.startswith(("yes", "no")), (command, family, cell)
            table[family, command.strip("`")] = cell.startswith("yes")
    return table


# -- the cases a user met, on the same runs --------------------------------------------------------------------
def test_a_tcnns_history_figures_are_drawn_from_its_gating_and_span(trained, tmp_path, capsys):
    """A T-CNN logs gating/ and span/ (its GPSA convolutions have no token grid for a nonlocality): its figures
    are drawn from them, beside a DeiT's nonlocality in one command, and nothing sends the user after a switch."""
    runs, _, _ = trained
    tcnn, deit = runs["T-CNN"][0], runs["DeiT+"][0]
    code, out, err = _call(capsys, diagnostics.main, [tcnn, "--output", tmp_path / "tcnn"])
    assert code == 0, err
    assert sorted(Path(p).name for p in out.split()) == ["gating_T-CNN.png", "span_T-CNN.png"]
    code, out, err = _call(capsys, diagnostics.main, [tcnn, deit, "--output", tmp_path / "mixed"])
    assert code == 0, err
    assert sorted(Path(p).name for p in out.split()) == ["gating_T-CNN.png", "nonlocality.png", "span_T-CNN.png"]
    assert "diagnostics" not in err


def test_an_exported_efcn_travels_without_its_cnns_checkpoint(trained, cli_argv, digit_images, tmp_path, capsys):
    """An eFCN trained from a CNN checkpoint that is gone since: its run still predicts and exports, and the
    exported folder alone rebuilds it (convbias-predict, timm's local-dir: with and without weights)."""
    _, _, root = trained
    cnn = tmp_path / "cnn_point"
    shutil.copytree((root / "CNN" / "checkpoints" / "last").resolve(), cnn)
    run = tmp_path / "efcn"
    recipe = dict(RECIPES["eFCN"], model_kwargs=dict(RECIPES["eFCN"]["model_kwargs"], cnn_checkpoint=cnn))
    digits = {**cli_argv.PLAIN_DIGITS, "img_size": 8, "batch_size": 64, "train_fraction": 0.2}
    assert train.main(cli_argv(digits, recipe, epochs=1, output=run)) == 0
    shutil.rmtree(cnn)
    code, _, err = _call(capsys, predict.main, [run, digit_images, "--output", tmp_path / "run.json"])
    assert code == 0, err
    folder = tmp_path / "exported"
    code, _, err = _call(capsys, export.main, [run, "--output", folder])
    assert code == 0, err
    _no_machine_paths(folder, tmp_path, root)
    assert "cnn_checkpoint" not in json.loads((folder / "config.json").read_text())["model_args"]
    assert "model_kwargs.cnn_checkpoint" in (folder / "README.md").read_text()
    code, _, err = _call(capsys, predict.main, [folder, digit_images, "--output", tmp_path / "exported.json"])
    assert code == 0, err
    top = [
        [p["top"] for p in json.loads((tmp_path / f"{name}.json").read_text())["predictions"]]
        for name in ("run", "exported")
    ]
    assert top[0] == top[1]
    model = timm.create_model(f"local-dir:{folder}").eval()  # without its weights: the architecture alone
    assert type(model).__name__ == "EmbeddedFCN"


def test_a_deit_given_a_convit_recipe_is_refused_naming_the_gpsa_blocks(repo, tmp_path, capsys):
    """`-c demo_digits.yaml --model deit_tiny_plus` would keep the recipe's local_up_to_layer: 5 (a ConViT named a
    DeiT): refused in one line naming it, before anything is written. The demo's DeiT recipe is the demo's with
    self-attention everywhere: the same options, width and depth, no GPSA block."""
    from convbias.engine import create_model, parse_config

    output = tmp_path / "deit"
    demo = repo / "configs" / "train" / "demo_digits.yaml"
    code, _, err = _call(
        capsys, train.main, ["-c", demo, "--model", "deit_tiny_plus", "--epochs", "1", "--output", output]
    )
    assert _refusal(code, err) == (
        "cannot build deit_tiny_plus with {'patch_size': 2, 'depth': 6, 'local_up_to_layer': 5}: deit_tiny_plus has "
        "no GPSA blocks: local_up_to_layer=5 would make it convit_tiny_plus; give local_up_to_layer=0 for the DeiT, "
        "or use convit_tiny_plus"
    )
    assert not output.exists()
    convit_cfg = parse_config(["-c", str(demo)])
    deit_cfg = parse_config(["-c", str(repo / "configs" / "train" / "demo_digits_deit.yaml")])
    differ = {k for k, v in deit_cfg.to_dict().items() if convit_cfg.to_dict()[k] != v}
    assert differ == {"model", "model_kwargs", "config", "output"}  # output: runs/<model>-<dataset>
    convit_model, deit_model = (create_model(cfg, 10, 1) for cfg in (convit_cfg, deit_cfg))
    assert deit_model.local_up_to_layer == 0 and not [n for n, _ in deit_model.named_parameters() if "gating" in n]
    assert (deit_model.embed_dim, len(deit_model.blocks)) == (convit_model.embed_dim, len(convit_model.blocks))


@pytest.fixture
def drawn_figures(monkeypatch) -> list[Figure]:
    """The Figures the package's figure functions save, in order."""
    saved = []
    save = figures.save_figure

    def record(fig, path, **kwargs):
        saved.append(fig)
        return save(fig, path, **kwargs)

    monkeypatch.setattr(figures, "save_figure", record)
    return saved


def test_history_figures_start_at_initialization_share_axes_and_label_their_colors(
    trained, drawn_figures, tmp_path, capsys
):
    """Nonlocality (ConViT | DeiT), span per head and the eFCN | FCN deviation: each line starts at epoch 0 with the
    value logged at initialization; the compared panels share their axes; each color encoding has a labelled
    color bar (the layer's depth; the gates of the attention maps' titles)."""
    runs, _, _ = trained
    convit, deit, tcnn, efcn, fcn = (runs[family][0] for family in ("ConViT", "DeiT+", "T-CNN", "eFCN", "FCN"))
    image = tmp_path / "digit.png"
    Image.fromarray((load_digits().images[0] * 255 / 16).astype(np.uint8)).save(image)
    for argv in ([convit, deit, "--image", image], [tcnn], [efcn, fcn]):
        code, _, err = _call(capsys, diagnostics.main, [*argv, "--output", tmp_path / "figures"])
        assert code == 0, err
    nonlocality, _, _, maps, _, span, deviation = drawn_figures  # span: the T-CNN's two GPSA layers
    compared = ((nonlocality, convit, "nonlocality/layer1"), (span, tcnn, "span/layer1/head1"), (deviation, efcn, "deviation/conv1"))  # fmt: skip
    for fig, run, key in compared:
        axes = [ax for ax in fig.axes if ax.lines]
        assert len(axes) == 2 and all(line.get_xdata()[0] == 0 for ax in axes for line in ax.lines)
        assert axes[0].get_shared_y_axes().joined(*axes) and axes[0].get_shared_x_axes().joined(*axes)
        first = json.loads((run / "log.jsonl").read_text().splitlines()[0])
        assert axes[0].lines[0].get_ydata()[0] == pytest.approx(first[f"init_{key}"])
    for fig in (nonlocality, maps):
        bars = [ax for ax in fig.axes if hasattr(ax, "_colorbar")]
        assert bars and all(ax.get_ylabel() or ax.get_xlabel() for ax in bars)
