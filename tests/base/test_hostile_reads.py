"""Every file a command reads is untrusted: a run's config.yaml, a point's manifest.json, results.json, an
export folder (config.json and its weights), a class map, the entries of an image folder; and every option
value is checked where it is declared. Each case is one line with its exit code, naming the file and the key,
and nothing is written. The runs here are points written by ``CheckpointDir`` or one tiny trained run per
module."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from support.images import png
from support.runs import TINY_TRAIN_ARGS, Pickled, a_run, messages, one_line, run_train, tree

from convbias.base.errors import EXIT_DAMAGED, EXIT_USAGE, DamagedCheckpointError, DamagedInputError
from convbias.cli import diagnostics, export, predict, train
from convbias.engine.checkpoint.resume import find_resume_point
from convbias.engine.rundir.manifest import check_point
from convbias.studies.ensembles import command as ensemble
from convbias.studies.robustness import command as robustness
from convbias.studies.stability import command as stability

pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------------------- option values
@pytest.mark.parametrize(
    "options, refused",
    [
        (["--seed", "-1"], r"--seed must be in \[0, 2\*\*31\), got -1"),
        (["--seed", str(2**40)], r"--seed must be in \[0, 2\*\*31\), got 1099511627776"),
        (["--sched", "step", "--decay-epochs", "0"], r"--decay-epochs must be positive, got 0"),
        (["--opt", "sgd", "--momentum", "-1"], r"--momentum must be in \[0, 1\), got -1"),
        (["--sched", "step", "--decay-rate", "-0.5"], r"--decay-rate must be positive, got -0.5"),
        (["--lr-noise", "0.1", "--lr-noise-pct", "1.5"], r"--lr-noise-pct must be in \(0, 1\], got 1.5"),
        (["--hflip", "2"], r"--hflip must be in \[0, 1\], got 2"),
        (["--scale", "0", "1"], r"--scale must be two positive numbers, MIN <= MAX"),
        (["--save-epochs", "-1"], r"--save-epochs must be epochs >= 0"),
    ],
)
def test_an_option_value_out_of_its_declared_range_is_one_line(tmp_path, capsys, options, refused):
    code, err = run_train(capsys, *options, "--output", str(tmp_path / "run"))
    assert code == EXIT_USAGE
    one_line(err, rf"^error: {refused}")
    assert not (tmp_path / "run").exists()


def test_lr_noise_within_its_range_keeps_every_lr_positive():
    """timm multiplies the lr by 1 + a draw bounded by --lr-noise-pct: at most 1 keeps it positive, so the
    option's range is what makes a negative lr impossible (timm's own scheduler is the oracle)."""
    import torch
    from timm.scheduler import CosineLRScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    for pct, negative_possible in ((1.0, False), (3.0, True)):
        scheduler = CosineLRScheduler(
            optimizer, t_initial=200, noise_range_t=0, noise_pct=pct, noise_std=3.0, noise_seed=1
        )
        lrs = []
        for epoch in range(200):
            scheduler.step(epoch)
            lrs.append(optimizer.param_groups[0]["lr"])
        assert (min(lrs) < 0) == negative_possible


def test_a_negative_decay_rate_is_what_makes_timms_step_schedule_negative():
    """timm's step schedule is lr x decay_rate^(epoch // decay_epochs): a negative --decay-rate flips the lr's
    sign every decay, and --decay-epochs 0 divides by zero; the declared ranges refuse both."""
    import torch
    from timm.scheduler import StepLRScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = StepLRScheduler(optimizer, decay_t=1, decay_rate=-0.5)
    scheduler.step(1)
    assert optimizer.param_groups[0]["lr"] == -0.5
    with pytest.raises(ZeroDivisionError):
        StepLRScheduler(optimizer, decay_t=0, decay_rate=0.1).step(1)


@pytest.mark.parametrize(
    "environment, present",
    [({"WORLD_SIZE": "2"}, "WORLD_SIZE=2"), ({"LOCAL_RANK": "0"}, "LOCAL_RANK=0"), ({"WORLD_SIZE": "x"}, None)],
)
def test_launcher_variables_without_a_launcher_say_what_to_run(tmp_path, capsys, monkeypatch, environment, present):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    code, err = run_train(capsys, "--output", str(tmp_path / "run"))
    assert code == EXIT_USAGE
    if present is None:
        one_line(err, r"^error: WORLD_SIZE='x' in the environment: expected the number of processes")
    else:
        one_line(err, rf"^error: the environment holds {present} but not .*MASTER_ADDR.*convbias-launch")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------ one tiny run and its export
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """One epoch of a 2-block ConViT of width 8 on 8x8 digits, its export, and an image to label."""
    root = tmp_path_factory.mktemp("reads")
    run = root / "run"
    argv = [*TINY_TRAIN_ARGS, "--train-fraction", "0.1", "--batch-size", "64", "--output", str(run)]
    assert train.main(argv) == 0
    assert export.main([str(run), "--output", str(root / "exported")]) == 0
    png(root / "img.png")
    return {"run": run, "exported": root / "exported", "image": root / "img.png"}


def copied(trained, tmp_path) -> dict[str, Path]:
    """A fresh copy of the run and the export, for one test to damage."""
    run, exported = tmp_path / "run", tmp_path / "exported"
    shutil.copytree(trained["run"], run, symlinks=True)
    shutil.copytree(trained["exported"], exported, symlinks=True)
    return {"run": run, "exported": exported, "image": trained["image"], "out": tmp_path / "out"}


def edit_yaml(path: Path, **changes) -> None:
    lines = path.read_text().splitlines()
    for key, value in changes.items():
        lines = [f"{key}: {value}" if line.startswith(f"{key}:") else line for line in lines]
    path.write_text("\n".join(lines) + "\n")


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def newest_point(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("epoch_*[0-9]"))[-1]


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def fifo_in_place_of(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def empty_manifest_and_flipped_weights(files) -> Path:
    point = newest_point(files["run"])
    edit_json(point / "manifest.json", files={})
    flip_a_byte(point / "model.safetensors")
    return point / "manifest.json"


def weights_of_the_export(files, change) -> Path:
    from safetensors.torch import load_file, save_file

    path = files["exported"] / "model.safetensors"
    save_file({key: change(value) for key, value in load_file(str(path)).items()}, str(path))
    return path


def class_map_that_is(files, target: str) -> Path:
    """The run's config.yaml naming a class map that is a FIFO or a link to /dev/zero."""
    path = files["run"].parent / "classes.txt"
    if target == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    edit_yaml(files["run"] / "config.yaml", class_map=str(path))
    return path


