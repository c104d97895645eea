"""Side-by-side timing of models that each live in their own process, one step at a time in turn.

Each model runs in a worker process, so that its peak resident memory is its own: peak = ru_maxrss at
the end minus the resident size just before the first step (weights, batch and imports excluded;
gradients, optimizer state and activations included).

The workers run in lockstep: the parent asks each in turn for one step (rotating the order every
round) while the others wait, blocked, so a step never shares the CPU with another model's. Steps of
different models are at most a few seconds apart, and slow drifts in the machine's speed (on a shared
VM, +-10% over seconds) hit every model alike instead of whichever ran during the slow minute. Speed
ratios are paired: the median over rounds of the reference's step time over the model's in the same
round, so a drift between rounds cancels.

On a GPU (`--device cuda`) the peak is torch's peak allocated CUDA memory over the steps minus the
allocation before the first step, and every step ends with a synchronize, so its wall time is the GPU's.

glibc's malloc adapts its mmap and trim thresholds as a process runs; with the defaults a worker can
return hundreds of MB to the kernel and fault them back in on some steps (0 to 170k page faults per
step measured here, varying from process to process). Every worker therefore gets the same fixed
thresholds (`MALLOC_ENVIRONMENT`, unless already set): each model trains from a warm heap, as a long
run does, and no model is timed on its page faults.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from convbias.engine.config.options import COMPILE_MODES
from convbias.engine.model.compile import compile_model

MALLOC_ENVIRONMENT = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),  # glibc's maximum: blocks below it come from the heap
    "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30),  # never give the heap's free top back to the kernel
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve(step: Callable[[], None], device: str = "cpu") -> None:
    """Worker side: run one step per 'step' line on stdin and answer with its wall and CPU time.

    Any other line ends the loop; the answer is then the peak memory of the steps. Call it once the
    model, data and optimizer exist. Nothing else may be written to stdout."""
    import torch

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else _rss_bytes()
    _reply({"ready": True})
    for command in sys.stdin:
        if command.strip() != "step":
            break
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        if cuda:
            torch.cuda.synchronize()
        _reply({"wall": time.perf_counter() - start, "cpu": time.process_time() - start_cpu})
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    _reply({"peak_mb": (peak - before) / 2**20})


# ------------------------------------------------------------------ device, precision and compilation
PRECISIONS = ("fp32", "bf16")
COMPILE_AS = ("engine", "torch")


def add_step_arguments(parser) -> None:
    """The options every benchmark shares: where and how its steps run."""
    parser.add_argument("--device", default="cpu", help="torch device of the steps: cpu, cuda, cuda:1...")
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=PRECISIONS,
        help="bf16: forward and loss under torch.autocast(bfloat16), weights and optimizer in fp32",
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile every model (inductor)")
    parser.add_argument("--compile-mode", default="default", choices=COMPILE_MODES)
    parser.add_argument(
        "--compile-as",
        default="engine",
        choices=COMPILE_AS,
        help="engine: as train.py --compile (on a CPU: ATen's kernels for GELU, LayerNorm, ReLU and "
        "max-pool, no layout optimization; convbias.engine.model.compile); torch: plain torch.compile",
    )


def check_step_arguments(parser, args) -> None:
    """Bad --device values stop the parent with one line before any worker starts."""
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        parser.error(f"--device {args.device!r}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device visible to torch")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: expected cpu or cuda[:N]")


def check_counts(parser, args, positive: tuple[str, ...]) -> None:
    """Too small a count stops the parent with one line: each of `positive` must be >= 1, --warmup >= 0."""
    for flag in positive:
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")


def step_argv(args) -> list[str]:
    """The parent's step options, forwarded to each worker."""
    argv = [
        "--device",
        args.device,
        "--precision",
        args.precision,
        "--compile-mode",
        args.compile_mode,
        "--compile-as",
        args.compile_as,
    ]
    return argv + (["--compile"] if args.compile else [])


def describe(args) -> str:
    """'fp32, eager, cpu' / 'bf16, compiled (default, as engine), cuda' for the table headers."""
    how = f"compiled ({args.compile_mode}, as {args.compile_as})" if args.compile else "eager"
    return f"{args.precision}, {how}, {args.device}"


