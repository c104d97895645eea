"""Shared pytest fixtures: the repository root, the installed console scripts, test data builders."""

import contextlib
import io
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from support.faults import Fault, FaultyFileSystem, no_space, read_only_disk
from torch import nn

from convbias.base import storage

REPO = Path(__file__).resolve().parents[1]
# configs/recipes/deit.yaml, the DeiT recipe: for tests written about it (train.py's own defaults are timm's)
DEIT_RECIPE = yaml.safe_load((REPO / "configs" / "recipes" / "deit.yaml").read_text())


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`-n N`) each worker gets its share of the cores: N workers each running torch
    on every core oversubscribe them, and torch's thread pool then spins instead of working."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for the subprocesses (convbias-train, accelerate launch)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # --dist loadfile hands out the files in the order below


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files that hold real runs (`integration`) first, then those with other `slow` tests, each file's tests
    in their order: xdist's loadfile would hand out the files with the most tests first, leaving the long runs to
    the end of the suite, where one worker runs them while the other has nothing left; the many quick files
    last fill the workers evenly."""
    first_seen: dict[Path, int] = {}
    runs: set[Path] = set()
    slow: set[Path] = set()
    for item in items:
        first_seen.setdefault(item.path, len(first_seen))
        if item.get_closest_marker("integration"):
            runs.add(item.path)
        if item.get_closest_marker("slow"):
            slow.add(item.path)
    items.sort(key=lambda item: (item.path not in runs, item.path not in slow, first_seen[item.path]))


@pytest.fixture(scope="session", autouse=True)
def idle_machine():
    """The engine's load average reads as an idle machine's in this process: whether a run warns of threads beyond
    the free cores must not depend on what else runs beside the tests (tests/engine/loop/test_startup.py sets a load where it
    tests the warning)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("convbias.engine.loop.node.load_average", lambda: 0.0)
        yield


# What the package reads from the environment that a user's shell may hold: the suite runs without them, so that
# none decides a result (a test that needs one sets it). OMP_NUM_THREADS stays: it only sizes the thread pools.
PACKAGE_VARIABLES = (
    "CONVBIAS_TRACEBACK",  # every error with its traceback (convbias.base.errors)
    "CONVBIAS_LAUNCH_PROCESSES",  # set by convbias-launch for the processes it starts (convbias.cli.launch)
    "CONVBIAS_LAUNCH_EXIT_DIR",
    "TRITON_INTERPRET",  # the Triton kernels under the interpreter (convbias.gpsa.fused, engine.data.augment_passes)
    # a launcher's: torch's env:// rendezvous and the world sizes of MPI launchers (convbias.engine, convbias.cli.train)
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PMI_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_SIZE",
)


@pytest.fixture(scope="session", autouse=True)
def no_user_settings():
    """The package's environment variables (`PACKAGE_VARIABLES`) unset for the whole session, subprocesses included."""
    with pytest.MonkeyPatch.context() as patch:
        for name in PACKAGE_VARIABLES:
            patch.delenv(name, raising=False)
        yield


@pytest.fixture(scope="session")
def repo() -> Path:
    """The repository root (configs/, train.py)."""
    return REPO


@pytest.fixture(scope="session")
def deit_recipe() -> dict:
    """The options of configs/recipes/deit.yaml (the DeiT recipe; train.py's own defaults are timm's)."""
    return dict(DEIT_RECIPE)


@pytest.fixture(scope="session")
def console_script():
    """`console_script("convbias-train")`: the path of an installed console script, the one next to the
    interpreter running the tests (the venv's bin/), as a user runs it."""

    def find(name: str) -> str:
        path = Path(sys.executable).parent / name
        if not path.is_file():
            pytest.fail(f"console script {name} not found next to {sys.executable}: pip install -e . first")
        return str(path)

    return find


