"""The async arena pinned ahead (`staging.PinnedArena.prepin`) and how much the DeepSpeed engine
asks it to pin, and the GPU cache it grows ahead of the first save, on the CPU: pinning itself
is replaced by plain allocations."""

from __future__ import annotations

import gc
import types
from typing import Any

import pytest
import torch

from nvcomp_ckpt_engine import staging
from nvcomp_ckpt_engine.errors import CheckpointError


@pytest.fixture
def arena(monkeypatch: pytest.MonkeyPatch) -> staging.PinnedArena:
    """An arena whose "pinned" segments are plain host tensors (this machine may have no GPU)."""
    made: list[int] = []
    arena = staging.PinnedArena(segment_bytes=1 << 20)

    def allocate(nbytes: int) -> torch.Tensor:
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(arena, "_allocate", allocate)
    monkeypatch.setattr(staging, "PREPIN_SEGMENT_BYTES", 1 << 20)
    arena.made = made  # type: ignore[attr-defined]
    return arena


def test_prepin_pins_in_segments_up_to_the_target_and_captures_reuse_them(arena) -> None:
    thread = arena.prepin((5 << 20) + 123)
    assert thread is not None
    thread.join(30)
    assert arena.made == [1 << 20] * 5 + [123] and arena.pinned_bytes == (5 << 20) + 123
    assert arena.prepin(1 << 20) is None  # holds that much already
    lease = arena.open()
    slices = [lease.take(512 << 10) for _ in range(10)]
    lease.close()
    assert len(arena.made) == 6, "a capture within what was pinned ahead pinned more"
    assert len({s.data_ptr() for s in slices}) == 10


