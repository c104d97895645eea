"""Sweep tool and report: grid expansion, epoch scaling, bad input, resume after a kill, report from CSV."""

from __future__ import annotations

import csv
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import yaml
from matplotlib.figure import Figure
from scipy import stats as scipy_stats
from support.sweeps import TINY_MODEL_KWARGS, TINY_SET, sweep_cli

from convbias.engine import parse_config
from convbias.engine.config.derived import effective_epochs
from convbias.studies import intervals
from convbias.studies.phase_diagram import tables as phase_diagram_tables
from convbias.studies.sweep import command as SWEEP_CLI
from convbias.studies.sweep import figures as sweep_figures
from convbias.studies.sweep import report, sweep
from convbias.studies.sweep import spec as sweep_spec


def tiny_spec(**grid) -> dict:
    grid = grid or {"model": ["convit_tiny", "deit_tiny_plus"], "train_fraction": [0.5, 1.0], "seed": [0, 1]}
    return sweep_spec.normalize_spec({"set": TINY_SET, "grid": grid})


# ----------------------------------------------------------------------------- grid expansion


def test_grid_expansion_is_the_cartesian_product_in_order():
    spec = sweep_spec.normalize_spec(
        {
            "set": {"dataset": "digits", "model_kwargs": {"patch_size": 2}},
            "grid": {
                "model": ["convit_tiny", "deit_tiny_plus"],
                "train_fraction": [0.05, 1.0],
                "seed": [0, 1, 2],
                "model_kwargs.locality_strength": [0.5, 2.0],
            },
        }
    )
    runs = sweep_spec.expand_grid(spec)
    assert len(runs) == 2 * 2 * 3 * 2
    assert [run.name for run in runs[:3]] == [
        "convit_tiny__f0.05__seed0__locality_strength-0.5",
        "convit_tiny__f0.05__seed0__locality_strength-2",
        "convit_tiny__f0.05__seed1__locality_strength-0.5",
    ]
    assert len({run.name for run in runs}) == len(runs)
    last = runs[-1]
    assert last.point == {
        "model": "deit_tiny_plus",
        "train_fraction": 1.0,
        "seed": 2,
        "model_kwargs.locality_strength": 2.0,
    }
    # the swept kwarg joins the shared ones without mutating the spec
    assert last.options["model_kwargs"] == {"patch_size": 2, "locality_strength": 2.0}
    assert spec["set"]["model_kwargs"] == {"patch_size": 2}


def test_variants_are_crossed_with_the_grid():
    spec = sweep_spec.normalize_spec(
        {
            "set": {"model_kwargs": {"patch_size": 2}},
            "variants": {
                "convit": {"model": "convit_tiny"},
                "frozen_gate": {"model": "convit_tiny", "model_kwargs": {"train_gating": False}},
                "deit": {"model": "deit_tiny_plus"},
            },
            "grid": {"train_fraction": [0.1, 1.0], "seed": [0]},
        }
    )
    runs = sweep_spec.expand_grid(spec)
    assert [run.name for run in runs] == [
        "convit__f0.1__seed0",
        "convit__f1__seed0",
        "frozen_gate__f0.1__seed0",
        "frozen_gate__f1__seed0",
        "deit__f0.1__seed0",
        "deit__f1__seed0",
    ]
    assert runs[2].options["model_kwargs"] == {"patch_size": 2, "train_gating": False}
    assert runs[0].options["model_kwargs"] == {"patch_size": 2}


def test_cli_overrides_replace_axes_and_shared_options():
    spec = sweep_spec.override_spec(tiny_spec(), grid={"seed": [3]}, options={"epochs": 7, "model_kwargs.depth": 3})
    assert spec["grid"]["seed"] == [3]
    assert spec["set"]["epochs"] == 7
    assert spec["set"]["model_kwargs"] == {**TINY_MODEL_KWARGS, "depth": 3}
    assert tiny_spec()["set"]["model_kwargs"] == TINY_MODEL_KWARGS


# ----------------------------------------------------------------------------- commands and epoch scaling


