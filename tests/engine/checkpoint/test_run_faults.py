"""A run directory survives faults: nothing that may hold weights is deleted, damaged files are found by
their checksums, disk faults are one line with their own exit code, and `--resume auto` then finishes with
the numbers of the uninterrupted run wherever the fault left an intact resume point.

Faults are injected at the package's file-system calls (convbias.base.storage.FileSystem: safetensors' and
torch's writes, the log's appends, the lock's writes; the fixtures of tests/conftest.py) with the errno a full or
read-only disk gives: the tests run as root, whom chmod stops not.
"""

import csv
import errno
import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from support.faults import Fault, FaultyFileSystem, no_space
from support.runs import messages, save_point

from convbias.base import storage
from convbias.base.errors import (
    EXIT_DAMAGED,
    EXIT_REQUEUE,
    EXIT_STORAGE,
    EXIT_USAGE,
    DamagedCheckpointError,
    DamagedRunRecordError,
    StorageError,
)
from convbias.base.run_layout import MANIFEST_FILE
from convbias.base.weights import load_weights
from convbias.cli import train
from convbias.engine.checkpoint.points import STATE_FILE, WEIGHTS_FILE, CheckpointDir, write_manifest
from convbias.engine.checkpoint.resume import find_resume_point, load_training_state
from convbias.engine.loop.records import read_log
from convbias.engine.rundir.reader import RunDir

pytestmark = pytest.mark.usefixtures("single_thread")

# what a full disk is called in a message: the disk (its mount point) and its free space
DISK_FULL = r"no space left on the device: the disk at \S+ has [\d.]+ \w+ free"
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


@pytest.fixture(scope="module")
def finished(tmp_path_factory, args) -> Path:
    """The uninterrupted 3-epoch run."""
    output = tmp_path_factory.mktemp("faults") / "reference"
    train.run(args + ["--output", str(output)])
    return output


@pytest.fixture(scope="module")
def reference(finished):
    return summary(finished)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, args):
    """A run whose third resume point met a full disk (safetensors' write): epochs 1 and 2 are kept."""
    output = tmp_path_factory.mktemp("faults") / "stopped"
    with storage.using(FaultyFileSystem(Fault("save_safetensors", no_space(), at=3))):
        code = train.main(args + ["--output", str(output)])
    return output, code


def copy(stopped, tmp_path) -> Path:
    """A copy of a run (``stopped``, or a run dir) with its links as links."""
    output = tmp_path / "run"
    shutil.copytree(stopped[0] if isinstance(stopped, tuple) else stopped, output, symlinks=True)
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


