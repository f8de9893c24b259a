"""GDPA forwards against their peers: peer device time over ours, per case and card, from the records.

Bars above 1 mean ours is faster. Each `LABEL=PATH` is a `gdpa_bench.py` record (cross and pooled
against cuDNN softmax: `cases[i].cudnn_softmax.fwd_device_ms / cases[i].pallas.fwd_device_ms`) or an
`hstu_bench.py` record (causal SiLU against HSTU's Triton kernel: `hstu.fwd.kernel_ms /
ours.fwd.device_ms`); cases a record skipped are left out. The records name their GPU, which labels
the bars: ratios compare only within one run.

    python benchmarks/plot_gdpa_peers.py \\
        "H200=benchmarks/results/gdpa_h200_silu_tanh_output_scale_5669e21_20261205.json" \\
        "H100=benchmarks/results/gdpa_h100_silu_tanh_output_scale_5669e21_20261205.json" \\
        "H200, 12-05=benchmarks/results/hstu_h200_silu_tanh_output_scale_5669e21_20261205.json" \\
        "H100, 12-06=benchmarks/results/hstu_h100_grouped_0e91284_20261206.json" \\
        --out benchmarks/figures/gdpa_peers.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GDPA_SHAPES = ("cross", "pooled")  # the shapes with a >= 1.0x cuDNN target


def ratios(record: dict) -> dict[str, float]:
    """`{case: peer device time / ours}` of one gdpa_bench or hstu_bench record.

    Raises:
      ValueError: a record of neither benchmark.
    """
    if record.get("benchmark") == "hstu_bench":
        return {
            f"causal SiLU\n{name}\nvs HSTU": case["hstu"]["fwd"]["kernel_ms"] / case["ours"]["fwd"]["device_ms"]
            for name, case in record["cases"].items()
            if "ours" in case and "hstu" in case
        }
    if record.get("benchmark") == "gdpa":
        return {
            f"GELU\n{case['shape']}\nvs cuDNN": case["cudnn_softmax"]["fwd_device_ms"] / case["pallas"]["fwd_device_ms"]
            for case in record["cases"]
            if case.get("shape") in GDPA_SHAPES
        }
    raise ValueError(f"not a gdpa_bench or hstu_bench record (benchmark={record.get('benchmark')!r})")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", help="LABEL=PATH: the card's label and a record")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    bars: list[tuple[str, float]] = []
    for spec in args.records:
        label, _, path = spec.partition("=")
        if not path:
            parser.error(f"{spec!r}: expected LABEL=PATH")
        bars += [(f"{case}\n({label})", value) for case, value in ratios(json.loads(Path(path).read_text())).items()]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(bars)), 4.0))
    names, values = zip(*bars)
    ax.bar(range(len(bars)), values, color=["tab:green" if v >= 1.0 else "tab:orange" for v in values])
    for x, v in enumerate(values):
        ax.text(x, v + 0.02, f"{v:.2f}x", ha="center", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(bars)), names, fontsize=8)
    ax.set_ylabel("peer device time / ours (> 1: ours faster)")
    ax.set_title("GDPA forward against its peers (same run per bar)")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
