"""Ensemble evaluation: identical members, a hand-computed two-member case, scalar binary outputs,
and refusing members of different architectures or class counts."""
import json
import shutil

import numpy as np
import pytest
import torch
import yaml

from convbias.evaluation.ensembles import check_same_architecture, error_rate, evaluate_ensemble

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("average", ["logits", "probabilities"])
def test_ensemble_of_identical_members_is_that_member(average):
    torch.manual_seed(0)
    logits, labels = torch.randn(50, 4), torch.randint(0, 4, (50,))
    result = evaluate_ensemble(logits.expand(3, -1, -1), labels, average)
    single = error_rate(logits, labels)
    assert result.members == 3 and result.member_errors == [single] * 3
    assert result.ensemble_error == result.mean_member_error == single
    assert result.fluctuation == pytest.approx(0.0, abs=1e-12)  # (x + x + x) / 3 may round


def test_two_members_against_a_direct_computation():
    a = np.array([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 3.0]])
    b = np.array([[0.0, 1.0], [0.0, 2.0], [0.0, 3.0], [1.0, 0.0]])
    labels = np.array([0, 1, 0, 1])
    result = evaluate_ensemble(torch.tensor(np.stack([a, b])), torch.tensor(labels))
    mean = (a + b) / 2  # predicts 0, 1, 1, 1
    assert result.member_errors == [0.0, 75.0]
    assert result.ensemble_error == 100.0 * np.mean(mean.argmax(1) != labels) == 25.0
    fluctuation = np.sqrt(np.mean([((m - mean) ** 2).sum(1) for m in (a, b)]))
    assert result.fluctuation == pytest.approx(fluctuation)

    probs = torch.tensor(np.stack([a, b])).softmax(-1)
    by_probs = evaluate_ensemble(torch.tensor(np.stack([a, b])), torch.tensor(labels), "probabilities")
    assert by_probs.ensemble_error == error_rate(probs.mean(0), torch.tensor(labels))
    assert by_probs.fluctuation == pytest.approx((probs - probs.mean(0)).square().sum(-1).mean().sqrt().item())


def test_scalar_outputs_of_a_binary_classifier():
    outputs = torch.tensor([[1.0, -2.0, 0.5], [3.0, 1.0, -1.5]])
    labels = torch.tensor([1.0, -1.0, 1.0])
    result = evaluate_ensemble(outputs, labels)
    assert result.member_errors == pytest.approx([0.0, 200 / 3])
    assert result.ensemble_error == pytest.approx(100 / 3)  # mean output: 2, -0.5, -0.5
    assert result.fluctuation == pytest.approx(np.sqrt(np.mean([1, 2.25, 1] * 2)))
    with pytest.raises(ValueError, match="probabilities.*scalar"):
        evaluate_ensemble(outputs, labels, "probabilities")


def test_members_of_different_architectures_or_classes_are_refused():
    base = {"model": "convit_tiny", "num_classes": 10, "img_size": 8}
    check_same_architecture([base, dict(base)], ["a", "b"])
    with pytest.raises(ValueError, match=r"runs/c differs from runs/a in num_classes: 10 vs 5"):
        check_same_architecture([base, dict(base), {**base, "num_classes": 5}], ["runs/a", "runs/b", "runs/c"])
    with pytest.raises(ValueError, match=r"in model: 'convit_tiny' vs 'deit_tiny'"):
        check_same_architecture([base, {**base, "model": "deit_tiny"}], ["a", "b"])
    with pytest.raises(ValueError, match="at least 2 members"):
        check_same_architecture([base], ["a"])


# ------------------------------------------------------------------------ convbias-ensemble on real runs
TINY_RUN = ["--model", "deit_tiny_patch16_224", "--model-kwargs", "patch_size=2", "embed_dim=32", "depth=1",
            "num_heads=2", "--dataset", "digits", "--img-size", "8", "--crop-pct", "1", "--no-aug",
            "--repeated-aug", "1", "--batch-size", "64", "--lr", "2e-3", "--warmup-epochs", "0",
            "--workers", "0", "--epochs", "2", "--diagnostics-images", "2"]


@pytest.fixture(scope="module")
def seed_runs(tmp_path_factory):
    from convbias.cli import train

    root = tmp_path_factory.mktemp("ensemble")
    results = [train.run(TINY_RUN + ["--seed", str(seed), "--output", str(root / f"seed{seed}")]) for seed in (0, 1)]
    return root, results


def test_ensemble_command_on_runs_that_differ_by_seed(seed_runs, tmp_path, capsys):
    from convbias.cli import ensemble

    root, results = seed_runs
    runs = [str(root / "seed0"), str(root / "seed1")]
    out = tmp_path / "ensemble.json"
    assert ensemble.main(runs + ["--output", str(out)]) == 0
    record = json.loads(out.read_text())
    # the members' errors are those the engine measured on the same validation set
    assert record["member_errors"] == pytest.approx([100 - r["best_top1"] for r in results], abs=1e-9)
    assert record["fluctuation"] > 0 and "ensemble of 2" in capsys.readouterr().out
    assert ensemble.main([runs[0], runs[0], "--output", str(out)]) == 0  # a run with itself: one member
    same = json.loads(out.read_text())
    assert same["ensemble_error"] == same["member_errors"][0] and same["fluctuation"] == 0.0


def test_ensemble_command_refuses_other_class_counts(seed_runs, tmp_path, capsys):
    from convbias.cli import ensemble

    root, _ = seed_runs
    other = tmp_path / "five_classes"
    shutil.copytree(root / "seed1", other)
    config = yaml.safe_load((other / "config.yaml").read_text())
    (other / "config.yaml").write_text(yaml.safe_dump({**config, "num_classes": 5}))
    assert ensemble.main([str(root / "seed0"), str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert f"{other} differs from {root / 'seed0'} in num_classes: None vs 5" in err
    assert ensemble.main([str(root / "seed0"), str(tmp_path / "missing")]) == 2
    assert "run directory not found" in capsys.readouterr().err
