"""`--dataset hfds/NAME` and `hfids/NAME`: a Hugging Face dataset read through timm's dataset factory
(ReaderHfds, random access; ReaderHfids, streamed), here a local parquet dataset in the Hub's layout written
by the test and read offline.

It trains and is evaluated whole; subsampling applies to hfds/; an hfids/ stream resumes mid-epoch exactly;
a missing package, a missing local dataset, an unknown Hub id (offline), a corrupt parquet file, and for
hfids/ a card without split sizes or class names, each stop the run before any work with one line and exit
2, writing nothing.
"""

import functools
import json
import shutil
import sys

import numpy as np
import pytest

from convbias.cli import train
from convbias.engine.config.options import Config
from convbias.engine.data.factory import build_datasets

datasets = pytest.importorskip("datasets")

SIZE = 8  # --img-size: the toy images' own side (conftest's HFToyDataset.size)
RUN = dict(batch_size=8, lr=2e-3, epochs=1, no_diagnostics=True)


@pytest.fixture(scope="module")
def run_argv(cli_argv):
    """`run_argv(dataset=..., **options)`: a tiny ConViT for an epoch on SIZE x SIZE images, no augmentation."""
    return functools.partial(
        cli_argv, cli_argv.DEIT_RECIPE, cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, RUN, img_size=SIZE
    )


@pytest.fixture(scope="module")
def toy(tmp_path_factory, hf_toy):
    return hf_toy.write(tmp_path_factory.mktemp("hfds") / "toy", {"train": 48, "validation": 12})


@pytest.fixture(scope="module")
def carded(toy, tmp_path_factory, hf_toy):
    """The toy dataset with its card (hfids/ needs the split sizes; hfds/ reads the files without one)."""
    root = shutil.copytree(toy, tmp_path_factory.mktemp("hfids") / "toy")
    hf_toy.write_card(root, {"train": 48, "validation": 12})
    return root


@pytest.fixture()
def cache(tmp_path):
    (tmp_path / "cache").mkdir()
    return tmp_path / "cache"


def test_a_local_hf_dataset_trains(toy, cache, tmp_path, run_argv):
    output = tmp_path / "run"
    results = train.run(run_argv(dataset=f"hfds/{toy}", data_dir=cache, output=output))
    log = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    assert [record["epoch"] for record in log] == [1]
    assert results["final_top1"] * 12 / 100 == pytest.approx(round(results["final_top1"] * 12 / 100))  # all 12
    assert any(cache.iterdir())  # prepared into --data-dir, not the user's ~/.cache


def test_subsampling_an_hf_dataset(toy, cache):
    """--train-fraction keeps round(f n) of each class of train; --first-classes keeps the first classes of both."""
    bundle = build_datasets(
        Config(dataset=f"hfds/{toy}", data_dir=str(cache), img_size=SIZE, train_fraction=0.25, first_classes=2)
    )
    assert bundle.class_names == ["left", "middle"] and bundle.num_classes == 2
    assert np.bincount(bundle.train.targets).tolist() == [4, 4]
    assert np.bincount(bundle.val.targets).tolist() == [4, 4]
    assert [bundle.train[i][1] for i in range(len(bundle.train))] == bundle.train.targets
    assert bundle.train[0][0].shape == (3, SIZE, SIZE)


@pytest.mark.parametrize(
    "mistake, expected",
    [
        ("corrupt", "Failed to read schema from '{toy}/data/train-00000-of-00001.parquet'"),
        ("missing", "Couldn't find any data file at {toy}/missing"),
        ("offline", "Couldn't reach 'nobody/no-such-dataset' on the Hub"),
        ("no_package", "needs the datasets package: pip install datasets"),
    ],
)
def test_bad_hfds_input_is_one_line_and_writes_nothing(
    toy, cache, tmp_path, capsys, monkeypatch, mistake, expected, run_argv
):
    name = f"hfds/{toy}"
    if mistake == "corrupt":
        toy = shutil.copytree(toy, tmp_path / "toy")
        name, shard = f"hfds/{toy}", toy / "data" / "train-00000-of-00001.parquet"
        shard.write_bytes(shard.read_bytes()[:700])
    elif mistake == "missing":
        name = f"hfds/{toy}/missing"
    elif mistake == "offline":  # what HF_HUB_OFFLINE=1 sets at import time
        import huggingface_hub.constants

        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        name = "hfds/nobody/no-such-dataset"
    else:
        monkeypatch.setitem(sys.modules, "datasets", None)
    output = tmp_path / "run"
    code = train.main(run_argv(dataset=name, data_dir=cache, output=output))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and expected.format(toy=toy) in err[0], err
    assert not output.exists()


