"""Helpers the benchmark scripts share: cold-cache loads, the cold read of a folder (the
disk bound of its load), on-disk sizes, and the background
writes (and step timing around them) that the async benchmarks compare the engine with."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from nvcomp_ckpt_engine import fileio


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


#: Reads in flight and their size for `cold_read`: as the engine's GPU load path reads.
COLD_READERS = 4
COLD_READ_PIECE = 64 << 20


def cold_read(folder: Path, share: tuple[int, int] = (0, 1)) -> tuple[int, float]:
    """The bytes of the files under `folder` and the seconds to read them from storage, its
    pages dropped first (`drop_page_cache`): `COLD_READERS` threads of `COLD_READ_PIECE`
    positional reads into reused buffers, no decode, no checks. A load of the same files
    cannot be faster than this, so ``load_s / read_s`` says how far a load is from the disk
    bound measured in the same run. `share` = (rank, ranks): this process reads every
    ranks-th piece from its rank on, so ranks reading together read the folder once (the
    slowest one's seconds are the folder's)."""
    drop_page_cache(folder)
    pieces = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        size = path.stat().st_size
        pieces += [(path, at, min(COLD_READ_PIECE, size - at)) for at in range(0, size, COLD_READ_PIECE)]
    rank, ranks = share
    pieces = pieces[rank::ranks]
    local = threading.local()

    def read(piece: tuple[Path, int, int]) -> int:
        path, at, length = piece
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(COLD_READ_PIECE)
        view, done = memoryview(buf), 0
        with open(path, "rb", buffering=0) as f:
            while done < length:
                got = os.preadv(f.fileno(), [view[done:length]], at + done)
                if not got:
                    break
                done += got
        return done

    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(COLD_READERS) as pool:
        nbytes = sum(pool.map(read, pieces))
    seconds = time.perf_counter() - t0
    drop_page_cache(folder)
    return nbytes, seconds


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
    through `fileio.ShardFileWriter` (writeback started every 64 MiB, fsync, atomic rename),
    checksums given; returns the seconds. Both writes stream from `_streaming_source`."""
    source = _streaming_source()
    t0 = time.perf_counter()
    writer = fileio.ShardFileWriter(path)
    for piece in _pieces(source, nbytes, 16 << 20):
        writer.append(piece, crc32=0)
    writer.finish()
    return time.perf_counter() - t0


@functools.cache
def _streaming_source() -> memoryview:
    """1 GiB of random bytes to write from: more than any CPU cache holds, so a write streams
    its source through memory as the write of a real checkpoint does. Built once: building it
    holds the GIL for most of a second, which would count against the write it feeds."""
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


def series_while(step: Callable[[], float], running: Callable[[], bool],
                 finish: Callable[[], object]) -> StepSeries:
    """Steps while `running()` is true; `finish()` (wait for the write, delete its file); then as
    many steps again: what the background work costs a training loop, and where it lost time."""
    with thread_times() as during_times:
        during = steps_while(step, running)
    finish()
    with thread_times() as after_times:
        after = [step() for _ in during]
    return StepSeries(during, after, during_times, after_times)


def steps_during(step: Callable[[], float], write: Callable[[Path, int], float], path: Path,
                 nbytes: int) -> StepSeries:
    """Step times while `write(path, nbytes)` runs in a thread, and as many right after it: what
    that background write costs a training loop on this machine."""
    _streaming_source()
    writer = threading.Thread(target=write, args=(path, nbytes), name="control-write")
    writer.start()

    def finish() -> None:
        writer.join()
        path.unlink()

    return series_while(step, writer.is_alive, finish)


