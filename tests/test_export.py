"""convbias-export: a T-CNN fine-tuned by train.py exports and reloads with timm.create_model to the run's own
top-1 on its validation set; the model card's front matter; ONNX and torch.export files checked against
PyTorch; the refused cases (no checkpoint, unknown architecture, a damaged checkpoint, a fixed-size model at
another size, an unreachable Hub) with one line; the upload through huggingface_hub's API, replaced at its boundary."""

import json
import shutil
from pathlib import Path

import pytest
import timm
import torch
import yaml
from test_tcnn_recipes import SMALL_RUN

from convbias.cli import export, train
from convbias.engine.config import Config
from convbias.engine.data import build_datasets, build_eval_loader
from convbias.engine.run_dir import read_run_config

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tcnn_run(tmp_path_factory):
    """A T-CNN fine-tuned from a plain ResNet-18 file by train.py (the T-CNN recipes' smallest run)."""
    root = tmp_path_factory.mktemp("tcnn")
    torch.manual_seed(0)
    resnet18 = root / "resnet18.safetensors"
    from safetensors.torch import save_file

    save_file(timm.create_model("resnet18").state_dict(), str(resnet18))
    run = root / "run"
    train.run(
        ["--model", "tcnn_resnet18", "--pretrained", "--pretrained-file", str(resnet18), "--epochs", "1"]
        + ["--lr", "1e-4", "--output", str(run), *SMALL_RUN]
    )
    return run


@pytest.fixture(scope="module")
def efcn_run(tmp_path_factory):
    """A tiny eFCN on the native 8x8 digits: two epochs, fast (the deployment exports and the refusals)."""
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


@torch.no_grad()
def test_a_fine_tuned_tcnn_exports_and_reloads_to_its_own_top1(tcnn_run, tmp_path, capsys):
    out = tmp_path / "tcnn_resnet18-digits"
    assert export.main([str(tcnn_run), "--output", str(out)]) == 0
    assert "checkpoints/last (epoch 1) ->" in capsys.readouterr().out
    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert model.pretrained_cfg["architecture"] == "tcnn_resnet18"
    # the run's validation set, through the preprocessing the export recorded (not the run's own options)
    cfg = model.pretrained_cfg
    data = build_datasets(
        Config(
            {
                **read_run_config(tcnn_run),
                "img_size": cfg["input_size"][-1],
                "crop_pct": cfg["crop_pct"],
                "interpolation": cfg["interpolation"],
            }
        )
    )
    assert (tuple(data.mean), tuple(data.std)) == (tuple(cfg["mean"]), tuple(cfg["std"]))
    correct = total = 0
    for images, labels in build_eval_loader(data.val, 128, 0):
        correct += (model(images).argmax(1) == labels).sum().item()
        total += len(labels)
    results = json.loads((tcnn_run / "results.json").read_text())
    assert 100 * correct / total == pytest.approx(results["final_top1"], abs=1e-9)

    card = (out / "README.md").read_text()
    front = _front_matter(card)
    assert (front["library_name"], front["license"], front["datasets"]) == ("timm", "apache-2.0", ["digits"])
    assert {"image-classification", "timm", "transformed-cnn"} <= set(front["tags"])
    metrics = {m["name"]: m["value"] for m in front["model-index"][0]["results"][0]["metrics"]}
    assert metrics == {"top-1": round(results["final_top1"], 4), "top-5": round(results["final_top5"], 4)}
    for text in ("## Training recipe", "| lr | 0.0001 |", "## Results", "import transformed_cnn", "commit "):
        assert text in card
    config = json.loads((out / "config.json").read_text())
    assert config["model_args"]["stages"] == [4] and config["model_args"]["in_chans"] == 1
    assert config["label_names"] == [str(d) for d in range(10)]
    assert "tag" not in config["pretrained_cfg"]  # the run's weights, not timm's resnet18.a1_in1k
    assert (out / "config.yaml").read_text() == (tcnn_run / "config.yaml").read_text()


def test_best_checkpoint_card_holds_the_best_top1(efcn_run, tmp_path):
    out = tmp_path / "best"
    assert export.main([str(efcn_run), "--output", str(out), "--which", "best"]) == 0
    results = json.loads((efcn_run / "results.json").read_text())
    front = _front_matter((out / "README.md").read_text())
    metrics = {m["name"]: m["value"] for m in front["model-index"][0]["results"][0]["metrics"]}
    assert metrics["top-1"] == round(results["best_top1"], 4)


@torch.no_grad()
def test_deployment_files_match_pytorch(efcn_run, tmp_path, capsys):
    pytest.importorskip("onnxruntime", reason="the onnx extra (in dev): pip install -e '.[onnx]'")
    import onnxruntime

    out = tmp_path / "deploy"
    assert export.main([str(efcn_run), "--output", str(out), "--onnx", "--pt2"]) == 0
    printed = capsys.readouterr().out
    assert "model.onnx: relative error" in printed and "model.pt2: relative error" in printed
    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    x = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    onnx_logits = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    torch.testing.assert_close(onnx_logits, model(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.export.load(str(out / "model.pt2")).module()(x), model(x))


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
    assert "has no checkpoints/last/model.safetensors (it holds no checkpoint" in _error_line(capsys)

    unknown = tmp_path / "unknown_run"
    shutil.copytree(efcn_run, unknown, symlinks=True)
    config = yaml.safe_load((unknown / "config.yaml").read_text())
    (unknown / "config.yaml").write_text(yaml.safe_dump({**config, "model": "efcn_vanila_cnn"}))
    assert export.main([str(unknown), "--output", str(out)]) == 2
    assert "unknown model 'efcn_vanila_cnn'" in _error_line(capsys)

    assert export.main([str(efcn_run), "--output", str(out), "--pt2", "--img-size", "16"]) == 2
    assert _error_line(capsys) == (
        "error: efcn_vanilla_cnn takes only 8x8 inputs (fixed_input_size): it cannot be exported at 16x16"
    )
    damaged = tmp_path / "damaged_run"
    shutil.copytree(efcn_run, damaged, symlinks=True)
    weights = damaged / "checkpoints" / "last" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    assert export.main([str(damaged), "--output", str(out)]) == 2
    assert "model.safetensors is damaged: model.safetensors does not match its sha256" in _error_line(capsys)

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


def test_push_without_network_is_one_line_and_keeps_the_folder(efcn_run, tmp_path, monkeypatch, capsys):
    """A real connection attempt (a closed local port stands for the unreachable Hub)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    out = tmp_path / "offline"
    assert export.main([str(efcn_run), "--output", str(out), "--push-to", "user/efcn-digits"]) == 1
    err = _error_line(capsys)
    assert err.startswith("error: --push-to user/efcn-digits: cannot upload (") and err.endswith(f"stays in {out}")
    assert (out / "model.safetensors").is_file()
