"""convbias-export beyond what every family does (tests/families/test_family_matrix.py: each family's run exports, reloads
with its logits, predicts as its run, with --pt2 and --onnx checked against PyTorch): the best checkpoint's card;
the refused cases (no checkpoint, unknown architecture, a fixed-size model at another size, an unreachable Hub)
with one line; the upload through huggingface_hub's API, replaced at its boundary. Faults: a damaged weights file
or results.json (one line, exit 65), a full disk while writing (one line, exit 74, nothing left), a killed export's
staging folder (removed by the next export), results.json older than the newest point."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.faults import Fault, no_space

from convbias.base.errors import EXIT_DAMAGED, EXIT_STORAGE
from convbias.cli import export, train

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def efcn_run(tmp_path_factory):
    """A tiny eFCN on the native 8x8 digits: two epochs, fast (the refusals and the faults)."""
    run = tmp_path_factory.mktemp("efcn") / "run"
    train.run(
        ["--model", "efcn_vanilla_cnn", "--model-kwargs", "channels=4", "--img-size", "8", "--epochs", "2"]
        + ["--drop-path", "0", "--dataset", "digits", "--batch-size", "64", "--train-fraction", "0.2", "--no-aug"]
        + ["--workers", "0", "--warmup-epochs", "0", "--no-diagnostics", "--output", str(run)]
    )
    return run


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_best_checkpoint_card_holds_the_best_top1(efcn_run, tmp_path):
    out = tmp_path / "best"
    assert export.main([str(efcn_run), "--output", str(out), "--which", "best"]) == 0
    results = json.loads((efcn_run / "results.json").read_text())
    front = _front_matter((out / "README.md").read_text())
    metrics = {m["name"]: m["value"] for m in front["model-index"][0]["results"][0]["metrics"]}
    assert metrics["top-1"] == round(results["best_top1"], 4)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    return err


def test_refused_with_one_line_before_writing(efcn_run, tmp_path, capsys):
    out = tmp_path / "out"
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "config.yaml").write_text((efcn_run / "config.yaml").read_text())
    assert export.main([str(empty), "--output", str(out)]) == 2
    assert "has no resume point (checkpoints/ holds no checkpoint)" in _error_line(capsys)

    unknown = tmp_path / "unknown_run"
    shutil.copytree(efcn_run, unknown, symlinks=True)
    config = yaml.safe_load((unknown / "config.yaml").read_text())
    (unknown / "config.yaml").write_text(yaml.safe_dump({**config, "model": "efcn_vanila_cnn"}))
    assert export.main([str(unknown), "--output", str(out)]) == 2
    assert "unknown model 'efcn_vanila_cnn'" in _error_line(capsys)
    (unknown / "config.yaml").write_text(yaml.safe_dump({**config, "bn_eps": 1e-3}))
    assert export.main([str(unknown), "--output", str(out)]) == 2
    assert "was trained with --bn-eps 0.001, set on its BatchNorm layers" in _error_line(capsys)

    assert export.main([str(efcn_run), "--output", str(out), "--pt2", "--img-size", "16"]) == 2
    assert _error_line(capsys) == (
        "error: efcn_vanilla_cnn takes only 8x8 inputs (fixed_input_size): it cannot be exported at 16x16"
    )
    assert export.main([str(tmp_path / "nowhere"), "--output", str(out)]) == 2
    assert "run directory not found" in _error_line(capsys)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))  # nothing written, no temporary folder left

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert export.main([str(efcn_run), "--output", str(out)]) == 2
    assert "already exists and is not empty" in _error_line(capsys)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_push_uploads_the_folder_with_huggingface_hub(efcn_run, tmp_path, monkeypatch, capsys):
    """huggingface_hub's HfApi calls replaced at the boundary: what would reach the Hub."""
    from huggingface_hub import HfApi, RepoUrl

    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, repo_id, folder_path, **kwargs):
        calls.append(("upload_folder", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))
        return "https://huggingface.co/user/efcn-digits/commit/0"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    out = tmp_path / "push"
    assert export.main([str(efcn_run), "--output", str(out), "--push-to", "user/efcn-digits", "--private"]) == 0
    assert calls[0][:2] == ("create_repo", "user/efcn-digits") and calls[0][2]["private"] is True
    assert calls[1] == (
        "upload_folder",
        "user/efcn-digits",
        ["README.md", "config.json", "config.yaml", "model.safetensors", "results.json"],
    )
    assert "uploaded to https://huggingface.co/user/efcn-digits/commit/0" in capsys.readouterr().out
    assert "timm.create_model('hf-hub:user/efcn-digits', pretrained=True)" in (out / "README.md").read_text()


