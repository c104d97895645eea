"""DDP on CPU: 2 processes keep identical weights and train the same model as 1 process with the same
global batch (gloo backend; randomness that differs per rank is off: no augmentation, no drop path). SGD keeps
rounding differences at rounding size (Adam divides near-zero gradients by their own magnitude).

`accelerate launch --cpu` starts a single process unless MPI is set up, so the test uses accelerate's
torchrun launcher (`--multi_gpu`) with ACCELERATE_USE_CPU=1, which is accelerate's multi-CPU mode. One launch
of 2 processes trains every run of this module in turn (`run_jobs`: starting the processes is the larger
part of the time); each test asserts on its own runs.
"""

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import REPO

from convbias.cli import train
from convbias.engine import parse_config
from convbias.engine.loop import trainer as engine_trainer
from convbias.engine.loop.start import start_run
from convbias.families import load_families

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

# The launched script: this module's `run_jobs` in every process.
PROGRAM = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]  # the packages before tests/ (whose folders share their names)
import test_train_ddp
test_train_ddp.run_jobs(sys.argv[1])
"""
LAUNCH_TIMEOUT_S = 300  # a collective that one rank never joins hangs: fail instead
SGD = dict(drop_path=0, opt="sgd", lr=0.05, epochs=1, save_epochs=0)
DIST_BN = ("reduce", "broadcast", "")  # every --dist-bn: timm's default, rank 0's statistics, none


def train_and_dump(args: list[str], dump: Path) -> None:
    """The engine's run of `args`; this process's final weights in dump/rank<process index>.safetensors."""
    trainer = engine_trainer.build_trainer(start_run(parse_config(args), load_families(), None))
    trainer.fit()
    rank = trainer.accelerator.process_index
    weights = trainer.accelerator.unwrap_model(trainer.models.model).state_dict()
    save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(dump / f"rank{rank}.safetensors"))


def running_means(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_buffers() if k.endswith("running_mean")}


def every_dist_bn(args: list[str], dump: Path):
    """A `Trainer.distribute_batchnorm` that, before the run's own step, records the rank's BatchNorm
    statistics and what each --dist-bn of DIST_BN (parsed from the command line) makes of them, every one
    applied by the engine's own step to the rank's own statistics, in dump/bn_rank<process index>.safetensors."""
    engine_step = engine_trainer.Trainer.distribute_batchnorm

    def recorded(self) -> None:
        model = self.accelerator.unwrap_model(self.models.model)
        buffers = dict(model.named_buffers())
        own = {k: v.detach().clone() for k, v in buffers.items()}
        record, cfg = {f"before.{k}": v for k, v in running_means(model).items()}, self.cfg
        for mode in DIST_BN:
            self.cfg = cfg.resolved(dist_bn=parse_config([*args, "--dist-bn", mode]).dist_bn)
            engine_step(self)
            record.update({f"{mode or 'none'}.{k}": v for k, v in running_means(model).items()})
            for k, v in own.items():
                buffers[k].copy_(v)
        self.cfg = cfg
        engine_step(self)  # the run goes on with its own --dist-bn
        save_file(record, str(dump / f"bn_rank{self.accelerator.process_index}.safetensors"))

    return recorded


def run_jobs(jobs_file: str) -> None:
    """In every launched process: the runs of `jobs_file` in turn ({"args", "dump", "dist_bn"} each: with
    "dist_bn", what every --dist-bn makes of each rank's BatchNorm statistics is recorded too)."""
    engine_step = engine_trainer.Trainer.distribute_batchnorm
    for job in json.loads(Path(jobs_file).read_text()):
        dump = Path(job["dump"])
        if job["dist_bn"]:
            engine_trainer.Trainer.distribute_batchnorm = every_dist_bn(job["args"], dump)
        try:
            train_and_dump(job["args"], dump)
        finally:
            engine_trainer.Trainer.distribute_batchnorm = engine_step


def launch_two(tmp_path: Path, jobs: dict[str, tuple[list[str], int, bool]]) -> dict[str, Path]:
    """`jobs`: name -> (train options, batch size per process, whether to record --dist-bn); each run in
    tmp_path/<name>/run, its processes' weights in tmp_path/<name>. All of them in one launch of 2 processes."""
    script, jobs_file = tmp_path / "program.py", tmp_path / "jobs.json"
    script.write_text(PROGRAM)
    dumps, listed = {}, []
    for name, (train_args, batch_size, dist_bn) in jobs.items():
        dumps[name] = tmp_path / name
        dumps[name].mkdir()
        args = [*train_args, "--batch-size", str(batch_size), "--output", str(dumps[name] / "run")]
        listed.append({"args": args, "dump": str(dumps[name]), "dist_bn": dist_bn})
    jobs_file.write_text(json.dumps(listed))
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(script),
        str(jobs_file),
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return dumps


@pytest.fixture(scope="module")
def run_argv(cli_argv):
    """`run_argv(**options)`: a tiny ConViT of width 16 trained by SGD, no augmentation, no drop path."""
    model_kwargs = dict(cli_argv.TINY_CONVIT["model_kwargs"], embed_dim=16)
    return functools.partial(cli_argv, cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, SGD, model_kwargs=model_kwargs)


@pytest.fixture(scope="module")
def stream_argv(tmp_path_factory, hf_toy, run_argv):
    """That ConViT on a local hfids/ stream of the toy data set (48 training, 13 validation images), evaluated in
    batches of 2; None without the datasets package."""
    if importlib.util.find_spec("datasets") is None:
        return None
    root = tmp_path_factory.mktemp("stream")
    hf_toy.write(root / "toy", {"train": 48, "validation": 13}, card=True)
    (root / "cache").mkdir()
    return run_argv(dataset=f"hfids/{root / 'toy'}", data_dir=root / "cache", eval_batch_size=2)


@pytest.fixture(scope="module")
def dist_bn_argv(cli_argv) -> list[str]:
    """timm's test_resnet (BatchNorm) on the plain 16-px digits."""
    return cli_argv(cli_argv.PLAIN_DIGITS, SGD, model="test_resnet", img_size=16, train_fraction=0.3)


@pytest.fixture(scope="module")
def launched(tmp_path_factory, run_argv, stream_argv, dist_bn_argv) -> dict[str, Path]:
    """The runs of this module, trained by 2 processes in one launch with a batch of 8 per process."""
    jobs = {"same": (run_argv(train_fraction=0.3), 8, False), "dist_bn": (dist_bn_argv, 8, True)}
    if stream_argv is not None:
        jobs["stream"] = (stream_argv, 8, False)
    return launch_two(tmp_path_factory.mktemp("two"), jobs)


def test_two_processes_train_the_same_model_as_one(tmp_path, run_argv, launched):
    """The 2-process run (a batch of 8 each) against the same run trained by 1 process (a batch of 16), here."""
    one = tmp_path / "one"
    one.mkdir()
    train_and_dump([*run_argv(train_fraction=0.3), "--batch-size", "16", "--output", str(one / "run")], one)
    two = launched["same"]

    rank0, rank1 = load_file(two / "rank0.safetensors"), load_file(two / "rank1.safetensors")
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0), "DDP ranks diverged"

    single = load_file(one / "rank0.safetensors")
    initial = load_file(one / "run" / "checkpoints" / "epoch_0.safetensors")
    assert all(
        torch.equal(initial[k], load_file(two / "run" / "checkpoints" / "epoch_0.safetensors")[k]) for k in initial
    )
    moved = max((single[k] - initial[k]).abs().max().item() for k in single)
    gap = max((single[k] - rank0[k]).abs().max().item() for k in single)
    assert moved > 1e-2, "training did not change the weights"
    assert gap < 1e-4 * moved, (gap, moved)  # float summation order only (SGD: no Adam amplification)

    # evaluation is exact across processes: gather_for_metrics drops the padding of the last batch
    results_two = json.loads((two / "run" / "results.json").read_text())
    results_one = json.loads((one / "run" / "results.json").read_text())
    assert abs(results_two["final_top1"] - results_one["final_top1"]) < 0.6  # at most 2 of 359 images flip
    header, row_two = (two / "run" / "summary.csv").read_text().splitlines()[:2]
    row_one = (one / "run" / "summary.csv").read_text().splitlines()[1]
    eval_loss = header.split(",").index("eval_loss")
    assert abs(float(row_two.split(",")[eval_loss]) - float(row_one.split(",")[eval_loss])) < 1e-3


