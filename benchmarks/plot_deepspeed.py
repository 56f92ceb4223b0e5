"""Draws the chart of a `bench_deepspeed.py` result: time blocked, time until durable and load
time per variant, with the bytes on disk in the labels.

    python benchmarks/plot_deepspeed.py results/bench_deepspeed.json results/bench_deepspeed.png

Needs matplotlib (not a dependency of the package).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("result", type=Path)
    parser.add_argument("png", type=Path)
    args = parser.parse_args(argv)
    report = json.loads(args.result.read_text())
    results = report["results"]
    names = [f"{r['variant']}\n{r['bytes'] / 1e9:.1f} GB" for r in results]
    # A process's first save also pins its host buffers; with repetitions, show the later saves.
    for r in results:
        r["blocked_shown_s"] = r.get("blocked_s_later", r["blocked_s"])
    later = any("blocked_s_later" in r for r in results)
    metrics = (("blocked_shown_s", "training blocked" + (" (saves after the first)" if later else "")),
               ("durable_s", "until durable"), ("load_s", "load (cold cache)"))
    width = 0.27
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for k, (key, label) in enumerate(metrics):
        xs = [i + (k - 1) * width for i in range(len(results))]
        bars = ax.bar(xs, [r[key] for r in results], width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(results)), names)
    ax.set_ylabel("seconds")
    params = report.get("params", 0) / 1e9
    setup = "ZeRO-1 bf16" + (" + ZeRO-Offload" if report.get("offload") else "")
    ax.set_title(f"DeepSpeed {setup}, {params:.2f}B params, {report.get('device', '')}: "
                 "default engine vs nvcomp_ckpt_engine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
