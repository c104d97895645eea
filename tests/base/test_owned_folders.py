"""Every output folder a study or sweep writes has an owner, and every file the package writes and reads back is
read by one checked reader. A study or sweep marks the folder it writes (run_layout.OwnedFolder, its .owner
file), so that no other command writes over the files read back there; its commands write only plain files
(never through a symbolic or hard link, never into a FIFO) and read back only tables with their declared columns
and types. train.py's --save-epochs snapshots, its lock and a timm checkpoint's saved args are read the same way.

The folders here are written by the commands themselves (tiny inputs: a study's tables combined, a sweep of two
tiny trained runs and one that a stand-in launcher fails, a phase diagram of two nets, one tiny training run), once
per module; every check is an in-process call of a command's main(argv)."""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from support import REPO
from support.images import png
from support.runs import TINY_TRAIN_ARGS, messages, tree
from support.sweeps import TINY_SET

from convbias.base import run_layout
from convbias.base.errors import EXIT_DAMAGED, EXIT_USAGE, DamagedCheckpointError, DamagedInputError
from convbias.base.run_layout import (
    CHECKPOINTS_DIR,
    OWNED_FOLDERS,
    OWNER_FILE,
    REPORT_FILE,
    SNAPSHOT_NAME,
    SNAPSHOT_SUFFIX,
    SNAPSHOTS_FILE,
    STABILITY_TABLE,
    SWEEP_LOGS_DIR,
    SWEEP_RUNS_DIR,
    snapshot_file,
)
from convbias.cli import predict, train
from convbias.engine.checkpoint.points import CheckpointDir
from convbias.engine.rundir.timm_files import read_timm_checkpoint
from convbias.studies.efcn_protocol import command as efcn_protocol
from convbias.studies.efcn_protocol import seeds
from convbias.studies.efcn_protocol.seeds import BASELINE_METRICS, SUMMARY_METRICS
from convbias.studies.phase_diagram import command as phase_diagram
from convbias.studies.phase_diagram import study as phase_diagram_study
from convbias.studies.regimes import command as regimes
from convbias.studies.robustness import command as robustness
from convbias.studies.stability import command as stability
from convbias.studies.stability import contrasts as stability_contrasts
from convbias.studies.stability import contrasts_command as contrasts
from convbias.studies.stability import study as stability_study
from convbias.studies.sweep import command as sweep_command
from convbias.studies.sweep import report as sweep_report
from convbias.studies.sweep import runs as sweep_runs
from convbias.studies.sweep import sweep
from convbias.studies.sweep.spec import load_spec

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.integration]

STUDY = REPO / "results" / "relative_stability"
RUN = [*TINY_TRAIN_ARGS, "--train-fraction", "0.1", "--batch-size", "64", "--no-diagnostics"]
Command = Callable[[Path, Path], tuple[Callable[[list[str]], int], list[str]]]  # (folder, scratch) -> main, argv


