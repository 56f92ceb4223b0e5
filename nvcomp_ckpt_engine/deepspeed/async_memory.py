"""The host and GPU memory one rank's async saves may hold, and what is made ready before them.

An async save returns once its state is captured: GPU state encoded, its payloads left on the
GPU within a GPU budget (their copies to host memory run beside the next steps) or copied into
pinned host memory within a host budget. The stall is then the encoding alone, provided nothing
is allocated, pinned or loaded during it; so this rank's memory for it is set up ahead:

- at engine start, the pinned host arena is pinned in the background (`prepin`), sized from the
  ZeRO-1/2 state the `DeepSpeedEngine` holds on the GPU;
- once a whole training step has set the peak the GPU budget is measured from, torch's allocator
  is made to cache the first save's budget and the codecs are set up (`before_first_save`);
- at that boundary too, Python's garbage collector makes one full pass (`collect_garbage`): a
  job's first full pass scans every object its start-up made, and it runs wherever the
  allocations since start-up cross the collector's threshold; left alone, the capture's own
  allocations crossed it inside the first save's stall (0.21 s of 0.52 s, H200, 1.3B model);
- after a save whose payloads wanted more than was cached, the rest is cached for the next one
  (`grow_after_save`);
- the threads that checksum and encode every async save's chunks are started once, at that
  boundary, and kept for the engine's life (`pool`), rather than started inside each stall.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import logging
import os
import threading
import time
import weakref
from typing import Any

import torch

from .. import codecs, pipeline, staging
from ..config import NvcompConfig
from . import _compat

logger = logging.getLogger(__name__)


class AsyncMemory:
    """One rank's memory budgets for async saves (``async_host_memory_gb``,
    ``async_gpu_memory_gb``) and their preparation ahead of the saves."""

    #: Step boundaries before the first save after which its GPU budget is cached: DeepSpeed
    #: asks at a boundary before the optimizer step, so the second has seen a whole step's peak.
    CACHE_AHEAD_AT_BOUNDARY = 2

    def __init__(self, options: NvcompConfig) -> None:
        self.options = options
        #: The background pinning of the arena started with the engine (`prepin`).
        self.prepinning: threading.Thread | None = None
        #: ``async_gpu_memory_gb``'s automatic value, measured once (`gpu_cap_bytes`).
        self._gpu_headroom: int | None = None
        #: The raw bytes and dtypes of the state this rank's saves capture from the GPU, known
        #: from the engine at start (`prepin`; 0: unknown).
        self._gpu_state_bytes = 0
        self._gpu_state_dtypes: set[torch.dtype] = set()
        self._boundaries_seen = 0
        #: The latest background growth of the GPU cache (`before_first_save`, `grow_after_save`).
        self.caching: threading.Thread | None = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pool_closer: weakref.finalize | None = None

    def pool(self) -> cf.ThreadPoolExecutor:
        """The threads of every async save's checksums and CPU encoding (`api.save_async`'s
        `pool`), kept for the engine's life and closed by `close` (or when the engine is
        collected, or at exit); started together the first time, outside a stall."""
        if self._pool is None:
            workers = pipeline.default_workers()
            self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="nvckpt-async")
            self._pool_closer = weakref.finalize(self, self._pool.shutdown, wait=False)
            _start_threads(self._pool, workers)
        return self._pool

    def close(self) -> None:
        """Close `pool` once no save uses it (the engine's end: DeepSpeed's ``destroy()``); a
        later save starts it again."""
        if self._pool_closer is not None:
            self._pool_closer()  # shuts the pool down, once
        self._pool = self._pool_closer = None

    def prepin(self, engine: Any) -> None:
        """Start pinning, in the background, the host memory this rank's async captures will
        copy into (`staging.PinnedArena.prepin`), so the first async save blocks no longer
        than the next ones instead of paying seconds of cudaHostAlloc.

        How much, from what `engine` (the `DeepSpeedEngine`, being built or built) knows at
        start: 12 bytes per element of its ZeRO-1/2 fp32 partitions on the GPU — the fp32 master
        and two Adam moments, the state a save captures (the 16-bit module is derived from it),
        raw, so at least its compressed size — and never more than the host budget. Nothing is
        pinned ahead for other setups (ZeRO-0/3, ZeRO-Offload, whose state stays in host memory,
        or no GPU): their first async save pins what it needs.
        """
        if engine is None or not torch.cuda.is_available():
            return
        on_gpu = [g.partition for g in _compat.zero_groups(engine) or () if g.partition.is_cuda]
        self._gpu_state_bytes = 12 * sum(p.numel() for p in on_gpu)
        self._gpu_state_dtypes = {p.dtype for p in on_gpu}
        if self._gpu_state_bytes:
            self.prepinning = staging.ARENA.prepin(min(self._gpu_state_bytes, self.host_budget_bytes()))
            codecs.gpu_codecs_available()  # loads nvCOMP now rather than in the first capture

    def host_budget_bytes(self) -> int:
        """Host memory an async save may hold on this rank (see ``async_host_memory_gb``)."""
        if self.options.async_host_memory_gb is not None:
            return int(self.options.async_host_memory_gb * 2**30)
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(available * 0.5 / max(1, _compat.local_world_size()))

    def gpu_cap_bytes(self) -> int:
        """GPU memory an async save's payloads may hold after it returns (``async_gpu_memory_gb``):
        automatic, measured once before the first capture, since a capture's own payloads raise
        the peak it is measured from."""
        if self.options.async_gpu_memory_gb is not None:
            return int(self.options.async_gpu_memory_gb * 2**30)
        if self._gpu_headroom is None:
            self._gpu_headroom = pipeline.gpu_headroom_bytes()
        return self._gpu_headroom

    def gpu_budget_bytes(self, cap_bytes: int) -> int:
        """One save's GPU budget: within `cap_bytes`, only what the allocator has cached already
        beyond the capture's working memory, so the capture never allocates during the stall."""
        return pipeline.gpu_cache.budget_from_cache(
            cap_bytes, pipeline.gpu_cache.cached_free_bytes(), self.working_bytes())

    def working_bytes(self) -> int:
        """A capture's own GPU memory, which a budget taken from the cache must leave there."""
        return pipeline.gpu_cache.working_bytes(self.options.gpu_batch_bytes, self.options.chunk_bytes)

    def before_first_save(self) -> None:
        """At each step boundary before the first save: once a whole step has set the peak the
        GPU budget is measured from, collect the start-up's garbage (`collect_garbage`), cache
        the first save's payloads' memory beside training (`gpu_cache.growth_ahead`, from the
        state `prepin` found) and set the codecs up (`pipeline.warm_up`), so that the first
        save's capture, like the later ones', allocates, loads and collects nothing."""
        if self._boundaries_seen >= self.CACHE_AHEAD_AT_BOUNDARY:
            return
        self._boundaries_seen += 1
        if self._boundaries_seen < self.CACHE_AHEAD_AT_BOUNDARY:
            return
        self.pool()
        collect_garbage()
        if not torch.cuda.is_available():
            return
        try:
            pipeline.warm_up(sorted(self._gpu_state_dtypes, key=str),
                             torch.device("cuda", torch.cuda.current_device()),
                             algorithm=self.options.algorithm, portable=self.options.portable)
        except Exception as exc:  # a training step must not fail for it: a save reports its own
            logger.warning("setting up the codecs ahead of the first async save failed (the save "
                           "sets them up itself): %s", exc)
        target = pipeline.gpu_cache.growth_ahead(
            self.gpu_cap_bytes(), self._gpu_state_bytes, self.working_bytes())
        self._grow(target, 0, "the first async save's payloads")

    def grow_after_save(self, cap_bytes: int, wanted_bytes: int, held_bytes: int) -> None:
        """After a save whose payloads did not all fit in cached GPU memory, have the allocator
        cache what the next save will want (within the cap), beside training: the next save's
        capture then allocates nothing new, and its stall is the encoding alone."""
        target = pipeline.gpu_cache.growth_after_save(cap_bytes, wanted_bytes, held_bytes,
                                                      self.working_bytes())
        self._grow(target, held_bytes, "the next async saves' payloads")

    def _grow(self, target: int, counted_bytes: int, what: str) -> None:
        if not target or not torch.cuda.is_available():
            return
        thread = pipeline.gpu_cache.grow_cache(target, torch.cuda.current_stream(),
                                               counted_bytes=counted_bytes)
        if thread is not None:
            self.caching = thread
            logger.info("caching up to %.2f GiB of GPU memory for %s", target / 2**30, what)


def _start_threads(pool: cf.ThreadPoolExecutor, workers: int) -> None:
    """Have `pool` start all its `workers` threads now: a pool starts a thread per job only
    while none is idle, so jobs that wait for each other make it start every one."""
    together = threading.Barrier(workers)
    cf.wait([pool.submit(together.wait, 10.0) for _ in range(workers)])


def collect_garbage() -> None:
    """One full pass of Python's garbage collector, at a step boundary ahead of the first async
    save (see the module docstring). The pass a job pays once anyway, here outside a stall;
    after it the survivors of start-up count as long-lived, and the collector's next full pass
    waits until a quarter as many objects again have piled up."""
    started = time.perf_counter()
    gc.collect()
    logger.debug("collected start-up garbage ahead of the first async save in %.3f s",
                 time.perf_counter() - started)


__all__ = ["AsyncMemory", "collect_garbage"]
