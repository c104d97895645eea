"""Reading files a user hands to a command (recipes, sweep files, a run's config, manifests, results and log,
an export's config, class maps) with limits, so a damaged or hostile file is one line naming it, never a
traceback, a hang or a memory blow-up.

Every file read whole is a regular file (``read_file``: a FIFO, socket or device is named and never read: it
could block forever or never end) of bounded size.

YAML is read with PyYAML's safe loader (no tags that run code) bounded in nesting depth, in aliases and in
the size the aliases expand to (a "billion laughs" file of 1 KB expands to 10^9 nodes); a mapping that gives a
key twice is refused naming the key and both lines (PyYAML would keep the last without a word). A JSON line nested
deeper than the interpreter's recursion limit is a damaged line like any other. Messages quote a value by a
short prefix only. Light to import: no torch.
"""

from __future__ import annotations

import collections
import json
import os
import reprlib
import stat
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

# Nesting of a recipe or sweep file: real ones nest 3 or 4 levels; PyYAML's composer recurses per level.
MAX_YAML_DEPTH = 64
# Aliases (*name) in one document: real recipes use a handful.
MAX_YAML_ALIASES = 1_000
# Nodes once every alias is expanded: what a consumer that walks or prints the value meets.
MAX_YAML_NODES = 1_000_000
# Characters of a value quoted in a message.
QUOTED_CHARACTERS = 60
# Bytes of a file read whole (recipes, configs, manifests, results, class maps): far above what any of them
# holds, far below what would exhaust memory.
MAX_FILE_BYTES = 64 << 20
# What a file that is not regular is, by its stat mode
SPECIAL_FILES = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def special_file(mode: int) -> str | None:
    """What a file of stat mode ``mode`` is when it is neither a regular file nor a folder, else None."""
    return next((kind for is_kind, kind in SPECIAL_FILES if is_kind(mode)), None)


def check_regular_file(path: str | Path, what: str = "file", error: type[Exception] = ConfigError) -> Path:
    """``path`` (links followed) when it is a regular file; ``error`` naming it otherwise (missing, a folder, a
    FIFO, socket or device: found by its status, never opened)."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except OSError as e:
        raise error(f"{what} {path} cannot be read ({e.strerror or e})") from None
    if stat.S_ISDIR(mode):
        raise error(f"{what} {path} is a folder, not a file")
    kind = special_file(mode)
    if kind is not None:
        raise error(f"{what} {path} is {kind}, not a regular file; it was not read")
    return path


def check_plain_file(path: str | Path, what: str = "file", error: type[Exception] = ConfigError) -> Path:
    """``path`` when it is a regular file under that one name, as the package writes its own files: ``error``
    naming it when it is a symbolic link (with its target), has other names (a hard link: a write through it
    changes them all), or is no regular file (``check_regular_file``). Found by its status, never opened."""
    path = Path(path)
    try:
        status = os.lstat(path)
    except OSError:
        return check_regular_file(path, what, error)  # missing or unreadable: named there
    if stat.S_ISLNK(status.st_mode):
        raise error(
            f"{what} {path} is a symbolic link (to {os.readlink(path)}), not the file this package wrote there; "
            f"it was not read or written through: replace it with a copy of what it points at, or move it away"
        )
    check_regular_file(path, what, error)
    if status.st_nlink > 1:
        raise error(
            f"{what} {path} is a hard link ({status.st_nlink} names for one file), not the file this package "
            f"wrote there; it was not read or written through: replace it with a copy (cp), or move it away"
        )
    return path


def read_head(path: str | Path, size: int) -> bytes | None:
    """The first ``size`` bytes of the regular file ``path``, or None when it is missing, not a regular file or
    unreadable: what a check that recognizes a file by its first line reads (never blocking on a FIFO)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as f:
        try:
            return f.read(size) if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else None
        except OSError:
            return None


def read_file(
    path: str | Path,
    what: str = "file",
    error: type[Exception] = ConfigError,
    limit: int = MAX_FILE_BYTES,
    plain: bool = False,
    tail: bool = False,
) -> bytes:
    """The bytes of the regular file ``path`` (``check_regular_file``; with ``plain``, a file the package wrote
    and reads back: ``check_plain_file``), at most ``limit`` of them (with ``tail``, its last ``limit`` bytes:
    a log's end); ``error`` naming it (as ``what``) otherwise. Opened without blocking, so a file swapped for a
    FIFO after the check is refused too."""
    path = check_plain_file(path, what, error) if plain else check_regular_file(path, what, error)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise error(f"{what} {path} cannot be read ({e.strerror or e})") from None
    with os.fdopen(descriptor, "rb") as f:
        kind = special_file(os.fstat(f.fileno()).st_mode)
        if kind is not None:
            raise error(f"{what} {path} is {kind}, not a regular file; it was not read")
        try:
            if tail:
                f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            data = f.read(limit + 1)
        except OSError as e:
            raise error(f"{what} {path} cannot be read ({e.strerror or e})") from None
    if len(data) > limit:
        raise error(f"{what} {path} is larger than {limit:,} bytes: not a {what} this package reads")
    return data


def read_json(path: str | Path, what: str = "file", error: type[Exception] = ConfigError, plain: bool = False) -> Any:
    """The JSON value of the file ``path`` (``read_file``'s checks); ``error`` naming it when it is not UTF-8
    JSON or is nested beyond what the interpreter decodes."""
    data = read_file(path, what, error, plain=plain)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None
    except ValueError as e:
        raise error(f"{what} {path} is not JSON ({first_line(e)})") from None
    except RecursionError:
        raise error(f"{what} {path} is nested too deeply to be a {what}") from None


