"""Inputs and folders a user did not make for the engine: symlinks, half-loaded weights, the user's own files,
damaged or hostile recipes and logs. Each link, file or folder is made in a temporary directory; each test
checks the outcome is one line with its exit code, that nothing of the user's is replaced and that nothing
outside the run is written. No test here trains: the runs are points written by ``CheckpointDir``."""

import errno
import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from support.images import png
from support.runs import TINY_TRAIN_ARGS, Pickled, a_run, messages, one_line, run_train, save_point, tree

from convbias.base import inputs
from convbias.base.errors import (
    EXIT_DAMAGED,
    EXIT_INTERRUPTED,
    EXIT_STORAGE,
    EXIT_USAGE,
    ConfigError,
    DamagedInputError,
)
from convbias.base.run_layout import CONFIG_MARKER
from convbias.base.storage import write_failure
from convbias.base.weights import load_weights
from convbias.cli import diagnostics, export, launch, predict, train
from convbias.engine import parse_config
from convbias.engine.checkpoint.points import CheckpointDir
from convbias.engine.config.parsing import load_yaml
from convbias.engine.data import datasets
from convbias.engine.loop.records import read_log
from convbias.engine.model import factory as modeling
from convbias.engine.rundir import lock
from convbias.studies.efcn_protocol import command as efcn_protocol
from convbias.studies.ensembles import command as ensemble
from convbias.studies.phase_diagram import command as phase_diagram
from convbias.studies.regimes import command as regimes
from convbias.studies.robustness import command as robustness
from convbias.studies.stability import command as stability
from convbias.studies.stability import contrasts_command as stability_contrasts
from convbias.studies.sweep import command as sweep

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_folder_scan_follows_no_loop_and_counts_each_file_once(tmp_path, monkeypatch, capsys):
    train_dir = tmp_path / "data" / "train"
    for name, value in (("cat/a.png", 0), ("cat/b.png", 1), ("dog/c.png", 2), ("dog/d.png", 3)):
        png(train_dir / name, value)
    (train_dir / "cat" / "loop").symlink_to(".")  # a loop: the scan used to hang here
    (train_dir / "cat" / "dogs").symlink_to("../dog")  # a sibling class: its images counted twice
    (train_dir / "cat" / "0-dog.png").symlink_to("../dog/c.png")  # a file reached twice, first from cat
    (train_dir / "dog" / "again.png").symlink_to("../cat/a.png")  # a file reached twice
    monkeypatch.setattr(datasets, "SCAN_PROGRESS_SECONDS", 0.0)  # every folder is "long": progress is said
    with pytest.warns(UserWarning) as said:
        found = datasets.ImageFolderDataset.scan(train_dir, "layout")
    assert sorted((os.path.basename(p), t) for p, t in found.samples) == [
        ("a.png", 0),
        ("b.png", 0),
        ("c.png", 1),
        ("d.png", 1),
    ]
    warning = str(said[0].message)
    assert "did not follow 2 links to folders inside class folders" in warning
    assert f"{train_dir}/cat/dogs -> ../dog" in warning and "counted once 2 image files" in warning
    assert f"{train_dir}/cat/0-dog.png -> ../dog/c.png" in warning  # c.png stays a dog
    assert re.search(rf"scanning {train_dir}: \d+ image files so far", capsys.readouterr().err)


# ------------------------------------------------------------------------------ 2. writes through links
def test_a_lock_file_that_is_a_link_is_never_written_through(tmp_path, capsys):
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's file")
    output = tmp_path / "run"
    output.mkdir()
    (output / ".lock").symlink_to(mine)
    with pytest.raises(lock.ForeignLockError, match="is a symbolic link"):
        lock.RunLock(output).acquire()
    code, err = run_train(capsys, "--output", str(output))
    assert code == EXIT_DAMAGED
    one_line(err, rf"{output}/.lock is a symbolic link \(to {mine}\), not a lock file of train.py")
    assert mine.read_text() == "the user's file" and sorted(p.name for p in output.iterdir()) == [".lock"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "hard link"])
