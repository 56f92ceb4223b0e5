"""GPU memory for an async save's payloads, taken only from what torch's allocator has cached.

An async save with a GPU budget leaves its compressed payloads on the GPU while their copies to
host memory run beside training. If the allocator has to `cudaMalloc` that memory during the
capture, the save's stall pays for it: on an H200, 15.6 GiB of new segments made a 1.3B model's
first save 0.66 s against 0.28 s for the next ones, which found the memory cached. So a save's
budget is what its cap allows *and* the allocator holds free already (`budget_from_cache`); the
rest of its payloads are copied as they are encoded (the stall of a save without a budget).
After such a save, `grow_cache` makes the allocator cache what the next save will want, in the
background while training runs: from then on saves find it cached.
"""

from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger(__name__)

#: Segments `grow_cache` allocates one at a time, so that training's own allocations, which wait
#: for the allocator's lock during each `cudaMalloc`, are held up by one short call at a time.
SEGMENT_BYTES = 1 << 30


def cached_free_bytes(device: torch.device | int | None = None) -> int:
    """Bytes torch's caching allocator holds on `device` without handing them out (0 without
    CUDA): what a capture can allocate without `cudaMalloc`."""
    if not torch.cuda.is_available():
        return 0
    return max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def budget_from_cache(cap_bytes: int, cached_bytes: int) -> int:
    """The GPU budget of one save: its cap, but no more than what is cached free already."""
    return max(0, min(cap_bytes, cached_bytes))


def shortfall(cap_bytes: int, wanted_bytes: int, available_bytes: int) -> int:
    """Bytes the cache lacks for the next save: what it wants (its payloads' GPU memory, within
    the cap) less what is cached or held by payloads that will be freed (`available_bytes`)."""
    return max(0, min(cap_bytes, wanted_bytes) - available_bytes)


def grow_cache(nbytes: int, stream: torch.cuda.Stream, *,
               segment_bytes: int = SEGMENT_BYTES) -> threading.Thread | None:
    """Make torch's allocator cache `nbytes` more on `stream`'s device, in a background thread.

    Segments are allocated on `stream` (the caching allocator keeps a freed block for the stream
    it was allocated on, and a capture allocates its payloads on the training stream), then all
    freed at once, so that they stay cached. Out of memory stops the growth where it is (a
    warning: the next saves then find less cached, and copy more as they encode). Returns the
    thread (None when there is nothing to do).
    """
    if nbytes <= 0:
        return None

    def run() -> None:
        held: list[torch.Tensor] = []
        try:
            with torch.cuda.stream(stream):
                for start in range(0, nbytes, segment_bytes):
                    size = min(segment_bytes, nbytes - start)
                    held.append(torch.empty(size, dtype=torch.uint8, device=stream.device))
        except torch.cuda.OutOfMemoryError:
            logger.warning("GPU memory for async saves: cached %d of %d more bytes (out of memory); "
                           "later saves copy the rest as they encode", sum(t.numel() for t in held),
                           nbytes)
        finally:
            del held

    thread = threading.Thread(target=run, name="nvckpt-gpu-cache", daemon=True)
    thread.start()
    return thread


__all__ = ["SEGMENT_BYTES", "budget_from_cache", "cached_free_bytes", "grow_cache", "shortfall"]
