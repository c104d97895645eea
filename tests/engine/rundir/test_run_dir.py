"""A run directory is the unit: its lock, its reuse by path (--eval-only RUN_DIR, --which) and its restarts."""

import csv
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from convbias import engine
from convbias.cli import train
from convbias.engine import parse_config
from convbias.engine.rundir.lock import RunLock, RunLockedError
from convbias.families import load_families

pytestmark = pytest.mark.usefixtures("single_thread")

# A 2-block ConViT of width 16 on the 8x8 digits (16 tokens of 2x2 pixels): about a second an epoch.
MODEL = [
    "--model",
    "convit_tiny",
    "--model-kwargs",
    "patch_size=2",
    "depth=2",
    "local_up_to_layer=1",
    "embed_dim=4",
    "--dataset",
    "digits",
    "--img-size",
    "8",
    "--crop-pct",
    "1",
]
TRAIN = MODEL + [
    "--no-aug",
    "--repeated-aug",
    "1",
    "--batch-size",
    "32",
    "--lr",
    "2e-3",
    "--weight-decay",
    "0",
    "--workers",
    "0",
    "--warmup-epochs",
    "0",
]

# the run of the module's finished_run fixture
FINISHED = TRAIN + ["--epochs", "2", "--train-fraction", "0.25"]


