"""How much an async save's background work slows a Python-bound training loop, with neither
DeepSpeed nor a GPU in the way: what part of the slowdown is the I/O and what part the engine.

The main thread runs a loop of small torch ops (`step`, like the Python thread of a training
loop launching kernels). In the background, in turn, interleaved over `--reps` rounds:
  engine        `nvcomp_ckpt_engine.save_async` of `--gb` of fp32 tensors with the ``none``
                codec: after the capture, the background work is what a GPU capture leaves
                behind, the chunk checksums and the writes;
  engine-nocrc  the same with the checksums skipped (that file is not loadable, and is
                deleted): what the checksums cost;
  writer-io     the engine's writer alone (`common.writer_io`): the same I/O, none of the
                engine's threads;
  plain-write   write + fsync of the same bytes (`common.plain_write`).
A run's slowdown is the median step time while the write is in flight over the median of as
many steps right after it. Each run also says where the loop thread's time went during the
write (`common.thread_times`): waiting for the GIL, which the engine's own threads cause, and
waiting for a core; on a shared machine these spread far less than step times do.

    python benchmarks/bench_async_steps.py --gb 2 --reps 8 --scratch /tmp/bas --out results/
    python benchmarks/bench_async_steps.py --gb 0.02 --reps 1 --scratch /tmp/bas --out results/   # a smoke run

Writes OUT/bench_async_steps.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

# benchmarks/ is on sys.path when run as a script
from common import StepSeries, plain_write, series_while, steps_during, writer_io

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine.pipeline import encode

VARIANTS = ("engine", "engine-nocrc", "writer-io", "plain-write")
#: Small enough that the loop is bound by Python and the dispatcher, not by arithmetic.
_STEP_WIDTH, _STEP_OPS = 32, 400


def make_step() -> Callable[[], float]:
    """One 'training step': `_STEP_OPS` tiny matmul+tanh ops on one thread; returns its seconds."""
    x = torch.randn(_STEP_WIDTH, _STEP_WIDTH)

    def step() -> float:
        t0 = time.perf_counter()
        y = x
        for _ in range(_STEP_OPS):
            y = torch.tanh(y @ x) * 0.5
        return time.perf_counter() - t0

    return step


@contextlib.contextmanager
def checksums_skipped() -> Iterator[None]:
    """Chunk checksums of 0 instead of CRC-32s, for the pipeline's calls only."""
    real = encode.zlib
    encode.zlib = types.SimpleNamespace(crc32=lambda *args: 0)
    try:
        yield
    finally:
        encode.zlib = real


def engine_run(step: Callable[[], float], state: dict[str, torch.Tensor], path: Path,
               crc: bool) -> tuple[StepSeries, float]:
    """Steps during and after an async save of `state`; and the seconds the save blocked."""
    with contextlib.nullcontext() if crc else checksums_skipped():
        t0 = time.perf_counter()
        pending = nce.save_async(state, path, algorithm="none", host_budget_bytes=1 << 62)
        blocked = time.perf_counter() - t0

        def finish() -> None:
            pending.result()
            path.unlink()

        return series_while(step, lambda: not pending.done(), finish), blocked


def run(variant: str, step: Callable[[], float], state: dict[str, torch.Tensor], scratch: Path,
        nbytes: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    blocked = 0.0
    if variant.startswith("engine"):
        series, blocked = engine_run(step, state, scratch / "engine.nvckpt", variant == "engine")
    else:
        write = writer_io if variant == "writer-io" else plain_write
        series = steps_during(step, write, scratch / f"{variant}.bin", nbytes)
    during, after = statistics.median(series.during), statistics.median(series.after)
    return {"blocked_s": blocked, "seconds": time.perf_counter() - t0, "steps": len(series.during),
            "step_s_during": during, "step_s_after": after, "slowdown": during / after - 1,
            "loop_thread_during": series.during_times.shares(),
            "loop_thread_after": series.after_times.shares()}


def _median_share(runs: list[dict[str, Any]], kind: str) -> float | None:
    """Median share of the write the loop thread spent `kind` ("blocked": waiting for the GIL,
    "runnable": for a core), None where the kernel does not say."""
    shares = [r["loop_thread_during"][kind] for r in runs]
    return None if None in shares else statistics.median(shares)


def _percent(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.1f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0, help="GB of state each save writes")
    parser.add_argument("--reps", type=int, default=8, help="rounds over every variant (medians)")
    parser.add_argument("--scratch", type=Path, default=Path("bench_async_steps"))
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # one training thread; the save's threads are the engine's own
    numel = int(args.gb * 1e9) // 4 // 16
    state = {f"t{i}": torch.randn(numel) for i in range(16)}
    nbytes = 16 * numel * 4
    step = make_step()
    for _ in range(50):  # warm up the allocator and the dispatcher
        step()
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        for variant in VARIANTS:
            r = run(variant, step, state, args.scratch, nbytes)
            runs[variant].append(r)
            print(f"rep {rep} {variant:13s} slowdown {100 * r['slowdown']:+.1f}%, loop thread "
                  f"waiting for the GIL {_percent(r['loop_thread_during']['blocked'])} of the "
                  f"write ({_percent(r['loop_thread_after']['blocked'])} after it), for a core "
                  f"{_percent(r['loop_thread_during']['runnable'])}", flush=True)
    report = {
        "machine": platform.machine(), "cpus": os.cpu_count(), "bytes": nbytes,
        "results": {v: {"slowdown_median": statistics.median(r["slowdown"] for r in rs),
                        "gil_wait_share_median": _median_share(rs, "blocked"),
                        "core_wait_share_median": _median_share(rs, "runnable"),
                        "runs": rs}
                    for v, rs in runs.items()},
    }
    (args.out / "bench_async_steps.json").write_text(json.dumps(report, indent=2))
    for variant, result in report["results"].items():
        print(f"{variant:13s} median slowdown {100 * result['slowdown_median']:+.1f}%, loop thread "
              f"waiting for the GIL {_percent(result['gil_wait_share_median'])}, for a core "
              f"{_percent(result['core_wait_share_median'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
