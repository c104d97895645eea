"""A launch says at start what it will do: output, processes and threads, device and precision, model size,
data, global batch with the effective lr and the rule that gave it, epochs and warm-up."""

import json
import re
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace

import pytest
import timm
import torch
import yaml
from safetensors.torch import save_file
from support import REPO
from support.runs import PROGRESS, messages
from support.timm_train import timm_train_loss
from timm.loss import BinaryCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2, scheduler_kwargs
from torchvision.transforms import ColorJitter

import convit  # noqa: F401  (registers the project's models)
import transformed_cnn  # noqa: F401
from convbias.base.errors import ConfigError
from convbias.cli import train
from convbias.engine.checkpoint.resume import ResumePoint
from convbias.engine.config.options import Config
from convbias.engine.config.parsing import config_warnings, option_source, parse_config
from convbias.engine.config.timm_train_options import TIMM_TRAIN_DEFAULTS
from convbias.engine.data.factory import build_transforms
from convbias.engine.loop import node
from convbias.engine.loop.node import busy_cores_warning, intra_op_threads, set_threads
from convbias.engine.loop.records import model_arguments, settings_lines
from convbias.engine.loop.start import finished_message
from convbias.engine.model.factory import create_model_and_report, head_fit_warning
from convbias.engine.optim.factory import create_mixup, optimizer_arguments, trained_epochs
from convbias.engine.optim.factory import create_train_loss as recipe_loss

pytestmark = pytest.mark.usefixtures("single_thread")


def test_the_startup_block_states_what_the_run_will_do(cli_argv, tmp_path, capsys):
    args = cli_argv(
        cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, batch_size=16, train_fraction=0.5, epochs=1, no_diagnostics=True
    )
    output = tmp_path / "run"
    assert train.main(args + ["--output", str(output)]) == 0
    out, err = capsys.readouterr()
    assert messages(err) == []
    model = timm.create_model(
        "convit_tiny", **cli_argv.TINY_CONVIT["model_kwargs"], img_size=8, in_chans=1, num_classes=10
    )
    params = sum(p.numel() for p in model.parameters()) / 1e6
    updates = 719 // 16  # half of the 1,438 training digits, in full batches of 16
    assert out.splitlines()[:15] == [
        f"output: {output} (a new run)",
        # the module's single_thread fixture; fp32: --mixed-precision's default
        "processes: 1 (1 thread each [OMP_NUM_THREADS=1]) on cpu, fp32 [default]",
        f"model: convit_tiny, {params:.2f}M parameters; arguments patch_size=2 [command line], depth=2 [command line], "
        "local_up_to_layer=1 [command line], embed_dim=8 [command line]",
        "data: digits [command line], 719 train / 359 val images, 10 classes",
        "num_classes: 10 (command line)",  # PLAIN_DIGITS's --num-classes 10
        "batch: 16 global = 16 [command line] per process x 1 x 1 [timm default] accumulation; lr 0.00625 (--lr-base "
        "0.1 x 16 / --lr-base-size 256)",
        f"schedule: 1 epoch [command line], 0 of warm-up [command line], {updates} updates per epoch",
        # timm's train.py's defaults where the command line sets nothing, each value with its source
        "optimizer: SGD (--opt sgd [timm default]), momentum 0.9 [timm default], nesterov True [--opt sgd], "
        "weight decay 2e-05 [timm default]",
        "lr: 0.00625 from --lr-base 0.1 [timm default] per 256 [timm default] images, scaled linear [timm default]",
        "lr schedule: cosine [timm default] stepped per epoch [timm default], warm-up from 1e-05 [timm default], "
        "min lr 0 [timm default]",
        # --no-aug on the command line set these, not their defaults
        "augmentation: auto-augment none [--no-aug (command line)], random erasing 0 [--no-aug (command line)], "
        "mixup/cutmix off [--no-aug (command line)], repeated augmentation 1 [command line], drop-path the model's, "
        "color jitter 0 [--no-aug (command line)] (all off: --no-aug)",
        "loss: CrossEntropyLoss (no mixup/cutmix, smoothing 0 [--no-aug (command line)])",  # timm's without either
        "EMA: off [timm default]",
        "input: 8 [command line] px, crop 1.0 [command line], interpolation bicubic [model convit_tiny's config] "
        "(train bicubic [as eval]), mean (0.3053,) [dataset digits], std (0.3759,) [dataset digits]",
        "also: --train-fraction 0.5 [command line], --hflip 0 [--no-aug (command line)]",  # off timm's defaults
    ]


