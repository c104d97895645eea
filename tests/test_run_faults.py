"""A run directory survives faults: nothing that may hold weights is deleted, damaged files are found by
their checksums, disk faults are one line with their own exit code, and `--resume auto` then finishes with
the numbers of the uninterrupted run wherever the fault left an intact resume point.

Faults are injected at the write boundaries (safetensors' save_file, torch.save, the log's open, the
lock's pwrite) with the errno a full or read-only disk gives: the tests run as root, whom chmod stops not.
"""

import csv
import errno
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from test_train_errors import messages

from convbias.cli import train
from convbias.engine import checkpoint, lock, run_log, trainer
from convbias.engine.checkpoint import (
    MANIFEST_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    CheckpointDir,
    find_resume_point,
    load_training_state,
    write_manifest,
)
from convbias.engine.errors import (
    EXIT_DAMAGED,
    EXIT_REQUEUE,
    EXIT_STORAGE,
    EXIT_USAGE,
    DamagedCheckpointError,
    StorageError,
)

pytestmark = pytest.mark.usefixtures("single_thread")

FIELDS = ("epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5", "lr")


@pytest.fixture(scope="module")
def args(cli_argv) -> list[str]:
    """A ConViT of width 16 for 3 epochs of 9 steps on a tenth of digits: 3 resume points, so a fallback has
    one to go back to."""
    model_kwargs = dict(cli_argv.TINY_CONVIT["model_kwargs"], embed_dim=16)
    return cli_argv(
        cli_argv.TINY_CONVIT,
        cli_argv.PLAIN_DIGITS,
        model_kwargs=model_kwargs,
        batch_size=16,
        lr=1e-3,
        weight_decay=0,
        seed=0,
        train_fraction=0.1,
        epochs=3,
        no_diagnostics=True,
    )


@pytest.fixture
def main(capsys, args):
    """`main(output, *extra)`: train.py's exit code, stdout and stderr lines for that run."""

    def run(output: Path, *extra: str) -> tuple[int, str, list[str]]:
        code = train.main(args + ["--output", str(output), *extra])
        out, err = capsys.readouterr()
        return code, out, messages(err)

    return run


def summary(output: Path) -> list[tuple[str, ...]]:
    with open(output / "summary.csv", newline="") as f:
        return [tuple(row[k] for k in FIELDS) for row in csv.DictReader(f)]


def snapshot(output: Path) -> dict[str, tuple[int, int]]:
    """Every path under the run dir with its size and mtime: what a refusal must leave as it was."""
    return {str(p.relative_to(output)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in output.rglob("*")}


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, args):
    output = tmp_path_factory.mktemp("faults") / "reference"
    train.run(args + ["--output", str(output)])
    return summary(output)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, args):
    """A run whose third resume point met a full disk (safetensors' write): epochs 1 and 2 are kept."""
    output = tmp_path_factory.mktemp("faults") / "stopped"
    real, calls = checkpoint.save_file, []

    def full_at_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            no_space()
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint, "save_file", full_at_the_third)
        code = train.main(args + ["--output", str(output)])
    return output, code


def copy(stopped, tmp_path) -> Path:
    output = tmp_path / "run"
    shutil.copytree(stopped[0], output, symlinks=True)
    return output


