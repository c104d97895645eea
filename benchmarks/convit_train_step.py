"""Throughput and peak memory of one training step: our ConViT-Ti vs timm's ConViT-Ti vs timm's DeiT-Ti.

A step is forward + cross-entropy + backward + AdamW step (timm's optimizer factory), fp32, eager.
Each (model, setting) runs in a fresh subprocess so that its peak resident memory is its own:
peak = ru_maxrss at the end minus the resident size just before the first step (weights, batch and
imports excluded; gradients, AdamW state and activations included). Throughput uses the median step
time; "img/CPU-s" divides by the process's CPU time instead, a cross-check that other load on the
machine disturbs less (with more than one thread it also counts OpenMP spinning). timm's ConViT gets
exactly our weights (loaded strictly), so both ConViTs compute the same function.

    python benchmarks/convit_train_step.py            # full run, ~2-3 minutes on 2 cores
    python benchmarks/convit_train_step.py --quick    # smoke run, small batches, 2 steps
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
from typing import Dict, List

MODELS = {
    "ours": "ConViT-Ti (ours)",
    "timm_convit": "ConViT-Ti (timm)",
    "deit": "DeiT-Ti (timm)",
}
# name: (img_size, patch_size, batch_size); the quick run divides the batch by QUICK_BATCH_DIVISOR
SETTINGS = {
    "224px": (224, 16, 32),
    "32px": (32, 4, 128),
}
QUICK_BATCH_DIVISOR = 8
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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_worker(name: str, img_size: int, patch_size: int, batch_size: int, steps: int, warmup: int, threads: int) -> Dict:
    import torch
    from timm.optim import create_optimizer_v2

    torch.set_num_threads(threads)
    model = build_model(name, img_size, patch_size).train()
    optimizer = create_optimizer_v2(model, "adamw", lr=5e-4, weight_decay=0.05)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, img_size, img_size, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(images), labels).backward()
        optimizer.step()

    rss_before = _rss_bytes()
    wall, cpu = [], []
    for i in range(warmup + steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        if i >= warmup:
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    return {
        "images_per_sec": batch_size / statistics.median(wall),
        "images_per_cpu_sec": batch_size / statistics.median(cpu),
        "peak_mb": (peak - rss_before) / 2**20,
    }


def measure(name: str, setting: str, batch_size: int, args) -> Dict:
    img_size, patch_size, _ = SETTINGS[setting]
    cmd = [
        sys.executable, __file__, "--worker", name, "--img-size", str(img_size), "--patch-size", str(patch_size),
        "--batch-size", str(batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--threads", str(args.threads),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"worker {name} ({setting}) failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(rows: List[Dict]) -> None:
    header = (
        f"{'setting':<16} {'model':<18} {'img/s':>8} {'x DeiT':>7} {'img/CPU-s':>10} {'x DeiT':>7} "
        f"{'peak MB':>8} {'x DeiT':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['setting']:<16} {MODELS[row['model']]:<18} {row['images_per_sec']:8.1f} {row['speed_ratio']:7.2f} "
            f"{row['images_per_cpu_sec']:10.1f} {row['cpu_speed_ratio']:7.2f} {row['peak_mb']:8.0f} {row['memory_ratio']:7.2f}"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: batch / 8, 1 warmup + 2 steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per model (default 8, quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2, quick 1)")
    parser.add_argument("--repeats", type=int, default=1, help="run every model this many times, interleaved; keep the best")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: all cores, quick: 1)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--worker", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--img-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--patch-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = dict(steps=2, warmup=1, threads=1) if args.quick else dict(steps=8, warmup=2, threads=os.cpu_count() or 1)
    for flag, value in defaults.items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    for flag in ("steps", "repeats", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")

    if args.worker:
        result = run_worker(args.worker, args.img_size, args.patch_size, args.batch_size, args.steps, args.warmup, args.threads)
        print(json.dumps(result))
        return 0

    load_before = os.getloadavg()[0]
    rows = []
    for setting in args.settings:
        img_size, patch_size, batch_size = SETTINGS[setting]
        if args.quick:
            batch_size = max(1, batch_size // QUICK_BATCH_DIVISOR)
        results = {name: [] for name in MODELS}
        for _ in range(args.repeats):
            for name in MODELS:
                results[name].append(measure(name, setting, batch_size, args))
        best = {
            name: {
                "images_per_sec": max(r["images_per_sec"] for r in runs),
                "images_per_cpu_sec": max(r["images_per_cpu_sec"] for r in runs),
                "peak_mb": min(r["peak_mb"] for r in runs),
            }
            for name, runs in results.items()
        }
        label = f"{img_size}/p{patch_size} bs{batch_size}"
        for name in MODELS:
            rows.append(
                dict(
                    setting=label,
                    model=name,
                    **best[name],
                    speed_ratio=best[name]["images_per_sec"] / best["deit"]["images_per_sec"],
                    cpu_speed_ratio=best[name]["images_per_cpu_sec"] / best["deit"]["images_per_cpu_sec"],
                    memory_ratio=best[name]["peak_mb"] / best["deit"]["peak_mb"],
                )
            )
    print(f"one training step (forward, backward, AdamW), fp32, {args.threads} threads, "
          f"{args.steps} timed steps after {args.warmup} warmup, best of {args.repeats}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after "
          f"(other load distorts img/s most, img/CPU-s less, peak MB not)")
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
