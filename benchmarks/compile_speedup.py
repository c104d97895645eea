"""Is torch.compile slower than eager? Every model family, training and inference, compiled vs eager.

Whether `train.py --compile` is slower than eager for any family (results: docs/benchmarks.md). For each
case (a registered timm model at one resolution and batch size) three workers, built alike (seed 0, same
weights, same random batch), run in lockstep (see `lockstep.py`): the model eager, the model under plain
`torch.compile` (inductor, `--compile-mode`, default mode by default), and the model compiled as the
engine's `--compile` does it (`convbias.engine.model.compile.compile_model`: on a CPU, ATen's kernels for GELU,
LayerNorm and max-pool and no layout optimization; on a GPU the same as plain). A training step is
forward + cross-entropy + backward + AdamW step (timm's optimizer, eager: only the model is compiled, as
the engine does); inference is a forward in eval mode under no_grad (`lockstep.make_step`).

Reported per case and mode: img/s of each (median step), each compiled worker's speed over eager paired
by round (> 1: compiled is faster), the engine worker's peak memory over eager's, and each compiled
worker's compile time: its first (warmup) step minus the eager worker's. Compiled workers compile from
scratch (inductor's caches off), so compile time and memory do not depend on what earlier runs left in
the cache. On the CPU a peak includes what Dynamo and Inductor keep in the process (graphs, generated
code, the compiler's heap), so the memory ratio is that of a training process, not of the step alone.

    python benchmarks/compile_speedup.py                         # every case, ~25 minutes on 2 cores
    python benchmarks/compile_speedup.py --cases convit_tiny@32 deit_tiny_patch16_224@32 --modes training
    python benchmarks/compile_speedup.py --compile-mode max-autotune-no-cudagraphs
    python benchmarks/compile_speedup.py --quick                 # smoke run, < 2 minutes
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lockstep
from convit_train_step import NUM_CLASSES as IMAGENET_CLASSES
from convit_train_step import SETTINGS as VIT_SETTINGS

from convbias.base.tables import markdown_table


@dataclass(frozen=True)
class Case:
    model: str  # registered timm name
    img_size: int
    batch_size: int
    num_classes: int
    kwargs: dict[str, Any] = field(default_factory=dict)  # more timm.create_model arguments

    @property
    def name(self) -> str:
        return f"{self.model}@{self.img_size}"


VIT_MODELS = ("convit_tiny", "deit_tiny_patch16_224")  # ConViT-Ti and DeiT-Ti, as in convit_train_step.py
TCNN_IMG_SIZE, TCNN_BATCH = 224, 8  # T-CNN (last stage at stride 1, GPSA) and its ResNet: ~1.2 s per training step
EFCN_CHANNELS, EFCN_CLASSES, EFCN_IMG_SIZE, EFCN_BATCH = 16, 10, 32, 128  # configs/efcn_protocol/efcn_cpu.yaml's
# width, at CIFAR-10's size: the eFCN has 68 M weights (the paper's 64 channels would need 1.3 G)
CASES: dict[str, Case] = {
    case.name: case
    for case in [
        *(
            Case(model, img_size, batch, IMAGENET_CLASSES, dict(img_size=img_size, patch_size=patch))
            for img_size, patch, batch in VIT_SETTINGS.values()
            for model in VIT_MODELS
        ),
        *(Case(model, TCNN_IMG_SIZE, TCNN_BATCH, IMAGENET_CLASSES) for model in ("tcnn_resnet18", "resnet18")),
        *(
            Case(model, EFCN_IMG_SIZE, EFCN_BATCH, EFCN_CLASSES, dict(channels=EFCN_CHANNELS, img_size=EFCN_IMG_SIZE))
            for model in ("efcn_vanilla_cnn", "vanilla_cnn")
        ),
    ]
}
MODES = ("training", "inference")
FLAVOURS = {"eager": None, "torch": "torch", "engine": "engine"}  # worker: its --compile-as (None: eager, the
# reference of the ratios)
DEFAULT_THREADS = 2
DEFAULT_STEPS, DEFAULT_WARMUP = 12, 2
QUICK_CASES = ("vanilla_cnn@32", "efcn_vanilla_cnn@32")  # the cheapest compiles
QUICK_STEPS, QUICK_WARMUP, QUICK_BATCH_DIVISOR = 2, 1, 8


def build_model(case: Case):
    """The case's model, seeded: every worker gets the same weights."""
    import timm
    import torch

    from convbias.families import load_families

    load_families()
    torch.manual_seed(0)
    return timm.create_model(case.model, num_classes=case.num_classes, **case.kwargs)


def run_worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.compile:
        torch.compiler.config.force_disable_caches = True  # a cold compile, whatever earlier runs cached
    case = CASES[args.worker]
    lockstep.serve_random_batch(
        build_model(case), case.img_size, args.batch_size, case.num_classes, args.mode == "training", args
    )