def test_likely_unintended_settings_are_warned_before_training(cli_argv, tmp_path, capsys, monkeypatch):
    """The DeiT recipe on 8-px digits: its augmentation, an lr scaled to 7.8e-6 by a batch of 8, more loader
    workers than the node's cores (one core here), timm's 1000-way head for the 10 digits, and 2 intra-op threads
    where the load average leaves no core free."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    monkeypatch.setattr(node, "load_average", lambda: 0.7)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice, which the engine keeps
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    args = cli_argv(
        cli_argv.DEIT_RECIPE,
        cli_argv.TINY_CONVIT,
        dataset="digits",
        batch_size=8,
        train_fraction=0.05,
        epochs=1,
        warmup_epochs=0,
        workers=2,
    )
    try:
        assert train.main(args + ["--output", str(tmp_path / "run"), "--no-diagnostics"]) == 0
    finally:
        torch.set_num_threads(threads)
    warnings = [line for line in messages(capsys.readouterr().err) if line.startswith("warning: ")]
    assert warnings == [
        "warning: the lr scaled to the global batch is 7.81e-06 (--lr-base 0.0005 x 8 / --lr-base-size 512), below "
        "1e-05: the run may barely learn; set --lr, or raise --lr-base or the batch",
        "warning: heavy augmentation (--aa rand-m9-mstd0.5-inc1, --mixup 0.8, --cutmix 1, --reprob 0.25, "
        "--repeated-aug 3) on 8-px images: recipes like DeiT's are made for 224 px and leave little of a small image; "
        "use a light recipe (configs/train/demo_digits.yaml) or --no-aug",
        "warning: --workers 2 x 1 process on this node start 2 loader processes for 1 core: they compete with "
        "training; lower --workers",
        "warning: the model's head has 1000 outputs (model default, as timm) and --dataset digits has 10 classes: "
        "990 outputs are never a label but share the softmax; pass --num-classes 10",
        "warning: 2 intra-op threads, and the load average (0.7 over the last minute) leaves about 0 of 1 cores "
        "free: threads waiting for a busy core slow every step; set OMP_NUM_THREADS=1 (convbias-launch, accelerate "
        "launch: --num_cpu_threads_per_process 1)",
    ]


def test_output_that_is_not_a_terminal_gets_one_line_per_epoch_and_no_progress_bar(cli_argv, tmp_path):
    """A job log (stdout and stderr to files) holds the epoch lines, not hundreds of progress-bar redraws. The
    run is train.py's main in this process with both streams written to files, as a job's are: whether a
    progress bar is drawn depends on the stream, not on the process (a new interpreter costs seconds)."""
    args = cli_argv(cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, lr=1e-3, train_fraction=0.1, epochs=2)
    stdout, stderr = tmp_path / "job.out", tmp_path / "job.err"
    with open(stdout, "w") as out, open(stderr, "w") as err, redirect_stdout(out), redirect_stderr(err):
        code = train.main([*args, "--no-diagnostics", "--output", str(tmp_path / "run")])
    printed, logged = stdout.read_text(), stderr.read_text()
    assert code == 0, logged
    assert "\r" not in logged and not any(PROGRESS.match(line) for line in logged.splitlines()), logged
    epochs = [line for line in printed.splitlines() if re.match(r"epoch \d/2  train_loss", line)]
    assert [line.split()[1] for line in epochs] == ["1/2", "2/2"]


def test_intra_op_threads_are_the_cores_the_loader_workers_leave():
    assert intra_op_threads(cores=2, processes=1, workers=4) == 1  # 2 threads were 13.6x slower here
    assert intra_op_threads(cores=2, processes=1, workers=0) == 2
    assert intra_op_threads(cores=16, processes=1, workers=4) == 12
    assert intra_op_threads(cores=16, processes=2, workers=4) == 4  # 8 cores each
    assert intra_op_threads(cores=8, processes=4, workers=2) == 1


def test_threads_beyond_the_cores_the_load_leaves_are_warned_with_the_option_that_lowers_them(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(node, "load_average", lambda: 4.2)  # 4 of the 8 cores are taken by other jobs
    warning = busy_cores_warning(threads=4)
    assert warning.startswith("4 intra-op threads per process x 2 processes, and the load average (4.2 over the last")
    assert "leaves about 4 of 8 cores free" in warning and warning.endswith(
        "set OMP_NUM_THREADS=2 (convbias-launch, accelerate launch: --num_cpu_threads_per_process 2)"
    )
    assert busy_cores_warning(threads=2) is None  # 2 x 2 fit the 4 free cores
    assert busy_cores_warning(threads=1) is None  # nothing to lower
    monkeypatch.setattr("os.cpu_count", lambda: 64)  # 8 cores of a 64-core machine: 1/8 of its load is here
    assert busy_cores_warning(threads=3) is None  # 3 x 2 of the 7 cores free
    assert "leaves about 7 of 8 cores free" in busy_cores_warning(threads=4)
    monkeypatch.setattr(node, "load_average", lambda: None)  # a system without a load average
    assert busy_cores_warning(threads=64) is None


def test_a_head_larger_than_the_data_classes_is_warned_with_the_option_that_fits_it():
    warning = head_fit_warning(10, "recipe", 3, "--dataset folder")
    assert warning == (
        "the model's head has 10 outputs (recipe) and --dataset folder has 3 classes: 7 outputs are never a label "
        "but share the softmax; pass --num-classes 3; with 3 classes eval_top5 says nothing (a 3-way model scores "
        "100%): judge by top-1"
    )
    assert head_fit_warning(10, "command line", 10, "--dataset digits") is None


def test_each_process_takes_its_share_of_the_cores_unless_the_user_set_the_threads(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("OMP_NUM_THREADS")
    before = torch.get_num_threads()
    torch.set_num_threads(node.TORCH_THREADS_AT_IMPORT)  # as if nothing had set them since the engine's import
    try:
        assert set_threads(workers=0) == "8 cores / 4 processes less 0 loader workers"
        assert torch.get_num_threads() == 2  # 8 cores, 4 processes on the node
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert set_threads(workers=3) == "8 cores less 3 loader workers"  # the engine's own value is not the user's
        assert torch.get_num_threads() == 5
        torch.set_num_threads(3)
        assert set_threads(workers=3) == "torch.set_num_threads"  # the user's choice stands
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "6")
        assert set_threads(workers=3) == "OMP_NUM_THREADS=6"
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_the_startup_block_says_where_the_threads_came_from(cli_argv, tmp_path, capsys, monkeypatch, recwarn):
    """Two cores and two loader workers: one intra-op thread, said so; torch's own worker warning is not
    printed beside the engine's."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("OMP_NUM_THREADS")
    before = torch.get_num_threads()
    torch.set_num_threads(node.TORCH_THREADS_AT_IMPORT)  # as if nothing had set them since the engine's import
    args = cli_argv(
        cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, batch_size=16, train_fraction=0.05, epochs=1, workers=3
    )
    try:
        assert train.main(args + ["--output", str(tmp_path / "run"), "--no-diagnostics"]) == 0
    finally:
        torch.set_num_threads(before)
    out, err = capsys.readouterr()
    assert "processes: 1 (1 thread each [2 cores less 3 loader workers]) on cpu, fp32 [default]" in out.splitlines()
    assert not [w for w in recwarn if "This DataLoader will create" in str(w.message)]
    assert [line for line in messages(err) if "loader processes" in line] == [
        "warning: --workers 3 x 1 process on this node start 3 loader processes for 2 cores: they compete with "
        "training; lower --workers"
    ]


