"""The GPU budget of async saves (pipeline.gpu_cache) on any machine; the allocator-level
behaviour is tested on a GPU (test_gpu_pipeline)."""

from __future__ import annotations

import pytest
import torch

from nvcomp_ckpt_engine.pipeline import gpu_cache


@pytest.mark.parametrize("cap, cached, budget", [
    (8 << 30, 0, 0),                 # nothing cached: the first save copies as it encodes
    (8 << 30, 3 << 30, 3 << 30),     # part of it: that part waits on the GPU
    (2 << 30, 5 << 30, 2 << 30),     # more than the cap: the cap
    (0, 5 << 30, 0),                 # async_gpu_memory_gb: 0
])
def test_a_budget_never_exceeds_the_cap_or_the_cache(cap, cached, budget):
    assert gpu_cache.budget_from_cache(cap, cached) == budget


@pytest.mark.parametrize("cap, wanted, available, missing", [
    (8 << 30, 5 << 30, 1 << 30, 4 << 30),   # grows by what the payloads wanted beyond it
    (3 << 30, 5 << 30, 1 << 30, 2 << 30),   # never beyond the cap
    (8 << 30, 5 << 30, 6 << 30, 0),         # enough already
    (0, 5 << 30, 0, 0),
])
def test_the_cache_grows_by_what_the_next_save_lacks(cap, wanted, available, missing):
    assert gpu_cache.shortfall(cap, wanted, available) == missing


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only answers")
def test_without_cuda_nothing_is_cached_and_nothing_grows():
    assert gpu_cache.cached_free_bytes() == 0
    assert gpu_cache.grow_cache(0, stream=None) is None  # type: ignore[arg-type]
