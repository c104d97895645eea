"""Throughput and peak memory of one training step (or inference forward): our ConViT-Ti vs timm's
ConViT-Ti vs timm's DeiT-Ti.

A training step is forward + cross-entropy + backward + AdamW step (timm's optimizer factory); an
inference step is a forward in eval mode under no_grad. fp32 or bf16 (autocast), eager or compiled, on
the CPU or a GPU (`--device cuda`). Each model lives in its own process and the three run in lockstep,
a step each in turn; speed ratios are paired by round (see `lockstep.py` for the protocol and the memory
measurement). timm's ConViT gets exactly our weights (loaded strictly), so both ConViTs compute the
same function.

    python benchmarks/convit_train_step.py            # full run, ~6 minutes on 2 cores
    python benchmarks/convit_train_step.py --compile  # the same, every model torch.compile'd
    python benchmarks/convit_train_step.py --device cuda --precision bf16 --modes training inference --batch-size 256
    python benchmarks/convit_train_step.py --quick    # smoke run, small batches, 2 steps
    python benchmarks/convit_train_step.py --device cuda --precision bf16 --compile --compile-mode reduce-overhead \
        --models ours --settings 224px --batch-size 256    # CUDA graphs (ours against DeiT-Ti)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import lockstep

MODELS = {
    "ours": "ConViT-Ti (ours)",
    "timm_convit": "ConViT-Ti (timm)",
    "deit": "DeiT-Ti (timm)",
}
REFERENCE = "deit"
# name: (img_size, patch_size, batch_size); the quick run divides the batch by QUICK_BATCH_DIVISOR
SETTINGS = {
    "224px": (224, 16, 32),
    "32px": (32, 4, 128),
}
QUICK_BATCH_DIVISOR = 8
MODES = ("training", "inference")
NUM_CLASSES = 1000


def build_model(name: str, img_size: int, patch_size: int):
    import timm
    import torch
    from timm.models.convit import ConVit

    import convit  # noqa: F401  (registers our convit_tiny)

    torch.manual_seed(0)
    size = dict(img_size=img_size, patch_size=patch_size, num_classes=NUM_CLASSES)
    if name == "deit":
        return timm.create_model("deit_tiny_patch16_224", **size)
    ours = timm.create_model("convit_tiny", **size)
    if name == "ours":
        return ours
    reference = ConVit(embed_dim=48, num_heads=4, local_up_to_layer=10, **size)  # timm's embed_dim is per head
    reference.load_state_dict(ours.state_dict(), strict=True)
    return reference


def run_worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    model = build_model(args.worker, args.img_size, args.patch_size)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (args.batch_size,), generator=generator)
    lockstep.serve(lockstep.make_step(model, images, labels, args.mode == "training", args), args.device)


def measure(setting: str, batch_size: int, mode: str, args) -> dict[str, dict]:
    img_size, patch_size, _ = SETTINGS[setting]
    workers = {
        name: [
            __file__,
            "--worker",
            name,
            "--img-size",
            str(img_size),
            "--patch-size",
            str(patch_size),
            "--batch-size",
            str(batch_size),
            "--threads",
            str(args.threads),
            "--mode",
            mode,
            *lockstep.step_argv(args),
        ]
        for name in args.models
    }
    results = lockstep.run(workers, args.warmup, args.steps)
    return {name: lockstep.summary(result, results[REFERENCE], batch_size) for name, result in results.items()}


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'setting':<16} {'mode':<10} {'model':<18} {'img/s':>8} {'x DeiT':>7} {'img/CPU-s':>10} {'x DeiT':>7} "
        f"{'peak MB':>8} {'x DeiT':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['setting']:<16} {row['mode']:<10} {MODELS[row['model']]:<18} {row['images_per_sec']:8.1f} {row['speed_ratio']:7.2f} "
            f"{row['images_per_cpu_sec']:10.1f} {row['cpu_speed_ratio']:7.2f} {row['peak_mb']:8.0f} {row['memory_ratio']:7.2f}"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: batch / 8, 1 warmup + 2 steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per model (default 30, quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 4, quick 1)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads per worker (default: all cores, quick: 1)"
    )
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--modes", nargs="+", default=["training"], choices=MODES)
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(MODELS),
        choices=list(MODELS),
        help=f"which models (the reference, {REFERENCE}, always runs; timm's ConViT fails under "
        f"--compile-mode reduce-overhead: its cached rel_indices are overwritten by CUDA graphs)",
    )
    lockstep.add_step_arguments(parser)
    parser.add_argument("--worker", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--img-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--patch-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="images per step for every setting (default: the setting's, 32 at 224px, 128 at 32px; /8 with --quick)",
    )
    args = parser.parse_args(argv)
    defaults = (
        dict(steps=2, warmup=1, threads=1) if args.quick else dict(steps=30, warmup=4, threads=os.cpu_count() or 1)
    )
    for flag, value in defaults.items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    for flag in ("steps", "threads") + (("batch_size",) if args.batch_size is not None else ()):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")

    if args.worker:
        run_worker(args)
        return 0
    lockstep.check_step_arguments(parser, args)
    args.models = [name for name in MODELS if name in args.models or name == REFERENCE]

    load_before = os.getloadavg()[0]
    rows = []
    for setting in args.settings:
        img_size, patch_size, batch_size = SETTINGS[setting]
        if args.batch_size is not None:
            batch_size = args.batch_size
        elif args.quick:
            batch_size = max(1, batch_size // QUICK_BATCH_DIVISOR)
        for mode in args.modes:
            started = time.perf_counter()
            for name, result in measure(setting, batch_size, mode, args).items():
                rows.append(dict(setting=f"{img_size}/p{patch_size} bs{batch_size}", mode=mode, model=name, **result))
            print(f"measured {setting} {mode} in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    print(
        f"training step (forward, backward, AdamW) or inference forward, {lockstep.describe(args)}, {args.threads} threads, models in lockstep, "
        f"{args.steps} timed steps each after {args.warmup} warmup, speed ratios paired by round; "
        f"{time.strftime('%Y-%m-%d %H:%M')}, load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after"
    )
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
