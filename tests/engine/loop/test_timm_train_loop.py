"""The training loop against timm's train.py's: gradient accumulation as its ``train_one_epoch`` does it (every
batch trained on, the epoch's last update from the batches that remain with their own loss scaling), the update
count and the per-update schedule its ``main`` builds, Lookahead synced at each epoch's end; and a resume point
just before an epoch's last, short update continues exactly."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from timm.optim import create_optimizer_v2, optimizer_kwargs
from timm.scheduler import create_scheduler_v2, scheduler_kwargs

from convbias import engine
from convbias.base.errors import Preempted
from convbias.base.run_layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LAST_LINK,
    TIMM_ARGS_FILE,
    TIMM_ARGS_MARKER,
    WEIGHTS_FILE,
)
from convbias.engine import parse_config
from convbias.engine.config.timm_train_options import TIMM_TRAIN_DEFAULTS
from convbias.engine.data.device_augment import DeviceBatches
from convbias.engine.data.loaders import epoch_batches
from convbias.engine.loop.trainer import accumulation
from convbias.engine.optim.factory import main_lr
from convbias.engine.rundir.run_files import foreign_entry
from convbias.families import load_families

pytestmark = pytest.mark.usefixtures("single_thread")

# 5 batches of 16 per epoch, 2 per update: timm makes 3 updates an epoch, the last from the 5th batch alone
ACCUMULATED = dict(
    batch_size=16,
    train_fraction=0.06,
    grad_accum_steps=2,
    epochs=2,
    warmup_epochs=1,
    sched_on_updates=True,
    opt="lookahead_sgd",
    lr=0.05,
    no_diagnostics=True,
)


def timm_train_one_epoch(epoch, model, batches, optimizer, args, lr_scheduler, loss_fn, lrs):
    """timm's train.py ``train_one_epoch`` (at TIMM_TRAIN_COMMIT) on one process without AMP, clipping or EMA:
    its accumulation (``accum_steps``, ``last_accum_steps``, ``need_update``), its update count and schedule steps,
    ``sync_lookahead`` at the end; the lr after each update is appended to ``lrs``."""
    accum_steps = args.grad_accum_steps
    last_accum_steps = len(batches) % accum_steps
    updates_per_epoch = (len(batches) + accum_steps - 1) // accum_steps
    num_updates = epoch * updates_per_epoch
    last_batch_idx = len(batches) - 1
    last_batch_idx_to_accum = len(batches) - last_accum_steps
    optimizer.zero_grad()
    for batch_idx, (input, target) in enumerate(batches):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        if batch_idx >= last_batch_idx_to_accum:
            accum_steps = last_accum_steps
        loss = loss_fn(model(input), target)
        if accum_steps > 1:
            loss /= accum_steps
        loss.backward()
        if not need_update:
            continue
        optimizer.step()
        num_updates += 1
        optimizer.zero_grad()
        lr_scheduler.step_update(num_updates=num_updates)
        lrs.append(optimizer.param_groups[0]["lr"])
    if hasattr(optimizer, "sync_lookahead"):
        optimizer.sync_lookahead()
    return num_updates


def argv(cli_argv, tmp_path, name: str, **options) -> list[str]:
    return cli_argv(cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, ACCUMULATED, output=tmp_path / name, **options)


@pytest.fixture(scope="module")
def accumulated_run(cli_argv, tmp_path_factory):
    """The engine's run (its lr after every update recorded) and timm's loop on the same batches from the same
    initial weights, with timm's optimizer and the schedule timm's main builds for its loader's length."""
    from convbias.engine.loop.start import start_run
    from convbias.engine.loop.trainer import build_trainer

    tmp_path = tmp_path_factory.mktemp("accumulated")
    trainer = build_trainer(start_run(parse_config(argv(cli_argv, tmp_path, "run")), load_families(), None))
    cfg, data, device = trainer.cfg, trainer.data, trainer.accelerator.device
    timm_model = copy.deepcopy(trainer.models.whole_model())
    epochs = [
        list(
            DeviceBatches(epoch_batches(data.train_loader, e, 0, data.steps_per_epoch, cfg.seed), device, data.augment)
        )
        for e in range(cfg.epochs)
    ]
    lrs, scheduler = [], trainer.optimization.scheduler
    step_update = type(scheduler).step_update

    def recorded(self, num_updates, metric=None):  # the run's main lr after each update's schedule step
        step_update(self, num_updates, metric)
        if self is scheduler:
            lrs.append(main_lr(trainer.optimization.optimizer.param_groups))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(scheduler), "step_update", recorded)
        trainer.fit()

    args = SimpleNamespace(
        **{**TIMM_TRAIN_DEFAULTS, **{k: getattr(cfg, k) for k in TIMM_TRAIN_DEFAULTS if hasattr(cfg, k)}}
    )
    optimizer = create_optimizer_v2(timm_model, **optimizer_kwargs(args))
    updates_per_epoch = (len(data.train_loader) + args.grad_accum_steps - 1) // args.grad_accum_steps  # its main's
    timm_scheduler, _ = create_scheduler_v2(optimizer, **scheduler_kwargs(args), updates_per_epoch=updates_per_epoch)
    timm_lrs, loss_fn = [], torch.nn.CrossEntropyLoss()
    for epoch, batches in enumerate(epochs):
        timm_train_one_epoch(epoch, timm_model.train(), batches, optimizer, args, timm_scheduler, loss_fn, timm_lrs)
    theirs = SimpleNamespace(model=timm_model, lrs=timm_lrs, scheduler=timm_scheduler, batches=len(epochs[0]))
    return SimpleNamespace(trainer=trainer, lrs=lrs, theirs=theirs, output=tmp_path / "run")