def test_a_lock_file_that_is_a_fifo_or_a_hard_link_is_never_read_or_written_through(tmp_path, capsys, kind):
    """A FIFO would block the lock's read of its holder (train.py hung silently); a hard link to another run's
    results.json would be emptied to record the holder."""
    output = tmp_path / "run"
    output.mkdir()
    if kind == "fifo":
        os.mkfifo(output / ".lock")
        described = r"a named pipe \(FIFO\)"
    else:
        (tmp_path / "results.json").write_text('{"model": "convit_tiny"}\n')
        os.link(tmp_path / "results.json", output / ".lock")
        described = r"a hard link \(2 names for one file\)"
    before = tree(tmp_path)
    code, err = run_train(capsys, "--output", str(output))
    assert code == EXIT_DAMAGED
    one_line(err, rf"{output}/.lock is {described}, not a lock file of train.py; nothing was read from or written")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("name", ["log.jsonl", "summary.csv", "config.yaml", "results.json"])
def test_a_log_or_results_file_that_is_a_link_is_refused_naming_it(tmp_path, capsys, name):
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's file")
    output = a_run(tmp_path / "run") if name != "config.yaml" else tmp_path / "run"
    output.mkdir(exist_ok=True)
    (output / name).symlink_to(mine)
    before = tree(output)
    code, err = run_train(capsys, "--output", str(output), "--resume", "auto")
    assert code == EXIT_DAMAGED
    one_line(err, rf"--output {output}: {output}/{name} -> {mine} is a symbolic link that train.py did not make")
    assert mine.read_text() == "the user's file" and tree(output) == before


