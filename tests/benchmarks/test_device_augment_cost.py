"""What one batch of the device augmentation costs a GPU (aten ops and bytes written, counted at the dispatcher on
the CPU by benchmarks/dispatch_cost.py), whatever RandAugment draws."""

import numpy as np
import pytest
import torch

from benchmarks.dispatch_cost import DispatchCost
from convbias.engine.data.device_augment import AugmentSpec, DeviceAugment

pytestmark = pytest.mark.usefixtures("single_thread")

# the DeiT recipe's augmentation (RandAugment rand-m9-mstd0.5-inc1, normalization, erasing 0.25 in pixel mode)
DEIT_RECIPE = AugmentSpec(img_size=224, in_chans=3, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
# the goal for one batch: aten ops, and bytes written in fp32 batches
MAX_OPS, MAX_FP32_BATCHES_WRITTEN = 60, 4.0


def test_a_batch_is_a_few_passes_whatever_the_draw():
    """The DeiT recipe on 16 images at 224, four seeds (different ops, boxes): the same op count for every draw,
    at most MAX_OPS ops and MAX_FP32_BATCHES_WRITTEN fp32 batches written (one batch per op before)."""
    batch = torch.randint(0, 256, (16, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    fp32_batch = batch.numel() * 4
    counts, distinct = [], set()
    for seed in range(4):
        augment = DeviceAugment(DEIT_RECIPE, "cpu", seed=seed)
        state = augment.state_dict()
        with DispatchCost() as cost:
            augment(batch)
        counts.append((cost.ops, cost.bytes_written / fp32_batch))
        augment.load_state_dict(state)
        ops, _ = augment.rand_augment.sample(len(batch), augment.plan_generator)
        distinct.add(len(np.unique(ops)))
    assert len(distinct) > 1, "the seeds drew the same number of distinct ops: the check would not see a change"
    assert len({ops for ops, _ in counts}) == 1, counts
    assert all(ops <= MAX_OPS and written <= MAX_FP32_BATCHES_WRITTEN for ops, written in counts), counts
