"""Draws the chart of a `bench_deepspeed.py` result: time blocked, time until durable and load
time per variant, with the bytes on disk in the labels.

    python benchmarks/plot_deepspeed.py results/bench_deepspeed.json results/bench_deepspeed.png

Every bar is the figure docs/BENCHMARKS.md quotes for that variant: the median over the
repetitions, except the time an async save blocks training, which is the median of the saves
after the process's first (the first also pins the host memory later saves reuse, and the table
gives it apart). A synchronous save blocks until it is durable, so its two bars match.

The PNG records which result it was drawn from: the SHA-256 of the JSON file's bytes, in its
"Source" text chunk (`source_of` reads it back without matplotlib; tests/test_docs.py checks
every committed chart against its JSON).

Needs matplotlib (not a dependency of the package).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import zlib
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


def digest(result_json: bytes) -> str:
    """What a chart's "Source" chunk says of the result file it was drawn from."""
    return "sha256:" + hashlib.sha256(result_json).hexdigest()


def source_of(png: Path) -> str | None:
    """The "Source" text chunk of a PNG file (None without one), read chunk by chunk."""
    data = png.read_bytes()
    offset = 8  # the PNG signature
    while offset + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[offset:offset + 8])
        body = data[offset + 8:offset + 8 + length]
        if kind == b"tEXt" and body.startswith(b"Source\0"):
            return body[len(b"Source\0"):].decode("latin-1")
        if kind == b"zTXt" and body.startswith(b"Source\0"):
            return zlib.decompress(body[len(b"Source\0") + 1:]).decode("latin-1")
        offset += 12 + length
    return None


def draw(report: dict[str, Any], png: Path, source: str = "") -> None:
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
    fig.savefig(png, dpi=120, metadata={"Source": source} if source else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("result", type=Path)
    parser.add_argument("png", type=Path)
    args = parser.parse_args(argv)
    data = args.result.read_bytes()
    draw(json.loads(data), args.png, source=digest(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