def test_a_staging_folder_that_is_a_link_is_removed_not_written_through(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    points = CheckpointDir(tmp_path / "run")
    points.root.mkdir(parents=True)
    (points.root / ".epoch_0001.tmp").symlink_to(elsewhere)
    save_point(points, 1)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"] and (points.root / "epoch_0001").is_dir()


def test_a_point_that_is_a_link_is_named_never_resumed_or_replaced(tmp_path, capsys):
    output = a_run(tmp_path / "run", points=2)
    elsewhere = tmp_path / "copy"
    (output / "checkpoints" / "epoch_0002").rename(elsewhere)
    (output / "checkpoints" / "epoch_0002").symlink_to(elsewhere)
    before, copied = tree(output), tree(elsewhere)
    code, err = run_train(capsys, "--output", str(output), "--resume", "auto")
    assert code == EXIT_DAMAGED
    one_line(err, rf"checkpoints/epoch_0002 -> {elsewhere} is a symbolic link that train.py did not make")
    assert tree(output) == before and tree(elsewhere) == copied
    png(tmp_path / "img.png")  # every reader of the run names it too, rather than take an older point
    assert predict.main([str(output), str(tmp_path / "img.png")]) == EXIT_DAMAGED
    one_line(
        messages(capsys.readouterr().err), rf"{output}/checkpoints/epoch_0002 is a symbolic link \(to {elsewhere}\)"
    )
    # a link that appears in a point's place while a run saves is set aside, never deleted through
    points = CheckpointDir(output)
    save_point(points, 2)
    assert (output / "checkpoints" / "epoch_0002.link").is_symlink() and tree(elsewhere) == copied


# ----------------------------------------------------------------------------- 3. the user's own files
@pytest.mark.parametrize(
    "files, first",
    [
        ({"config.yaml": "lr: 0.1\n", "notes.txt": "mine"}, r"config.yaml \(not as train.py writes it\)"),
        ({"summary.csv": "name,score\nx,1\n"}, r"summary.csv \(not as train.py writes it\)"),
        ({"log.jsonl": "my notes\n"}, r"log.jsonl \(not as train.py writes it\)"),
        ({"config.yaml": f"{CONFIG_MARKER}\nmodel: m\n", "notes.txt": "mine"}, r"notes.txt \(not a file train.py"),
        ({"checkpoints/photos.txt": "mine"}, r"checkpoints \(beside no run config\)"),
    ],
)
def test_a_folder_is_started_over_only_when_every_entry_is_the_engines(tmp_path, capsys, files, first):
    output = tmp_path / "mine"
    for name, text in files.items():
        (output / name).parent.mkdir(parents=True, exist_ok=True)
        (output / name).write_text(text)
    before = tree(output)
    for resume in ([], ["--resume", "auto"]):
        code, err = run_train(capsys, "--output", str(output), *resume)
        assert code == EXIT_DAMAGED, err
        one_line(err, rf"^error: --output {output} is not a run of train.py: it holds {first}")
        assert "damaged" not in err[0] and tree(output) == before


def test_no_command_writes_its_output_onto_a_file_of_a_run(tmp_path, capsys):
    run = a_run(tmp_path / "run")
    (run / "results.json").write_text("{}")
    png(tmp_path / "img.png")
    before = tree(run)
    targets = [run / "results.json", run / "checkpoints" / "epoch_0001" / "manifest.json", run / "log.jsonl"]
    for target in targets[:2]:
        assert predict.main([str(run), str(tmp_path / "img.png"), "--output", str(target.with_suffix(".json"))]) == 2
        one_line(messages(capsys.readouterr().err), rf"--output {target.with_suffix('.json')} is a file of the run")
    assert ensemble.main([str(run), str(run), "--output", str(targets[2])]) == EXIT_USAGE
    one_line(messages(capsys.readouterr().err), rf"--output {targets[2]} is a file of the run {run}")
    assert export.main([str(run), "--output", str(run / "checkpoints" / "exported")]) == EXIT_USAGE
    one_line(messages(capsys.readouterr().err), rf"--output {run}/checkpoints/exported is a file of the run")
    assert tree(run) == before


# ------------------------------------------------------------------------------------------ 4. weights
@pytest.fixture
def tiny_model():
    from convbias.families import load_families

    load_families()
    return lambda **options: parse_config([*TINY_TRAIN_ARGS, *[str(item) for pair in options.items() for item in pair]])


def test_a_partial_pretrained_file_is_listed_and_needs_allow_partial(tmp_path, tiny_model):
    cfg = tiny_model()
    full = modeling.create_model(cfg, 10, 1).state_dict()
    half = {k: v for i, (k, v) in enumerate(full.items()) if i % 2 or k.startswith("head")}
    path = tmp_path / "half.pt"
    torch.save(half, path)
    cfg = tiny_model(**{"--pretrained-file": path, "--num-classes": 10})
    missing = len(full) - len(half)
    with pytest.raises(ConfigError, match=rf"{path} loaded partially: {missing} missing keys, left at their init"):
        modeling.create_model(cfg, 10, 1)
    with pytest.warns(UserWarning, match=rf"--allow-partial: {path} loaded partially: {missing} missing keys"):
        model = modeling.create_model(cfg.replace(allow_partial=True), 10, 1)
    # what the file holds is loaded (but the head: timm resets it for classes other than its pretrained cfg's)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in half.items() if not k.startswith("head"))


@pytest.mark.parametrize("damage", ["int64", "bool", "nan", "inf"])
def test_integer_or_non_finite_weights_are_refused_at_load(tmp_path, tiny_model, damage):
    model = modeling.create_model(tiny_model(), 10, 1)
    weights = model.state_dict()
    key = "blocks.0.mlp.fc1.weight"
    if damage in ("int64", "bool"):
        weights[key] = weights[key].to(getattr(torch, damage))
        pattern = rf"non-float tensors for float weights of the model: {key} \({damage}\)"
    else:
        weights[key][0, 0] = float(damage)
        pattern = rf"non-finite values \(NaN or infinity\) in 1 tensors: {key}"
    path = tmp_path / "weights.pt"
    torch.save(weights, path)
    with pytest.raises(DamagedInputError, match=pattern):
        load_weights(model, path)  # --checkpoint, --eval-only, a resume: the engine's own load
    with pytest.raises(DamagedInputError, match=pattern):  # --pretrained-file: timm's load
        modeling.create_model(tiny_model(**{"--pretrained-file": path, "--num-classes": 10}), 10, 1)
    cfg = tiny_model(**{"--num-classes": 10})
    for pretrained, route in (  # the files timm.create_model's own arguments name, given as --model-kwargs
        (False, dict(checkpoint_path=str(path))),
        (True, dict(pretrained_cfg_overlay=dict(file=str(path)))),
        (True, dict(pretrained_cfg=dict(file=str(path)))),
    ):
        routed = cfg.replace(pretrained=pretrained, model_kwargs={**cfg.model_kwargs, **route})
        with pytest.raises(DamagedInputError, match=pattern):
            modeling.create_model(routed, 10, 1)


def test_weights_a_family_argument_has_timm_load_are_checked(tmp_path, tiny_model):
    """An eFCN's cnn_checkpoint=FILE (the families registered by ``tiny_model``): timm's pretrained loading reads it
    inside the family's builder; the model it built is refused when the file gave it non-finite weights."""
    import timm

    from convbias.engine import Config

    cnn = timm.create_model("vanilla_cnn", channels=4, img_size=8, num_classes=10, in_chans=1).state_dict()
    cnn["conv1.weight"][0] = float("nan")
    torch.save(cnn, tmp_path / "cnn.pt")
    cfg = Config(model="efcn_vanilla_cnn", model_kwargs=dict(channels=4, cnn_checkpoint=str(tmp_path / "cnn.pt")))
    with pytest.raises(DamagedInputError, match=r"cnn\.pt \(as efcn_vanilla_cnn's weights\) holds non-finite .*conv1"):
        modeling.create_model(cfg.replace(img_size=8), 10, 1)


class Executes:
    """A pickle that writes ``marker`` when it is loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "executed"))


@pytest.mark.parametrize("damage", ["nan", "pickle"])
def test_model_kwargs_checkpoint_path_goes_through_the_weights_checks(tmp_path, capsys, tiny_model, damage):
    """timm.create_model(checkpoint_path=FILE) given as --model-kwargs: checked as --checkpoint FILE is (exit 65
    naming the tensors; a pickle refused unexecuted), not handed to timm's loader."""
    weights = modeling.create_model(tiny_model(), 10, 1).state_dict()
    path, marker = tmp_path / "weights.pt", tmp_path / "executed"
    if damage == "nan":
        for key in ("blocks.0.mlp.fc1.weight", "head.bias"):
            weights[key][0] = float("nan")
        torch.save(weights, path)
        expected = r"non-finite values \(NaN or infinity\) in 2 tensors: .*blocks\.0\.mlp\.fc1\.weight"
    else:
        torch.save({"state_dict": weights, "extra": Executes(marker)}, path)
        expected = rf"--model-kwargs checkpoint_path: {re.escape(str(path))} cannot be read as weights .*not unpickled"
    kwargs = TINY_TRAIN_ARGS.index("--model-kwargs") + 1
    argv = [
        *TINY_TRAIN_ARGS[: kwargs + 4],
        f"checkpoint_path={path}",
        *TINY_TRAIN_ARGS[kwargs + 4 :],
        "--num-classes",
        "10",
    ]
    assert train.main([*argv, "--output", str(tmp_path / "run")]) == EXIT_DAMAGED
    one_line(messages(capsys.readouterr().err), expected)
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_model_kwargs_checkpoint_path_loads_what_timms_own_loader_loads(tmp_path, tiny_model):
    """The route through the package's checks loads the file's weights as timm.create_model(checkpoint_path=)
    does (the oracle: timm's load_checkpoint), into the model the run's other options build."""
    import timm

    cfg = tiny_model(**{"--num-classes": 10})
    weights = {key: torch.randn_like(value) for key, value in modeling.create_model(cfg, 10, 1).state_dict().items()}
    path = tmp_path / "weights.pt"
    torch.save({"state_dict": weights, "epoch": 3}, path)  # as timm's train.py writes its checkpoints (no EMA)
    ours = modeling.create_model(cfg.replace(model_kwargs={**cfg.model_kwargs, "checkpoint_path": str(path)}), 10, 1)
    timms = timm.create_model(
        cfg.model, checkpoint_path=str(path), num_classes=10, in_chans=1, img_size=cfg.img_size, **cfg.model_kwargs
    )
    assert ours.state_dict().keys() == timms.state_dict().keys() == weights.keys()
    assert all(torch.equal(ours.state_dict()[key], timms.state_dict()[key]) for key in weights)


# ------------------------------------------------------------------------------------ 5. no tracebacks
LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)


