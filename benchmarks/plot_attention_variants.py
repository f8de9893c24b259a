"""Attention variants' forward+backward device time, split forward / the rest, from the records.

Each `LABEL=PATH[:KEY]` is an `attention_variants_bench.py` record: the file itself or, with KEY, the
record under that top-level key of the file. Each (record, variant) is one bar of `timing[variant]
.device_ms` (forward+backward), stacked as `forward_ms` and the rest; a variant timed without
`forward_ms` is one hatched bar. The records name their GPU, which titles the figure: times and their
ratios compare only within one GPU call (one record, or the records one file holds from one call).

    python benchmarks/plot_attention_variants.py \\
        "one warpgroup per CTA=benchmarks/results/block_local_two_in_flight_h100_20261206.json:main" \\
        "two steps in flight=benchmarks/results/block_local_two_in_flight_h100_20261206.json:two_in_flight" \\
        --variants block_local_pallas full_jfa_pallas --out benchmarks/figures/block_local_h100_20261206.png
    python benchmarks/plot_attention_variants.py \\
        "before (CUDA sinf/cosf tables)=benchmarks/results/block_local_bounded_trig_h100_20261206.json:before" \\
        "bounded_trig tables=benchmarks/results/block_local_bounded_trig_h100_20261206.json:bounded" \\
        --variants block_local_pallas full_jfa_pallas --out benchmarks/figures/block_local_bounded_trig_h100_20261206.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(spec: str) -> tuple[str, str, dict]:
    """`LABEL=PATH[:KEY]` -> (label, source, record); source names the file (and key) in errors."""
    label, _, rest = spec.partition("=")
    path, sep, key = rest.rpartition(":")
    path, key = (path, key) if sep else (rest, None)
    if not label or not path:
        raise ValueError(f"{spec!r}: expected LABEL=PATH[:KEY]")
    data = json.loads(Path(path).read_text())
    if key is None:
        return label, path, data
    if key not in data:
        raise ValueError(f"{path}: no top-level key {key!r} (keys: {sorted(data)})")
    return label, f"{path}:{key}", data[key]


def bars(record: dict, source: str, variants=None) -> list[tuple[str, float, float | None]]:
    """`[(variant, device_ms, forward_ms or None)]` of one record, in `variants` order (default: all timed).

    Raises:
      ValueError: the record has no "timing", or a requested variant has no numeric device_ms there.
    """
    if not isinstance(record.get("timing"), dict):
        raise ValueError(f"{source}: no 'timing' in the record (not an attention_variants_bench record?)")
    timing = record["timing"]
    timed = [name for name, entry in timing.items() if isinstance(entry.get("device_ms"), (int, float))]
    for name in variants or ():
        if name not in timed:
            why = timing[name].get("skipped", "no device_ms") if name in timing else "absent"
            raise ValueError(f"{source}: variant {name!r} not timed ({why}); timed: {timed}")
    return [(name, timing[name]["device_ms"], timing[name].get("forward_ms")) for name in variants or timed]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", help="LABEL=PATH[:KEY]: a label and a record")
    parser.add_argument("--variants", nargs="+", help="timing entries to draw (default: all timed)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows, devices = [], []
    for spec in args.records:
        label, source, record = read(spec)
        device = record.get("device", "unknown device")
        devices += [] if device in devices else [device]
        rows += [(f"{name}\n({label})", total, fwd) for name, total, fwd in bars(record, source, args.variants)]
    if not rows:
        parser.error("no timed variants in the records")
    fig, ax = plt.subplots(figsize=(8.0, 1.0 + 0.7 * len(rows)))
    for y, (_, total, fwd) in enumerate(rows):
        if fwd is None:
            ax.barh(y, total, color="lightgray", hatch="//", edgecolor="gray",
                    label="forward+backward (forward not timed)")
        else:
            ax.barh(y, fwd, color="tab:blue", label="forward")
            ax.barh(y, total - fwd, left=fwd, color="tab:orange", label="backward (device_ms - forward_ms)")
        ax.text(total, y, f" {total:.3f} ms", va="center", fontsize=8)
    handles = dict(zip(*reversed(ax.get_legend_handles_labels())))
    ax.legend(handles.values(), handles.keys(), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    ax.set_yticks(range(len(rows)), [name for name, _, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.2 * max(total for _, total, _ in rows))
    ax.set_xlabel("device time, forward+backward (ms); compare only bars of one GPU call")
    ax.set_title(f"Attention variants on {', '.join(devices)}", fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
