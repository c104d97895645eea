"""The training loop's own costs, guarded without a GPU: host-device synchronizations per step (a dispatch
recorder of the calls that read a tensor's value on the host), loader workers kept across epochs and
evaluations, preemption decided every PREEMPTION_CHECK_INTERVAL updates, and benchmarks/train_loop.py."""

from __future__ import annotations

import copy
import importlib
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from support import REPO
from torch.utils._python_dispatch import TorchDispatchMode

from convbias.engine import parse_config

pytestmark = pytest.mark.usefixtures("single_thread")
ROOT = REPO

# The DeiT recipe's per-step work at the tiny ConViT's scale: device RandAugment and erasing, mixup/cutmix,
# label smoothing, drop-path, gradient clipping and an EMA
DEIT_STEP = dict(
    aa="rand-m9-mstd0.5-inc1",
    reprob=0.25,
    mixup=0.8,
    cutmix=1.0,
    smoothing=0.1,
    drop_path=0.1,
    clip_grad=1.0,
    model_ema=True,
    color_jitter=0,
)


# ops whose output's size depends on the input's values: on a GPU each waits for the device
VALUE_SIZED_OPS = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave"}


class HostReads(TorchDispatchMode):
    """Counts the calls that synchronize with a GPU: reads of a tensor's value on the host (``.item()``,
    ``float()``, ``bool()``: ``aten._local_scalar_dense``), leaving out tensors that live on the host on every
    device (the optimizer's step counters: torch keeps them on the CPU), and the ops of VALUE_SIZED_OPS."""

    def __init__(self, host_tensors: list[torch.Tensor]):
        super().__init__()
        self.host_pointers = {t.data_ptr() for t in host_tensors}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += args[0].data_ptr() not in self.host_pointers
        elif func.__name__.split(".")[0] in VALUE_SIZED_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


