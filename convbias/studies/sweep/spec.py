"""A sweep file and its grid: read and check the spec (see `convbias.studies.sweep.sweep` for the file's
format), apply command-line overrides, and expand the grid into runs, each with its directory name and
the train.py options it resolves to."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convbias.base.command_line import non_finite
from convbias.base.errors import ConfigError
from convbias.base.inputs import read_yaml
from convbias.engine import build_parser, file_option_value, file_place, option_names

SWEEP_KEYS = ("config", "set", "grid", "variants", "scale_epochs", "baseline")
MODEL_KWARG_PREFIX = "model_kwargs."


@dataclass(frozen=True)
class Run:
    """One grid point: its directory name, its axis values and the train.py options it resolves to."""

    name: str
    point: dict[str, Any]
    options: dict[str, Any]


# ----------------------------------------------------------------------------- sweep spec


def load_spec(path: str | Path) -> dict[str, Any]:
    """Read a sweep file and return its normalized spec (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file not found: {path}")
    lines: dict[str, int] = {}
    raw = read_yaml(path, "sweep file", key_lines=lines) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with keys {', '.join(SWEEP_KEYS)}")
    spec = normalize_spec(raw, source=str(path))
    check_values(spec, lambda key: file_place("sweep file", path, lines.get(key), key))
    return spec


def check_values(spec: dict[str, Any], place: Callable[[str], str]) -> None:
    """Each value the spec gives a train.py option (in ``set``, on a ``grid`` axis, in a variant) typed and checked
    as that option's, before any run is expanded: a ConfigError naming where it is (``place('set.lr')``: the
    file, line and key), not the command line the sweep renders it to; a model kwarg's number finite. Keys that
    are no option are refused by the sweep's own check, with their close names."""
    parser = build_parser()
    given = [(f"set.{key}", key, value) for key, value in spec["set"].items()]
    given += [(f"grid.{key}", key, value) for key, values in spec["grid"].items() for value in values]
    given += [
        (f"variants.{name}.{key}", key, value)
        for name, options in spec["variants"].items()
        for key, value in options.items()
    ]
    for where, key, value in given:
        if key.startswith(MODEL_KWARG_PREFIX):
            bad = non_finite(value)
            if bad is not None:
                raise ConfigError(f"{place(where)} must be a finite number, got {bad}")
        elif key in option_names():
            file_option_value(key, value, place(where), parser)


def normalize_spec(raw: dict[str, Any], source: str = "sweep") -> dict[str, Any]:
    """Check the shape of a sweep spec and fill its defaults; grid values become lists."""
    unknown = sorted(set(raw) - set(SWEEP_KEYS))
    if unknown:
        raise ConfigError(f"{source}: unknown sweep key(s) {unknown}; expected {list(SWEEP_KEYS)}")
    spec = {
        "config": raw.get("config"),
        "set": dict(raw.get("set") or {}),
        "grid": {},
        "variants": dict(raw.get("variants") or {}),
        "scale_epochs": bool(raw.get("scale_epochs", True)),
        "baseline": raw.get("baseline"),
    }
    for key, values in (raw.get("grid") or {}).items():
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        if not values:
            raise ConfigError(f"{source}: grid.{key} is empty")
        if len(set(map(repr, values))) != len(values):
            raise ConfigError(f"{source}: grid.{key} repeats a value: {values}")
        spec["grid"][key] = values
    for name, options in spec["variants"].items():
        if not isinstance(options, dict):
            raise ConfigError(f"{source}: variants.{name} must be a mapping of train.py options")
    if spec["variants"] and "model" in spec["grid"]:
        raise ConfigError(f"{source}: use either variants or grid.model, not both (put the model inside each variant)")
    return spec


def override_spec(
    spec: dict[str, Any], grid: dict[str, list] | None = None, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Return a copy of ``spec`` with grid axes and shared options replaced (the CLI overrides), each value
    checked as its option's (``check_values``, naming ``--set KEY`` or ``--grid KEY``)."""
    given = {"set": dict(options or {}), "grid": {key: list(values) for key, values in (grid or {}).items()}}
    check_values({**given, "variants": {}}, lambda where: "--" + where.replace(".", " ", 1))
    spec = copy.deepcopy(spec)
    for key, values in (grid or {}).items():
        spec["grid"][key] = list(values)
    for key, value in (options or {}).items():
        if key.startswith(MODEL_KWARG_PREFIX):
            spec["set"].setdefault("model_kwargs", {})[key[len(MODEL_KWARG_PREFIX) :]] = value
        else:
            spec["set"][key] = value
    return normalize_spec(spec)


# ----------------------------------------------------------------------------- grid expansion


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).replace("/", "-").replace(" ", "")


def run_name(point: dict[str, Any]) -> str:
    """Directory name of a grid point: ``convit_tiny__f0.05__seed0__locality_strength-2``."""
    parts = []
    for key, value in point.items():
        if key in ("variant", "model"):
            parts.append(_format_value(value))
        elif key == "train_fraction":
            parts.append(f"f{_format_value(value)}")
        elif key == "seed":
            parts.append(f"seed{value}")
        else:
            parts.append(f"{column_name(key)}-{_format_value(value)}")
    return "__".join(parts)


def column_name(axis: str) -> str:
    """CSV column of a grid axis (``model_kwargs.locality_strength`` -> ``locality_strength``)."""
    return axis[len(MODEL_KWARG_PREFIX) :] if axis.startswith(MODEL_KWARG_PREFIX) else axis


def _apply(options: dict[str, Any], key: str, value: Any) -> None:
    if key.startswith(MODEL_KWARG_PREFIX):
        options.setdefault("model_kwargs", {})[key[len(MODEL_KWARG_PREFIX) :]] = value
    elif key == "model_kwargs":
        options.setdefault("model_kwargs", {}).update(value)
    else:
        options[key] = value


def expand_grid(spec: dict[str, Any]) -> list[Run]:
    """All runs of a sweep, in grid order (variants outermost, then the grid axes as written)."""
    axes = dict(spec["grid"])
    if spec["variants"]:
        axes = {"variant": list(spec["variants"]), **axes}
    columns = [column_name(axis) for axis in axes]
    if len(set(columns)) != len(columns):
        raise ConfigError(f"two grid axes map to the same CSV column: {list(axes)}")
    runs = []
    for values in itertools.product(*axes.values()):
        point = dict(zip(axes, values))
        options: dict[str, Any] = {}
        for key, value in copy.deepcopy(spec["set"]).items():  # model_kwargs.NAME in a file's set too
            _apply(options, key, value)
        for key, value in point.items():
            if key == "variant":
                for vkey, vvalue in spec["variants"][value].items():
                    _apply(options, vkey, copy.deepcopy(vvalue))
            else:
                _apply(options, key, value)
        runs.append(Run(run_name(point), point, options))
    names = [run.name for run in runs]
    if len(set(names)) != len(names):
        raise ConfigError(
            "two grid points give the same run directory name; make the grid values distinct after formatting"
        )
    return runs