def flip(path: Path) -> None:
    """4 KiB of garbage written inside the file (its size stays)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = os.urandom(min(4096, len(data) - middle))
    path.write_bytes(bytes(data))


def test_disk_full_during_a_save_is_one_line_and_resume_auto_finishes_the_run(main, stopped, reference, tmp_path):
    output, code = stopped
    points = output / "checkpoints"
    assert code == EXIT_STORAGE
    assert sorted(p.name for p in points.iterdir()) == ["best", "epoch_0001", "epoch_0002", "last"]  # no staging
    assert CheckpointDir(output).select() == ((points / "epoch_0002").resolve(), [])
    assert not (output / ".lock").exists()

    run = copy(stopped, tmp_path)
    code, out, err = main(run, "--resume", "auto")
    assert code == 0 and err == [], err
    assert f"resumed from {(run / 'checkpoints' / 'epoch_0002').resolve()} after epoch 2" in out
    assert summary(run) == reference


def test_disk_full_message(main, tmp_path):
    """The one line names the point, the reason, what is kept and how to resume."""
    real, calls = checkpoint.save_file, []

    def full_at_the_second(*args, **kwargs):
        calls.append(1)
        return no_space() if len(calls) == 2 else real(*args, **kwargs)

    output = tmp_path / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint, "save_file", full_at_the_second)
        code, _, err = main(output, "--epochs", "2")
    assert code == EXIT_STORAGE and len(err) == 1
    assert re.fullmatch(
        r"error: writing the resume point epoch_0002 failed \(no space left on the device: the disk at \S+ has "
        rf"[\d.]+ \w+ free; this write needs about [\d.]+ \w+\); kept {re.escape(str(output))}/checkpoints/last "
        r"\(epoch 1\); continue with --resume auto",
        err[0],
    ), err


@pytest.mark.parametrize("damage", ["flip model.safetensors", "flip training_state.pt", "remove training_state.pt"])
def test_a_damaged_newest_point_is_skipped_named_and_kept(main, stopped, reference, tmp_path, damage):
    run = copy(stopped, tmp_path)
    action, name = damage.split()
    newest = run / "checkpoints" / "epoch_0002"
    flip(newest / name) if action == "flip" else (newest / name).unlink()
    before = snapshot(run)

    code, _, err = main(run)  # a plain rerun never starts over
    assert code == EXIT_USAGE and len(err) == 1, err
    assert "already holds a run (checkpoints/epoch_0001, checkpoints/epoch_0002)" in err[0]
    assert snapshot(run) == before

    if action == "flip" and name == WEIGHTS_FILE:
        code, _, err = main(run, "--eval-only", "--checkpoint", str(run))
        assert code == EXIT_DAMAGED and err == [
            f"error: {run}/checkpoints/epoch_0002/{name} is damaged: {name} does not match its sha256 (damaged); "
            "it was not loaded"
        ]

    code, out, err = main(run, "--resume", "auto")
    assert code == 0 and err == [], err
    why = "is missing" if action == "remove" else "does not match its sha256 (damaged)"
    assert f"skipped {newest} ({name} {why}); kept it as epoch_0002.damaged; resuming from epoch_0001" in out
    assert summary(run) == reference
    assert (run / "checkpoints" / "epoch_0002.damaged" / WEIGHTS_FILE).is_file()  # kept, not deleted


def test_renamed_points_are_never_deleted_and_resume_from_a_named_one(main, stopped, reference, tmp_path):
    run = copy(stopped, tmp_path)
    points = run / "checkpoints"
    for name in ("epoch_0001", "epoch_0002"):
        (points / name).rename(points / f"{name}.bak")  # last and best now dangle
    before = snapshot(run)

    code, _, err = main(run)
    assert code == EXIT_USAGE and len(err) == 1 and "checkpoints/epoch_0001.bak, checkpoints/epoch_0002.bak" in err[0]
    code, _, err = main(run, "--resume", "auto")
    assert code == EXIT_DAMAGED and len(err) == 1, err
    assert "holds checkpoints/epoch_0001.bak, checkpoints/epoch_0002.bak but no intact resume point" in err[0]
    assert f"--resume {run}/checkpoints/NAME" in err[0] and "nothing was changed" in err[0]
    assert snapshot(run) == before

    code, _, err = main(run, "--resume", str(points / "epoch_0002.bak"))
    assert code == 0 and err == [], err
    assert summary(run) == reference
    assert (points / "epoch_0001.bak" / STATE_FILE).is_file() and (points / "epoch_0002.bak" / STATE_FILE).is_file()


def test_a_foreign_training_state_is_one_line_never_advice_to_unpickle(main, tmp_path):
    point = tmp_path / "foreign"
    point.mkdir()
    (point / STATE_FILE).write_bytes(os.urandom(2048))
    torch.save({}, tmp_path / "x.pt")
    shutil.copy(tmp_path / "x.pt", point / WEIGHTS_FILE)  # not looked at: the state is read first
    code, _, err = main(tmp_path / "run", "--resume", str(point))
    assert code == EXIT_DAMAGED and err == [
        f"error: {point.resolve()}/{STATE_FILE} is not a training state this engine wrote (damaged or foreign); "
        "it was not loaded"
    ]
    assert not (tmp_path / "run").exists()


def half_line_then(code: int, log_name: str = "log.jsonl", at_epoch: int = 2):
    """An ``open`` for run_log that writes half of the chosen epoch's line into ``log_name``, then fails."""
    real, seen = open, []

    class HalfThenFail:
        def __init__(self, f, path):
            self.f, self.path = f, str(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise OSError(code, os.strerror(code), self.path)

    def failing_open(path, mode="r", *args, **kwargs):
        f = real(path, mode, *args, **kwargs)
        if "a" in mode and Path(path).name == log_name:
            seen.append(1)
            if len(seen) == at_epoch:
                return HalfThenFail(f, path)
        return f

    return failing_open


def test_disk_full_while_logging_leaves_no_half_line_and_resumes(main, reference, tmp_path, monkeypatch):
    output = tmp_path / "run"
    monkeypatch.setattr(run_log, "open", half_line_then(errno.ENOSPC), raising=False)
    code, _, err = main(output)
    monkeypatch.undo()
    assert code == EXIT_STORAGE and err == [
        f"error: writing {output}/log.jsonl failed (no space left on the device); "
        f"kept {output}/checkpoints/last (epoch 1); continue with --resume auto"
    ]
    assert (output / "log.jsonl").read_text().endswith("}\n") and not (output / ".lock").exists()
    code, _, err = main(output, "--resume", "auto")
    assert code == 0 and err == [] and summary(output) == reference


def test_read_only_output_mid_run_is_one_line_and_the_lock_is_stale_not_live(main, tmp_path, monkeypatch):
    output = tmp_path / "run"
    monkeypatch.setattr(run_log, "open", half_line_then(errno.EROFS, "summary.csv", at_epoch=1), raising=False)
    real_unlink = os.unlink

    def read_only_unlink(path, *args, **kwargs):
        if Path(path).name == ".lock":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(lock.os, "unlink", read_only_unlink)
    code, _, err = main(output)
    monkeypatch.undo()
    assert code == EXIT_STORAGE and err == [
        f"error: writing {output}/summary.csv failed (the file system is read-only); no checkpoint was written yet "
        f"in {output}; rerun the same command to start over"
    ]
    assert (output / ".lock").exists()  # left by the read-only disk: the next run takes it over as stale
    code, out, err = main(output, "--epochs", "1")
    assert code == 0 and "took over the stale lock" in out and not (output / ".lock").exists()


def test_output_removed_mid_run_is_one_line(main, tmp_path, monkeypatch):
    output = tmp_path / "run"
    real = run_log.RunLog.log_epoch

    def removed_first(self, record):
        shutil.rmtree(output)
        return real(self, record)

    monkeypatch.setattr(run_log.RunLog, "log_epoch", removed_first)
    code, _, err = main(output)
    assert code == EXIT_STORAGE and err == [
        f"error: writing {output}/summary.csv failed (the output directory or a file in it was removed); "
        f"no checkpoint was written yet in {output}; rerun the same command to start over"
    ]


def test_starting_on_a_full_disk_is_one_line_and_leaves_no_lock(main, tmp_path, monkeypatch):
    output = tmp_path / "run"
    monkeypatch.setattr(lock.os, "pwrite", no_space)
    code, _, err = main(output)
    assert code == EXIT_STORAGE and err == [
        f"error: starting the run failed: {output}: no space left on the device; nothing was written"
    ]
    assert not output.exists()


def sighup_after(steps: int):
    """epoch_batches for the trainer that sends this process SIGHUP (a closed terminal) after ``steps`` batches."""
    real = trainer.epoch_batches

    def batches(*args, **kwargs):
        for i, batch in enumerate(real(*args, **kwargs)):
            if i == steps:
                os.kill(os.getpid(), signal.SIGHUP)
            yield batch

    return batches


def test_sighup_stops_with_a_resume_point_and_changes_that_break_exactness_are_refused(
    main, reference, tmp_path, monkeypatch
):
    output = tmp_path / "run"
    monkeypatch.setattr(trainer, "epoch_batches", sighup_after(4))
    code, _, err = main(output)
    monkeypatch.undo()
    point = output / "checkpoints" / "epoch_0000_step_0000005"
    assert code == EXIT_REQUEUE and len(err) == 1 and err[0].startswith("preempted: stopped by SIGHUP after step 5")
    assert not (output / ".lock").exists() and load_training_state(point)["step"] == 5

    before = snapshot(output)
    for change, shown in [
        (["--batch-size", "32"], "--batch-size 16 -> 32"),
        (["--seed", "1"], "--seed 0 -> 1"),
        (["--train-fraction", "0.2"], "--train-fraction 0.1 -> 0.2"),
        (["--model-kwargs", "patch_size=2", "depth=3", "local_up_to_layer=1", "embed_dim=16"], "--model-kwargs"),
    ]:
        code, _, err = main(output, "--resume", "auto", *change)
        assert code == EXIT_USAGE and len(err) == 1 and "is a mid-epoch resume point (5 steps into epoch 1)" in err[0]
        assert shown in err[0] and "--accept-resume-changes" in err[0], err
    assert snapshot(output) == before

    accepted = tmp_path / "accepted"
    shutil.copytree(output, accepted, symlinks=True)
    code, out, err = main(accepted, "--resume", "auto", "--seed", "3", "--accept-resume-changes", "--epochs", "1")
    assert code == 0 and "--accept-resume-changes: continuing" in out
    assert '"resume_changes_accepted": "--seed 0 -> 3"' in (accepted / "log.jsonl").read_text().splitlines()[0]

    code, _, err = main(output, "--resume", "auto")
    assert code == 0 and err == [] and summary(output) == reference


# ---------------------------------------------------------------------- resume points, without training
def save_point(points: CheckpointDir, epoch: int, step: int = 0, is_best: bool = False) -> Path:
    model = torch.nn.Linear(3, 2)
    points.stage(epoch, step)
    best = {"epoch": 1}  # the training state records the best point (epoch 1 in these tests)
    return points.save(epoch, model.state_dict(), {"model": "m", "epoch": epoch, "best": best}, None, {}, is_best, step)


@pytest.mark.parametrize("where", ["save_file", "torch.save", "write_manifest", "rename", "link"])
def test_a_kill_during_each_stage_of_a_save_keeps_an_intact_newest_point(tmp_path, monkeypatch, where):
    points = CheckpointDir(tmp_path)
    first = save_point(points, 1, is_best=True)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    target = {
        "save_file": (checkpoint, "save_file"),
        "torch.save": (torch, "save"),
        "write_manifest": (checkpoint, "write_manifest"),
        "rename": (checkpoint.os, "rename"),
        "link": (CheckpointDir, "link"),
    }[where]
    monkeypatch.setattr(*target, killed)
    with pytest.raises(KeyboardInterrupt):
        save_point(points, 2)
    monkeypatch.undo()
    newest = "epoch_0002" if where == "link" else "epoch_0001"  # renamed into place, the link not yet swapped
    assert find_resume_point("auto", tmp_path).name == newest
    assert not list(points.root.glob(".*.tmp")) and first.is_dir()


@pytest.mark.parametrize(
    "error, reason",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "no space left on the device"),
        (OSError(errno.EROFS, "Read-only file system"), "the file system is read-only"),
        (RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos"), "RuntimeError: [enforce fail"),
    ],
)
def test_a_failed_write_is_a_storage_error_and_leaves_no_staging(tmp_path, monkeypatch, error, reason):
    points = CheckpointDir(tmp_path)
    save_point(points, 1)

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(torch, "save", fail)
    with pytest.raises(StorageError, match=re.escape(f"writing the resume point epoch_0002 failed ({reason}")):
        save_point(points, 2)
    assert sorted(p.name for p in points.root.iterdir()) == ["epoch_0001", "last"]


def test_a_failed_snapshot_write_is_a_storage_error(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "save_file", no_space)
    with pytest.raises(StorageError, match=r"writing the snapshot epoch_5.safetensors failed \(no space left"):
        CheckpointDir(tmp_path).save_snapshot(5, torch.nn.Linear(3, 2).state_dict(), {})
    assert list((tmp_path / "checkpoints").iterdir()) == []  # no temporary file left


def test_only_the_engines_own_superseded_points_are_deleted(tmp_path):
    points = CheckpointDir(tmp_path, keep=2)
    save_point(points, 1, is_best=True)
    save_point(points, 2)
    (points.root / "epoch_0002" / "notes.txt").write_text("a user's file")  # no longer provably the engine's
    (points.root / "epoch_0001_step_0000003.bak").mkdir()
    (points.root / "epoch_0001_step_0000003.bak" / WEIGHTS_FILE).write_bytes(b"user's")
    save_point(points, 2, step=4)
    save_point(points, 3)
    save_point(points, 4)
    held = sorted(p.name for p in points.root.iterdir())
    # the newest 2, best (epoch 1), the point holding a user's file, and what is not named as a point
    assert held == [
        "best",
        "epoch_0001",
        "epoch_0001_step_0000003.bak",
        "epoch_0002",
        "epoch_0003",
        "epoch_0004",
        "last",
    ]
    assert find_resume_point("auto", tmp_path).name == "epoch_0004"


def test_a_foreign_manifest_or_damaged_point_named_explicitly_is_refused(tmp_path):
    points = CheckpointDir(tmp_path)
    point = save_point(points, 1)
    state = load_training_state(point)
    torch.save(dict(state, epoch=5), point / STATE_FILE)
    with pytest.raises(DamagedCheckpointError, match=r"training_state.pt (has \d+ bytes|does not match)"):
        find_resume_point(str(point), tmp_path)
    write_manifest(point, 5, 0)  # a deliberate edit, re-checksummed: accepted
    assert find_resume_point(str(point), tmp_path) == point.resolve()
    (point / MANIFEST_FILE).write_text("not json")
    with pytest.raises(DamagedCheckpointError, match="manifest.json is unreadable"):
        find_resume_point(str(point), tmp_path)
