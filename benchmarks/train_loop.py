"""The engine's training loop against its model's bare step, side by side in one process.

The engine side is what train.py builds (``start_run`` and ``build_trainer``: loaders with workers,
accelerate, the recipe's mixup/cutmix, loss and optimizer, the device half of the input pipeline), with one
change: its train set is synthetic uint8 crops held in memory (what the fast path's workers produce), so no
decoding is timed. Each round times one engine epoch (``Trainer.train_one_epoch``) of ``--steps`` steps.

The bare step is the same model (the same module and compiled view, the same weights, precision, optimizer
and thread count) on one batch already on the device: device augmentation, mixup/cutmix, forward, loss,
backward, optimizer step, ``--steps`` times. It does the recipe's augmentation work too, so the ratio
(engine over bare step, the median over rounds of the paired ratios) is the loop's overhead: the loader,
its workers and its copies, accelerate's wrappers, the schedule, the loss bookkeeping and checks.
The bare model step without augmentation (what benchmarks/convit_train_step.py times) is printed beside it.

Where the time goes: two more epochs of each side under torch.profiler (the faster one shown), summed
over the step's ranges (engine.loop.trainer.STEP_RANGES); on CUDA the ranges' device time too, and the synchronizing calls of one
engine epoch under ``torch.cuda.set_sync_debug_mode("warn")``.

    python benchmarks/train_loop.py --quick                      # ConViT-Ti at 32/p4 on the CPU, DeiT recipe
    python benchmarks/train_loop.py --device cuda --precision bf16 --img-size 224 --patch-size 16 \\
        --batch-size 256 --steps 30 [--compile] [--no-recipe]

The last line is ``ratio R``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parent.parent
DEIT_RECIPE = ROOT / "configs" / "train" / "convit" / "deit_recipe.yaml"
NUM_CLASSES = 1000  # ImageNet's head
# The recipe "off": no RandAugment, erasing, mixup/cutmix, smoothing, drop-path or repeated augmentation
RECIPE_OFF = {
    "aa": "none",
    "color_jitter": "0",
    "reprob": "0",
    "mixup": "0",
    "cutmix": "0",
    "smoothing": "0",
    "drop_path": "0",
    "repeated_aug": "1",
}
DEFAULTS = dict(img_size=224, patch_size=16, batch_size=256, steps=30, rounds=5, workers=8, threads=None)
PROFILED_ROUNDS = 2  # profiled epochs a side, in turn; the table shows each side's fastest
QUICK = dict(img_size=32, patch_size=4, batch_size=16, steps=5, rounds=5, workers=1, threads=1)  # ConViT-Ti, small


class UInt8Crops(Dataset):
    """In-memory uint8 (C, S, S) crops and labels: the fast path's worker output without decoding."""

    def __init__(self, count: int, in_chans: int, size: int, num_classes: int, seed: int = 0, as_float: bool = False):
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (count, in_chans, size, size), dtype=torch.uint8, generator=generator)
        if as_float:  # a val set as the eval transform leaves it
            self.images = self.images.float().div_(255)
        self.targets = torch.randint(0, num_classes, (count,), generator=generator).tolist()
        self.classes = [f"c{i}" for i in range(num_classes)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        return self.images[index], self.targets[index]


def engine_argv(args: argparse.Namespace, work: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """train.py's command line for ``args`` (a patch size of None: the model's own), then ``extra``."""
    options = {
        "model": args.model,
        "img_size": str(args.img_size),
        "batch_size": str(args.batch_size),
        "workers": str(args.workers),
        "epochs": "1000",
        "warmup_epochs": "0",
        "mixed_precision": "bf16" if args.precision == "bf16" else "no",
        "data_dir": str(work / "data"),
        "output": str(work / "run"),
        "seed": "0",
    }
    if args.patch_size is not None:
        options["model_kwargs"] = f"patch_size={args.patch_size}"
    if not args.recipe:
        options.update(RECIPE_OFF)
    argv = ["-c", str(DEIT_RECIPE)]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", value]
    argv += ["--no-diagnostics", "--preempt-signals"]  # no signal handlers in a benchmark
    return argv + (["--compile"] if args.compile else []) + list(extra)


def build_engine(args: argparse.Namespace, work: Path, extra: tuple[str, ...] = ()):
    """The Trainer train.py would build with ``extra`` options, on UInt8Crops (``--steps`` batches an epoch)."""
    from convbias.engine import parse_config
    from convbias.engine.data import build as data_build
    from convbias.engine.data import factory as engine_data
    from convbias.engine.loop.start import start_run
    from convbias.engine.loop.trainer import build_trainer
    from convbias.families import load_families

    for split in ("train", "val"):
        (work / "data" / split / "c0").mkdir(parents=True, exist_ok=True)
    cfg = parse_config(engine_argv(args, work, extra))

    def synthetic(cfg):
        shape = engine_data.input_format(cfg)
        device_spec = engine_data.augment_spec(cfg) if engine_data.fast_path_reason(cfg) is None else None
        if device_spec is None:
            raise SystemExit("train_loop.py: this configuration does not take the fast input path")
        count = args.steps * args.batch_size
        train = UInt8Crops(count, shape.in_chans, shape.img_size, NUM_CLASSES)
        val = UInt8Crops(args.batch_size, shape.in_chans, shape.img_size, NUM_CLASSES, seed=1, as_float=True)
        classes = list(train.classes)
        return engine_data.DataBundle(
            train, val, NUM_CLASSES, shape.in_chans, classes, shape.mean, shape.std, device_spec
        )

    with mock.patch.object(data_build, "build_datasets", synthetic):
        trainer = build_trainer(start_run(cfg, load_families(), None))
    trainer.models.model.train()
    return trainer


class BareStep:
    """The trainer's model, optimizer, loss, mixup and device augmentation, called directly on one batch."""

    def __init__(self, trainer, augmented: bool = True):
        acc, data = trainer.accelerator, trainer.data
        self.device = acc.device
        self.model = trainer.models.forward  # the compiled view under --compile: compiled once, shared
        self.optimizer = trainer.optimization.optimizer.optimizer  # torch's, not accelerate's wrapper
        self.loss = trainer.optimization.train_loss
        self.mixup = trainer.optimization.mixup if augmented else None
        self.augment = data.augment if augmented else None
        self.autocast = acc.autocast
        images, targets = next(iter(torch.utils.data.DataLoader(data.bundle.train, batch_size=trainer.cfg.batch_size)))
        self.images, self.targets = images.to(self.device), targets.to(self.device)
        spec = data.augment.spec
        self.mean = torch.tensor(spec.mean, device=self.device).view(1, -1, 1, 1)
        self.std = torch.tensor(spec.std, device=self.device).view(1, -1, 1, 1)
        self.plain_targets = self.targets
        if self.mixup is None and trainer.optimization.mixup is not None:  # the loss wants soft targets
            self.plain_targets = trainer.optimization.mixup(images.float().to(self.device), self.targets)[1]

    def step(self) -> None:
        if self.augment is not None:
            with record_function("device_augment"):
                images = self.augment(self.images)
        else:
            images = (self.images.float() / 255 - self.mean) / self.std
        targets = self.plain_targets
        if self.mixup is not None:
            with record_function("mixup"):
                images, targets = self.mixup(images, self.targets)
        with record_function("forward_backward"):
            with self.autocast():
                outputs = self.model(images)
            self.loss(outputs, targets).backward()
        with record_function("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_engine_epoch(trainer, epoch: int) -> float:
    synchronize(trainer.accelerator.device)
    started = time.perf_counter()
    trainer.train_one_epoch(epoch, 0)
    synchronize(trainer.accelerator.device)
    return time.perf_counter() - started


def time_bare(bare: BareStep, steps: int) -> float:
    synchronize(bare.device)
    started = time.perf_counter()
    for _ in range(steps):
        bare.step()
    synchronize(bare.device)
    return time.perf_counter() - started


def profile_ranges(run, device: torch.device) -> tuple[dict[str, float], dict[str, float], float]:
    """Host seconds and device seconds per range name, and the wall seconds, of ``run()`` under the profiler."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        synchronize(device)
        started = time.perf_counter()
        run()
        synchronize(device)
        wall = time.perf_counter() - started
    from convbias.engine.loop.trainer import STEP_RANGES

    host, on_device = {}, {}
    for event in prof.key_averages():
        if event.key in STEP_RANGES:
            host[event.key] = event.cpu_time_total / 1e6
            on_device[event.key] = getattr(event, "device_time_total", 0.0) / 1e6
    return host, on_device, wall


def count_synchronizations(trainer, epoch: int, steps: int) -> None:
    """One engine epoch under torch.cuda.set_sync_debug_mode("warn"): the synchronizing calls, by place."""
    from convbias.engine.loop.trainer import LOSS_CHECK_INTERVAL

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_one_epoch(epoch, 0)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    checks = steps // LOSS_CHECK_INTERVAL + (steps % LOSS_CHECK_INTERVAL != 0)
    print(f"\nsynchronizing calls in one engine epoch of {steps} steps: {len(syncs)} (loss checks: {checks})")
    for place, count in Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs).most_common(8):
        print(f"  {count} at {place}")


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--compile", action="store_true", help="the engine's --compile (both sides)")
    parser.add_argument("--no-recipe", dest="recipe", action="store_false", help="the DeiT recipe's augmentation off")
    parser.add_argument("--model", default="convit_tiny")
    parser.add_argument("--img-size", type=int, default=None)
    parser.add_argument("--patch-size", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="steps per epoch (each side, each round)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (after one warmup round)")
    parser.add_argument("--workers", type=int, default=None, help="the engine's loader workers")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: the engine's choice)")
    parser.add_argument(
        "--no-profile", dest="profile", action="store_false", help="no profiled epochs (the where-the-time-goes table)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="ConViT-Ti at 32/p4, batch 16, one thread, on the CPU (1-3 min)"
    )
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():  # what the command line leaves unset
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.device = "cpu"
    small = [
        f"--{k.replace('_', '-')}"
        for k in ("batch_size", "steps", "rounds", "img_size", "patch_size")
        if getattr(args, k) < 1
    ]
    if small or args.workers < 0:
        parser.error(f"{', '.join(small) or '--workers'}: expected a positive number (--workers: 0 or more)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("train_loop.py: --device cuda but torch sees no GPU")
    os.environ["ACCELERATE_USE_CPU"] = "true" if args.device == "cpu" else "false"
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_engine(args, Path(tmp))
        device = trainer.accelerator.device
        bare, model_only = BareStep(trainer), BareStep(trainer, augmented=False)
        print(
            f"# {args.model} {args.img_size}/p{args.patch_size} batch {args.batch_size}, {args.steps} steps a side a "
            f"round, {args.rounds} rounds; {device} {args.precision}{' compiled' if args.compile else ' eager'}; "
            f"DeiT recipe {'on' if args.recipe else 'off'}; {args.workers} workers, {torch.get_num_threads()} threads; "
            f"torch {torch.__version__}",
            flush=True,
        )
        epoch = 0
        time_engine_epoch(trainer, epoch)  # warmup (and compile) of every side
        time_bare(bare, 2)
        time_bare(model_only, 2)
        engine_s, bare_s, model_s = [], [], []
        for round_number in range(args.rounds):
            epoch += 1
            engine_s.append(time_engine_epoch(trainer, epoch))
            bare_s.append(time_bare(bare, args.steps))
            model_s.append(time_bare(model_only, args.steps))
            print(
                f"round {round_number + 1}: engine {engine_s[-1]:.2f} s, bare step {bare_s[-1]:.2f} s, "
                f"bare model step {model_s[-1]:.2f} s",
                flush=True,
            )
        images = args.steps * args.batch_size
        ratios = [b / e for e, b in zip(engine_s, bare_s)]
        model_ratios = [m / e for e, m in zip(engine_s, model_s)]
        ratio = statistics.median(ratios)
        print("\n| side | img/s (median) | x bare step |")
        print("|---|---|---|")
        print(f"| engine loop | {images / statistics.median(engine_s):.1f} | {ratio:.3f} |")
        print(f"| bare step (same augmentation) | {images / statistics.median(bare_s):.1f} | 1.000 |")
        print(
            f"| bare model step (no augmentation) | {images / statistics.median(model_s):.1f} | "
            f"{statistics.median([m / b for m, b in zip(model_s, bare_s)]) ** -1:.3f} |"
        )
        print(f"\nengine / bare model step (no augmentation): {statistics.median(model_ratios):.3f}")
        print(f"paired ratios per round: {' '.join(f'{r:.3f}' for r in ratios)}")

        if device.type == "cuda":
            epoch += 1
            count_synchronizations(trainer, epoch, args.steps)
        if args.profile:
            engine_profiles, bare_profiles = [], []
            for _ in range(PROFILED_ROUNDS):
                epoch += 1
                engine_profiles.append(profile_ranges(lambda epoch=epoch: trainer.train_one_epoch(epoch, 0), device))
                bare_profiles.append(profile_ranges(lambda: [bare.step() for _ in range(args.steps)], device))
            engine = min(engine_profiles, key=lambda profiled: profiled[2])  # the least disturbed epoch of each side
            plain = min(bare_profiles, key=lambda profiled: profiled[2])
            from convbias.engine.loop.trainer import STEP_RANGES

            print(
                f"\nwhere the time goes (the faster of {PROFILED_ROUNDS} profiled epochs a side, ms per step; device ms on "
                f"{device.type})"
            )
            print("| range | engine host | bare host | engine device | bare device |")
            print("|---|---|---|---|---|")
            for name in STEP_RANGES:
                row = [side[k].get(name, 0.0) * 1e3 / args.steps for side in (engine, plain) for k in (0, 1)]
                print(f"| {name} | {row[0]:.2f} | {row[2]:.2f} | {row[1]:.2f} | {row[3]:.2f} |")
            outside = [(side[2] - sum(side[0].values())) * 1e3 / args.steps for side in (engine, plain)]
            print(f"| outside the ranges | {outside[0]:.2f} | {outside[1]:.2f} | | |")
            print(f"| wall | {engine[2] * 1e3 / args.steps:.2f} | {plain[2] * 1e3 / args.steps:.2f} | | |")
    print(f"ratio {ratio:.3f}")
    return ratio


if __name__ == "__main__":
    from lockstep import MALLOC_ENVIRONMENT

    if any(os.environ.get(key) != value for key, value in MALLOC_ENVIRONMENT.items()):
        # glibc's fixed thresholds, as every lockstep worker gets them: no side is timed on page faults
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENVIRONMENT})
    main()
    # Ends without the interpreter's exit handlers and teardown, which after torch.compile can outlast the
    # benchmark itself (torch's shutdown of its compile workers, its caches, the compiled graphs' teardown). The
    # loader's workers and torch's compile workers watch this process and end with it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
