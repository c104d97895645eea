"""What the EMA's update costs a GPU (aten ops, counted at the dispatcher by benchmarks/dispatch_cost.py): two
multi-tensor ops on any device, with timm's values."""

from types import SimpleNamespace

import pytest
import torch
from timm.utils import ModelEmaV3

from benchmarks.dispatch_cost import DispatchCost
from convbias.engine.model.build import create_ema

pytestmark = pytest.mark.usefixtures("single_thread")


def test_the_ema_updates_every_tensor_in_two_ops_on_any_device_as_timm_updates_them():
    """The EMA is built where the model is and then moved (as timm's train.py builds it after moving the model):
    timm's ModelEmaV3 given another device updates one tensor at a time. Its integer buffers (BatchNorm's
    update counts) are copied in one op too. The values are timm's ModelEmaV3's."""
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))]
    model = torch.nn.Sequential(*layers)  # 16 parameters, 12 buffers (4 of them integer), on the CPU
    options = SimpleNamespace(model_ema=True, model_ema_decay=0.9, model_ema_warmup=False)
    ema, timm_ema = create_ema(options, model, torch.device("cpu")), ModelEmaV3(model, decay=0.9)
    model(torch.randn(8, 4))  # new batch statistics and counts
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))
    ema.update(model, step=5)
    timm_ema.update(model, step=5)
    for (name, ours), theirs in zip(ema.module.state_dict().items(), timm_ema.module.state_dict().values()):
        assert torch.equal(ours, theirs), name

    on_device = create_ema(options, model, torch.device("meta"))  # the device the model will train on
    assert {p.device.type for p in on_device.module.parameters()} == {"meta"}
    model.to("meta")
    with DispatchCost() as cost:
        on_device.update(model, step=5)
    assert cost.by_op == {"aten::_foreach_copy_": 1, "aten::_foreach_lerp_.Scalar": 1}, cost.by_op
