"""Draws the chart of a `bench_deepspeed.py` result: time blocked, time until durable and load
time per variant, with the bytes on disk in the labels.

    python benchmarks/plot_deepspeed.py results/bench_deepspeed.json results/bench_deepspeed.png

Every bar is the figure docs/BENCHMARKS.md quotes for that variant: the median over the
repetitions, except the time an async save blocks training, which is the median of the saves
after the process's first (the first also pins the host memory later saves reuse, and the table
gives it apart). A synchronous save blocks until it is durable, so its two bars match.

Needs matplotlib (not a dependency of the package).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: The legend labels of each variant's bars, in `bar_values` order.
LABELS = ("training blocked", "until durable", "load (cold cache)")


def is_async(result: dict[str, Any]) -> bool:
    """The benchmark's naming rule for variants that save in the background."""
    return "-async" in result["variant"]


def bar_values(result: dict[str, Any]) -> tuple[float, float, float]:
    """One variant's bars, in `LABELS` order (seconds)."""
    blocked = result.get("blocked_s_later", result["blocked_s"]) if is_async(result) else (
        result["blocked_s"])
    return blocked, result["durable_s"], result["load_s"]


def draw(report: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    names = [f"{r['variant']}\n{r['bytes'] / 1e9:.1f} GB" for r in results]
    width = 0.27
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = list(LABELS)
    if any(is_async(r) for r in results):
        labels[0] += " (async: saves after the first)"
    for k, label in enumerate(labels):
        xs = [i + (k - 1) * width for i in range(len(results))]
        bars = ax.bar(xs, [bar_values(r)[k] for r in results], width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(results)), names)
    ax.set_ylabel("seconds")
    params = report.get("params", 0) / 1e9
    setup = "ZeRO-1 bf16" + (" + ZeRO-Offload" if report.get("offload") else "")
    ax.set_title(f"DeepSpeed {setup}, {params:.2f}B params, {report.get('device', '')}: "
                 "default engine vs nvcomp_ckpt_engine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("result", type=Path)
    parser.add_argument("png", type=Path)
    args = parser.parse_args(argv)
    draw(json.loads(args.result.read_text()), args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