@pytest.fixture(scope="module")
def single_thread():
    """For modules of tiny models: a second thread costs more than it saves (far more on a busy machine).

    Use with `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    previous, variable = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # as a user would set it: the engine then keeps the threads as they are
    yield
    torch.set_num_threads(previous)
    if variable is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = variable


# -- Faults, at the package's own seams -------------------------------------------------------------------
@pytest.fixture
def file_faults():
    """The package's file-system calls (convbias.base.storage.FileSystem) for the test, with the faults that
    ``file_faults.add(Fault(...))`` plans (support.faults); ``file_faults.clear()`` ends them, for a rerun on a
    sound disk."""
    faulty = FaultyFileSystem()
    with storage.using(faulty):
        yield faulty


def _fault_of(file_faults: FaultyFileSystem, error: Callable[[], BaseException]):
    def add(on: str, name: str = "", at: int = 1, partial: bool = False) -> Fault:
        return file_faults.add(Fault(on, error(), name, at, partial=partial))

    return add


@pytest.fixture
def disk_full(file_faults):
    """``disk_full(on, name="", at=1, partial=False)``: the ``at``-th call of the FileSystem method ``on`` (on a
    file whose name holds ``name``) fails as on a full disk (ENOSPC), having written part of its content with
    ``partial``."""
    return _fault_of(file_faults, no_space)


@pytest.fixture
def read_only(file_faults):
    """``read_only(on, name="", at=1, partial=False)``: that call fails as on a read-only disk (EROFS)."""
    return _fault_of(file_faults, read_only_disk)


@pytest.fixture
def killed_at(file_faults):
    """``killed_at(on, name="", at=1)``: the process is killed inside that call (a second Ctrl-C: the
    KeyboardInterrupt that no handler turns into a clean stop)."""
    return _fault_of(file_faults, KeyboardInterrupt)


@pytest.fixture
def signal_after():
    """``with signal_after(signal.SIGHUP, batches=4):`` in the block, the run's process receives the signal once an
    epoch has handed out that many batches (the training loop's ``watching_batches``), as from a closed terminal or
    a scheduler."""
    from convbias.engine.loop.trainer import watching_batches  # not at the top: collecting loads no training loop

    def after(sig: signal.Signals, batches: int) -> contextlib.AbstractContextManager:
        def watch(source):
            for i, batch in enumerate(source):
                if i == batches:
                    os.kill(os.getpid(), sig)
                yield batch

        return watching_batches(watch)

    return after


@pytest.fixture
def as_an_unprivileged_user(monkeypatch):
    """The permission checks answer as for a user whom a folder's modes stop: the tests run as root, whom chmod
    stops not (``os.access`` says no)."""
    monkeypatch.setattr(os, "access", lambda path, mode: False)


# -- Command lines of the console scripts (convbias-train, convbias-robustness) --------------------------
class CliArgv:
    """`cli_argv(*bases, **options)`: the argv a test passes to a command, from keyword options.

    `img_size=8` gives `--img-size 8`; True a bare flag (`no_aug=True`: `--no-aug`); None or False leave the
    option out (to drop one from a base); a dict the flag's `key=value` items (`model_kwargs`); a list or
    tuple several values (`save_epochs=[0, 2]`). Each base is a dict of such options, merged in order,
    `options` last; `cli_argv.TINY_CONVIT` is the 2-block ConViT of width 8 on 8x8 images, 16 tokens of 2x2
    pixels, and `cli_argv.PLAIN_DIGITS` the embedded digits (a 10-way head) without augmentation, warm-up or loader workers."""

    TINY_CONVIT = dict(
        model="convit_tiny",
        model_kwargs=dict(patch_size=2, depth=2, local_up_to_layer=1, embed_dim=8),
        img_size=8,
        crop_pct=1,
    )
    PLAIN_DIGITS = dict(
        dataset="digits", num_classes=10, crop_pct=1, no_aug=True, repeated_aug=1, warmup_epochs=0, workers=0
    )
    DEIT_RECIPE = dict(config=str(REPO / "configs" / "recipes" / "deit.yaml"))  # train.py's defaults are timm's

    def __call__(self, *bases: dict, **options) -> list[str]:
        merged = {}
        for base in (*bases, options):
            merged.update(base)
        argv = []
        for name, value in merged.items():
            if value is None or value is False:
                continue
            argv.append("--" + name.replace("_", "-"))
            if isinstance(value, dict):
                argv += [f"{key}={item}" for key, item in value.items()]
            elif isinstance(value, list | tuple):
                argv += [str(item) for item in value]
            elif value is not True:
                argv.append(str(value))
        return argv


@pytest.fixture(scope="session")
def cli_argv() -> CliArgv:
    """Builds command lines from keyword options: `cli_argv(cli_argv.TINY_CONVIT, epochs=2, no_aug=True)`."""
    return CliArgv()


# -- Transformed CNN exactness: a CNN and its T-CNN on the same images ---------------------------------
@pytest.fixture(scope="session")
def tcnn_images() -> torch.Tensor:
    """Two fixed 64x64 RGB images (large enough for every ResNet stage to keep a spatial map)."""
    return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def relative_error():
    """`relative_error(actual, expected)`: ||actual - expected|| / ||expected||."""

    def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
        return ((actual - expected).norm() / expected.norm()).item()

    return relative


@pytest.fixture(scope="session")
def randomize_norms():
    """`randomize_norms(model)`: random BatchNorm statistics and affine parameters, model in eval mode.
    timm zero-inits the last BN of each residual branch, which would hide the converted convolutions
    from the output."""

    @torch.no_grad()
    def randomize(model: nn.Module) -> nn.Module:
        generator = torch.Generator().manual_seed(1)
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.weight.copy_(torch.rand(module.weight.shape, generator=generator) + 0.5)
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
                module.running_mean.copy_(0.1 * torch.randn(module.running_mean.shape, generator=generator))
                module.running_var.copy_(torch.rand(module.running_var.shape, generator=generator) + 0.5)
        return model.eval()

    return randomize


# -- A Hugging Face dataset in the Hub's layout, local (hfds/ and hfids/ sources) -------------------------
class HFToyDataset:
    """Three classes of 8x8 RGB PNGs (a bright left, middle or right band) as the Hub stores a dataset:
    root/data/<split>-00000-of-00001.parquet with 'image' and ClassLabel 'label' columns (or the names in
    `columns`, as CIFAR-100's 'img' and 'fine_label'), and optionally the README.md card that gives each split's
    size (what a stream needs)."""

    size = 8
    classes = ("left", "middle", "right")

    def write(
        self, root: Path, per_split: dict[str, int], card: bool = False, columns: tuple[str, str] = ("image", "label")
    ) -> Path:
        import datasets  # an optional dependency: the tests that use it skip without it

        (root / "data").mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        image_key, label_key = columns
        features = datasets.Features(
            {image_key: datasets.Image(), label_key: datasets.ClassLabel(names=list(self.classes))}
        )
        for split, count in per_split.items():
            labels, images = [i % len(self.classes) for i in range(count)], []
            for label in labels:
                pixels = rng.integers(0, 90, (self.size, self.size, 3), dtype=np.uint8)
                pixels[:, 3 * label : 3 * label + 2] += 150
                png = io.BytesIO()
                Image.fromarray(pixels).save(png, format="PNG")
                images.append({"bytes": png.getvalue(), "path": None})
            split_set = datasets.Dataset.from_dict({image_key: images, label_key: labels}, features=features)
            split_set.to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
        if card:
            self.write_card(root, per_split, columns)
        return root

    def write_card(self, root: Path, per_split: dict[str, int], columns: tuple[str, str] = ("image", "label")) -> None:
        names = "".join(f"          '{index}': {name}\n" for index, name in enumerate(self.classes))
        splits = "".join(
            f"  - name: {split}\n    num_bytes: 0\n    num_examples: {count}\n" for split, count in per_split.items()
        )
        (root / "README.md").write_text(
            f"---\ndataset_info:\n  features:\n  - name: {columns[0]}\n    dtype: image\n"
            f"  - name: {columns[1]}\n    dtype:\n      class_label:\n        names:\n"
            f"{names}  splits:\n{splits}---\n"
        )


@pytest.fixture(scope="session")
def hf_toy() -> HFToyDataset:
    """Writes the toy Hugging Face dataset: `hf_toy.write(root, {"train": 48, "validation": 12}, card=True)`."""
    return HFToyDataset()


@pytest.fixture(scope="session")
def authors_remap():
    """`authors_remap(image, field)`: the bilinear remap of the diffeomorphism authors' library
    (pcsl-epfl/diffeomorphism): floor/ceil corners of the clamped source point s - field(s), field (2, H, W)
    in pixels (channel 0 along the width)."""

    def remap(image: torch.Tensor, field: torch.Tensor) -> torch.Tensor:
        height, width = image.shape[-2:]
        y, x = torch.meshgrid(
            torch.arange(height, dtype=torch.float32), torch.arange(width, dtype=torch.float32), indexing="ij"
        )
        xn, yn = (x - field[0]).clamp(0, width - 1), (y - field[1]).clamp(0, height - 1)
        xf, yf, xc, yc = xn.floor().long(), yn.floor().long(), xn.ceil().long(), yn.ceil().long()
        xv, yv = xn - xf, yn - yf
        return (
            (1 - yv) * (1 - xv) * image[..., yf, xf]
            + (1 - yv) * xv * image[..., yf, xc]
            + yv * (1 - xv) * image[..., yc, xf]
            + yv * xv * image[..., yc, xc]
        )

    return remap


# -- torch.compile: a compiled model's outputs and gradients against eager's ---------------------------
@pytest.fixture(scope="session")
def compiled_matches_eager():
    """`compiled_matches_eager(name, model_kwargs, side, aten_kernels, part=None)`: compiles the timm model
    `name` with fullgraph=True (plain torch.compile, or as the engine's --compile does it on a CPU) and asserts
    that its outputs and gradients equal eager's on a (2, 3, side, side) batch. With `part` (a submodule's
    name), that submodule alone is compiled, on the activations it receives from that batch."""
    import timm

    from convbias.engine.model.compile import compile_model

    def loss_and_grads(model: nn.Module, fn, x: torch.Tensor):
        model.zero_grad(set_to_none=True)
        out = fn(x)
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def part_input(model: nn.Module, part: str, x: torch.Tensor) -> torch.Tensor:
        received = []
        hook = model.get_submodule(part).register_forward_pre_hook(lambda _, args: received.append(args[0]))
        with torch.no_grad():
            model(x)
        hook.remove()
        return received[0]

    def check(name: str, model_kwargs: dict, side: int, aten_kernels: bool, part: str | None = None) -> None:
        torch.manual_seed(0)
        model = timm.create_model(name, num_classes=5, **model_kwargs).train()
        x = torch.randn(2, 3, side, side)
        if part is not None:
            model, x = model.get_submodule(part), part_input(model, part, x)
        eager_out, eager_grads = loss_and_grads(model, model, x)
        # Dynamo's graphs only: torch.compiler.reset() would drop inductor's compiled kernels too, 3x the time
        torch._dynamo.reset()
        compiled = compile_model(model, "cpu", aten_kernels=aten_kernels, fullgraph=True)
        out, grads = loss_and_grads(model, compiled, x)
        torch.testing.assert_close(out, eager_out, rtol=1e-4, atol=1e-4)
        assert grads.keys() == eager_grads.keys()
        for key in grads:
            scale = eager_grads[key].abs().max().item()  # relative to the tensor's own size: BN grads are large
            torch.testing.assert_close(grads[key], eager_grads[key], rtol=1e-4, atol=1e-4 * max(scale, 1.0), msg=key)

    return check
