"""The run's options from argv to the trainer: the config package checks what it owns and loads no torch, each
package checks its own options (called once by the entry point), the checked Config is frozen, and the values
derived from it are computed once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

from convbias import engine
from convbias.base.errors import ConfigError
from convbias.engine.config import parsing as config_parsing
from convbias.engine.config.derived import RunValues
from convbias.engine.config.options import Config
from convbias.engine.data import checks as data_checks
from convbias.engine.data.factory import dataset_info
from convbias.engine.loop.start import start_run
from convbias.engine.model import checks as model_checks
from convbias.engine.optim import checks as optim_checks
from convbias.engine.optim import factory as optim_factory
from convbias.engine.rundir import checks as checkpointing_checks
from convbias.families import load_families

ROOT = REPO


def argv(tmp_path: Path, *options: str) -> list[str]:
    return ["--model", "vanilla_cnn", "--dataset", "digits", "--output", str(tmp_path / "run"), *options]


def test_a_checked_config_is_frozen_and_replace_gives_a_changed_copy(tmp_path):
    cfg = engine.parse_config(argv(tmp_path, "--lr", "0.1"))
    assert cfg.frozen
    with pytest.raises(AttributeError, match=r"cfg\.lr cannot be set: .* frozen; cfg\.replace\(lr=\.\.\.\) gives"):
        cfg.lr = 0.2
    changed = cfg.replace(lr=0.2)
    assert (cfg.lr, changed.lr, changed.frozen) == (0.1, 0.2, False)
    engine.validate(changed)  # a changed copy is checked as a Config built in Python, then frozen
    assert changed.frozen
    built = Config(model="vanilla_cnn", dataset="digits", output=str(tmp_path / "run"), no_aug=True)
    engine.validate(built)  # normalized in place before the freeze
    assert built.frozen and built.mixup == 0.0 and built.aa is None


@pytest.mark.parametrize(
    "options, package, message",
    [
        (("--dataset", "svhn"), data_checks, "unknown dataset 'svhn'; choices: digits"),
        (("--mean", "0.5", "0.5"), data_checks, "--mean 0.5 0.5: 2 values for 1-channel images"),
        (("--opt", "nope"), optim_checks, r"unknown --opt 'nope'; see timm.optim.list_optimizers\(\)"),
        (("--opt", "adamw", "--opt-betas", "0.9"), optim_checks, "--opt-betas: --opt adamw takes 2 betas, got 1"),
        (
            ("--epochs", "3", "--cooldown-epochs", "2", "--save-epochs", "6"),
            optim_checks,
            r"--save-epochs 6 is .*0\.\.5",
        ),
        (("--compile", "--compile-backend", "nope"), model_checks, "unknown --compile-backend 'nope'"),
    ],
)
def test_each_package_checks_its_own_options(tmp_path, options, package, message):
    """The config package passes what another package owns; that package's check names it, and the entry point
    (convbias.engine.parse_config) reports it."""
    cfg = config_parsing.parse_config([*argv(tmp_path), *options])
    assert not cfg.frozen
    with pytest.raises(ConfigError, match=message):
        package.check(cfg)
    with pytest.raises(ConfigError, match=message):
        engine.parse_config([*argv(tmp_path), *options])


def test_the_checkpointing_package_checks_the_resume_file_and_reads_an_evaluated_run(tmp_path):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"")
    cfg = config_parsing.parse_config([*argv(tmp_path), "--resume", str(weights)])
    with pytest.raises(ConfigError, match=r"--resume \S+weights\.bin is a file, and not one of timm's"):
        checkpointing_checks.check(cfg)
    assert checkpointing_checks.evaluated_run_options(str(weights)) == {}  # weights, not a run directory


def test_the_config_package_reads_and_checks_options_without_torch(tmp_path):
    """Its own reading and checks run in a process that never loads torch, timm or numpy; so does --help."""
    script = (
        "import sys; from convbias.engine.config.parsing import parse_config; "
        f"parse_config({argv(tmp_path, '--epochs', '2')!r}); "
        "print(sorted(m for m in ('torch', 'timm', 'numpy') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]"
    script = (
        "import runpy, sys; sys.argv = ['train.py', '--help']\n"
        "try: runpy.run_path('train.py', run_name='__main__')\n"
        "except SystemExit: pass\n"
        "print(sorted(m for m in ('torch', 'timm', 'numpy') if m in sys.modules), file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "--model" in done.stdout and done.stderr.strip() == "[]"


def test_the_scheduled_epochs_are_counted_once(tmp_path, monkeypatch):
    """timm's count (epochs, cooldown) serves the check of --save-epochs and the run's set-up: one count."""
    calls, create = [], optim_factory.create_scheduler_v2
    monkeypatch.setattr(optim_factory, "create_scheduler_v2", lambda *a, **kw: calls.append(kw) or create(*a, **kw))
    # a --seed (the lr noise's, part of timm's arguments) no other test schedules with: counted here, not earlier
    options = ("--epochs", "4", "--cooldown-epochs", "3", "--save-epochs", "7", "--seed", "12345")
    cfg = engine.parse_config(argv(tmp_path, *options))
    start = start_run(cfg, load_families(), None)
    assert start.values.epochs == 7 and len(calls) == 1


def test_the_set_up_resolves_options_in_a_frozen_copy_and_derives_values_once(tmp_path):
    cfg = engine.parse_config(argv(tmp_path, "--lr-base", "0.1", "--batch-size", "16", "--grad-accum-steps", "2"))
    start = start_run(cfg, load_families(), None)
    assert cfg.img_size is None  # the checked options are left as they are
    assert start.cfg.frozen and start.cfg.img_size == dataset_info("digits").default_img_size
    assert start.cfg.replace(img_size=None) == cfg
    # timm's train.py: lr = lr_base x global batch / lr_base_size (linear for SGD)
    assert start.values == RunValues(300, 5, 300, 32, 0.1 * 32 / 256, "--lr-base 0.1 x 32 / --lr-base-size 256")
