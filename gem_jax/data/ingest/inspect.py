"""`gem-data inspect`: what an event log (raw or converted) holds, and what it means for batches.

`inspect_raw` streams raw inputs under an `EventSchema` (the same checks as a
conversion), partitioning the rows by user into bucket files in a temporary
folder, as a conversion's pass 1 does, then counts the duplicate events bucket
group by bucket group, as its pass 2 does (`convert.count_duplicates`);
`inspect_converted` reads a converted directory's manifest and lengths. Both
return an `InspectReport`, which `format_report` prints: the schema, row / user /
item counts, skipped rows, duplicate events, label rates per task, feature
cardinalities, the sequence-length distribution as a text
histogram (and, with matplotlib, as a figure), and for a global batch size and
a number of GPUs the padding waste, jagged slack and per-GPU imbalance
(`batch_layout.layout_report`).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gem_jax.data.ingest.batch_layout import LayoutReport, layout_report
from gem_jax.data.ingest.convert import (
    DEFAULT_MEMORY_MB, Buckets, bucket_count, bucket_rows, bucket_schema, count_duplicates, max_sorted_events, memory_plan, positive_labels,
)
from gem_jax.data.ingest.manifest import DUPLICATES_NOT_COUNTED, describe_duplicates, read_manifest
from gem_jax.data.ingest.readers import BadRows, Format, event_kinds, expand_inputs, parquet_column_types, prefetched, stream_rows
from gem_jax.data.ingest.schema import EventSchema
from gem_jax.data.ingest.stats import length_summary, text_histogram
from gem_jax.data.ingest.vocab import CountAccumulator
from gem_jax.data.rows import OnBadRow


@dataclasses.dataclass
class InspectReport:
    """What `gem-data inspect` prints.

    Attributes:
      source: the inspected path(s).
      files: `(path, format, {column: type})` per input file (CSV columns are text).
      events, users, items: counts (events after skipped rows).
      skipped: the skipped rows (`readers.BadRows.counts()`).
      duplicate_events: rows equal in every column read to an earlier row (`convert.duplicate_rows`), or None
        for a conversion written before they were counted.
      first_duplicate_event: the first one's `{"file", "location", "copy_of"}` (a manifest's
        `first_duplicate_event`), or None.
      label_rates: task -> share of events labelled 1.
      feature_values: feature -> distinct values.
      time_range: (first, last) time.
      lengths: int64 `[users]`, events per user.
      layout: padding and balance for `batch_size` on `gpus` (None when not asked).
    """

    source: str
    files: list[tuple[str, str, dict[str, str]]]
    events: int
    users: int
    items: int
    skipped: list[dict]
    label_rates: dict[str, float]
    feature_values: dict[str, int]
    time_range: tuple[int, int]
    lengths: np.ndarray
    duplicate_events: int | None
    first_duplicate_event: dict[str, str] | None
    layout: LayoutReport | None = None
    layout_setting: str = ""

    @property
    def summary(self) -> dict:
        return length_summary(self.lengths)


def inspect_raw(
    inputs: Sequence[str | os.PathLike], schema: EventSchema, on_bad_row: OnBadRow = OnBadRow.RAISE, memory_mb: int = DEFAULT_MEMORY_MB,
) -> InspectReport:
    """Counts, duplicate events and lengths of raw inputs, read in one streaming pass into bucket files in a temporary
    folder (`tempfile`: about the size of the columns read, removed on return), whose rows that tie on (user, time)
    are then compared as `gem-data convert` compares them (`convert.count_duplicates`), in bucket groups sized by the
    memory budget `memory_mb` (MiB) as a conversion's.

    Raises:
      BadRowError, DataFormatError: as `convert` does on the same inputs.
      ValueError: `memory_mb` below the smallest budget (`convert.memory_plan`).
    """
    files = expand_inputs(inputs, schema.delimiter)
    kinds = event_kinds(schema)
    block_size, bucket_bytes = memory_plan(memory_mb)
    bad = BadRows(on_bad_row)
    users, items = CountAccumulator(), CountAccumulator()
    features = {f.name: CountAccumulator() for f in schema.event_features}
    positives = np.zeros(len(schema.labels), dtype=np.int64)
    events, low, high = 0, None, None
    numbers = {file: k for k, file in enumerate(files)}
    with tempfile.TemporaryDirectory(prefix="gem-data-inspect-") as scratch:
        buckets = Buckets(Path(scratch) / "buckets", bucket_count(files, bucket_bytes), bucket_schema(schema))
        for file, columns, rows in prefetched(stream_rows(files, kinds, bad, separator=schema.multi_separator, block_size=block_size)):
            n = len(columns[schema.time])
            if not n:
                continue
            events += n
            users.add(columns[schema.user])
            items.add(columns[schema.item])
            for name, counter in features.items():
                counter.add(columns[name])
            table = bucket_rows(schema, columns, rows, numbers[file])
            positives += positive_labels(table, schema)
            buckets.write(table)
            times = columns[schema.time]
            low = int(times.min()) if low is None else min(low, int(times.min()))
            high = int(times.max()) if high is None else max(high, int(times.max()))
        buckets.close()
        duplicates = count_duplicates(buckets, max_sorted_events(bucket_bytes))
    described = []
    for file in files:
        types = parquet_column_types(file, list(kinds)) if file.format is Format.PARQUET else {c: "text" for c in kinds}
        described.append((str(file), file.format.value, types))
    return InspectReport(
        source=", ".join(map(str, inputs)),
        files=described,
        events=events,
        users=users.table().num_rows,
        items=items.table().num_rows,
        skipped=bad.counts(),
        label_rates={rule.name: float(positives[k] / events) if events else 0.0 for k, rule in enumerate(schema.labels)},
        feature_values={name: counter.table().num_rows for name, counter in features.items()},
        time_range=(low or 0, high or 0),
        lengths=np.sort(users.table()["count"].to_numpy())[::-1].copy(),
        duplicate_events=duplicates.count,
        first_duplicate_event=duplicates.first(files),
    )


def inspect_converted(directory: str | os.PathLike) -> InspectReport:
    """The report of a converted directory, from its manifest and `lengths.npz` (no record read)."""
    manifest = read_manifest(directory)
    with np.load(Path(directory) / manifest["lengths"]) as saved:
        lengths = np.concatenate([saved[name] for name in saved.files]).astype(np.int64)
    counts = manifest["counts"]
    return InspectReport(
        source=str(directory),
        files=[(entry["path"], "input", {}) for entry in manifest["inputs"]],
        events=counts["events"],
        users=counts["users"],
        items=counts["items"],
        skipped=manifest["skipped_rows"],
        label_rates={task["name"]: task["positive_rate"] for task in manifest["tasks"]},
        feature_values={f["name"]: manifest["vocabularies"][f["vocab"].removeprefix("vocab/").removesuffix(".csv")]["ids"] for f in manifest["features"]},
        time_range=tuple(manifest["time_range"]),
        lengths=lengths,
        duplicate_events=counts.get("duplicate_events"),  # absent from a conversion written before they were counted
        first_duplicate_event=manifest.get("first_duplicate_event"),
    )


def add_layout(report: InspectReport, batch_size: int, gpus: int, max_seq_len: int | None = None, *, where: str = "add_layout") -> None:
    """Fills `report.layout` for global batches of `batch_size` on `gpus` GPUs (`layout_report`; `where`
    names the settings in its errors, e.g. the command line's options)."""
    report.layout = layout_report(report.lengths, batch_size, gpus, max_seq_len, where=where)
    report.layout_setting = f"batch {batch_size} on {gpus} GPU(s), histories up to {max_seq_len or int(report.lengths.max())} events"


def format_report(report: InspectReport) -> str:
    """The report as the text `gem-data inspect` prints."""
    summary = report.summary
    lines = [f"inspected: {report.source}"]
    for path, fmt, types in report.files:
        lines.append(f"  {path} ({fmt})" + (": " + ", ".join(f"{c} {t}" for c, t in types.items()) if types else ""))
    lines.append(f"events {report.events}, users {report.users}, items {report.items}, time {report.time_range[0]} .. {report.time_range[1]}")
    for entry in report.skipped:
        lines.append(f"  skipped {entry['count']} row(s) of {entry['file']}: {entry['kind']} (first: {entry['first']})")
    lines.append(_duplicates_line(report))
    for task, rate in report.label_rates.items():
        lines.append(f"task {task}: {rate:.2%} positive")
    for name, values in report.feature_values.items():
        lines.append(f"feature {name}: {values} distinct values")
    q = summary["quantiles"]
    lines.append(
        f"events per user: mean {summary['mean']:.1f}, std {summary['std']:.1f}, min {summary['min']}, "
        f"p50 {q.get('p50', 0):g}, p90 {q.get('p90', 0):g}, p99 {q.get('p99', 0):g}, max {summary['max']}"
    )
    lines.append(text_histogram(summary))
    if report.layout is not None:
        layout = report.layout
        lines.append(f"layout, {report.layout_setting} (mean of {layout.batches} random batches, one sample per user):")
        lines.append(f"  padded to max_seq_len: {layout.padded_waste:.1%} of token slots are padding")
        lines.append(f"  padded to each batch's longest: {layout.padded_to_longest_waste:.1%}")
        lines.append(f"  jagged with token capacities (TokenBuckets): {layout.jagged_slack:.1%} slack")
        lines.append(f"  per-GPU imbalance (max/mean - 1 of attention+MLP FLOPs): {layout.imbalance:.1%} without BBS, {layout.imbalance_bbs:.1%} with BBS")
    return "\n".join(lines)


def _duplicates_line(report: InspectReport) -> str:
    """The report's line on duplicate events: their count and the first's place, or that they were not counted."""
    if report.duplicate_events is None:
        return DUPLICATES_NOT_COUNTED
    if report.duplicate_events == 0:
        return "duplicate events 0"
    return f"duplicate events {report.duplicate_events}: {describe_duplicates(report.first_duplicate_event)}"


def save_figure(report: InspectReport, path: str | os.PathLike) -> bool:
    """Draws the sequence-length histogram to `path`; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    summary = report.summary
    edges, counts = summary["histogram"]["edges"], summary["histogram"]["counts"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(range(len(counts)), counts, color="#4477aa")
    ax.set_xticks(range(len(counts)), [f"{lo}" if hi == lo + 1 else f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])], rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("events per user")
    ax.set_ylabel("users")
    ax.set_title(f"{report.users} users, {report.events} events (mean {summary['mean']:.1f}, max {summary['max']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
