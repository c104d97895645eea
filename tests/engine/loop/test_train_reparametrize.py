"""--reparametrize-at-epoch: a ResNet (timm's 0.47M-parameter test_resnet) trains, becomes a T-CNN (transformed_cnn.transform) at the start of
epoch 1, and keeps the optimizer state of every parameter that survives."""

import json

import pytest
import torch
from safetensors.torch import load_file

from convbias.cli import train
from convbias.engine.checkpoint.resume import load_training_state

pytestmark = pytest.mark.integration

pytest.importorskip("transformed_cnn.transform")

TCNN_AT_EPOCH_1 = dict(
    model="test_resnet",
    img_size=32,
    train_fraction=0.2,
    batch_size=16,
    lr=1e-3,
    epochs=2,
    drop_path=0,
    reparametrize="tcnn",
    reparametrize_at_epoch=1,
    reparametrize_kwargs=dict(init="paper"),
    no_diagnostics=True,
)


def test_reparametrize_keeps_optimizer_state_of_surviving_parameters(tmp_path, capsys, cli_argv):
    output = tmp_path / "run"
    results = train.run(
        cli_argv(
            cli_argv.DEIT_RECIPE,
            cli_argv.PLAIN_DIGITS,
            TCNN_AT_EPOCH_1,
            param_group_lr=dict(gating_param=0.1),
            output=output,
        )
    )
    assert "reparametrized the model" in capsys.readouterr().out
    names = load_file(str(output / "checkpoints" / "last" / "model.safetensors")).keys()
    assert {"layer4.0.conv1.gating_param", "layer4.0.conv2.pos_proj.weight"} <= names
    assert "layer4.0.conv1.weight" not in names and "layer3.0.conv1.weight" in names

    state = load_training_state(output / "checkpoints" / "last")
    assert state["reparametrized"] is True
    steps = {}
    for group in state["optimizer"]["param_groups"]:
        for name, index in zip(group["param_names"], group["params"]):
            steps[name] = int(state["optimizer"]["state"][index]["step"])
    per_epoch = state["num_updates"] // 2
    gating = [name for name in steps if "gating_param" in name]
    assert gating and all(steps[name] == per_epoch for name in gating)  # new in epoch 2
    gating_groups = [g for g in state["optimizer"]["param_groups"] if g["lr_pattern"] == "gating_param"]
    assert len(gating_groups) == 1 and set(gating_groups[0]["param_names"]) == set(gating)
    assert gating_groups[0]["initial_lr"] == 0.1
    assert steps["conv1.0.weight"] == steps["layer1.0.conv1.weight"] == 2 * per_epoch  # kept across the change

    # the checkpoint is a T-CNN: eval-only rebuilds the transformed architecture before loading it
    eval_args = cli_argv(cli_argv.DEIT_RECIPE, cli_argv.PLAIN_DIGITS, TCNN_AT_EPOCH_1, reparametrize_at_epoch=None)
    metrics = train.run(eval_args + ["--eval-only", "--checkpoint", str(output / "checkpoints" / "last")])
    assert metrics["eval_top1"] == pytest.approx(results["final_top1"])
    assert json.loads((output / "results.json").read_text())["epochs"] == 2
    assert torch.is_tensor(state["rng"][0]["torch"])
