"""`--dataset wds/NAME`: webdataset tar shards read through timm's dataset factory, written by the test.

A shard set trains and is evaluated whole; a corrupt (truncated) shard, a missing info file and per-class
subsampling of a stream each stop the run before any work with one line and exit 2, writing nothing.
"""

import functools
import json

import pytest
from support.images import SHARD_SIDE, write_shards

from convbias.cli import train

pytest.importorskip("webdataset")

RUN = dict(img_size=SHARD_SIDE, batch_size=8, lr=2e-3, epochs=2, diagnostics_images=4, dataset="wds/toy", num_classes=2)


@pytest.fixture()
def shards(tmp_path):
    root = tmp_path / "shards"
    root.mkdir()
    write_shards(root, {"train": 96, "validation": 16})
    return root


@pytest.fixture()
def run_argv(cli_argv, shards):
    """`run_argv(**options)`: a tiny ConViT of 4x4 patches on the shards, without augmentation."""
    model_kwargs = dict(cli_argv.TINY_CONVIT["model_kwargs"], patch_size=4)
    return functools.partial(
        cli_argv,
        cli_argv.DEIT_RECIPE,
        cli_argv.TINY_CONVIT,
        cli_argv.PLAIN_DIGITS,
        RUN,
        model_kwargs=model_kwargs,
        data_dir=shards,
    )


def test_a_wds_shard_set_trains(run_argv, tmp_path):
    output = tmp_path / "run"
    results = train.run(run_argv(output=output))
    log = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    assert [record["epoch"] for record in log] == [1, 2]
    assert log[-1]["train_loss"] < log[0]["train_loss"]
    assert results["final_top1"] * 16 / 100 == pytest.approx(round(results["final_top1"] * 16 / 100))  # all 16 images
    assert results["final_top1"] > 50.0  # chance: 50%


@pytest.mark.parametrize(
    "mistake, expected",
    [
        ("truncate", "toy-train-0001.tar is corrupt or partial"),
        ("no_info", "no _info.json or info.json"),
        ("not_json", "shard set info {shards}/_info.json is not JSON"),
        ("infinite_count", "_info.json: missing or malformed cannot convert float infinity to integer"),
        ("fraction", "--train-fraction and --first-classes need an index of labels"),
        (
            "workers",
            "--workers 3: the training stream of --dataset wds/toy has 2 shard(s) for 1 process(es) x 3 loader "
            "worker(s), and a worker without a shard reads nothing; use --workers 2 or fewer",
        ),
    ],
)
def test_bad_stream_input_is_one_line_and_writes_nothing(shards, run_argv, tmp_path, capsys, mistake, expected):
    """(--workers 3 over 2 shards: the third worker would read nothing and the epoch end after 64 of 96 images.)"""
    extra = []
    if mistake == "truncate":
        shard = shards / "toy-train-0001.tar"
        shard.write_bytes(shard.read_bytes()[:700])
    elif mistake == "no_info":
        (shards / "_info.json").unlink()
    elif mistake == "not_json":
        (shards / "_info.json").write_text("{")
    elif mistake == "infinite_count":
        info = shards / "_info.json"
        info.write_text(info.read_text().replace('"num_samples": 96', '"num_samples": Infinity'))
    elif mistake == "fraction":
        extra = ["--train-fraction", "0.5"]
    else:
        extra = ["--workers", "3"]
    output = tmp_path / "run"
    code = train.main(run_argv(output=output) + extra)
    err = capsys.readouterr().err.strip().splitlines()
    expected = expected.format(shards=shards)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not output.exists()


def test_a_stream_resumes_mid_epoch_exactly(run_argv, tmp_path, monkeypatch):
    """A stop after step 5 of epoch 1 (the preemption check answers yes on its 5th call), then --resume auto:
    the stream is replayed from the epoch's start and its first 5 batches dropped; the metrics are those of
    the uninterrupted run."""
    from convbias.base.errors import EXIT_REQUEUE as REQUEUE_EXIT_CODE
    from convbias.engine.loop.preemption import PreemptionSignals

    args = run_argv(no_diagnostics=True)
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    assert train.main(args + ["--output", str(reference)]) == 0
    calls = []
    monkeypatch.setattr(
        PreemptionSignals, "requested", lambda self, accelerator, updates: calls.append(1) or len(calls) == 5
    )
    assert train.main(args + ["--output", str(stopped)]) == REQUEUE_EXIT_CODE
    assert (stopped / "checkpoints" / "last").resolve().name == "epoch_0000_step_0000005"
    monkeypatch.undo()
    assert train.main(args + ["--output", str(stopped), "--resume", "auto"]) == 0
    assert (stopped / "summary.csv").read_text().splitlines()[1:] != []
    fields = lambda path: [line.split(",")[:6] for line in (path / "summary.csv").read_text().splitlines()]  # noqa: E731
    assert fields(stopped) == fields(reference)