def test_convbias_traceback_shows_the_error_behind_a_set_up_refusal(cli_argv, tmp_path, capsys, monkeypatch):
    args = cli_argv(cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, epochs=1, output=str(tmp_path / "run"))
    bad = [a if a != "local_up_to_layer=1" else "local_up_to_layer=7" for a in args]  # more GPSA blocks than blocks
    assert train.main(bad) == 2
    plain = messages(capsys.readouterr().err)
    assert len(plain) == 1 and plain[0].startswith("error: ")
    monkeypatch.setenv("CONVBIAS_TRACEBACK", "1")
    assert train.main(bad) == 2
    err = capsys.readouterr().err
    assert plain[0] in err and "Traceback (most recent call last)" in err and "The above exception" in err


def test_the_epoch_and_step_lines_give_time_images_per_second_and_time_left(cli_argv, tmp_path, capsys):
    """The values are log.jsonl's (epoch_seconds, images_per_sec); the time left is this launch's pace times the
    steps left (none after the last epoch)."""
    args = cli_argv(
        cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, batch_size=16, train_fraction=0.2, epochs=2, log_interval=4
    )
    output = tmp_path / "run"
    assert train.main(args + ["--output", str(output), "--no-diagnostics"]) == 0
    out = capsys.readouterr().out.splitlines()
    records = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    pace = r"(\d+\.\d) s  (\d+) img/s  (\d+:\d\d:\d\d) left"
    epochs = [re.fullmatch(rf"epoch (\d)/2  train_loss \S+  eval_top1 \S+  eval_top5 \S+  {pace}", x) for x in out]
    epochs = [match.groups() for match in epochs if match]
    assert epochs == [
        (str(r["epoch"]), f"{r['epoch_seconds']:.1f}", f"{r['images_per_sec']:.0f}", left)
        for r, left in zip(records, (epochs[0][3], "0:00:00"))
    ]
    steps = [re.fullmatch(rf"epoch (\d)/2  step (\d+)/17  train_loss \S+  lr \S+  {pace}", x) for x in out]
    steps = [match.groups() for match in steps if match]
    assert [(epoch, step) for epoch, step, *_ in steps] == [(e, s) for e in "12" for s in ("4", "8", "12", "16")]
    for epoch in "12":  # the epoch's time so far, at a positive speed
        seconds = [float(s) for e, _, s, speed, _ in steps if e == epoch and float(speed) > 0]
        assert len(seconds) == 4 and seconds == sorted(seconds)


