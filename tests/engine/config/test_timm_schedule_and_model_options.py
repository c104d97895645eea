"""timm train.py's --sched plateau with --patience-epochs, --sched-on-updates, --lr-noise, --checkpoint-hist,
--bn-eps, --bn-momentum, --head-init-bias and --pin-mem: each checked by its effect against timm's own
scheduler, a replay of the run's logged metrics, or the model timm builds."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from timm.scheduler import CosineLRScheduler, PlateauLRScheduler
from torch import nn

from convbias.base.errors import ConfigError
from convbias.engine import RunDir, build_run_model, read_log, run_model_spec, validate
from convbias.engine.checkpoint.resume import load_training_state
from convbias.engine.config.options import Config
from convbias.engine.data import loaders
from convbias.engine.loop.start import start_run
from convbias.engine.loop.trainer import build_trainer
from convbias.engine.model import factory as modeling
from convbias.engine.optim import factory as recipe
from convbias.families import load_families

pytestmark = pytest.mark.usefixtures("single_thread")

LR, UPDATES = 1e-3, 4  # UPDATES: optimizer updates per epoch


@pytest.fixture(scope="module", autouse=True)
def families():
    load_families()


def small_cnn(tmp_path, name: str = "run", **options) -> Config:
    """timm's test_resnet on a tenth of the plain 16-px digits: a few steps per epoch."""
    base = dict(
        model="test_resnet",
        img_size=16,
        dataset="digits",
        no_aug=True,
        repeated_aug=1,
        train_fraction=0.1,
        epochs=1,
        warmup_epochs=0,
        batch_size=16,
        workers=0,
        diagnostics=False,
        lr=0.01,
        sched_on_updates=True,
    )  # fmt: skip  (the schedule per update: its steps are the updates)
    cfg = Config(**{**base, **options, "output": str(tmp_path / name)})
    validate(cfg)
    return cfg


def train(cfg: Config) -> list[dict]:
    """The run's log.jsonl records (one per epoch)."""
    build_trainer(start_run(cfg, load_families(), None)).fit()
    return read_log(Path(cfg.output) / "log.jsonl")[0]


# ---------------------------------------------------------------------------------------------- schedule
def test_no_sched_on_updates_steps_timms_schedule_once_per_epoch(tmp_path):
    cfg = small_cnn(tmp_path, sched_on_updates=False, epochs=4, warmup_epochs=1, lr=LR, min_lr=1e-5)
    optimizer = recipe.create_optimizer(cfg, nn.Linear(2, 2), LR)
    scheduler = recipe.create_scheduler(cfg, optimizer, 4, 1, UPDATES)
    timm_optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    timm_scheduler = CosineLRScheduler(
        timm_optimizer, t_initial=4, lr_min=1e-5, warmup_t=1, warmup_lr_init=cfg.warmup_lr
    )
    num_updates = 0
    for epoch in range(4):  # timm's train.py: step_update after each update (a no-op here), step after each epoch
        lrs = set()
        for _ in range(UPDATES):
            num_updates += 1
            scheduler.step_update(num_updates)
            lrs.add(optimizer.param_groups[0]["lr"])
        assert lrs == {timm_optimizer.param_groups[0]["lr"]}, epoch  # one lr for the whole epoch, timm's
        scheduler.step(epoch + 1)
        timm_scheduler.step(epoch + 1)
    assert optimizer.param_groups[0]["lr"] < LR / 2  # past the cosine's midpoint
    restored = recipe.create_scheduler(cfg, recipe.create_optimizer(cfg, nn.Linear(2, 2), LR), 4, 1, UPDATES)
    recipe.set_scheduled_lr(restored, num_updates=2 * UPDATES + 1, epoch=2)  # a point inside the third epoch
    timm_scheduler.step(2)
    assert restored.optimizer.param_groups[0]["lr"] == timm_optimizer.param_groups[0]["lr"]


