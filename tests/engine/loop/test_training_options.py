"""Training-loop options: --channels-last, --sync-bn and --mixup-off-epoch: what reaches the model, and where they
cannot apply."""

import pytest
import torch

from convbias.cli import train
from convbias.engine import validate
from convbias.engine.config.options import Config
from convbias.engine.loop.start import start_run
from convbias.engine.loop.trainer import build_trainer
from convbias.engine.model.factory import sync_batchnorm
from convbias.families import load_families

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("single_thread")]  # every test trains a tiny model


def small_cnn(tmp_path, **options) -> Config:
    base = dict(model="test_resnet", img_size=16, dataset="digits", num_classes=10, no_aug=True, repeated_aug=1, train_fraction=0.1,
                epochs=1, warmup_epochs=0, batch_size=16, workers=0, diagnostics=False, lr=0.01)  # fmt: skip
    cfg = Config(**{**base, **options, "output": str(tmp_path / "run")})
    validate(cfg)
    return cfg


def test_channels_last_trains_and_evaluates_a_cnn_on_channels_last_batches(tmp_path):
    trainer = build_trainer(start_run(small_cnn(tmp_path, channels_last=True), load_families(), None))
    model = trainer.models.model
    convs = [m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert any(not w.is_contiguous() for w in convs)  # (1x1 kernels and one channel are both formats at once)
    seen = []
    model.register_forward_pre_hook(
        lambda _, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last))
    )
    trainer.fit()
    assert len(seen) > 2 and all(seen)  # every training step and evaluation batch
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)  # the optimizer kept the format


def test_sync_bn_is_refused_on_a_model_without_batchnorm(tmp_path, capsys, cli_argv):
    argv = cli_argv(cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, epochs=1, output=str(tmp_path / "run"))
    assert train.main([*argv, "--sync-bn"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --sync-bn: convit_tiny has no BatchNorm layers; run without it"]
    assert not (tmp_path / "run").exists()


def test_sync_bn_on_one_process_leaves_batchnorm_as_it_is(tmp_path):
    from accelerate import Accelerator

    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
    assert sync_batchnorm(model, "cnn", Accelerator(cpu=True)) is model
    assert isinstance(model[1], torch.nn.BatchNorm2d) and not isinstance(model[1], torch.nn.SyncBatchNorm)


def test_mixup_off_epoch_trains_on_unmixed_targets_from_that_epoch(tmp_path):
    cfg = small_cnn(tmp_path, epochs=2, no_aug=False, aa="none", reprob=0.0, mixup=0.8, cutmix=0.0, smoothing=0.1,
                    mixup_off_epoch=1)  # fmt: skip
    trainer = build_trainer(start_run(cfg, load_families(), None))
    loss, mixed_per_epoch = trainer.optimization.train_loss, {}

    def recording(outputs, targets):  # smoothed one-hot rows have one entry of 1 - 0.1 + 0.1 / 10
        mixed = bool((targets.max(dim=1).values < 0.91 - 1e-6).any())
        epoch = 0 if trainer.progress.num_updates < trainer.data.steps_per_epoch else 1
        mixed_per_epoch.setdefault(epoch, set()).add(mixed)
        return loss(outputs, targets)

    trainer.optimization.train_loss = recording
    trainer.fit()
    assert mixed_per_epoch == {0: {True}, 1: {False}}


def test_eval_metric_loss_picks_the_epoch_of_the_lowest_eval_loss(tmp_path):
    from convbias.engine import RunDir, read_log

    cfg = small_cnn(tmp_path, epochs=4, lr=0.05, eval_metric="loss")
    results = build_trainer(start_run(cfg, load_families(), None)).fit()
    records, _ = read_log(tmp_path / "run" / "log.jsonl")
    losses = {r["epoch"]: r["eval_loss"] for r in records if "eval_loss" in r}
    top1 = {r["epoch"]: r["eval_top1"] for r in records if "eval_top1" in r}
    assert results["best_epoch"] == min(losses, key=losses.get) == RunDir(tmp_path / "run").best_epoch()
    assert results["best_top1"] == top1[results["best_epoch"]]


def test_log_interval_prints_a_progress_line_every_n_steps_without_a_terminal(tmp_path, capsys):
    trainer = build_trainer(start_run(small_cnn(tmp_path, train_fraction=0.5, log_interval=10), load_families(), None))
    trainer.fit()
    steps = trainer.data.steps_per_epoch
    lines = [line for line in capsys.readouterr().out.splitlines() if " step " in line]
    assert steps > 20 and [line.split()[3] for line in lines] == [f"{s}/{steps}" for s in range(10, steps, 10)]
    assert all(line.startswith("epoch 1/1  step ") and "train_loss" in line and " lr " in line for line in lines)


def test_a_resumed_run_draws_the_same_device_side_augmentations(tmp_path, cli_argv):
    """The DeiT recipe's RandAugment and random erasing run on the device from their own streams, which a resume
    point holds (engine.checkpoint.parts.AugmentStreams): 1 epoch, then --resume to 2, equals 2 epochs straight."""
    from safetensors.torch import load_file

    from convbias.engine import RunDir, read_log

    recipe = cli_argv(cli_argv.TINY_CONVIT, dataset="digits", img_size=8, crop_pct=1, repeated_aug=1, mixup=0,
                      cutmix=0, reprob=0.5, sched="constant", warmup_epochs=0, workers=0, train_fraction=0.2)  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train.main([*recipe, "--epochs", "2", "--output", str(straight)]) == 0
    assert train.main([*recipe, "--epochs", "1", "--output", str(resumed)]) == 0
    assert train.main([*recipe, "--epochs", "2", "--output", str(resumed), "--resume", "auto"]) == 0
    losses = [[r["train_loss"] for r in read_log(run / "log.jsonl")[0]] for run in (straight, resumed)]
    assert losses[0] == losses[1] and losses[0][0] != losses[0][1]
    weights = [load_file(RunDir(run).checkpoint("last").weights) for run in (straight, resumed)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
