"""The deployment files of a model (convbias.sharing.deploy): a torch.export program and an ONNX model with a
dynamic batch, each run on a batch of another size and compared with the eager PyTorch model (the oracle), and
the example batch at the run's input size, refused at another size for a model of fixed input size."""

from __future__ import annotations

import importlib.util

import pytest
import timm
import torch

from convbias.families import load_families
from convbias.sharing import deploy

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def cnn():
    """The VanillaCNN of the eFCN chapter, 2 channels and one stage on 8x8 RGB (fixed input size)."""
    load_families()
    torch.manual_seed(0)
    return timm.create_model("vanilla_cnn", channels=2, depth=1, img_size=8, num_classes=5).eval()


def batch(size: int, side: int = 8) -> torch.Tensor:
    return torch.randn(size, 3, side, side, generator=torch.Generator().manual_seed(size))


def test_the_example_is_a_seeded_batch_of_the_runs_input_size(cnn):
    preprocessing = {"input_size": (3, 8, 8)}
    example = deploy.deploy_input(cnn, preprocessing, None)
    assert example.shape == (2, 3, 8, 8) and torch.equal(example, deploy.deploy_input(cnn, preprocessing, 8))
    with pytest.raises(
        ValueError, match="vanilla_cnn takes only 8x8 inputs .fixed_input_size.: it cannot be exported at 16x16"
    ):
        deploy.deploy_input(cnn, preprocessing, 16)
    convit = timm.create_model("convit_tiny", patch_size=2, depth=2, local_up_to_layer=1, embed_dim=8, img_size=8)
    assert deploy.deploy_input(convit, preprocessing, 16).shape == (2, 3, 16, 16)  # any multiple of the patch


def test_the_exported_program_takes_any_batch_and_computes_the_model(cnn, tmp_path):
    path = tmp_path / "model.pt2"
    error = deploy.export_program(cnn, deploy.deploy_input(cnn, {"input_size": (3, 8, 8)}, None), path)
    assert error < 1e-6
    program = torch.export.load(str(path)).module()
    with torch.no_grad():
        for size in (1, 7):
            torch.testing.assert_close(program(batch(size)), cnn(batch(size)), rtol=1e-6, atol=1e-6)


class DataDependent(torch.nn.Module):
    """A branch on the values of the input: torch.export cannot trace it."""

    def forward(self, x):
        return x if x.sum() > 0 else -x


def test_a_model_that_does_not_export_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^torch.export cannot export this model: [^\n]+$"):
        deploy.export_program(DataDependent(), batch(2), tmp_path / "model.pt2")
    assert not (tmp_path / "model.pt2").exists()


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="the onnx extra is not installed")
def test_the_onnx_model_runs_in_onnx_runtime_as_the_model(cnn, tmp_path):
    import onnxruntime

    path = tmp_path / "model.onnx"
    assert deploy.export_onnx(cnn, batch(2), path) <= deploy.ONNX_TOLERANCE
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    with torch.no_grad():
        for size in (1, 5):
            got = torch.from_numpy(session.run(None, {name: batch(size).numpy()})[0])
            torch.testing.assert_close(got, cnn(batch(size)), rtol=1e-4, atol=1e-5)


def test_a_missing_onnx_package_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "onnxscript" else real(name))
    with pytest.raises(
        ValueError, match=r"--onnx needs onnxscript: pip install 'convolutional-inductive-biases\[onnx\]'"
    ):
        deploy.check_onnx_installed()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    deploy.check_onnx_installed()  # all there: nothing to say
