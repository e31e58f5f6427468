"""File -> `Config`: the file read within bounds (a regular file only, size, UTF-8, nesting,
alias expansion), parsed as YAML, validated, and every failure turned into a `ConfigError`
naming the key path and the reason, e.g.
``pools[llama3-8b].endpoints[0].address: expected host:port, got 'foo'``: a pool is named by
its name (by its index when it has no usable or unique name), and an unknown key comes with
the closest known key at that place (``unknown key; did you mean lb_policy?``). The CLI
turns a `ConfigError` into exit status 2."""

from __future__ import annotations

import asyncio
import difflib
import os
import re
import stat
import types
import typing
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from xds_server.config.checks import config_problems
from xds_server.config.schema import Config


class ConfigError(Exception):
    """A config that cannot be used. `problems` holds (key path, reason) pairs."""

    def __init__(self, problems: Iterable[tuple[str, str]]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(f"{path}: {reason}" if path else reason
                                   for path, reason in self.problems))


def _format_loc(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds: itself, or inside Optional/Union/list/dict/
    Annotated (a dict's values, a list's items)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (dict, Mapping) and len(args) == 2:
        args = args[1:]
    elif origin is typing.Annotated:
        args = args[:1]
    elif not (origin in (typing.Union, types.UnionType, list, tuple, set, frozenset)
              or origin is not None and getattr(origin, "__module__", "") == "collections.abc"):
        return []
    return [model for arg in args if arg is not Ellipsis for model in _models_in(arg)]


def _field_keys(model: type[BaseModel]) -> dict[str, Any]:
    """The keys a config mapping may hold (a field's alias where it has one) -> annotation."""
    return {(field.alias or name): field.annotation for name, field in model.model_fields.items()}


def _is_mapping(annotation: Any) -> bool:
    """A dict field (or an optional one): its keys are names the operator chose."""
    if typing.get_origin(annotation) in (dict, Mapping):
        return True
    return any(_is_mapping(arg) for arg in typing.get_args(annotation)
               if typing.get_origin(annotation) in (typing.Union, types.UnionType))


def _known_keys(loc: tuple[int | str, ...]) -> set[str]:
    """Every key the mapping at ``loc`` (the unknown key's parent) accepts; empty when the
    place cannot be told from the location."""
    models: list[type[BaseModel]] = [Config]
    free_key = False  # the next part is a key of a dict field (a version label, a tier name)
    for part in loc:
        if isinstance(part, int) or free_key:
            free_key = False
            continue  # a list item or a dict key: the element's models were taken already
        named = [m for m in models if m.__name__ == part]
        if named:  # a union member's tag in the location
            models = named
            continue
        fields = [_field_keys(m)[part] for m in models if part in _field_keys(m)]
        models = [model for annotation in fields for model in _models_in(annotation)]
        if not models:
            return set()
        free_key = any(_is_mapping(annotation) for annotation in fields)
    return {key for m in models for key in _field_keys(m)}


def _suggestion(key: str, loc: tuple[int | str, ...]) -> str:
    close = difflib.get_close_matches(key, sorted(_known_keys(loc)), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _reason(error: Any) -> str:
    message = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            message = message[len(prefix):]
    if error["type"] == "literal_error":
        message = f"{message}, got {error['input']!r}"
    if error["type"] == "extra_forbidden":
        loc = tuple(error["loc"])
        message = "unknown key"
        if loc and isinstance(loc[-1], str):
            message += _suggestion(loc[-1], loc[:-1])
    return message


def _pydantic_problems(exc: ValidationError) -> list[tuple[str, str]]:
    return [(_format_loc(tuple(err["loc"])), _reason(err)) for err in exc.errors()]


_POOL_INDEX = re.compile(r"(?<![\w.\]])pools\[(\d+)\]")
_LABEL = re.compile(r"(?=.*[^0-9])[A-Za-z0-9._:/@+-]+")  # not all digits: never read as an index


def _pool_labels(data: Mapping[str, Any]) -> dict[str, str]:
    """Pool index -> its name, for pools whose name is a plain string no other pool has."""
    pools = data.get("pools")
    if not isinstance(pools, list):
        return {}
    names = [p.get("name") if isinstance(p, dict) else None for p in pools]
    counts = Counter(n for n in names if isinstance(n, str))
    return {str(i): n for i, n in enumerate(names)
            if isinstance(n, str) and counts[n] == 1 and _LABEL.fullmatch(n)}


def _named(problems: Iterable[tuple[str, str]], data: Mapping[str, Any]
           ) -> list[tuple[str, str]]:
    """``pools[0]`` -> ``pools[llama3-8b]`` in every path and reason: an operator reads a
    pool's name, not its place in the list."""
    labels = _pool_labels(data)

    def name(match: re.Match[str]) -> str:
        return f"pools[{labels.get(match.group(1), match.group(1))}]"

    return [(_POOL_INDEX.sub(name, path), _POOL_INDEX.sub(name, reason))
            for path, reason in problems]


def parse_config(data: Any) -> Config:
    """Validate an already-parsed YAML document. Raises ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError([("", f"expected a mapping at the top level, got {type(data).__name__}")])
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_named(_pydantic_problems(exc), data)) from None
    problems = config_problems(config)
    if problems:
        raise ConfigError(_named(problems, data))
    return config


# Bounds on a config file (a hostile or broken file is refused, never crashes the loader).
MAX_CONFIG_BYTES = 4 * 1024 * 1024
MAX_CONFIG_DEPTH = 64  # nested mappings/sequences, aliases expanded
MAX_CONFIG_NODES = 1_000_000  # YAML nodes once every alias is expanded (alias bombs)
MAX_CONFIG_LOAD_SECONDS = 30.0  # a reload that has not read and validated the file by then fails


# What a path names instead of a regular file, by stat's file type test.
_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISDIR, "a directory"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISSOCK, "a socket"))


def _refuse_unless_regular(path: str | Path, mode: int) -> None:
    """A FIFO would block the reader until someone writes it, a device may never end: only a
    regular file is read."""
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")
    raise ConfigError([("", f"{path}: is {kind}; a config must be a regular file, refused "
                            f"without reading it")])


def _cannot_read(path: str | Path, exc: OSError) -> ConfigError:
    return ConfigError([("", f"cannot read config file {str(path)!r}: {exc.strerror}")])


def _read_bytes(path: str | Path) -> bytes:
    """At most MAX_CONFIG_BYTES + 1 bytes of a regular file. The file type is checked before
    opening, and again on the open descriptor (opened non-blocking), so a FIFO swapped in
    between never blocks."""
    try:
        _refuse_unless_regular(path, os.stat(path).st_mode)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise _cannot_read(path, exc) from None
    try:
        with os.fdopen(fd, "rb") as handle:
            _refuse_unless_regular(path, os.fstat(handle.fileno()).st_mode)
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise _cannot_read(path, exc) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError([("", f"{path}: larger than {MAX_CONFIG_BYTES} bytes")])
    return raw


def _decode(path: str | Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError([("", f"{path}: not UTF-8: byte 0x{raw[exc.start]:02x} at offset "
                                f"{exc.start} (line {line})")]) from None


_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: faster


def _check_events(path: str | Path, text: str) -> None:
    """Nesting depth bounded before anything recursive (the composer) sees the document."""
    depth = 0
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                mark = event.start_mark
                where = f" at line {mark.line + 1}" if mark is not None else ""
                raise ConfigError([("", f"{path}: nested deeper than {MAX_CONFIG_DEPTH} "
                                        f"levels{where}")])
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _check_expansion(path: str | Path, root: yaml.Node) -> None:
    """Aliases expanded: at most MAX_CONFIG_DEPTH deep and MAX_CONFIG_NODES nodes in all;
    a recursive alias is refused."""
    measured: dict[int, tuple[int, int]] = {}  # node -> (expanded size, height)
    too_deep = ConfigError([("", f"{path}: aliases nest deeper than {MAX_CONFIG_DEPTH} levels")])

    def measure(node: yaml.Node, depth: int, open_ids: frozenset[int]) -> tuple[int, int]:
        if id(node) in open_ids:
            raise ConfigError([("", f"{path}: recursive YAML alias")])
        known = measured.get(id(node))
        if known is None:
            if depth > MAX_CONFIG_DEPTH:
                raise too_deep
            children: list[yaml.Node] = []
            if isinstance(node, yaml.SequenceNode):
                children = list(node.value)
            elif isinstance(node, yaml.MappingNode):
                children = [part for pair in node.value for part in pair]
            inner = open_ids | {id(node)}
            parts = [measure(child, depth + 1, inner) for child in children]
            known = (1 + sum(p[0] for p in parts), 1 + max((p[1] for p in parts), default=0))
            measured[id(node)] = known
        if depth + known[1] > MAX_CONFIG_DEPTH + 1:
            raise too_deep
        if known[0] > MAX_CONFIG_NODES:
            raise ConfigError([("", f"{path}: more than {MAX_CONFIG_NODES} YAML nodes once "
                                    f"aliases are expanded")])
        return known

    measure(root, 0, frozenset())


def _yaml_problem(path: str | Path, exc: Exception) -> ConfigError:
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    detail = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line
    return ConfigError([("", f"{path}: invalid YAML{where}: {detail}")])


def load_yaml_text(text: str, path: str | Path = "<config>") -> Any:
    """Parse YAML within the bounds above. Raises ConfigError, nothing else."""
    try:
        _check_events(path, text)
        loader = _LOADER(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_expansion(path, node)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        raise _yaml_problem(path, exc) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # e.g. a huge int
        raise ConfigError([("", f"{path}: unusable YAML value: {type(exc).__name__}: "
                                f"{exc}")]) from None


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file. Raises ConfigError naming what is wrong: an
    unreadable, non-regular (a FIFO, a device), oversized, non-UTF-8, too deeply nested or
    alias-bombed file included."""
    text = _decode(path, _read_bytes(path))
    return parse_config(load_yaml_text(text, path))


async def load_config_off_loop(path: str | Path,
                               timeout: float = MAX_CONFIG_LOAD_SECONDS) -> Config:
    """:func:`load_config` in a worker thread, so the event loop keeps serving while a large
    file is parsed; one that takes longer than ``timeout`` seconds is refused (the thread is
    left to finish on its own). Raises ConfigError."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(load_config, path), timeout)
    except TimeoutError:
        raise ConfigError([("", f"{path}: not read and validated within {timeout:g}s; "
                                f"refused")]) from None
