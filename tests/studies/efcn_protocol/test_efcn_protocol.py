"""The eFCN relax-time protocol end to end on a tiny digits setting, through the real engine."""

import csv
import re
from pathlib import Path

import pytest
import yaml

from convbias.studies.efcn_protocol import command as efcn_protocol
from convbias.studies.efcn_protocol import report as protocol_report
from convbias.studies.intervals import wilson

# a tiny CNN on 8-px digits: a second thread costs more than it saves
pytestmark = pytest.mark.usefixtures("single_thread")


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return [{k: (v if k in ("method", "run") else float(v)) for k, v in r.items()} for r in csv.DictReader(f)]


FIGURES = (
    "fig6_2_training_curves",
    "fig6_3_accuracy_gradient_hessian",
    "fig6_4_deviation",
    "fig6_5_local_offlocal",
    "fig6_6_6_7_first_layer_filters",
    "figE6_interpolation",
)
TINY = dict(
    model="vanilla_cnn",
    model_kwargs={"channels": 4},
    dataset="digits",
    num_classes=5,  # half the digits: every step of the protocol, on half the images
    img_size=8,
    batch_size=50,
    workers=0,
    cnn_epochs=2,
    efcn_epochs=2,
    snapshots=2,
    measure_train_samples=100,
    power_iterations=3,
    interpolate_relax_times=2,
    interpolation_points=3,
    string_points=3,
    string_steps=2,
)