class YAMLLimitError(yaml.YAMLError):
    """A YAML document beyond one of the limits above."""


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping that gives one key twice."""


MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *base`: the keys it brings in may be given again, by YAML's rules


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that counts depth and aliases while composing, and the expanded size after; refuses a key
    given twice in one mapping; records the line of each key in ``key_lines`` (``_record_key_lines``)."""

    def __init__(self, stream: Any, key_lines: dict[Any, int] | None = None):
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0
        self.key_lines = key_lines

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    first = lines.get(key)
                except TypeError:  # an unhashable key: the constructor names it
                    continue
                if first is not None:
                    raise DuplicateKeyError(f"the key {quoted(str(key))!r} is given twice, on lines {first} and {line}")
                lines[key] = line
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise YAMLLimitError(f"more than {MAX_YAML_ALIASES} aliases")
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise YAMLLimitError(f"nested deeper than {MAX_YAML_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None:
            expanded_size(node)
        if self.key_lines is not None:
            self._record_key_lines(node)
        return node

    def _record_key_lines(self, root: Any) -> None:
        """The line (from 1) of each key of the mappings in ``root``, a nested one as 'outer.inner'; a mapping
        reached again through an alias is recorded once, under its first path."""
        pending, seen = collections.deque([(root, "")]), set()
        while pending:
            node, prefix = pending.popleft()
            if not isinstance(node, yaml.MappingNode) or id(node) in seen:
                continue
            seen.add(id(node))
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode):
                    self.key_lines.setdefault(prefix + key_node.value, key_node.start_mark.line + 1)
                    pending.append((value_node, f"{prefix}{key_node.value}."))


def expanded_size(node: yaml.Node) -> int:
    """The nodes of ``node`` with every alias expanded (shared nodes counted each time they are reached);
    YAMLLimitError past MAX_YAML_NODES. Memoized per node, so a billion laughs costs a few dozen steps."""
    sizes: dict[int, int] = {}

    def size(item: yaml.Node) -> int:
        key = id(item)
        if key not in sizes:
            sizes[key] = 0  # a node that contains itself (a recursive alias) counts as one here
            if isinstance(item, yaml.MappingNode):
                children = [child for pair in item.value for child in pair]
            elif isinstance(item, yaml.SequenceNode):
                children = item.value
            else:
                children = []
            total = 1 + sum(size(child) for child in children)
            if total > MAX_YAML_NODES:
                raise YAMLLimitError(f"expands to more than {MAX_YAML_NODES:,} values through its aliases")
            sizes[key] = total
        return sizes[key]

    return size(node)


def parse_yaml(text: str | bytes, key_lines: dict[Any, int] | None = None) -> Any:
    """The YAML document in ``text`` (yaml.YAMLError when it is not YAML, gives a key twice or breaks a limit);
    ``key_lines``, when given, gets the line (from 1) of each key of its mappings ('set.lr' for a nested one)."""
    loader = _BoundedLoader(text, key_lines)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(
    path: str | Path,
    what: str = "file",
    error: type[Exception] = ConfigError,
    plain: bool = False,
    key_lines: dict[Any, int] | None = None,
) -> Any:
    """The YAML document of the file ``path``; ``error`` naming it when it is missing, not a regular file, not
    UTF-8 text, not YAML, gives a key twice or is beyond the limits (``what`` says what the file is: 'recipe',
    'sweep file'). With ``plain``: a file the package wrote and reads back (``check_plain_file``); ``key_lines``
    as ``parse_yaml``'s."""
    data = read_file(path, what, error, plain=plain)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None
    try:
        return parse_yaml(text, key_lines)
    except yaml.YAMLError as e:
        raise error(f"{what} {path} is not valid YAML: {yaml_problem(e)}") from None


def yaml_problem(error: yaml.YAMLError) -> str:
    """What is wrong in a YAML document and where: 'expected ',' or ']', but got '<stream end>' (line 1,
    column 13)'; the first line of any other error."""
    problem, mark = getattr(error, "problem", None), getattr(error, "problem_mark", None)
    if not problem or mark is None:
        return first_line(error)
    return f"{quoted(problem, 200)} (line {mark.line + 1}, column {mark.column + 1})"


def first_line(error: BaseException) -> str:
    """The first line of an error's message, cut to a readable length."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return quoted(text, 200)


def quoted(value: Any, limit: int = QUOTED_CHARACTERS) -> str:
    """``value`` as a message shows it: its repr (a string as it is), at most ``limit`` characters."""
    text = value if isinstance(value, str) else _short_repr(value, limit)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short_repr(value: Any, limit: int) -> str:
    """repr of a value whose full repr may be huge (a shared structure expanded): the plain repr when the
    value is small, else reprlib's, which stops at a few items per level."""
    if _values_within(value, limit):
        return repr(value)
    shortener = reprlib.Repr()
    shortener.maxstring = shortener.maxother = limit
    shortener.maxlevel = 3
    return shortener.repr(value)


def _values_within(value: Any, budget: int) -> bool:
    """``value`` holds at most ``budget`` values, counting a shared one each time it is reached."""
    pending, seen = [value], 0
    while pending:
        item = pending.pop()
        seen += 1
        if seen > budget:
            return False
        if isinstance(item, dict):
            pending += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple, set)):
            pending += list(item)
    return True


def json_record(line: bytes) -> Any:
    """A JSON line's value, or None when it is damaged: not UTF-8, not JSON, or nested beyond what the
    interpreter can decode (a damaged line is dropped whatever its depth)."""
    try:
        return json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
