"""No command writes over a file another command reads. Every writer (each command's --output, the files and
folders it writes) goes through convbias.base.storage, which refuses a destination that is a file of a run or of an
exported model, however the path is spelled, unless the writer is the run itself (train.py); an explicit
--resume POINT continues into the point's own run or a fresh folder, never over another run. A command that
reads a run still training loads the point it verified or the next verified one. The runs are real (a tiny
eFCN trained by train.py) and the export is convbias-export's, built once for the module."""

import contextlib
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from support.images import png
from support.runs import messages, one_line, tree

from convbias.base import storage
from convbias.base.errors import EXIT_REQUEUE, EXIT_USAGE, ConfigError
from convbias.base.run_layout import CHECKPOINTS_DIR, WEIGHTS_FILE, point_name, point_position
from convbias.base.weights import read_state_dict, weights_metadata
from convbias.cli import diagnostics, export, predict, train
from convbias.engine import RunDir, build_run_model
from convbias.engine.checkpoint.points import CheckpointDir
from convbias.engine.checkpoint.resume import load_training_state
from convbias.engine.rundir.reader import ROTATION_RETRIES
from convbias.families import load_families
from convbias.studies.efcn_protocol import command as efcn_protocol
from convbias.studies.ensembles import command as ensemble
from convbias.studies.phase_diagram import command as phase_diagram
from convbias.studies.robustness import command as robustness
from convbias.studies.stability import command as stability
from convbias.studies.sweep import command as sweep

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.integration]

EFCN = ["--model", "efcn_vanilla_cnn", "--model-kwargs", "channels=4", "--img-size", "8", "--drop-path", "0"]
EFCN += ["--dataset", "digits", "--batch-size", "64", "--train-fraction", "0.2", "--no-aug", "--workers", "0"]
EFCN += ["--warmup-epochs", "0", "--no-diagnostics"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A finished run of 2 epochs, another run of 1 epoch (another seed), the first one's export, an image."""
    root = tmp_path_factory.mktemp("writes")
    run, other, exported = root / "run", root / "other", root / "exported"
    assert train.main([*EFCN, "--epochs", "2", "--output", str(run)]) == 0
    assert train.main([*EFCN, "--epochs", "1", "--seed", "1", "--output", str(other)]) == 0
    assert export.main([str(run), "--output", str(exported)]) == 0
    png(root / "img.png")
    return SimpleNamespace(root=root, run=run, other=other, exported=exported, image=root / "img.png")


def snapshot(folders) -> dict:
    return {name: tree(getattr(folders, name)) for name in ("run", "other", "exported")}


# ------------------------------------------------------------------------------- case 1: --resume POINT
def test_resume_of_another_runs_point_is_refused_over_a_finished_run(folders, capsys):
    before = snapshot(folders)
    point = folders.other / CHECKPOINTS_DIR / point_name(1)
    capsys.readouterr()
    code = train.main([*EFCN, "--epochs", "3", "--resume", str(point), "--output", str(folders.run)])
    assert code == EXIT_USAGE
    one_line(
        messages(capsys.readouterr().err),
        rf"--resume {point} is a point of the run {folders.other}, and --output {folders.run} is another run .*"
        rf"continue into the point's own run \(--output {folders.other}\) or into a new --output",
    )
    assert snapshot(folders) == before  # byte for byte: points, config.yaml, logs, results.json


def test_resume_of_another_runs_point_continues_into_a_fresh_folder_and_touches_no_other(folders, tmp_path):
    before = snapshot(folders)
    point = folders.other / CHECKPOINTS_DIR / point_name(1)
    fresh = tmp_path / "continued"
    assert train.main([*EFCN, "--epochs", "2", "--resume", str(point), "--output", str(fresh)]) == 0
    assert RunDir(fresh).status() == "done" and RunDir(fresh).results()["epochs"] == 2
    assert snapshot(folders) == before  # neither the point's run nor a third folder is touched


# ------------------------------------------------------------------ case 2: an export's own file as --output
@pytest.mark.parametrize("spelling", ["plain", "relative", "dot-dot", "link"])
def test_predict_never_writes_over_an_exports_config(folders, tmp_path, monkeypatch, capsys, spelling):
    before = snapshot(folders)
    target = folders.exported / "config.json"
    if spelling == "relative":
        monkeypatch.chdir(folders.root)
        target = target.relative_to(folders.root)
    elif spelling == "dot-dot":
        target = folders.exported / ".." / folders.exported.name / "config.json"
    elif spelling == "link":
        (tmp_path / "alias").symlink_to(folders.exported)
        target = tmp_path / "alias" / "config.json"
    capsys.readouterr()
    assert predict.main([str(folders.exported), str(folders.image), "--output", str(target)]) == EXIT_USAGE
    one_line(messages(capsys.readouterr().err), rf"--output {target} is a file of the exported model ")
    assert snapshot(folders) == before


# --------------------------------------------------------------------------------- the shared writer
@pytest.mark.parametrize("spelling", ["plain", "relative", "dot-dot", "link", "point"])
def test_the_shared_writer_refuses_a_runs_file_however_spelled(folders, tmp_path, monkeypatch, spelling):
    before = snapshot(folders)
    target = {
        "plain": folders.run / "summary.csv",
        "relative": Path(folders.run.name) / "results.json",
        "dot-dot": folders.run / CHECKPOINTS_DIR / ".." / "config.yaml",
        "link": tmp_path / "alias" / "log.jsonl",
        "point": folders.run / CHECKPOINTS_DIR / point_name(2) / "manifest.json",
    }[spelling]
    monkeypatch.chdir(folders.root)
    (tmp_path / "alias").symlink_to(folders.run)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(target))} is a file of the run {folders.run}"):
        storage.write_text(target, "replaced\n")
    assert snapshot(folders) == before