def call(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, list[str]]:
    """A command in this process: its exit code and its stderr lines (progress bars and warnings left out)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, [line for line in messages(err.getvalue()) if not line.startswith("warning:")]


@dataclass
class Folder:
    """An output folder as its commands leave it: the commands that write it, and per file those that read it."""

    path: Path
    declared: Callable[[str], bool]  # what its writers write there: the package's declaration
    writers: list[Command]
    readers: dict[str, list[Command]]
    others: tuple[str, ...] = ()  # subfolders that are other commands' (a sweep's train.py runs)
    inside: str = ""  # the folder within what a case copies: a run's checkpoints/ within the run

    @property
    def root(self) -> Path:
        """What a case copies: the folder, or the run that holds it."""
        return self.path.parents[len(Path(self.inside).parts) - 1] if self.inside else self.path

    def files(self) -> list[str]:
        """Every file in the folder (its subfolders' too, but the others'), relative."""
        found = []
        for path in sorted(self.path.rglob("*")):
            relative = path.relative_to(self.path).as_posix()
            if not path.is_dir() and relative.split("/")[0] not in self.others:
                found.append(relative)
        return found


# ------------------------------------------------------------------------------------------------ the folders
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One epoch of the tiny ConViT with its --save-epochs snapshots of epochs 0 and 1."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert call(train.main, [*RUN, "--save-epochs", "0", "1", "--output", str(run)])[0] == 0
    return run


def measured_tables(folder: Path) -> Path:
    """Two seeds each of the study's T-CNN and FCN at the full training set, as the study measured them."""
    folder.mkdir(parents=True)
    runs = {f"{model}_P1.0_seed{seed}" for model in ("tcnn", "fcn") for seed in (0, 1)}
    for name in (STABILITY_TABLE, "stability_layers.csv", "trajectories.csv"):
        with open(STUDY / name, newline="") as f:
            rows = [row for row in csv.DictReader(f) if row["run"].rsplit("/", 1)[-1] in runs]
        with open(folder / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
    return folder


COMBINE = ["--checkpoints", "init", "best", "--deltas", "1", "--cuts", "3", "--main-delta", "1"]


@pytest.fixture(scope="module")
def stability_folder(tmp_path_factory) -> Folder:
    root = tmp_path_factory.mktemp("stability")
    source, folder = measured_tables(root / "measured"), root / "folder"
    assert call(stability.main, ["--combine", str(source), *COMBINE, "--output", str(folder)])[0] == 0
    shutil.copy(source / "trajectories.csv", root / "trajectories.csv")
    assert call(contrasts.main, [str(folder), "--no-figure"])[0] == 2  # no trajectories yet: nothing written
    shutil.copy(root / "trajectories.csv", folder / "trajectories.csv")
    assert call(contrasts.main, [str(folder), "--no-figure"])[0] == 0
    rewrite: Command = lambda f, scratch: (  # noqa: E731
        stability.main,
        ["--combine", str(source), *COMBINE, "--output", str(f)],
    )
    pairs: Command = lambda f, scratch: (contrasts.main, [str(f), "--no-figure"])  # noqa: E731
    combined: Command = lambda f, scratch: (  # noqa: E731
        stability.main,
        ["--combine", str(f), *COMBINE, "--output", str(scratch / "new")],
    )
    readers = {STABILITY_TABLE: [combined, pairs], "stability_layers.csv": [combined], "trajectories.csv": [pairs]}
    return Folder(folder, run_layout.STABILITY_FOLDER.declares, [rewrite, pairs], readers)


def sweep_file(root: Path) -> Path:
    path = root / "grid.yaml"
    spec = {"set": TINY_SET, "grid": {"model": ["convit_tiny"], "seed": [0, 1, 2]}}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def sweep_folder(tmp_path_factory) -> Folder:
    """Seeds 0 and 1 trained (train.py in this process, as the sweep's commands say), seed 2 started by a launcher
    that fails (`false`): the sweep's record, its runs' table and their ensemble, a log and the report."""
    root = tmp_path_factory.mktemp("sweep")
    grid, folder = sweep_file(root), root / "folder"
    prepared = sweep.Sweep.prepare(load_spec(grid), folder)
    for command in prepared.commands()[:2]:
        assert call(train.main, command[3:])[0] == 0  # python -m convbias.cli.train ARGS
    run = ["run", str(grid), "--output", str(folder), "--launcher", "false"]
    assert call(sweep_command.main, run)[0] == 1  # seed 2 failed, left as it is
    assert (folder / "ensembles.csv").is_file()
    writers: list[Command] = [
        lambda f, scratch: (sweep_command.main, ["run", str(grid), "--output", str(f), "--launcher", "false"]),
        lambda f, scratch: (sweep_command.main, ["collect", "--output", str(f)]),
        lambda f, scratch: (sweep_command.main, ["report", "--csv", str(f / "runs.csv"), "--output", str(f)]),
        lambda f, scratch: (regimes.main, [str(f)]),
    ]
    report: Command = lambda f, scratch: (  # noqa: E731
        sweep_command.main,
        ["report", "--csv", str(f / "runs.csv"), "--output", str(scratch / "new")],
    )
    readers = {
        "sweep.yaml": [writers[1]],
        "runs.csv": [report, writers[3]],
        "ensembles.csv": [report],
        f"{SWEEP_LOGS_DIR}/{prepared.runs[2].name}.log": [],  # any bytes are a console log
    }
    return Folder(folder, run_layout.SWEEP_FOLDER.declares, writers, readers, others=(SWEEP_RUNS_DIR,))


@pytest.fixture(scope="module")
def phase_diagram_folder(tmp_path_factory) -> Folder:
    root = tmp_path_factory.mktemp("phase")
    config, folder = root / "grid.yaml", root / "folder"
    grid = {"widths": [2], "alpha_tildes": [1.0], "seeds": [0, 1], "train_size": 20, "max_steps": 3}
    config.write_text(yaml.safe_dump(dict(grid, ntk_samples=2)))
    assert call(phase_diagram.main, ["-c", str(config), "--output", str(folder)])[0] == 0
    plot_only: Command = lambda f, scratch: (phase_diagram.main, ["--output", str(f), "--plot-only"])  # noqa: E731
    again: Command = lambda f, scratch: (phase_diagram.main, ["-c", str(config), "--output", str(f)])  # noqa: E731
    report: Command = lambda f, scratch: (  # noqa: E731
        sweep_command.main,
        ["report", "--csv", str(f / "runs.csv"), "--output", str(scratch / "new")],
    )
    readers = {name: [plot_only] for name in ("config.yaml", "nets.csv", "cells.csv")}
    readers |= {"runs.csv": [report], "ensembles.csv": [report]}
    return Folder(folder, run_layout.PHASE_DIAGRAM_FOLDER.declares, [plot_only, again], readers)


def protocol_output(folder: Path, seed: int) -> Path:
    """relax_times.csv, baselines.csv and protocol_config.yaml in the schemas the protocol writes them in."""
    from convbias.base.tables import write_csv

    folder.mkdir(parents=True)
    (folder / "protocol_config.yaml").write_text(yaml.safe_dump({"seed": seed}))
    accuracies = ("local_only_test_acc", "off_local_only_test_acc")
    row = {key: 50.0 + seed + i for i, key in enumerate((*SUMMARY_METRICS, *accuracies))}
    write_csv([{"relax_time": t, **row} for t in (0, 5)], folder / "relax_times.csv")
    baselines = {key: 60.0 + i for i, key in enumerate((*BASELINE_METRICS, *(f"fcn_{key}" for key in accuracies)))}
    write_csv([baselines], folder / "baselines.csv")
    return folder


@pytest.fixture(scope="module")
def efcn_protocol_folder(tmp_path_factory) -> Folder:
    root = tmp_path_factory.mktemp("protocol")
    folder, other = protocol_output(root / "seed0", 0), protocol_output(root / "seed1", 1)
    protocol = str(REPO / "configs" / "efcn_protocol" / "efcn_cpu.yaml")
    single: Command = lambda f, scratch: (  # noqa: E731
        efcn_protocol.main,
        ["--stage", "single-seed", "--test-images", "100", "--output", str(f)],
    )
    seeds: Command = lambda f, scratch: (  # noqa: E731
        efcn_protocol.main,
        ["--stage", "summarize", "--seed-dirs", str(f), str(other), "--output", str(f)],
    )
    analyze: Command = lambda f, scratch: (  # noqa: E731
        efcn_protocol.main,
        ["-c", protocol, "--stage", "analyze", "--output", str(f)],
    )
    for command in (single, seeds):
        assert call(*command(folder, root))[0] == 0
    summarized: Command = lambda f, scratch: (  # noqa: E731
        efcn_protocol.main,
        ["--stage", "summarize", "--seed-dirs", str(f), str(other), "--output", str(scratch / "new")],
    )
    readers = {"protocol_config.yaml": [summarized], "relax_times.csv": [single, summarized]}
    readers["baselines.csv"] = [single, summarized]
    return Folder(folder, run_layout.EFCN_PROTOCOL_FOLDER.declares, [single, seeds, analyze], readers)


@pytest.fixture(scope="module")
def robustness_folder(tmp_path_factory, trained) -> Folder:
    folder = tmp_path_factory.mktemp("robustness") / "folder"
    quick = [str(trained), "--max-images", "4", "--workers", "0", "--attacks", "none", "--severities", "1"]
    assert call(robustness.main, [*quick, "--output", str(folder)])[0] == 0
    again: Command = lambda f, scratch: (robustness.main, [*quick, "--output", str(f)])  # noqa: E731
    return Folder(folder, run_layout.ROBUSTNESS_FOLDER.declares, [again], {})


QUICK_STABILITY = ["--images", "2", "--deltas", "0.75", "--cuts", "3", "--main-delta", "0.75", "--draws", "1"]


def is_snapshot_file(relative: str) -> bool:
    """run_layout's names of what --save-epochs writes into checkpoints/: the snapshots and their listing."""
    stem = relative.removesuffix(SNAPSHOT_SUFFIX)
    return relative == SNAPSHOTS_FILE or (stem != relative and SNAPSHOT_NAME.fullmatch(stem) is not None)


@pytest.fixture(scope="module")
def snapshots_folder(trained) -> Folder:
    """The checkpoints/ of a run with --save-epochs snapshots: train.py writes them (and reads their listing
    back), convbias-stability reads them."""
    resume: Command = lambda f, scratch: (  # noqa: E731
        train.main,
        [*RUN, "--epochs", "2", "--save-epochs", "0", "1", "2", "--resume", "auto", "--output", str(f.parent)],
    )
    measure: Command = lambda f, scratch: (  # noqa: E731
        stability.main,
        [str(f.parent), "--checkpoints", "init", "epoch_1", *QUICK_STABILITY, "--output", str(scratch / "new")],
    )
    readers = {SNAPSHOTS_FILE: [resume, measure], snapshot_file(0): [measure], snapshot_file(1): [measure]}
    points = tuple(p.name for p in (trained / CHECKPOINTS_DIR).iterdir() if not is_snapshot_file(p.name))
    return Folder(trained / CHECKPOINTS_DIR, is_snapshot_file, [resume], readers, points, CHECKPOINTS_DIR)


FOLDERS = {owner: owner.removeprefix("convbias-").replace("-", "_") + "_folder" for owner in OWNED_FOLDERS}


def test_every_owned_folder_of_the_package_is_driven_here():
    """A new owned folder is a new declaration in run_layout, and needs its case below."""
    assert set(FOLDERS.values()) == {
        "stability_folder",
        "sweep_folder",
        "phase_diagram_folder",
        "efcn_protocol_folder",
        "robustness_folder",
    }


# ------------------------------------------------------------------------------------- what is planted
PLANTS = ("symbolic link", "hard link", "fifo", "damaged")


def plant(path: Path, how: str, elsewhere: Path) -> None:
    """``how`` in the place of ``path``: a link (of either kind) to a copy elsewhere, a FIFO, or the file with its
    first byte replaced by one that is no UTF-8 text (a damaged copy)."""
    if how == "damaged":
        data = path.read_bytes()
        path.write_bytes(b"\xff" + data[1:])
        return
    other = elsewhere / f"other.{path.name}"
    shutil.copyfile(path, other)
    path.unlink()
    if how == "symbolic link":
        path.symlink_to(other)
    elif how == "hard link":
        os.link(other, path)
    else:
        os.mkfifo(path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", PLANTS)
@pytest.mark.parametrize("kind", [*FOLDERS.values(), "snapshots_folder"])
def test_a_link_a_fifo_or_a_damaged_copy_at_any_file_of_a_folder_is_one_line_naming_it(request, tmp_path, kind, how):
    """At every file a study's, sweep's or --save-epochs' commands write or read back (the files of the folder its
    commands wrote, each declared by the package): every writer of the folder and every reader of the file refuses a
    link of either kind or a FIFO in its place, and every reader a damaged copy: one line naming the file, exit 65,
    nothing written (the folder, the link's target, the reader's new output)."""
    folder: Folder = request.getfixturevalue(kind)
    files = folder.files()
    undeclared = [name for name in files if not folder.declared(name)]
    assert not undeclared, f"files its commands write but the package does not declare: {undeclared}"
    assert set(folder.readers) <= set(files), "a file read back that its commands did not write"
    for relative in files:
        readers = folder.readers.get(relative, [])
        for number, command in enumerate(readers if how == "damaged" else [*folder.writers, *readers]):
            work = tmp_path / f"{relative.replace('/', '_')}-{number}"
            shutil.copytree(folder.root, work / folder.root.name, symlinks=True)
            copy = work / folder.root.name / folder.inside
            (work / "elsewhere").mkdir()
            plant(copy / relative, how, work / "elsewhere")
            before = tree(work)
            main, argv = command(copy, work)
            code, err = call(main, argv)
            assert code == EXIT_DAMAGED and len(err) == 1, (relative, argv, code, err)
            assert str(copy / relative) in err[0] and "Traceback" not in err[0], (relative, err)
            assert tree(work) == before, (relative, argv)


# --------------------------------------------------------------------- writes the guard never saw (data loss)
@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_sweep_log_that_is_a_link_to_a_runs_file_is_refused_and_the_file_kept(sweep_folder, trained, tmp_path, link):
    """The sweep appends each run's console log: through a symbolic link to another run's weights it would append
    to them, through a hard link to a run's results.json make it unreadable. Refused before any run starts."""
    folder, run = tmp_path / "sweep", tmp_path / "other_run"
    shutil.copytree(sweep_folder.path, folder, symlinks=True)
    shutil.copytree(trained, run, symlinks=True)
    (log,) = (folder / SWEEP_LOGS_DIR).iterdir()
    log.unlink()
    target = run / CHECKPOINTS_DIR / "epoch_0001" / "model.safetensors" if link == "symbolic" else run / "results.json"
    log.symlink_to(target) if link == "symbolic" else os.link(target, log)
    before = tree(tmp_path)
    code, err = call(*sweep_folder.writers[0](folder, tmp_path))
    assert code == EXIT_DAMAGED and len(err) == 1 and f"{log} is a {link} link" in err[0], err
    assert tree(tmp_path) == before  # the run's file byte for byte, no run started


@pytest.mark.parametrize("spelling", ["plain", "relative", "dot-dot", "linked folder"])
def test_predict_never_writes_over_a_studys_table_however_spelled(
    stability_folder, trained, tmp_path, monkeypatch, spelling
):
    folder = tmp_path / "stability"
    shutil.copytree(stability_folder.path, folder)
    png(tmp_path / "img.png")
    target = {
        "plain": folder / STABILITY_TABLE,
        "relative": Path(folder.name) / STABILITY_TABLE,
        "dot-dot": folder / ".." / folder.name / STABILITY_TABLE,
        "linked folder": tmp_path / "alias" / STABILITY_TABLE,
    }[spelling]
    (tmp_path / "alias").symlink_to(folder)
    monkeypatch.chdir(tmp_path)
    before = tree(folder)
    code, err = call(predict.main, [str(trained), str(tmp_path / "img.png"), "--output", str(target)])
    assert code == EXIT_USAGE and len(err) == 1, err
    assert re.search(
        rf"--output {re.escape(str(target))} is a file of the output folder of convbias-stability ", err[0]
    )
    assert tree(folder) == before  # the table convbias-stability --combine reads back, byte for byte


def test_a_hard_link_to_a_studys_table_given_as_an_output_is_replaced_never_written_through(
    stability_folder, trained, tmp_path
):
    """A whole-file write replaces the name it is given: the table under its other name is untouched."""
    folder = tmp_path / "stability"
    shutil.copytree(stability_folder.path, folder)
    png(tmp_path / "img.png")
    os.link(folder / STABILITY_TABLE, tmp_path / "predictions.csv")
    before = tree(folder)
    code, _ = call(
        predict.main, [str(trained), str(tmp_path / "img.png"), "--output", str(tmp_path / "predictions.csv")]
    )
    assert code == 0 and tree(folder) == before
    assert (tmp_path / "predictions.csv").read_text().startswith("path,label_1")


# -------------------------------------------------------------------------------------- hangs on special files
@pytest.mark.timeout(60)
def test_a_snapshot_listing_that_becomes_a_fifo_mid_run_stops_the_next_snapshot_unread(tmp_path):
    """--save-epochs reads its listing before each snapshot: a FIFO put there while the run trains is one
    DamagedCheckpointError naming it (exit 65), and the snapshot is not written."""
    points = CheckpointDir(tmp_path)
    weights = torch.nn.Linear(4, 2).state_dict()
    points.save_snapshot(0, weights, {"epoch": "0"})
    (points.root / SNAPSHOTS_FILE).unlink()
    os.mkfifo(points.root / SNAPSHOTS_FILE)
    with pytest.raises(DamagedCheckpointError, match=re.escape(f"{points.root / SNAPSHOTS_FILE} is a named pipe")):
        points.save_snapshot(1, weights, {"epoch": "1"})
    assert not (points.root / snapshot_file(1)).exists()


@pytest.fixture(scope="module")
def timm_checkpoint(tmp_path_factory) -> Path:
    """timm's training checkpoint of its 0.37M-parameter test ResNet, as its CheckpointSaver writes one."""
    import argparse

    import timm

    path = tmp_path_factory.mktemp("timm") / "last.pth.tar"
    model = timm.create_model("test_resnet", num_classes=3)
    args = argparse.Namespace(model="test_resnet", num_classes=3, input_size=None, in_chans=None, gp=None)
    torch.save({"state_dict": model.state_dict(), "epoch": 0, "version": 2, "args": args}, path)
    return path


def with_args(source: Path, path: Path, **args) -> Path:
    content = torch.load(source, weights_only=False)
    vars(content["args"]).update(args)
    torch.save(content, path)
    return path


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "field, value, refused",
    [
        ("class_map", "FIFO", r"args\.class_map: --class-map \S+ is a named pipe \(FIFO\), not a regular file"),
        ("crop_pct", 7.0, r"args\.crop_pct must be in \(0, 1\], got 7\.0"),
        ("mean", [float("nan")] * 3, r"args\.mean must be a finite number, got nan"),
        ("num_classes", "three", r"args\.num_classes expects int, got 'three'"),
        ("mean", [0.5, 0.5], r"args\.mean has 2 values for 3-channel images: \[0\.5, 0\.5\]"),
    ],
)
def test_a_timm_checkpoints_saved_args_are_checked_as_their_options(timm_checkpoint, tmp_path, field, value, refused):
    """Each field of the args a timm checkpoint saved, that building, evaluating or labelling its model reads, is
    checked as the option of that name: a class map naming a FIFO is refused unread (predict blocked on it)."""
    if value == "FIFO":
        os.mkfifo(tmp_path / "classes.txt")
        value = str(tmp_path / "classes.txt")
    path = with_args(timm_checkpoint, tmp_path / "last.pth.tar", **{field: value})
    png(tmp_path / "img.png")
    with pytest.raises(DamagedInputError, match=rf"^{re.escape(str(path))}: {refused}"):
        read_timm_checkpoint(path)
    code, err = call(predict.main, [str(path), str(tmp_path / "img.png"), "--output", str(tmp_path / "out.csv")])
    assert code == EXIT_DAMAGED and len(err) == 1 and re.search(refused, err[0]), err
    assert not (tmp_path / "out.csv").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("named", ["a pickle", "a FIFO", "no file"])
def test_a_weights_file_in_a_timm_checkpoints_saved_model_kwargs_is_never_read(timm_checkpoint, tmp_path, named):
    """timm.create_model(checkpoint_path=) would load what the saved args.model_kwargs name before the checkpoint's
    own weights replace it: a pickle was torch's advice to unpickle it (exit 2), a FIFO a FileNotFoundError
    traceback. Not read, the labels are those of the checkpoint's own weights."""
    target = tmp_path / "weights.pth"
    if named == "a pickle":
        torch.save({"state_dict": argparse.Namespace(x=1)}, target)  # a Python object besides tensors
    elif named == "a FIFO":
        os.mkfifo(target)
    path = with_args(timm_checkpoint, tmp_path / "last.pth.tar", model_kwargs={"checkpoint_path": str(target)})
    png(tmp_path / "img.png", 90)
    outputs = {}
    for name, source in (("named", path), ("plain", timm_checkpoint)):
        argv = [str(source), str(tmp_path / "img.png"), "--topk", "3", "--output", str(tmp_path / f"{name}.csv")]
        code, err = call(predict.main, argv)
        assert code == 0 and err[-1] == f"1 images labelled by {source} -> {tmp_path / f'{name}.csv'}", err
        outputs[name] = (tmp_path / f"{name}.csv").read_text().splitlines()[1].split(",", 1)[1]
    assert outputs["named"] == outputs["plain"]


def test_a_pool_type_a_constructor_asserts_on_is_one_line(timm_checkpoint, tmp_path):
    """timm's ResNet refuses a global pool type with an AssertionError: --gp, and a timm checkpoint's args.gp."""
    argv = ["--model", "test_resnet", "--dataset", "digits", "--img-size", "8", "--gp", "bogus"]
    code, err = call(train.main, [*argv, "--output", str(tmp_path / "run")])
    assert code == EXIT_USAGE and err == [
        "error: cannot build test_resnet with {'global_pool': 'bogus'}: Invalid pool type: bogus"
    ], err
    path = with_args(timm_checkpoint, tmp_path / "last.pth.tar", gp="bogus")
    png(tmp_path / "img.png")
    code, err = call(predict.main, [str(path), str(tmp_path / "img.png"), "--output", str(tmp_path / "out.csv")])
    assert code == EXIT_USAGE and err == [
        f"error: {path}: timm cannot build test_resnet from its args (Invalid pool type: bogus)"
    ], err
    assert not (tmp_path / "run").exists() and not (tmp_path / "out.csv").exists()


# ---------------------------------------------------------------------- tables the package wrote, read back
def edited(source: Path, path: Path, change: Callable[[list[dict]], tuple[list[str], list[dict]]]) -> Path:
    with open(source, newline="") as f:
        rows = list(csv.DictReader(f))
    columns, rows = change(rows)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, lineterminator="\n", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.mark.parametrize(
    "damage, refused",
    [
        ("foreign columns", r"has no 'run', 'group', .* columns? \(its header: name,score\)"),
        ("a header only", r"holds no rows \(a header only\)"),
        ("seed inf", r": line 2, column seed: unexpected value inf \(expected a finite number\)"),
    ],
)
def test_stability_combine_refuses_a_table_that_is_not_the_studys(stability_folder, tmp_path, damage, refused):
    source = tmp_path / "measured"
    shutil.copytree(stability_folder.path, source)
    table = source / STABILITY_TABLE
    changes = {
        "foreign columns": lambda rows: (["name", "score"], [{"name": "a", "score": "1"}]),
        "a header only": lambda rows: (list(rows[0]), []),
        "seed inf": lambda rows: (list(rows[0]), [dict(rows[0], seed="inf"), *rows[1:]]),
    }
    edited(table, table, changes[damage])
    code, err = call(stability.main, ["--combine", str(source), *COMBINE, "--output", str(tmp_path / "out")])
    assert (
        code == EXIT_DAMAGED
        and len(err) == 1
        and re.search(rf"{re.escape(str(table))}\S* {refused}|{re.escape(str(table))}{refused}", err[0])
    ), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "options, refused",
    [
        (
            ["--main-delta", "1.5", "--deltas", "1.5"],
            r"the tables hold no measurement at --main-delta 1\.5 and cut 3 \(the first of --cuts\); they hold delta 1 "
            r"at cut 3: give --main-delta and --cuts as measured",
        ),
        (["--checkpoints", "init", "last"], r"has no measurement of checkpoint last \(it has best, init\)"),
    ],
)
def test_stability_combine_with_settings_its_tables_do_not_hold_is_one_line(
    stability_folder, tmp_path, options, refused
):
    """Summarizing at a point or checkpoint the tables were not measured at names what they hold (it was a
    traceback of a figure's empty log axes, or a KeyError), and nothing is written."""
    argv = ["--combine", str(stability_folder.path), *COMBINE, *options, "--output", str(tmp_path / "out")]
    code, err = call(stability.main, argv)
    assert code == EXIT_USAGE and len(err) == 1 and re.search(f"^error: --combine: .*{refused}", err[0]), err
    assert not (tmp_path / "out").exists()