def test_the_startup_block_says_what_the_pretrained_file_gave_and_the_end_line_names_the_metric(
    cli_argv, tmp_path, capsys
):
    """ConViT weights for 32-px RGB images of 1000 classes into the tiny ConViT on 8-px gray digits: timm resets
    the head, adapts the stem to one channel and the position embedding to the 4x4 grid; with
    --eval-metric top5 the end line names the best top-5."""
    imagenet = timm.create_model("convit_tiny", **cli_argv.TINY_CONVIT["model_kwargs"], img_size=32)
    weights = tmp_path / "imagenet.safetensors"
    save_file(imagenet.state_dict(), str(weights))
    args = cli_argv(
        cli_argv.TINY_CONVIT,
        cli_argv.PLAIN_DIGITS,
        pretrained_file=str(weights),
        batch_size=16,
        train_fraction=0.1,
        epochs=1,
        eval_metric="top5",
        no_diagnostics=True,
    )
    output = tmp_path / "run"
    assert train.main(args + ["--output", str(output)]) == 0
    out = capsys.readouterr().out.splitlines()
    model = timm.create_model(
        "convit_tiny", **cli_argv.TINY_CONVIT["model_kwargs"], img_size=8, in_chans=1, num_classes=10
    )
    file, built = imagenet.state_dict(), model.state_dict()
    assert [line for line in out if line.startswith("weights: ")] == [
        f"weights: {weights}: {len(built) - 2} of {len(built)} tensors loaded; reset: head.bias, head.weight for 10 "
        f"classes (the file's has 1000); adapted: pos_embed {tuple(file['pos_embed'].shape)} -> "
        f"{tuple(built['pos_embed'].shape)}, patch_embed.proj.weight {tuple(file['patch_embed.proj.weight'].shape)} "
        f"-> {tuple(built['patch_embed.proj.weight'].shape)}"
    ]
    record = json.loads((output / "log.jsonl").read_text().splitlines()[-1])
    assert out[-1].startswith(
        f"done: final top-1 {record['eval_top1']:.2f} (epoch 1), best top-5 {record['eval_top5']:.2f} (epoch 1); "
    )


