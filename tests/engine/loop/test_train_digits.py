"""A real (short) training run on scikit-learn's digits, its output directory, eval-only, wandb offline."""

import csv
import functools
import json
import re

import pytest
import timm
import torch

from convbias.base.weights import load_weights
from convbias.cli import train
from convbias.engine import parse_config
from convbias.engine.checkpoint.points import save_weights
from convbias.engine.loop.records import SUMMARY_FIELDS

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("single_thread")]  # tiny models

TRAIN = dict(batch_size=16, lr=1e-3, weight_decay=0, seed=0)


@pytest.fixture(scope="module")
def model_argv(cli_argv):
    """`model_argv(**options)`: a 2-block ConViT (one GPSA block, one SA block) of width 16 on the 8x8 digits,
    16 tokens of 2x2 pixels."""
    model_kwargs = dict(cli_argv.TINY_CONVIT["model_kwargs"], embed_dim=16)
    return functools.partial(
        cli_argv, cli_argv.DEIT_RECIPE, cli_argv.TINY_CONVIT, model_kwargs=model_kwargs, dataset="digits"
    )


@pytest.fixture(scope="module")
def train_argv(cli_argv, model_argv):
    """`train_argv(**options)`: that ConViT trained without augmentation, weight decay or warm-up."""
    return functools.partial(model_argv, cli_argv.PLAIN_DIGITS, TRAIN)


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory, train_argv):
    output = tmp_path_factory.mktemp("digits") / "run"
    results = train.run(train_argv(epochs=3, output=output))
    return output, results


def test_training_on_digits_beats_chance(digits_run):
    output, results = digits_run
    assert results["final_top1"] > 40.0, results  # chance: 10%
    rows = list(csv.DictReader((output / "summary.csv").read_text().splitlines()))
    assert tuple(rows[0]) == SUMMARY_FIELDS and [int(r["epoch"]) for r in rows] == [1, 2, 3]
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"]) - 0.3
    assert float(rows[-1]["eval_top1"]) == pytest.approx(results["final_top1"])
    assert json.loads((output / "results.json").read_text()) == results
    assert results["model"] == "convit_tiny" and results["epochs"] == 3 and results["train_fraction"] == 1.0


def test_output_dir_holds_log_config_and_checkpoints(digits_run):
    output, _results = digits_run
    records = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert set(SUMMARY_FIELDS) <= set(records[0]) and records[0]["unreadable_images"] == 0
    # ConViT diagnostics from convit.diagnostics.summary: one GPSA layer with 4 heads
    assert {"gating/layer1/head1", "nonlocality/layer1"} <= set(records[-1])
    assert 0 < records[-1]["gating/layer1/head1"] < 1

    reloaded = parse_config(["-c", str(output / "config.yaml")])
    assert reloaded.epochs == 3 and reloaded.model_kwargs == {
        "patch_size": 2,
        "depth": 2,
        "local_up_to_layer": 1,
        "embed_dim": 16,
    }
    best = output / "checkpoints" / "best" / "model.safetensors"
    assert best.is_file() and (output / "checkpoints" / "last" / "training_state.pt").is_file()
    model = timm.create_model(
        "convit_tiny", patch_size=2, depth=2, local_up_to_layer=1, embed_dim=16, img_size=8, in_chans=1, num_classes=10
    )
    load_weights(model, best)


def test_eval_only_prints_top1_and_top5(digits_run, capsys, model_argv):
    output, results = digits_run
    assert train.main(model_argv(eval_only=True, checkpoint=output, which="best", workers=0)) == 0
    printed = re.search(r"top1 ([\d.]+)\s+top5 ([\d.]+)", capsys.readouterr().out)
    assert printed, "eval-only printed no top1/top5"
    assert float(printed.group(1)) == pytest.approx(results["best_top1"], abs=0.01)
    assert float(printed.group(2)) == pytest.approx(results["best_top5"], abs=0.01)


