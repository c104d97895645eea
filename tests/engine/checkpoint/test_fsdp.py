"""FSDP2 resume points on CPU: PyTorch's `fully_shard` over a gloo mesh of 2 processes (accelerate enables
FSDP only on GPUs, see convbias/engine/checkpoint/shards.py), a tiny ConViT sharded block by block.

- A run saved after 3 steps with `save_sharded` and continued in fresh processes with `load_sharded`
  ends bit-identical to the run that went on (sharded weights *and* AdamW state restored).
- The sharded weights load into an unsharded model in 1 process (another world size) and equal the
  gathered weights at the save; `load_sharded` without a process group restores the weights *and* the
  AdamW state into an ordinary model and optimizer (how a sharded point resumes without FSDP).
- `FullCopy.refresh` (what the EMA and the diagnostics read under FSDP) holds the gathered weights on
  every rank.
- 2 sharded processes train the same model as 1 process with the same global batch (up to float
  summation order), also with activation checkpointing and torch.compile (AOTAutograd's forward and
  backward graphs around FSDP2's hooks), as `--grad-checkpointing --compile` run.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# One interpreter imports torch and timm once and forks the processes of every run from there (a gloo group
# through a file store each): fresh processes, without an interpreter start-up of their own.
DRIVER = r"""
import sys
from datetime import timedelta
from multiprocessing import get_context
from pathlib import Path

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import convit  # noqa: F401  (registers convit_tiny)
from convbias.engine.checkpoint.shards import load_sharded, save_sharded
from convbias.engine.model.build import FullCopy

global_batch = 8


def worker(mode, out, rank, world):
    dist.init_process_group("gloo", init_method=f"file://{out / (mode + '.store')}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # a collective that one rank never joins: fail
    torch.manual_seed(0)
    model = timm.create_model("convit_tiny", patch_size=2, depth=2, local_up_to_layer=1, embed_dim=8, img_size=8,
                              in_chans=1, num_classes=10, drop_path_rate=0.0)
    full_copy = FullCopy(model, "cpu")
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward = model
    if mode == "compiled":  # what --compile --grad-checkpointing do: timm's checkpointing, torch.compile of the model
        model.set_grad_checkpointing(True)
        forward = torch.compile(model, backend="aot_eager")

    def train(steps):
        for step in steps:
            g = torch.Generator().manual_seed(step)  # the global batch of this step; each rank takes its slice
            images = torch.randn(global_batch, 1, 8, 8, generator=g)
            labels = torch.randint(0, 10, (global_batch,), generator=g)
            part = slice(rank * global_batch // world, (rank + 1) * global_batch // world)
            F.cross_entropy(forward(images[part]), labels[part]).backward()
            optimizer.step()
            optimizer.zero_grad()

    def dump(name):
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, str(out / f"{name}.safetensors"))

    if mode == "straight":  # 6 steps, saved after 3 (the save changes nothing in the run)
        train(range(3))
        dump("at_save")
        copied = full_copy.refresh(model).state_dict()
        save_file({k: v.contiguous() for k, v in copied.items()}, str(out / f"full_copy_rank{rank}.safetensors"))
        point = out / "point"
        point.mkdir(exist_ok=True)
        save_sharded(point, model, optimizer)
        full_optimizer = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                            cpu_offload=True))
        if rank == 0:
            torch.save(full_optimizer, out / "optimizer_at_save.pt")
        train(range(3, 6))
        dump("straight")
    elif mode == "compiled":
        train(range(6))
        dump("compiled")
    else:
        load_sharded(out / "point", model, optimizer)
        train(range(3, 6))
        dump("resumed")
    dist.barrier()
    dist.destroy_process_group()


def launch(mode, out, world):  # mode on world fresh processes forked from this one (everything imported)
    out.mkdir(exist_ok=True)
    ranks = [get_context("fork").Process(target=worker, args=(mode, out, rank, world)) for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(150)
        if process.exitcode is None:
            process.kill()
    codes = [process.exitcode for process in ranks]
    if codes != [0] * world:
        sys.exit(f"{mode} on {world} processes: exit codes {codes}")


root = Path(sys.argv[1])
launch("straight", root, 2)
launch("resume", root, 2)  # fresh processes: only the resume point goes from the straight run to these
launch("straight", root / "single", 1)
launch("compiled", root / "compiled", 2)
"""


def run_driver(root: Path) -> None:
    """The driver's runs in `root`: the 2-process run saved after 3 steps (point/, at_save, full_copy_rank*,
    optimizer_at_save.pt, straight) and its resumption (resumed), the 1-process run (single/) and the
    2-process compiled run (compiled/)."""
    script = root / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(script), str(root)], env=env, capture_output=True, text=True, cwd=root, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_sharded_save_and_resume_continue_exactly(tmp_path):
    run_driver(tmp_path)
    assert sorted(p.name for p in (tmp_path / "point" / "sharded").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    straight, resumed = load_file(tmp_path / "straight.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)

    # the weights alone on another world size: one process, an ordinary model
    import timm

    import convit  # noqa: F401
    from convbias.engine.checkpoint.shards import load_full_weights

    model = timm.create_model(
        "convit_tiny", patch_size=2, depth=2, local_up_to_layer=1, embed_dim=8, img_size=8, in_chans=1, num_classes=10
    )
    load_full_weights(tmp_path / "point", model)
    at_save = load_file(tmp_path / "at_save.safetensors")
    assert all(torch.equal(v, at_save[k]) for k, v in model.state_dict().items())
    for rank in range(2):  # every rank's full copy holds the gathered weights
        copied = load_file(tmp_path / f"full_copy_rank{rank}.safetensors")
        assert copied.keys() == at_save.keys() and all(torch.equal(copied[k], at_save[k]) for k in at_save)

    # weights and optimizer state into an ordinary model and AdamW, no process group (resume without FSDP)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from convbias.engine.checkpoint.shards import load_sharded

    plain = timm.create_model(
        "convit_tiny", patch_size=2, depth=2, local_up_to_layer=1, embed_dim=8, img_size=8, in_chans=1, num_classes=10
    )
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    load_sharded(tmp_path / "point", plain, optimizer)
    assert all(torch.equal(v, at_save[k]) for k, v in plain.state_dict().items())
    restored = get_optimizer_state_dict(plain, optimizer)["state"]
    expected = torch.load(tmp_path / "optimizer_at_save.pt", weights_only=True)["state"]
    assert restored.keys() == expected.keys() and len(expected) == len(list(plain.parameters()))
    for name, moments in expected.items():
        assert all(torch.equal(restored[name][k], v) for k, v in moments.items()), name

    # 2 sharded processes train what 1 process trains with the same global batch
    one = load_file(tmp_path / "single" / "straight.safetensors")
    moved = max((one[k] - at_save[k]).abs().max().item() for k in one)
    gap = max((one[k] - straight[k]).abs().max().item() for k in one)
    assert moved > 1e-3 and gap < 1e-2 * moved, (gap, moved)  # AdamW: float summation order, amplified a little

    # the same, sharded and compiled with activation checkpointing
    trained = load_file(tmp_path / "compiled" / "compiled.safetensors")
    gap = max((one[k] - trained[k]).abs().max().item() for k in one)
    assert gap < 1e-2 * moved, (gap, moved)