@pytest.mark.parametrize(
    "offline, reason", [(False, "cannot upload ("), (True, "HF_HUB_OFFLINE is set; ")], ids=["unreachable", "offline"]
)
def test_push_without_network_is_one_line_and_keeps_the_folder(
    efcn_run, tmp_path, monkeypatch, capsys, offline, reason
):
    """A real connection attempt (a closed local port stands for the unreachable Hub), and huggingface_hub's offline
    mode. The mode is set here either way: huggingface_hub reads HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) from the
    caller's environment once, when it is imported."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    out = tmp_path / "offline"
    assert export.main([str(efcn_run), "--output", str(out), "--push-to", "user/efcn-digits"]) == 1
    err = _error_line(capsys)
    assert err.startswith(f"error: --push-to user/efcn-digits: {reason}") and err.endswith(f"stays in {out}")
    assert (out / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------------ faults
def _copy(run: Path, tmp_path: Path) -> Path:
    """A copy of the run to damage (its last/best links copied as links)."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, symlinks=True)
    return copy


def _newest_weights(run: Path) -> Path:
    return max((run / "checkpoints").glob("epoch_*[0-9]")) / "model.safetensors"


def _card_metrics(out: Path) -> dict:
    front = _front_matter((out / "README.md").read_text())
    return {m["name"]: m["value"] for m in front["model-index"][0]["results"][0]["metrics"]}


def _nothing_written(out: Path) -> bool:
    """--output absent and no staging folder left beside it."""
    return not out.exists() and not list(out.parent.glob(f".{out.name}.tmp*"))


def test_damaged_weights_of_the_newest_point_are_one_line_naming_them_exit_65(efcn_run, tmp_path, capsys):
    run = _copy(efcn_run, tmp_path)
    weights = _newest_weights(run)
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    weights.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert export.main([str(run), "--output", str(out)]) == EXIT_DAMAGED
    assert _error_line(capsys) == (
        f"error: {weights} is damaged: model.safetensors does not match its sha256 (damaged); it was not loaded"
    )
    assert _nothing_written(out)


def test_truncated_results_json_is_one_line_naming_it_exit_65(efcn_run, tmp_path, capsys):
    run = _copy(efcn_run, tmp_path)
    results = run / "results.json"
    results.write_bytes(results.read_bytes()[:20])
    out = tmp_path / "out"
    assert export.main([str(run), "--output", str(out)]) == EXIT_DAMAGED
    err = _error_line(capsys)
    assert err.startswith(f"error: {results} is not readable (JSONDecodeError: "), err
    assert _nothing_written(out)


def test_results_older_than_the_newest_point_give_way_to_its_logged_evaluation(efcn_run, tmp_path):
    """results.json of epoch 1 (a run extended and killed before rewriting it) does not describe the last
    weights (epoch 2): the card takes epoch 2's evaluation from log.jsonl, whose damaged lines are skipped."""
    run = _copy(efcn_run, tmp_path)
    results = json.loads((run / "results.json").read_text())
    (run / "results.json").write_text(json.dumps({**results, "epochs": 1, "final_top1": 0.0, "final_top5": 0.0}))
    logged = json.loads((run / "log.jsonl").read_text().splitlines()[-1])
    assert logged["epoch"] == 2
    with (run / "log.jsonl").open("ab") as log:
        log.write(b'\xff\xfe not utf-8\n[1, 2]\n{"epoch": 2, "eval_t')
    out = tmp_path / "out"
    assert export.main([str(run), "--output", str(out)]) == 0
    assert _card_metrics(out) == {"top-1": round(logged["eval_top1"], 4), "top-5": round(logged["eval_top5"], 4)}


