"""GPU memory for an async save's payloads, taken only from what torch's allocator has cached.

An async save with a GPU budget leaves its compressed payloads on the GPU while their copies to
host memory run beside training. If the allocator has to `cudaMalloc` that memory during the
capture, the save's stall pays for it: on an H200, 15.6 GiB of new segments made a 1.3B model's
first save 0.66 s against 0.28 s for the next ones, which found the memory cached. So a save's
budget is what its cap allows *and* the allocator holds free already, less the capture's own
working memory (`budget_from_cache`); the rest of its payloads are copied as they are encoded
(the stall of a save without a budget). After such a save, `grow_cache` makes the allocator
cache what the next save will want (`cache_target`), in the background while training runs:
from then on saves find it cached. A job whose state size is known before it saves caches its
first save's budget ahead (`growth_ahead`), once a whole training step has set the peak the
budget is measured from, so the first save stalls no longer than the next ones.

Memory cached this way is not lost to training: when a `cudaMalloc` fails, torch's allocator
frees its unused cached blocks and tries again.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

logger = logging.getLogger(__name__)

#: Segments `grow_cache` allocates one at a time, so that training's own allocations, which wait
#: for the allocator's lock during each `cudaMalloc`, are held up by one short call at a time.
SEGMENT_BYTES = 1 << 30
#: A capture's own GPU working memory, in GPU batches: input planes, nvCOMP's output bound and
#: scratch (`options.CompressionOptions.gpu_batch_mb`).
WORKING_BATCHES = 3
#: Payload buffers do not tile the cached segments exactly: the cache is grown by this much more
#: than the payloads held (a 1 GiB segment holds three ~300 MiB batch buffers, 88% of it).
FRAGMENTATION_MARGIN = 1.25


def cached_free_bytes(device: torch.device | int | None = None) -> int:
    """Bytes torch's caching allocator holds on `device` without handing them out (0 without
    CUDA): what a capture can allocate without `cudaMalloc`."""
    if not torch.cuda.is_available():
        return 0
    return max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def working_bytes(gpu_batch_bytes: int, chunk_bytes: int = 0) -> int:
    """The GPU memory a capture needs besides the payloads it leaves waiting: a batch holds at
    least one chunk (`plan.prepare_shard`), so a chunk larger than `gpu_batch_bytes` sets it."""
    return WORKING_BATCHES * max(gpu_batch_bytes, chunk_bytes)


def budget_from_cache(cap_bytes: int, cached_bytes: int, working: int = 0) -> int:
    """The GPU budget of one save: its cap, but no more than what is cached free already beyond
    the capture's own `working` memory."""
    return max(0, min(cap_bytes, cached_bytes - working))


def cache_target(cap_bytes: int, wanted_bytes: int, working: int = 0) -> int:
    """The free cache the next save needs to leave all its payloads waiting (what they wanted,
    within the cap, with the fragmentation margin) and still find its working memory."""
    return int(min(cap_bytes, wanted_bytes) * FRAGMENTATION_MARGIN) + working


def growth_after_save(cap_bytes: int, wanted_bytes: int, held_bytes: int, working: int) -> int:
    """The free cache to grow to after a save (0: none): only when a budget is allowed (`cap`)
    and the save's payloads wanted more GPU memory than they could hold (`held_bytes`)."""
    if cap_bytes <= 0 or wanted_bytes <= held_bytes:
        return 0
    return cache_target(cap_bytes, wanted_bytes, working)


def growth_ahead(cap_bytes: int, state_bytes: int, working: int) -> int:
    """The free cache to grow to before a job's first save (0: none): enough for payloads as
    large as the raw `state_bytes` (a payload is never stored larger than its chunk; nvCOMP's
    output bound and the segments' tiling are what `FRAGMENTATION_MARGIN` covers), within the
    cap; nothing without a budget or a known state."""
    if cap_bytes <= 0 or state_bytes <= 0:
        return 0
    return cache_target(cap_bytes, state_bytes, working)


def grow_until(target_bytes: int, allocate: Callable[[int], object], cached: Callable[[], int],
               *, segment_bytes: int = SEGMENT_BYTES) -> list[object]:
    """Allocate segments until what they hold plus what stays `cached` free reaches
    `target_bytes`; returns them, for the caller to free (into the cache) at once.

    An allocation may be served from blocks the allocator had cached already (then the cache
    does not grow by it, and what stays free shrinks instead), so growth is judged by the sum,
    not by what was allocated. Bounded: never more segments than the target and the initial
    cache could take.
    """
    held: list[object] = []
    total = 0
    limit = (target_bytes + cached()) // segment_bytes + 2
    while len(held) < limit:
        missing = target_bytes - total - cached()
        if missing <= 0:
            break
        size = min(segment_bytes, missing)
        held.append(allocate(size))
        total += size
    return held


def grow_cache(target_bytes: int, stream: torch.cuda.Stream, *, counted_bytes: int = 0,
               segment_bytes: int = SEGMENT_BYTES) -> threading.Thread | None:
    """Make torch's allocator cache `target_bytes` free on `stream`'s device, in a background
    thread; `counted_bytes` are held now but return to the cache soon (payloads still being
    copied off), and count toward the target.

    Segments are allocated on `stream` (the caching allocator keeps a freed block for the stream
    it was allocated on, and a capture allocates its payloads on the training stream), then all
    freed at once, so that they stay cached (`grow_until`). Out of memory stops the growth where
    it is (a warning: the next saves then find less cached, and copy more as they encode).
    Returns the thread (None when the cache holds enough already).
    """
    target = target_bytes - counted_bytes
    if target <= cached_free_bytes(stream.device):
        return None

    def allocate(size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, device=stream.device)

    def run() -> None:
        try:
            with torch.cuda.stream(stream):
                held = grow_until(target, allocate, lambda: cached_free_bytes(stream.device),
                                  segment_bytes=segment_bytes)
            del held
        except torch.cuda.OutOfMemoryError:
            logger.warning("GPU memory for async saves: could not cache %d bytes (out of memory); "
                           "later saves copy what does not fit as they encode", target)

    thread = threading.Thread(target=run, name="nvckpt-gpu-cache", daemon=True)
    thread.start()
    return thread


__all__ = ["FRAGMENTATION_MARGIN", "SEGMENT_BYTES", "WORKING_BATCHES", "budget_from_cache",
           "cache_target", "cached_free_bytes", "grow_cache", "grow_until", "growth_after_save",
           "growth_ahead", "working_bytes"]