def test_a_tcnn_from_resnet_weights_says_which_stages_were_transformed_and_how(tmp_path):
    weights = tmp_path / "resnet10t.safetensors"
    save_file(timm.create_model("resnet10t").state_dict(), str(weights))
    cfg = Config(
        model="tcnn_resnet10t",
        model_kwargs=dict(stages="3,4", init="exact"),
        pretrained=True,
        pretrained_file=str(weights),
    )
    model, report = create_model_and_report(cfg, num_classes=1000, in_chans=3)
    assert report == (
        f"{weights}: {len(model.state_dict())} of {len(model.state_dict())} tensors loaded; resnet10t weights, "
        "transformed: the 3x3 convolutions of stage(s) 3, 4 became GPSA layers (stages=[3, 4], init=exact, "
        "keep_stride=False)"
    )
    save_file(model.state_dict(), str(tmp_path / "tcnn.safetensors"))
    again = Config(**{**cfg.to_dict(), "pretrained_file": str(tmp_path / "tcnn.safetensors")})
    assert create_model_and_report(again, num_classes=1000, in_chans=3)[1].endswith(
        "T-CNN weights of tcnn_resnet10t (stages=[3, 4], init=exact, keep_stride=False), loaded as they are"
    )


@pytest.mark.parametrize("aa", ["rand-m9-mstd0.5-inc1", "3a", None])
def test_the_block_lists_color_jitter_only_where_timms_transform_has_it(aa):
    cfg = parse_config(["-c", str(REPO / "configs" / "recipes" / "deit.yaml"), "--aa", str(aa), "--img-size", "32"])
    train_transform, _ = build_transforms(32, 3, (0.5,) * 3, (0.5,) * 3, cfg)
    jitters = [t for t in train_transform.transforms if isinstance(t, ColorJitter)]  # timm's own choice
    augmentation = next(line for line in settings_lines(cfg, 1e-3) if line.startswith("augmentation: "))
    assert ("color jitter 0.3 [recipe deit.yaml]" in augmentation) == bool(jitters) == (aa != "rand-m9-mstd0.5-inc1")