def test_stability_combine_of_rows_with_no_positive_r_f_draws_its_figures(stability_folder, tmp_path):
    """R_f is NaN where D_f = G_f = 0 (a model its input does not move) and 0 where D_f = 0, as measure writes it:
    the tables and figures are written, the error plot without its log axes (it was a matplotlib traceback)."""
    source = tmp_path / "measured"
    shutil.copytree(stability_folder.path, source)
    table = source / STABILITY_TABLE
    edited(
        table, table, lambda rows: (list(rows[0]), [dict(r, R="nan" if i % 2 else "0.0") for i, r in enumerate(rows)])
    )
    code, err = call(stability.main, ["--combine", str(source), *COMBINE, "--output", str(tmp_path / "out")])
    assert code == 0 and err == [], err
    assert (tmp_path / "out" / "rf_vs_error.png").stat().st_size > 0


@pytest.mark.parametrize("top1, refused", [("high", "unexpected value high"), ("nan", "unexpected value nan")])
def test_a_sweep_report_refuses_a_runs_table_with_no_accuracy_in_top1(sweep_folder, tmp_path, top1, refused):
    table = edited(
        sweep_folder.path / "runs.csv", tmp_path / "runs.csv", lambda rows: (list(rows[0]), [dict(rows[0], top1=top1)])
    )
    code, err = call(sweep_command.main, ["report", "--csv", str(table), "--output", str(tmp_path / "report")])
    expected = f"{table}: line 2, column top1: {refused} (expected a finite number in [0, 100])"
    assert code == EXIT_DAMAGED and err == [f"error: sweep runs table {expected}"], err
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("damage", ["not utf-8", "no run column", "a run named by a path"])
def test_regimes_refuses_a_runs_table_that_is_not_the_sweeps(sweep_folder, tmp_path, damage):
    """A runs.csv regimes cannot read is named (it read it with its own open()); a run named by a path (its folder
    is runs/NAME) is no row the sweep wrote, and is never loaded from where the path leads."""
    folder = tmp_path / "sweep"
    shutil.copytree(sweep_folder.path, folder, symlinks=True)
    table = folder / "runs.csv"
    if damage == "not utf-8":
        table.write_bytes(b"run,model,top1\n\xff\xfe,convit_tiny,50\n")
        refused = r"is not a CSV file this package wrote \('utf-8' codec can't decode byte 0xff"
    elif damage == "no run column":
        edited(table, table, lambda rows: ([c for c in rows[0] if c != "run"], rows))
        refused = r"has no 'run' column"
    else:
        edited(table, table, lambda rows: (list(rows[0]), [dict(rows[0], run="../../trained/run"), *rows[1:]]))
        refused = r"line 2, column run: unexpected value \.\./\.\./trained/run \(expected the name of a run folder\)"
    before = tree(folder)
    code, err = call(regimes.main, [str(folder)])
    assert code == EXIT_DAMAGED and len(err) == 1 and re.search(rf"{re.escape(str(table))}:? {refused}", err[0]), err
    assert tree(folder) == before


