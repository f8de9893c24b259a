"""Configs as plain trees: JSON for the workdir, typed command-line overrides, field diffs.

A config is a tree of frozen dataclasses (`TrainConfig` and its parts) whose leaves are
ints, floats, strings, bools, enums, None and tuples. `to_tree` turns it into JSON-able
dicts and lists (enums by name), `from_tree` rebuilds it from the dataclass field types,
`apply_overrides` replaces fields named by dotted paths (`model.embed_dim=128`) with
values parsed to the field's declared type, `diff` names the leaves two trees
disagree on, and `override_help` lists every leaf with its type, default and the
meaning its class's docstring gives it (`attribute_docs`).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gem_jax.checks import accepted_members, member_names, member_of


class ConfigError(ValueError):
    """A config field that does not exist, or a value that does not fit its field's type."""


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def to_tree(obj: Any) -> Any:
    """A config (or any part of it) as JSON-able dicts, lists and scalars; enums by name.

    Values that are not config data (a callable workload, say) become their `repr`.
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_tree(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, enum.Enum):
        return obj.name
    if isinstance(obj, (tuple, list)):
        return [to_tree(x) for x in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_tree(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)


def _decode(tp: Any, value: Any, where: str, members: Sequence[enum.Enum] = ()) -> Any:
    """`value` (a JSON-able tree or a Python literal) as an instance of type `tp`; `members`: the enum members the
    field accepts (`_members`), named when a value is none of them (empty: every member of its enum)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _decode(option, value, where, members)
            except ConfigError:
                continue
        enums = [a for a in options if isinstance(a, type) and issubclass(a, enum.Enum)]
        if len(enums) == 1 and set(options) == {enums[0], type(None)}:  # an optional enum: name what it takes
            raise ConfigError(f"{where}: expected {member_names(members or tuple(enums[0]), or_none=True)}, got {value!r}")
        raise ConfigError(f"{where}: {value!r} fits none of {_type_name(tp)}")
    if origin is tuple or tp is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a sequence for {_type_name(tp)}, got {value!r}")
        args = typing.get_args(tp)
        if not args:
            return tuple(value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]", members) for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{where}: expected {len(args)} items for {_type_name(tp)}, got {len(value)}")
        return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is not None and origin in (Callable, typing.get_origin(Callable[[], None])):
        if callable(value):
            return value
        raise ConfigError(f"{where}: a callable cannot be given as {value!r}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        member = member_of(tp, value)
        if member is None:
            raise ConfigError(f"{where}: {value!r} is not a {tp.__name__} (one of {member_names(members or tuple(tp))})")
        return member
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if value == tp.__name__:  # `--set data.bbs=BBSConfig`: the defaults
            return tp()
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {value!r}")
        return from_tree(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where}: expected a bool, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and value.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
            return float(value)  # a float, if not a finite one: the field's own check names that
        raise ConfigError(f"{where}: expected a float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{where}: cannot read {value!r} as {_type_name(tp)}")


def _type_name(tp: Any) -> str:
    """`int`, `Source`, `BBSConfig | None`, `tuple[float, ...]`: short names, no module paths."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        inner = f"{_type_name(args[0])}, ..." if len(args) == 2 and args[1] is Ellipsis else ", ".join(map(_type_name, args))
        return f"tuple[{inner}]"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def from_tree(cls: type, tree: Mapping[str, Any], where: str = "") -> Any:
    """Rebuilds dataclass `cls` from `to_tree`'s output (missing fields keep their defaults).

    Raises:
      ConfigError: an unknown field, or a value that does not fit its field's type
        (the dotted path is named).
    """
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(tree) - names)
    if unknown:
        raise ConfigError(f"{where or cls.__name__}: unknown field(s) {unknown}; {cls.__name__} has {sorted(names)}")
    kwargs = {k: _decode(hints[k], v, f"{where}.{k}" if where else k, _members(cls, k, hints[k])) for k, v in tree.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{where or cls.__name__}: {error}") from error


def _parse_literal(text: str) -> Any:
    """A command-line value: a Python literal (`128`, `1e-3`, `(1, 2)`, `None`, `'x'`) or a bare word."""
    lowered = text.strip()
    if lowered.lower() in ("true", "false"):
        return lowered.lower() == "true"
    if lowered.lower() in ("none", "null"):
        return None
    try:
        return ast.literal_eval(lowered)
    except (ValueError, SyntaxError):
        return lowered


def apply_overrides(config: Any, overrides: Iterable[str]) -> Any:
    """`config` with the fields named by `path=value` strings replaced.

    `path` is dotted (`loop.num_steps`, `data.synthetic.num_items`); the value is parsed
    to the declared type of that field (enum members by name, `None` where allowed,
    tuples as `(1, 2)` or `1,2`, a variable-length tuple of one item also as the bare item).
    All overrides of one dataclass are applied together and it is checked once, so fields
    that must agree change together (`model.embed_dim=18 model.num_heads=3`); a later value
    of a field replaces an earlier one.

    Raises:
      ConfigError: a malformed override, an unknown field (the valid names are listed),
        a value of the wrong type, or a config the overrides make invalid, each naming
        the overrides.
    """
    items = []
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"override {override!r} is not of the form path=value (e.g. loop.num_steps=10)")
        path, text = override.split("=", 1)
        items.append((path.strip().split("."), _parse_literal(text), override))
    return _replace_fields(config, items) if items else config


def _replace_fields(obj: Any, items: Sequence[tuple[Sequence[str], Any, str]]) -> Any:
    """`obj` with every `(keys, value, override)` of `items` applied, in one `dataclasses.replace`."""
    if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        raise ConfigError(f"override {items[0][2]!r}: {type(obj).__name__} has no fields to set")
    names = [f.name for f in dataclasses.fields(obj) if f.init]
    types_ = _field_types(type(obj))
    changes: dict[str, Any] = {}
    nested: dict[str, list] = {}
    for keys, value, override in items:
        key = keys[0]
        if key not in names:
            raise ConfigError(f"override {override!r}: {type(obj).__name__} has no field {key!r}; fields: {', '.join(names)}")
        if len(keys) > 1:
            nested.setdefault(key, []).append((keys[1:], value, override))
            continue
        nested.pop(key, None)  # a whole value given later replaces the earlier overrides inside it
        changes[key] = _decode_field(types_[key], value, override, _members(type(obj), key, types_[key]))
    for key, inner_items in nested.items():
        inner = changes.get(key, getattr(obj, key))
        if inner is None:  # an optional part that is off: `data.bbs.minibatch_size=64` turns it on with its defaults
            inner = _default_of(types_[key], inner_items[0][2])
        changes[key] = _replace_fields(inner, inner_items)
    try:
        return dataclasses.replace(obj, **changes)
    except (TypeError, ValueError) as error:
        named = ", ".join(repr(override) for _, _, override in items)
        raise ConfigError(f"{'override' if len(items) == 1 else 'overrides'} {named}: {error}") from error


def _decode_field(tp: Any, value: Any, override: str, members: Sequence[enum.Enum]) -> Any:
    """`value` as the field type `tp` (tuples from `1,2` or a bare item), naming `override` on error; `members`:
    the enum members the field accepts (`_members`)."""
    if typing.get_origin(tp) is tuple or tp is tuple:
        if isinstance(value, str) and "," in value:
            value = tuple(_parse_literal(v) for v in value.split(","))
        elif not isinstance(value, (tuple, list)) and typing.get_args(tp)[1:] == (Ellipsis,):
            value = (value,)  # a variable-length tuple: one bare item is a 1-tuple
    try:
        return _decode(tp, value, override.split("=", 1)[0], members)
    except ConfigError as error:
        raise ConfigError(f"override {override!r}: {error}") from None


def _default_of(tp: Any, override: str) -> Any:
    """The default instance of the dataclass in an optional field's type."""
    options = typing.get_args(tp) if typing.get_origin(tp) in (types.UnionType, typing.Union) else (tp,)
    for option in options:
        if isinstance(option, type) and dataclasses.is_dataclass(option):
            return option()
    raise ConfigError(f"override {override!r}: {_type_name(tp)} has no fields to set")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a `to_tree` tree by dotted path (lists are leaves)."""
    if isinstance(tree, Mapping):
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def diff(old: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """`(path, old value, new value)` for every leaf where two `to_tree` trees differ, sorted by path."""
    a, b = flatten(old), flatten(new)
    missing = object()
    rows = []
    for path in sorted(set(a) | set(b)):
        x, y = a.get(path, missing), b.get(path, missing)
        if x != y:
            rows.append((path, None if x is missing else x, None if y is missing else y))
    return rows


_ENTRY = re.compile(r"([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*:(?:\s+(.*))?$")


def attribute_docs(doc: str | None) -> dict[str, str]:
    """The `Attributes:` section of a Google-style docstring: each field's text, on one line.

    An entry is `name: text` one level under the header, its continuation lines indented
    deeper; `a, b: text` gives both fields the text. The section ends at the first line
    indented no deeper than its header (the next section, e.g. `Raises:`). A docstring
    without the section gives {}.
    """
    lines = inspect.cleandoc(doc or "").splitlines()
    header = next((i for i, line in enumerate(lines) if line.strip() == "Attributes:"), None)
    if header is None:
        return {}
    header_indent = len(lines[header]) - len(lines[header].lstrip())
    entries: dict[str, list[str]] = {}
    entry_indent, names = None, ()
    for line in lines[header + 1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= header_indent:
            break
        entry = _ENTRY.match(line.strip())
        if entry_indent is None:
            entry_indent = indent
        if indent <= entry_indent and entry:
            names = tuple(name.strip() for name in entry.group(1).split(","))
            for name in names:
                entries[name] = [entry.group(2) or ""]
        else:  # a continuation line (or text before the first entry, which names no field)
            for name in names:
                entries[name].append(line.strip())
    return {name: " ".join(part for part in parts if part) for name, parts in entries.items()}


def override_help(cls: type, prefix: str = "", width: int | None = None) -> list[str]:
    """Every overridable leaf of dataclass `cls`: a `path: type = default` line (an enum's members
    after it), then what the field means, its entry in the `Attributes:` section of its class's
    docstring, indented by four and wrapped to `width` columns (None: on one line). An optional
    group's fields follow its own line; a callable field, which `--set` cannot take, is left out."""
    lines = []
    hints = _field_types(cls)
    meanings = attribute_docs(cls.__doc__)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            lines += override_help(tp, path, width)
            continue
        if any(typing.get_origin(a) is Callable for a in (tp, *typing.get_args(tp))):
            continue  # set in a config file: --set takes no Python callable
        line = f"{path}: {_type_name(tp)}"
        if f.default is not dataclasses.MISSING:
            line += f" = {to_tree(f.default)!r}"
        choices = _members(cls, f.name, tp)
        lines.append(f"{line}  (one of {member_names(choices)})" if choices else line)
        meaning = meanings.get(f.name) or f"(undocumented: {cls.__name__}'s docstring has no entry for {f.name})"
        lines += textwrap.wrap(meaning, width, initial_indent="    ", subsequent_indent="    ", break_long_words=False, break_on_hyphens=False) if width else [f"    {meaning}"]
        if (group := _optional_group(tp)) is not None:  # off by default; `--set path.field=...` turns it on
            lines += override_help(group, path, width)
    return lines


def _members(cls: type, name: str, tp: Any) -> Sequence[enum.Enum]:
    """The enum members field `name` of dataclass `cls` (of type `tp`) accepts: those its metadata names
    (`checks.accepted_members`), else every member of the enums in its type; () for a field of no enum."""
    enums = (a for a in (tp, *typing.get_args(tp)) if isinstance(a, type) and issubclass(a, enum.Enum))
    return accepted_members(cls, name) or tuple(member for a in enums for member in a)


def _optional_group(tp: Any) -> type | None:
    """The dataclass of an optional group of settings (`BBSConfig | None`), else None."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and isinstance(inner[0], type) and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None