@pytest.mark.parametrize(
    "text, message",
    [
        (b"\xff\xfe\x00binary", r"recipe {path} is not UTF-8 text \(byte 0 is 0xff\)"),
        (b"_base_: self.yaml\nlr: 1", r"the _base_ files name each other in a cycle \({path} -> {path}\)"),
        (b"_base_: other.yaml\n", r"a cycle \({path} -> {other} -> {path}\)"),
        (b"lr: " + b"[" * 5000 + b"]" * 5000, r"recipe {path} is not valid YAML: nested deeper than 64 levels"),
        (
            ("model_kwargs:\n  " + LAUGHS.replace("\n", "\n  ")).encode(),
            r"is not valid YAML: expands to more than 1,000,000 values through its aliases",
        ),
        (b"lr: !!python/object/apply:os.system [echo hi]", r"is not valid YAML: could not determine a constructor"),
    ],
)
def test_a_damaged_or_hostile_recipe_is_one_line(tmp_path, capsys, text, message):
    path, other = tmp_path / "self.yaml", tmp_path / "other.yaml"
    path.write_bytes(text)
    other.write_text("_base_: self.yaml\n")
    with pytest.raises(ConfigError, match=message.format(path=re.escape(str(path)), other=re.escape(str(other)))):
        load_yaml(path)
    code, err = run_train(capsys, "-c", str(path), "--output", str(tmp_path / "run"))
    assert code == EXIT_USAGE and not (tmp_path / "run").exists()
    one_line(err, "^error: ")
    assert len(err[0].replace(str(tmp_path), "")) < 400  # a short prefix of a value, never the structure (paths aside)


