"""The sweep under faults: it reads every run through RunDir, resumes what train.py can resume, leaves what it
cannot as it is (named with the command that resumes it), never reports a damaged or stale results.json as a
result, and a CSV it cannot write is one error line (exit 74) with no temporary file left."""

from __future__ import annotations

import csv
import errno
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from support.faults import Fault
from support.sweeps import TINY_SET, sweep_cli

from convbias.base.errors import DamagedInputError, StorageError
from convbias.base.tables import write_csv
from convbias.studies.regimes import study as regimes
from convbias.studies.sweep import spec as sweep_spec
from convbias.studies.sweep import sweep

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.integration, pytest.mark.slow]


def trained_sweep(tmp_path: Path, epochs: int, seeds: list[int]) -> tuple[Path, sweep.Sweep]:
    """A sweep file of the tiny recipe and its runs, trained in this process (a train.py subprocess costs
    seconds of start-up); the sweep's own command reruns them, its train.py in this process too (``TrainHere``
    of test_sweep; test_sweep's kill test runs the sweep's train.py as a subprocess)."""
    from convbias.cli import train

    sweep_file = tmp_path / "tiny.yaml"
    spec = {"set": {**TINY_SET, "epochs": epochs, "lr": 1e-3}, "grid": {"model": ["convit_tiny"], "seed": seeds}}
    sweep_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    prepared = sweep.Sweep.prepare(sweep_spec.load_spec(sweep_file), tmp_path / "sweep")
    for cmd in prepared.commands():
        train.run(cmd[3:])  # python -m convbias.cli.train ARGS
    return sweep_file, prepared


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every file's bytes and every link's target under ``root``, by relative path."""
    return {
        str(path.relative_to(root)): f"-> {os.readlink(path)}" if path.is_symlink() else path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_symlink() or path.is_file()
    }


def epochs_of(summary: Path) -> list[int]:
    with open(summary, newline="") as f:
        return [int(row["epoch"]) for row in csv.DictReader(f)]


# ----------------------------------------------------------------------------- runs train.py resumes or refuses


def test_a_run_whose_last_link_is_gone_or_dangling_is_resumed_and_nothing_is_removed(tmp_path):
    """Killed after its first point (results.json and the second point gone): one run's ``last`` link
    removed, the other's left dangling. Both are resumed, not taken for new runs and removed; their
    points and a user's folder in checkpoints/ survive."""
    sweep_file, prepared = trained_sweep(tmp_path, epochs=2, seeds=[0, 1])
    removed, dangling = (prepared.run_dir(run) for run in prepared.runs)
    for run in (removed, dangling):
        (run / "results.json").unlink()
        shutil.rmtree(run / "checkpoints" / "epoch_0002")
        (run / "checkpoints" / "epoch_0003.bak").mkdir()
        (run / "checkpoints" / "epoch_0003.bak" / "note.txt").write_text("kept by hand\n")
    (removed / "checkpoints" / "last").unlink()
    assert os.readlink(dangling / "checkpoints" / "last") == "epoch_0002"
    assert not (dangling / "checkpoints" / "last").exists()
    assert sweep.run_state(removed) == sweep.run_state(dangling) == "interrupted"
    before = {run: snapshot(run) for run in (removed, dangling)}

    done = sweep_cli("run", str(sweep_file), "--output", str(prepared.sweep_dir), train_here=True)

    assert done.returncode == 0, done.stdout + done.stderr
    assert "removed" not in done.stdout
    for index, run in enumerate((removed, dangling), 1):
        assert f"[{index}/2] {run.name}: resuming" in done.stdout
        assert "resumed from" in (prepared.sweep_dir / "logs" / f"{run.name}.log").read_text()
        after = snapshot(run)
        kept = [name for name in before[run] if not name.startswith("checkpoints/last")]
        assert all(name in after for name in kept), sorted(set(kept) - set(after))
        assert after["checkpoints/epoch_0003.bak/note.txt"] == b"kept by hand\n"
        assert sweep.run_state(run) == "done" and epochs_of(run / "summary.csv") == [1, 2]
        assert json.loads((run / "results.json").read_text())["epochs"] == 2
    with open(prepared.sweep_dir / "runs.csv", newline="") as f:
        assert sorted(row["run"] for row in csv.DictReader(f)) == sorted([removed.name, dangling.name])


