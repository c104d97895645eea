"""Evaluation: exact loss, top-1 and top-5 over a validation set split between processes.

The eval loader is prepared (accelerate pads its last batches alike on every process) and metrics go
through ``gather_for_metrics``, which drops the padding, so they are exact; a stream's loaders are not
prepared (timm's reader splits the stream between processes) and each process's sums are reduced once
after evaluation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from accelerate import Accelerator


@torch.no_grad()
def evaluate(
    acc: Accelerator, model: torch.nn.Module, loader: Iterable, streamed: bool, channels_last: bool = False
) -> dict[str, float]:
    """Exact loss, top-1 and top-5 (in %) over the whole validation set, across all processes."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=acc.device)  # loss sum, top-1 and top-5 hits, images
    for images, targets in loader:
        images, targets = images.to(acc.device), targets.to(acc.device)  # a stream's loader is not prepared
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with acc.autocast():
            logits = model(images)
        loss = F.cross_entropy(logits.float(), targets, reduction="none")
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        correct1 = top[:, 0] == targets
        correct5 = (top == targets[:, None]).any(dim=1)
        if not streamed:  # the prepared loader pads the last batches alike; gather_for_metrics drops that
            loss, correct1, correct5 = acc.gather_for_metrics((loss, correct1, correct5))
        totals += torch.stack(
            [
                loss.double().sum(),
                correct1.double().sum(),
                correct5.double().sum(),
                torch.tensor(loss.numel(), dtype=torch.float64, device=acc.device),
            ]
        )
    if streamed:  # each process read its own part of the stream, in batches of its own number and sizes
        totals = acc.reduce(totals, reduction="sum")
    model.train(was_training)
    loss_sum, top1, top5, count = totals.tolist()
    return {"eval_loss": loss_sum / count, "eval_top1": 100.0 * top1 / count, "eval_top5": 100.0 * top5 / count}