@pytest.mark.parametrize("text", [b"grid:\n  lr: !!python/name:os.system\n", b"grid: [lr: 1", b"grid: \xff\xfe\n"])
def test_a_damaged_sweep_file_is_one_line_naming_it(tmp_path, capsys, text):
    path = tmp_path / "grid.yaml"
    path.write_bytes(text)
    assert sweep.main(["run", str(path), "--output", str(tmp_path / "sweep"), "--print-commands"]) == EXIT_USAGE
    one_line(messages(capsys.readouterr().err), rf"^error: sweep file {path} is not (valid YAML|UTF-8 text)")
    assert not (tmp_path / "sweep").exists()


def test_a_log_line_nested_beyond_the_recursion_limit_is_dropped(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"epoch": 1, "eval_top1": 50.0}\n' + "[" * 200_000 + "]" * 200_000 + '\n{"epoch": 2}\n')
    records, dropped = read_log(log)
    assert [r["epoch"] for r in records] == [1, 2] and dropped == 1
    assert diagnostics.read_histories([str(tmp_path)], maps_too=False) == {tmp_path.name: records}


def exported(tmp_path, name: str, data: bytes):
    folder = tmp_path / "exported"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architecture": "convit_tiny", "num_classes": 10}))
    (folder / name).write_bytes(data)
    return folder


@pytest.mark.parametrize(
    "name, data",
    [("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}"), ("pytorch_model.bin", None)],
)
def test_predict_on_a_damaged_export_is_one_line_never_advice_to_unpickle(tmp_path, capsys, name, data):
    if data is None:
        torch.save({"w": Pickled()}, tmp_path / "p.bin")
        data = (tmp_path / "p.bin").read_bytes()
    folder = exported(tmp_path, name, data)
    png(tmp_path / "img.png")
    assert predict.main([str(folder), str(tmp_path / "img.png")]) == EXIT_DAMAGED
    one_line(messages(capsys.readouterr().err), rf"^error: {folder}/{name} (is not a readable|cannot be read as)")


def test_an_efcn_cnn_checkpoint_that_is_a_pickle_is_one_line(tmp_path):
    import timm

    from convbias.families import load_families

    load_families()
    path = tmp_path / "cnn.pt"
    torch.save({"w": Pickled()}, path)
    with pytest.raises(DamagedInputError, match=r"it was not unpickled") as refused:
        timm.create_model("efcn_vanilla_cnn", cnn_checkpoint=str(path), channels=2, depth=1, img_size=8)
    assert "weights_only=False" not in str(refused.value)


# --------------------------------------------------------------------------------- 6. one exit-code table
def test_model_kwargs_of_the_wrong_type_name_the_kwarg_and_the_type(tmp_path, capsys):
    code, err = run_train(capsys, "--model-kwargs", "embed_dim=abc", "--output", str(tmp_path / "run"))
    assert code == EXIT_USAGE
    one_line(err, r"^error: --model-kwargs embed_dim=abc: expected an int \(as ConViT's default 48\), got a str$")