def test_the_run_itself_writes_its_own_files(folders, tmp_path):
    own = tmp_path / "own"
    shutil.copytree(folders.run, own, symlinks=True)
    storage.write_text(own / "results.json", "{}\n", owner=own)  # train.py's records, with their owner
    assert (own / "results.json").read_text() == "{}\n"
    with pytest.raises(ConfigError, match="is a file of the run"):
        storage.write_text(own / "results.json", "{}\n", owner=folders.run)  # another run is no owner here


# ------------------------------------------------------------------------------------- every writer
def writers(folders, fixture_dir):
    """Each command that writes, pointed at a run's files and at an export's: (name, argv, main)."""
    run, exported, image = str(folders.run), str(folders.exported), str(folders.image)
    protocol = str(fixture_dir / "configs" / "efcn_protocol" / "efcn_cifar10.yaml")
    phase = folders.root / "phase.yaml"
    phase.write_text(yaml.safe_dump({"widths": [2], "alpha_tildes": [1.0], "seeds": [0]}))
    quick_stability = [
        "--checkpoints",
        "last",
        "--images",
        "8",
        "--deltas",
        "0.75",
        "--main-delta",
        "0.75",
        "--cuts",
        "3",
        "--draws",
        "1",
    ]
    sweep_run = ["run", "--models", "efcn_vanilla_cnn", "--fractions", "1", "--seeds", "0", "--print-commands"]
    maps = ["--model", "convit_tiny", "--image", image, "--img-size", "32"]
    return [
        ("train", train.main, [*EFCN, "--output", f"{run}/checkpoints/mine"], [*EFCN, "--output", f"{exported}/config.json"]),
        ("predict", predict.main, [run, image, "--output", f"{run}/results.json"], [run, image, "--output", f"{exported}/config.json"]),
        ("export", export.main, [run, "--output", f"{run}/checkpoints/exported"], [run, "--output", f"{exported}/README.md"]),
        ("ensemble", ensemble.main, [run, str(folders.other), "--output", f"{run}/log.jsonl"], [run, str(folders.other), "--output", f"{exported}/config.json"]),
        ("robustness", robustness.main, [run, "--max-images", "8", "--output", run], [run, "--max-images", "8", "--output", exported]),
        ("diagnostics", diagnostics.main, [*maps, "--output", f"{run}/checkpoints"], [*maps, "--output", exported]),
        ("stability", stability.main, [run, *quick_stability, "--output", run], [run, *quick_stability, "--output", exported]),
        ("sweep", sweep.main, [*sweep_run, "--output", run], [*sweep_run, "--output", exported]),
        ("phase-diagram", phase_diagram.main, ["-c", str(phase), "--output", run], ["-c", str(phase), "--output", exported]),
        ("efcn-protocol", efcn_protocol.main, ["-c", protocol, "--output", run], ["-c", protocol, "--output", exported]),
    ]  # fmt: skip


WRITERS = ["train", "predict", "export", "ensemble", "robustness", "diagnostics", "stability", "sweep"]
WRITERS += ["phase-diagram", "efcn-protocol"]


@pytest.mark.parametrize("target", ["run", "export"])
@pytest.mark.parametrize("writer", WRITERS)
def test_every_writer_refuses_a_file_another_command_reads(folders, repo, capsys, writer, target):
    found = {name: (main, at_run, at_export) for name, main, at_run, at_export in writers(folders, repo)}
    main, at_run, at_export = found[writer]
    before = snapshot(folders)
    capsys.readouterr()
    assert main(at_run if target == "run" else at_export) == EXIT_USAGE
    folder = folders.run if target == "run" else folders.exported
    one_line(
        messages(capsys.readouterr().err), rf"--output {folder}\S* (is a file of the|is a train.py run|is an exported)"
    )
    assert snapshot(folders) == before  # byte for byte, nothing added


def test_train_writes_its_own_run_and_a_resume_continues_it(folders, tmp_path):
    """The owner's exception: train.py rewrites its own config.yaml, logs and results when it continues."""
    own = tmp_path / "own"
    shutil.copytree(folders.other, own, symlinks=True)
    assert train.main([*EFCN, "--epochs", "2", "--resume", "auto", "--output", str(own)]) == 0
    assert RunDir(own).results()["epochs"] == 2


