"""Cost of R_f (relative stability to diffeomorphisms) against plainly evaluating the same images.

Three kinds of work on the same N images, each in its own process, in lockstep (see `lockstep.py`):
  evaluate   the model's forward over the N images, `--chunk-size` at a time (eval mode, no_grad);
  rf         convbias.evaluation.stability.relative_stability at delta = 1, c = 3 on the logits, published
             convention: one diffeomorphism and one noise draw per image (3 forwards per image, 1 deformation
             pass; the robust convention adds a second pass for its shared noise radius);
  deform     the deformation work inside rf alone: drawing the fields and resampling, once over N images.
Targets: rf of 500 images for ConViT-Ti at 224 under 2 minutes on a 2-core CPU, peak memory under
1.5x that of `evaluate`, the deformation under 10% of rf's time. Peak = resident peak minus the resident
size once model and images are loaded.

    python benchmarks/relative_stability.py                 # convit_tiny, 500 images at 224, 2 rounds
    python benchmarks/relative_stability.py --per-layer     # R_f of every block as well
    python benchmarks/relative_stability.py --quick         # smoke run: 32 images at 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import lockstep

WORKS = ("evaluate", "rf", "deform")
DELTA, CUT = 1.0, 3
TARGET_SECONDS, TARGET_MEMORY, TARGET_DEFORM = 120.0, 1.5, 0.10


def make_work(args):
    import timm
    import torch

    from convbias.evaluation import diffeo
    from convbias.evaluation.stability import relative_stability
    from convbias.families import load_families

    load_families()
    torch.manual_seed(0)
    model = timm.create_model(args.model, img_size=args.img_size).eval()
    images = torch.randn(args.images, 3, args.img_size, args.img_size, generator=torch.Generator().manual_seed(0))
    chunks = [slice(i, i + args.chunk_size) for i in range(0, args.images, args.chunk_size)]
    T = diffeo.temperature(DELTA, CUT, args.img_size)

    @torch.no_grad()
    def evaluate() -> None:
        for part in chunks:
            model(images[part])

    def rf() -> None:
        relative_stability(model, images, delta=DELTA, cut=CUT, per_layer=args.per_layer, chunk_size=args.chunk_size)

    def deform() -> None:
        fields = diffeo.sample_fields(args.images, CUT, torch.Generator().manual_seed(0))
        for part in chunks:
            diffeo.deform(images[part], T, CUT, coefficients=fields[part])

    return {"evaluate": evaluate, "rf": rf, "deform": deform}[args.work]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a registered model taking img_size (default convit_tiny)")
    parser.add_argument("--img-size", type=int, default=None, help="default 224 (quick 64)")
    parser.add_argument("--images", type=int, default=None, help="default 500 (quick 32)")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--per-layer", action="store_true", help="rf measures every block too")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 2, quick 1)")
    parser.add_argument("--warmup", type=int, default=0, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per worker")
    parser.add_argument("--quick", action="store_true", help="smoke run: 32 images at 64x64, one round")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", choices=WORKS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.model = args.model or "convit_tiny"
    args.img_size = args.img_size or (64 if args.quick else 224)
    args.images = args.images or (32 if args.quick else 500)
    args.rounds = args.rounds or (1 if args.quick else 2)
    for flag in ("img_size", "images", "chunk_size", "rounds", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        lockstep.serve(make_work(args))
        return 0

    from convbias.evaluation import diffeo

    try:
        diffeo.temperature(DELTA, CUT, args.img_size)
    except ValueError as e:
        parser.error(f"--img-size {args.img_size}: {e}")
    common = [
        "--model",
        args.model,
        "--img-size",
        str(args.img_size),
        "--images",
        str(args.images),
        "--chunk-size",
        str(args.chunk_size),
        "--threads",
        str(args.threads),
    ]
    common += ["--per-layer"] if args.per_layer else []
    load_before = os.getloadavg()[0]
    results = lockstep.run(
        {work: [__file__, "--worker", "--work", work, *common] for work in WORKS}, args.warmup, args.rounds
    )
    seconds = {work: statistics.median(t["wall"] for t in r["times"]) for work, r in results.items()}
    cpu = {work: statistics.median(t["cpu"] for t in r["times"]) for work, r in results.items()}
    peak = {work: r["peak_mb"] for work, r in results.items()}
    print(
        f"{args.model} at {args.img_size}x{args.img_size}, {args.images} images, chunks of {args.chunk_size}, "
        f"delta={DELTA} c={CUT}, {'logits + every block' if args.per_layer else 'logits'}, {args.threads} threads, "
        f"median of {args.rounds} lockstep rounds after {args.warmup} warmup; {time.strftime('%Y-%m-%d %H:%M')}, "
        f"load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after"
    )
    header = f"{'work':<10} {'wall s':>7} {'cpu s':>7} {'x evaluate (cpu)':>16} {'peak MB':>8} {'x evaluate':>10}"
    print(header)
    print("-" * len(header))
    for work in WORKS:
        print(
            f"{work:<10} {seconds[work]:7.1f} {cpu[work]:7.1f} {cpu[work] / cpu['evaluate']:16.2f} "
            f"{peak[work]:8.0f} {peak[work] / max(peak['evaluate'], 1e-9):10.2f}"
        )
    checks = [
        (f"rf under {TARGET_SECONDS:.0f} s (wall)", seconds["rf"] < TARGET_SECONDS),
        (f"rf peak under {TARGET_MEMORY}x evaluate", peak["rf"] < TARGET_MEMORY * peak["evaluate"]),
        (f"deformation under {TARGET_DEFORM:.0%} of rf (cpu)", cpu["deform"] < TARGET_DEFORM * cpu["rf"]),
    ]
    print(
        "; ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in checks)
        + f" (deformation {cpu['deform'] / cpu['rf']:.1%} of rf)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