def test_launch_refuses_a_process_count_below_one(capsys):
    assert launch.main(["--cpu", "--num_processes", "-3", "train.py"]) == EXIT_USAGE
    one_line(
        messages(capsys.readouterr().err),
        r"^error: argument --num_processes/--num-processes: must be >= 1, got -3; usage: ",
    )


@pytest.mark.usefixtures("as_an_unprivileged_user")  # the tests run as root, whom chmod stops not
def test_a_read_only_output_is_74(tmp_path, capsys):
    code, err = run_train(capsys, "--output", str(tmp_path / "run"))
    assert code == EXIT_STORAGE
    one_line(err, rf"^error: --output {tmp_path}/run: {tmp_path} is not writable \(read-only\)")


def test_predict_names_a_dangling_link_it_skips(tmp_path):
    from convbias.sharing.prediction import Predictor, find_images
    from convbias.sharing.prediction import predict as label

    png(tmp_path / "images" / "real.png")
    (tmp_path / "images" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    paths = find_images([str(tmp_path / "images")])
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 3))
    predictor = Predictor(model, lambda image: torch.ones(3, 4, 4), 3, "RGB", "test")
    result = label(predictor, paths, topk=1)
    assert [p.path for p in result.predictions] == [str(tmp_path / "images" / "real.png")]
    assert result.skipped == [
        (str(tmp_path / "images" / "gone.png"), f"a dangling symbolic link to {tmp_path / 'nowhere.png'}")
    ]


# Every command's one line and exit code for each row of the table (docs/run-directory.md): what each
# command parses first is made to fail as a user's mistake, a damaged input, a failed write and Ctrl-C.
COMMANDS = {
    "convbias-train": train.main,
    "convbias-predict": predict.main,
    "convbias-ensemble": ensemble.main,
    "convbias-robustness": robustness.main,
    "convbias-stability": stability.main,
    "convbias-diagnostics": diagnostics.main,
    "convbias-export": export.main,
    "convbias-launch": launch.main,
    "convbias-sweep": sweep.main,
    "convbias-regimes": regimes.main,
    "convbias-phase-diagram": phase_diagram.main,
    "convbias-stability-contrasts": stability_contrasts.main,
    "convbias-efcn-protocol": efcn_protocol.main,
}
ROWS = [
    (ConfigError("a user's mistake"), EXIT_USAGE, "error: a user's mistake"),
    (DamagedInputError("X is damaged"), EXIT_DAMAGED, "error: X is damaged"),
    (
        write_failure(OSError(errno.EROFS, "Read-only file system"), "/out/x"),
        EXIT_STORAGE,
        r"error: writing /out/x failed \(the file system is read-only\)",
    ),
    (KeyboardInterrupt(), EXIT_INTERRUPTED, "interrupted: stopped"),
]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("error, code, line", ROWS, ids=["usage", "damaged", "io", "interrupted"])
def test_every_command_follows_the_exit_code_table(monkeypatch, capsys, command, error, code, line):
    import argparse

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", fail)
    assert COMMANDS[command](["x"]) == code
    err = messages(capsys.readouterr().err)
    assert len(err) == 1 and re.fullmatch(line, err[0]), err


def test_inputs_quote_a_short_prefix_of_a_value():
    shared = [["x" * 10] * 10] * 10
    assert len(inputs.quoted(shared)) <= inputs.QUOTED_CHARACTERS and len(inputs.quoted("y" * 10_000)) <= 60
    assert inputs.json_record(b"[" * 100_000) is None and inputs.json_record(b'{"a": 1}') == {"a": 1}
    assert pickle.loads(pickle.dumps(DamagedInputError("x"))).args == ("x",)


def test_the_preempted_row_is_train_pys(monkeypatch, capsys):
    """75 belongs to the commands that train (train.py, and convbias-launch, which passes its rank's code on:
    tests/cli/test_launch.py); what stops train.py before its set-up is reported as every other command's."""
    import argparse

    from convbias.base.errors import EXIT_REQUEUE, Preempted

    def preempted(*args, **kwargs):
        raise Preempted("SIGTERM", None, 0, 3)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", preempted)
    assert train.main(["x"]) == EXIT_REQUEUE
    one_line(messages(capsys.readouterr().err), r"^preempted: stopped by SIGTERM after step 3 of epoch 1")