def test_disk_full_message(main, tmp_path, disk_full):
    """The one line names the point, the reason, what is kept and how to resume."""
    output = tmp_path / "run"
    disk_full("save_safetensors", WEIGHTS_FILE, at=2, partial=True)
    code, _, err = main(output, "--epochs", "2")
    assert code == EXIT_STORAGE and len(err) == 1
    assert re.fullmatch(
        rf"error: writing the resume point epoch_0002 failed \({DISK_FULL}; this write needs about [\d.]+ \w+\); "
        rf"kept {re.escape(str(output))}/checkpoints/last \(epoch 1\); continue with --resume auto",
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


def test_disk_full_while_logging_leaves_no_half_line_and_resumes(main, reference, tmp_path, disk_full, file_faults):
    output = tmp_path / "run"
    disk_full("append_text", "log.jsonl", at=2, partial=True)  # half of epoch 2's line, then the disk is full
    code, _, err = main(output)
    file_faults.clear()
    assert code == EXIT_STORAGE and len(err) == 1
    assert re.fullmatch(
        rf"error: writing {re.escape(str(output))}/log.jsonl failed \({DISK_FULL}\); "
        rf"kept {re.escape(str(output))}/checkpoints/last \(epoch 1\); continue with --resume auto",
        err[0],
    ), err
    assert (output / "log.jsonl").read_text().endswith("}\n") and not (output / ".lock").exists()
    code, _, err = main(output, "--resume", "auto")
    assert code == 0 and err == [] and summary(output) == reference


def test_read_only_output_mid_run_is_one_line_and_the_lock_is_stale_not_live(main, tmp_path, read_only, file_faults):
    output = tmp_path / "run"
    read_only("append_text", "summary.csv", partial=True)  # half of epoch 1's row, then the disk is read-only
    read_only("unlink", ".lock")
    code, _, err = main(output)
    file_faults.clear()
    assert code == EXIT_STORAGE and err == [
        f"error: writing {output}/summary.csv failed (the file system is read-only); no checkpoint was written yet "
        f"in {output}; rerun the same command to start over"
    ]
    assert (output / ".lock").exists()  # left by the read-only disk: the next run takes it over as stale
    code, out, err = main(output, "--epochs", "1")
    assert code == 0 and "took over the stale lock" in out and not (output / ".lock").exists()


def test_output_removed_mid_run_is_one_line(main, tmp_path, file_faults):
    output = tmp_path / "run"
    file_faults.add(Fault("append_text", name="summary.csv", meanwhile=lambda path: shutil.rmtree(output)))
    code, _, err = main(output)
    assert code == EXIT_STORAGE and err == [
        f"error: writing {output}/summary.csv failed (the output directory or a file in it was removed); "
        f"no checkpoint was written yet in {output}; rerun the same command to start over"
    ]


def test_starting_on_a_full_disk_is_one_line_and_leaves_no_lock(main, tmp_path, disk_full):
    output = tmp_path / "run"
    disk_full("pwrite")  # the lock's record of its holder
    code, _, err = main(output)
    assert code == EXIT_STORAGE and len(err) == 1
    assert re.fullmatch(
        rf"error: starting the run failed: {re.escape(str(output))}: {DISK_FULL}; nothing was written", err[0]
    ), err
    assert not output.exists()


def test_sighup_stops_with_a_resume_point_and_changes_that_break_exactness_are_refused(
    main, reference, tmp_path, signal_after
):
    output = tmp_path / "run"
    with signal_after(signal.SIGHUP, batches=4):  # a closed terminal, during step 5
        code, _, err = main(output)
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
# where a save is killed: the FileSystem call, on which file
KILLED_IN = {
    "save_file": ("save_safetensors", WEIGHTS_FILE),
    "torch.save": ("save_torch", STATE_FILE),
    "write_manifest": ("write_text", MANIFEST_FILE),
    "rename": ("rename", "epoch_0002"),  # the staging folder renamed into place
    "link": ("replace", "last"),  # the new last link swapped in
}


@pytest.mark.parametrize("where", KILLED_IN)
def test_a_kill_during_each_stage_of_a_save_keeps_an_intact_newest_point(tmp_path, killed_at, file_faults, where):
    points = CheckpointDir(tmp_path)
    first = save_point(points, 1, is_best=True)
    killed_at(*KILLED_IN[where])
    with pytest.raises(KeyboardInterrupt):
        save_point(points, 2)
    file_faults.clear()
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
def test_a_failed_write_is_a_storage_error_and_leaves_no_staging(tmp_path, file_faults, error, reason):
    points = CheckpointDir(tmp_path)
    save_point(points, 1)
    file_faults.add(Fault("save_torch", error, partial=True))
    with pytest.raises(StorageError, match=re.escape(f"writing the resume point epoch_0002 failed ({reason}")):
        save_point(points, 2)
    assert sorted(p.name for p in points.root.iterdir()) == ["epoch_0001", "last"]


def test_a_failed_snapshot_write_is_a_storage_error(tmp_path, disk_full):
    disk_full("save_safetensors", partial=True)
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
    with pytest.raises(DamagedCheckpointError, match="manifest.json is not JSON"):
        find_resume_point(str(point), tmp_path)


# ------------------------------------------------------------------ links and bookkeeping follow the points
def test_deleting_the_best_link_never_deletes_the_best_point(tmp_path):
    points = CheckpointDir(tmp_path, keep=1)
    save_point(points, 1, is_best=True)  # every state records epoch 1 as the best
    (points.root / "best").unlink()
    for epoch in (2, 3, 4):
        save_point(points, epoch)
    assert sorted(p.name for p in points.points()) == ["epoch_0001", "epoch_0004"]
    assert RunDir(tmp_path).checkpoint("best").weights == points.root / "epoch_0001" / WEIGHTS_FILE
    assert RunDir(tmp_path).checkpoint("last").weights == points.root / "epoch_0004" / WEIGHTS_FILE


@pytest.mark.parametrize("link", ["removed", "dangling", "copied folder"])
def test_a_missing_dangling_or_copied_last_link_resumes_by_name_and_is_regenerated(
    main, stopped, reference, tmp_path, link
):
    run = copy(stopped, tmp_path)
    points = run / "checkpoints"
    (points / "last").unlink()
    if link == "dangling":
        (points / "last").symlink_to("epoch_0007")
    elif link == "copied folder":  # what `cp -rL` makes of a link
        shutil.copytree(points / "epoch_0002", points / "last")
    assert RunDir(run).checkpoint("last").epoch == 2  # by name, whatever the link

    code, out, err = main(run, "--resume", "auto")
    assert code == 0 and err == [], err
    state = {"removed": "missing", "dangling": "pointing at epoch_0007", "copied folder": "not a link"}[link]
    assert f"checkpoints/last was {state}: pointed it at epoch_0002, as the training state records" in out
    assert summary(run) == reference and os.readlink(points / "last") == "epoch_0003"
    assert not list(points.glob(".*"))  # no .last.tmp
    if link == "copied folder":
        assert "kept what was there as last.copy" in out and (points / "last.copy" / WEIGHTS_FILE).is_file()


def test_a_run_extended_and_killed_before_its_results_rewrites_them_from_the_point(
    main, finished, tmp_path, killed_at, file_faults
):
    run = copy(finished, tmp_path)
    three = json.loads((run / "results.json").read_text())
    killed_at("write_text", "results.json")
    code, _, _ = main(run, "--resume", "auto", "--epochs", "4")
    file_faults.clear()
    assert code == 130 and json.loads((run / "results.json").read_text()) == three
    assert (run / "checkpoints" / "epoch_0004").is_dir()
    assert RunDir(run).status() == "interrupted" and RunDir(run).current_results() is None  # never "done"

    code, out, err = main(run, "--resume", "auto", "--epochs", "4")
    assert code == 0 and err == [], err
    assert "results.json was stale (epoch 3); rewrote it from epoch 4's training state" in out
    results = RunDir(run).results()
    last = summary(run)[-1]
    assert results["epochs"] == 4 and results["final_top1"] == float(last[FIELDS.index("eval_top1")])
    assert RunDir(run).status() == "done"


@pytest.mark.parametrize("damage", ["truncated", "not json", "removed"])
def test_a_damaged_results_file_is_named_then_rewritten_from_the_point(main, finished, tmp_path, damage):
    run = copy(finished, tmp_path)
    results = run / "results.json"
    original = json.loads(results.read_text())
    if damage == "removed":
        results.unlink()
    else:
        results.write_bytes(results.read_bytes()[:40] if damage == "truncated" else b"\xff7\n")
        with pytest.raises(DamagedRunRecordError, match=re.escape(f"{results} is not readable")):
            RunDir(run).results()
    code, out, err = main(run, "--resume", "auto")
    assert code == 0 and err == [], err
    why = "missing" if damage == "removed" else "unreadable"
    assert f"results.json was {why}; rewrote it from epoch 3's training state" in out and "already finished" in out
    assert json.loads(results.read_text()) == original


@pytest.fixture(scope="module")
def ema_args(cli_argv) -> list[str]:
    """One epoch of the tiny ConViT with --model-ema: the EMA's evaluation is the epoch's metric."""
    return cli_argv(
        cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, batch_size=64, train_fraction=0.1, epochs=1, seed=0
    ) + ["--model-ema", "--no-diagnostics"]


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory, ema_args) -> Path:
    output = tmp_path_factory.mktemp("ema") / "run"
    train.run(ema_args + ["--output", str(output)])
    return output