# --------------------------------------------------------------------------- reading a run being written
class RotatingRun(storage.FileSystem):
    """The package's file system, where the run at ``run`` saves a new point before each of the first ``times``
    loads of one of its weights files (``loads``): the training loop's own save (CheckpointDir.save, of the newest
    point's weights and state one epoch on), whose rotation (keeping 1 point, and the best as --checkpoint-hist 1
    ranks it) removes the point the reader chose between its choice and its load."""

    def __init__(self, run: Path, times: int):
        self.run, self.times, self.loads = run.resolve(), times, []

    def load_safetensors(self, path):
        if len(self.loads) < self.times and Path(path).resolve().is_relative_to(self.run):
            self.loads.append(Path(path))
            self.save_a_point()
        return super().load_safetensors(path)

    def save_a_point(self) -> None:
        points = CheckpointDir(self.run, keep=1)
        newest = points.points()[0]
        epoch = point_position(newest)[0] + 1
        state = load_training_state(newest)
        weights = storage.FileSystem().load_safetensors(newest / WEIGHTS_FILE)
        points.stage(epoch)
        state = dict(state, epoch=epoch, ranked=[state["best"]])
        points.save(epoch, weights, state, None, weights_metadata(newest / WEIGHTS_FILE), is_best=False)


@pytest.fixture
def rotate_under_the_reader():
    """``rotate_under_the_reader(run, times)``: for the rest of the test the run rotates its points away under
    the reader (``RotatingRun``); returns the weights files whose loads it preceded."""
    with contextlib.ExitStack() as stack:

        def rotate(run: Path, times: int) -> list[Path]:
            return stack.enter_context(storage.using(RotatingRun(run, times))).loads

        yield rotate


def test_a_reader_loads_the_next_verified_point_when_the_run_rotates_its_choice_away(
    folders, tmp_path, rotate_under_the_reader
):
    run = tmp_path / "training"
    shutil.copytree(folders.run, run, symlinks=True)
    chosen = RunDir(run).newest_point()
    calls = rotate_under_the_reader(run, times=1)
    model, checkpoint = build_run_model(RunDir(run), "last", load_families())
    assert calls == [chosen / WEIGHTS_FILE] and not chosen.exists()  # removed between the choice and the load
    assert checkpoint.epoch == 3 and checkpoint.weights == run / CHECKPOINTS_DIR / point_name(3) / WEIGHTS_FILE
    expected = read_state_dict(checkpoint.weights)
    assert all(torch.equal(value, expected[name]) for name, value in model.state_dict().items())


def test_a_run_that_keeps_rotating_under_a_reader_is_one_line_run_again(
    folders, tmp_path, rotate_under_the_reader, capsys
):
    run = tmp_path / "training"
    shutil.copytree(folders.run, run, symlinks=True)
    rotate_under_the_reader(run, times=ROTATION_RETRIES)
    capsys.readouterr()
    assert predict.main([str(run), str(tmp_path / ".." / folders.image)]) == EXIT_REQUEUE
    one_line(messages(capsys.readouterr().err), rf"^error: {run} is being written: .* run the command again")


def test_an_export_of_a_run_being_written_holds_the_next_verified_point(
    folders, tmp_path, rotate_under_the_reader, capsys
):
    run = tmp_path / "training"
    shutil.copytree(folders.run, run, symlinks=True)
    rotate_under_the_reader(run, times=1)
    assert export.main([str(run), "--output", str(tmp_path / "exported")]) == 0
    assert "epoch 3" in capsys.readouterr().out
    exported = read_state_dict(tmp_path / "exported" / WEIGHTS_FILE)
    expected = read_state_dict(run / CHECKPOINTS_DIR / point_name(3) / WEIGHTS_FILE)
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)


def test_eval_only_of_a_run_being_written_evaluates_the_next_verified_point(
    folders, tmp_path, rotate_under_the_reader, capsys
):
    """train.py --eval-only RUN chooses the point before it builds the model; the run's rotation removes it
    in between, and the evaluation loads the next verified point and names it."""
    run = tmp_path / "training"
    shutil.copytree(folders.run, run, symlinks=True)
    chosen = RunDir(run).newest_point()
    calls = rotate_under_the_reader(run, times=1)
    capsys.readouterr()
    assert train.main(["--eval-only", str(run), "--workers", "0"]) == 0
    assert calls == [chosen / WEIGHTS_FILE] and not chosen.exists()
    assert re.search(rf"\({run / CHECKPOINTS_DIR / 'last'} \(epoch 3\)\)", capsys.readouterr().out)


def test_robustness_of_a_run_being_written_evaluates_the_next_verified_point(
    folders, tmp_path, rotate_under_the_reader, capsys
):
    run = tmp_path / "training"
    shutil.copytree(folders.run, run, symlinks=True)
    chosen = RunDir(run).newest_point()
    calls = rotate_under_the_reader(run, times=1)
    output = tmp_path / "robustness"
    assert robustness.main([str(run), "--max-images", "8", "--output", str(output)]) == 0
    assert calls == [chosen / WEIGHTS_FILE] and not chosen.exists()
    assert "epoch 3" in (output / "robustness.md").read_text()  # the table names the point evaluated