def snapshot(directory):
    """Every file under `directory` with its bytes and mtime: what "nothing changed" compares."""
    return {
        str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def hold_lock(directory):
    """A live process holding `directory`'s run lock (as a running train.py does); returns the Popen."""
    code = textwrap.dedent(f"""
        import time
        from convbias.engine.rundir.lock import RunLock
        RunLock({str(directory)!r}).acquire()
        print("locked", flush=True)
        time.sleep(120)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-epoch run on a quarter of the digits whose diagnostics hook, called mid-run, checks that the run holds
    its directory's lock."""
    output = tmp_path_factory.mktemp("run") / "run"
    seen = {}

    def probe(model, images):
        try:
            RunLock(output).acquire().release()
            seen["second_lock"] = "acquired"
        except RunLockedError as e:
            seen["second_lock"] = str(e)
        return {}

    extensions = load_families()
    extensions.diagnostics["probe"] = probe
    results = engine.run(FINISHED + ["--output", str(output)], extensions)
    return output, results, seen


def test_a_live_run_holds_its_lock_and_releases_it(finished_run):
    output, _results, seen = finished_run
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in seen["second_lock"]
    assert not (output / ".lock").exists()


@pytest.mark.integration
def test_second_run_on_a_live_runs_dir_is_refused_naming_the_holder(tmp_path, capsys):
    output = tmp_path / "run"
    holder = hold_lock(output)
    try:
        before = snapshot(output)
        assert train.main(TRAIN + ["--epochs", "1", "--output", str(output)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert f"in use by another run (pid {holder.pid} on host {socket.gethostname()}" in err[0]
        assert snapshot(output) == before
    finally:
        holder.kill()
        holder.wait(timeout=120)


@pytest.mark.integration
def test_restart_after_a_failure_before_the_first_checkpoint_takes_over_the_stale_lock(tmp_path, capsys):
    output = tmp_path / "run"
    # a diverging first attempt stops before its first checkpoint (exit 1), leaving config.yaml and summary.csv
    assert train.main(TRAIN + ["--epochs", "1", "--lr", "1e30", "--output", str(output)]) == 1
    assert (output / "summary.csv").is_file() and not (output / "checkpoints").exists()
    holder = hold_lock(output)  # ...and a later attempt killed with -9 leaves its lock file behind
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=120)
    assert (output / ".lock").is_file()
    capsys.readouterr()

    results = engine.run(TRAIN + ["--epochs", "1", "--warmup-epochs", "3", "--output", str(output)], load_families())
    captured = capsys.readouterr()
    assert f"took over the stale lock of pid {holder.pid}" in captured.out
    assert "starting over" in captured.out
    assert (
        "warning: --warmup-epochs 3 covers the whole run of 1 epoch(s): the lr only ramps up from --warmup-lr "
        "and never reaches its peak; lower --warmup-epochs"
    ) in captured.err.splitlines()
    assert captured.out.strip().splitlines()[-1] == (
        f"done: final top-1 {results['final_top1']:.2f} (epoch 1), best top-1 {results['best_top1']:.2f} (epoch 1); "
        f"in {output}: results.json, summary.csv, log.jsonl, config.yaml, args.yaml, checkpoints/last, checkpoints/best"
    )
    assert b"\r" not in (output / "summary.csv").read_bytes()  # one line ending
    assert json.loads((output / "results.json").read_text()) == results
    assert [json.loads(line)["epoch"] for line in (output / "log.jsonl").read_text().splitlines()] == [1]
    assert not (output / ".lock").exists()


def test_eval_only_run_dir_alone_gives_the_runs_final_top1(finished_run, capsys):
    output, results, _ = finished_run
    assert train.main(["--eval-only", str(output)]) == 0
    out = capsys.readouterr().out
    assert "checkpoints/last (epoch 2)" in out
    top1 = float(re.search(r"top1 ([\d.]+)", out).group(1))
    assert top1 == pytest.approx(results["final_top1"], abs=0.01)


def test_eval_only_run_dir_takes_the_runs_loader_workers_unless_given(finished_run):
    output, _results, _ = finished_run  # trained with --workers 0: evaluating it starts no loader process
    assert parse_config(["--eval-only", str(output)]).workers == 0
    assert parse_config(["--eval-only", str(output), "--workers", "2"]).workers == 2


def test_which_best_evaluates_the_best_checkpoint(finished_run, capsys):
    output, results, _ = finished_run
    assert train.main(["--eval-only", str(output), "--which", "best"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoints/best (epoch {results['best_epoch']})" in out
    top1 = float(re.search(r"top1 ([\d.]+)", out).group(1))
    assert top1 == pytest.approx(results["best_top1"], abs=0.01)


def test_resume_auto_on_a_finished_run_says_so_and_rewrites_nothing(finished_run, capsys):
    output, _results, _ = finished_run
    before = snapshot(output)
    assert train.main(FINISHED + ["--resume", "auto", "--output", str(output)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"{output} is already finished (epoch 2/2"), out
    assert snapshot(output) == before


def test_robustness_reads_the_run_dir_and_its_clean_accuracy_is_the_runs_final_top1(finished_run, tmp_path, capsys):
    from convbias.studies.robustness import command as robustness

    output, results, _ = finished_run
    argv = [str(output), "--attacks", "none", "--corruptions", "none", "--workers", "0"]
    assert robustness.main([*argv, "--output", str(tmp_path / "robustness")]) == 0
    described = str(output / "checkpoints" / "last") + " (epoch 2)"
    assert capsys.readouterr().err.splitlines()[0] == f"convit_tiny: {described}"
    table = json.loads((tmp_path / "robustness" / "robustness.json").read_text())["table"]
    assert table[0]["clean"] == pytest.approx(results["final_top1"], abs=0.01)
    assert table[0]["checkpoint"] == described  # which of the run's checkpoints the numbers are of
    assert f"| convit_tiny | {described} | 8 |" in (tmp_path / "robustness" / "robustness.md").read_text()


def test_robustness_tables_name_the_runs_checkpoint_and_the_attacks(finished_run, tmp_path):
    """`convbias-robustness RUN --which best` writes tables that name the run's checkpoint and the attacks' eps and
    steps."""
    from convbias.studies.robustness import command as robustness

    output, _results, _ = finished_run
    argv = ["--which", "best", "--pgd-steps", "2", "--corruptions", "none", "--max-images", "32", "--workers", "0"]
    assert robustness.main([str(output), *argv, "--output", str(tmp_path / "new")]) == 0
    described = str(output / "checkpoints" / "best") + " (epoch "
    markdown = (tmp_path / "new" / "robustness.md").read_text()
    assert "| FGSM eps 1/255 (0.003922) | PGD eps 1/255 (0.003922), 2 steps |" in markdown
    assert f"| convit_tiny | {described}" in markdown
    with (tmp_path / "new" / "robustness.csv").open() as f:
        row = next(csv.DictReader(f))
    assert row["checkpoint"].startswith(described) and (row["eps_255"], row["pgd_steps"]) == ("1", "2")
    assert row["eps_fraction"] == "0.00392157"


@pytest.mark.parametrize("command", ["diagnostics", "robustness"])
def test_help_gives_the_run_first_and_examples_that_parse(command, capsys):
    """--help shows the grammar (the run first), names only files a run has, and each example parses."""
    import importlib
    import shlex

    where = {"diagnostics": "convbias.cli.diagnostics", "robustness": "convbias.studies.robustness.command"}
    module = importlib.import_module(where[command])
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: convbias-{command} ") and "RUN" in out.splitlines()[0]
    assert "best.safetensors" not in out and "checkpoints/epoch_NNNN/model.safetensors" in out
    examples = re.findall(rf"^ +(convbias-{command} (?:.*\\\n)*.*)$", module.__doc__, re.MULTILINE)
    assert len(examples) >= 2
    for example in examples:
        module.build_parser().parse_args(shlex.split(example.replace("\\\n", " "))[1:])


def test_diagnostics_reads_the_run_dir_and_unreadable_weights_are_one_line(finished_run, tmp_path, capsys):
    import numpy as np
    from PIL import Image

    from convbias.cli import diagnostics
    from convbias.studies.robustness import command as robustness

    output, results, _ = finished_run
    image = tmp_path / "digit.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (8, 8), dtype=np.uint8)).save(image)
    figures = tmp_path / "figures"
    assert diagnostics.main([str(output), "--which", "best", "--image", str(image), "--output", str(figures)]) == 0
    captured = capsys.readouterr()
    assert f"checkpoints/best (epoch {results['best_epoch']})" in captured.err
    assert captured.out.split() == [
        str(figures / name) for name in ("nonlocality.png", "gating_run.png", "span_run.png", "attention_maps.png")
    ]

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(bytes(range(256)))
    draw = ["--model", "convit_tiny", "--checkpoint", str(garbage), "--image", str(image)]
    assert diagnostics.main([*draw, "--output", str(tmp_path / "figures2")]) == 65  # damaged or foreign input
    assert robustness.main([str(garbage), "--model", "convit_tiny", "--output", str(tmp_path / "r")]) == 65
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err
        == [f"error: {garbage} is not a readable safetensors file (Error while deserializing header: header too large)"]
        * 2
    )
    assert not (tmp_path / "figures2").exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("kind", ["missing", "a folder", "a FIFO"])
def test_diagnostics_names_an_image_that_is_no_file_as_what_it_is(tmp_path, capsys, kind):
    """--image that is missing, a folder or a FIFO is one line saying which, before a model is built (a FIFO is
    never opened: a read would block)."""
    from convbias.base.errors import EXIT_USAGE
    from convbias.cli import diagnostics

    image = tmp_path / "digit.png"
    if kind == "a folder":
        image.mkdir()
    elif kind == "a FIFO":
        os.mkfifo(image)
    expected = {
        "missing": f"--image not found: {image}",
        "a folder": f"--image {image} is a folder, not a file",
        "a FIFO": f"--image {image} is a named pipe (FIFO), not a regular file; it was not read",
    }[kind]
    argv = ["--model", "convit_tiny", "--image", str(image), "--output", str(tmp_path / "figures")]
    assert diagnostics.main(argv) == EXIT_USAGE
    err = capsys.readouterr().err.splitlines()
    assert err[-1].endswith(f"error: {expected}"), err
    assert not (tmp_path / "figures").exists()


def test_diagnostics_draws_the_maps_of_the_image_as_the_run_evaluates_it(finished_run, tmp_path, monkeypatch, capsys):
    """--image goes through the run's own evaluation transform, the one convbias-predict applies (the digits' mean
    and std, the run's crop_pct 1), not timm's defaults for the architecture (averaged ImageNet statistics, crop
    0.875, which cut the digit's border): a dark image with a light left column, normalized in closed form. An
    exported folder of the run gives the same tensor."""
    import numpy as np
    import torch
    from PIL import Image

    from convbias.cli import diagnostics, export
    from convbias.engine.data.datasets import DIGITS_MEAN, DIGITS_STD
    from convbias.sharing.prediction import load_predictor

    output, _results, _ = finished_run
    pixels = np.zeros((8, 8), dtype=np.uint8)
    pixels[:, 0] = 255
    image = tmp_path / "column.png"
    Image.fromarray(pixels).save(image)
    drawn = []
    plot = diagnostics.plot_attention_maps
    monkeypatch.setattr(
        diagnostics, "plot_attention_maps", lambda x, *args, **kw: drawn.append(x) or plot(x, *args, **kw)
    )
    assert diagnostics.main([str(output), "--image", str(image), "--output", str(tmp_path / "figures")]) == 0
    (x,) = drawn
    (mean,), (std,) = DIGITS_MEAN, DIGITS_STD
    expected = torch.full((1, 8, 8), -mean / std)
    expected[..., 0] = (1 - mean) / std
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-6)
    assert torch.equal(x, load_predictor(output, load_families()).image(image))  # the one code path predict uses
    exported = tmp_path / "exported"
    assert export.main([str(output), "--output", str(exported)]) == 0
    assert diagnostics.main([str(exported), "--image", str(image), "--output", str(tmp_path / "from_export")]) == 0
    assert f"note: {exported}: no log.jsonl in it, so no history figures" in capsys.readouterr().err
    torch.testing.assert_close(drawn[1], expected, rtol=0, atol=1e-6)  # the export's preprocessing is the run's


def test_damaged_run_weights_are_one_line_exit_65_for_diagnostics_and_robustness(finished_run, tmp_path, capsys):
    """The newest point's weights with bytes flipped in their middle: refused before any model is built,
    naming the file; a run without a resume point is one line and exit 2 (no usage text)."""
    import shutil

    import numpy as np
    from PIL import Image

    from convbias.base.errors import EXIT_DAMAGED, EXIT_USAGE
    from convbias.cli import diagnostics
    from convbias.studies.robustness import command as robustness

    output, _results, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(output, run, symlinks=True)
    weights = run / "checkpoints" / "epoch_0002" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    weights.write_bytes(bytes(data))
    image = tmp_path / "digit.png"
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(image)
    figures, tables = tmp_path / "figures", tmp_path / "robustness"

    draw = ["--image", str(image), "--output", str(figures)]
    assert diagnostics.main([str(run), *draw]) == EXIT_DAMAGED
    assert robustness.main([str(run), "--workers", "0", "--output", str(tables)]) == EXIT_DAMAGED
    damaged = f"error: {weights} is damaged: model.safetensors does not match its sha256 (damaged); it was not loaded"
    assert capsys.readouterr().err.splitlines() == [damaged] * 2
    assert not figures.exists() and not tables.exists()

    shutil.rmtree(run / "checkpoints")
    assert diagnostics.main([str(run), *draw]) == EXIT_USAGE
    assert robustness.main([str(run), "--output", str(tables)]) == EXIT_USAGE
    no_point = f"error: {run} has no resume point (checkpoints/ holds no checkpoint): did the run finish an epoch?"
    assert capsys.readouterr().err.splitlines() == [no_point] * 2
