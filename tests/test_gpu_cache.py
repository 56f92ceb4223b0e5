"""The GPU budget of async saves (pipeline.gpu_cache) on any machine, the cache's growth against
a model of torch's caching allocator; the allocator itself is tested on a GPU (test_gpu_pipeline)."""

from __future__ import annotations

import pytest
import torch

from nvcomp_ckpt_engine.pipeline import gpu_cache

GiB = 1 << 30


@pytest.mark.parametrize("cap, cached, working, budget", [
    (8 * GiB, 0, 0, 0),                    # nothing cached: the first save copies as it encodes
    (8 * GiB, 3 * GiB, 0, 3 * GiB),        # part of it: that part waits on the GPU
    (8 * GiB, 3 * GiB, GiB, 2 * GiB),      # less the capture's own working memory
    (8 * GiB, GiB // 2, GiB, 0),
    (2 * GiB, 5 * GiB, GiB, 2 * GiB),      # more than the cap: the cap
    (0, 5 * GiB, 0, 0),                    # async_gpu_memory_gb: 0
])
def test_a_budget_never_exceeds_the_cap_or_the_spare_cache(cap, cached, working, budget):
    assert gpu_cache.budget_from_cache(cap, cached, working) == budget


def test_the_target_covers_the_payloads_with_margin_and_the_working_memory():
    assert gpu_cache.cache_target(8 * GiB, 4 * GiB, GiB) == int(4 * GiB * gpu_cache.FRAGMENTATION_MARGIN) + GiB
    assert gpu_cache.cache_target(2 * GiB, 4 * GiB, 0) == int(2 * GiB * gpu_cache.FRAGMENTATION_MARGIN)
    # what a budget then takes from that cache holds every payload
    target = gpu_cache.cache_target(8 * GiB, 4 * GiB, GiB)
    assert gpu_cache.budget_from_cache(8 * GiB, target, GiB) >= 4 * GiB


@pytest.mark.parametrize("cap, wanted, held, grows", [
    (8 * GiB, 4 * GiB, 0, True),        # the first save copied as it encoded: grow
    (8 * GiB, 4 * GiB, 3 * GiB, True),  # part of it waited on the GPU: grow for the rest
    (8 * GiB, 4 * GiB, 4 * GiB, False), # every payload waited: the cache held it already
    (0, 4 * GiB, 0, False),             # async_gpu_memory_gb: 0, no budget to cache
])
def test_the_cache_grows_after_a_save_only_when_its_budget_fell_short(cap, wanted, held, grows):
    target = gpu_cache.growth_after_save(cap, wanted, held, GiB)
    assert target == (gpu_cache.cache_target(cap, wanted, GiB) if grows else 0)


class _Allocator:
    """torch's caching allocator in miniature: an allocation takes the smallest cached free
    block that fits (splitting it), else a new segment; freeing returns blocks to the cache."""

    def __init__(self, free: list[int]) -> None:
        self.free = sorted(free)

    def cached(self) -> int:
        return sum(self.free)

    def allocate(self, size: int) -> int:
        fits = [b for b in self.free if b >= size]
        if fits:
            self.free.remove(fits[0])
            if fits[0] > size:
                self.free = sorted(self.free + [fits[0] - size])
        return size  # else a new segment

    def release(self, blocks: list[int]) -> None:
        self.free = sorted(self.free + blocks)


@pytest.mark.parametrize("free", [[], [300 << 20], [3 * GiB], [64 << 20] * 40, [5 * GiB]])
def test_growth_counts_what_stays_cached_not_what_it_allocated(free):
    """An allocation served from blocks cached already grows nothing: growth stops only once
    the segments held plus what stays free reach the target, so after they are freed the cache
    holds it; a cache that holds it already allocates nothing."""
    allocator = _Allocator(free)
    target = 4 * GiB
    held = gpu_cache.grow_until(target, allocator.allocate, allocator.cached, segment_bytes=GiB)
    allocator.release(held)
    assert allocator.cached() >= target
    assert sum(held) <= target + GiB
    if sum(free) >= target:
        assert held == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only answers")
def test_without_cuda_nothing_is_cached():
    assert gpu_cache.cached_free_bytes() == 0


@pytest.mark.parametrize("cap, state, grows", [
    (8 * GiB, 4 * GiB, True),   # the raw state, with the margin, plus the working memory
    (2 * GiB, 4 * GiB, True),   # within the cap
    (0, 4 * GiB, False),        # async_gpu_memory_gb: 0
    (8 * GiB, 0, False),        # no state known on the GPU (ZeRO-Offload, ZeRO-3)
])
def test_the_cache_grown_ahead_of_the_first_save_holds_its_raw_state(cap, state, grows):
    target = gpu_cache.growth_ahead(cap, state, GiB)
    assert target == (gpu_cache.cache_target(cap, state, GiB) if grows else 0)
    if grows:  # a first save's payloads, never larger than its raw chunks, then all wait
        assert gpu_cache.budget_from_cache(cap, target, GiB) >= min(cap, state)


def test_the_working_memory_is_three_batches_of_at_least_one_chunk():
    assert gpu_cache.working_bytes(256 << 20, 16 << 20) == 3 * (256 << 20)
    assert gpu_cache.working_bytes(4 << 20, 16 << 20) == 3 * (16 << 20)  # a batch holds a chunk
