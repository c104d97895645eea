"""What GPSA adds to a training step, counted at PyTorch's dispatcher (`dispatch_cost`) on the CPU.

Two pairs, each model beside its baseline:
  ConViT-Ti against DeiT-Ti: aten ops dispatched and bytes written by one forward + backward (eager, after a
      warm-up step that builds the cached geometry), fp32 and bf16 autocast;
  tcnn_resnet50 against resnet50 (and resnet50 with the T-CNN's stride change, no attention): bytes the
      training forward saves for the backward (fp32).
Counts, not timings: on a GPU each op is a kernel launch and the bytes are memory traffic and activation
memory, so the ratios predict where the GPU's step goes, and are the same on any machine.

    python benchmarks/gpsa_cost.py                      # batch 8 at 224 (about a minute on 2 cores)
    python benchmarks/gpsa_cost.py --batch-size 2
"""

from __future__ import annotations

import argparse

import timm
import torch
from dispatch_cost import DispatchCost, SavedForBackward

import convit  # noqa: F401  (registers convit_tiny)
import transformed_cnn  # noqa: F401  (registers tcnn_resnet50)
from convbias.base.tables import markdown_table
from transformed_cnn.transform import remove_stage_stride

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def step_cost(name: str, images: torch.Tensor, dtype: torch.dtype | None) -> DispatchCost:
    """Ops and bytes of one forward + backward of a freshly built model, after one warm-up step."""
    torch.manual_seed(0)
    model = timm.create_model(name).train()
    for _ in range(2):  # the first step builds the cached geometry; the second is counted
        model.zero_grad(set_to_none=True)
        with DispatchCost() as cost:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = model(images).float().sum()
            loss.backward()
    return cost


def saved_bytes(model: torch.nn.Module, images: torch.Tensor) -> int:
    """Bytes the training forward keeps for the backward."""
    with SavedForBackward() as saved:
        model.train()(images)
    return saved.bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=224)
    args = parser.parse_args()
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size)

    rows = []
    for precision, dtype in PRECISIONS.items():
        convit_cost, deit_cost = (step_cost(n, images, dtype) for n in ("convit_tiny", "deit_tiny_patch16_224"))
        rows.append(
            [
                f"ConViT-Ti / DeiT-Ti, forward + backward, {precision}",
                f"{convit_cost.ops} / {deit_cost.ops} = {convit_cost.ops / deit_cost.ops:.3f}",
                f"{convit_cost.bytes_written / 1e6:.0f} / {deit_cost.bytes_written / 1e6:.0f} MB = "
                f"{convit_cost.bytes_written / deit_cost.bytes_written:.3f}",
            ]
        )
    resnet = saved_bytes(timm.create_model("resnet50"), images)
    strided = timm.create_model("resnet50")
    remove_stage_stride(strided, 4)
    for label, model in (("resnet50, last stage at stride 1", strided), ("tcnn_resnet50", None)):
        saved = saved_bytes(model or timm.create_model("tcnn_resnet50"), images)
        rows.append(
            [
                f"{label} / resnet50, saved for backward",
                "",
                f"{saved / 1e6:.0f} / {resnet / 1e6:.0f} MB = {saved / resnet:.3f}",
            ]
        )
    print(f"batch {args.batch_size} at {args.img_size}, torch {torch.__version__}, timm {timm.__version__}")
    print(markdown_table(["pair", "aten ops", "bytes"], rows))


if __name__ == "__main__":
    main()