def test_an_unreachable_hub_is_one_line_with_the_offline_hint(cache, tmp_path, capsys, caplog, monkeypatch, run_argv):
    """With no network, huggingface_hub logs a warning per retry before datasets gives up: held back, so the
    user reads one line, which names HF_HUB_OFFLINE (the retries' way out)."""
    import logging

    from convbias.engine.data import streams

    def unreachable(name, **kwargs):
        logging.getLogger("huggingface_hub.utils._http").warning(
            "'[Errno -2] Name or service not known' thrown while requesting HEAD https://huggingface.co/... "
            "Retrying in 1s [Retry 1/5]."
        )
        raise ConnectionError("Couldn't reach 'nobody/no-such-dataset' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(streams, "create_dataset", unreachable)  # the name the engine calls
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    output = tmp_path / "run"
    code = train.main(run_argv(dataset="hfds/nobody/no-such-dataset", data_dir=cache, output=output))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no network? HF_HUB_OFFLINE=1" in err[0], err
    assert not [record for record in caplog.records if "Retrying" in record.getMessage()]  # held, then dropped
    assert not output.exists()


def test_a_streamed_hf_dataset_trains_and_resumes_mid_epoch_exactly(carded, cache, tmp_path, monkeypatch, run_argv):
    """hfids/: 2 epochs of 6 steps; a stop after step 4 of epoch 1, then --resume auto (the stream replayed from
    the epoch's start, its first 4 batches dropped) ends with the uninterrupted run's metrics, all 12
    validation images evaluated."""
    from convbias.base.errors import EXIT_REQUEUE as REQUEUE_EXIT_CODE
    from convbias.engine.loop.preemption import PreemptionSignals

    args = run_argv(dataset=f"hfids/{carded}", data_dir=cache, epochs=2)
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    results = train.run(args + ["--output", str(reference)])
    assert results["final_top1"] * 12 / 100 == pytest.approx(round(results["final_top1"] * 12 / 100))  # all 12
    log = [json.loads(line) for line in (reference / "log.jsonl").read_text().splitlines()]
    assert [record["epoch"] for record in log] == [1, 2] and log[-1]["train_loss"] < log[0]["train_loss"]
    calls = []
    monkeypatch.setattr(
        PreemptionSignals, "requested", lambda self, accelerator, updates: calls.append(1) or len(calls) == 4
    )
    assert train.main(args + ["--output", str(stopped)]) == REQUEUE_EXIT_CODE
    assert (stopped / "checkpoints" / "last").resolve().name == "epoch_0000_step_0000004"
    monkeypatch.undo()
    assert train.main(args + ["--output", str(stopped), "--resume", "auto"]) == 0
    fields = lambda path: [line.split(",")[:6] for line in (path / "summary.csv").read_text().splitlines()]  # noqa: E731
    assert len(fields(reference)) == 3 and fields(stopped) == fields(reference)


@pytest.mark.parametrize(
    "mistake, expected",
    [
        ("no_sizes", "its card gives no num_examples for split 'train' and 'validation'"),
        ("no_classes", "no ClassLabel 'label' column (columns: image, label)"),
        ("fraction", "--train-fraction and --first-classes need an index of labels"),
        (
            "workers",
            "has 1 shard(s) for 1 process(es) x 2 loader worker(s), and a worker without a shard reads nothing; "
            "use --workers 1 or fewer",
        ),
        ("missing", "Couldn't find any data file at {toy}"),
        ("no_package", "needs the datasets package: pip install datasets"),
    ],
)
def test_bad_hfids_input_is_one_line_and_writes_nothing(
    carded, cache, tmp_path, capsys, monkeypatch, hf_toy, mistake, expected, run_argv
):
    toy, extra = carded, []
    if mistake in ("no_sizes", "no_classes"):
        toy = shutil.copytree(carded, tmp_path / "toy")
        card = toy / "README.md"
        if mistake == "no_sizes":
            card.unlink()
        else:
            card.write_text(
                card.read_text()
                .replace("dtype:\n      class_label:\n        names:\n", "dtype: int64\n")
                .replace("".join(f"          '{k}': {c}\n" for k, c in enumerate(hf_toy.classes)), "")
            )
    elif mistake == "fraction":
        extra = ["--train-fraction", "0.5"]
    elif mistake == "workers":  # timm's reader would raise in the second worker, mid-run
        extra = ["--workers", "2"]
    elif mistake == "missing":
        toy = toy / "missing"
    else:
        monkeypatch.setitem(sys.modules, "datasets", None)
    output = tmp_path / "run"
    code = train.main(run_argv(dataset=f"hfids/{toy}", data_dir=cache, output=output) + extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and expected.format(toy=toy) in err[0], err
    assert not output.exists()


def _numbers(files):
    yield from ({"x": f} for f in files)


@pytest.mark.parametrize("shards, processes", [(4, 2), (3, 2), (1, 2), (6, 3), (2, 4)])
def test_the_hfids_worker_check_follows_datasets_split_between_processes(shards, processes):
    """The most loader workers the check lets each process have is the number of shards datasets'
    split_dataset_by_node actually gives rank 0 (the oracle): that many pass, one more is refused."""
    from datasets.distributed import split_dataset_by_node

    from convbias.engine.data.streams import check_shards_per_worker

    stream = datasets.IterableDataset.from_generator(_numbers, gen_kwargs={"files": list(range(shards))})
    assert stream.num_shards == shards
    per_process = split_dataset_by_node(stream, rank=0, world_size=processes).num_shards
    check_shards_per_worker("hfids/toy", shards, per_process, processes)
    with pytest.raises(ValueError, match=f"use --workers {per_process} or fewer"):
        check_shards_per_worker("hfids/toy", shards, per_process + 1, processes)


@pytest.fixture(scope="module")
def renamed(tmp_path_factory, hf_toy):
    """The carded toy dataset under CIFAR-100's column names on the Hub: 'img' and 'fine_label'."""
    root = tmp_path_factory.mktemp("columns") / "toy"
    return hf_toy.write(root, {"train": 48, "validation": 12}, card=True, columns=("img", "fine_label"))


def validation_items(bundle) -> list[tuple]:
    """The validation split as (image, label) pairs, in order (the eval transform draws nothing)."""
    return [(image, int(label)) for image, label in bundle.val]


@pytest.mark.parametrize("prefix", ["hfds", "hfids"])
def test_input_and_target_keys_read_other_columns(renamed, carded, cache, prefix):
    """--input-key img --target-key fine_label read the same images, labels and class names as the standard
    'image' and 'label' columns; without them the dataset is refused in one line that names both options."""
    from convbias.base.errors import ConfigError

    options = dict(data_dir=str(cache), img_size=SIZE, workers=0, no_aug=True)
    keyed = build_datasets(Config(dataset=f"{prefix}/{renamed}", input_key="img", target_key="fine_label", **options))
    standard = build_datasets(Config(dataset=f"{prefix}/{carded}", **options))
    assert keyed.class_names == standard.class_names == ["left", "middle", "right"]
    got, expected = validation_items(keyed), validation_items(standard)
    assert len(got) == 12 and [label for _, label in got] == [label for _, label in expected]
    assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(got, expected, strict=True))
    with pytest.raises(ConfigError, match="--input-key and --target-key name"):
        build_datasets(Config(dataset=f"{prefix}/{renamed}", **options))


def test_a_run_keeps_its_columns_for_evaluation(renamed, cache, tmp_path, run_argv):
    """The columns are among a run's data options: --eval-only RUN reads the same columns (and the same top-1)."""
    from convbias.engine import parse_config

    output = tmp_path / "run"
    keys = dict(input_key="img", target_key="fine_label")
    results = train.run(run_argv(dataset=f"hfds/{renamed}", data_dir=cache, output=output, **keys))
    evaluated = parse_config(["--eval-only", str(output)])
    assert (evaluated.input_key, evaluated.target_key) == ("img", "fine_label")
    again = train.run(["--eval-only", str(output), "--workers", "0"])
    assert again["eval_top1"] == pytest.approx(results["final_top1"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset", "hfds/x", "--target-key", "a,b"], "--target-key must be one column name"),
    ],
)
def test_bad_column_options_are_one_line_errors(argv, message):
    from convbias.base.errors import ConfigError
    from convbias.engine import parse_config

    with pytest.raises(ConfigError, match=message):
        parse_config(["--model", "vanilla_cnn", *argv])
