"""Time and peak memory of efcn.embed for the VanillaCNN (Sec. 6.2.2), vs the size of the eFCN's weights.

Each configuration runs in a fresh subprocess. Peak memory is the process's peak RSS during
`embed` minus its RSS just before (torch imported, CNN built), so it counts the dense matrices,
the masks and every temporary. Target: peak <= 1.5x the eFCN's weights.

    python benchmarks/efcn_embedding.py                      # 16, 32, 64 channels at 32x32 RGB
    python benchmarks/efcn_embedding.py --channels 8 16 --img-size 16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

WORKER = r"""
import json, resource, sys, time
import torch, efcn

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

channels, img_size = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
cnn = efcn.VanillaCNN(channels=channels, img_size=img_size).eval()
before = rss_mb()
start = time.perf_counter()
model = efcn.embed(cnn, (3, img_size, img_size))
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
params = sum(p.numel() for p in model.parameters())
x = torch.randn(2, 3, img_size, img_size)
with torch.no_grad():
    error = (model(x) - cnn(x)).abs().max().item()
print(json.dumps(dict(params=params, weights_mb=params * 4 / 2**20, seconds=seconds,
                      peak_mb=peak - before, max_abs_error=error)))
"""


def measure(channels: int, img_size: int) -> dict:
    out = subprocess.run([sys.executable, "-c", WORKER, str(channels), str(img_size)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"embedding {channels} channels at {img_size}x{img_size} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--channels", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--img-size", type=int, default=32)
    args = parser.parse_args()
    print(
        f"VanillaCNN (3 x conv3x3-ReLU-maxpool2, RGB {args.img_size}x{args.img_size}) -> eFCN, fp32, one process each"
    )
    print(
        f"{'channels':>8} {'eFCN params':>14} {'weights MB':>11} {'embed s':>8} {'peak MB':>9} "
        f"{'peak/weights':>12} {'max |err|':>10}"
    )
    for channels in args.channels:
        r = measure(channels, args.img_size)
        print(
            f"{channels:>8} {r['params']:>14,} {r['weights_mb']:>11.1f} {r['seconds']:>8.2f} {r['peak_mb']:>9.1f} "
            f"{r['peak_mb'] / r['weights_mb']:>12.2f} {r['max_abs_error']:>10.1e}"
        )


if __name__ == "__main__":
    main()