def test_two_processes_stream_a_dataset_and_evaluate_all_of_it(tmp_path, stream_argv, launched):
    """hfids/ under 2 processes: timm's reader gives each rank its own part of the stream (one parquet shard:
    every other example), the ranks stay identical, and the 13 validation images, split 7/6 between the
    ranks and read in batches of 2 (4 batches against 3), are evaluated whole: the final metrics are those
    of one process evaluating the final weights."""
    pytest.importorskip("datasets")
    two = launched["stream"]

    rank0, rank1 = load_file(two / "rank0.safetensors"), load_file(two / "rank1.safetensors")
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0), "DDP ranks diverged"
    final = json.loads((two / "run" / "log.jsonl").read_text().splitlines()[-1])
    one = train.run(
        stream_argv
        + ["--eval-only", "--checkpoint", str(two / "rank0.safetensors"), "--output", str(tmp_path / "eval")]
    )
    assert final["eval_top1"] == pytest.approx(one["eval_top1"], abs=1e-9)
    assert final["eval_top1"] * 13 / 100 == pytest.approx(round(final["eval_top1"] * 13 / 100))  # out of 13
    assert final["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("dist_bn", DIST_BN)
def test_dist_bn_gives_every_rank_the_same_batchnorm_statistics(launched, dist_bn):
    """Each rank's last batches move its own BatchNorm statistics: before evaluating, --dist-bn reduce (timm's
    default) averages them over the ranks, broadcast gives every rank rank 0's, '' leaves them apart. Every
    mode is applied by the engine's step to the same statistics of the same 2-process run (`every_dist_bn`)."""
    two = launched["dist_bn"]
    rank0, rank1 = load_file(two / "bn_rank0.safetensors"), load_file(two / "bn_rank1.safetensors")
    names = [k.removeprefix("before.") for k in rank0 if k.startswith("before.")]
    assert names and max((rank0[f"before.{k}"] - rank1[f"before.{k}"]).abs().max().item() for k in names) > 1e-4
    after = dist_bn or "none"
    for k in names:
        before0, before1 = rank0[f"before.{k}"], rank1[f"before.{k}"]
        after0, after1 = rank0[f"{after}.{k}"], rank1[f"{after}.{k}"]
        expected = {"reduce": ((before0 + before1) / 2,) * 2, "broadcast": (before0, before0), "": (before0, before1)}
        torch.testing.assert_close((after0, after1), expected[dist_bn], rtol=1e-6, atol=1e-7)
