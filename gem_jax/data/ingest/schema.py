"""The generic event schema: which columns of a user's event log mean what.

An event log is a table with one row per event: a user id, an item id, a
timestamp, optionally an event type (action), one or more labels (each a
task), optionally a per-event weight, and categorical side features of the item
and of the user. Side features come either from the event rows themselves or
from separate item / user tables joined by id. `EventSchema` says which column
is which; `gem-data` builds it from its flags and saves it in the manifest
(`to_json` / `from_json`).

Flag syntax (`gem-data convert --help`):

- `--label click`: the column's values must be 0 or 1 (or true/false).
- `--label like=rating>=4`: task `like` is 1 where `rating >= 4`, else 0; the
  operators are `>=`, `>`, `<=`, `<`, `==`, `!=` against a number. A rule
  needs its `name=`; task and feature names are letters, digits and `_` (they
  name metrics, `auc_like`, and parameters).
- `--item-feature category` (one value per row) or `--item-feature tags:multi`
  (several values per row, split at `--multi-separator`, default `|`); the
  same for `--user-feature`.
- `--item-table items.parquet --item-key item_id`: item features come from this
  table instead of the event rows (the same for users).
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import re
from typing import Any

from gem_jax.batch import NAME_PATTERN

_OPERATORS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">": operator.gt, "<": operator.lt}
_RULE = re.compile(r"^\s*([^<>=!]+?)\s*(>=|<=|==|!=|>|<)\s*([^<>=!\s]+)\s*$")


class SchemaError(ValueError):
    """A flag or a saved schema that does not describe a valid event schema."""


def _task_name(name: str, text: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise SchemaError(f"--label {text!r}: the task name {name!r} must be letters, digits and '_' (it names metrics: auc_<task>); e.g. --label like=rating>=4")
    return name


class Side(enum.Enum):
    """Whose feature a categorical column is."""

    USER = "user"
    ITEM = "item"


@dataclasses.dataclass(frozen=True)
class LabelRule:
    """One task's label: a 0/1 column, or `column op threshold`.

    Attributes:
      name: the task name.
      column: the column read.
      op: None for a 0/1 column, else one of `>=`, `>`, `<=`, `<`, `==`, `!=`.
      threshold: the number compared against (with `op`).
    """

    name: str
    column: str
    op: str | None = None
    threshold: float | None = None

    def __post_init__(self):
        if not self.name or not self.column:
            raise SchemaError(f"label {self!r}: name and column must be non-empty")
        if (self.op is None) != (self.threshold is None) or (self.op is not None and self.op not in _OPERATORS):
            raise SchemaError(f"label {self.name!r}: op must be one of {sorted(_OPERATORS)} with a threshold, or both None")

    @classmethod
    def parse(cls, text: str) -> LabelRule:
        """`click`, `like=rating>=4` or `yes=click` (see the module docstring).

        Raises:
          SchemaError: text that is none of these, a threshold that is not a number, a
            rule without a name, a name other than letters, digits and `_`.
        """
        name, _, rule = text.partition("=") if re.match(r"^[^<>=!]+=[^=]", text) else ("", "", text)
        match = _RULE.match(rule)
        if match is None:
            if not re.match(r"^[^<>=!\s]+$", rule.strip()):
                raise SchemaError(f"--label {text!r}: expected a column (click) or name=rule (like=rating>=4)")
            return cls(name=_task_name(name.strip() or rule.strip(), text), column=rule.strip())
        column, op, value = match.groups()
        try:
            threshold = float(value)
        except ValueError:
            raise SchemaError(f"--label {text!r}: the threshold {value!r} is not a number") from None
        if not name.strip():
            raise SchemaError(f"--label {text!r}: name the rule's task (letters, digits and '_'), e.g. --label like={rule.strip()}")
        return cls(name=_task_name(name.strip(), text), column=column, op=op, threshold=threshold)

    def describe(self) -> str:
        return self.column if self.op is None else f"{self.column}{self.op}{self.threshold:g}"


@dataclasses.dataclass(frozen=True)
class FeatureColumn:
    """One categorical side feature.

    Attributes:
      name: the column (also the feature's name).
      side: `Side.USER` or `Side.ITEM`.
      multi: True when a row holds several values separated by the schema's
        `multi_separator` (e.g. `drama|comedy`).
    """

    name: str
    side: Side
    multi: bool = False

    @classmethod
    def parse(cls, text: str, side: Side) -> FeatureColumn:
        """`category` or `tags:multi`.

        Raises:
          SchemaError: an empty name or a suffix other than `:multi`.
        """
        name, _, kind = text.partition(":")
        if not name or kind not in ("", "multi"):
            raise SchemaError(f"--{side.value}-feature {text!r}: expected COLUMN or COLUMN:multi")
        if not NAME_PATTERN.fullmatch(name):
            raise SchemaError(f"--{side.value}-feature {text!r}: the feature's name is its column's, which must be letters, digits and '_' (rename the column)")
        return cls(name=name, side=side, multi=kind == "multi")


@dataclasses.dataclass(frozen=True)
class EventSchema:
    """Which columns of the event log (and of the side tables) mean what.

    Attributes:
      user, item, time: the user id, item id and timestamp columns. Ids are
        read as strings (integer ids too: `42` and `"42"` are the same id).
        Times are integers (taken as they are, e.g. Unix seconds) or ISO 8601
        dates / date-times (`2024-01-31`, `2024-01-31T12:00:00`, optionally
        ending in `Z`; read as UTC and stored as Unix seconds), or Parquet
        timestamp / date columns (stored as Unix seconds).
      labels: the tasks (a conversion needs at least one).
      action: the event-type column, or None.
      weight: the per-event weight column (finite, >= 0), or None.
      features: the categorical side features, user and item.
      item_table, user_table: a file (or directory / glob) holding the item /
        user features, or None to read them from the event rows.
      item_key, user_key: the id column of those tables (default: the
        `item` / `user` column name).
      delimiter: the CSV field delimiter (`\\t` for TSV; `.tsv` files
        default to a tab).
      multi_separator: separates the values of a multi-valued feature.
    """

    user: str
    item: str
    time: str
    labels: tuple[LabelRule, ...]
    action: str | None = None
    weight: str | None = None
    features: tuple[FeatureColumn, ...] = ()
    item_table: str | None = None
    user_table: str | None = None
    item_key: str | None = None
    user_key: str | None = None
    delimiter: str = ","
    multi_separator: str = "|"

    def __post_init__(self):
        names = [rule.name for rule in self.labels]
        if len(set(names)) != len(names):
            raise SchemaError(f"task names must differ, got {names}")
        features = [f.name for f in self.features]
        if len(set(features)) != len(features):
            raise SchemaError(f"a feature column may appear once, got {features}")
        for name in ("user", "item", "time"):
            if not getattr(self, name):
                raise SchemaError(f"--{name} must name a column")
        if len(self.delimiter) != 1 or not self.multi_separator:
            raise SchemaError(f"the delimiter must be one character and the separator non-empty, got {self.delimiter!r}, {self.multi_separator!r}")

    @property
    def task_names(self) -> tuple[str, ...]:
        return tuple(rule.name for rule in self.labels)

    def side_features(self, side: Side) -> tuple[FeatureColumn, ...]:
        return tuple(f for f in self.features if f.side is side)

    @property
    def event_features(self) -> tuple[FeatureColumn, ...]:
        """The features read from the event rows: those of a side without a side table."""
        return tuple(f for f in self.features if self.table(f.side) is None)

    def table(self, side: Side) -> str | None:
        return self.item_table if side is Side.ITEM else self.user_table

    def key(self, side: Side) -> str:
        """The id column of `side`'s side table."""
        if side is Side.ITEM:
            return self.item_key or self.item
        return self.user_key or self.user

    def event_columns(self) -> tuple[str, ...]:
        """The columns the event rows must have, each once, in a fixed order."""
        columns = [self.user, self.item, self.time]
        columns += [c for c in (self.action, self.weight) if c]
        columns += [rule.column for rule in self.labels]
        columns += [f.name for f in self.event_features]
        return tuple(dict.fromkeys(columns))

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["labels"] = [dataclasses.asdict(rule) for rule in self.labels]
        data["features"] = [{"name": f.name, "side": f.side.value, "multi": f.multi} for f in self.features]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EventSchema:
        data = dict(data)
        data["labels"] = tuple(LabelRule(**rule) for rule in data["labels"])
        data["features"] = tuple(FeatureColumn(f["name"], Side(f["side"]), f["multi"]) for f in data["features"])
        return cls(**data)


def label_values(rule: LabelRule, values):
    """0/1 of `rule` on float64 `values` (numpy), as a bool array; for a 0/1 column, `values != 0`."""
    if rule.op is None:
        return values != 0
    return _OPERATORS[rule.op](values, rule.threshold)
