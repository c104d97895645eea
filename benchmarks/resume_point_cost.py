"""Cost of writing a mid-epoch resume point against the cost of a training step (ConViT-Ti, 224, bs32).

The resume point is what the engine writes on a preemption signal or every --checkpoint-interval steps:
model weights (safetensors), EMA weights, optimizer + scheduler state and RNG states (training_state.pt),
written into a temporary directory and renamed into place (convbias.engine.checkpoint.points.CheckpointDir,
the engine's own code). Steps and saves alternate in one process, so both see the same machine; the
ratio is the median save time over the median step time (the issue's target: < 2 steps).

    python benchmarks/resume_point_cost.py                   # ConViT-Ti, 224, batch 32, 5 rounds
    python benchmarks/resume_point_cost.py --quick           # 32x32, batch 8, 2 rounds
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="convit_tiny")
    parser.add_argument("--img-size", type=int, default=None, help="default 224 (quick 32)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 32 (quick 8)")
    parser.add_argument("--rounds", type=int, default=None, help="step + save rounds (default 5, quick 2)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir; use the run's disk)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    args.img_size = args.img_size or (32 if args.quick else 224)
    args.batch_size = args.batch_size or (8 if args.quick else 32)
    args.rounds = args.rounds or (2 if args.quick else 5)
    for flag in ("img_size", "batch_size", "rounds", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")

    import timm
    import torch
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2
    from timm.utils import ModelEmaV3

    import convbias.families
    from convbias.engine.checkpoint.points import CheckpointDir
    from convbias.engine.checkpoint.rng import rng_state

    convbias.families.load_families()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kwargs = dict(img_size=args.img_size, num_classes=1000)
    if args.img_size < 224:
        kwargs["patch_size"] = 4
    model = timm.create_model(args.model, **kwargs).train()
    optimizer = create_optimizer_v2(model, "adamw", lr=5e-4, weight_decay=0.05)
    scheduler, _ = create_scheduler_v2(optimizer, "cosine", num_epochs=300, updates_per_epoch=1000)
    ema = ModelEmaV3(model, decay=0.99996)
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size)
    labels = torch.randint(0, 1000, (args.batch_size,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(images), labels).backward()
        optimizer.step()
        ema.update(model)

    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        checkpoints = CheckpointDir(root)

        def save(index: int) -> None:
            state = {
                "model": args.model,
                "epoch": 0,
                "step": index + 1,
                "loss_sums": [1.0],
                "num_updates": index + 1,
                "best": {},
                "final": {},
                "reparametrized": False,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": None,
                "rng": [rng_state()],
            }
            checkpoints.stage(0, step=index + 1)
            checkpoints.save(
                0,
                model.state_dict(),
                state,
                ema.module.state_dict(),
                {"model": args.model, "epoch": "0"},
                is_best=False,
                step=index + 1,
            )

        step()  # warm-up: optimizer state exists from here on
        steps, saves = [], []
        for index in range(args.rounds):
            started = time.perf_counter()
            step()
            steps.append(time.perf_counter() - started)
            started = time.perf_counter()
            save(index)
            saves.append(time.perf_counter() - started)
        size_mb = sum(f.stat().st_size for f in checkpoints.points()[0].iterdir()) / 2**20

    step_s, save_s = statistics.median(steps), statistics.median(saves)
    print(
        f"{args.model}, {args.img_size}x{args.img_size}, batch {args.batch_size}, fp32, {args.threads} threads, "
        f"{args.rounds} rounds of step + save; {time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'training step s':>16} {'resume point s':>15} {'size MB':>8} {'x step':>7}")
    print(f"{step_s:16.3f} {save_s:15.3f} {size_mb:8.1f} {save_s / step_s:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
