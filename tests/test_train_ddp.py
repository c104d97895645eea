"""DDP on CPU: 2 processes keep identical weights and train the same model as 1 process with the same
global batch (gloo backend; randomness that differs per rank is off: no augmentation, no drop path). SGD keeps
rounding differences at rounding size (Adam divides near-zero gradients by their own magnitude).

`accelerate launch --cpu` starts a single process unless MPI is set up, so the test uses accelerate's
torchrun launcher (`--multi_gpu`) with ACCELERATE_USE_CPU=1, which is accelerate's multi-CPU mode.
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from convbias.cli import train

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DUMP_WEIGHTS = """
import sys
from safetensors.torch import save_file
from convbias.engine import parse_config
from convbias.engine.loop.setup import start_run
from convbias.engine.loop.trainer import build_trainer
from convbias.families import load_families
dump_dir, args = sys.argv[1], sys.argv[2:]
trainer = build_trainer(start_run(parse_config(args), load_families(), None))
trainer.fit()
rank = trainer.accelerator.process_index
weights = trainer.accelerator.unwrap_model(trainer.models.model).state_dict()
save_file({k: v.detach().contiguous() for k, v in weights.items()}, f"{dump_dir}/rank{rank}.safetensors")
"""
LAUNCH_TIMEOUT_S = 300  # a collective that one rank never joins hangs: fail instead
SGD = dict(drop_path=0, opt="sgd", lr=0.05, epochs=1, save_epochs=0)


@pytest.fixture(scope="module")
def run_argv(cli_argv):
    """`run_argv(**options)`: a tiny ConViT of width 16 trained by SGD, no augmentation, no drop path."""
    model_kwargs = dict(cli_argv.TINY_CONVIT["model_kwargs"], embed_dim=16)
    return functools.partial(cli_argv, cli_argv.TINY_CONVIT, cli_argv.PLAIN_DIGITS, SGD, model_kwargs=model_kwargs)


def launch(
    tmp_path: Path, name: str, processes: int, batch_size: int, train_args: list[str], program: str = DUMP_WEIGHTS
) -> Path:
    dump = tmp_path / name
    dump.mkdir()
    script = tmp_path / f"{name}.py"
    script.write_text(program)
    mode = ["--multi_gpu"] if processes > 1 else ["--cpu"]
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *mode,
        "--num_processes",
        str(processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(script),
        str(dump),
        *train_args,
        "--batch-size",
        str(batch_size),
        "--output",
        str(dump / "run"),
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return dump


def test_two_processes_train_the_same_model_as_one(tmp_path, run_argv):
    train_args = run_argv(train_fraction=0.3)
    two = launch(tmp_path, "two", processes=2, batch_size=8, train_args=train_args)
    one = launch(tmp_path, "one", processes=1, batch_size=16, train_args=train_args)

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


def test_two_processes_stream_a_dataset_and_evaluate_all_of_it(tmp_path, hf_toy, run_argv):
    """hfids/ under 2 processes: timm's reader gives each rank its own part of the stream (one parquet shard:
    every other example), the ranks stay identical, and the 13 validation images, split 7/6 between the
    ranks and read in batches of 2 (4 batches against 3), are evaluated whole: the final metrics are those
    of one process evaluating the final weights."""
    pytest.importorskip("datasets")
    root, cache = tmp_path / "toy", tmp_path / "cache"
    cache.mkdir()
    hf_toy.write(root, {"train": 48, "validation": 13}, card=True)
    stream_args = run_argv(dataset=f"hfids/{root}", data_dir=cache, eval_batch_size=2)
    two = launch(tmp_path, "two", processes=2, batch_size=8, train_args=stream_args)

    rank0, rank1 = load_file(two / "rank0.safetensors"), load_file(two / "rank1.safetensors")
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0), "DDP ranks diverged"
    final = json.loads((two / "run" / "log.jsonl").read_text().splitlines()[-1])
    one = train.run(
        stream_args
        + ["--eval-only", "--checkpoint", str(two / "rank0.safetensors"), "--output", str(tmp_path / "eval")]
    )
    assert final["eval_top1"] == pytest.approx(one["eval_top1"], abs=1e-9)
    assert final["eval_top1"] * 13 / 100 == pytest.approx(round(final["eval_top1"] * 13 / 100))  # out of 13
    assert final["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)


# Records every rank's BatchNorm statistics just before and after the engine's --dist-bn step.
RECORD_DIST_BN = """
import sys
import torch
from safetensors.torch import save_file
from convbias.engine.loop import trainer as engine_trainer
from convbias.families import load_families
from convbias.engine import parse_config
from convbias.engine.loop.setup import start_run
dump_dir, args = sys.argv[1], sys.argv[2:]
real = engine_trainer.Trainer._distribute_batchnorm
def recorded(self):
    model = self.accelerator.unwrap_model(self.models.model)
    stats = lambda: {k: v.detach().clone() for k, v in model.named_buffers() if k.endswith("running_mean")}
    before = stats()
    real(self)
    rank = self.accelerator.process_index
    save_file({**{"before." + k: v for k, v in before.items()}, **{"after." + k: v for k, v in stats().items()}},
              f"{dump_dir}/rank{rank}.safetensors")
engine_trainer.Trainer._distribute_batchnorm = recorded
engine_trainer.build_trainer(start_run(parse_config(args), load_families(), None)).fit()
"""


@pytest.mark.parametrize("dist_bn", ["reduce", "broadcast", ""])
def test_dist_bn_gives_every_rank_the_same_batchnorm_statistics(tmp_path, cli_argv, dist_bn):
    """Each rank's last batches move its own BatchNorm statistics: before evaluating, --dist-bn reduce (timm's
    default) averages them over the ranks, broadcast gives every rank rank 0's, '' leaves them apart."""
    train_args = cli_argv(cli_argv.PLAIN_DIGITS, SGD, model="test_resnet", img_size=16, train_fraction=0.3)
    train_args = [*train_args, "--dist-bn", dist_bn]
    two = launch(tmp_path, "two", processes=2, batch_size=8, train_args=train_args, program=RECORD_DIST_BN)
    rank0, rank1 = load_file(two / "rank0.safetensors"), load_file(two / "rank1.safetensors")
    names = [k.removeprefix("before.") for k in rank0 if k.startswith("before.")]
    assert names and max((rank0[f"before.{k}"] - rank1[f"before.{k}"]).abs().max().item() for k in names) > 1e-4
    for k in names:
        before0, before1, after0, after1 = (
            rank0[f"before.{k}"],
            rank1[f"before.{k}"],
            rank0[f"after.{k}"],
            rank1[f"after.{k}"],
        )
        expected = {"reduce": ((before0 + before1) / 2,) * 2, "broadcast": (before0, before0), "": (before0, before1)}
        torch.testing.assert_close((after0, after1), expected[dist_bn], rtol=1e-6, atol=1e-7)