def test_a_run_with_no_intact_point_is_left_in_place_and_named_with_its_resume_command(tmp_path):
    """The only point of the first run is damaged: train.py refuses it (exit 65); the sweep leaves every
    file of it as it was, names it with its resume command and the log's last line, finishes the second
    run, and exits 1 as for any failed run."""
    sweep_file, prepared = trained_sweep(tmp_path, epochs=1, seeds=[0, 1])
    damaged, other = (prepared.run_dir(run) for run in prepared.runs)
    for run in (damaged, other):
        (run / "results.json").unlink()  # both killed after their last point, before results.json
    state = damaged / "checkpoints" / "epoch_0001" / "training_state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(255 - b for b in data[len(data) // 2 : len(data) // 2 + 16])
    state.write_bytes(bytes(data))
    before = snapshot(damaged)

    done = sweep_cli("run", str(sweep_file), "--output", str(prepared.sweep_dir), train_here=True)

    assert done.returncode == 1, done.stdout + done.stderr
    assert snapshot(damaged) == before  # nothing removed, renamed or rewritten
    resume = shlex.join(sweep.command(sweep.train_args(prepared.runs[0], damaged, prepared.spec, prepared.known)))
    (failure,) = [line for line in done.stdout.splitlines() if "FAILED" in line]
    assert failure.startswith(f"[1/2] {damaged.name}: FAILED (exit 65, ")
    assert "no intact resume point" in failure and str(damaged) in failure
    assert failure.endswith(f"resume it with: {resume} (log: {prepared.sweep_dir / 'logs' / damaged.name}.log)")
    assert done.stderr.strip() == f"1 run(s) failed, left as they are: {damaged.name}"
    assert sweep.run_state(damaged) == "interrupted" and sweep.run_state(other) == "done"
    with open(prepared.sweep_dir / "runs.csv", newline="") as f:
        assert [row["run"] for row in csv.DictReader(f)] == [other.name]


# ----------------------------------------------------------------------------- collecting results