@dataclass
class ThreadTimes:
    """Where one thread's wall time went, from the kernel's scheduler statistics.

    For a thread that never waits on its own (a Python-bound training loop), `blocked_s` is the
    time it waited for the GIL while other threads of its process held it; `runnable_s` is the
    time it was ready but had no core. None where the kernel does not say (not Linux).
    """

    wall_s: float = 0.0
    running_s: float | None = None
    runnable_s: float | None = None

    @property
    def blocked_s(self) -> float | None:
        if self.running_s is None or self.runnable_s is None:
            return None
        return max(0.0, self.wall_s - self.running_s - self.runnable_s)

    def shares(self) -> dict[str, float | None]:
        """Blocked and runnable time as shares of the wall time (JSON-ready)."""
        def share(seconds: float | None) -> float | None:
            return None if seconds is None or not self.wall_s else seconds / self.wall_s
        return {"blocked": share(self.blocked_s), "runnable": share(self.runnable_s)}


@dataclass
class StepSeries:
    """Step times while a background write ran and as many right after it, and where the
    stepping thread's time went in each of the two windows."""

    during: list[float]
    after: list[float]
    during_times: ThreadTimes
    after_times: ThreadTimes


def _schedstat() -> tuple[float, float] | None:
    """(seconds on a CPU, seconds waiting for one) of the calling thread, or None."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            running_ns, waiting_ns, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(running_ns) / 1e9, int(waiting_ns) / 1e9


@contextlib.contextmanager
def thread_times() -> Iterator[ThreadTimes]:
    """Measure the calling thread over the block: the result is filled in when it ends."""
    times = ThreadTimes()
    start, t0 = _schedstat(), time.perf_counter()
    try:
        yield times
    finally:
        times.wall_s = time.perf_counter() - t0
        end = _schedstat()
        if start is not None and end is not None:
            times.running_s, times.runnable_s = (b - a for a, b in zip(start, end))


#: `HostMemory` figures: torch's pinned allocator (active: buffers in use; held: active plus
#: the freed blocks it keeps pinned for reuse), and the process (/proc/self/status: resident
#: memory, and pages pinned for devices where the kernel counts them).
HOST_FIGURES = ("pinned_active", "pinned_held", "rss", "vm_pin")


def host_memory_now() -> dict[str, int | None]:
    """The `HOST_FIGURES` at this moment, in bytes (None where this machine does not say)."""
    figures: dict[str, int | None] = dict.fromkeys(HOST_FIGURES)
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            stats = torch.cuda.host_memory_stats()
            figures["pinned_active"] = int(stats.get("active_bytes.current", 0))
            # torch 2.13 calls the pinned blocks it owns (active + cached) "allocated_bytes";
            # older releases kept that figure as "reserved_bytes": the larger is what is pinned.
            figures["pinned_held"] = int(max(stats.get("allocated_bytes.current", 0),
                                             stats.get("reserved_bytes.current", 0)))
    except (ImportError, RuntimeError):
        pass
    try:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        for figure, key in (("rss", "VmRSS"), ("vm_pin", "VmPin")):
            if key in status:
                figures[figure] = int(status[key].split()[0]) * 1024
    except OSError:
        pass
    return figures


class HostMemory:
    """The peak of each `HOST_FIGURES` figure during a block, sampled every `INTERVAL_S`, both
    absolute and above its value when the block began. (torch's own peak counters of the pinned
    allocator are kept per size bucket and summed, which overstates a peak many times over.)"""

    INTERVAL_S = 0.005

    def __init__(self) -> None:
        self.base = host_memory_now()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="host-memory", daemon=True)

    def _update(self) -> None:
        for name, value in host_memory_now().items():
            if value is not None:
                self.peak[name] = max(self.peak[name] or 0, value)

    def _sample(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            self._update()

    def __enter__(self) -> HostMemory:
        self.base = host_memory_now()
        self.peak = dict(self.base)
        self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._sampler.join()
        self._update()

    def report(self, prefix: str = "") -> dict[str, float | None]:
        """``{prefix}{figure}_gib`` (peak above the start) and ``{prefix}{figure}_total_gib``."""
        out: dict[str, float | None] = {}
        for name in HOST_FIGURES:
            peak, base = self.peak[name], self.base[name]
            out[f"{prefix}{name}_gib"] = None if peak is None else round((peak - (base or 0)) / 2**30, 3)
            out[f"{prefix}{name}_total_gib"] = None if peak is None else round(peak / 2**30, 3)
        return out