def test_the_model_arguments_in_force_are_the_recipes_merged_with_the_command_lines(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: convit_tiny\nmodel_kwargs: {depth: 4, patch_size: 2}\n")
    cfg = parse_config(["-c", str(recipe), "--model-kwargs", "depth=2", "local_up_to_layer=1"])
    assert model_arguments(cfg) == (
        "depth=2 [command line], patch_size=2 [recipe recipe.yaml], local_up_to_layer=1 [command line]"
    )
    assert model_arguments(parse_config(["--model", "convit_tiny"])) == "the model's defaults"
    with_timm_names = parse_config(["-c", str(REPO / "configs" / "recipes" / "deit.yaml"), "--drop-connect", "0.05"])
    assert (with_timm_names.drop_path, option_source(with_timm_names, "drop_path")) == (0.1, "recipe deit.yaml")
    assert option_source(parse_config(["--drop-connect", "0.05"]), "drop_path") == "command line"


def test_a_finished_run_names_the_best_epoch_by_its_eval_metric(tmp_path):
    """--resume auto of a run that chose its best epoch by top-5 says "best top-5", with that epoch's top-5."""
    state = {
        "epoch": 2,
        "step": 0,
        "model": "convit_tiny",
        "options": {"model": "convit_tiny"},  # a point records the options its exact continuation needs
        "final": {"epoch": 2, "eval_top1": 60.0, "eval_top5": 90.0},
        "best": {"epoch": 1, "eval_top1": 65.0, "eval_top5": 92.5},
    }
    point = ResumePoint(tmp_path / "checkpoints" / "epoch_0002", state, {})
    message = finished_message(point, tmp_path, epochs=2, write=False, options={"eval_metric": "top5"})
    assert "final top-1 60.00, best top-5 92.50 at epoch 1); nothing to do" in message


def test_the_input_size_is_credited_to_input_size_not_to_the_recipe_that_left_it_unset(tmp_path):
    """timm's args.yaml holds img_size: null; --input-size 3 64 64 on the command line gives the 64."""
    recipe = tmp_path / "args.yaml"
    recipe.write_text(yaml.safe_dump({**TIMM_TRAIN_DEFAULTS, "model": "resnet18"}))
    cfg = parse_config(["-c", str(recipe), "--input-size", "3", "64", "64", "--output", str(tmp_path / "run")])
    shown = next(line for line in settings_lines(cfg, 0.1) if line.startswith("input: "))
    assert shown.startswith("input: 64 [--input-size (command line)] px, crop 0.95 [model resnet18's config]")
    assert (option_source(cfg, "img_size"), option_source(cfg, "in_chans")) == ("--input-size (command line)",) * 2


def test_input_size_on_the_command_line_wins_over_an_args_files_img_size_as_in_timm(tmp_path):
    """timm's args.yaml with img_size: 96, and --input-size 3 64 64 on the command line: timm's resolve_data_config
    takes input_size over img_size, so train.py trains at 64; so does this engine, crediting the command line."""
    from timm.data import resolve_data_config

    values = {**TIMM_TRAIN_DEFAULTS, "model": "resnet18", "img_size": 96}
    recipe = tmp_path / "args.yaml"
    recipe.write_text(yaml.safe_dump(values))
    cfg = parse_config(["-c", str(recipe), "--input-size", "3", "64", "64", "--output", str(tmp_path / "run")])
    pretrained = timm.get_pretrained_cfg("resnet18").to_dict()
    theirs = resolve_data_config({**values, "input_size": [3, 64, 64]}, pretrained_cfg=pretrained)["input_size"]
    assert (cfg.in_chans, cfg.img_size, cfg.img_size) == theirs == (3, 64, 64)
    assert option_source(cfg, "img_size") == "--input-size (command line)"
    given_both = ["--model", "resnet18", "--img-size", "96", "--input-size", "3", "64", "64"]
    with pytest.raises(ConfigError, match="--input-size 3 64 64 and --img-size 96 disagree"):
        parse_config([*given_both, "--output", str(tmp_path / "run")])


def test_a_lookahead_optimizers_values_are_credited_to_the_optimizer_it_wraps(tmp_path):
    """lookahead_adamw: timm's factory builds Lookahead over AdamW, whose defaults give eps and betas."""
    cfg = parse_config(["--model", "resnet18", "--opt", "lookahead_adamw", "--output", str(tmp_path / "run")])
    # the oracle: what timm's factory builds from the same options, and without lookahead_ the optimizer it wraps
    # (whose defaults Lookahead's are)
    arguments = optimizer_arguments(cfg, 0.1)
    built = create_optimizer_v2([torch.zeros(1, requires_grad=True)], **arguments)
    inner = create_optimizer_v2([torch.zeros(1, requires_grad=True)], **{**arguments, "opt": "adamw"})
    shown = next(line for line in settings_lines(cfg, 0.1) if line.startswith("optimizer: "))
    assert shown == (
        f"optimizer: {type(built).__name__} of {type(inner).__name__} (--opt lookahead_adamw [command line]), "
        f"eps {built.defaults['eps']} [AdamW default], betas {built.defaults['betas']} [AdamW default], weight "
        "decay 2e-05 [timm default]"
    )


def test_every_training_value_off_timms_defaults_is_shown_with_its_source(tmp_path):
    """The loss timm's branches choose with its options, and --layer-decay, --clip-grad, --drop, --lr-noise,
    --decay-epochs/--decay-rate, --eval-metric and the EMA's warm-up, each with where it came from."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: resnet18\nclip_grad: 1.0\ndecay_rate: 0.97\n")
    given = (
        "--bce-loss --bce-sum --bce-target-thresh 0.2 --mixup 0.8 --layer-decay 0.65 --drop 0.2 --lr-noise 0.42 0.9 "
        "--sched step --decay-epochs 2.4 --eval-metric loss --model-ema --model-ema-warmup"
    )
    cfg = parse_config(["-c", str(recipe), *given.split(), "--output", str(tmp_path / "run")])
    lines = settings_lines(cfg, 0.1)
    loss = recipe_loss(cfg, create_mixup(cfg, num_classes=10))
    theirs = timm_train_loss({**TIMM_TRAIN_DEFAULTS, **cfg.to_dict()}, torch.device("cpu"))  # timm's branches
    assert type(loss) is type(theirs) is BinaryCrossEntropy
    assert next(line for line in lines if line.startswith("loss: ")) == (
        "loss: BinaryCrossEntropy (--bce-loss [command line], smoothing 0.1 [timm default] in mixup/cutmix's "
        "targets, target threshold 0.2 [command line], summed over classes True [command line], positive weight "
        "none [timm default])"
    )
    assert next(line for line in lines if line.startswith("EMA: ")).startswith(
        "EMA: decay 0.9998 [timm default], warm-up True [command line]; "
    )
    assert next(line for line in lines if line.startswith("also: ")) == (
        "also: --drop 0.2 [command line], --layer-decay 0.65 [command line], --clip-grad 1 [recipe recipe.yaml], "
        "--decay-epochs 2.4 [command line], --decay-rate 0.97 [recipe recipe.yaml], --lr-noise 0.42 0.9 "
        "[command line], --eval-metric loss [command line]"
    )


def test_the_warm_up_warning_counts_the_epochs_timms_scheduler_trains(tmp_path):
    """--epochs 1 --cooldown-epochs 10: timm's create_scheduler_v2 trains 11 epochs; a warm-up of 5 still covers the
    whole schedule of 1, and the warning says both."""
    cfg = parse_config(
        ["--model", "resnet18", "--epochs", "1", "--cooldown-epochs", "10", "--output", str(tmp_path / "run")]
    )
    args = SimpleNamespace(**{**TIMM_TRAIN_DEFAULTS, **cfg.to_dict()})
    _, timm_epochs = create_scheduler_v2(torch.optim.SGD([torch.zeros(1)], lr=0.1), **scheduler_kwargs(args))
    assert trained_epochs(cfg) == timm_epochs == 11
    warned = [w for w in config_warnings(cfg, trained_epochs(cfg)) if w.startswith("--warmup-epochs")]
    assert warned == [
        "--warmup-epochs 5 covers the whole schedule of 1 epoch(s) of the 11 the run trains (--cooldown-epochs, lr "
        "cycles: at the schedule's end lr): the lr only ramps up from --warmup-lr and never reaches its peak; lower "
        "--warmup-epochs"
    ]
