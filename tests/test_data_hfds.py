"""`--dataset hfds/NAME`: a Hugging Face dataset read through timm's dataset factory (ReaderHfds), here a
local parquet dataset in the Hub's layout written by the test and read offline.

It trains and is evaluated whole; subsampling applies to it; a missing package, a missing local dataset, an
unknown Hub id (offline), and a corrupt parquet file each stop the run before any work with one line and
exit 2, writing nothing.
"""
import io
import json
import shutil
import sys

import numpy as np
import pytest
from PIL import Image

from convbias.cli import train
from convbias.engine.data import build_datasets

datasets = pytest.importorskip("datasets")

SIZE, CLASSES = 8, ("left", "middle", "right")
ARGS = ["--model", "convit_tiny", "--model-kwargs", "patch_size=2", "depth=2", "local_up_to_layer=1", "embed_dim=8",
        "--img-size", str(SIZE), "--crop-pct", "1", "--no-aug", "--repeated-aug", "1", "--batch-size", "8",
        "--lr", "2e-3", "--warmup-epochs", "0", "--workers", "0", "--epochs", "1", "--no-diagnostics"]


def write_parquet_dataset(root, per_split: dict[str, int]) -> None:
    """Three classes of 8x8 RGB PNGs (a bright left, middle or right band) as the Hub stores a dataset:
    root/data/<split>-00000-of-00001.parquet with 'image' and ClassLabel 'label' columns."""
    rng = np.random.default_rng(0)
    features = datasets.Features(image=datasets.Image(), label=datasets.ClassLabel(names=list(CLASSES)))
    for split, count in per_split.items():
        labels, images = [i % len(CLASSES) for i in range(count)], []
        for label in labels:
            pixels = rng.integers(0, 90, (SIZE, SIZE, 3), dtype=np.uint8)
            pixels[:, 3 * label:3 * label + 2] += 150
            png = io.BytesIO()
            Image.fromarray(pixels).save(png, format="PNG")
            images.append({"bytes": png.getvalue(), "path": None})
        split_set = datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)
        split_set.to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfds") / "toy"
    (root / "data").mkdir(parents=True)
    write_parquet_dataset(root, {"train": 48, "validation": 12})
    return root


@pytest.fixture()
def cache(tmp_path):
    (tmp_path / "cache").mkdir()
    return tmp_path / "cache"


def test_a_local_hf_dataset_trains(toy, cache, tmp_path):
    output = tmp_path / "run"
    results = train.run(ARGS + ["--dataset", f"hfds/{toy}", "--data-dir", str(cache), "--output", str(output)])
    log = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    assert [record["epoch"] for record in log] == [1]
    assert results["final_top1"] * 12 / 100 == pytest.approx(round(results["final_top1"] * 12 / 100))  # all 12
    assert any(cache.iterdir())  # prepared into --data-dir, not the user's ~/.cache


def test_subsampling_an_hf_dataset(toy, cache):
    """--train-fraction keeps round(f n) of each class of train; --num-classes keeps the first classes of both."""
    bundle = build_datasets(dict(dataset=f"hfds/{toy}", data_dir=str(cache), img_size=SIZE,
                                 train_fraction=0.25, num_classes=2))
    assert bundle.class_names == ["left", "middle"] and bundle.num_classes == 2
    assert np.bincount(bundle.train.targets).tolist() == [4, 4]
    assert np.bincount(bundle.val.targets).tolist() == [4, 4]
    assert [bundle.train[i][1] for i in range(len(bundle.train))] == bundle.train.targets
    assert bundle.train[0][0].shape == (3, SIZE, SIZE)


@pytest.mark.parametrize("mistake, expected", [
    ("corrupt", "Failed to read schema from '{toy}/data/train-00000-of-00001.parquet'"),
    ("missing", "Couldn't find any data file at {toy}/missing"),
    ("offline", "Couldn't reach 'nobody/no-such-dataset' on the Hub"),
    ("no_package", "needs the datasets package: pip install datasets"),
])
def test_bad_hfds_input_is_one_line_and_writes_nothing(toy, cache, tmp_path, capsys, monkeypatch, mistake, expected):
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
    code = train.main(ARGS + ["--dataset", name, "--data-dir", str(cache), "--output", str(output)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and expected.format(toy=toy) in err[0], err
    assert not output.exists()


def test_an_unreachable_hub_is_one_line_with_the_offline_hint(cache, tmp_path, capsys, caplog, monkeypatch):
    """With no network, huggingface_hub logs a warning per retry before datasets gives up: held back, so the
    user reads one line, which names HF_HUB_OFFLINE (the retries' way out)."""
    import logging

    import timm.data

    def unreachable(name, **kwargs):
        logging.getLogger("huggingface_hub.utils._http").warning(
            "'[Errno -2] Name or service not known' thrown while requesting HEAD https://huggingface.co/... "
            "Retrying in 1s [Retry 1/5].")
        raise ConnectionError("Couldn't reach 'nobody/no-such-dataset' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(timm.data, "create_dataset", unreachable)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    output = tmp_path / "run"
    code = train.main(ARGS + ["--dataset", "hfds/nobody/no-such-dataset", "--data-dir", str(cache),
                              "--output", str(output)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no network? HF_HUB_OFFLINE=1" in err[0], err
    assert not [record for record in caplog.records if "Retrying" in record.getMessage()]  # held, then dropped
    assert not output.exists()