def test_printed_commands_are_train_py_invocations_with_scaled_epochs(tmp_path):
    out = tmp_path / "sweep"
    done = sweep_cli(
        "run",
        "--output",
        str(out),
        "--models",
        "convit_tiny",
        "deit_tiny_plus",
        "--fractions",
        "0.05",
        "0.3",
        "1",
        "--seeds",
        "0",
        "--set",
        "epochs=2",
        "eval_interval=2",
        "dataset=digits",
        "img_size=8",
        "model_kwargs.patch_size=2",
        "--grid",
        "model_kwargs.locality_strength=1,2",
        "--print-commands",
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2 * 3 * 2
    assert not (out / "runs").exists()  # printing runs nothing
    assert yaml.safe_load((out / "sweep.yaml").read_text())["grid"]["train_fraction"] == [0.05, 0.3, 1.0]
    for line in lines:
        argv = shlex.split(line)
        assert argv[:3] == [sys.executable, "-m", "convbias.cli.train"]
        cfg = parse_config(argv[3:])  # the engine's own parser accepts every printed command
        assert cfg.scale_epochs and cfg.epochs == 2
        assert effective_epochs(cfg)[0] == math.ceil(2 / cfg.train_fraction - 1e-9)
        assert cfg.eval_interval == round(2 / cfg.train_fraction)  # evaluations at equal images seen
        name = Path(cfg.output).name
        assert (
            name
            == f"{cfg.model}__f{cfg.train_fraction:g}__seed0__locality_strength-{cfg.model_kwargs['locality_strength']}"
        )
        assert cfg.model_kwargs["patch_size"] == 2
    epochs = sorted({effective_epochs(parse_config(shlex.split(line)[3:]))[0] for line in lines})
    assert epochs == [2, 7, 40]  # 2 / 1, ceil(2 / 0.3), 2 / 0.05


def test_a_sweep_files_shared_model_argument_by_its_dotted_key_reaches_every_run(tmp_path, capsys):
    """``set: {model_kwargs.NAME: V}`` in a file, as ``--set model_kwargs.NAME=V`` gives it (it was a KeyError
    traceback): every printed command carries it beside the file's other model arguments."""
    path, out = tmp_path / "sweep.yaml", tmp_path / "sweep"
    text = "set:\n  dataset: digits\n  img_size: 8\n  model_kwargs.patch_size: 2\n  model_kwargs: {depth: 2, local_up_to_layer: 1}\n"
    path.write_text(text + "grid:\n  model: [convit_tiny]\n  seed: [0, 1]\n")
    assert SWEEP_CLI.main(["run", str(path), "--output", str(out), "--print-commands"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert parse_config(shlex.split(line)[3:]).model_kwargs == {"patch_size": 2, "depth": 2, "local_up_to_layer": 1}


def test_launcher_prefix_and_no_scale_epochs(tmp_path):
    done = sweep_cli(
        "run",
        "--output",
        str(tmp_path / "s"),
        "--models",
        "convit_tiny",
        "--fractions",
        "0.5",
        "--no-scale-epochs",
        "--launcher",
        "accelerate launch --num_processes 2",
        "--set",
        "model_kwargs.patch_size=2",
        "img_size=8",
        "--print-commands",
    )
    assert done.returncode == 0, done.stderr
    argv = shlex.split(done.stdout.strip())
    assert argv[:4] == ["accelerate", "launch", "--num_processes", "2"]
    assert argv[4:6] == ["-m", "convbias.cli.train"] and "--scale-epochs" not in argv


def test_the_digits_study_runs_on_an_image_folder(tmp_path, repo):
    """The committed study's grid, pointed at a user's ImageFolder, gives valid train.py commands."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in ("cat", "dog"):
            (tmp_path / "data" / split / name).mkdir(parents=True)
            for i in range(10):
                pixels = rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / "data" / split / name / f"{i}.png")
    done = sweep_cli(
        "run",
        str(repo / "configs" / "sweeps" / "digits_sample_efficiency.yaml"),
        "--output",
        str(tmp_path / "sweep"),
        "--dataset",
        "folder",
        "--data-dir",
        str(tmp_path / "data"),
        "--set",
        "img_size=16",
        "model_kwargs.patch_size=4",
        "--print-commands",
    )
    assert done.returncode == 0, done.stderr
    configs = [parse_config(shlex.split(line)[3:]) for line in done.stdout.strip().splitlines()]
    spec = yaml.safe_load((repo / "configs" / "sweeps" / "digits_sample_efficiency.yaml").read_text())
    assert len(configs) == len(spec["variants"]) * len(spec["grid"]["train_fraction"]) * len(spec["grid"]["seed"])
    assert {(c.dataset, c.data_dir, c.img_size, c.model_kwargs["patch_size"]) for c in configs} == {
        ("folder", str(tmp_path / "data"), 16, 4)
    }
    assert sorted({c.model for c in configs}) == ["convit_tiny", "deit_tiny_plus"]


def test_the_mnist_sample_efficiency_sweep_sees_as_many_images_in_every_run(tmp_path, repo):
    """Each run sees ceil(10 / f) epochs of 4,000 f images: 40,000 (40,800 at f = 0.3, the epochs rounded
    up), about the digits study's 30 x 1,438."""
    done = sweep_cli(
        "run",
        str(repo / "configs" / "sweeps" / "mnist_sample_efficiency.yaml"),
        "--output",
        str(tmp_path / "sweep"),
        "--print-commands",
    )
    assert done.returncode == 0, done.stderr
    configs = [parse_config(shlex.split(line)[3:]) for line in done.stdout.strip().splitlines()]
    assert len(configs) == 30 and sorted({c.model for c in configs}) == ["convit_tiny", "deit_tiny_plus"]
    assert {(c.dataset, c.img_size, c.model_kwargs["patch_size"]) for c in configs} == {("mnist", 28, 4)}
    seen = {c.train_fraction: round(effective_epochs(c)[0] * c.train_fraction * 4000) for c in configs}
    assert seen == {0.1: 40_000, 0.3: 40_800, 1.0: 40_000}


@pytest.mark.parametrize(
    "name, runs", [("imagenet_sample_efficiency", 10), ("imagenet100_locality", 20), ("imagenet_ablations", 14)]
)
def test_the_paper_sweeps_give_valid_commands(tmp_path, repo, name, runs):
    for split in ("train", "val"):
        (tmp_path / "imagenet" / split).mkdir(parents=True)
    done = sweep_cli(
        "run",
        str(repo / "configs" / "sweeps" / f"{name}.yaml"),
        "--output",
        str(tmp_path / "sweep"),
        "--data-dir",
        str(tmp_path / "imagenet"),
        "--print-commands",
    )
    assert done.returncode == 0, done.stderr
    configs = [parse_config(shlex.split(line)[3:]) for line in done.stdout.strip().splitlines()]
    assert len(configs) == runs
    assert {(c.dataset, c.img_size, c.epochs) for c in configs} == {("imagenet", 224, 300)}
    if name == "imagenet_sample_efficiency":  # Table 7.2: 300 / f epochs, DeiT recipe
        assert sorted(effective_epochs(c)[0] for c in configs if c.model == "convit_small") == [
            300,
            600,
            1000,
            3000,
            6000,
        ]
        assert {c.batch_size * 8 for c in configs} == {1024} and {c.mixup for c in configs} == {0.8}
    if name == "imagenet100_locality":  # Fig. 7.9: first 100 classes
        assert {c.num_classes for c in configs} == {100}
        assert {c.model_kwargs["local_up_to_layer"] for c in configs} == {0, 3, 6, 9, 10}


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "args, message",
    [
        (["--models", "convit_tiny", "convit_tinny"], "unknown model 'convit_tinny'"),
        (["--fractions", "0"], "argument --fractions: must be in (0, 1], got 0"),
        (["--fractions", "0.5", "1.5"], "argument --fractions: must be in (0, 1], got 1.5"),
        (["--grid", "lerning_rate=0.1,0.2"], "'lerning_rate' is not a train.py option"),
        (
            ["--models", "deit_tiny_patch16_224", "--grid", "model_kwargs.locality_strength=1,2"],
            "cannot build deit_tiny_patch16_224 with {'patch_size': 2, 'locality_strength': 1}: "
            "VisionTransformer.__init__() got an unexpected keyword argument 'locality_strength'",
        ),
        (["--models", "convit_tiny", "--grid", "model_kwargs.localty_strength=1,2"], "localty_strength"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(tmp_path, args, message):
    out = tmp_path / "sweep"
    done = sweep_cli("run", "--output", str(out), "--set", "img_size=8", "model_kwargs.patch_size=2", *args)
    assert done.returncode == 2
    assert message in done.stderr and done.stderr.startswith("error: ")
    assert "Traceback" not in done.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("text", "argv", "message"),
    [
        ("set:\n  img_size: 8\n  lr: abc\n", [], "sweep file {path}, line 3: set.lr expects float, got 'abc'"),
        ("grid:\n  lr: [0.1, .nan]\n", [], "sweep file {path}, line 2: grid.lr must be a finite number, got nan"),
        ("set:\n  aa: rand-m9-n-3\n", [], "sweep file {path}, line 2: set.aa: rand-m9-n-3: section 'n' is not"),
        (
            "variants:\n  a: {model: convit_tiny, interpolation: bogus}\n",
            [],
            "sweep file {path}, line 2: variants.a.interpolation: unknown value 'bogus'; choices: ''",
        ),
        (
            "grid:\n  model_kwargs.locality_strength: [1, .inf]\n",
            [],
            "sweep file {path}, line 2: grid.model_kwargs.locality_strength must be a finite number, got inf",
        ),
        ("set: {lr: 0.1}\n", ["--set", "lr=abc"], "--set lr expects float, got 'abc'"),
        ("set: {lr: 0.1}\n", ["--grid", "lr=0.1,nan"], "--grid lr must be a finite number, got nan"),
    ],
)
def test_a_sweep_files_value_is_named_by_the_file_line_and_key(tmp_path, capsys, text, argv, message):
    """Not by the train.py command line the sweep renders it to (``run X: argument --lr``), and before any run."""
    path, out = tmp_path / "sweep.yaml", tmp_path / "sweep"
    path.write_text(text)
    models = [] if "variants" in text else ["--models", "convit_tiny"]
    assert SWEEP_CLI.main(["run", str(path), "--output", str(out), *models, *argv]) == 2
    assert capsys.readouterr().err.startswith("error: " + message.format(path=path))
    assert not out.exists()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
def test_a_run_refused_by_train_py_stops_the_sweep(tmp_path):
    """Data problems are found by train.py (the sweep does not scan datasets): the first refusal
    stops the sweep with train.py's message instead of failing every run the same way. train.py runs in this
    process (``TrainHere``): what the sweep does with its exit code and log is under test, not its start-up."""
    (tmp_path / "empty").mkdir()
    out = tmp_path / "sweep"
    done = sweep_cli(
        "run",
        "--output",
        str(out),
        "--models",
        "convit_tiny",
        "deit_tiny_plus",
        "--fractions",
        "1",
        "--dataset",
        "folder",
        "--data-dir",
        str(tmp_path / "empty"),
        "--set",
        "img_size=8",
        "model_kwargs.patch_size=2",
        "workers=0",
        train_here=True,
    )
    assert done.returncode == 2
    assert "train.py refused run convit_tiny__f1__seed0" in done.stderr and str(tmp_path / "empty") in done.stderr
    assert [p.name for p in (out / "logs").iterdir()] == ["convit_tiny__f1__seed0.log"]  # the DeiT never started


def test_a_different_grid_in_the_output_dir_is_refused_with_the_difference(tmp_path):
    out = tmp_path / "sweep"
    base = [
        "run",
        "--output",
        str(out),
        "--models",
        "convit_tiny",
        "--set",
        "img_size=8",
        "model_kwargs.patch_size=2",
        "--print-commands",
    ]
    assert sweep_cli(*base, "--seeds", "0", "1").returncode == 0
    done = sweep_cli(*base, "--seeds", "0", "1", "2")
    assert done.returncode == 2
    assert "holds a different sweep" in done.stderr and "grid.seed: [0, 1] -> [0, 1, 2]" in done.stderr
    # the same grid again is fine, and the baseline (a report option) is not part of the grid
    assert sweep_cli(*base, "--seeds", "0", "1", "--baseline", "convit_tiny").returncode == 0


def test_spec_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match=r"unknown sweep key\(s\) \['grids'\]"):
        sweep_spec.normalize_spec({"grids": {}})
    with pytest.raises(ValueError, match="grid.seed is empty"):
        sweep_spec.normalize_spec({"grid": {"seed": []}})
    with pytest.raises(ValueError, match="'output' is set by the sweep"):
        sweep.Sweep.prepare(
            sweep_spec.normalize_spec({"set": {**TINY_SET, "output": "x"}, "grid": {"model": ["convit_tiny"]}}),
            tmp_path,
        )


# ----------------------------------------------------------------------------- resumption with real runs


def _epochs(summary: Path) -> list[int]:
    with open(summary, newline="") as f:
        return [int(row["epoch"]) for row in csv.DictReader(f)]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
def test_kill_mid_sweep_then_rerun_repeats_nothing_and_loses_nothing(tmp_path, console_script):
    """Kill the sweep (and its train.py) inside its second run, rerun: the first run is kept as it is,
    the second resumes from its checkpoint, and the CSV holds both. Also checks epochs x 1/f. The first run
    is trained beforehand by its sweep command's train.py in this process (a train.py subprocess costs
    seconds of start-up), so the killed sweep skips it as complete and starts the second; the killed sweep and
    its train.py are real processes, the rerun's train.py runs in this process (``TrainHere``)."""
    from convbias.cli import train

    sweep_file = tmp_path / "tiny.yaml"
    sweep_file.write_text(
        yaml.safe_dump(
            {
                "set": {**TINY_SET, "epochs": 3, "lr": 1e-3},
                "grid": {"model": ["convit_tiny"], "train_fraction": [1.0, 0.25], "seed": [0]},
            },
            sort_keys=False,
        )
    )
    out = tmp_path / "sweep"
    first, second = out / "runs" / "convit_tiny__f1__seed0", out / "runs" / "convit_tiny__f0.25__seed0"
    first_command = sweep.Sweep.prepare(sweep_spec.load_spec(sweep_file), out).commands()[0]
    assert Path(first_command[first_command.index("--output") + 1]) == first
    train.run(first_command[3:])  # python -m convbias.cli.train ARGS
    with open(tmp_path / "killed.log", "w") as console:
        process = subprocess.Popen(
            [console_script("convbias-sweep"), "run", str(sweep_file), "--output", str(out)],
            cwd=tmp_path,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        deadline = time.time() + 300
        while not (second / "checkpoints" / "last" / "training_state.pt").is_file():
            assert process.poll() is None, (tmp_path / "killed.log").read_text()
            assert time.time() < deadline, "the second run never wrote a checkpoint"
            time.sleep(0.02)
        os.killpg(process.pid, signal.SIGKILL)  # the sweep and its train.py child, as a lost node would
        process.wait(timeout=120)
    assert (first / "results.json").is_file()
    assert not (second / "results.json").exists(), "the second run ended before the kill: nothing to resume"
    killed_at = int((second / "checkpoints" / "last").resolve().name.split("_")[1])
    assert 1 <= killed_at < 12
    first_results = (first / "results.json").read_bytes()
    first_mtime = (first / "results.json").stat().st_mtime_ns
    kept_rows = (second / "summary.csv").read_text().splitlines()[: 1 + killed_at]

    done = sweep_cli("run", str(sweep_file), "--output", str(out), train_here=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[1/2] convit_tiny__f1__seed0: complete, skipped" in done.stdout
    assert "[2/2] convit_tiny__f0.25__seed0: resuming" in done.stdout
    # nothing repeated: the first run was not touched
    assert (first / "results.json").read_bytes() == first_results
    assert (first / "results.json").stat().st_mtime_ns == first_mtime
    assert _epochs(first / "summary.csv") == [1, 2, 3]
    # nothing lost: the second run continued after its checkpoint, every epoch logged once
    assert "resumed from" in (out / "logs" / "convit_tiny__f0.25__seed0.log").read_text()
    assert (second / "summary.csv").read_text().splitlines()[: 1 + killed_at] == kept_rows
    assert _epochs(second / "summary.csv") == list(range(1, 13))
    second_results = json.loads((second / "results.json").read_text())
    assert second_results["epochs"] == 12  # 3 epochs / 0.25
    with open(out / "runs.csv", newline="") as f:
        rows = {row["run"]: row for row in csv.DictReader(f)}
    assert set(rows) == {first.name, second.name}
    assert float(rows[second.name]["top1"]) == pytest.approx(second_results["final_top1"])
    assert rows[second.name]["epochs_trained"] == "12" and rows[first.name]["epochs_trained"] == "3"
    assert (out / "report.md").is_file()
    # a third run of the same command does nothing at all
    again = sweep_cli("run", str(sweep_file), "--output", str(out), "--print-commands")
    assert again.returncode == 0 and again.stdout == ""


# ----------------------------------------------------------------------------- report from a CSV fixture


def write_fixture(path: Path) -> dict:
    """Two models x three fractions x two seeds, with known values; returns the expected stats."""
    top1 = {
        ("convit_tiny", 0.1): [50.0, 54.0],
        ("convit_tiny", 0.5): [70.0, 72.0],
        ("convit_tiny", 1.0): [80.0, 80.0],
        ("deit_tiny_plus", 0.1): [40.0, 44.0],
        ("deit_tiny_plus", 0.5): [60.0, 66.0],
        ("deit_tiny_plus", 1.0): [78.0, 82.0],
    }
    rows = []
    for (model, fraction), values in top1.items():
        for seed, value in enumerate(values):
            rows.append(
                {
                    "run": f"{model}__f{fraction:g}__seed{seed}",
                    "model": model,
                    "train_fraction": fraction,
                    "seed": seed,
                    "top1": value,
                    "top5": 95.0 + seed,
                    "best_top1": value + 1,
                    "best_top5": 99.0,
                    "epochs_trained": int(10 / fraction),
                }
            )
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return top1


def _cell(values) -> str:
    """mean ± std [95% t interval of the mean], computed here with scipy's t distribution, cut at 0 and 100%."""
    mean, std = np.mean(values), np.std(values, ddof=1)
    if std == 0:
        return f"{mean:.1f} ± 0.0 [{mean:.1f}, {mean:.1f}]"
    low, high = scipy_stats.t.interval(0.95, len(values) - 1, loc=mean, scale=std / np.sqrt(len(values)))
    low, high = np.clip((low, high), 0, 100)
    return f"{mean:.1f} ± {std:.1f} [{low:.1f}, {high:.1f}]"


def _paired(ours, base) -> str:
    """The paired 95% interval of ours - base, from scipy's paired t test (an independent implementation)."""
    diff = np.subtract(ours, base)
    if diff.std() == 0:
        return f"{diff.mean():+.1f} [{diff.mean():+.1f}, {diff.mean():+.1f}]"
    low, high = scipy_stats.ttest_rel(ours, base).confidence_interval(0.95)
    return f"{diff.mean():+.1f} [{low:+.1f}, {high:+.1f}]"


def test_report_from_csv_fixture(tmp_path):
    top1 = write_fixture(tmp_path / "runs.csv")
    done = sweep_cli("report", "--csv", str(tmp_path / "runs.csv"), "--output", str(tmp_path / "report"))
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "report" / "report.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0] == (
        "| Train size | n | deit_tiny_plus top-1 | convit_tiny top-1 | gap top-1 (points) | relative | "
        "deit_tiny_plus top-5 | convit_tiny top-5 | gap top-5 (points) | relative |"
    )
    rows = {line.split(" | ")[0][2:]: line.strip("| ").split(" | ") for line in table[1:]}
    assert list(rows) == ["10%", "50%", "100%"]
    for fraction, label in ((0.1, "10%"), (0.5, "50%"), (1.0, "100%")):
        base, ours = top1[("deit_tiny_plus", fraction)], top1[("convit_tiny", fraction)]
        assert rows[label][1] == "2"
        assert rows[label][2] == _cell(base) and rows[label][3] == _cell(ours)
        assert rows[label][4] == _paired(ours, base)
        assert rows[label][6] == _cell([95.0, 96.0]) and rows[label][8] == "+0.0 [+0.0, +0.0]"
        assert rows[label][9] == "0%"
    # relative gaps of the means: (52 - 42) / 42, (71 - 63) / 63, (80 - 80) / 80
    assert [rows[label][5] for label in rows] == ["+24%", "+13%", "0%"]
    # the gap's change from 100% to 10%: Welch's interval, as scipy computes it
    small, large = np.subtract([50.0, 54.0], [40.0, 44.0]), np.subtract([80.0, 80.0], [78.0, 82.0])
    low, high = scipy_stats.ttest_ind(small, large, equal_var=False).confidence_interval(0.95)
    change = f"Gap at 10% minus gap at 100%: {small.mean() - large.mean():+.1f} [{low:+.1f}, {high:+.1f}]"
    assert change + " (no change of the gap is supported)." in text
    assert "10%: +10.0 [+10.0, +10.0] (interval excludes 0)" in text
    assert "100%: +0.0 [" in text and "100%: +0.0 [+0.0" not in text
    image = matplotlib.image.imread(tmp_path / "report" / "sample_efficiency.png")
    assert image.shape[0] > 200 and image.shape[1] > 400 and image[..., :3].std() > 0.05
    assert _cell([95.0, 96.0]) == "95.5 ± 0.7 [89.1, 100.0]"  # the t interval, 101.9 at the top, is cut at 100
    assert "intervals of accuracies are cut at 0 and 100%" in text
    assert sorted(os.listdir(tmp_path)) == ["report", "runs.csv"]  # nothing beside the CSV

    # --best switches to the best-epoch columns
    report.write_report(tmp_path / "runs.csv", tmp_path / "best", best=True)
    best = (tmp_path / "best" / "report.md").read_text()
    assert f"| 10% | 2 | {_cell([41.0, 45.0])} | {_cell([51.0, 55.0])} | +10.0 [+10.0, +10.0] | +23% |" in best


def test_sweep_report_writes_only_where_it_is_told(tmp_path):
    """The documented regeneration command reads a committed runs.csv: without --output it writes nothing."""
    write_fixture(tmp_path / "runs.csv")
    done = sweep_cli("report", "--csv", str(tmp_path / "runs.csv"))
    assert done.returncode == 2 and "--output" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == ["runs.csv"]


def test_accuracy_axes_and_error_bars_end_at_100(tmp_path, monkeypatch):
    """Two seeds at 99 and 100% top-1: the t interval runs to 105.9; the figure's bars and axis stop at 100 and
    its note says so."""
    rows = [
        {"run": f"{m}{f}{s}", "model": m, "train_fraction": f, "seed": s, "top1": v + s, "top5": 100.0}
        for m, v in (("deit_tiny_plus", 90.0), ("convit_tiny", 99.0))
        for f in (0.5, 1.0)
        for s in (0, 1)
    ]
    cell = intervals.stat(rows[-2:], "top1")
    assert (cell.mean + cell.half_width, cell.high, cell.cut) == (pytest.approx(105.85, abs=0.01), 100.0, True)
    assert cell.error_bars() == (pytest.approx(cell.half_width), 0.5)
    drawn = []

    def record(figure, path, **kwargs):  # the figure as drawn; an empty file where it is saved
        drawn.append(figure)
        Path(path).write_bytes(b"")

    monkeypatch.setattr(Figure, "savefig", record)
    sweep_figures.plot_sample_efficiency(rows, "deit_tiny_plus", tmp_path / "se.png")
    accuracy = drawn[0].axes[0]
    bar_tops = [segment[:, 1].max() for collection in accuracy.collections for segment in collection.get_segments()]
    assert max(bar_tops) == 100.0 and accuracy.get_ylim()[1] == 100.0
    assert (
        drawn[0]
        .texts[0]
        .get_text()
        .splitlines()[-1]
        .startswith("error bars: 95% t interval of the mean over 2 seeds, cut at 100%")
    )


def test_report_states_a_gap_change_only_where_its_interval_excludes_zero(tmp_path):
    """Five seeds: a gap of about 20 points at 10% and about 2 at 100% is a supported change; one seed
    has no interval and the report says so instead of a verdict."""
    noise = [0.0, 1.0, -1.0, 0.5, -0.5]
    rows = []
    for seed, e in enumerate(noise):
        for fraction, gap in ((0.1, 20.0), (1.0, 2.0)):
            rows.append(dict(model="deit_tiny_plus", train_fraction=fraction, seed=seed, top1=60 + 30 * fraction + e))
            rows.append(
                dict(model="convit_tiny", train_fraction=fraction, seed=seed, top1=60 + 30 * fraction + gap - e)
            )
    sweep.write_csv(rows, tmp_path / "runs.csv")
    text = report.write_report(tmp_path / "runs.csv")[0].read_text()
    assert "(the gap differs between the two fractions)" in text
    assert "| 10% | 5 |" in text and "| 100% | 5 |" in text
    (tmp_path / "one").mkdir()
    sweep.write_csv([row for row in rows if row["seed"] == 0], tmp_path / "one" / "runs.csv")
    text = report.write_report(tmp_path / "one" / "runs.csv")[0].read_text()
    assert "(no interval)" in text and "(n = 1: no interval)" in text and "too few runs for an interval" in text
    assert "excludes 0" not in text and "differs" not in text


def test_parameter_sweep_report_and_heatmap(tmp_path):
    rows = [
        {
            "run": f"r{a}{k}{s}",
            "model": "convit_tiny",
            "train_fraction": 1.0,
            "seed": s,
            "locality_strength": a,
            "local_up_to_layer": k,
            "top1": 30 + 10 * a * k + s,
            "top5": 90,
        }
        for a in (0.5, 2.0)
        for k in (0, 1, 3)
        for s in (0, 1)
    ]
    sweep.write_csv(rows, tmp_path / "runs.csv")
    paths = report.write_report(tmp_path / "runs.csv")
    assert [p.name for p in paths] == ["report.md", "parameter_sweep.png"]
    text = paths[0].read_text()
    assert f"| convit_tiny | 1.0 | 2.0 | 3 | {_cell([90.0, 91.0])} | 90.0 ± 0.0 [90.0, 90.0] | 2 |" in text
    assert "Sample efficiency" not in text  # one model: nothing to compare
    assert matplotlib.image.imread(paths[1]).ndim == 3


def test_report_of_a_single_model_lists_its_accuracy_per_fraction(tmp_path):
    rows = [
        {"run": f"r{f}{s}", "model": "convit_tiny", "train_fraction": f, "seed": s, "top1": 10 * f + s, "top5": 50}
        for f in (0.5, 1.0)
        for s in (0, 1)
    ]
    sweep.write_csv(rows, tmp_path / "runs.csv")
    assert [p.name for p in report.write_report(tmp_path / "runs.csv")] == ["report.md"]
    text = (tmp_path / "report.md").read_text()
    assert f"| convit_tiny | 0.5 | {_cell([5.0, 6.0])} | 50.0 ± 0.0 [50.0, 50.0] | 2 |" in text
    assert f"| convit_tiny | 1.0 | {_cell([10.0, 11.0])} |" in text


def test_report_bad_input(tmp_path):
    with pytest.raises(ValueError, match="CSV not found"):
        report.write_report(tmp_path / "missing.csv")
    write_fixture(tmp_path / "runs.csv")
    with pytest.raises(ValueError, match=r"baseline 'deit_small' is not in the CSV's model column"):
        report.write_report(tmp_path / "runs.csv", baseline="deit_small")
    done = sweep_cli("report", "--csv", str(tmp_path / "nope.csv"), "--output", str(tmp_path / "report"))
    assert done.returncode == 2 and done.stderr.strip() == f"error: CSV not found: {tmp_path / 'nope.csv'}"


def test_phase_diagram_tables_give_every_cell_an_interval(tmp_path):
    """Single-net error: t interval over seeds (scipy's); ensemble error: Clopper-Pearson over the test
    images (closed form at 0 errors: upper = 1 - 0.025^(1/n)); zero-loss nets k / n likewise."""
    nets, cells = [], []
    for width in (4, 8):
        for alpha in (0.1, 10.0):
            errors = [5.0 + width / 4, 6.0 + width / 4, 8.0 + width / 4]
            for seed, error in enumerate(errors):
                nets.append(
                    dict(width=width, alpha_tilde=alpha, seed=seed, test_error=error, ntk_change=alpha * (seed + 1))
                    | dict(converged=int(seed < 2))
                )
            cells.append(dict(width=width, alpha_tilde=alpha, ensemble_test_error=0.0 if width == 4 else 10.0))
    sweep.write_csv(nets, tmp_path / "nets.csv")
    sweep.write_csv(cells, tmp_path / "cells.csv")
    text = phase_diagram_tables.phase_diagram_tables(tmp_path, test_size=100)
    low, high = scipy_stats.t.interval(0.95, 2, loc=np.mean([6.0, 7.0, 9.0]), scale=scipy_stats.sem([6.0, 7.0, 9.0]))
    assert f"| 10 | {np.mean([6.0, 7.0, 9.0]):.1f} [{low:.1f}, {high:.1f}] |" in text
    assert f"0.0 [0.0, {100 * (1 - 0.025 ** (1 / 100)):.1f}]" in text  # no error among 100 test images
    assert "| 0.1 | 2/3 [" in text and "n = 3 seeds" in text
    geometric = np.exp(np.mean(np.log([10.0, 20.0, 30.0])))
    assert f"| 10 | {geometric:.2g} [" in text.split("Kernel change")[1]
