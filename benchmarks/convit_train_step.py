"""Throughput and peak memory of one training step: our ConViT-Ti vs timm's ConViT-Ti vs timm's DeiT-Ti.

A step is forward + cross-entropy + backward + AdamW step (timm's optimizer factory), fp32, eager.
Each model lives in its own subprocess, so that its peak resident memory is its own: peak = ru_maxrss
at the end minus the resident size just before the first step (weights, batch and imports excluded;
gradients, AdamW state and activations included). timm's ConViT gets exactly our weights (loaded
strictly), so both ConViTs compute the same function.

The workers run in lockstep: the parent asks each in turn for one step (rotating the order every
round) and the others wait, blocked, so a step never shares the CPU with another model's. Steps of
different models are therefore at most a few seconds apart, and slow drifts in the machine's speed
(on a shared VM, +-10% over seconds) hit every model alike instead of whichever ran during the slow
minute. img/s is the batch size over the median step time. The "x DeiT" speed ratio is paired: the
median over rounds of DeiT's step time over the model's in the same round, so a drift between rounds
cancels. "img/CPU-s" and its ratio do the same with each step's CPU time (with more than one thread
that also counts OpenMP spinning).

glibc's malloc adapts its mmap and trim thresholds as a process runs, and with the defaults a worker
can return hundreds of MB to the kernel and fault them back in on every step (0 to 170k page faults
per step here, varying from process to process). Every worker therefore gets the same fixed
thresholds (`MALLOC_ENVIRONMENT`, unless already set): each model then trains from a warm heap, as a
long training run does, and no model is timed on its page faults.

    python benchmarks/convit_train_step.py            # full run, ~5 minutes on 2 cores
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
MALLOC_ENVIRONMENT = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),  # glibc's maximum: blocks below it come from the heap
    "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30),  # never give the heap's free top back to the kernel
}


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


def run_worker(name: str, img_size: int, patch_size: int, batch_size: int, threads: int) -> None:
    """Build the model, then run one step per 'step' line on stdin and answer with its times.

    The answer to 'done' is the peak memory of the steps. Nothing else is written to stdout."""
    import torch
    from timm.optim import create_optimizer_v2

    torch.set_num_threads(threads)
    model = build_model(name, img_size, patch_size).train()
    optimizer = create_optimizer_v2(model, "adamw", lr=5e-4, weight_decay=0.05)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, img_size, img_size, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)
    loss_fn = torch.nn.CrossEntropyLoss()

    def reply(message: Dict) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    rss_before = _rss_bytes()
    reply({"ready": True})
    for command in sys.stdin:
        if command.strip() != "step":
            break
        start, start_cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(images), labels).backward()
        optimizer.step()
        reply({"wall": time.perf_counter() - start, "cpu": time.process_time() - start_cpu})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    reply({"peak_mb": (peak - rss_before) / 2**20})


class Worker:
    """One model in its own process, driven a step at a time over pipes."""

    def __init__(self, name: str, setting: str, batch_size: int, threads: int):
        img_size, patch_size, _ = SETTINGS[setting]
        self.name, self.setting = name, setting
        cmd = [
            sys.executable, __file__, "--worker", name, "--img-size", str(img_size), "--patch-size", str(patch_size),
            "--batch-size", str(batch_size), "--threads", str(threads),
        ]
        env = {**MALLOC_ENVIRONMENT, **os.environ}
        self.process = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )

    def ask(self, command: str) -> Dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.answer()

    def answer(self) -> Dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise SystemExit(f"worker {self.name} ({self.setting}) failed:\n{self.process.stderr.read()}")
        return json.loads(line)

    def finish(self) -> float:
        peak = self.ask("done")["peak_mb"]
        self.process.wait()
        return peak


def measure(setting: str, batch_size: int, args) -> Dict[str, Dict]:
    """All models of one setting in lockstep: warmup rounds, then timed rounds; medians per model."""
    workers = [Worker(name, setting, batch_size, args.threads) for name in MODELS]
    try:
        for worker in workers:  # the models build in parallel; nothing is timed yet
            worker.answer()
        times = {name: [] for name in MODELS}
        for round_index in range(args.warmup + args.steps):
            shift = round_index % len(workers)
            for worker in workers[shift:] + workers[:shift]:
                result = worker.ask("step")
                if round_index >= args.warmup:
                    times[worker.name].append(result)
        peaks = {worker.name: worker.finish() for worker in workers}
    finally:
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.kill()

    def paired_ratio(name: str, clock: str) -> float:
        return statistics.median(d[clock] / t[clock] for d, t in zip(times["deit"], times[name]))

    return {
        name: {
            "images_per_sec": batch_size / statistics.median(t["wall"] for t in times[name]),
            "images_per_cpu_sec": batch_size / statistics.median(t["cpu"] for t in times[name]),
            "peak_mb": peaks[name],
            "speed_ratio": paired_ratio(name, "wall"),
            "cpu_speed_ratio": paired_ratio(name, "cpu"),
            "memory_ratio": peaks[name] / peaks["deit"],
        }
        for name in MODELS
    }


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
    parser.add_argument("--steps", type=int, default=None, help="timed steps per model (default 30, quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 4, quick 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: all cores, quick: 1)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--worker", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--img-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--patch-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = dict(steps=2, warmup=1, threads=1) if args.quick else dict(steps=30, warmup=4, threads=os.cpu_count() or 1)
    for flag, value in defaults.items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    for flag in ("steps", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")

    if args.worker:
        run_worker(args.worker, args.img_size, args.patch_size, args.batch_size, args.threads)
        return 0

    load_before = os.getloadavg()[0]
    rows = []
    for setting in args.settings:
        img_size, patch_size, batch_size = SETTINGS[setting]
        if args.quick:
            batch_size = max(1, batch_size // QUICK_BATCH_DIVISOR)
        for name, result in measure(setting, batch_size, args).items():
            rows.append(dict(setting=f"{img_size}/p{patch_size} bs{batch_size}", model=name, **result))
    print(f"one training step (forward, backward, AdamW), fp32, {args.threads} threads, models in lockstep, "
          f"{args.steps} timed steps each after {args.warmup} warmup, speed ratios paired by round; "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after")
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
