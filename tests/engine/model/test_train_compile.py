"""--compile: compiled training matches eager, with no graph break and no recompilation after the first
epoch, and a compiled run's checkpoints (weights, EMA) carry the model's own keys, so they load wherever
an eager run's do. --grad-checkpointing trains the same model as without it.

Runs in-process (`train.run`), so dynamo's counters can be read; tiny models. The engine's plumbing is
what is tested here, through dynamo and AOTAutograd (`aot_eager`: forward and backward graphs, no code
generation); inductor's numerics on the models are tests/families/test_compile.py's.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from convbias.cli import train

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

SHORT = dict(train_fraction=0.2, batch_size=16, eval_batch_size=128, lr=1e-3, epochs=2, diagnostics_images=4)
EMA = dict(model_ema=True, model_ema_decay=0.9)
TCNN = dict(
    model="test_resnet",
    img_size=16,
    train_fraction=0.1,
    drop_path=0,
    reparametrize="tcnn",
    reparametrize_at_epoch=1,
    reparametrize_kwargs=dict(init="paper"),
)
SMALL_CNN = dict(model="vanilla_cnn", model_kwargs=dict(channels=4), img_size=8, drop_path=0)


@pytest.fixture(scope="module")
def convit(cli_argv) -> list[str]:
    """The tiny ConViT with drop path, EMA and diagnostics."""
    return cli_argv(cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, SHORT, EMA, drop_path=0.1)


def run(args, output, *extra):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    results = train.run(args + ["--output", str(output), *extra])
    log = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    return results, log, dict(torch._dynamo.utils.counters["graph_break"])


def assert_same_training(eager_log, compiled_log, loss_tol):
    for eager, compiled in zip(eager_log, compiled_log, strict=True):
        assert compiled["train_loss"] == pytest.approx(eager["train_loss"], rel=loss_tol)
        assert compiled["eval_loss"] == pytest.approx(eager["eval_loss"], rel=loss_tol)
        assert abs(compiled["eval_top1"] - eager["eval_top1"]) <= 100 / 359 + 1e-9  # at most 1 of 359 images flips


@pytest.fixture(scope="module")
def convit_runs(tmp_path_factory, convit):
    root = tmp_path_factory.mktemp("compile")
    _, eager_log, _ = run(convit, root / "eager")
    results, log, breaks = run(convit, root / "compiled", "--compile", "--compile-backend", "aot_eager")
    return root, eager_log, results, log, breaks


def test_compiled_convit_matches_eager_and_writes_plain_checkpoints(convit_runs, convit):
    root, eager_log, _, log, _ = convit_runs
    assert log[1]["compiled_graphs"] == log[0]["compiled_graphs"]  # epoch 2 compiled nothing new
    assert_same_training(eager_log, log, loss_tol=1e-3)
    assert "ema_eval_top1" in log[-1] and any(key.startswith("nonlocality/") for key in log[-1])  # EMA, diagnostics

    last, eager_last = root / "compiled" / "checkpoints" / "last", root / "eager" / "checkpoints" / "last"
    for name in ("model.safetensors", "ema.safetensors"):
        assert load_file(last / name).keys() == load_file(eager_last / name).keys()
    # eager evaluation of the compiled run's checkpoint: the model's weights, so the model's own evaluation (the
    # run's final_top1 is the EMA's with --model-ema, timm's metric)
    metrics = train.run(convit + ["--eval-only", "--checkpoint", str(last / "model.safetensors"), "--no-model-ema"])
    assert metrics["eval_top1"] == pytest.approx(log[-1]["model_eval_top1"])


def test_compiled_convit_has_no_graph_break(convit_runs):
    _, _, _, log, breaks = convit_runs
    assert breaks == {} and log[-1]["graph_breaks"] == 0


def test_compiled_tcnn_reparametrization_matches_eager(tmp_path, cli_argv):
    tcnn = cli_argv(cli_argv.PLAIN_DIGITS, SHORT, TCNN)
    _, eager_log, _ = run(tcnn, tmp_path / "eager")
    _, log, breaks = run(tcnn, tmp_path / "compiled", "--compile", "--compile-backend", "eager")  # dynamo's graphs
    assert breaks == {}
    assert_same_training(eager_log, log, loss_tol=1e-3)


def test_grad_checkpointing_trains_the_same_model(tmp_path, cli_argv):
    args = cli_argv(
        cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, SHORT, epochs=1, diagnostics_images=None, no_diagnostics=True
    )
    plain = train.run(args + ["--output", str(tmp_path / "plain")])
    checkpointed = train.run(args + ["--output", str(tmp_path / "checkpointed"), "--grad-checkpointing"])
    a = load_file(tmp_path / "plain" / "checkpoints" / "last" / "model.safetensors")
    b = load_file(tmp_path / "checkpointed" / "checkpoints" / "last" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    assert checkpointed["final_top1"] == plain["final_top1"]


def test_inductor_compiled_run_on_cpu_matches_eager(tmp_path, cli_argv):
    """The default backend, as users run it: on a CPU, inductor with engine.model.aten_kernels (here the CNN's
    ReLUs and max-pools, in the model and in its EMA copy); epoch 2 compiles nothing new."""
    small_cnn = cli_argv(cli_argv.PLAIN_DIGITS, SHORT, EMA, SMALL_CNN)
    _, eager_log, _ = run(small_cnn, tmp_path / "eager")
    _, log, breaks = run(small_cnn, tmp_path / "compiled", "--compile")
    assert breaks == {} and log[-1]["graph_breaks"] == 0
    assert log[1]["compiled_graphs"] == log[0]["compiled_graphs"]
    assert_same_training(eager_log, log, loss_tol=1e-3)
    assert log[-1]["ema_eval_top1"] == pytest.approx(eager_log[-1]["ema_eval_top1"], abs=100 / 359 + 1e-9)