def test_every_table_of_the_results_reads_back_through_its_reader():
    """The columns each reader declares are those its writer writes: every table and record the repository's
    results hold (the studies' and sweeps' own outputs) reads back through its reader."""
    results = REPO / "results"
    readers: list[tuple[Callable[[Path], object], Path]] = []
    for folder in (results / "relative_stability", results / "relative_stability" / "grid"):
        readers += [(stability_study.read_rows, folder / STABILITY_TABLE)]
        layers = lambda path: stability_study.read_rows(path, stability_study.LAYER_COLUMNS)  # noqa: E731
        readers += [(layers, folder / "stability_layers.csv")]
    readers += [(stability_contrasts.read_trajectories, results / "relative_stability" / "trajectories.csv")]
    readers += [(sweep_runs.read_runs, path) for path in sorted(results.rglob("runs.csv"))]
    readers += [(sweep_report.read_ensembles, path) for path in sorted(results.rglob("ensembles.csv"))]
    readers += [(sweep.read_record, path.parent) for path in sorted(results.rglob("sweep.yaml"))]
    for folder in (results / "phase_diagram", results / "phase_diagram" / "long_budget"):
        readers += [(phase_diagram_study.read_nets, folder / "nets.csv")]
        readers += [(phase_diagram_study.read_cells, folder / "cells.csv")]
    for folder in (results / "efcn", *sorted((results / "efcn" / "seeds").iterdir())):
        readers += [(seeds._read_csv, folder / "relax_times.csv"), (seeds._read_csv, folder / "baselines.csv")]
        readers += [(seeds._seed, folder)]
    assert len(readers) >= 44  # the tables committed with the results, and any added since
    for read, path in readers:
        assert read(path) is not None, path
    top1 = [row["top1"] for row in sweep_runs.read_runs(results / "sample_efficiency" / "runs.csv")]
    assert len(top1) == 30 and all(isinstance(value, float) and 0 <= value <= 100 for value in top1)


