"""The async arena pinned ahead (`staging.PinnedArena.prepin`) and how much the DeepSpeed engine
asks it to pin, on the CPU: pinning itself is replaced by plain allocations."""

from __future__ import annotations

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


@pytest.mark.parametrize("cap_gb, partitions, expected", [
    (None, [(1000, True), (24, True)], 12 * 1024),  # the fp32 master and two Adam moments
    (1e-6, [(1000, True)], int(1e-6 * 2**30)),  # never more than the cap
    (None, [(1000, False)], None),  # ZeRO-Offload: the state stays in host memory
])
def test_the_engine_prepins_its_zero_state_within_the_cap(monkeypatch: pytest.MonkeyPatch, cap_gb: Any,
                                                         partitions: list, expected: int | None) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from nvcomp_ckpt_engine.config import NvcompConfig
    from nvcomp_ckpt_engine.deepspeed import _compat
    from nvcomp_ckpt_engine.deepspeed import engine as engine_module

    asked: list[int] = []
    monkeypatch.setattr(engine_module.staging.ARENA, "prepin", lambda nbytes: asked.append(nbytes))
    monkeypatch.setattr(engine_module.torch.cuda, "is_available", lambda: True)
    groups = [types.SimpleNamespace(partition=types.SimpleNamespace(numel=lambda n=n: n, is_cuda=cuda))
              for n, cuda in partitions]
    monkeypatch.setattr(_compat, "zero_groups", lambda engine: groups)
    checkpoint_engine = engine_module.NvcompCheckpointEngine(
        options=NvcompConfig(enabled=True, async_save=True, async_host_memory_gb=cap_gb), zero_stage=1)
    checkpoint_engine.prepin(object())
    assert asked == ([] if expected is None else [expected])
