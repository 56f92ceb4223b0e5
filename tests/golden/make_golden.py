"""Regenerates the golden shard files of format version 1.

Run only on a deliberate format change (then bump FORMAT_VERSION and keep the old files):
    python tests/golden/make_golden.py
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch

import nvcomp_ckpt_engine as nce

HERE = Path(__file__).parent
ALGORITHMS = ("zstd", "deflate", "none")


def golden_state() -> dict:
    """A small state with every feature the format has: dtypes, views, sharing, nesting."""
    gen = torch.Generator().manual_seed(1234)
    weights = torch.randn(64, 16, generator=gen)
    return {
        "module": collections.OrderedDict(
            weight=weights.bfloat16(),
            bias=torch.zeros(16, dtype=torch.float16),
        ),
        "master": weights,
        "master_view": weights[::2, 3:],
        "exp_avg": torch.randn(1024, generator=gen) * 1e-3,
        "step": torch.tensor(12, dtype=torch.int64),
        "mask": torch.arange(10) % 3 == 0,
        "fp8": torch.randn(32, generator=gen).to(torch.float8_e4m3fn),
        "empty": torch.empty(0, 3),
        "meta": {"global_steps": 12, "lr": [1e-3, 2e-3], "name": "golden", "none": None},
    }


def main() -> None:
    for algorithm in ALGORITHMS:
        nce.save(golden_state(), HERE / f"v1_{algorithm}.nvckpt", algorithm=algorithm, chunk_mb=1 / 256)


if __name__ == "__main__":
    main()