def test_wandb_offline_run_records_the_run(tmp_path, monkeypatch, train_argv):
    """An offline wandb run in the output folder, with --wandb-tags and the id --wandb-resume-id gives (with
    --resume auto, here with no point yet), and the run's console in it."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    started, init = [], wandb.init
    monkeypatch.setattr(wandb, "init", lambda *args, **kwargs: started.append(init(*args, **kwargs)) or started[-1])
    output = tmp_path / "run"
    wandb_options = dict(log_wandb=True, wandb_tags=["convit", "digits"], wandb_resume_id="abc123", resume="auto")
    results = train.run(train_argv(epochs=1, train_fraction=0.2, output=output, **wandb_options))
    assert [(run.id, run.tags) for run in started] == [("abc123", ("convit", "digits"))]
    runs = list((output / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((output / "wandb").iterdir())
    console = (runs[0] / "files" / "output.log").read_text()  # wandb's capture of the run's console
    assert f"eval_top1 {results['final_top1']:.2f}" in console


def test_every_epoch_record_reaches_the_tracker(tmp_path):
    from convbias.engine.loop.records import RunLog

    class Tracker:  # accelerate's Accelerator.log, as the engine calls it
        logged = []

        def log(self, values, step):
            self.logged.append((step, values))

    log = RunLog(tmp_path, True, Tracker())
    log.start(0)
    log.log_epoch({"epoch": 1, "train_loss": 2.0, "eval_top1": 50.0, "note": "text"})
    assert Tracker.logged == [(1, {"epoch": 1, "train_loss": 2.0, "eval_top1": 50.0})]


def test_hard_distillation_uses_the_teacher_loaded_from_its_file(tmp_path, train_argv):
    """The engine's training loss is DeiT's hard distillation against the teacher read from the file."""
    from convbias.engine.loop.start import start_run
    from convbias.engine.loop.trainer import build_trainer
    from convbias.families import load_families

    teacher = timm.create_model("test_resnet", num_classes=10, in_chans=1)
    with torch.no_grad():  # a teacher that always answers class 3
        teacher.fc.weight.zero_()
        teacher.fc.bias.copy_(torch.nn.functional.one_hot(torch.tensor(3), 10).float())
    save_weights(teacher.state_dict(), tmp_path / "teacher.safetensors")
    cfg = parse_config(
        train_argv(
            epochs=1,
            distill_teacher="test_resnet",
            distill_teacher_file=tmp_path / "teacher.safetensors",
            output=tmp_path / "run",
        )
    )
    trainer = build_trainer(start_run(cfg, load_families(), None))
    images, targets = next(iter(trainer.data.train_loader))
    logits = trainer.models.model(images)
    cross_entropy = torch.nn.functional.cross_entropy
    expected = 0.5 * cross_entropy(logits, targets) + 0.5 * cross_entropy(logits, torch.full_like(targets, 3))
    torch.testing.assert_close(trainer.optimization.train_loss(images, logits, targets), expected)


def test_ema_is_evaluated_and_saved(tmp_path, model_argv, train_argv):
    output = tmp_path / "run"
    train.run(train_argv(epochs=1, train_fraction=0.2, model_ema=True, model_ema_decay=0.9, output=output))
    record = json.loads((output / "log.jsonl").read_text().splitlines()[-1])
    ema_file = output / "checkpoints" / "last" / "ema.safetensors"
    evaluated = train.run(model_argv(eval_only=True, checkpoint=ema_file, workers=0))
    assert evaluated["eval_top1"] == pytest.approx(record["ema_eval_top1"])
    assert evaluated["eval_loss"] == pytest.approx(record["ema_eval_loss"])
    assert record["ema_eval_loss"] != pytest.approx(record["model_eval_loss"])  # the EMA is not the model itself


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, train_argv):
    from convbias.engine import parse_config
    from convbias.engine.loop.start import start_run
    from convbias.engine.loop.trainer import NonFiniteLossError, build_trainer
    from convbias.families import load_families

    output = tmp_path / "run"
    cfg = parse_config(train_argv(epochs=2, train_fraction=0.2, output=output))
    trainer = build_trainer(start_run(cfg, load_families(), None))
    real_loss = trainer.optimization.train_loss

    def diverging(outputs, targets):  # fine in epoch 1, NaN from epoch 2 on
        updates, per_epoch = trainer.progress.num_updates, trainer.data.steps_per_epoch
        return real_loss(outputs, targets) * (float("nan") if updates >= per_epoch else 1.0)

    trainer.optimization.train_loss = diverging
    with pytest.raises(NonFiniteLossError, match="non-finite training loss .* epoch 2.*last good checkpoint"):
        trainer.fit()
    last = output / "checkpoints" / "last"
    assert last.resolve().name == "epoch_0001" and not (output / "results.json").exists()
    load_weights(
        timm.create_model(
            "convit_tiny",
            patch_size=2,
            depth=2,
            local_up_to_layer=1,
            embed_dim=16,
            img_size=8,
            in_chans=1,
            num_classes=10,
        ),
        last,
    )


def test_pretrained_file_goes_through_timm_pretrained_loading(tmp_path, cli_argv):
    """An ImageNet-shaped file (3 channels, 1000 classes) of timm's test_resnet (a ResNet whose stem's first
    convolution is conv1.0, as its pretrained config names it) starts a run on the 1-channel, 10-class digits."""
    from safetensors.torch import load_file

    source = timm.create_model("test_resnet", num_classes=1000)  # ImageNet-shaped: 3 channels, 1000 classes
    save_weights(source.state_dict(), tmp_path / "test_resnet.safetensors")
    output = tmp_path / "run"
    train.run(
        cli_argv(
            model="test_resnet",
            dataset="digits",
            pretrained_file=tmp_path / "test_resnet.safetensors",
            num_classes=10,  # a new head for the digits, as timm's --num-classes
            img_size=16,
            no_aug=True,
            repeated_aug=1,
            train_fraction=0.1,
            batch_size=16,
            workers=0,
            epochs=1,
            save_epochs=0,
            no_diagnostics=True,
            output=output,
        )
    )
    start = load_file(output / "checkpoints" / "epoch_0.safetensors")
    assert torch.equal(start["layer1.0.conv1.weight"], source.state_dict()["layer1.0.conv1.weight"])
    # timm adapts the stem to 1 input channel (sum over RGB) and gives digits' 10 classes a new head
    assert torch.allclose(start["conv1.0.weight"], source.conv1[0].weight.sum(dim=1, keepdim=True))
    assert start["fc.weight"].shape == (10, source.num_features)