def make_step(model, images, labels, training: bool, args: Any) -> Callable[[], None]:
    """One training step (forward, cross-entropy, backward, AdamW) or one inference forward (eval mode,
    no_grad) on args.device, in args.precision, compiled with args.compile (as args.compile_as). The data
    stays on the device."""
    import torch
    from timm.optim import create_optimizer_v2

    model = model.to(args.device).train(training)
    images, labels = images.to(args.device), labels.to(args.device)
    device_type = torch.device(args.device).type
    forward = (
        compile_model(model, device_type, mode=args.compile_mode, aten_kernels=args.compile_as == "engine")
        if args.compile
        else model
    )
    autocast = torch.autocast(device_type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    if not training:

        @torch.no_grad()
        def infer() -> None:
            with autocast:
                forward(images)

        return infer

    optimizer = create_optimizer_v2(model, "adamw", lr=1e-4, weight_decay=0.05)
    loss_fn = torch.nn.CrossEntropyLoss()

    def train() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(forward(images), labels)
        loss.backward()
        optimizer.step()

    return train


def serve_random_batch(model, img_size: int, batch_size: int, num_classes: int, training: bool, args: Any) -> None:
    """Worker side, the common case: `make_step` on a fixed random batch (seed 0) of RGB images and labels,
    served (see `serve`). Call it after torch.set_num_threads and building the model."""
    import torch

    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, img_size, img_size, generator=generator)
    labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
    serve(make_step(model, images, labels, training, args), args.device)


class _Worker:
    def __init__(self, key: Hashable, argv: Sequence[str]):
        self.key = key
        env = {**MALLOC_ENVIRONMENT, **os.environ}
        self.process = subprocess.Popen(
            [sys.executable, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def ask(self, command: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.answer()

    def answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise SystemExit(f"benchmark worker {self.key} failed:\n{self.process.stderr.read()}")
        return json.loads(line)


def run(workers: dict[Hashable, Sequence[str]], warmup: int, steps: int) -> dict[Hashable, dict]:
    """Start one process per entry (argv of a script that calls `serve`), run them in lockstep.

    Returns per key: 'times' (one {'wall', 'cpu'} per timed step, in rounds), 'warmup_times' (the same
    for the warmup steps: the first one holds torch.compile's compilation) and 'peak_mb'."""
    started: list[_Worker] = [_Worker(key, argv) for key, argv in workers.items()]
    try:
        for worker in started:  # the models build in parallel; nothing is timed yet
            worker.answer()
        times = {worker.key: [] for worker in started}
        warmup_times = {worker.key: [] for worker in started}
        for round_index in range(warmup + steps):
            shift = round_index % len(started)
            for worker in started[shift:] + started[:shift]:
                result = worker.ask("step")
                (times if round_index >= warmup else warmup_times)[worker.key].append(result)
        peaks = {worker.key: worker.ask("done")["peak_mb"] for worker in started}
        for worker in started:
            worker.process.wait()
    finally:
        for worker in started:
            if worker.process.poll() is None:
                worker.process.kill()
    return {key: {"times": times[key], "warmup_times": warmup_times[key], "peak_mb": peaks[key]} for key in workers}


def summary(result: dict, reference: dict, batch_size: int) -> dict[str, float]:
    """Throughput (median step), paired speed ratios (wall and CPU) and memory ratio against `reference`."""

    def paired(clock: str) -> float:
        return statistics.median(r[clock] / t[clock] for r, t in zip(reference["times"], result["times"]))

    return {
        "images_per_sec": batch_size / statistics.median(t["wall"] for t in result["times"]),
        "images_per_cpu_sec": batch_size / statistics.median(t["cpu"] for t in result["times"]),
        "speed_ratio": paired("wall"),
        "cpu_speed_ratio": paired("cpu"),
        "peak_mb": result["peak_mb"],
        "memory_ratio": result["peak_mb"] / max(reference["peak_mb"], 1e-9),
    }
