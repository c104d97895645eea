"""Peak memory and time of the empirical NTK (convbias.evaluation.ntk) for ConViT-Ti at 32x32 on the CPU.

Each sample count runs in a fresh subprocess: the process's whole peak RSS (torch, the model, the
per-sample gradient buffer, every temporary) is reported beside the size of the full Jacobian that a
naive implementation would hold, (samples x logits) x params in float32. Target: 64 samples under 4 GB.

    python benchmarks/ntk_memory.py                     # 16 and 64 samples, ConViT-Ti, patch 4, 10 classes
    python benchmarks/ntk_memory.py --samples 8 --model deit_tiny_patch16_224
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from convbias.base.tables import markdown_table

WORKER = r"""
import json, resource, sys, time
import torch, timm
from convbias.families import load_families
from convbias.evaluation.ntk import buffer_bytes, empirical_ntk

torch.set_num_threads(1)
load_families()
name, samples, img_size, patch, classes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
model = timm.create_model(name, img_size=img_size, patch_size=patch, num_classes=classes)
images = torch.randn(samples, 3, img_size, img_size)
start = time.perf_counter()
theta = empirical_ntk(model, images, max_memory_gb=4.0)
seconds = time.perf_counter() - start
params = sum(p.numel() for p in model.parameters() if p.requires_grad)
print(json.dumps(dict(params=params, buffer_gb=buffer_bytes(model, samples) / 2**30,
                      jacobian_gb=samples * classes * params * 4 / 2**30,
                      peak_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, seconds=seconds,
                      symmetric=bool(torch.equal(theta, theta.T)))))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="convit_tiny")
    p.add_argument("--samples", type=int, nargs="+", default=[16, 64])
    p.add_argument("--img-size", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=4)
    p.add_argument("--classes", type=int, default=10)
    args = p.parse_args(argv)
    print(
        f"{args.model} at {args.img_size}x{args.img_size}, patch {args.patch_size}, {args.classes} logits "
        f"(trace contraction), float32, 1 thread"
    )
    header = ("samples", "params", "full Jacobian (GB)", "gradient buffer (GB)", "peak RSS (GB)", "peak / Jacobian")
    rows = []
    for samples in args.samples:
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                WORKER,
                args.model,
                str(samples),
                str(args.img_size),
                str(args.patch_size),
                str(args.classes),
            ],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            print(out.stderr.strip().splitlines()[-1], file=sys.stderr)
            return 1
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(
            (
                samples,
                f"{r['params']:,}",
                f"{r['jacobian_gb']:.2f}",
                f"{r['buffer_gb']:.2f}",
                f"{r['peak_gb']:.2f}",
                f"{r['peak_gb'] / r['jacobian_gb']:.2f}x",
                f"{r['seconds']:.0f}",
            )
        )
    print(markdown_table((*header, "time (s)"), rows), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
