"""Pinned host memory that asynchronous saves capture into, kept and reused from save to save.

Why not torch's caching host allocator: the first ``cudaHostAlloc`` of many GB runs at a few
GB/s (5.4 s for 15 GB on the H200 host), longer than the whole capture should take, and the
caching allocator keeps freed blocks by power-of-two size class, so a later save whose payloads
fall into other classes pins memory again. The arena hands out consecutive slices of a few large
pinned segments and starts again from the front once every save that took from it has been
written. It holds as much pinned memory as the largest capture needed (which the
``async_host_memory_gb`` cap bounds) until `release` is called.

A process's first async save would still pay for pinning (seconds for tens of GB), so a caller
that knows what its captures will need can have the arena pin it ahead, in a background thread
(`PinnedArena.prepin`): the DeepSpeed engine does so when it is built (`deepspeed.engine`).
"""

from __future__ import annotations

import logging
import threading

import torch

from .errors import CheckpointError

logger = logging.getLogger(__name__)

#: Pinned memory is added in segments of at least this size.
SEGMENT_BYTES = 1 << 30
#: Segments `prepin` pins one at a time: each cudaHostAlloc holds the driver for its duration,
#: so smaller pieces delay the training thread's CUDA calls less while the arena fills.
PREPIN_SEGMENT_BYTES = 256 << 20


class PinnedArena:
    """Slices of pinned host memory for captures in progress (see the module docstring)."""

    def __init__(self, segment_bytes: int = SEGMENT_BYTES) -> None:
        self._lock = threading.Lock()
        self._segments: list[torch.Tensor] = []
        self._segment = 0  # where the next slice starts: segment number and byte in it
        self._used = 0
        self._leases = 0
        self.segment_bytes = segment_bytes

    def open(self) -> Lease:
        """Start a capture: slices taken through the lease stay valid until it is closed."""
        with self._lock:
            self._leases += 1
        return Lease(self)

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 tensor of `nbytes`, valid until every open lease is closed."""
        with self._lock:
            while self._segment < len(self._segments):
                segment = self._segments[self._segment]
                if self._used + nbytes <= segment.numel():
                    self._used += nbytes
                    return segment[self._used - nbytes : self._used]
                self._segment, self._used = self._segment + 1, 0
            segment = self._allocate(max(nbytes, self.segment_bytes))
            self._segments.append(segment)
            self._used = nbytes
            return segment[:nbytes]

    def prepin(self, nbytes: int) -> threading.Thread | None:
        """Pin segments in a background thread until the arena holds `nbytes`; returns the
        thread (None when it holds that much already). Captures meanwhile use the segments
        pinned so far and pin what they lack themselves, as without `prepin`; pinning stops at
        `nbytes` whatever they added, and a failure only ends it (with a log line): the first
        capture then pins what it needs, as without `prepin`."""
        if self.pinned_bytes >= nbytes:
            return None

        def run() -> None:
            while self.pinned_bytes < nbytes:
                try:
                    segment = self._allocate(min(PREPIN_SEGMENT_BYTES, nbytes - self.pinned_bytes))
                except CheckpointError as exc:
                    logger.warning("pinning host memory ahead of async saves stopped: %s", exc)
                    return
                with self._lock:
                    self._segments.append(segment)
            logger.info("pinned %.2f GB of host memory for async saves", self.pinned_bytes / 1e9)

        thread = threading.Thread(target=run, name="nvckpt-prepin", daemon=True)
        thread.start()
        return thread

    def _allocate(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:  # out of memory, or a locked-memory limit (ulimit -l)
            raise CheckpointError(
                f"could not pin {nbytes >> 20} MiB of host memory for an async save "
                f"({self.pinned_bytes >> 20} MiB pinned already): {exc}. Lower "
                '"async_host_memory_gb" (the state above it is written before the save returns) '
                'or turn "async" off'
            ) from exc

    def _close(self) -> None:
        with self._lock:
            self._leases -= 1
            if self._leases == 0:
                self._segment = self._used = 0

    @property
    def pinned_bytes(self) -> int:
        """Pinned memory the arena holds."""
        return sum(s.numel() for s in self._segments)

    def release(self) -> bool:
        """Give the pinned memory back (True), unless a capture is still using it (False)."""
        with self._lock:
            if self._leases:
                return False
            self._segments.clear()
            return True


class Lease:
    """One capture's hold on the arena; `close` once its file is written (or abandoned)."""

    def __init__(self, arena: PinnedArena) -> None:
        self._arena: PinnedArena | None = arena

    def take(self, nbytes: int) -> torch.Tensor:
        if self._arena is None:
            raise RuntimeError("this staging lease is closed")
        return self._arena.take(nbytes)

    def close(self) -> None:
        arena, self._arena = self._arena, None
        if arena is not None:
            arena._close()


#: The process's arena: every async save captures into it.
ARENA = PinnedArena()


class StagingMeter:
    """Host memory the pipelines hold in staging buffers at once, counted as buffers are taken
    and given back: encoded payloads waiting for the writer (pinned for GPU payloads), plane
    copies on the CPU, read-ahead and decode buffers of a load. It is what the documented
    memory bounds of a save and a load are about (docs/ARCHITECTURE.md), and what tests and
    benchmarks read (`watch`). The async arena is not staging: its own cap bounds it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0
        self._peak = 0

    def take(self, nbytes: int) -> int:
        """Count `nbytes` as held; returns them, for the matching `give`."""
        with self._lock:
            self.held += nbytes
            self._peak = max(self._peak, self.held)
        return nbytes

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes

    def watch(self) -> StagingWatch:
        """A context manager whose `peak_bytes` is the most held at once during its block,
        above what was held when it began."""
        return StagingWatch(self)


class StagingWatch:
    """See `StagingMeter.watch`."""

    def __init__(self, meter: StagingMeter) -> None:
        self._meter = meter
        self._base = 0
        self.peak_bytes = 0

    def __enter__(self) -> StagingWatch:
        with self._meter._lock:
            self._base = self._meter.held
            self._meter._peak = self._meter.held
        return self

    def __exit__(self, *exc: object) -> None:
        with self._meter._lock:
            self.peak_bytes = self._meter._peak - self._base


#: The process's staging meter: every pipeline counts its host staging buffers here.
METER = StagingMeter()
