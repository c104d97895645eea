"""Deployment files of a model: an ONNX model and a torch.export program, each with a dynamic batch and
checked against the PyTorch model on a batch of another size (`convbias.sharing.hub.export_run` writes them beside
the Hub folder's weights). Failures are ConfigErrors with one line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path
from typing import Any

import torch
from timm.models import get_model_input_config

from convbias.base.errors import ConfigError

PACKAGE = "convolutional-inductive-biases"  # the distribution: its extras, its version in a model card
DEPLOY_FORMATS = ("onnx", "pt2")
ONNX_TOLERANCE = 1e-4  # relative: ONNX Runtime's kernels against PyTorch's, fp32
ONNX_SINGLE_FILE_BYTES = 2**30  # protobuf's 2 GB limit, with room: larger weights go to model.onnx.data


def deploy_input(model: torch.nn.Module, preprocessing: dict[str, Any], img_size: int | None) -> torch.Tensor:
    """An example batch at the run's input size (or `img_size`); ConfigError when the model takes only
    another size (an eFCN's fully connected layers fix its input)."""
    channels, height, width = preprocessing["input_size"]
    if img_size is not None and (img_size, img_size) != (height, width):
        if get_model_input_config(model)["fixed_input_size"]:
            raise ConfigError(
                f"{model.pretrained_cfg.get('architecture')} takes only {height}x{width} inputs "
                f"(fixed_input_size): it cannot be exported at {img_size}x{img_size}"
            )
        height = width = img_size
    return torch.randn(2, channels, height, width, generator=torch.Generator().manual_seed(0))


def _batch_dims():
    return ({0: torch.export.Dim("batch", min=1, max=4096)},)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def export_program(model: torch.nn.Module, example: torch.Tensor, path: Path) -> float:
    """torch.export with a dynamic batch, saved as .pt2; returns its relative error against eager on a
    batch of another size. ConfigError with torch.export's first line when the model does not export."""
    try:
        program = torch.export.export(model, (example,), dynamic_shapes=_batch_dims())
    except Exception as error:  # torch.export raises many types (Unsupported, UserError, ...)
        raise ConfigError(f"torch.export cannot export this model: {str(error).strip().splitlines()[0]}") from None
    torch.export.save(program, str(path))
    check = torch.cat([example, example[:1]])
    with torch.no_grad():
        return _relative_error(torch.export.load(str(path)).module()(check), model(check))


def _parameter_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def check_onnx_installed() -> None:
    """ConfigError naming the extra when ONNX export's packages are missing."""
    missing = [name for name in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"--onnx needs {', '.join(missing)}: pip install '{PACKAGE}[onnx]' (onnx, onnxscript, onnxruntime)"
        )


def export_onnx(model: torch.nn.Module, example: torch.Tensor, path: Path) -> float:
    """model.onnx through torch.onnx's dynamo exporter (dynamic batch), run with ONNX Runtime on a batch of
    another size and compared with PyTorch; ConfigError when it does not export or does not match."""
    import onnxruntime  # the onnx extra: optional, checked by check_onnx_installed

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the exporter prints its progress
            torch.onnx.export(
                model,
                (example,),
                str(path),
                dynamo=True,
                dynamic_shapes=_batch_dims(),
                external_data=_parameter_bytes(model) > ONNX_SINGLE_FILE_BYTES,
                verbose=False,
            )
    except Exception as error:  # the exporter wraps torch.export's and its own failures
        raise ConfigError(f"ONNX export failed: {str(error).strip().splitlines()[0]}") from None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    check = torch.cat([example, example[:1]])
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: check.numpy()})[0])
    with torch.no_grad():
        error = _relative_error(got, model(check))
    if error > ONNX_TOLERANCE:
        raise ConfigError(f"model.onnx differs from the PyTorch model: relative error {error:.2e} > {ONNX_TOLERANCE}")
    return error