def measure(case: Case, batch_size: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """The case's workers in lockstep: their summaries (relative to eager) and compile times."""
    common = ["--worker", case.name, "--mode", mode, "--batch-size", str(batch_size), "--threads", str(args.threads)]
    workers = {
        flavour: [
            __file__,
            *common,
            *lockstep.step_argv(
                argparse.Namespace(
                    **{**vars(args), "compile": compile_as is not None, "compile_as": compile_as or args.compile_as}
                )
            ),
        ]
        for flavour, compile_as in FLAVOURS.items()
    }
    results = lockstep.run(workers, args.warmup, args.steps)
    first = {flavour: results[flavour]["warmup_times"][0]["wall"] for flavour in FLAVOURS}
    return {
        **{flavour: lockstep.summary(results[flavour], results["eager"], batch_size) for flavour in FLAVOURS},
        "compile_s": {flavour: first[flavour] - first["eager"] for flavour in FLAVOURS},
    }


def header(args: argparse.Namespace, load_before: Sequence[float], load_after: Sequence[float]) -> str:
    """The line above the table: what ran, how, when, and the load average (1/5/15 min) around the run."""
    import torch

    load = {
        when: "/".join(f"{x:.2f}" for x in values) for when, values in (("before", load_before), ("after", load_after))
    }
    return (
        f"torch.compile vs eager, {args.precision}, {args.device}, torch {torch.__version__}, compile mode {args.compile_mode}, "
        f"cold compile; {args.threads} threads, eager, torch.compile and --compile "
        f"in lockstep, {args.steps} timed steps after {args.warmup} warmup, ratios paired by round (> 1: compiled faster); "
        f"{time.strftime('%Y-%m-%d %H:%M')}, load average (1/5/15 min) {load['before']} before, {load['after']} after"
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = [
        "case",
        "batch",
        "mode",
        "eager img/s",
        "torch.compile img/s",
        "x eager",
        "compile s",
        "--compile img/s",
        "x eager",
        "compile s",
        "--compile peak / eager",
    ]
    print(
        markdown_table(
            columns,
            [
                [
                    row["case"],
                    row["batch"],
                    row["mode"],
                    f"{row['eager']['images_per_sec']:.1f}",
                    *(
                        cell
                        for flavour in ("torch", "engine")
                        for cell in (
                            f"{row[flavour]['images_per_sec']:.1f}",
                            f"{row[flavour]['speed_ratio']:.3f}",
                            f"{row['compile_s'][flavour]:.0f}",
                        )
                    ),
                    f"{row['engine']['memory_ratio']:.2f}",
                ]
                for row in rows
            ],
        ),
        end="",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cases",
        nargs="+",
        default=None,
        choices=list(CASES),
        metavar="CASE",
        help=f"of {', '.join(CASES)} (default: all; quick: {' '.join(QUICK_CASES)})",
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {len(QUICK_CASES)} cases, batch / {QUICK_BATCH_DIVISOR}, "
        f"{QUICK_WARMUP} warmup + {QUICK_STEPS} steps",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help=f"timed steps per worker (default {DEFAULT_STEPS}, quick {QUICK_STEPS})"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"untimed steps first, the first one compiles (default {DEFAULT_WARMUP}, quick {QUICK_WARMUP})",
    )
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch threads per worker")
    lockstep.add_step_arguments(parser)
    parser.add_argument("--worker", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.cases = args.cases or list(QUICK_CASES if args.quick else CASES)
    args.steps = (QUICK_STEPS if args.quick else DEFAULT_STEPS) if args.steps is None else args.steps
    args.warmup = (QUICK_WARMUP if args.quick else DEFAULT_WARMUP) if args.warmup is None else args.warmup
    for flag in ("steps", "threads", "warmup"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1" + (" (the first warmup step compiles)" if flag == "warmup" else ""))
    if args.compile and not args.worker:
        parser.error(
            "--compile: this benchmark runs every case eager, under torch.compile and as the engine compiles; see --compile-mode"
        )

    if args.worker:
        run_worker(args)
        return 0
    lockstep.check_step_arguments(parser, args)

    load_before = os.getloadavg()
    rows = []
    for name in args.cases:
        case = CASES[name]
        batch_size = max(1, case.batch_size // QUICK_BATCH_DIVISOR) if args.quick else case.batch_size
        for mode in args.modes:
            started = time.perf_counter()
            rows.append(dict(case=name, batch=batch_size, mode=mode, **measure(case, batch_size, mode, args)))
            print(
                f"measured {name} {mode} in {time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.2f}",
                file=sys.stderr,
                flush=True,
            )
    print(header(args, load_before, os.getloadavg()))
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