@pytest.mark.integration
@pytest.mark.slow
def test_protocol_end_to_end(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "out"
    assert efcn_protocol.main(["-c", str(config), "--output", str(out)]) == 0

    # each stage said as it starts, with the time left once its kind has been timed
    stages = re.findall(r"^\[efcn_protocol\] stage (\d+) of (\d+): (.*); (.*)$", capsys.readouterr().out, re.M)
    n = 4 + 3 + 2  # trainings: CNN, 2 eFCNs, FCN; measurements: 2 eFCNs, the FCN; 2 interpolations
    assert [(int(k), int(total)) for k, total, _, _ in stages] == [(k, n) for k in range(1, n + 1)]
    assert stages[0][2:] == (
        "training the CNN for 2 epochs",
        "time left: known once these are timed: the CNN's "
        "training, the eFCN and FCN trainings, the measurements, the interpolations",
    )
    assert re.fullmatch(
        r"about \d+ s left, plus what is not timed yet: the measurements, the interpolations", stages[2][3]
    )
    assert re.fullmatch(r"about \d+ s left", stages[-1][3])
    # a run keeps the snapshots the analysis reads and one resume point (and its best, when that is another)
    for run in ("cnn", "efcn_tw0", "efcn_tw2", "fcn"):
        points = [p.name for p in (out / run / "checkpoints").glob("epoch_????") if not p.is_symlink()]
        assert 1 <= len(points) <= 2, (run, points)
        # the snapshots the analysis reads besides the final weights, which are the last point's (no copy)
        snapshots = sorted(p.name for p in (out / run / "checkpoints").glob("epoch_*.safetensors"))
        assert snapshots == (
            ["epoch_0.safetensors"] if run == "cnn" else ["epoch_0.safetensors", "epoch_1.safetensors"]
        )
    report = (out / "report.md").read_text()
    assert report.startswith("# eFCN relax-time protocol report\n")
    assert "measured on 180 test images" in report  # 5 classes of the 359 validation digits
    table = report.split("## Relax times")[1].split("##")[0]
    first = next(r for r in _rows(out / "relax_times.csv") if r["relax_time"] == 0)
    low, high = wilson(first["final_test_acc"], 180)
    assert (
        f"| 0 | {first['cnn_test_acc_at_relax_time']:.2f} | {first['final_test_acc']:.2f} [{low:.2f}, {high:.2f}] |"
        in table
    )
    assert [name for name, _ in protocol_report.FIGURES] == [f"{figure}.png" for figure in FIGURES]
    for figure in FIGURES:
        assert f"![{figure}.png]({figure}.png)" in report
    assert "This command ran 9 stages in" in report

    # a run that did not finish its record (as one stopped by Ctrl-C has none) is continued by rerunning the command
    (out / "fcn" / "results.json").unlink()
    assert efcn_protocol.main(["-c", str(config), "--output", str(out), "--stage", "train"]) == 0
    rerun = capsys.readouterr().out
    assert rerun.count("already complete, kept") == 3 and f"{out / 'fcn'} is already finished" in rerun
    assert (out / "fcn" / "results.json").is_file()

    rows = _rows(out / "relax_times.csv")
    assert [r["relax_time"] for r in rows] == [0, 2]
    fcn = _rows(out / "baselines.csv")[0]
    for r in rows:
        # the eFCN starts as its CNN snapshot: same predictions, same loss (the embedding is exact)
        assert r["initial_test_acc"] == pytest.approx(r["cnn_test_acc_at_relax_time"], abs=1e-6)
        assert r["initial_train_loss"] == pytest.approx(r["cnn_train_loss_at_relax_time"], rel=1e-5)
        # training in FCN space leaves the CNN subspace, but stays far closer than a standard FCN
        assert 0 < r["deviation_total"] < fcn["fcn_deviation_total"]
        assert r["weight_sharing_total"] > 0
        assert r["grad_norm_start"] > 0 and r["grad_norm_end"] > 0
    curves = _rows(out / "curves.csv")
    assert len(curves) == (TINY["cnn_epochs"] + 1) + 2 * (TINY["efcn_epochs"] + 1) + (TINY["efcn_epochs"] + 1)

    points = _rows(out / "interpolation.csv")
    assert sorted({p["relax_time"] for p in points}) == [0, 2]
    for t in (0, 2):
        by_method = {
            m: [p for p in points if p["relax_time"] == t and p["method"] == m] for m in ("linear", "string", "output")
        }
        assert [len(v) for v in by_method.values()] == [3, 3, 3]
        # every path joins the same two endpoints (the lifted final CNN and the trained eFCN)
        for end in (0, -1):
            losses = [by_method[m][end]["train_loss"] for m in by_method]
            assert max(losses) - min(losses) < 1e-4
        final = next(r for r in rows if r["relax_time"] == t)
        assert by_method["linear"][-1]["train_loss"] == pytest.approx(final["final_train_loss"], rel=1e-5)

    for figure in FIGURES:
        assert (out / f"{figure}.png").stat().st_size > 10_000


def test_protocol_rejects_bad_config(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(dict(TINY, cnn_epoch=3)))
    assert efcn_protocol.main(["-c", str(config), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: protocol config \S*bad.yaml, line \d+: cnn_epoch: unknown key .*; known: .*\n", err)
    config.write_text(yaml.safe_dump(dict(TINY)) + "cnn_lr: .nan\n")
    assert efcn_protocol.main(["-c", str(config), "--output", str(tmp_path / "out")]) == 2
    lines = len(yaml.safe_dump(dict(TINY)).splitlines()) + 1
    assert (
        capsys.readouterr().err
        == f"error: protocol config {config}, line {lines}: cnn_lr must be a finite number, got nan\n"
    )
    config.write_text(yaml.safe_dump(dict(TINY, model="resnet18")))
    assert efcn_protocol.main(["-c", str(config), "--output", str(tmp_path / "out")]) == 2
    assert "error: model efcn_resnet18 is not registered" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def _fake_seed(directory: Path, seed: int, acc: list[float], cnn: float, fcn: float) -> Path:
    from convbias.base.tables import write_csv
    from convbias.studies.efcn_protocol.seeds import BASELINE_METRICS, SUMMARY_METRICS

    directory.mkdir(parents=True)
    (directory / "protocol_config.yaml").write_text(yaml.safe_dump({"seed": seed}))
    rows = [{"relax_time": t, **{k: a + i for i, k in enumerate(SUMMARY_METRICS)}} for t, a in zip((0, 5), acc)]
    write_csv(rows, directory / "relax_times.csv")
    write_csv([dict(zip(BASELINE_METRICS, (cnn, fcn, 0.9)))], directory / "baselines.csv")
    return directory


def test_seed_summary_gives_means_intervals_and_paired_gaps(tmp_path):
    """Three seeds: the mean and the 95% t-interval (t_{0.975, 2} = 4.303) of the final accuracy and of the
    per-seed gap eFCN - CNN, computed by hand."""
    accs, cnns = [[95.0, 96.0], [96.0, 96.5], [97.0, 97.5]], [95.5, 95.5, 96.5]
    dirs = [_fake_seed(tmp_path / f"s{i}", i, a, c, 96.0) for i, (a, c) in enumerate(zip(accs, cnns))]
    out = tmp_path / "summary"
    assert efcn_protocol.main(["--stage", "summarize", "--seed-dirs", *map(str, dirs), "--output", str(out)]) == 0
    rows = {r["relax_time"]: r for r in csv.DictReader((out / "relax_times_seeds.csv").open())}
    gaps = [a[1] - c for a, c in zip(accs, cnns)]  # t_w = 5
    mean = sum(gaps) / 3
    half = 4.302653 * (sum((g - mean) ** 2 for g in gaps) / 2) ** 0.5 / 3**0.5
    assert float(rows["5"]["gap_vs_cnn"]) == pytest.approx(mean)
    assert float(rows["5"]["gap_vs_cnn_low"]) == pytest.approx(mean - half, rel=1e-5)
    assert float(rows["0"]["final_test_acc"]) == pytest.approx(96.0)
    assert rows["0"]["n"] == "3" and rows["0"]["seeds"] == "0 1 2"
    assert "over n = 3 seeds" in (out / "seeds.md").read_text()


def test_seed_summary_refuses_missing_runs_before_writing(tmp_path, capsys):
    good = _fake_seed(tmp_path / "s0", 0, [95.0, 96.0], 95.0, 96.0)
    out = tmp_path / "summary"
    argv = ["--stage", "summarize", "--seed-dirs", str(good), str(tmp_path / "missing"), "--output", str(out)]
    assert efcn_protocol.main(argv) == 2
    assert re.fullmatch(r"error: \S*missing/relax_times.csv not found: run the protocol .*\n", capsys.readouterr().err)
    assert efcn_protocol.main(["--stage", "summarize", "--seed-dirs", str(good), "--output", str(out)]) == 2
    assert "needs --seed-dirs with at least 2 directories" in capsys.readouterr().err
    assert not out.exists()


def test_seed_summary_refuses_a_damaged_protocol_config_naming_it(tmp_path, capsys):
    """The protocol_config.yaml a protocol wrote, read back through base.inputs: a seed that is no seed, or a
    key given twice, is exit 65 naming the file, and nothing is written."""
    dirs = [_fake_seed(tmp_path / f"s{i}", i, [95.0, 96.0], 95.0, 96.0) for i in range(2)]
    config, out = dirs[1] / "protocol_config.yaml", tmp_path / "summary"
    for text, problem in (("seed: abc\n", "seed"), ("seed: 1\nseed: 2\n", "the key 'seed' is given twice")):
        config.write_text(text)
        argv = ["--stage", "summarize", "--seed-dirs", *map(str, dirs), "--output", str(out)]
        assert efcn_protocol.main(argv) == 65
        err = capsys.readouterr().err
        assert err.startswith("error: protocol ") and str(config) in err and problem in err, err
        assert err.count("\n") == 1
    assert not out.exists()


def test_single_seed_stage_gives_each_accuracy_its_wilson_interval(tmp_path, capsys):
    """--stage single-seed reads one protocol output and writes each network's accuracy with its 95% Wilson
    interval over the test images: at 50% on 100 images that is [40.38, 59.62] (closed form, z = 1.96)."""
    (tmp_path / "baselines.csv").write_text(
        "cnn_final_test_acc,fcn_final_test_acc,fcn_local_only_test_acc,fcn_off_local_only_test_acc\n50,80,60,70\n"
    )
    (tmp_path / "relax_times.csv").write_text(
        "relax_time,final_test_acc,local_only_test_acc,off_local_only_test_acc\n0,90,85,20\n3,95,90,10\n"
    )
    argv = ["--stage", "single-seed", "--test-images", "100", "--output", str(tmp_path)]
    assert efcn_protocol.main(argv) == 0
    rows = list(csv.DictReader((tmp_path / "single_seed.csv").open()))
    assert [(r["model"], r["relax_time"]) for r in rows] == [
        ("CNN", ""),
        ("standard FCN", ""),
        ("eFCN", "0"),
        ("eFCN", "3"),
    ]
    assert abs(float(rows[0]["final_test_acc_low"]) - 40.383) < 1e-3
    assert abs(float(rows[0]["final_test_acc_high"]) - 59.617) < 1e-3
    assert float(rows[3]["off_local_only_test_acc_low"]) < 10 < float(rows[3]["off_local_only_test_acc_high"])
    assert "95.00 [" in (tmp_path / "single_seed.md").read_text()
    assert efcn_protocol.main(["--stage", "single-seed", "--output", str(tmp_path)]) == 2
    assert "needs --test-images" in capsys.readouterr().err
