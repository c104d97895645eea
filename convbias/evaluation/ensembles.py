"""Ensembles of networks that differ only by their random initialization (Geiger, Petrini &
Wyart, *Landscape and training regimes in deep learning*, Physics Reports 2021, Sec. 4).

Given the outputs of M members on the same test points, this reports each member's error, the error of
the ensemble average <f> (of the logits, or of the softmax probabilities), and the fluctuation of the
members around it,

    fluctuation = sqrt( mean_{i, mu} ||f_i(x_mu) - <f>(x_mu)||^2 )      (their Eq. 16; the
                                                                       norm runs over the logits)

which decays as width^(-1/2) and is what ensembling removes (the double-descent peak).

Outputs are (M, n, K) logits with integer labels, or (M, n) scalar outputs of a binary classifier with
labels +-1 (error = sign(f) != y, a zero output counting as an error).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from convbias.base.errors import ConfigError
from convbias.engine import Config, RunCheckpoint, RunDir, build_datasets, build_eval_loader, build_run_model

AVERAGES = ("logits", "probabilities")


@dataclass
class EnsembleResult:
    members: int
    member_errors: list[float]  # in %, one per member
    mean_member_error: float  # in %
    ensemble_error: float  # in %, of the averaged output
    fluctuation: float  # RMS distance of a member's output to the average
    images: int  # how many samples the errors are measured on
    checkpoints: list[RunCheckpoint] = field(default_factory=list)  # per member, of train.py runs

    def as_dict(self) -> dict:
        """The result as JSON values: a checkpoint is its description (path and epoch)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return values | {"checkpoints": [c.describe() for c in self.checkpoints]}


def error_rate(outputs: torch.Tensor, labels: torch.Tensor) -> float:
    """Test error in % of (n, K) logits against class indices, or (n,) scalars against +-1 labels."""
    if outputs.ndim == 1:
        return 100.0 * (outputs * labels <= 0).double().mean().item()
    return 100.0 * (outputs.argmax(dim=1) != labels).double().mean().item()


def _check(outputs: torch.Tensor, labels: torch.Tensor, average: str) -> None:
    if average not in AVERAGES:
        raise ConfigError(f"average must be one of {', '.join(AVERAGES)}, got {average!r}")
    if not isinstance(outputs, torch.Tensor) or outputs.ndim not in (2, 3) or len(outputs) == 0:
        raise ValueError("outputs must be an (members, samples) or (members, samples, classes) tensor")
    if outputs.shape[1] != len(labels):
        raise ValueError(f"outputs hold {outputs.shape[1]} samples but there are {len(labels)} labels")
    if outputs.ndim == 2 and average == "probabilities":
        raise ConfigError("average='probabilities' needs (members, samples, classes) logits, not scalar outputs")


def evaluate_ensemble(outputs: torch.Tensor, labels: torch.Tensor, average: str = "logits") -> EnsembleResult:
    """Member errors, ensemble error and fluctuation of M members' outputs on the same points."""
    _check(outputs, labels, average)
    outputs = outputs.double()
    values = outputs.softmax(dim=-1) if average == "probabilities" else outputs
    mean = values.mean(dim=0)
    member_errors = [error_rate(member, labels) for member in outputs]
    deviation = (values - mean).square()
    if deviation.ndim == 3:
        deviation = deviation.sum(dim=-1)
    return EnsembleResult(
        members=len(outputs),
        member_errors=member_errors,
        mean_member_error=sum(member_errors) / len(member_errors),
        ensemble_error=error_rate(mean, labels),
        fluctuation=deviation.mean().sqrt().item(),
        images=len(labels),
    )


def check_same_architecture(descriptions: Sequence[dict], sources: Sequence[str]) -> None:
    """Refuse members of different architectures or class counts: one error naming the first odd one.

    descriptions: per member, the fields that define the function's form (model name, constructor
    arguments, number of classes, input size...)."""
    if len(descriptions) < 2:
        raise ConfigError(f"an ensemble needs at least 2 members, got {len(descriptions)}")
    reference = descriptions[0]
    for description, source in zip(descriptions[1:], sources[1:]):
        differ = sorted(key for key in set(reference) | set(description) if reference.get(key) != description.get(key))
        if differ:
            details = ", ".join(f"{key}: {reference.get(key)!r} vs {description.get(key)!r}" for key in differ)
            raise ConfigError(
                f"ensemble members must share the architecture and class count: {source} differs "
                f"from {sources[0]} in {details}"
            )


# ------------------------------------------------------------------------------ train.py run directories
ARCHITECTURE_KEYS = (
    "model",
    "model_kwargs",
    "num_classes",
    "dataset",
    "img_size",
    "output_scale",
    "reparametrize",
    "reparametrize_kwargs",
)


def load_run(
    run_dir: str | Path, extensions: Any = None, data: Any = None, which: str = "best"
) -> tuple[torch.nn.Module, Config, Any]:
    """(model in eval mode with the verified weights of `which`, the run's Config, its datasets).

    `which` is best (the point the run records as its best evaluation) by default, or last, init, epoch_N;
    the model is rebuilt as train.py built it (``convbias.engine.build_run_model``). `data`, when given, is reused: the
    members of an ensemble share their datasets."""
    run = RunDir(run_dir)
    model, _ = build_run_model(run, which, extensions)
    cfg = run.run_config()
    return model, cfg, data if data is not None else build_datasets(cfg)


def evaluate_runs(
    run_dirs: Sequence[str | Path],
    extensions: Any = None,
    average: str = "logits",
    batch_size: int = 256,
    which: str = "best",
) -> EnsembleResult:
    """The ensemble of train.py runs (checkpoint `which` of each) on their validation set; the result's
    `checkpoints` say which checkpoint each member was scored with.

    Every member must have been trained with the same architecture, class count, dataset, input size and
    output scale, and every member's weights must match their manifest (both checked before any model is
    built); typically runs that differ by seed."""
    if average not in AVERAGES:
        raise ConfigError(f"average must be one of {', '.join(AVERAGES)}, got {average!r}")
    runs = [RunDir(d) for d in run_dirs]
    check_same_architecture([{k: r.config.get(k) for k in ARCHITECTURE_KEYS} for r in runs], [str(d) for d in run_dirs])
    for run in runs:
        run.checkpoint(which)  # every member's weights are verified before any model is built
    loader = build_eval_loader(build_datasets(runs[0].run_config()).val, batch_size, 0)
    outputs, checkpoints, labels = [], [], []
    for run in runs:
        model, checkpoint = build_run_model(run, which, extensions)
        with torch.no_grad():
            batches = [(model(images), targets) for images, targets in loader]
        outputs.append(torch.cat([output for output, _ in batches]))
        labels = torch.cat([targets for _, targets in batches])
        checkpoints.append(checkpoint)
    result = evaluate_ensemble(torch.stack(outputs), labels, average)
    result.checkpoints = checkpoints
    return result
