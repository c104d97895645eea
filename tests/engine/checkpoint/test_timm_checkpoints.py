"""timm's train.py checkpoints (written by timm's own CheckpointSaver: state_dict, optimizer, state_dict_ema,
epoch, arch, args as an argparse.Namespace, version, metric) load as weights, safely."""

import argparse
import pickle
from pathlib import Path

import pytest
import timm
import torch
import yaml
from support.images import image_folder
from support.timm_train import TIMM_EPOCHS, TIMM_UPDATES_PER_EPOCH, TINY_RESNET, timm_run, timm_train_args
from timm.utils import CheckpointSaver

from convbias.base.errors import ConfigError
from convbias.base.weights import load_weights, read_state_dict


@pytest.fixture
def folder_of_three(tmp_path):
    """DIR/<class>/<image>: 3 classes of 2 images."""
    return image_folder(tmp_path, per_class=2, side=16)


def timm_checkpoint(tmp_path):
    """model_best.pth.tar and last.pth.tar as timm's train.py writes them, for a tiny resnet with an EMA."""
    model = timm.create_model("resnet10t", num_classes=3)
    ema = timm.create_model("resnet10t", num_classes=3)
    args = argparse.Namespace(model="resnet10t", lr=0.1, model_kwargs={}, scale=[0.08, 1.0], aa=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    saver = CheckpointSaver(model, optimizer, args=args, model_ema=ema, checkpoint_dir=str(tmp_path))
    saver.save_checkpoint(epoch=0, metric=12.5)
    return model, ema


def test_a_timm_checkpoint_loads_its_models_weights(tmp_path):
    model, _ = timm_checkpoint(tmp_path)
    for name in ("model_best.pth.tar", "last.pth.tar"):
        weights = read_state_dict(tmp_path / name)
        assert weights.keys() == model.state_dict().keys()
        assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    fresh = timm.create_model("resnet10t", num_classes=3)
    load_weights(fresh, tmp_path / "model_best.pth.tar")
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


class Payload:
    """An object that runs code when unpickled."""

    def __reduce__(self):
        return (exec, ("raise SystemExit('executed')",))


def test_a_torch_file_with_other_objects_is_refused_unexecuted(tmp_path):
    path = tmp_path / "evil.pth.tar"
    torch.save(
        {"state_dict": {"w": torch.zeros(1)}, "payload": Payload()}, path, pickle_protocol=pickle.DEFAULT_PROTOCOL
    )
    with pytest.raises(ConfigError, match="weights_only=True .* it was not unpickled"):
        read_state_dict(path)


def test_a_timm_checkpoint_starts_a_run_and_is_evaluated(tmp_path, folder_of_three):
    from convbias import engine
    from convbias.engine import parse_config
    from convbias.families import load_families

    timm_checkpoint(tmp_path)
    best = str(tmp_path / "model_best.pth.tar")
    base = ["--model", "resnet10t", "--num-classes", "3", "--data-dir", str(folder_of_three), "--workers", "0"]
    metrics = engine.run(["--eval-only", best, *base], load_families())  # its args name no num_classes
    assert 0 <= metrics["eval_top1"] <= 100
    assert parse_config([*base, "--initial-checkpoint", best, "--output", str(tmp_path / "run")]).checkpoint == best
    other = tmp_path / "weights.bin"
    other.write_bytes((tmp_path / "last.pth.tar").read_bytes())
    with pytest.raises(ConfigError, match=r"^--resume \S+weights\.bin is a file, and not one of timm's training "):
        parse_config([*base, "--resume", str(other), "--output", str(tmp_path / "run")])


def test_training_from_a_timm_checkpoint_starts_from_its_ema_as_timms_initial_checkpoint(tmp_path, folder_of_three):
    """timm's train.py --initial-checkpoint is create_model(checkpoint_path=), whose load_checkpoint takes
    state_dict_ema first (use_ema=True); its validate.py takes the model's unless --use-ema. --checkpoint (and
    --model-kwargs checkpoint_path) start training from what timm's create_model loads; --eval-only evaluates the
    model's weights."""
    from safetensors.torch import load_file

    from convbias import engine
    from convbias.base.run_layout import CHECKPOINTS_DIR, snapshot_file
    from convbias.families import load_families

    model, ema = timm_checkpoint(tmp_path)
    best = str(tmp_path / "model_best.pth.tar")
    assert not torch.equal(model.conv1[0].weight, ema.conv1[0].weight)  # two inits: which one loads shows
    timms = timm.create_model("resnet10t", num_classes=3, checkpoint_path=best).state_dict()
    base = ["--model", "resnet10t", "--num-classes", "3", "--data-dir", str(folder_of_three), "--workers", "0"]
    base += ["--epochs", "1", "--save-epochs", "0", "--img-size", "16", "--batch-size", "2", "--warmup-epochs", "0"]
    for name, weights in (
        ("checkpoint", ["--checkpoint", best]),
        ("kwargs", ["--model-kwargs", f"checkpoint_path={best}"]),
    ):
        run = tmp_path / name
        assert engine.run([*base, *weights, "--output", str(run)], load_families())
        started = load_file(run / CHECKPOINTS_DIR / snapshot_file(0))
        assert started.keys() == timms.keys()
        assert all(torch.equal(started[k], v) for k, v in timms.items()), name
    assert all(torch.equal(read_state_dict(best)[k], v) for k, v in model.state_dict().items())  # eval's weights


# --------------------------------------------------------------------------- --resume of timm's last.pth.tar
# timm_run's run: TIMM_EPOCHS epochs, stopped after its second (saved epoch 1); resumed here for the third
def timm_resumed_optimizer(path, args, sched_on_updates):
    """The oracle: timm's train.py's resume of ``path`` (resume_checkpoint into a fresh model and optimizer, then
    create_scheduler_v2 and its step to the start epoch); returns (model, optimizer)."""
    from timm.models import resume_checkpoint
    from timm.optim import create_optimizer_v2, optimizer_kwargs
    from timm.scheduler import create_scheduler_v2, scheduler_kwargs

    model = timm.create_model(args.model, num_classes=args.num_classes, **args.model_kwargs)
    optimizer = create_optimizer_v2(model, **optimizer_kwargs(args))
    start_epoch = resume_checkpoint(model, str(path), optimizer=optimizer, log_info=False)
    args = argparse.Namespace(**{**vars(args), "sched_on_updates": sched_on_updates})
    scheduler, _ = create_scheduler_v2(optimizer, **scheduler_kwargs(args), updates_per_epoch=TIMM_UPDATES_PER_EPOCH)
    if sched_on_updates:
        scheduler.step_update(start_epoch * TIMM_UPDATES_PER_EPOCH)
    else:
        scheduler.step(start_epoch)
    return model, optimizer, start_epoch


CLASS_NAMES = ["cat", "dog", "bird"]


@pytest.fixture(scope="module")
def timm_last(tmp_path_factory):
    """last.pth.tar of a short timm run whose --class-map names its 3 classes, with its own preprocessing (one run
    for the tests of this module that only read it)."""
    folder = tmp_path_factory.mktemp("timm_run")
    (folder / "classes.txt").write_text("\n".join(CLASS_NAMES) + "\n")
    data = dict(img_size=40, crop_pct=0.95, interpolation="bilinear", mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    return timm_run(folder, timm_train_args(class_map=str(folder / "classes.txt"), **data))


@pytest.fixture
def folder_of_twelve(tmp_path):
    """DIR/<class>/<image>: 3 classes of 4 images, 32 px."""
    return image_folder(tmp_path, per_class=4, side=32)


def engine_arguments(folder, output, resume, *extra):
    recipe = Path(folder).parent / "tiny_resnet.yaml"  # the model kwargs of timm's run, as a recipe gives them
    recipe.write_text(
        yaml.safe_dump({"model_kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in TINY_RESNET.items()}})
    )
    return [
        "-c", str(recipe),
        "--model", "resnet10t", "--data-dir", str(folder), "--img-size", "32", "--batch-size", "4",
        "--epochs", str(TIMM_EPOCHS), "--warmup-epochs", "1", "--model-ema", "--model-ema-decay", "0.5",
        "--workers", "0", "--output", str(output), "--resume", str(resume), *extra,
    ]  # fmt: skip


@pytest.mark.integration
def test_resume_of_timms_last_checkpoint_continues_as_timms_train_py(tmp_path, folder_of_twelve, timm_last):
    import csv
    import json

    from convbias.engine import parse_config
    from convbias.engine.checkpoint.points import CheckpointDir
    from convbias.engine.loop.start import start_run
    from convbias.engine.loop.trainer import build_trainer
    from convbias.families import load_families

    last = timm_last
    saved = torch.load(last, weights_only=False)
    args = saved["args"]
    cfg = parse_config(engine_arguments(folder_of_twelve, tmp_path / "run", last))
    trainer = build_trainer(start_run(cfg, load_families(), None))
    resumed = trainer.checkpointer.load(trainer.start.resume)  # what fit() begins with (and does again below)
    assert trainer.data.steps_per_epoch == TIMM_UPDATES_PER_EPOCH  # 8 training images in batches of 4: as timm's run
    model = trainer.accelerator.unwrap_model(trainer.models.model)
    assert all(torch.equal(v, saved["state_dict"][k]) for k, v in model.state_dict().items())
    ema = trainer.models.ema.module.state_dict()
    assert all(torch.equal(v, saved["state_dict_ema"][k]) for k, v in ema.items())
    assert any(not torch.equal(v, saved["state_dict"][k]) for k, v in ema.items())  # the EMA is its own

    oracle_model, oracle, start_epoch = timm_resumed_optimizer(last, args, cfg.sched_on_updates)
    assert start_epoch == saved["epoch"] + 1 == trainer.progress.epoch == 2
    names = {id(p): n for n, p in oracle_model.named_parameters()}
    expected = {names[id(p)]: state["momentum_buffer"] for p, state in oracle.state.items()}
    optimizer = trainer.optimization.optimizer.optimizer
    ours = {n: optimizer.state[p]["momentum_buffer"] for n, p in model.named_parameters()}
    assert len(expected) == len(ours) == len(list(model.parameters()))
    assert all(torch.equal(ours[n], buffer) for n, buffer in expected.items())
    assert any(buffer.abs().sum() > 0 for buffer in expected.values())
    by_decay = lambda groups: sorted((g["weight_decay"], len(g["params"]), g["lr"], g["momentum"]) for g in groups)  # noqa: E731
    assert by_decay(optimizer.param_groups) == by_decay(oracle.param_groups)
    assert 0 < optimizer.param_groups[0]["lr"] < args.lr  # cosine after its warm-up, at epoch 2 of 3
    # this run's lr (--lr-base 0.1 for a batch of 4) is not the file's: the schedule follows the file's, as timm's
    assert trainer.start.values.lr == 0.1 * 4 / 256 and "starts from the file's lr (0.05), not 0.00156" in resumed

    trainer.fit()
    rows = list(csv.DictReader((tmp_path / "run" / "summary.csv").read_text().splitlines()))
    assert [int(row["epoch"]) for row in rows] == [TIMM_EPOCHS]  # one epoch: the third
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert record["lr"] == pytest.approx(oracle.param_groups[0]["lr"], rel=1e-12)  # per epoch: the epoch's lr
    assert CheckpointDir(tmp_path / "run").select()[0].name == "epoch_0003"  # --resume auto continues from here


def test_resume_of_timms_checkpoint_with_other_parameter_groups_is_refused_in_one_line(tmp_path, folder_of_twelve):
    from convbias.base.errors import ConfigError, DamagedInputError
    from convbias.engine import parse_config
    from convbias.engine.loop.start import start_run
    from convbias.engine.loop.trainer import build_trainer
    from convbias.families import load_families

    last = timm_run(tmp_path, timm_train_args(weight_decay=0.0))  # timm's optimizer: one group
    cfg = parse_config(engine_arguments(folder_of_twelve, tmp_path / "run", last))  # weight decay 2e-5: two
    with pytest.raises(ConfigError) as refused:
        build_trainer(start_run(cfg, load_families(), None)).fit()  # its first step: the one load, before any write
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"--resume {last}: its optimizer state does not fit this run's optimizer")
    groups = (
        "the file's parameter groups: 47 (weight decay 0); this run's: 16 (weight decay 2e-05), 31 (weight decay 0)"
    )
    assert groups in message
    assert not (tmp_path / "run").exists()
    other = parse_config([*engine_arguments(folder_of_twelve, tmp_path / "run", last), "--model", "resnet14t"])
    with pytest.raises(ConfigError, match=r"is timm's checkpoint of resnet10t, not of --model resnet14t$"):
        start_run(other, load_families(), None)
    weights_only = tmp_path / "weights.pth.tar"  # a state dict alone: no epoch to continue from
    torch.save(torch.load(last, weights_only=False)["state_dict"], weights_only)
    with pytest.raises(
        DamagedInputError, match=r"weights\.pth\.tar is not a timm training checkpoint: expected a dict"
    ):
        start_run(parse_config(engine_arguments(folder_of_twelve, tmp_path / "run", weights_only)), None, None)
    with pytest.raises(ConfigError, match="after 2 epochs, and this run has 2: nothing is left to train"):
        start_run(
            parse_config([*engine_arguments(folder_of_twelve, tmp_path / "run", last), "--epochs", "2"]), None, None
        )


# ------------------------------------------------------------------- convbias-predict and convbias-export of one


def timm_oracle(path, use_ema):
    """timm's validate.py on ``path``: the model its args name, load_checkpoint (--use-ema) and the data config
    resolve_data_config gives for the args and model."""
    from timm.data import resolve_data_config
    from timm.models import load_checkpoint

    args = vars(torch.load(path, weights_only=False)["args"])
    model = timm.create_model(args["model"], num_classes=args["num_classes"], **args["model_kwargs"])
    load_checkpoint(model, str(path), use_ema=use_ema)
    return model.eval(), resolve_data_config(args, model=model)


def test_predict_of_timms_checkpoint_gives_the_softmax_of_its_model_and_ema(tmp_path, timm_last):
    import json

    from PIL import Image
    from timm.data import create_transform

    from convbias.cli.predict import main

    (tmp_path / "images").mkdir()
    paths = [tmp_path / "images" / f"{i}.png" for i in range(3)]
    for i, path in enumerate(paths):
        generator = torch.Generator().manual_seed(i)
        pixels = torch.randint(0, 256, (40 + 4 * i, 36, 3), generator=generator, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(path)
    results = {}
    for use_ema in (False, True):
        output = tmp_path / f"ema_{use_ema}.json"
        argv = [str(timm_last), str(tmp_path / "images"), "--topk", "2", "--output", str(output), "--device", "cpu"]
        assert main(argv + (["--use-ema"] if use_ema else [])) == 0
        record = json.loads(output.read_text())
        model, config = timm_oracle(timm_last, use_ema)
        transform = create_transform(**config, is_training=False)
        with torch.no_grad():
            batch = torch.stack([transform(Image.open(path).convert("RGB")) for path in paths])
            values, indices = model(batch).softmax(-1).topk(2)
        assert [p["path"] for p in record["predictions"]] == [str(path) for path in paths]
        for prediction, value, index in zip(record["predictions"], values.tolist(), indices.tolist()):
            assert [top["index"] for top in prediction["top"]] == index
            assert [top["label"] for top in prediction["top"]] == [CLASS_NAMES[i] for i in index]
            assert [top["probability"] for top in prediction["top"]] == pytest.approx(value, abs=1e-6)
        results[use_ema] = [top["probability"] for p in record["predictions"] for top in p["top"]]
    assert results[False] != pytest.approx(results[True], abs=1e-4)  # the EMA's weights are others


def test_export_of_timms_checkpoint_loads_back_through_local_dir_with_its_logits(tmp_path, timm_last):
    from timm.data import resolve_model_data_config

    from convbias.cli.export import main

    assert main([str(timm_last), "--output", str(tmp_path / "exported"), "--use-ema"]) == 0
    exported = timm.create_model(f"local-dir:{tmp_path / 'exported'}", pretrained=True).eval()
    model, config = timm_oracle(timm_last, use_ema=True)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(exported(images), model(images))
    assert exported.pretrained_cfg["label_names"] == CLASS_NAMES
    exported_config = resolve_model_data_config(exported)
    plain = lambda value: tuple(value) if isinstance(value, list) else value  # noqa: E731 (JSON has lists)
    assert {k: plain(exported_config[k]) for k in config if k != "crop_mode"} == {
        k: v for k, v in config.items() if k != "crop_mode"
    }
    assert config == {**config, "input_size": (3, 40, 40), "crop_pct": 0.95, "interpolation": "bilinear"}
    assert yaml.safe_load((tmp_path / "exported" / "args.yaml").read_text())["model"] == "resnet10t"


def test_predict_and_export_refuse_what_a_timm_checkpoint_does_not_have_in_one_line(tmp_path, capsys):
    from convbias.cli.export import main as export
    from convbias.cli.predict import main as predict

    timm_checkpoint(tmp_path)  # no state_dict_ema? it has one; its args name no num_classes
    (tmp_path / "image.png").write_bytes(b"")
    no_ema = tmp_path / "no_ema.pth.tar"
    saved = torch.load(tmp_path / "last.pth.tar", weights_only=False)
    del saved["state_dict_ema"]
    torch.save(saved, no_ema)
    assert predict([str(no_ema), str(tmp_path / "image.png"), "--use-ema"]) == 2
    assert predict([str(tmp_path / "last.pth.tar"), str(tmp_path / "image.png"), "--which", "best"]) == 2
    not_timm = tmp_path / "weights.pth"
    torch.save({"w": torch.zeros(1)}, not_timm)
    assert export([str(not_timm), "--output", str(tmp_path / "out")]) == 65
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: --use-ema: {no_ema} holds no state_dict_ema (its run had no --model-ema)",
        f"error: --which is for run directories; {tmp_path / 'last.pth.tar'} is timm's checkpoint (use --use-ema for "
        f"its EMA)",
        f"error: {not_timm} is not a timm training checkpoint: expected a dict with 'state_dict' (tensors) and "
        f"'epoch', as timm's CheckpointSaver writes",
    ]
    assert not (tmp_path / "out").exists()