class HostData(TorchDispatchMode):
    """Records the tensors built from Python data (``torch.tensor``, ``new_tensor``: ``aten.lift_fresh``):
    on a GPU each is a copy from pageable host memory, which waits for the device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.lift_fresh.default
        return func(*args, **(kwargs or {}))


def test_device_rand_augment_ops_build_no_tensor_from_host_data():
    """Every batched RandAugment op runs from its device arguments and Python scalars alone, so that a
    GPU step queues it without waiting (the host's sampled plan reaches the device in one copy per group)."""
    from convbias.engine.data.rand_augment import OPS, OpContext

    torch.manual_seed(0)
    images = torch.randint(0, 256, (4, 3, 12, 10)).float()
    ctx = OpContext(fill=torch.full((1, 3, 1, 1), 124.0), interpolation="bilinear")
    arguments = torch.tensor([0.3, 0.9, 1.4, 2.0])  # a factor, bits, degrees or pixels, by op
    for name, op in OPS.items():
        recorder = HostData()
        with recorder:
            op(images.clone(), arguments, ctx)
        assert recorder.count == 0, f"{name} builds {recorder.count} tensors from host data"


def optimizer_steps(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [state["step"] for state in optimizer.state.values() if torch.is_tensor(state.get("step"))]


def build(cli_argv, tmp_path, **options):
    from convbias.engine.loop.start import start_run
    from convbias.engine.loop.trainer import build_trainer
    from convbias.families import load_families

    argv = cli_argv(
        cli_argv.DEIT_RECIPE,
        cli_argv.TINY_CONVIT,
        cli_argv.PLAIN_DIGITS,
        dict(batch_size=16, output=tmp_path / "run"),
        options,
    )
    return build_trainer(start_run(parse_config(argv), load_families(), None))


@pytest.mark.integration
@pytest.mark.slow
def test_an_epoch_reads_device_values_only_at_the_loss_checks(cli_argv, tmp_path):
    """With the DeiT recipe's step, one epoch reads a device value on the host only at the loss checks
    (every LOSS_CHECK_INTERVAL steps and at the epoch's end), so a GPU queues work ahead between them. The
    loader's transforms run in a worker (on the host on every device, as in a GPU run)."""
    from convbias.engine.loop.trainer import LOSS_CHECK_INTERVAL

    trainer = build(cli_argv, tmp_path, no_aug=False, train_fraction=0.15, epochs=2, workers=1, **DEIT_STEP)
    steps = trainer.data.steps_per_epoch
    assert steps > LOSS_CHECK_INTERVAL and trainer.data.augment is not None and trainer.optimization.mixup
    trainer.train_one_epoch(0, 0)  # the optimizer's state exists from here on
    reads = HostReads(optimizer_steps(trainer.optimization.optimizer.optimizer))
    with reads:
        trainer.train_one_epoch(1, 0)
    checks = steps // LOSS_CHECK_INTERVAL + (steps % LOSS_CHECK_INTERVAL != 0)
    assert reads.count == checks, f"{reads.count} host reads in {steps} steps, expected {checks}"


def benchmark(name: str):
    """benchmarks/<name>.py as a module (the benchmarks import their neighbours by name)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.integration
@pytest.mark.slow
def test_the_step_outside_the_model_launches_no_kernel_per_parameter(cli_argv, tmp_path):
    """With the DeiT recipe's step (mixup/cutmix, clipping, AdamW, zero_grad, the EMA, the bookkeeping), a model
    with about 3x the parameter tensors launches as many kernels outside its forward and backward, priced as
    benchmarks/step_cost.py prices them: multi-tensor ops, no loop over the parameters."""
    step_cost = benchmark("step_cost")
    kernels, tensors = {}, {}
    for depth in (2, 8):
        blocks = dict(cli_argv.TINY_CONVIT["model_kwargs"], depth=depth)
        options = dict(no_aug=False, train_fraction=0.15, model_kwargs=blocks, **DEIT_STEP)
        trainer = build(cli_argv, tmp_path / str(depth), **options)
        costs, *_ = step_cost.price_step(trainer)
        kernels[depth] = {phase: step_cost.kernels(costs[phase]) for phase in step_cost.OUTSIDE_THE_MODEL}
        tensors[depth] = len(list(trainer.models.model.parameters()))
    assert tensors[8] > 2.5 * tensors[2], tensors
    assert kernels[8] == kernels[2], f"kernels outside the model by phase: {kernels}"
    assert kernels[2]["optimizer"] > 0 and kernels[2]["ema"] > 0 and kernels[2]["mixup"] > 0, kernels


@pytest.mark.parametrize(
    ("opt_kwargs", "foreach", "fused"),
    [(None, True, None), ({"fused": True}, None, True), ({"foreach": False}, False, None)],
)
def test_the_optimizer_is_multi_tensor_unless_opt_kwargs_choose(cli_argv, opt_kwargs, foreach, fused):
    """torch's multi-tensor AdamW on every device (torch picks it by itself on CUDA only); --opt-kwargs
    fused=True or foreach=False are passed as given."""
    from convbias.engine.optim.factory import create_optimizer

    cfg = parse_config(cli_argv(cli_argv.DEIT_RECIPE, model="convit_tiny", opt_kwargs=opt_kwargs))
    optimizer = create_optimizer(cfg, torch.nn.Linear(3, 3), 1e-3)
    assert (optimizer.defaults["foreach"], optimizer.defaults["fused"]) == (foreach, fused)


def test_the_multi_tensor_update_is_timms_update(cli_argv):
    """Three AdamW updates of the engine's optimizer (multi-tensor) equal those of timm's factory's (which loops
    over the parameters on the CPU), bit for bit."""
    from timm.optim import create_optimizer_v2

    from convbias.engine.optim.factory import create_optimizer

    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    theirs = copy.deepcopy(ours)
    cfg = parse_config(cli_argv(cli_argv.DEIT_RECIPE, model="convit_tiny"))
    optimizers = [
        create_optimizer(cfg, ours, 1e-2),
        create_optimizer_v2(theirs, opt="adamw", lr=1e-2, weight_decay=cfg.weight_decay, eps=cfg.opt_eps),
    ]
    assert optimizers[0].defaults["foreach"] and not optimizers[1].defaults["foreach"]
    for _ in range(3):
        x = torch.randn(4, 6)
        for model, optimizer in zip((ours, theirs), optimizers):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, mine), timms in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(mine, timms), name


class Positions(torch.utils.data.Dataset):
    """Sample i: (i, a random draw of its transform, the loading process's id)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, torch.rand(()).item(), os.getpid()], dtype=torch.float64)


def test_loader_workers_persist_across_epochs_and_evaluations_with_the_same_batches():
    """The train loader's workers start once: the same processes serve a partly read epoch (as a run that
    skips the last batches), the next one and a mid-epoch restart, and each epoch's samples and their
    augmentation draws are those of a loader without workers. The eval loader's workers serve every
    evaluation."""
    from convbias.engine.data.loaders import build_eval_loader, build_train_loader, epoch_batches

    def epoch(loader, number, first=0, count=10):
        return torch.cat(list(epoch_batches(loader, number, first, count)))

    loader = build_train_loader(Positions(), batch_size=4, workers=2, seed=3)
    reference = build_train_loader(Positions(), batch_size=4, workers=0, seed=3)
    partial, second, restarted = epoch(loader, 0, count=3), epoch(loader, 1), epoch(loader, 1, first=4, count=6)
    pids = {int(p) for p in torch.cat([partial, second, restarted])[:, 2].tolist()}
    assert len(pids) == 2 and os.getpid() not in pids
    torch.testing.assert_close(second[:, :2], epoch(reference, 1)[:, :2], rtol=0, atol=0)
    torch.testing.assert_close(restarted, second[16:], rtol=0, atol=0)
    assert not torch.equal(partial[:, 0], second[:12, 0])  # the epochs' orders differ

    evaluation = build_eval_loader(Positions(), batch_size=8, workers=2)
    first_pass, second_pass = torch.cat(list(evaluation)), torch.cat(list(evaluation))
    assert first_pass[:, 0].tolist() == list(range(40))
    assert (
        set(first_pass[:, 2].tolist()) == set(second_pass[:, 2].tolist()) and len(set(first_pass[:, 2].tolist())) == 2
    )


class Draws(torch.utils.data.Dataset):
    """Sample i: (i, a draw from Python's, numpy's and torch's global RNGs)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, random.random(), np.random.rand(), torch.rand(()).item()], dtype=torch.float64)


def test_a_loader_without_workers_draws_each_sample_under_its_seed_and_leaves_the_global_rngs_as_they_were():
    """With workers=0 the transforms draw from the process's global RNGs: each sample draws what its own
    seed gives, and the run's streams (drop path, mixup) continue after an epoch as if nothing was loaded."""
    from convbias.engine.data.loaders import build_train_loader, epoch_batches, seeded_rngs

    loader = build_train_loader(Draws(), batch_size=4, workers=0, seed=7)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    before = random.random(), np.random.rand(), torch.rand(())
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    batches = torch.cat(list(epoch_batches(loader, 1, 0, 3)))
    assert (random.random(), np.random.rand(), torch.rand(())) == before
    loader.sampler.set_epoch(1)
    for row, (index, seed) in zip(batches.tolist(), loader.sampler, strict=True):
        with seeded_rngs(seed):
            assert row == [index, random.random(), np.random.rand(), torch.rand(()).item()]


class TwoRanks:
    """accelerate's reduce as two processes see it when the other rank has received a signal."""

    num_processes, device = 2, torch.device("cpu")

    def __init__(self):
        self.reductions = 0

    def reduce(self, flag: torch.Tensor, reduction: str) -> torch.Tensor:
        self.reductions += 1
        return flag + 1


def test_several_processes_decide_on_preemption_together_every_interval():
    """Every rank calls requested() after every update; with several processes they reduce and read the
    flag only every PREEMPTION_CHECK_INTERVAL updates, and stop at that update; one process reads its own
    flag at every update, with no collective."""
    import signal
    from types import SimpleNamespace

    from convbias.engine.loop.preemption import PREEMPTION_CHECK_INTERVAL, PreemptionSignals

    signals, ranks = PreemptionSignals([signal.SIGUSR1]), TwoRanks()
    updates = range(1, 3 * PREEMPTION_CHECK_INTERVAL + 1)
    decisions = [signals.requested(ranks, update) for update in updates]
    assert decisions == [update % PREEMPTION_CHECK_INTERVAL == 0 for update in updates]
    assert ranks.reductions == 3
    alone = SimpleNamespace(num_processes=1)
    assert not signals.requested(alone, 1)
    signals.received = signal.SIGUSR1
    assert signals.requested(alone, 1)


@pytest.mark.slow
def test_gpu_acceptance_script_parses_and_runs_its_steps_on_the_cpu(tmp_path):
    """benchmarks/gpu_acceptance.sh is valid bash, and in its CPU smoke mode a chosen step runs and one that
    fails (a missing test file) neither stops the next one nor the summary; a step with no time left is
    skipped and listed."""
    script = ROOT / "benchmarks" / "gpu_acceptance.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    environment = dict(
        os.environ,
        OUT=str(tmp_path),
        CPU_SMOKE="1",
        STEPS="jpegs gpu-tests",
        PYTHON=sys.executable,
        # pytest fails on the missing file; --noconftest spares it importing the fixtures' torch first
        GPU_TESTS="--noconftest tests/no_such_test_file.py",
    )
    done = subprocess.run(["bash", str(script)], env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = {line.split(",")[0]: line.split(",")[1] for line in (tmp_path / "summary.csv").read_text().splitlines()[1:]}
    assert rows["jpegs"] == "0" and rows["gpu-tests"] != "0", rows
    assert len(list((tmp_path / "jpegs" / "train").glob("c*/*.jpg"))) == 32
    # the skip is the script's clock alone: `true` as the interpreter spares the version lines' imports
    no_time = dict(environment, LIMIT="5", STEPS="jpegs", PYTHON="true")
    skipped = subprocess.run(["bash", str(script)], env=no_time, capture_output=True, text=True, timeout=60)
    assert "jpegs,skipped" in (tmp_path / "summary.csv").read_text(), skipped.stdout
