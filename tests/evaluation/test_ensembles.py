"""Ensemble evaluation: identical members, a hand-computed two-member case, scalar binary outputs,
and refusing members of different architectures or class counts."""

import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from scipy import stats

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
TINY_RUN_OPTIONS = dict(
    model="deit_tiny_patch16_224",
    model_kwargs=dict(patch_size=2, embed_dim=32, depth=1, num_heads=2),
    dataset="digits",
    img_size=8,
    crop_pct=1.0,
    no_aug=True,
    repeated_aug=1,
    batch_size=64,
    lr=2e-3,
    warmup_epochs=0,
    workers=0,
    epochs=1,
    diagnostics=False,
)


@pytest.fixture(scope="module")
def seed_runs(tmp_path_factory):
    """A two-seed sweep of a tiny DeiT on digits, its train.py runs executed in this process."""
    from convbias.cli import train
    from convbias.studies.sweep import spec as sweep_spec
    from convbias.studies.sweep import sweep

    root = tmp_path_factory.mktemp("ensemble")
    spec = sweep_spec.normalize_spec({"set": TINY_RUN_OPTIONS, "grid": {"seed": [0, 1]}, "scale_epochs": False})
    prepared = sweep.Sweep.prepare(spec, root)
    results = [train.run(cmd[3:]) for cmd in prepared.commands()]  # python -m convbias.cli.train ARGS
    return prepared, results


def test_sweep_with_several_seeds_reports_its_ensemble(seed_runs, capsys):
    from convbias.families import load_families
    from convbias.studies.sweep import report, sweep

    prepared, results = seed_runs
    rows, missing = prepared.collect()
    ensembles = prepared.collect_ensembles(rows, load_families())
    assert not missing and len(ensembles) == 1 and ensembles[0]["members"] == 2
    members = [r["best_top1"] for r in results]
    ensemble = ensembles[0]
    assert ensemble["member_top1"] == pytest.approx(sum(members) / 2)
    assert ensemble["member_top1_std"] == pytest.approx(abs(members[0] - members[1]) / 2**0.5)
    assert ensemble["images"] == 359  # the digits' validation split
    csv_path = sweep.write_csv(rows, prepared.sweep_dir / sweep.CSV_NAME, owner=prepared.sweep_dir)  # its own
    sweep.write_csv(ensembles, prepared.sweep_dir / sweep.ENSEMBLES_CSV_NAME, owner=prepared.sweep_dir)
    text = report.write_report(csv_path, ensembles=report.ensembles_beside(csv_path))[0].read_text()
    table = text.split("## Ensembles over seeds")[1]
    correct = round(ensemble["ensemble_top1"] * 359 / 100)
    low, high = stats.binomtest(correct, 359).proportion_ci(0.95, method="exact")
    half = stats.t.ppf(0.975, 1) * ensemble["member_top1_std"] / 2**0.5
    mean = ensemble["member_top1"]
    assert (
        f"| {ensemble['ensemble_top1']:.1f} [{100 * low:.1f}, {100 * high:.1f}] "
        f"| {mean:.1f} ± {ensemble['member_top1_std']:.1f} [{mean - half:.1f}, {mean + half:.1f}] |"
    ) in table

    from convbias.studies.sweep import command as sweep_cli

    code = sweep_cli.main(["report", "--csv", str(csv_path), "--output", str(prepared.sweep_dir / "plain")])
    assert code == 0 and "## Ensembles over seeds" in (prepared.sweep_dir / "plain" / "report.md").read_text()
    assert f"ensembles over seeds: {prepared.sweep_dir / sweep.ENSEMBLES_CSV_NAME}" in capsys.readouterr().out
    code = sweep_cli.main(
        ["report", "--csv", str(csv_path), "--output", str(prepared.sweep_dir / "no"), "--ensembles", "none"]
    )
    assert code == 0 and "Ensembles" not in (prepared.sweep_dir / "no" / "report.md").read_text()


def test_ensemble_command_on_runs_that_differ_by_seed(seed_runs, tmp_path, capsys):
    from convbias.studies.ensembles import command as ensemble

    prepared, results = seed_runs
    runs = [str(prepared.run_dir(run)) for run in prepared.runs]
    out = tmp_path / "ensemble.json"
    assert ensemble.main(runs + ["--output", str(out)]) == 0
    record = json.loads(out.read_text())
    # the members' errors are those the engine measured on the same validation set
    assert record["member_errors"] == pytest.approx([100 - r["best_top1"] for r in results], abs=1e-9)
    printed = capsys.readouterr().out
    assert record["fluctuation"] > 0 and "ensemble of 2" in printed
    for run, error in zip(runs, record["member_errors"]):  # the point each run records as its best
        assert f"{run}: error {error:.2f}% ({run}/checkpoints/best (epoch 1))" in printed
    assert ensemble.main([runs[0], runs[0], "--output", str(out)]) == 0  # a run with itself: one member
    same = json.loads(out.read_text())
    assert same["ensemble_error"] == same["member_errors"][0] and same["fluctuation"] == 0.0


def test_ensemble_command_refuses_other_class_counts(seed_runs, tmp_path, capsys):
    from convbias.studies.ensembles import command as ensemble

    prepared, _ = seed_runs
    first, second = (prepared.run_dir(run) for run in prepared.runs)
    other = tmp_path / "five_classes"
    shutil.copytree(second, other)
    config = yaml.safe_load((other / "config.yaml").read_text())
    (other / "config.yaml").write_text(yaml.safe_dump({**config, "num_classes": 5}))
    assert ensemble.main([str(first), str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert f"{other} differs from {first} in num_classes: None vs 5" in err
    assert ensemble.main([str(first), str(tmp_path / "missing")]) == 2
    assert "run directory not found" in capsys.readouterr().err


def test_ensemble_command_scores_the_last_point_and_refuses_damaged_weights(seed_runs, tmp_path, capsys):
    """--which last scores the members' final weights (their final top-1); a member whose weights have 8
    bytes flipped in their middle is one line naming the file, exit 65, before anything is printed."""
    from convbias.base.errors import EXIT_DAMAGED
    from convbias.engine import RunDir
    from convbias.studies.ensembles import command as ensemble

    prepared, results = seed_runs
    runs = [str(prepared.run_dir(run)) for run in prepared.runs]
    out = tmp_path / "last.json"
    assert ensemble.main([*runs, "--which", "last", "--output", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["member_errors"] == pytest.approx([100 - r["final_top1"] for r in results], abs=1e-6)
    assert record["which"] == "last"
    assert record["checkpoints"] == [f"{run}/checkpoints/last (epoch 1)" for run in runs]
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == [
        f"{run}: error {e:.2f}% ({run}/checkpoints/last (epoch 1))" for run, e in zip(runs, record["member_errors"])
    ]

    damaged = tmp_path / "damaged"
    shutil.copytree(runs[1], damaged, symlinks=True)
    weights = RunDir(damaged).checkpoint("best").weights  # the newest point, also the best
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    weights.write_bytes(bytes(data))
    assert ensemble.main([runs[0], str(damaged), "--output", str(out)]) == EXIT_DAMAGED
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"error: {weights} is damaged: model.safetensors does not match its sha256 (damaged); it was not loaded"
    ]
    assert captured.out == "" and json.loads(out.read_text())["which"] == "last"  # nothing scored or written
