"""The relative-stability study's plan (convbias.studies.stability.runs): every model of the
contrasts at every size and seed, and every planned train.py command accepted by the engine's own parser."""

from __future__ import annotations

from pathlib import Path

from support import REPO

from convbias.engine import parse_config
from convbias.studies.stability import runs as study
from convbias.studies.stability.contrasts import FRACTIONS, MODELS


def test_the_plan_covers_every_model_size_and_seed_of_the_contrasts():
    runs = study.study_runs([0, 1], list(FRACTIONS), Path("runs/rs"))
    assert len(runs) == len(MODELS) * len(FRACTIONS) * 2 == len({r.name for r in runs})
    assert {r.name.split("_P")[0] for r in runs} == set(MODELS)
    first_cnn = next(i for i, r in enumerate(runs) if r.name == "cnn_P0.25_seed0")
    lifted = [i for i, r in enumerate(runs) if r.name.startswith("efcn_r") and r.name.endswith("P0.25_seed0")]
    assert len(lifted) == 2 and all(i > first_cnn for i in lifted)  # each eFCN after its CNN's snapshots


def test_every_planned_command_parses(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the plan names configs/ relative to the repository, as the study runs there
    for run in study.study_runs([3], [0.25], tmp_path / "runs"):
        cfg = parse_config([*run.train_argv, "--output", str(tmp_path / run.name)])
        assert cfg.seed == 3 and cfg.train_fraction == 0.25, run.name
        if run.name.startswith("efcn_r"):
            relax = int(run.name[len("efcn_r")])
            assert cfg.epochs == study.CNN_EPOCHS - relax
            assert cfg.model_kwargs["cnn_checkpoint"].endswith(f"epoch_{relax}.safetensors")
        if run.name.startswith("cnn_"):
            assert sorted(cfg.save_epochs) == [0, *study.RELAX_EPOCHS]
