"""A training step priced on the CPU: aten ops dispatched and bytes written per phase, bytes saved for backward.

A GPU step's time outside the big GEMMs follows the kernels it launches and the bytes it writes, and its
activation memory the tensors autograd saves; all three are counted at PyTorch's dispatcher in eager mode on
the CPU (``benchmarks/dispatch_cost.py``). Each model's step is the one train.py builds (``start_run`` and
``build_trainer``, as benchmarks/train_loop.py builds it, on synthetic uint8 crops) with the DeiT recipe
(configs/recipes/deit.yaml: RandAugment rand-m9-mstd0.5-inc1, erasing 0.25, mixup 0.8 / cutmix 1.0, smoothing
0.1, AdamW) and its EMA (``--model-ema``), driven phase by phase through the engine's own objects: the loader's
hand-off (``DeviceBatches``), the device augmentation (``DeviceAugment``), mixup/cutmix, the forward with its
loss, the backward, the update (``Trainer._update``: clipping, optimizer, zero_grad, schedule), the EMA
(``Trainer._update_ema``) and the bookkeeping (``Trainer._after_step``, a step without a loss check), after
an unpriced step on two images (which creates the optimizer's state). The augmentation's headline figure is
priced alone on a GPU's batch (``--augment-batch-size``, 256): on a few images only some of RandAugment's ops
are drawn. The GPU rows are predicted from the bytes written at their batch (a bandwidth-bound step); the
growth of the step outside the model is read against ConViT-Ti with 3 blocks.

``ops`` are kernels a GPU would launch: dispatched ops less host reads (``aten._local_scalar_dense``: torch's
optimizers read their step counters, CPU tensors on every device, once or twice per parameter) and the
profiler's range markers, which launch none; host reads are counted beside them.

    python benchmarks/step_cost.py                  # ConViT-Ti, DeiT-Ti, tcnn_resnet50, resnet50; 224, batch 8
    python benchmarks/step_cost.py --models convit_tiny deit_tiny_patch16_224 --clip-grad 1.0

The last line holds the headline figures (the table above it, the goals): the augmentation's ops and bytes, ConViT-Ti
against DeiT-Ti, the T-CNN's saved bytes against ResNet-50's, the step outside the model.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from dispatch_cost import DispatchCost, SavedForBackward
from tqdm.auto import tqdm
from train_loop import build_engine

from convbias.engine.data.device_augment import DeviceBatches

PHASES = ("hand-off", "augmentation", "mixup", "forward", "backward", "optimizer", "ema", "bookkeeping")
OUTSIDE_THE_MODEL = ("mixup", "optimizer", "ema", "bookkeeping")  # the loss is in the forward
PAIRS = (("convit_tiny", "deit_tiny_patch16_224"), ("tcnn_resnet50", "resnet50"))
HOST_READS = "aten::_local_scalar_dense"
# The same family with a quarter of the parameter tensors: ConViT-Ti's 12 blocks (10 GPSA) against 3 (2 GPSA)
FEWER_TENSORS = ("convit_tiny", ("depth=3", "local_up_to_layer=2"))
# The goals: augmentation ops, its bytes (x the batch's fp32 bytes), ConViT-Ti / DeiT-Ti forward+backward
# ops and bytes, tcnn_resnet50 / resnet50 saved for backward
GOALS = dict(augmentation_ops=60, augmentation_bytes=4.0, ops_ratio=1.4, bytes_ratio=1.15, saved_ratio=1.15)
# The batch of each pair's GPU rows (benchmarks/gpu_acceptance.sh), at which the shares are predicted
GPU_BATCH = {PAIRS[0]: 256, PAIRS[1]: 128}
PER_IMAGE = ("hand-off", "mixup", "forward", "backward")  # their bytes grow with the batch; the update's do not
MODEL_STEP = ("forward", "backward", "optimizer")  # the bare model step of train_loop.py and convit_train_step.py
ENGINE_STEP = ("augmentation", "mixup", *MODEL_STEP, "bookkeeping")  # train_loop.py's engine (its recipe: no EMA)


def kernels(cost: DispatchCost) -> int:
    """The ops that launch a kernel on a GPU: all counted less host reads and profiler range markers."""
    return cost.ops - sum(n for name, n in cost.by_op.items() if name == HOST_READS or name.startswith("profiler::"))


def price_step(trainer) -> tuple[dict[str, DispatchCost], int, int]:
    """(cost per phase, bytes saved for backward, the batch's fp32 bytes) of a training step of ``trainer``,
    after one on two of its images (which creates the optimizer's state and what the model caches)."""
    acc, models, optimization = trainer.accelerator, trainer.models, trainer.optimization
    loader = torch.utils.data.DataLoader(trainer.data.bundle.train, batch_size=trainer.cfg.batch_size)
    images, targets = next(iter(loader))
    steps = 10 * trainer.data.steps_per_epoch  # the priced step is not a loss check
    loss_sum = torch.zeros((), dtype=torch.float64, device=acc.device)
    for count in (2, len(images)):  # mixup/cutmix takes even batches
        costs = {phase: DispatchCost() for phase in PHASES}
        with costs["hand-off"]:
            batch, labels = next(iter(DeviceBatches([(images[:count], targets[:count])], acc.device)))
        with costs["augmentation"]:
            batch = trainer.data.augment(batch)
        with costs["mixup"]:
            batch, labels = optimization.mixup(batch, labels)
        with costs["forward"], SavedForBackward() as saved:
            loss = optimization.train_loss(models.forward(batch), labels)
        with costs["backward"]:
            acc.backward(loss)
        with costs["optimizer"]:
            trainer._update()
        with costs["ema"]:
            trainer._update_ema()
        with costs["bookkeeping"]:
            trainer._after_step(0, 0, steps, loss, loss_sum, tqdm(total=steps, disable=True), updated=True)
    return costs, saved.bytes, batch.numel() * 4


def price_augmentation(trainer, batch_size: int) -> tuple[DispatchCost, int]:
    """(cost, the batch's fp32 bytes) of the trainer's device augmentation on one batch of random uint8 crops:
    at a few hundred images every RandAugment op is drawn for some image, as in a GPU's batch."""
    shape = (batch_size, *trainer.data.bundle.train[0][0].shape)  # the loader workers' uint8 crops
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with DispatchCost() as cost:
        trainer.data.augment(images)
    return cost, images.numel() * 4


def build(model: str, args: argparse.Namespace, work: Path, model_kwargs: tuple[str, ...] = ()):
    options = SimpleNamespace(
        model=model,
        img_size=args.img_size,
        patch_size=None,
        batch_size=args.batch_size,
        workers=0,
        precision=args.precision,
        recipe=True,
        compile=False,
        steps=2,
    )
    extra = ["--model-ema"] + (["--clip-grad", str(args.clip_grad)] if args.clip_grad else [])
    extra += ["--model-kwargs", *model_kwargs] if model_kwargs else []
    return build_engine(options, work / "_".join((model, *model_kwargs)), tuple(extra))


def bytes_at(
    costs: dict[str, DispatchCost], batch_size: int, augmentation: DispatchCost, augment_batch_size: int, gpu_batch: int
) -> dict[str, float]:
    """Bytes written per phase by a step of ``gpu_batch`` images: the per-image phases scaled from the priced
    batch, the augmentation from its own batch, the update's phases (optimizer, EMA, bookkeeping) as priced."""
    return {
        phase: augmentation.bytes_written * gpu_batch / augment_batch_size
        if phase == "augmentation"
        else costs[phase].bytes_written * (gpu_batch / batch_size if phase in PER_IMAGE else 1)
        for phase in PHASES
    }


def mb(count: int) -> str:
    return f"{count / 1e6:.2f}"


def phase_table(model: str, costs: dict[str, DispatchCost], saved: int, batch_bytes: int, tensors: int) -> None:
    print(f"\n{model} ({tensors} parameter tensors): saved for backward {mb(saved)} MB")
    print("| phase | ops | host reads | MB written | x batch fp32 |")
    print("|---|---|---|---|---|")
    for phase in (*PHASES, "outside the model"):
        parts = OUTSIDE_THE_MODEL if phase == "outside the model" else (phase,)
        ops = sum(kernels(costs[p]) for p in parts)
        reads = sum(costs[p].by_op[HOST_READS] for p in parts)
        written = sum(costs[p].bytes_written for p in parts)
        print(f"| {phase} | {ops} | {reads} | {mb(written)} | {written / batch_bytes:.2f} |")


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=[m for pair in PAIRS for m in pair])
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--augment-batch-size", type=int, default=256, help="the batch the augmentation is priced on alone (a GPU's)"
    )
    parser.add_argument("--clip-grad", type=float, default=None, help="the engine's --clip-grad (the recipe has none)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument(
        "--precision", choices=("bf16", "fp32"), default="bf16", help="bf16: autocast, as the GPU rows train"
    )
    args = parser.parse_args(argv)
    if min(args.img_size, args.batch_size, args.augment_batch_size) < 1:
        parser.error("--img-size, --batch-size, --augment-batch-size: expected a positive number")
    os.environ["ACCELERATE_USE_CPU"] = "true"
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"# a training step's cost counted on the CPU (eager, {args.precision}), {args.img_size}px, batch {args.batch_size}, "
        f"DeiT recipe with EMA{f' and clipping at {args.clip_grad}' if args.clip_grad else ''}; torch {torch.__version__}"
    )
    priced, augmentation = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            trainer = build(model, args, Path(tmp))
            priced[model] = (*price_step(trainer), len(list(trainer.models.model.parameters())))
            phase_table(model, *priced[model])
            if augmentation is None:  # the same for every model
                augmentation = price_augmentation(trainer, args.augment_batch_size)
        outside = {}
        if FEWER_TENSORS[0] in priced:
            few = build(FEWER_TENSORS[0], args, Path(tmp), FEWER_TENSORS[1])
            for name, (costs, *_, tensors) in (
                (
                    f"{FEWER_TENSORS[0]} {' '.join(FEWER_TENSORS[1])}",
                    (*price_step(few), len(list(few.models.model.parameters()))),
                ),
                (FEWER_TENSORS[0], priced[FEWER_TENSORS[0]]),
            ):
                outside[name] = (sum(kernels(costs[p]) for p in OUTSIDE_THE_MODEL), tensors)

    figures: dict[str, float] = {}
    print("\n| figure | value | goal |")
    print("|---|---|---|")
    first, second = PAIRS[0]
    if augmentation is not None:
        cost, batch_bytes = augmentation
        figures["augmentation_ops"] = kernels(cost)
        figures["augmentation_bytes"] = cost.bytes_written / batch_bytes
        print(
            f"| augmentation ops, one batch of {args.augment_batch_size} | {figures['augmentation_ops']} | "
            f"<= {GOALS['augmentation_ops']} |"
        )
        print(
            f"| augmentation bytes written, x the batch's fp32 bytes | {figures['augmentation_bytes']:.1f} | "
            f"<= {GOALS['augmentation_bytes']} |"
        )
    if first in priced and second in priced:
        ours, theirs = priced[first][0], priced[second][0]
        model_ops = [sum(kernels(c[p]) for p in ("forward", "backward")) for c in (ours, theirs)]
        model_bytes = [sum(c[p].bytes_written for p in ("forward", "backward")) for c in (ours, theirs)]
        figures["ops_ratio"], figures["bytes_ratio"] = model_ops[0] / model_ops[1], model_bytes[0] / model_bytes[1]
        print(f"| {first} / {second}, forward+backward ops | {figures['ops_ratio']:.2f} | <= {GOALS['ops_ratio']} |")
        print(
            f"| {first} / {second}, forward+backward bytes | {figures['bytes_ratio']:.2f} | <= {GOALS['bytes_ratio']} |"
        )
    cnn_pair = PAIRS[1]
    if all(m in priced for m in cnn_pair):
        figures["saved_ratio"] = priced[cnn_pair[0]][1] / priced[cnn_pair[1]][1]
        print(
            f"| {cnn_pair[0]} / {cnn_pair[1]}, saved for backward | {figures['saved_ratio']:.2f} | "
            f"<= {GOALS['saved_ratio']} |"
        )
    grows = None
    if outside:
        counts = [ops for ops, _ in outside.values()]
        grows = counts[0] != counts[1]
        figures["outside_ops"] = counts[1]
        described = ", ".join(f"{ops} for {name} ({tensors} tensors)" for name, (ops, tensors) in outside.items())
        print(f"| step outside the model, ops | {described} | the same for any number of tensors |")
    predictions = []
    if augmentation is not None and first in priced:
        at = bytes_at(priced[first][0], args.batch_size, augmentation[0], args.augment_batch_size, GPU_BATCH[PAIRS[0]])
        total = sum(at[p] for p in ENGINE_STEP)
        predictions += [
            (f"{first}: the augmentation's share of the engine's step", at["augmentation"] / total),
            (f"{first}: the engine against its bare model step", sum(at[p] for p in MODEL_STEP) / total),
        ]
    for pair in PAIRS:
        if all(m in priced for m in pair):
            at = [
                bytes_at(priced[m][0], args.batch_size, augmentation[0], args.augment_batch_size, GPU_BATCH[pair])
                for m in pair
            ]
            model_bytes = [sum(side[p] for p in MODEL_STEP) for side in at]
            predictions.append((f"{pair[0]} / {pair[1]}: training speed", model_bytes[1] / model_bytes[0]))
            saved = priced[pair[0]][1] / priced[pair[1]][1]
            predictions.append((f"{pair[0]} / {pair[1]}: activation memory (saved for backward)", saved))
    if predictions:
        batches = ", ".join(f"{pair[0]} {batch}" for pair, batch in GPU_BATCH.items())
        print(f"\npredicted from bytes written (a bandwidth-bound GPU step) at the GPU rows' batch ({batches}):")
        print("| GPU row | prediction |")
        print("|---|---|")
        for name, value in predictions:
            print(f"| {name} | {value:.2f} |")
    last = [
        f"augmentation {figures['augmentation_ops']} ops {figures['augmentation_bytes']:.1f}x"
        if "augmentation_ops" in figures
        else None,
        f"convit/deit ops {figures['ops_ratio']:.2f}x bytes {figures['bytes_ratio']:.2f}x"
        if "ops_ratio" in figures
        else None,
        f"tcnn/resnet50 saved {figures['saved_ratio']:.2f}x" if "saved_ratio" in figures else None,
        f"outside the model {figures['outside_ops']} ops, {'grows' if grows else 'constant'} with parameter tensors"
        if grows is not None
        else None,
    ]
    print("; ".join(part for part in last if part))
    return figures


if __name__ == "__main__":
    main()