def fake_sweep(tmp_path: Path, seeds: list[int]) -> sweep.Sweep:
    """A recorded sweep of the tiny recipe whose runs hold a results.json of epoch 1 and nothing else."""
    spec = sweep_spec.normalize_spec({"set": TINY_SET, "grid": {"model": ["convit_tiny"], "seed": seeds}})
    prepared = sweep.Sweep.prepare(spec, tmp_path / "sweep")
    for run in prepared.runs:
        run_dir = prepared.run_dir(run)
        run_dir.mkdir(parents=True)
        results = dict(model="convit_tiny", train_fraction=1.0, seed=run.point["seed"], epochs=1)
        results.update(final_top1=50.0 + run.point["seed"], best_top1=51.0, best_epoch=1)
        (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return prepared


def test_a_damaged_or_stale_results_file_is_an_incomplete_run_naming_it(tmp_path):
    prepared = fake_sweep(tmp_path, seeds=[0, 1, 2])
    good, truncated, stale = (prepared.run_dir(run) for run in prepared.runs)
    (good / "checkpoints" / "epoch_0001").mkdir(parents=True)
    (good / "summary.csv").write_bytes(
        b"epoch,train_loss,eval_loss,eval_top1,eval_top5,lr,images_per_sec,epoch_seconds\n"
        b"1,2.3,2.2,50.0,90.0,0.001,100.0,1.25\n2,2.1,2.\xff\n"  # a second line cut short by a kill
    )
    text = (truncated / "results.json").read_text()
    (truncated / "results.json").write_text(text[: len(text) // 2])
    (stale / "checkpoints" / "epoch_0003").mkdir(parents=True)  # extended to 3 epochs, killed before results

    done = sweep_cli("collect", "--output", str(prepared.sweep_dir))

    assert done.returncode == 1 and "Traceback" not in done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "not complete" in line]
    assert line.startswith(f"2 of 3 runs are not complete: {truncated.name} ({truncated / 'results.json'} is not ")
    assert f"{stale.name} ({stale / 'results.json'} is older than the run's newest resume point epoch_0003" in line
    with open(prepared.sweep_dir / "runs.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["run"] == good.name and float(row["top1"]) == 50.0
    assert float(row["train_seconds"]) == 1.2  # the damaged line is skipped; round(1.25, 1)
    assert [sweep.run_state(run) for run in (good, truncated, stale)] == ["done", "new", "interrupted"]
    assert [Path(cmd[-3]).name for cmd in prepared.commands()] == [truncated.name, stale.name]


# ----------------------------------------------------------------------------- a full disk


def test_write_csv_on_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, disk_full):
    path = write_csv([{"a": 1}], tmp_path / "runs.csv")
    disk_full("write_text", "runs.csv", partial=True)  # a few bytes of the temporary, then the disk is full
    with pytest.raises(StorageError, match=rf"^writing {path} failed \(no space left on the device: the disk at "):
        write_csv([{"a": 2}], path)
    assert path.read_text() == "a\n1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["runs.csv"]  # no .runs.csv.tmpPID left


@pytest.mark.parametrize("name", [sweep.CSV_NAME, sweep.ENSEMBLES_CSV_NAME])
def test_sweep_csvs_on_a_full_disk_are_one_error_line_and_exit_74(tmp_path, disk_full, name):
    """Two trained seeds: runs.csv, then their ensemble's evaluation for ensembles.csv."""
    _, prepared = trained_sweep(tmp_path, epochs=1, seeds=[0, 1])
    disk_full("write_text", name, partial=True)

    done = sweep_cli("collect", "--output", str(prepared.sweep_dir))

    assert done.returncode == 74
    assert done.stderr.startswith(f"error: writing {prepared.sweep_dir / name} failed (no space left on the device")
    assert len(done.stderr.splitlines()) == 1
    assert not list(prepared.sweep_dir.glob(".*.tmp*"))


def test_a_run_log_that_cannot_be_written_is_named_before_the_run_starts(tmp_path, file_faults):
    """The sweep's own writes name their file: a folder where the run's log goes is no file the sweep wrote (65),
    an I/O error opening it a failed write (74)."""
    prepared = fake_sweep(tmp_path, seeds=[0])
    (run,) = prepared.runs
    (prepared.run_dir(run) / "results.json").unlink()  # not run yet
    log = prepared.sweep_dir / "logs" / f"{run.name}.log"
    log.mkdir(parents=True)
    with pytest.raises(DamagedInputError, match=rf"its file {re.escape(str(log))} is a folder, not a file"):
        prepared.execute(launcher=["false"], log=lambda line: None)
    log.rmdir()
    file_faults.add(Fault("open", OSError(errno.EIO, os.strerror(errno.EIO)), name=log.name))
    with pytest.raises(StorageError, match=rf"^writing {re.escape(str(log))} failed \(an I/O error of the device\)"):
        prepared.execute(launcher=["false"], log=lambda line: None)
    assert list(prepared.run_dir(run).iterdir()) == []  # no run was started


# ----------------------------------------------------------------------------- regimes


def test_last_evaluation_skips_damaged_log_lines(tmp_path):
    (tmp_path / "log.jsonl").write_bytes(
        b'7\n{"epoch": 1, "eval_top1": 40.0}\n\xff\xfe not utf-8\n{"epoch": 2, "eval_top1": 50.0}\n'
        b'{"epoch": 3, "train_loss": 1.0}\n{"epoch": 4, "eval_top1": 6'  # the last line cut short by a kill
    )
    assert regimes.last_evaluation(tmp_path) == {"epoch": 2, "eval_top1": 50.0}
    (tmp_path / "log.jsonl").write_bytes(b"7\n\xff\n")
    with pytest.raises(ValueError, match=r"log.jsonl holds no evaluation \(no record with eval_top1\) \(2 damaged"):
        regimes.last_evaluation(tmp_path)