@pytest.mark.parametrize(
    "recovery", ["removed", "removed, resumed without --model-ema", "killed before it was written", "rerun intact"]
)
def test_a_recovered_record_of_an_ema_run_is_the_one_the_run_wrote(
    ema_run, ema_args, tmp_path, recovery, killed_at, file_faults
):
    """--resume auto completes results.json from the training state: the whole record equals the uninterrupted
    run's (metric_of "ema": whose evaluations the state holds), whether the file was removed (and the resume
    given without --model-ema: the run's config.yaml says how it trained), the run killed after its last point
    and before the file, or the finished run resumed again (its intact record left as it is)."""
    uninterrupted = json.loads((ema_run / "results.json").read_text())
    assert uninterrupted["metric_of"] == "ema"
    run = tmp_path / "run"
    if recovery == "killed before it was written":
        killed_at("write_text", "results.json")
        assert train.main(ema_args + ["--output", str(run)]) == 130
        file_faults.clear()
        assert not (run / "results.json").exists() and (run / "checkpoints" / "epoch_0001").is_dir()
    else:
        shutil.copytree(ema_run, run, symlinks=True)
        if recovery.startswith("removed"):
            (run / "results.json").unlink()
    resume = [arg for arg in ema_args if arg != "--model-ema"] if "without" in recovery else ema_args
    assert train.main(resume + ["--output", str(run), "--resume", "auto"]) == 0
    assert json.loads((run / "results.json").read_text()) == uninterrupted


