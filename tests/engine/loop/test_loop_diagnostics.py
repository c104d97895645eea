"""The engine's per-evaluation diagnostics (convbias.engine.loop.diagnostics.ModelDiagnostics) and what the
composition root hands it (convbias.engine.loop.extensions.Extensions, from convbias.families.load_families):
each registered function called on the fixed images, in eval mode, its keys merged, against calling the
functions directly; a failing one reported once and dropped."""

from __future__ import annotations

import warnings

import pytest
import timm
import torch

import convit.diagnostics
import efcn.diagnostics
import transformed_cnn
from convbias.engine.loop.diagnostics import ModelDiagnostics
from convbias.engine.loop.extensions import Extensions
from convbias.evaluation import stability
from convbias.evaluation.ntk import NTKChange
from convbias.families import load_families

pytestmark = pytest.mark.usefixtures("single_thread")

IMAGES = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))  # 8x8: too small for R_f


class Recorder:
    """A diagnostic that records what it was called with and returns fixed values (ints: cast to float)."""

    def __init__(self, values: dict):
        self.values, self.calls = values, []

    def __call__(self, model, images):
        self.calls.append((images, model.training, torch.is_grad_enabled()))
        return self.values


@pytest.mark.parametrize("training", [True, False])
def test_every_function_sees_the_fixed_images_in_eval_mode_and_their_keys_merge(training):
    model = torch.nn.Linear(3, 2).train(training)
    first, second, other = Recorder({"a": 1, "b": 2.5}), Recorder({"c": torch.tensor(0.25)}), Recorder({})
    diagnostics = ModelDiagnostics(IMAGES, {"first": first, "second": second, "other": other})
    for _ in range(2):
        results = diagnostics(model)
        assert results == {"a": 1.0, "b": 2.5, "c": 0.25} and all(type(v) is float for v in results.values())
    for recorder in (first, second, other):
        assert [(images is IMAGES, mode, grad) for images, mode, grad in recorder.calls] == [(True, False, False)] * 2
    assert model.training == training  # the model's mode given back


def test_a_failing_function_is_reported_once_and_left_out():
    def broken(model, images):
        calls.append(1)
        raise ValueError("no such layer")

    calls, kept = [], Recorder({"kept": 1.0})
    diagnostics = ModelDiagnostics(IMAGES, {"broken": broken, "kept": kept})
    with pytest.warns(UserWarning, match="diagnostics 'broken' failed and is disabled for this run"):
        assert diagnostics(torch.nn.Linear(3, 2)) == {"kept": 1.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert diagnostics(torch.nn.Linear(3, 2)) == {"kept": 1.0}
    assert len(calls) == 1 and len(kept.calls) == 2
    assert diagnostics.errors == {"broken": "ValueError: no such layer"}


def test_the_composition_root_hands_every_familys_diagnostics_and_the_tcnn_reparametrization():
    extensions = load_families()
    assert isinstance(extensions, Extensions)
    assert extensions.diagnostics.keys() == {"ntk", "attention", "efcn", "stability"}
    assert isinstance(extensions.diagnostics["ntk"], NTKChange)
    assert extensions.diagnostics["attention"] is convit.diagnostics.summary
    assert extensions.diagnostics["efcn"] is efcn.diagnostics.summary
    assert extensions.diagnostics["stability"] is stability.diagnostic
    assert extensions.reparametrizations == {"tcnn": transformed_cnn.transform}
    empty = Extensions()  # each its own tables: a mutable default shared between runs would leak
    empty.diagnostics["x"] = len
    assert Extensions().diagnostics == {}


@pytest.mark.parametrize(
    "name, kwargs, oracle",
    [
        (
            "convit_tiny",
            dict(patch_size=2, depth=2, local_up_to_layer=1, embed_dim=8, img_size=8),
            lambda model: convit.diagnostics.summary(model, IMAGES),
        ),
        ("efcn_vanilla_cnn", dict(channels=2, depth=1, img_size=8), lambda model: efcn.diagnostics.summary(model)),
    ],
)
def test_the_families_diagnostics_on_a_model_give_what_its_familys_summary_gives(name, kwargs, oracle):
    """The NTK change (no --output-scale) and R_f (8x8 images) give {}; the model's family gives its summary."""
    extensions = load_families()
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, **kwargs).eval()
    expected = oracle(model)
    assert expected  # the family's own keys are there to compare
    assert ModelDiagnostics(IMAGES, extensions.diagnostics)(model) == pytest.approx(expected, rel=1e-6, abs=1e-7)