def test_a_failed_prepin_only_stops(arena, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(nbytes: int) -> torch.Tensor:
        raise CheckpointError("locked-memory limit")

    monkeypatch.setattr(arena, "_allocate", refuse)
    thread = arena.prepin(1 << 20)
    thread.join(30)
    assert arena.pinned_bytes == 0


def _engine_over(monkeypatch: pytest.MonkeyPatch, partitions: list, **options: Any) -> Any:
    """An async engine, on a machine made to look as if it had CUDA, whose DeepSpeed engine
    holds ZeRO fp32 partitions of these (elements, on the GPU?) and is prepinned for."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from nvcomp_ckpt_engine.config import NvcompConfig
    from nvcomp_ckpt_engine.deepspeed import _compat, async_memory
    from nvcomp_ckpt_engine.deepspeed import engine as engine_module

    monkeypatch.setattr(async_memory.torch.cuda, "is_available", lambda: True)
    groups = [types.SimpleNamespace(partition=types.SimpleNamespace(
        numel=lambda n=n: n, is_cuda=cuda, dtype=torch.float32)) for n, cuda in partitions]
    monkeypatch.setattr(_compat, "zero_groups", lambda engine: groups)
    checkpoint_engine = engine_module.NvcompCheckpointEngine(
        options=NvcompConfig(enabled=True, async_save=True, **options), zero_stage=1)
    checkpoint_engine.prepin(object())
    return checkpoint_engine


@pytest.mark.parametrize("cap_gb, partitions, expected", [
    (None, [(1000, True), (24, True)], 12 * 1024),  # the fp32 master and two Adam moments
    (1e-6, [(1000, True)], int(1e-6 * 2**30)),  # never more than the cap
    (None, [(1000, False)], None),  # ZeRO-Offload: the state stays in host memory
])
def test_the_engine_prepins_its_zero_state_within_the_cap(monkeypatch: pytest.MonkeyPatch, cap_gb: Any,
                                                         partitions: list, expected: int | None) -> None:
    asked: list[int] = []
    monkeypatch.setattr(staging.ARENA, "prepin", lambda nbytes: asked.append(nbytes))
    _engine_over(monkeypatch, partitions, async_host_memory_gb=cap_gb)
    assert asked == ([] if expected is None else [expected])


@pytest.mark.parametrize("gpu_gb, partitions, grows", [
    (None, [(1000, True)], True),   # the automatic cap: the first save's budget cached ahead
    (0, [(1000, True)], False),     # async_gpu_memory_gb: 0, no budget to cache
    (None, [(1000, False)], False), # ZeRO-Offload: no state on the GPU to size it from
])
def test_the_first_saves_gpu_budget_is_cached_once_a_whole_step_has_run(
        monkeypatch: pytest.MonkeyPatch, gpu_gb: Any, partitions: list, grows: bool) -> None:
    """DeepSpeed asks `get_commit_info` at every step boundary, before the optimizer step: at
    the second, a whole step has set the peak the budget is measured from, and the cache is
    grown once, by the state's raw size within the cap (`gpu_cache.growth_ahead`); the codecs
    of the state's dtypes are warmed then too, after one full pass of the garbage collector
    (`async_memory.collect_garbage`), so that the first capture does not trigger it."""
    from nvcomp_ckpt_engine import pipeline
    from nvcomp_ckpt_engine.pipeline import gpu_cache

    grown: list[int] = []
    warmed: list[tuple] = []
    monkeypatch.setattr(staging.ARENA, "prepin", lambda nbytes: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(pipeline, "gpu_headroom_bytes", lambda: 1 << 30)
    monkeypatch.setattr(gpu_cache, "grow_cache", lambda target, stream, **kw: grown.append(target))
    monkeypatch.setattr(pipeline, "warm_up",
                        lambda dtypes, device, **kw: warmed.append((tuple(dtypes), device)))
    collected: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *args: collected.append(len(grown)))
    checkpoint_engine = _engine_over(monkeypatch, partitions, async_gpu_memory_gb=gpu_gb)
    seen = []
    for _ in range(4):
        assert checkpoint_engine.get_commit_info() is None
        seen.append(len(grown))
    assert collected == [0], "one full garbage collection, at the second boundary, before the cache grows"
    working = gpu_cache.working_bytes(checkpoint_engine.options.gpu_batch_bytes,
                                      checkpoint_engine.options.chunk_bytes)
    assert grown == ([gpu_cache.growth_ahead(1 << 30, 12 * 1000, working)] if grows else [])
    assert seen == ([0, 1, 1, 1] if grows else [0, 0, 0, 0])
    assert warmed == [((torch.float32,) if partitions[0][1] else (), torch.device("cuda", 0))]


def test_a_cpu_jobs_first_async_save_is_also_spared_the_collectors_full_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA there is nothing to cache or warm, but the capture (a snapshot of host
    tensors) would trigger the same pass: it is made at the same boundary, once."""
    from nvcomp_ckpt_engine import pipeline
    from nvcomp_ckpt_engine.deepspeed import async_memory

    checkpoint_engine = _engine_over(monkeypatch, [(1000, False)])
    monkeypatch.setattr(async_memory.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(pipeline, "warm_up", lambda *a, **kw: pytest.fail("warmed codecs without CUDA"))
    collected: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *args: collected.append(1))
    for _ in range(3):
        assert checkpoint_engine.get_commit_info() is None
    assert collected == [1]


def test_the_async_saves_threads_start_at_that_boundary_and_live_until_cleanup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every thread of the pool async saves share starts at the boundary that prepares the
    first save, outside a stall; the pool is the same for every save, until DeepSpeed's
    ``destroy()`` (`cleanup`) closes it; a save after that starts a new one."""
    import threading

    from nvcomp_ckpt_engine.deepspeed import async_memory

    checkpoint_engine = _engine_over(monkeypatch, [(1000, False)])
    monkeypatch.setattr(async_memory.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(async_memory.pipeline, "default_workers", lambda: 3)
    monkeypatch.setattr(gc, "collect", lambda *args: None)
    before = set(threading.enumerate())
    for _ in range(3):
        assert checkpoint_engine.get_commit_info() is None
    started = [t for t in threading.enumerate() if t not in before]
    assert len(started) == 3 and all(t.name.startswith("nvckpt-async") for t in started)
    pool = checkpoint_engine.memory.pool()
    assert checkpoint_engine.memory.pool() is pool
    checkpoint_engine.cleanup()
    with pytest.raises(RuntimeError):
        pool.submit(int)
    assert checkpoint_engine.memory.pool() is not pool
    checkpoint_engine.memory.close()


def test_warm_up_encodes_with_every_plan_auto_may_choose(monkeypatch: pytest.MonkeyPatch) -> None:
    from nvcomp_ckpt_engine import pipeline
    from nvcomp_ckpt_engine.pipeline import encode

    used: list[tuple[str, int]] = []
    run_codec = encode._run_codec
    monkeypatch.setattr(encode, "_run_codec", lambda plan, planes: (
        used.append((plan.codec.name, plan.width)), run_codec(plan, planes))[1])
    pipeline.warm_up([torch.float32, torch.int64], torch.device("cpu"), algorithm="auto", portable=False)
    assert used == [("zstd", 4), ("zstd", 1), ("zstd", 1)]


def test_a_failing_warm_up_never_fails_the_training_step(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The codecs set up ahead are an optimisation made at a step boundary, inside DeepSpeed's
    `step()`: their failure is a warning, and the cache is still grown (the save that follows
    reports any codec failure of its own, at its commit)."""
    from nvcomp_ckpt_engine import pipeline
    from nvcomp_ckpt_engine.pipeline import gpu_cache

    grown: list[int] = []
    monkeypatch.setattr(staging.ARENA, "prepin", lambda nbytes: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(pipeline, "gpu_headroom_bytes", lambda: 1 << 30)
    monkeypatch.setattr(gpu_cache, "grow_cache", lambda target, stream, **kw: grown.append(target))

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("nvCOMP could not start")

    monkeypatch.setattr(pipeline, "warm_up", broken)
    checkpoint_engine = _engine_over(monkeypatch, [(1000, True)])
    with caplog.at_level("WARNING"):
        for _ in range(2):
            assert checkpoint_engine.get_commit_info() is None
    assert "nvCOMP could not start" in caplog.text and len(grown) == 1