# Each damage: what it does to the copies, and the file the one line must name (returned)
DAMAGES = {
    "config value": lambda f: edit_yaml(f["run"] / "config.yaml", img_size="abc") or f["run"] / "config.yaml",
    "config key": lambda f: edit_yaml(f["run"] / "config.yaml", lr="[1, 2]") or f["run"] / "config.yaml",
    "config fifo": lambda f: fifo_in_place_of(f["run"] / "config.yaml") or f["run"] / "config.yaml",
    "manifest empty": empty_manifest_and_flipped_weights,
    "manifest field": lambda f: (
        edit_json(newest_point(f["run"]) / "manifest.json", best_epoch="abc")
        or newest_point(f["run"]) / "manifest.json"
    ),
    "manifest fifo": lambda f: (
        fifo_in_place_of(newest_point(f["run"]) / "manifest.json") or newest_point(f["run"]) / "manifest.json"
    ),
    "results field": lambda f: edit_json(f["run"] / "results.json", final_top1="high") or f["run"] / "results.json",
    "class map fifo": lambda f: class_map_that_is(f, "fifo"),
    "class map /dev/zero": lambda f: class_map_that_is(f, "zero"),
    "export architecture": lambda f: (
        edit_json(f["exported"] / "config.json", architecture="resnet_nothing") or f["exported"] / "config.json"
    ),
    "export model_args": lambda f: (
        edit_json(f["exported"] / "config.json", model_args={"no_such_arg": 1}) or f["exported"] / "config.json"
    ),
    "export shapes": lambda f: edit_json(f["exported"] / "config.json", num_classes=3) or f["exported"] / "config.json",
    "export fifo": lambda f: fifo_in_place_of(f["exported"] / "config.json") or f["exported"] / "config.json",
    "export nan": lambda f: weights_of_the_export(f, lambda t: torch.full_like(t, float("nan"))),
    "export int32": lambda f: weights_of_the_export(f, lambda t: t.to(torch.int32)),
}
# Each command that reads what a damage damages
COMMANDS = {
    "predict": lambda f: (predict.main, [str(f["run"]), str(f["image"]), "--output", str(f["out"]) + ".csv"]),
    "predict best": lambda f: (
        predict.main,
        [str(f["run"]), str(f["image"]), "--which", "best", "--output", str(f["out"]) + ".csv"],
    ),
    "predict export": lambda f: (
        predict.main,
        [str(f["exported"]), str(f["image"]), "--output", str(f["out"]) + ".csv"],
    ),
    "export": lambda f: (export.main, [str(f["run"]), "--output", str(f["out"])]),
    "eval-only": lambda f: (train.main, ["--eval-only", str(f["run"]), "--workers", "0", "--output", str(f["out"])]),
    "resume": lambda f: (
        train.main,
        [*TINY_TRAIN_ARGS, "--resume", str(newest_point(f["run"])), "--output", str(f["out"])],
    ),
    "ensemble": lambda f: (ensemble.main, [str(f["run"]), str(f["run"]), "--output", str(f["out"]) + ".json"]),
    "robustness": lambda f: (
        robustness.main,
        [str(f["run"]), "--max-images", "4", "--workers", "0", "--output", str(f["out"])],
    ),
    "stability": lambda f: (stability.main, [str(f["run"]), "--images", "2", "--output", str(f["out"])]),
    "diagnostics": lambda f: (diagnostics.main, [str(f["run"]), "--image", str(f["image"]), "--output", str(f["out"])]),
}
CASES = [
    *[(c, d, 65) for c in COMMANDS if c not in ("predict export", "resume") for d in ("config value", "config key")],
    *[(c, "config fifo", 65) for c in ("predict", "export", "eval-only", "ensemble", "robustness", "stability")],
    *[(c, "manifest empty", 65) for c in ("predict", "export", "eval-only", "resume", "ensemble", "robustness")],
    ("predict best", "manifest field", 65),
    ("predict", "manifest fifo", 65),
    ("resume", "manifest fifo", 65),
    ("export", "results field", 65),
    ("eval-only", "class map fifo", 2),
    ("eval-only", "class map /dev/zero", 2),
    *[
        ("predict export", d, 65)
        for d in (
            "export architecture",
            "export model_args",
            "export shapes",
            "export fifo",
            "export nan",
            "export int32",
        )
    ],
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command, damage, code", CASES, ids=[f"{c}-{d}" for c, d, _ in CASES])
def test_every_reader_of_a_damaged_or_special_file_is_one_line_naming_it(
    trained, tmp_path, capsys, command, damage, code
):
    files = copied(trained, tmp_path)
    named = DAMAGES[damage](files)
    before = {key: tree(files[key]) for key in ("run", "exported")}
    main, argv = COMMANDS[command](files)
    capsys.readouterr()
    assert main(argv) == code
    err = messages(capsys.readouterr().err)
    err = [line for line in err if not line.startswith("warning:")]
    one_line(err, rf"^error: .*{re.escape(str(named))}")
    assert {key: tree(files[key]) for key in ("run", "exported")} == before
    assert not list(tmp_path.glob("out*"))


# ------------------------------------------------------------------------------------ the cases
def test_resume_auto_never_takes_a_point_whose_manifest_lists_nothing(tmp_path):
    """A manifest that lists no files verifies nothing: the point, whose weights have a flipped byte, is
    skipped as damaged and the one before it resumed."""
    run = a_run(tmp_path / "run", points=2)
    point = run / "checkpoints" / "epoch_0002"
    (point / "manifest.json").write_text(json.dumps({"epoch": 2, "step": 0, "best_epoch": 1, "files": {}}))
    flip_a_byte(point / "model.safetensors")
    assert find_resume_point("auto", run).name == "epoch_0001"
    problem = check_point(point)
    assert problem is not None and "files: expected the point's files" in problem
    with pytest.raises(DamagedCheckpointError, match=r"epoch_0002/manifest.json: files"):
        find_resume_point(str(point), run)


def test_a_manifest_that_omits_a_file_the_resume_loads_vouches_for_nothing(tmp_path):
    run = a_run(tmp_path / "run", points=1)
    point = run / "checkpoints" / "epoch_0001"
    manifest = json.loads((point / "manifest.json").read_text())
    del manifest["files"]["model.safetensors"]
    (point / "manifest.json").write_text(json.dumps(manifest))
    flip_a_byte(point / "model.safetensors")
    assert check_point(point) == "model.safetensors is not in its manifest.json"
    assert find_resume_point("auto", run) is None


def folder_data(root: Path) -> Path:
    for split in ("train", "validation"):
        for label, name in enumerate(("cat", "dog")):
            for index in range(4):
                png(root / split / name / f"{index}.png", 60 * label + index)
    return root


def test_a_fifo_among_the_images_is_refused_at_the_scan_before_training(tmp_path, capsys):
    data = folder_data(tmp_path / "data")
    os.mkfifo(data / "train" / "dog" / "zz.png")
    argv = ["--dataset", "folder", "--data-dir", str(data), "--batch-size", "3", "--output", str(tmp_path / "run")]
    code, err = run_train(capsys, *argv)
    assert code == EXIT_DAMAGED
    one_line(err, rf"^error: {data}/train/dog/zz.png is a named pipe \(FIFO\), not an image file")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_a_class_map_that_is_a_fifo_or_a_link_to_a_device_is_refused_unread(tmp_path, capsys, special):
    path = tmp_path / "classes.txt"
    os.mkfifo(path) if special == "fifo" else path.symlink_to("/dev/zero")
    kind = r"a named pipe \(FIFO\)" if special == "fifo" else "a character device"
    code, err = run_train(capsys, "--class-map", str(path), "--output", str(tmp_path / "run"))
    assert code == EXIT_USAGE
    one_line(err, rf"^error: --class-map {path} is {kind}, not a regular file; it was not read")
    assert not (tmp_path / "run").exists()


def test_an_efcn_cnn_checkpoint_that_is_a_pickle_is_exit_65_in_train(tmp_path, capsys):
    path = tmp_path / "cnn.pt"
    torch.save({"w": Pickled()}, path)
    argv = ["--model", "efcn_vanilla_cnn", "--model-kwargs", f"cnn_checkpoint={path}", "channels=2", "depth=1"]
    argv += ["--img-size", "8", "--dataset", "digits", "--epochs", "1", "--warmup-epochs", "0", "--workers", "0"]
    assert train.main([*argv, "--output", str(tmp_path / "run")]) == EXIT_DAMAGED
    one_line(messages(capsys.readouterr().err), rf"^error: .*{path} cannot be read as weights with weights_only=True")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("command", ["predict", "export", "eval-only"])
def test_a_run_config_value_is_named_by_its_file_and_key_not_by_an_option(trained, tmp_path, capsys, command):
    files = copied(trained, tmp_path)
    edit_yaml(files["run"] / "config.yaml", img_size="abc")
    main, argv = COMMANDS[command](files)
    assert main(argv) == EXIT_DAMAGED
    one_line(
        messages(capsys.readouterr().err),
        rf"^error: {files['run']}/config.yaml: img_size expects int, got 'abc'$",
    )


@pytest.mark.parametrize(
    "reader, declared, checked",
    [
        ("convbias.studies.phase_diagram.study:read_cells", "CELL_COLUMNS", ("width", "alpha_tilde", "seeds")),
        ("convbias.studies.efcn_protocol.seeds:_read_csv", None, ("relax_time", "final_test_acc", "deviation_total")),
        ("convbias.studies.stability.study:read_rows", "ROW_COLUMNS", ("seed", "images", "draws")),
    ],
)
def test_a_results_table_a_command_wrote_is_read_back_and_a_damaged_cell_named(tmp_path, reader, declared, checked):
    """The studies read their own CSVs back through base.tables.read_csv with the columns their writers declare:
    the numbers as written; a cell that is no number (a table edited by hand or cut short) is one
    DamagedInputError naming the file, line and column; a FIFO in its place is refused unread."""
    import importlib

    module, name = reader.split(":")
    read = getattr(importlib.import_module(module), name)
    columns = list(getattr(importlib.import_module(module), declared)) if declared else list(checked)
    table = tmp_path / "table.csv"

    def write(*rows: tuple[str, ...]) -> None:
        cells = [{c: "1" for c in columns} | dict(zip(checked, row)) for row in rows]
        table.write_text(",".join(columns) + "\n" + "".join(",".join(r[c] for c in columns) + "\n" for r in cells))

    write(("1", "2", "3"), ("5", "6", "7"))
    assert [[row[c] for c in checked] for row in read(table)] == [[1, 2, 3], [5, 6, 7]]
    write(("1", "2", "3"), ("5", "six", "7"))
    with pytest.raises(
        DamagedInputError, match=re.escape(f"{table}: line 3, column {checked[1]}: unexpected value six")
    ):
        read(table)
    table.unlink()
    os.mkfifo(table)
    with pytest.raises(DamagedInputError, match="not a regular file"):
        read(table)
