"""convbias-predict: a tiny eFCN trained on the embedded digits labels PNG files of its own validation images
exactly as the run's model scores those images through the engine's eval transform (resize by crop_pct and
center crop, not a no-op at img_size 12); a convbias-export folder of the run gives the same predictions;
an undecodable file is named, skipped and counted; CSV and JSON outputs, standard output through the
console script; the refusals, each one `error:` line with exit status 2."""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convbias.cli import export, predict, train
from convbias.engine import RunDir, build_datasets, build_run_model
from convbias.families import load_families

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("single_thread")]
IMAGES = 6
CLASSES = 10


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One epoch of a 4-channel eFCN on 12x12 digits (upsampled from 8x8 to 14, center-cropped to 12)."""
    run = tmp_path_factory.mktemp("predict") / "run"
    train.run(
        ["--model", "efcn_vanilla_cnn", "--model-kwargs", "channels=4", "--img-size", "12", "--crop-pct", "0.875"]
        + ["--epochs", "1", "--drop-path", "0", "--dataset", "digits", "--batch-size", "64", "--train-fraction", "0.2"]
        + ["--no-aug", "--workers", "0", "--warmup-epochs", "0", "--no-diagnostics", "--output", str(run)]
    )
    return run


@pytest.fixture(scope="module")
def images(run, tmp_path_factory) -> dict:
    """The first validation images of the run as PNG files (two in a subfolder) and one corrupt file, with the
    oracle: the run's model on those images through the engine's own validation set and eval transform."""
    folder = tmp_path_factory.mktemp("images")
    (folder / "sub").mkdir()
    val = build_datasets(RunDir(run).run_config()).val
    transform, val.transform = val.transform, None
    paths = []
    for index in range(IMAGES):
        path = folder / ("sub" if index >= 4 else "") / f"val{index}.png"
        val[index][0].save(path)
        paths.append(str(path))
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    model, _ = build_run_model(RunDir(run), "last", load_families())
    val.transform = transform
    with torch.no_grad():
        probabilities = model(torch.stack([val[i][0] for i in range(IMAGES)])).softmax(-1)
    return {"folder": folder, "paths": paths, "broken": str(folder / "broken.png"), "probabilities": probabilities}


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exported") / "digits-efcn"
    assert export.main([str(run), "--output", str(out)]) == 0
    return out


def read_csv(path: Path) -> dict[str, dict[str, str]]:
    with open(path, newline="") as file:
        return {row["path"]: row for row in csv.DictReader(file)}


def test_run_predictions_are_its_model_on_its_validation_images(run, images, tmp_path, capsys):
    output = tmp_path / "preds.csv"
    argv = [str(run), str(images["folder"]), "--topk", str(CLASSES), "--output", str(output)]
    assert predict.main(argv + ["--batch-size", "4", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert f"skipping unreadable image {images['broken']} (" in err
    assert err.rstrip().endswith("skipped 1 unreadable images")
    rows = read_csv(output)
    assert sorted(rows) == sorted(images["paths"])  # the folder, recursively, without the corrupt file
    for path, expected in zip(images["paths"], images["probabilities"]):
        row = rows[path]
        indices = [int(row[f"index_{k}"]) for k in range(1, CLASSES + 1)]
        probabilities = torch.tensor([float(row[f"probability_{k}"]) for k in range(1, CLASSES + 1)])
        assert sorted(indices) == list(range(CLASSES))  # every class once: the probabilities cover them all
        assert indices[0] == expected.argmax().item()
        assert probabilities.sum().item() == pytest.approx(1.0, abs=1e-5)
        torch.testing.assert_close(probabilities, expected[indices], rtol=1e-5, atol=1e-6)
        assert [row[f"label_{k}"] for k in range(1, CLASSES + 1)] == [str(i) for i in indices]  # digits' names


def test_json_output_from_globs_and_files(run, images, tmp_path):
    output = tmp_path / "preds.json"
    pattern, single = str(images["folder"] / "sub" / "*.png"), images["paths"][0]
    assert predict.main([str(run), pattern, single, "--topk", "3", "--output", str(output), "--which", "best"]) == 0
    record = json.loads(output.read_text())
    assert (record["topk"], record["labels"], record["skipped"]) == (3, "names", [])
    assert "checkpoints/best" in record["model"]
    assert [p["path"] for p in record["predictions"]] == images["paths"][4:] + [single]
    expected = images["probabilities"][[4, 5, 0]]
    for prediction, probabilities in zip(record["predictions"], expected):
        top = prediction["top"]
        assert [t["index"] for t in top] == probabilities.topk(3).indices.tolist()
        assert [t["label"] for t in top] == [str(t["index"]) for t in top]
        assert [t["probability"] for t in top] == pytest.approx(probabilities.topk(3).values.tolist(), abs=1e-6)


def test_an_exported_folder_predicts_as_its_run(run, images, exported, tmp_path, capsys):
    outputs = {}
    for name, source in (("run", run), ("exported", exported)):
        outputs[name] = tmp_path / f"{name}.json"
        argv = [str(source), str(images["folder"]), "--topk", "5", "--output", str(outputs[name])]
        assert predict.main(argv) == 0
        assert "skipped 1 unreadable images" in capsys.readouterr().err
    ran, loaded = (json.loads(outputs[name].read_text()) for name in ("run", "exported"))
    assert loaded["model"] == str(exported) and loaded["labels"] == "names"
    assert loaded["skipped"] == ran["skipped"] == [{"path": images["broken"], "reason": ran["skipped"][0]["reason"]}]
    for a, b in zip(ran["predictions"], loaded["predictions"]):
        assert a["path"] == b["path"]
        assert [t["index"] for t in a["top"]] == [t["index"] for t in b["top"]]
        assert [t["label"] for t in a["top"]] == [t["label"] for t in b["top"]]
        assert [t["probability"] for t in a["top"]] == pytest.approx([t["probability"] for t in b["top"]], abs=1e-6)


def test_an_export_without_label_names_labels_by_index(exported, images, tmp_path, capsys):
    folder = tmp_path / "unlabelled"
    shutil.copytree(exported, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["label_names"]
    (folder / "config.json").write_text(json.dumps(config))
    assert predict.main([str(folder), images["paths"][0], "--topk", "2", "--output", str(tmp_path / "p.json")]) == 0
    assert "config.json has no label_names: labels are class indices" in capsys.readouterr().err
    record = json.loads((tmp_path / "p.json").read_text())
    assert record["labels"] == "class indices"
    assert all(t["label"] == str(t["index"]) for t in record["predictions"][0]["top"])


def test_console_script_writes_csv_to_standard_output(run, images, console_script):
    done = subprocess.run(
        [console_script("convbias-predict"), str(run), str(images["folder"]), "--topk", "1", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = list(csv.reader(done.stdout.splitlines()))
    assert rows[0] == ["path", "label_1", "index_1", "probability_1"]
    predicted = {row[0]: int(row[2]) for row in rows[1:]}
    assert predicted == {p: e.argmax().item() for p, e in zip(images["paths"], images["probabilities"])}
    assert images["broken"] in done.stderr and "skipped 1 unreadable images" in done.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full (a device that is always full)")
def test_predictions_on_a_full_standard_output_are_one_line(run, images, capsys, monkeypatch):
    """The CSV written to standard output on a full disk: a StorageError naming standard output (exit 74)."""
    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        assert predict.main([str(run), str(images["folder"]), "--topk", "1", "--device", "cpu"]) == 74
        monkeypatch.undo()
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("error: ")] == err[-1:], err
    assert err[-1] == "error: writing to standard output failed (no space left on the device)", err
    assert "Traceback" not in "".join(err)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{tmp}/missing", "{images}"], "{tmp}/missing not found: expected a train.py run directory"),
        (["{tmp}", "{images}"], "is neither a train.py run directory (no config.yaml), a convbias-export folder"),
        (["{run}", "{tmp}/nothing.png"], "image not found: {tmp}/nothing.png"),
        (["{run}", "{fifo}"], "image {fifo} is a named pipe (FIFO), not a regular file; it was not read"),
        (["{run}", "{tmp}/*.jpg"], "no file matches {tmp}/*.jpg"),
        (["{run}", "{tmp}"], "no image in folder {tmp}"),
        (["{run}", "{images}", "--output", "{tmp}/preds.txt"], "unknown suffix '.txt'; choose .csv or .json"),
        (["{run}", "{images}", "--output", "{tmp}/no/preds.csv"], "folder {tmp}/no not found"),
        (["{run}", "{images}", "--topk", "11"], "--topk 11: the model has 10 classes (choose 1 to 10)"),
        (["{run}", "{images}", "--topk", "0"], "argument --topk: must be a positive integer, got 0"),
        (["{run}", "{images}", "--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
        (["{run}", "{broken}"], "none of the 1 images could be read (skipped 1 unreadable images)"),
        (["{exported}", "{images}", "--which", "best"], "--which is for run directories"),
    ],
)
def test_refusals_are_one_line(run, images, exported, tmp_path, capsys, argv, message):
    fifo = tmp_path / "pipe" / "digit.png"
    fifo.parent.mkdir()
    os.mkfifo(fifo)  # never opened: a read of it would block
    values = dict(tmp=tmp_path, run=run, images=images["folder"], broken=images["broken"], exported=exported)
    values["fifo"] = fifo
    assert predict.main([arg.format(**values) for arg in argv]) == 2
    out, err = capsys.readouterr()
    error_lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and message.format(**values) in error_lines[0], err
    assert "Traceback" not in err and not out
