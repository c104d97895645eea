"""Training and inference throughput of Transformed CNNs vs their CNNs (the 'Speed' column of Table G.1).

For each timm ResNet, three models at the same resolution:
  cnn        the ResNet as timm builds it;
  cnn-s1     the ResNet with the T-CNN's stride change (last stage at stride 1), no attention;
  tcnn       tcnn_<resnet>: the last stage's 3x3 convs as GPSA layers (paper transform).
cnn-s1 separates the cost of the stride change (4x the last stage's positions) from that of the
attention. Inference = forward in eval mode under no_grad; training = forward + cross-entropy +
backward + AdamW step (timm's optimizer factory); fp32 or bf16 (autocast), eager or compiled, on the
CPU or a GPU (`--device cuda`). For each (ResNet, mode) the variants run
in their own processes, in lockstep, a step each in turn; ratios are relative to the plain CNN, speed
ratios paired by round (see `lockstep.py` for the protocol and the memory measurement).

    python benchmarks/tcnn_throughput.py                       # resnet50 at 224, ~5 minutes on 2 cores
    python benchmarks/tcnn_throughput.py --models resnetrs50 resnet50d --img-size 224
    python benchmarks/tcnn_throughput.py --compile             # every variant torch.compile'd
    python benchmarks/tcnn_throughput.py --device cuda --precision bf16 --batch-size 64
    python benchmarks/tcnn_throughput.py --quick               # smoke run: resnet18 at 64, batch 4
    python benchmarks/tcnn_throughput.py --device cuda --precision bf16 --compile --batch-size 128 \
        --positional-product kronecker dense   # the T-CNN once per positional product (convbias.gpsa)

`fused` runs the Triton kernel only in GPSA layers whose C_in is at most 128
(convbias.gpsa.fused.FUSED_MAX_VALUE_WIDTH); a paper T-CNN's GPSA layers (the last stage, C_in 512) keep
the unfused schedule, so `fused` measures the same as `kronecker` there.
"""

from __future__ import annotations

import argparse
import os
import time

import lockstep

from convbias.base.tables import markdown_table
from convbias.gpsa import POSITIONAL_PRODUCTS

VARIANTS = ("cnn", "cnn-s1", "tcnn")
MODES = ("inference", "training")
NUM_CLASSES = 1000


def build_model(cnn_name: str, variant: str, positional_product: str = "auto"):
    import timm
    import torch

    import transformed_cnn
    from convbias.gpsa import set_positional_product

    torch.manual_seed(0)
    if variant == "tcnn":
        model = timm.create_model(f"tcnn_{cnn_name}", num_classes=NUM_CLASSES)
        set_positional_product(model, positional_product)
        return model
    model = timm.create_model(cnn_name, num_classes=NUM_CLASSES)
    if variant == "cnn-s1":
        transformed_cnn.remove_stage_stride(model, len(model.feature_info) - 1)  # stem + one entry per stage
    return model


def run_worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    model = build_model(args.model, args.variant, args.positional_product[0])
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (args.batch_size,), generator=generator)
    lockstep.serve(lockstep.make_step(model, images, labels, args.mode == "training", args), args.device)


def measure(model: str, mode: str, args) -> dict:
    """The variants of one ResNet in one mode (the T-CNN once per positional product), in lockstep;
    summaries relative to the CNN."""
    keys = [(v, p) for v in args.variants for p in (args.positional_product if v == "tcnn" else ["auto"])]
    workers = {
        (variant, product): [
            __file__,
            "--worker",
            "--model",
            model,
            "--variant",
            variant,
            "--mode",
            mode,
            "--img-size",
            str(args.img_size),
            "--batch-size",
            str(args.batch_size),
            "--threads",
            str(args.threads),
            "--positional-product",
            product,
            *lockstep.step_argv(args),
        ]
        for variant, product in keys
    }
    results = lockstep.run(workers, args.warmup, args.steps)
    reference = results[("cnn", "auto")]
    return {key: lockstep.summary(result, reference, args.batch_size) for key, result in results.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models", nargs="+", default=None, help="timm ResNet names (default resnet50; quick resnet18)"
    )
    parser.add_argument("--img-size", type=int, default=None, help="default 224 (quick 64)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 16 (quick 4)")
    parser.add_argument("--quick", action="store_true", help="smoke run: resnet18, 64x64, batch 4, 1 warmup + 2 steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per model (default 12, quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3, quick 1)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per worker")
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="which variants (cnn always runs)"
    )
    parser.add_argument(
        "--positional-product",
        nargs="+",
        default=["auto"],
        choices=POSITIONAL_PRODUCTS,
        help="how the T-CNN's GPSA applies P to V (auto: the one measured faster per device, kronecker on a CPU and on CUDA); several: one worker each",
    )
    lockstep.add_step_arguments(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.models = args.models or (["resnet18"] if args.quick else ["resnet50"])
    args.img_size = args.img_size or (64 if args.quick else 224)
    args.batch_size = args.batch_size or (4 if args.quick else 16)
    args.steps = args.steps or (2 if args.quick else 12)
    args.warmup = (1 if args.quick else 3) if args.warmup is None else args.warmup
    lockstep.check_counts(parser, args, ("img_size", "batch_size", "steps", "threads"))

    if args.worker:
        run_worker(args)
        return 0
    lockstep.check_step_arguments(parser, args)
    args.variants = [v for v in VARIANTS if v in args.variants or v == "cnn"]
    args.positional_product = list(dict.fromkeys(args.positional_product))

    import timm

    import transformed_cnn  # noqa: F401  (registers tcnn_*)

    supported = [name.removeprefix("tcnn_") for name in timm.list_models("tcnn_*")]
    unknown = [m for m in args.models if m not in supported]
    if unknown:
        parser.error(f"no T-CNN for {', '.join(unknown)}; supported: {', '.join(supported)}")

    load_before = os.getloadavg()[0]
    results = {(model, mode): measure(model, mode, args) for model in args.models for mode in MODES}
    print(
        f"{args.img_size}x{args.img_size}, batch {args.batch_size}, {lockstep.describe(args)}, {args.threads} threads, variants in lockstep, "
        f"positional product of the T-CNN: {', '.join(args.positional_product)}, "
        f"{args.steps} timed steps each after {args.warmup} warmup, speed ratios paired by round; "
        f"{time.strftime('%Y-%m-%d %H:%M')}, load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after"
    )
    several = len(args.positional_product) > 1
    body = []
    for (model, mode), variants in results.items():
        for (variant, product), row in variants.items():
            name = {"cnn": model, "cnn-s1": f"{model} (stride 1)", "tcnn": f"tcnn_{model}"}[variant]
            name += f" [{product}]" if variant == "tcnn" and several else ""
            body.append(
                [
                    name,
                    mode,
                    f"{row['images_per_sec']:.1f}",
                    f"{row['speed_ratio']:.2f}",
                    f"{row['peak_mb']:.0f}",
                    f"{row['memory_ratio']:.2f}",
                ]
            )
    print(markdown_table(["model", "mode", "img/s", "x CNN", "peak MB", "x CNN"], body), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