def test_accumulation_trains_every_batch_with_timms_updates_and_schedule(accumulated_run):
    trainer, theirs = accumulated_run.trainer, accumulated_run.theirs
    assert theirs.batches == trainer.data.steps_per_epoch == 5
    assert trainer.data.updates_per_epoch == 3 and trainer.progress.num_updates == 6  # 3 per epoch, as timm
    ours = trainer.optimization.scheduler
    assert (ours.t_initial, ours.warmup_t) == (theirs.scheduler.t_initial, theirs.scheduler.warmup_t) == (6, 3)
    assert accumulated_run.lrs == pytest.approx(theirs.lrs, rel=1e-12) and len(theirs.lrs) == 6
    weights = trainer.models.whole_model().state_dict()
    for name, value in theirs.model.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)


class Recorded(torch.optim.SGD):
    """SGD that records the gradient each update takes."""

    def __init__(self, params):
        super().__init__(params, lr=1.0)
        self.gradients = []

    def step(self, closure=None):
        self.gradients.append(self.param_groups[0]["params"][0].grad.item())
        return super().step(closure)


@pytest.mark.parametrize("batches, accum_steps", [(15, 2), (5, 2), (8, 3), (7, 3)])
def test_the_accumulation_groups_are_timms(batches, accum_steps):
    """Batch b's loss is 2**b x w: each update's gradient in timm's loop names the batches it averages and their
    divisor, which the engine's groups give (15 batches by 2: 8 updates, the last of one batch, undivided)."""
    weight = torch.nn.Linear(1, 1, bias=False)
    data = [(torch.ones(1, 1), torch.tensor([[2.0**b]])) for b in range(batches)]
    optimizer = Recorded(weight.parameters())
    args = SimpleNamespace(grad_accum_steps=accum_steps)
    scheduler = SimpleNamespace(step_update=lambda num_updates: None)
    timm_train_one_epoch(
        0, weight, data, optimizer, args, scheduler, lambda output, target: (output * target).sum(), []
    )
    ours, pending = [], 0.0
    for step in range(batches):
        update, group = accumulation(step, batches, accum_steps)
        pending += 2.0**step / group
        if update:
            ours, pending = [*ours, pending], 0.0
    assert ours == pytest.approx(optimizer.gradients, rel=1e-6)
    assert len(ours) == (batches + accum_steps - 1) // accum_steps


def test_a_resume_point_before_the_epochs_last_short_update_continues_exactly(
    accumulated_run, cli_argv, tmp_path, monkeypatch
):
    """Stopped after the 5th update (4 of the 5 batches of epoch 2, the 5th left to its own update), resumed:
    the weights of the run that never stopped."""
    from convbias.engine.loop.preemption import PreemptionSignals

    stopped = argv(cli_argv, tmp_path, "stopped")
    with monkeypatch.context() as patched:
        patched.setattr(PreemptionSignals, "requested", lambda self, accelerator, updates: updates == 5)
        with pytest.raises(Preempted) as preempted:
            engine.run(stopped, load_families())
    assert (preempted.value.epoch, preempted.value.step) == (1, 4)
    engine.run([*stopped, "--resume", "auto"], load_families())
    resumed = load_file(tmp_path / "stopped" / CHECKPOINTS_DIR / LAST_LINK / WEIGHTS_FILE)
    uninterrupted = load_file(accumulated_run.output / CHECKPOINTS_DIR / LAST_LINK / WEIGHTS_FILE)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)


def test_the_run_writes_its_args_yaml_for_timms_train_py_beside_its_config(accumulated_run):
    """The run's args.yaml (tests/engine/config/test_timm_args_yaml.py reads it as timm's train.py does): marked as this engine's,
    what timm cannot express at its top, and read back with -c to the run of its config.yaml but for those."""
    output = accumulated_run.output
    lines = (output / TIMM_ARGS_FILE).read_text().splitlines()
    assert lines[0] == TIMM_ARGS_MARKER and "--train-fraction 0.06" in lines[1]
    assert foreign_entry(output) is None  # the folder holds only files train.py writes: it may be started over
    from_args, from_config = (parse_config(["-c", str(output / name)]) for name in (TIMM_ARGS_FILE, CONFIG_FILE))
    differ = {k for k, v in from_args.to_dict().items() if v != from_config.to_dict()[k]}
    assert differ == {"config", "train_fraction", "diagnostics", "mean", "std"}  # listed, or resolved (same values)
    assert from_args.replace(train_fraction=0.06, diagnostics=False, mean=None, std=None, config=None) == (
        from_config.replace(config=None)
    )
