"""The relative-stability study's paired contrasts and R_f trajectories against direct computations, and the
command regenerating the committed tables of results/relative_stability from their inputs."""

import json
import math
import shutil
from pathlib import Path

import pytest
from scipy import stats
from support import REPO

from convbias.base.tables import write_csv
from convbias.studies.stability.contrasts import (
    log_rows,
    pair_rows,
    read_trajectories,
    trajectory_summary,
)
from convbias.studies.stability.contrasts_command import main

STUDY = REPO / "results" / "relative_stability"
MEASURED = dict(convention="published", modes="published", images=300, draws=5)


def _row(model: str, fraction: float, seed: int, R: float, error: float, checkpoint: str = "best") -> dict:
    run = f"runs/{model}_P{fraction}_seed{seed}"
    return dict(run=run, train_fraction=fraction, seed=seed, checkpoint=checkpoint, delta=1.0, cut=3, R=R) | dict(
        test_error=error, **MEASURED
    )


def _scipy_interval(values: list[float], confidence: float) -> tuple[float, float]:
    return stats.t.interval(confidence, len(values) - 1, loc=sum(values) / len(values), scale=stats.sem(values))


def test_paired_contrast_is_the_paired_t_interval_with_bonferroni():
    """Per seed log(R_a / R_b) and error_a - error_b; the t interval at 95% and at 1 - 0.05 / k for the k = 2
    contrasts present (efcn_r1 against fcn at P fraction 0.25; cnn at 1.0 against 0.25, on its 3 shared seeds)."""
    ra, rb, ea, eb = [2.0, 3.5, 1.7, 2.9], [1.5, 1.6, 2.2, 1.1], [9.0, 8.1, 10.4, 9.9], [9.5, 8.0, 9.1, 10.6]
    rows = [_row("efcn_r1", 0.25, s, r, e) for s, (r, e) in enumerate(zip(ra, ea))]
    rows += [_row("fcn", 0.25, s, r, e) for s, (r, e) in enumerate(zip(rb, eb))]
    rows += [_row("fcn", 0.25, 0, 99.0, 0.0, checkpoint="init")]  # another checkpoint: left out
    rows += [_row("cnn", 1.0, s, 1.0 + s, 5.0) for s in range(3)] + [_row("cnn", 0.25, s, 2.0, 9.0) for s in range(4)]
    pairs = pair_rows(rows)
    assert [(p["model"], p["reference"], p["n"], p["comparisons"]) for p in pairs] == [
        ("efcn_r1", "fcn", 4, 2),
        ("cnn", "cnn", 3, 2),
    ]
    first = pairs[0]
    logs = [math.log(a / b) for a, b in zip(ra, rb)]
    gaps = [a - b for a, b in zip(ea, eb)]
    assert first["R_ratio_mean"] == pytest.approx(math.exp(sum(logs) / 4), rel=1e-12)
    for level, suffix in ((0.95, ""), (1 - 0.05 / 2, "bonferroni_")):
        low, high = _scipy_interval(logs, level)
        assert (first[f"R_ratio_{suffix}low"], first[f"R_ratio_{suffix}high"]) == pytest.approx(
            (math.exp(low), math.exp(high)), rel=1e-12
        )
        assert (first[f"test_error_gap_{suffix}low"], first[f"test_error_gap_{suffix}high"]) == pytest.approx(
            _scipy_interval(gaps, level), rel=1e-12
        )
    assert {k: first[k] for k in MEASURED} == MEASURED and first["checkpoint"] == "best"


def test_trajectory_summary_by_hand(tmp_path: Path):
    """Group a_P1.0: R_f 2 and 8 (geometric mean 4, log std ln 4 / sqrt 2, so 4 * 2^(-/+ t)), top-1 30 and 50
    (40 -/+ 10 t), t = t_0.975(1); group b_P0.25 has one seed: no interval."""
    text = "run,epoch,rf,eval_top1,convention,modes,draws,images\n"
    text += "a_P1.0_seed0,0,2.0,,published,disc,1,100\na_P1.0_seed1,0,8.0,,published,disc,1,100\n"
    text += "a_P1.0_seed0,1,8.0,30.0,published,disc,1,100\na_P1.0_seed1,1,2.0,50.0,published,disc,1,100\n"
    text += "b_P0.25_seed3,1,5.0,70.0,published,disc,1,100\n"
    (tmp_path / "trajectories.csv").write_text(text)
    summary = trajectory_summary(read_trajectories(tmp_path / "trajectories.csv"))
    t = stats.t.ppf(0.975, 1)
    assert [(s["group"], s["epoch"], s["n"]) for s in summary] == [
        ("a_P1.0", 0, 2),
        ("a_P1.0", 1, 2),
        ("b_P0.25", 1, 1),
    ]
    init, trained, single = summary
    assert (init["rf"], init["rf_low"], init["rf_high"]) == pytest.approx((4.0, 4 * 2**-t, 4 * 2**t), rel=1e-12)
    assert init["eval_top1"] is None and (init["modes"], init["images"], init["draws"]) == ("disc", 100, 1)
    assert (trained["rf"], trained["eval_top1"]) == pytest.approx((4.0, 40.0), rel=1e-12)
    assert (trained["eval_top1_low"], trained["eval_top1_high"]) == pytest.approx((40 - 10 * t, 40 + 10 * t))
    assert single["rf"] == pytest.approx(5.0) and math.isnan(single["rf_low"])


def test_training_logs_round_trip_through_trajectories_csv(tmp_path: Path):
    """Rows read from the runs' logs and from the CSV written of them summarize the same; runs without R_f
    diagnostics are left out."""
    for name, init in (("cnn_P1.0_seed0", 0.5), ("cnn_P1.0_seed1", 0.7), ("plain_P1.0_seed0", None)):
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        (run / "config.yaml").write_text("model: efcn_vanilla_cnn\nepochs: 2\ndiagnostics_images: 100\n")
        records = [dict(epoch=e, rf=init * (e + 1), eval_top1=50.0 + e) if init else dict(epoch=e) for e in (1, 2)]
        records[0] |= dict(init_rf=init) if init else {}
        (run / "log.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    rows = log_rows(tmp_path / "runs", "published", "published")
    assert [(r["run"], r["epoch"]) for r in rows][:3] == [
        ("cnn_P1.0_seed0", 0),
        ("cnn_P1.0_seed0", 1),
        ("cnn_P1.0_seed0", 2),
    ]
    assert len(rows) == 6 and rows[0]["rf"] == 0.5 and rows[0]["images"] == 100
    write_csv(rows, tmp_path / "trajectories.csv")
    assert trajectory_summary(read_trajectories(tmp_path / "trajectories.csv")) == trajectory_summary(rows)


def test_command_regenerates_the_committed_tables(tmp_path: Path, capsys: pytest.CaptureFixture):
    for name in ("stability.csv", "trajectories.csv"):
        shutil.copy(STUDY / name, tmp_path / name)
    assert main([str(tmp_path), "--no-figure"]) == 0
    for name in ("pairs.csv", "pairs.md", "trajectories.csv", "trajectories_summary.csv"):
        assert (tmp_path / name).read_bytes() == (STUDY / name).read_bytes(), name
    assert "17 comparisons" in capsys.readouterr().out


def test_command_without_stability_table_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture):
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: ") and not list(tmp_path.iterdir())
