"""Type and range checks for config dataclass fields, raising errors that name the field, and the
checks of command-line values (a count of at least one, an output directory).

Config dataclasses call these from `__post_init__`, so a bad value is refused where
the config is built (a config file, `--set`, `run.json`), not steps later.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def _where(obj: Any, name: str) -> str:
    return f"{type(obj).__name__}.{name}"


def check_int(obj: Any, name: str, *, minimum: int | None = None) -> None:
    """`obj.name` is an int (not a bool, float or string) and `>= minimum`.

    Raises:
      TypeError: not an int (the field, value and its type named).
      ValueError: below `minimum`.
    """
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_where(obj, name)} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{_where(obj, name)} must be >= {minimum}, got {value}")


def check_float(obj: Any, name: str, *, minimum: float | None = None, positive: bool = False) -> None:
    """`obj.name` is a finite real number (int or float, not a bool or string), `>= minimum` or `> 0` if `positive`.

    Raises:
      TypeError: not a number (the field, value and its type named).
      ValueError: not finite, or out of range.
    """
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{_where(obj, name)} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{_where(obj, name)} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{_where(obj, name)} must be > 0, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{_where(obj, name)} must be >= {minimum}, got {value}")


def check_bool(obj: Any, name: str) -> None:
    """`obj.name` is a bool (not an int or string).

    Raises:
      TypeError: not a bool (the field, value and its type named).
    """
    value = getattr(obj, name)
    if not isinstance(value, bool):
        raise TypeError(f"{_where(obj, name)} must be a bool, got {value!r} ({type(value).__name__})")


MEMBERS = "members"  # a config field's metadata key: the enum members it accepts where it takes fewer than its enum's


def accepted_members(cls: type, name: str) -> tuple[enum.Enum, ...] | None:
    """The enum members that field `name` of config dataclass `cls` accepts (its `metadata[MEMBERS]`), or None
    where it takes every member of its enum. `check_member` refuses the others, and `--help-config` lists these."""
    return next(f for f in dataclasses.fields(cls) if f.name == name).metadata.get(MEMBERS)


def member_of(kind: type[enum.Enum], value: Any) -> enum.Enum | None:
    """The member of enum `kind` that `value` names: the member itself, its value, or its name in any case
    (`"PALLAS"`, `"pallas"`); None where it names none."""
    for member in kind:
        if value is member or value == member.name or value == member.value or (isinstance(value, str) and value.upper() == member.name):
            return member
    return None


def member_names(members: Iterable[enum.Enum], *, or_none: bool = False) -> str:
    """Enum `members` as `--help-config` and the config errors write them: their names, the spelling `--set` takes,
    joined by ", " ("XLA, PALLAS"); `or_none` adds " or None" for a field that also takes None ("XLA, PALLAS or None")."""
    names = ", ".join(member.name for member in members)
    return f"{names} or None" if or_none else names


def check_member(obj: Any, name: str, refused_because: str) -> None:
    """`obj.name`, a field of a frozen dataclass with `metadata[MEMBERS]`, is None or names one of the members it
    accepts (`accepted_members`), as the member, its value or its name (`member_of`); a value is replaced by its member.

    Raises:
      ValueError: names no member (the field, the accepted members and the value named), or a member the field
        does not accept (named, with `refused_because`: why it takes none but those); members are spelled as
        `--help-config` writes them (`member_names`), e.g. "ModelConfig.norm_implementation must be XLA, PALLAS or
        None, got CUDNN: RMSNorm has no cuDNN implementation".
    """
    value, members = getattr(obj, name), accepted_members(type(obj), name)
    if value is None:
        return
    accepted = f"{_where(obj, name)} must be {member_names(members, or_none=True)}"
    member = member_of(type(members[0]), value)
    if member is None:
        raise ValueError(f"{accepted}, got {value!r}")
    if member not in members:
        raise ValueError(f"{accepted}, got {member.name}: {refused_because}")
    object.__setattr__(obj, name, member)


def write_problem(folder: Path) -> str | None:
    """Why nothing can be created in the existing directory `folder` (read-only, immutable, foreign-owned
    or a pseudo filesystem), e.g. "PermissionError: Permission denied", or None. Probed by creating an
    empty temporary directory there and removing it at once."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gem-write-probe-", dir=folder))
    except OSError as error:
        return f"{type(error).__name__}: {error.strerror or error}"
    return None


def output_directory_problem(path: str, option: str) -> str | None:
    """Why `path`, given as `option` (e.g. "--workdir"), cannot be a directory a command writes into, or None.

    Refused: an empty path (an unset shell variable would name the current directory), a file, a path
    under a file, a symbolic link whose target is missing, and a place where no directory can be created
    (probed with an empty temporary directory, removed at once). A directory, or a path that does not
    exist yet under directories, is fine.
    """
    if not path.strip():
        return f"{option} is empty: name a directory"
    target = Path(path)
    if target.is_symlink() and not target.exists():
        return f"{option} {path}: a symbolic link to a missing target ({target.readlink()})"
    for folder in (target, *target.parents):
        if folder.exists():
            if folder.is_dir():
                problem = write_problem(folder)
                return None if problem is None else f"{option} {path}: nothing can be created in {folder} ({problem})"
            if folder == target:
                return f"{option} {path}: a file of that name exists; it must be a directory (or not exist yet)"
            return f"{option} {path}: {folder} is a file, so no directory can be made under it"
    return None


def positive_int(text: str) -> int:
    """An argparse `type` for an option's count: an int >= 1 (`--stop-after-steps`, `--batch-size`, ...).

    Raises:
      argparse.ArgumentTypeError: not an int, or below 1 (argparse names the option).
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value