def test_lr_noise_is_timms_per_update_and_replays_on_resume(tmp_path):
    """--lr-noise 0.3 0.9 over a 10-epoch cosine of 4 updates each: timm's CosineLRScheduler with noise over
    updates 12..36, seeded by --seed, gives every update's lr; outside that range the lr is the plain cosine's,
    inside it differs; a scheduler rebuilt at update 20 (a resume) sets the same noisy lr."""
    options = dict(epochs=10, lr=LR, min_lr=1e-5, lr_noise=[0.3, 0.9], lr_noise_pct=0.5, lr_noise_std=0.8, seed=7)
    cfg = small_cnn(tmp_path, **options)
    noisy = recipe.create_scheduler(cfg, recipe.create_optimizer(cfg, nn.Linear(2, 2), LR), 10, 0, UPDATES)
    plain_cfg = small_cnn(tmp_path, **{**options, "lr_noise": None, "lr_noise_pct": 0.67, "lr_noise_std": 1.0})
    plain = recipe.create_scheduler(plain_cfg, recipe.create_optimizer(plain_cfg, nn.Linear(2, 2), LR), 10, 0, UPDATES)
    timm_optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    timm_scheduler = CosineLRScheduler(
        timm_optimizer, t_initial=40, lr_min=1e-5, t_in_epochs=False, warmup_lr_init=cfg.warmup_lr,
        noise_range_t=[12.0, 36.0], noise_pct=0.5, noise_std=0.8, noise_seed=7,
    )  # fmt: skip
    lrs = {}
    for update in range(40):
        for scheduler in (noisy, plain, timm_scheduler):
            scheduler.step_update(update)
        lr, plain_lr = noisy.optimizer.param_groups[0]["lr"], plain.optimizer.param_groups[0]["lr"]
        assert lr == timm_optimizer.param_groups[0]["lr"], update
        assert (lr != plain_lr) == (12 <= update < 36), update
        lrs[update] = lr
    resumed = recipe.create_scheduler(cfg, recipe.create_optimizer(cfg, nn.Linear(2, 2), LR), 10, 0, UPDATES)
    recipe.set_scheduled_lr(resumed, num_updates=20, epoch=5)
    assert resumed.optimizer.param_groups[0]["lr"] == lrs[20]
    with pytest.raises(ConfigError, match=r"--lr-noise must be START \[END\], ordered, >= 0"):
        small_cnn(tmp_path, lr_noise=[0.9, 0.3])


def plateau_lrs(metrics: list[float], patience: int, decay_rate: float, lr: float) -> list[float]:
    """The lr of each epoch that timm's PlateauLRScheduler gives on a loss (lower is better), stepped as timm's
    train.py steps it with these metrics after each epoch."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scheduler = PlateauLRScheduler(optimizer, decay_rate, patience, lr_min=1e-12, mode="min")
    lrs = []
    for epoch, metric in enumerate(metrics):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(epoch + 1, metric)
    return lrs


PLATEAU = dict(sched="plateau", patience_epochs=1, decay_rate=0.5, lr=1e-7, min_lr=1e-12, eval_metric="loss")


@pytest.mark.integration
def test_plateau_decays_the_lr_as_timms_plateau_on_the_runs_metrics_and_resumes_with_its_counters(tmp_path):
    """At lr 1e-7 the model barely learns and its eval loss wanders (the BatchNorm statistics move): the loss
    stops improving after epoch 1 and the lr halves after epoch 3. The run's lrs are timm's PlateauLRScheduler
    replayed on the run's own eval losses. Stopped after epoch 2 (one epoch without improvement counted) and
    resumed, it decays after epoch 3 as the uninterrupted run does: the resume point holds the patience counter
    that timm's own state_dict leaves out (the test fails without it)."""
    straight = train(small_cnn(tmp_path, "straight", epochs=5, **PLATEAU))
    losses, lrs = [r["eval_loss"] for r in straight], [r["lr"] for r in straight]
    assert lrs == pytest.approx(plateau_lrs(losses, patience=1, decay_rate=0.5, lr=1e-7), rel=1e-12)
    assert lrs[:4] == [1e-7, 1e-7, 1e-7, 5e-8]  # the plateau met after epoch 3, as the docstring says

    train(small_cnn(tmp_path, "resumed", epochs=2, **PLATEAU))
    resumed = train(small_cnn(tmp_path, "resumed", epochs=5, resume="auto", **PLATEAU))
    assert [(r["epoch"], r["lr"], r["eval_loss"]) for r in resumed] == [
        (r["epoch"], r["lr"], r["eval_loss"]) for r in straight
    ]


def test_plateau_options_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="^--patience-epochs must be >= 0, got -1$"):
        small_cnn(tmp_path, sched="plateau", patience_epochs=-1)
    with pytest.raises(ConfigError, match="^--sched plateau cannot be combined with --reparametrize-at-epoch"):
        small_cnn(tmp_path, sched="plateau", epochs=2, reparametrize="tcnn", reparametrize_at_epoch=1)


