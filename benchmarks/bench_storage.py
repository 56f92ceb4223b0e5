"""Raw write and read strategies on one file system, to choose the pipeline's I/O pattern.

Write (each timed until durable, fsync included): buffered with one fsync at the end; buffered
with writeback started every 64 MiB (`os.posix_fadvise(DONTNEED)` on the range just written,
which starts its writeback on Linux); `O_DIRECT` with 16 MiB and 64 MiB aligned writes.
Read (each with the page cache dropped first): sequential 64 MiB reads on one thread;
positional reads of 16/64/256 MiB with 1/4/8 in flight; `O_DIRECT` reads.

    python benchmarks/bench_storage.py --gb 8 --scratch /tmp/bs --out results/
    python benchmarks/bench_storage.py --gb 0.05 --scratch /tmp/bs   # a smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import mmap
import os
import time
from pathlib import Path
from typing import Callable

from common import drop_page_cache  # benchmarks/ is on sys.path when run as a script

MiB = 1 << 20


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned memory, as O_DIRECT needs; filled with incompressible bytes."""
    buf = mmap.mmap(-1, nbytes)
    buf[:] = os.urandom(nbytes)
    return buf


def write_buffered(path: Path, nbytes: int, block: mmap.mmap, *, kick: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < nbytes:
            n = os.pwrite(fd, memoryview(block)[: min(len(block), nbytes - done)], done)
            if kick:
                os.posix_fadvise(fd, done, n, os.POSIX_FADV_DONTNEED)
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)


def write_direct(path: Path, nbytes: int, block: mmap.mmap, *, inflight: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    size = len(block)
    try:
        with cf.ThreadPoolExecutor(inflight) as pool:
            list(pool.map(lambda off: os.pwrite(fd, block, off), range(0, nbytes, size)))
        os.fsync(fd)
    finally:
        os.close(fd)


def read_positional(path: Path, block: int, inflight: int, *, direct: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    size = os.fstat(fd).st_size
    buffers = [mmap.mmap(-1, block) for _ in range(inflight)]
    try:
        def one(k: int) -> int:
            return os.preadv(fd, [buffers[k % inflight]], k * block)
        with cf.ThreadPoolExecutor(inflight) as pool:
            # Consecutive blocks, `inflight` at a time (a buffer is reused once its read is done).
            for first in range(0, -(-size // block), inflight):
                list(pool.map(one, range(first, min(first + inflight, -(-size // block)))))
    finally:
        os.close(fd)


def read_sequential(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(64 * MiB)
        while f.readinto(buf):
            pass


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="file size in GB")
    parser.add_argument("--scratch", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    nbytes = int(args.gb * 1e9) // (64 * MiB) * (64 * MiB)
    path = args.scratch / "storage.bin"
    block16, block64 = aligned_buffer(16 * MiB), aligned_buffer(64 * MiB)
    writes = {
        "buffered 64 MiB, fsync at end": lambda: write_buffered(path, nbytes, block64, kick=False),
        "buffered 64 MiB, writeback started per write": lambda: write_buffered(path, nbytes, block64, kick=True),
        "O_DIRECT 16 MiB": lambda: write_direct(path, nbytes, block16, inflight=1),
        "O_DIRECT 64 MiB, 4 in flight": lambda: write_direct(path, nbytes, block64, inflight=4),
    }
    reads = {
        "sequential 64 MiB, 1 thread": lambda: read_sequential(path),
        "pread 256 MiB, 4 in flight": lambda: read_positional(path, 256 * MiB, 4, direct=False),
        "pread 64 MiB, 4 in flight": lambda: read_positional(path, 64 * MiB, 4, direct=False),
        "pread 16 MiB, 8 in flight": lambda: read_positional(path, 16 * MiB, 8, direct=False),
        "O_DIRECT 64 MiB, 1 in flight": lambda: read_positional(path, 64 * MiB, 1, direct=True),
        "O_DIRECT 64 MiB, 4 in flight": lambda: read_positional(path, 64 * MiB, 4, direct=True),
        "O_DIRECT 16 MiB, 8 in flight": lambda: read_positional(path, 16 * MiB, 8, direct=True),
    }
    report: dict[str, dict[str, float | str]] = {"bytes": {"file": nbytes}, "write_gbps": {}, "read_cold_gbps": {}}
    for name, fn in writes.items():
        drop_page_cache(args.scratch)
        try:
            report["write_gbps"][name] = nbytes / timed(fn) / 1e9
        except OSError as exc:
            report["write_gbps"][name] = f"failed: {exc}"
        print(name, report["write_gbps"][name], flush=True)
    write_buffered(path, nbytes, block64, kick=False)
    for name, fn in reads.items():
        how = drop_page_cache(args.scratch)
        try:
            report["read_cold_gbps"][name] = nbytes / timed(fn) / 1e9
        except OSError as exc:
            report["read_cold_gbps"][name] = f"failed: {exc}"
        print(name, report["read_cold_gbps"][name], how, flush=True)
    path.unlink()
    (args.out / "bench_storage.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
