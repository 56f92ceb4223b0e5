"""Helpers the benchmark scripts share: cold-cache loads, on-disk sizes, and the background
writes (and step timing around them) that the async benchmarks compare the engine with."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from nvcomp_ckpt_engine import storage


def drop_page_cache(folder: Path) -> str:
    """Evict the checkpoint's pages so a load reads from storage (best effort; says how)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for path in folder.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "posix_fadvise"


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under `folder`."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def plain_write(path: Path, nbytes: int) -> float:
    """Write `nbytes` of random bytes to `path` sequentially, then fsync; returns the seconds."""
    source = _streaming_source()
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for piece in _pieces(source, nbytes, 64 << 20):
            f.write(piece)
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def writer_io(path: Path, nbytes: int) -> float:
    """Write `nbytes` as the engine's writer does, without the engine around it: 16 MiB appends
    through `storage.ShardFileWriter` (writeback started every 64 MiB, fsync, atomic rename),
    checksums given; returns the seconds. Both writes stream from `_streaming_source`."""
    source = _streaming_source()
    t0 = time.perf_counter()
    writer = storage.ShardFileWriter(path)
    for piece in _pieces(source, nbytes, 16 << 20):
        writer.append(piece, crc32=0)
    writer.finish()
    return time.perf_counter() - t0


def _streaming_source() -> memoryview:
    """1 GiB of random bytes to write from: more than any CPU cache holds, so a write streams
    its source through memory as the write of a real checkpoint does."""
    return memoryview(os.urandom(16 << 20) * 64)


def _pieces(source: memoryview, nbytes: int, size: int) -> Iterator[memoryview]:
    """`nbytes` of `source` in pieces of `size`, cycling through it."""
    done = 0
    while done < nbytes:
        start = done % len(source)
        piece = source[start : start + min(size, nbytes - done, len(source) - start)]
        done += len(piece)
        yield piece


def steps_while(step: Callable[[], float], running: Callable[[], bool]) -> list[float]:
    """The times of `step()` calls made while `running()` is true (at least one)."""
    times = [step()]
    while running():
        times.append(step())
    return times


def steps_during(step: Callable[[], float], write: Callable[[Path, int], float], path: Path,
                 nbytes: int) -> tuple[list[float], list[float]]:
    """Step times while `write(path, nbytes)` runs in a thread, and as many right after it: what
    that background write costs a training loop on this machine."""
    writer = threading.Thread(target=write, args=(path, nbytes), name="control-write")
    writer.start()
    during = steps_while(step, writer.is_alive)
    writer.join()
    path.unlink()
    return during, [step() for _ in during]
