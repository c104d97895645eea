"""Training and inference throughput of Transformed CNNs vs their CNNs (the 'Speed' column of Table G.1).

For each timm ResNet, three models at the same resolution:
  cnn        the ResNet as timm builds it;
  cnn-s1     the ResNet with the T-CNN's stride change (last stage at stride 1), no attention;
  tcnn       tcnn_<resnet>: the last stage's 3x3 convs as GPSA layers (paper transform).
cnn-s1 separates the cost of the stride change (4x the last stage's positions) from that of the
attention. Inference = forward in eval mode under no_grad; training = forward + cross-entropy +
backward + AdamW step (timm's optimizer factory); fp32, eager. Each (model, mode) runs in a fresh
subprocess, so its peak memory is its own: ru_maxrss at the end minus the resident size before the
first step. Throughput uses the median step time. Ratios are relative to the plain CNN.

    python benchmarks/tcnn_throughput.py                       # resnet50 at 224, a few minutes on 2 cores
    python benchmarks/tcnn_throughput.py --models resnetrs50 resnet50d --img-size 224
    python benchmarks/tcnn_throughput.py --quick               # smoke run: resnet18 at 64, batch 4
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ("cnn", "cnn-s1", "tcnn")
MODES = ("inference", "training")
NUM_CLASSES = 1000


def build_model(cnn_name: str, variant: str):
    import timm
    import torch

    import transformed_cnn

    torch.manual_seed(0)
    if variant == "tcnn":
        return timm.create_model(f"tcnn_{cnn_name}", num_classes=NUM_CLASSES)
    model = timm.create_model(cnn_name, num_classes=NUM_CLASSES)
    if variant == "cnn-s1":
        transformed_cnn.remove_stage_stride(model, len(model.feature_info) - 1)  # stem + one entry per stage
    return model


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_worker(args) -> dict:
    import torch
    from timm.optim import create_optimizer_v2

    torch.set_num_threads(args.threads)
    model = build_model(args.model, args.variant)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (args.batch_size,), generator=generator)
    if args.mode == "training":
        model.train()
        optimizer = create_optimizer_v2(model, "adamw", lr=1e-4, weight_decay=0.05)
        loss_fn = torch.nn.CrossEntropyLoss()

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(images), labels).backward()
            optimizer.step()
    else:
        model.eval()

        @torch.no_grad()
        def step() -> None:
            model(images)

    rss_before = _rss_bytes()
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    return {"images_per_sec": args.batch_size / statistics.median(times), "peak_mb": (peak - rss_before) / 2**20}


def measure(model: str, variant: str, mode: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", model, "--variant", variant, "--mode", mode,
           "--img-size", str(args.img_size), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"worker {variant} {model} ({mode}) failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help="timm ResNet names (default resnet50; quick resnet18)")
    parser.add_argument("--img-size", type=int, default=None, help="default 224 (quick 64)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 16 (quick 4)")
    parser.add_argument("--quick", action="store_true", help="smoke run: resnet18, 64x64, batch 4, 1 warmup + 2 steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per measurement (default 5, quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1)")
    parser.add_argument("--repeats", type=int, default=1, help="run everything this many times, interleaved; keep the best")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per worker")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.models = args.models or (["resnet18"] if args.quick else ["resnet50"])
    args.img_size = args.img_size or (64 if args.quick else 224)
    args.batch_size = args.batch_size or (4 if args.quick else 16)
    args.steps = args.steps or (2 if args.quick else 5)
    args.warmup = 1 if args.warmup is None else args.warmup
    for flag in ("img_size", "batch_size", "steps", "repeats", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")

    if args.worker:
        print(json.dumps(run_worker(args)))
        return 0

    import timm

    import transformed_cnn  # noqa: F401  (registers tcnn_*)

    supported = [name.removeprefix("tcnn_") for name in timm.list_models("tcnn_*")]
    unknown = [m for m in args.models if m not in supported]
    if unknown:
        parser.error(f"no T-CNN for {', '.join(unknown)}; supported: {', '.join(supported)}")

    runs = {}
    for _ in range(args.repeats):
        for model in args.models:
            for mode in MODES:
                for variant in VARIANTS:
                    runs.setdefault((model, mode, variant), []).append(measure(model, variant, mode, args))
    best = {key: {"images_per_sec": max(r["images_per_sec"] for r in rs), "peak_mb": min(r["peak_mb"] for r in rs)}
            for key, rs in runs.items()}

    print(f"{args.img_size}x{args.img_size}, batch {args.batch_size}, fp32, {args.threads} threads, {args.steps} timed "
          f"steps after {args.warmup} warmup, best of {args.repeats}; {time.strftime('%Y-%m-%d %H:%M')}")
    header = f"{'model':<24} {'mode':<10} {'img/s':>8} {'x CNN':>6} {'peak MB':>8} {'x CNN':>6}"
    print(header)
    print("-" * len(header))
    for model in args.models:
        for mode in MODES:
            reference = best[(model, mode, "cnn")]
            for variant in VARIANTS:
                row = best[(model, mode, variant)]
                name = {"cnn": model, "cnn-s1": f"{model} (stride 1)", "tcnn": f"tcnn_{model}"}[variant]
                print(f"{name:<24} {mode:<10} {row['images_per_sec']:8.1f} "
                      f"{row['images_per_sec'] / reference['images_per_sec']:6.2f} {row['peak_mb']:8.0f} "
                      f"{row['peak_mb'] / max(reference['peak_mb'], 1e-9):6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
