"""timm's class map files (``--class-map``): which folder classes a run trains on, and their labels.

A map is .txt (one class name per line, its label the line number) or .pkl (a pickled {name: label}), as timm's
readers take it; the labels index the classifier, so they are 0..K-1, each once.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

from convbias.base.errors import ConfigError
from convbias.base.inputs import read_file

CLASS_MAP_FORMS = ".txt (one class name per line, its label the line number) or .pkl (a pickled {name: label})"


class _NoGlobalsUnpickler(pickle.Unpickler):
    """A class map is a dict of built-in types: no global is ever needed, so none is loaded (no code runs)."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}, not a plain mapping")


def _text_class_map(data: bytes) -> dict[str, int]:
    """timm's .txt class map: the stripped line N names class N (blank lines at the end are ignored)."""
    names = [line.strip() for line in data.decode("utf-8").splitlines()]
    while names and not names[-1]:
        names.pop()
    mapping: dict[str, int] = {}
    for number, name in enumerate(names, start=1):
        if not name:
            raise ConfigError(f"line {number} is empty")
        if name in mapping:
            raise ConfigError(f"class {name!r} is on lines {mapping[name] + 1} and {number}")
        mapping[name] = number - 1
    return mapping


def _pickled_class_map(data: bytes) -> dict[str, int]:
    try:
        mapping = _NoGlobalsUnpickler(io.BytesIO(data)).load()
    except Exception as error:  # a damaged pickle raises many kinds
        raise ConfigError(f"not a pickled mapping ({' '.join(str(error).split()) or type(error).__name__})") from None
    if not isinstance(mapping, dict):
        raise ConfigError(f"holds a {type(mapping).__name__}, not a mapping")
    bad = next((item for item in mapping.items() if not isinstance(item[0], str) or type(item[1]) is not int), None)
    if bad is not None:
        raise ConfigError(f"entry {bad[0]!r}: {bad[1]!r} is not a class name and an integer label")
    return mapping


def read_class_map(path: str | Path) -> dict[str, int]:
    """timm's class map file as {class name: label} (timm.data.readers.class_map reads the same two formats but
    timm does not export it). The labels index the classifier, so they must be 0..K-1, each once, with K >= 2.
    ConfigError naming the file and the expected form otherwise."""
    path = Path(path)
    expected = f"expected {CLASS_MAP_FORMS}"
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".pkl"):
        raise ConfigError(f"--class-map {path}: unknown file type {suffix or '(no suffix)'}; {expected}")
    try:  # a regular file of bounded size: never a FIFO, a device or /dev/zero
        data = read_file(path, "--class-map")
    except ConfigError as error:
        raise ConfigError(f"{error}; {expected}") from None
    try:
        mapping = _text_class_map(data) if suffix == ".txt" else _pickled_class_map(data)
    except ValueError as error:  # UnicodeDecodeError is one
        raise ConfigError(f"--class-map {path}: {' '.join(str(error).split())}; {expected}") from None
    if len(mapping) < 2:
        raise ConfigError(
            f"--class-map {path} names {len(mapping) or 'no'} class{'es' if not mapping else ''}; classification "
            f"needs at least 2; {expected}"
        )
    if sorted(mapping.values()) != list(range(len(mapping))):
        raise ConfigError(
            f"--class-map {path}: labels {sorted(mapping.values())[:10]} are not 0..{len(mapping) - 1} each once; "
            f"{expected}"
        )
    return mapping


def apply_class_map(dataset, class_to_idx: dict[str, int]):
    """The samples of the mapped classes, labelled as the map says; images of other classes are left out, as
    timm's folder reader does with a class map. Every mapped name must be one of ``dataset.classes``."""
    position = {name: label for label, name in enumerate(dataset.classes)}
    new_label = {position[name]: label for name, label in class_to_idx.items()}
    kept = [i for i, target in enumerate(dataset.targets) if target in new_label]
    classes = sorted(class_to_idx, key=class_to_idx.__getitem__)
    return dataset.relabeled(kept, [new_label[dataset.targets[i]] for i in kept], classes)