@pytest.mark.integration
def test_a_killed_exports_staging_folder_is_removed_by_the_next_export(efcn_run, tmp_path, capsys):
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, timeout=120
    )
    out = tmp_path / "out"
    stale = [tmp_path / f".out.tmp{pid}" for pid in (int(finished.stdout), 999999)]
    for folder in stale:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half a file")
    assert export.main([str(efcn_run), "--output", str(out)]) == 0
    assert "->" in capsys.readouterr().out
    assert not any(folder.exists() for folder in stale) and not list(tmp_path.glob(".out.tmp*"))
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "config.yaml",
        "model.safetensors",
        "results.json",
    ]
    assert (out / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable by others, not safetensors' 0600


def _safetensors_fails() -> Exception:
    from safetensors import SafetensorError

    return SafetensorError("Error while serializing: IoError")


# a fault of the export's writes: the FileSystem call, on which file, the error, the file named
EXPORT_FAULTS = {
    "enospc": ("save_hf", "", no_space(), "model.safetensors", r"no space left on the device: the disk at \S+ "),
    "safetensors": ("save_hf", "", _safetensors_fails(), "model.safetensors", r"SafetensorError: Error while "),
    "torch": (
        "save_hf",
        "",
        RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file"),
        "model.safetensors",
        r"RuntimeError: \[enforce fail ",
    ),
    "run-files": (  # results.json is copied as the run wrote it (config.yaml is written less the machine's paths)
        "copy_file",
        "results.json",
        no_space(),
        "results.json",
        r"no space left on the device: the disk at \S+ ",
    ),
}


@pytest.mark.parametrize("fault", EXPORT_FAULTS)
@pytest.mark.parametrize("existing", [False, True], ids=["new", "empty-output"])
def test_a_failed_write_is_one_line_exit_74_and_leaves_nothing(
    efcn_run, tmp_path, capsys, file_faults, fault, existing
):
    on, name, error, written, reason = EXPORT_FAULTS[fault]
    file_faults.add(Fault(on, error, name, partial=True))  # after a partial write into the staging folder
    out = tmp_path / "out"
    if existing:
        out.mkdir()
    assert export.main([str(efcn_run), "--output", str(out)]) == EXIT_STORAGE
    err = _error_line(capsys)
    assert re.fullmatch(
        rf"error: writing {re.escape(str(out / written))} failed \({reason}.*\); "
        rf"nothing was written to --output {re.escape(str(out))}",
        err,
    ), err
    assert not list(tmp_path.glob(".out.tmp*"))
    assert (list(out.iterdir()) == []) if existing else not out.exists()


def test_the_exported_options_leave_out_the_paths_of_the_machine():
    """config.yaml (a run's options) and args.yaml (timm's) as an export writes them: every option naming a file or
    folder emptied, 'auto' and empty values kept, an eFCN's cnn_checkpoint dropped from the model kwargs; each named."""
    from convbias.families import load_families
    from convbias.sharing.hub import portable_options

    initialization = load_families().initialization_kwargs  # the eFCN's cnn_checkpoint
    timm_args = {"model": "resnet10t", "data_dir": "/data/imagenet", "output": "/home/me/out", "resume": "",
                 "initial_checkpoint": "/home/me/init.pth", "class_map": "", "lr": 0.1}  # fmt: skip
    kept, left_out = portable_options(timm_args, initialization)
    assert kept == {**timm_args, "data_dir": None, "output": None, "initial_checkpoint": None}
    assert left_out == ["output", "data_dir", "initial_checkpoint"]
    run = {"model": "efcn_vanilla_cnn", "output": "runs/efcn", "resume": "auto", "pretrained_file": None,
           "model_kwargs": {"channels": 4, "cnn_checkpoint": "/home/me/runs/cnn/checkpoints/epoch_0003"}}  # fmt: skip
    kept, left_out = portable_options(run, initialization)
    assert kept == {**run, "output": None, "model_kwargs": {"channels": 4}}
    assert left_out == ["output", "model_kwargs.cnn_checkpoint"]
