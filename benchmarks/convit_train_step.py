"""Throughput and peak memory of one training step (or inference forward): our ConViT vs timm's
ConViT vs timm's DeiT, at one size (Ti, S or B: `--size`).

A training step is forward + cross-entropy + backward + AdamW step (timm's optimizer factory); an
inference step is a forward in eval mode under no_grad. fp32 or bf16 (autocast), eager or compiled, on
the CPU or a GPU (`--device cuda`). Each model lives in its own process and the three run in lockstep,
a step each in turn; speed ratios are paired by round (see `lockstep.py` for the protocol and the memory
measurement). timm's ConViT gets exactly our weights (loaded strictly), so both ConViTs compute the
same function. Ours runs once per `--positional-product` given (how GPSA applies its positional
attention, `convbias.gpsa.POSITIONAL_PRODUCTS`), each in its own worker, so both forms are compared
in one run.

    python benchmarks/convit_train_step.py            # full run, ~6 minutes on 2 cores
    python benchmarks/convit_train_step.py --compile  # the same, every model torch.compile'd
    python benchmarks/convit_train_step.py --device cuda --precision bf16 --modes training inference --batch-size 256
    python benchmarks/convit_train_step.py --quick    # smoke run, small batches, 2 steps
    python benchmarks/convit_train_step.py --device cuda --precision bf16 --compile --compile-mode reduce-overhead \
        --models ours --settings 224px --batch-size 256    # CUDA graphs (ours against DeiT-Ti)
    python benchmarks/convit_train_step.py --device cuda --precision bf16 --compile --settings 224px \
        --batch-size 256 --positional-product kronecker dense --size small   # both products, ConViT-S vs DeiT-S
    python benchmarks/convit_train_step.py --device cuda --precision bf16 --settings 224px --batch-size 256 \
        --models ours deit --positional-product kronecker fused   # the fused Triton kernel against the factored product

`fused` is meant for a GPU: on a CPU it runs the kernel's PyTorch reference (convbias.gpsa.fused), which
forms the (B, H, N, N) attention, not a fast path.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import lockstep

from convbias.base.tables import markdown_table
from convbias.gpsa import POSITIONAL_PRODUCTS

MODELS = {
    "ours": "ConViT-{size} (ours)",
    "timm_convit": "ConViT-{size} (timm)",
    "deit": "DeiT-{size} (timm)",
}
REFERENCE = "deit"
# size: (our model, heads of timm's ConVit (48 wide each), timm's DeiT, label)
SIZES = {
    "tiny": ("convit_tiny", 4, "deit_tiny_patch16_224", "Ti"),
    "small": ("convit_small", 9, "deit_small_patch16_224", "S"),
    "base": ("convit_base", 16, "deit_base_patch16_224", "B"),
}
# name: (img_size, patch_size, batch_size); the quick run divides the batch by QUICK_BATCH_DIVISOR
SETTINGS = {
    "224px": (224, 16, 32),
    "32px": (32, 4, 128),
}
QUICK_BATCH_DIVISOR = 8
MODES = ("training", "inference")
NUM_CLASSES = 1000


def build_model(name: str, model_size: str, img_size: int, patch_size: int, positional_product: str = "auto"):
    import timm
    import torch
    from timm.models.convit import ConVit

    import convit  # noqa: F401  (registers our convit_*)
    from convbias.gpsa import set_positional_product

    torch.manual_seed(0)
    ours_name, heads, deit_name, _ = SIZES[model_size]
    size = dict(img_size=img_size, patch_size=patch_size, num_classes=NUM_CLASSES)
    if name == "deit":
        return timm.create_model(deit_name, **size)
    ours = timm.create_model(ours_name, **size)
    if name == "ours":
        set_positional_product(ours, positional_product)
        return ours
    reference = ConVit(embed_dim=48, num_heads=heads, local_up_to_layer=10, **size)  # timm's embed_dim is per head
    reference.load_state_dict(ours.state_dict(), strict=True)
    return reference


def worker_keys(args) -> list[tuple[str, str]]:
    """(model, positional product) per worker: ours once per product, the others once ("-")."""
    return [(name, product) for name in args.models for product in (args.positional_product if name == "ours" else "-")]


def label(key: tuple[str, str], args) -> str:
    name, product = key
    text = MODELS[name].format(size=SIZES[args.size][3])
    return f"{text} [{product}]" if name == "ours" and len(args.positional_product) > 1 else text


def run_worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    model = build_model(args.worker, args.size, args.img_size, args.patch_size, args.positional_product[0])
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (args.batch_size,), generator=generator)
    lockstep.serve(lockstep.make_step(model, images, labels, args.mode == "training", args), args.device)


def measure(setting: str, batch_size: int, mode: str, args) -> dict[str, dict]:
    img_size, patch_size, _ = SETTINGS[setting]
    workers = {
        (name, product): [
            __file__,
            "--worker",
            name,
            "--size",
            args.size,
            "--positional-product",
            product if name == "ours" else "auto",
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
        for name, product in worker_keys(args)
    }
    results = lockstep.run(workers, args.warmup, args.steps)
    reference = results[(REFERENCE, "-")]
    return {key: lockstep.summary(result, reference, batch_size) for key, result in results.items()}


def print_table(rows: list[dict], args) -> None:
    header = ["setting", "mode", "model", "img/s", "x DeiT", "img/CPU-s", "x DeiT", "peak MB", "x DeiT"]
    body = [
        [
            row["setting"],
            row["mode"],
            label(row["model"], args),
            f"{row['images_per_sec']:.1f}",
            f"{row['speed_ratio']:.2f}",
            f"{row['images_per_cpu_sec']:.1f}",
            f"{row['cpu_speed_ratio']:.2f}",
            f"{row['peak_mb']:.0f}",
            f"{row['memory_ratio']:.2f}",
        ]
        for row in rows
    ]
    print(markdown_table(header, body), end="")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: batch / 8, 1 warmup + 2 steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per model (default 30, quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 4, quick 1)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads per worker (default: all cores, quick: 1)"
    )
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument(
        "--size", default="tiny", choices=list(SIZES), help="ConViT-Ti/S/B against DeiT-Ti/S/B (default tiny)"
    )
    parser.add_argument(
        "--positional-product",
        nargs="+",
        default=["auto"],
        choices=POSITIONAL_PRODUCTS,
        help="how our GPSA applies P to V (auto: the one measured faster per device, kronecker on a CPU and on CUDA); several: one worker each",
    )
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
    lockstep.check_counts(parser, args, ("steps", "threads") + (("batch_size",) if args.batch_size is not None else ()))

    if args.worker:
        run_worker(args)
        return 0
    lockstep.check_step_arguments(parser, args)
    args.models = [name for name in MODELS if name in args.models or name == REFERENCE]
    args.positional_product = list(dict.fromkeys(args.positional_product))

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
        f"positional product of ours: {', '.join(args.positional_product)}, "
        f"{args.steps} timed steps each after {args.warmup} warmup, speed ratios paired by round; "
        f"{time.strftime('%Y-%m-%d %H:%M')}, load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after"
    )
    print_table(rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