def test_damaged_log_lines_are_dropped_with_a_note_and_the_run_resumes(main, stopped, reference, tmp_path):
    run = copy(stopped, tmp_path)
    with open(run / "log.jsonl", "ab") as f:
        f.write(b"\xff\xfe not utf-8\n7\n")
    with open(run / "summary.csv", "ab") as f:
        f.write(b"2,\xff\xfe,,,,,,\n")
    code, out, err = main(run, "--resume", "auto")
    assert code == 0 and err == [], err
    assert f"dropped 2 damaged lines of {run}/log.jsonl (kept 2 epochs)" in out
    assert f"dropped 1 damaged line of {run}/summary.csv (kept 2 epochs)" in out
    assert summary(run) == reference
    records, dropped = read_log(run / "log.jsonl")
    assert dropped == 0 and [r["epoch"] for r in records] == [1, 2, 3]


@pytest.mark.parametrize("where", ["results.json", "config.yaml"])
def test_disk_full_at_the_bookkeeping_writes_is_one_line_and_resume_auto_finishes(
    main, reference, tmp_path, where, disk_full, file_faults
):
    output = tmp_path / "run"
    disk_full("write_text", where, partial=True)  # the disk fills while the file's temporary is being written
    code, _, err = main(output)
    file_faults.clear()
    assert code == EXIT_STORAGE and len(err) == 1 and re.search(DISK_FULL, err[0]), err
    assert not [p for p in output.rglob(".*") if p.name != ".lock"]  # no temporary left
    code, _, err = main(output, "--resume", "auto") if where == "results.json" else main(output)
    assert code == 0 and err == [], err
    assert summary(output) == reference and RunDir(output).status() == "done"


def test_a_pickled_object_is_one_line_never_advice_to_unpickle(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2, 3), "why": Path("a Python object")}, path)
    with pytest.raises(ValueError) as error:
        load_weights(torch.nn.Linear(3, 2), path)
    message = str(error.value)
    assert message.startswith(f"{path} cannot be read as weights with weights_only=True") and "\n" not in message
    assert "weights_only=False" not in message and "\x1b" not in message


def test_a_damaged_snapshot_is_refused_before_it_is_read(tmp_path):
    points = CheckpointDir(tmp_path)
    weights = torch.nn.Linear(64, 2).state_dict()
    path = points.save_snapshot(0, weights, {"epoch": "0"})
    assert RunDir(tmp_path).checkpoint("init").weights == path
    flip(path)
    with pytest.raises(DamagedCheckpointError, match=re.escape(f"{path} is damaged: it does not match its entry")):
        RunDir(tmp_path).checkpoint("init")
    (points.root / "snapshots.json").unlink()  # a snapshot written before the listing: it must at least read
    path.write_bytes(b"\x00" * 16)
    with pytest.raises(DamagedCheckpointError, match=re.escape(f"{path} is not a readable safetensors file")):
        RunDir(tmp_path).checkpoint("epoch_0")


@pytest.mark.parametrize("which", ["finished", "stopped"])
def test_a_resume_refuses_an_option_it_cannot_honour_and_records_nothing(main, finished, stopped, tmp_path, which):
    """--lr on a resume: the resumed optimizer and schedule keep the run's lr, so it is refused, not recorded."""
    run = copy(finished if which == "finished" else stopped, tmp_path)
    before = snapshot(run)
    code, _, err = main(run, "--resume", "auto", "--lr", "1e6", "--weight-decay", "0.5")
    assert code == EXIT_USAGE and len(err) == 1, err
    assert re.search(
        r"^error: --resume \S+: --lr 1000000\.0 \(the run: 0\.001\); --weight-decay 0\.5 \(the run: 0\.0\): a resumed "
        r"run keeps the optimizer and schedule of its resume point, so these would not apply; give the run's values",
        err[0],
    ), err
    assert snapshot(run) == before and "lr: 0.001" in (run / "config.yaml").read_text()
