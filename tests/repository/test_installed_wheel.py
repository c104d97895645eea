"""A fresh, non-editable install of the package's wheel. The wheel is built from a copy of the repository (pip
wheel without build isolation: this environment's setuptools, nothing downloaded) and installed into an empty
folder (`pip install --no-deps --target`); a child interpreter then sees that folder and this environment's
third-party packages, never the repository nor its editable install. pyproject.toml names no family: the wheel
holds convbias and exactly the families of `convbias.families.FAMILIES`, and `load_families()` there imports
each one from the installed folder and registers its models in timm's registry."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

from convbias.families import FAMILIES

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# What the repository holds that a build neither needs nor should see: its history, virtual environment, caches,
# earlier builds, runs and results
NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", "__pycache__", ".*_cache", "build", "dist", "*.egg-info", "runs", "wandb", "results"
)

CHILD = """
import json, sys
# the repository's editable install (a finder on sys.meta_path) out: only the installed folder holds convbias
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path.insert(0, sys.argv[1])
import timm
from timm.models import model_entrypoint
import convbias.families
names = list(convbias.families.FAMILIES)
convbias.families.load_families()
print(json.dumps({
    "families": names,
    "files": {name: sys.modules[name].__file__ for name in ["convbias", *names]},
    "models": {name: sorted(m for m in timm.list_models() if model_entrypoint(m).__module__.split(".")[0] == name)
               for name in names},
}))
"""


def _pip(*args: str | Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            *map(str, args),
            "--no-deps",
            "--no-index",
            "--quiet",
            "--disable-pip-version-check",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The folder the wheel, built from a copy of the repository, is installed into."""
    root = tmp_path_factory.mktemp("wheel")
    source, dist, target = root / "source", root / "dist", root / "installed"
    shutil.copytree(REPO, source, ignore=NOT_COPIED)
    _pip("wheel", "--no-build-isolation", "--wheel-dir", dist, source)
    (wheel,) = dist.glob("*.whl")
    _pip("install", "--target", target, wheel)
    return target


def test_the_wheel_holds_the_package_and_every_family(installed):
    packages = {path.name for path in installed.iterdir() if (path / "__init__.py").is_file()}
    assert packages == {"convbias", *FAMILIES}  # not tests/ nor benchmarks/: pyproject excludes them, names none


def test_an_installed_wheel_registers_every_family(installed, tmp_path):
    done = subprocess.run(
        [sys.executable, "-I", "-c", CHILD, str(installed)],
        cwd=tmp_path,  # not the repository: -I keeps the current folder and PYTHONPATH off sys.path
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["families"] == list(FAMILIES)
    for name, file in report["files"].items():
        assert Path(file).is_relative_to(installed), f"{name} imported from {file}, not from the installed wheel"
    assert [name for name, models in report["models"].items() if not models] == [], report["models"]
