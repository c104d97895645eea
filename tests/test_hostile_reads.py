"""Every file a command reads is untrusted: a run's config.yaml, a point's manifest.json, results.json, an
export folder (config.json and its weights), a class map, the entries of an image folder; and every option
value is checked where it is declared. Each case is one line with its exit code, naming the file and the key,
and nothing is written. The runs here are points written by ``CheckpointDir`` or one tiny trained run per
module."""

import pytest
from test_hostile_inputs import one_line, run_train

from convbias.errors import EXIT_USAGE

pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------------------- option values
@pytest.mark.parametrize(
    "options, refused",
    [
        (["--seed", "-1"], r"--seed must be in \[0, 2\*\*31\), got -1"),
        (["--seed", str(2**40)], r"--seed must be in \[0, 2\*\*31\), got 1099511627776"),
        (["--sched", "step", "--decay-epochs", "0"], r"--decay-epochs must be positive, got 0"),
        (["--opt", "sgd", "--momentum", "-1"], r"--momentum must be in \[0, 1\), got -1"),
        (["--sched", "step", "--decay-rate", "-0.5"], r"--decay-rate must be in \(0, 1\], got -0.5"),
        (["--lr-noise", "0.1", "--lr-noise-pct", "1.5"], r"--lr-noise-pct must be in \(0, 1\], got 1.5"),
        (["--hflip", "2"], r"--hflip must be in \[0, 1\], got 2"),
        (["--scale", "0", "1"], r"--scale must be two positive numbers, MIN <= MAX"),
        (["--save-epochs", "-1"], r"--save-epochs must be epochs >= 0"),
    ],
)
def test_an_option_value_out_of_its_declared_range_is_one_line(tmp_path, capsys, options, refused):
    code, err = run_train(capsys, *options, "--output", str(tmp_path / "run"))
    assert code == EXIT_USAGE
    one_line(err, rf"^error: {refused}")
    assert not (tmp_path / "run").exists()


def test_lr_noise_within_its_range_keeps_every_lr_positive():
    """timm multiplies the lr by 1 + a draw bounded by --lr-noise-pct: at most 1 keeps it positive, so the
    option's range is what makes a negative lr impossible (timm's own scheduler is the oracle)."""
    import torch
    from timm.scheduler import CosineLRScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    for pct, negative_possible in ((1.0, False), (3.0, True)):
        scheduler = CosineLRScheduler(
            optimizer, t_initial=200, noise_range_t=0, noise_pct=pct, noise_std=3.0, noise_seed=1
        )
        lrs = [scheduler._get_values(t, on_epoch=True)[0] for t in range(200)]
        lrs = [lr + lr * scheduler._calculate_noise(t) for t, lr in enumerate(lrs)]
        assert (min(lrs) < 0) == negative_possible


@pytest.mark.parametrize(
    "environment, present",
    [({"WORLD_SIZE": "2"}, "WORLD_SIZE=2"), ({"LOCAL_RANK": "0"}, "LOCAL_RANK=0"), ({"WORLD_SIZE": "x"}, None)],
)
def test_launcher_variables_without_a_launcher_say_what_to_run(tmp_path, capsys, monkeypatch, environment, present):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    code, err = run_train(capsys, "--output", str(tmp_path / "run"))
    assert code == EXIT_USAGE
    if present is None:
        one_line(err, r"^error: WORLD_SIZE='x' in the environment: expected the number of processes")
    else:
        one_line(err, rf"^error: the environment holds {present} but not .*MASTER_ADDR.*convbias-launch")
    assert not (tmp_path / "run").exists()