# ------------------------------------------------------------------------------------------ checkpoints
@pytest.mark.integration
def test_checkpoint_hist_keeps_the_points_of_the_k_best_evaluations(tmp_path):
    cfg = small_cnn(tmp_path, epochs=5, lr=0.05, eval_metric="loss", keep_checkpoints=1, checkpoint_hist=3, bn_eps=1e-3)
    records = train(cfg)
    rebuilt, _ = build_run_model(RunDir(tmp_path / "run"), "best", load_families())  # as evaluation commands rebuild it
    assert {m.eps for m in rebuilt.modules() if isinstance(m, nn.BatchNorm2d)} == {1e-3}
    losses = {r["epoch"]: r["eval_loss"] for r in records}
    best_three = sorted(losses, key=losses.get)[:3]
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("epoch_*") if p.is_dir())
    assert kept == sorted({f"epoch_{e:04d}" for e in [*best_three, 5]})
    state = load_training_state(tmp_path / "run" / "checkpoints" / "epoch_0005")
    assert [e["epoch"] for e in state["ranked"]] == best_three
    assert len(kept) > 2  # more than the newest and the best: the history is kept

    one = small_cnn(tmp_path, "one", epochs=5, lr=0.05, eval_metric="loss", keep_checkpoints=1, checkpoint_hist=1)
    losses = {r["epoch"]: r["eval_loss"] for r in train(one)}
    kept = sorted(p.name for p in (tmp_path / "one" / "checkpoints").glob("epoch_*") if p.is_dir())
    assert kept == sorted({f"epoch_{min(losses, key=losses.get):04d}", "epoch_0005"})


# ------------------------------------------------------------------------------------------------ model
def build(cfg: Config, in_chans: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return modeling.create_model(cfg, num_classes=10, in_chans=in_chans)


@pytest.mark.integration
def test_gp_is_kept_by_every_command_that_rebuilds_the_run(tmp_path):
    """--gp catavgmax doubles test_resnet's classifier input, so its weights load only into a model built with
    it: the run rebuilt (RunDir.build_model), its model_spec (diagnostics), --eval-only RUN and robustness's
    clean accuracy all give the run's own top-1."""
    import csv
    import json

    from convbias.cli import train as train_command
    from convbias.engine import parse_config
    from convbias.studies.robustness import command as robustness

    cfg = small_cnn(tmp_path, gp="catavgmax")
    records = train(cfg)
    run = RunDir(cfg.output)
    model, _ = build_run_model(run, "last", load_families())
    assert model.get_classifier().in_features == 2 * model.num_features  # average and max pools concatenated
    assert run_model_spec(run)["model_kwargs"] == {"global_pool": "catavgmax"}
    assert parse_config(["--eval-only", cfg.output]).gp == "catavgmax"
    evaluated = train_command.run(["--eval-only", cfg.output, "--workers", "0"])
    assert evaluated["eval_top1"] == pytest.approx(records[-1]["eval_top1"])
    studied = tmp_path / "robustness"
    argv = [cfg.output, "--attacks", "none", "--corruptions", "none", "--workers", "0", "--output", str(studied)]
    assert robustness.main(argv) == 0
    with open(studied / "robustness.csv", newline="") as file:
        clean = float(next(csv.DictReader(file))["clean"])
    assert clean == pytest.approx(json.loads((Path(cfg.output) / "results.json").read_text())["final_top1"], abs=0.01)


def test_bn_eps_and_momentum_set_every_batchnorm_layer(tmp_path):
    reference = build(small_cnn(tmp_path))
    model = build(small_cnn(tmp_path, bn_eps=1e-3, bn_momentum=0.01))
    layers = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert layers and all(m.eps == 1e-3 and m.momentum == 0.01 for m in layers)
    assert all(m.eps == 1e-5 and m.momentum == 0.1 for m in reference.modules() if isinstance(m, nn.BatchNorm2d))
    images = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    for m in reference.modules():  # the eval output with eps = 1e-3: the same weights with their eps set by hand
        if isinstance(m, nn.BatchNorm2d):
            m.eps = 1e-3
    assert torch.equal(model.eval()(images), reference.eval()(images))
    with pytest.raises(ConfigError, match="^--bn-eps: convit_tiny has no BatchNorm layers; run without it$"):
        build(Config(model="convit_tiny", bn_eps=1e-3), in_chans=3)
    with pytest.raises(ConfigError, match=r"^--bn-momentum must be in \(0, 1\], got 0.0$"):
        small_cnn(tmp_path, bn_momentum=0.0)


def test_head_init_bias_sets_the_classifiers_bias_only(tmp_path):
    reference, model = build(small_cnn(tmp_path)), build(small_cnn(tmp_path, head_init_bias=-2.0))
    assert torch.equal(model.fc.bias, torch.full((10,), -2.0))
    for name, value in reference.state_dict().items():
        if name != "fc.bias":
            assert torch.equal(model.state_dict()[name], value), name
    both = build(small_cnn(tmp_path, head_init_bias=1.0, head_init_scale=0.5))  # timm: scaled, then the bias set
    assert torch.equal(both.fc.bias, torch.ones(10)) and torch.equal(both.fc.weight, reference.fc.weight * 0.5)


def test_pin_mem_decides_whether_the_loaders_pin_on_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(loaders.torch.cuda, "is_available", lambda: True)  # as on a GPU node: the loaders'
    for pin in (True, False):
        data = build_trainer(start_run(small_cnn(tmp_path, pin_mem=pin), load_families(), None)).data
        assert data.train_loader.pin_memory is pin and data.eval_loader.pin_memory is pin