# ------------------------------------------------------------------------------------------ the folders' marks
def test_a_marked_folder_is_the_owners_only(stability_folder, sweep_folder, tmp_path):
    """A study's folder is refused to another study (exit 2), and a folder whose mark names no command of the
    package is refused to all (65)."""
    folder = tmp_path / "stability"
    shutil.copytree(stability_folder.path, folder)
    code, err = call(*sweep_folder.writers[0](folder, tmp_path))
    assert code == EXIT_USAGE and err == [
        f"error: --output {folder} is the output folder of convbias-stability (its {OWNER_FILE}); convbias-sweep "
        f"writes into a folder of its own: choose another --output"
    ]
    (folder / OWNER_FILE).write_text("someone-else\n")
    code, err = call(*stability_folder.writers[0](folder, tmp_path))
    assert code == EXIT_DAMAGED and len(err) == 1 and f"its {OWNER_FILE} names no command" in err[0]


def test_a_sweep_report_or_regimes_writes_only_into_folders_whose_workflow_has_them(
    stability_folder, sweep_folder, efcn_protocol_folder, phase_diagram_folder, tmp_path
):
    """`convbias-sweep report --output` and `convbias-regimes` write into another command's folder only where the
    documented workflow does (a phase diagram's report; a sweep's regimes): a stability study's or an eFCN
    protocol's folder, whose report.md they would replace, is one line and left as it was."""
    for source in (stability_folder, efcn_protocol_folder):
        folder = tmp_path / source.path.parent.name
        shutil.copytree(source.path, folder)
        (folder / REPORT_FILE).write_text("the study's own report\n")
        table = str(shutil.copy(sweep_folder.path / "runs.csv", folder))  # a sweep's table, there by mistake
        before = tree(folder)
        owner = (folder / OWNER_FILE).read_text().splitlines()[0]
        for main, argv, writer in (
            (sweep_command.main, ["report", "--csv", table, "--output", str(folder)], "convbias-sweep"),
            (regimes.main, [str(folder)], "convbias-regimes"),
        ):
            code, err = call(main, argv)
            option = "--output" if writer == "convbias-sweep" else "SWEEP_DIR"
            assert code == EXIT_USAGE and err == [
                f"error: {option} {folder} is the output folder of {owner} (its {OWNER_FILE}), which {writer} does "
                f"not write into: choose another {option}"
            ], err
            assert tree(folder) == before
    folder = tmp_path / "phase"
    shutil.copytree(phase_diagram_folder.path, folder)
    code, err = call(sweep_command.main, ["report", "--csv", str(folder / "runs.csv"), "--output", str(folder)])
    assert code == 0 and err == [], err
    assert (folder / REPORT_FILE).read_text().startswith("# Sweep report")
