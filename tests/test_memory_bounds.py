"""Host staging memory is bounded whatever the state's size: every staging buffer a save or a
load takes is counted (`staging.METER`), and its peak stays within the documented bound
(`pipeline.save_staging_bound`, `pipeline.load_staging_bound`) for states many times larger.
The CPU path here; the GPU path (pinned payloads, read-ahead) in the `gpu` test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import codecs, pipeline, staging

from conftest import assert_same_tensor

MIB = 1 << 20
WORKERS = 2


def _state(total: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """`total` bytes of fp32 training-like state in tensors of 16 MiB and a few small ones."""
    gen = torch.Generator().manual_seed(0)
    big = {f"exp_avg_sq/{i}": (torch.randn(4 * MIB, generator=gen) * 1e-3) ** 2 for i in range(total // (16 * MIB))}
    small = {f"bias/{i}": torch.randn(1000, generator=gen) for i in range(5)}
    return {k: v.to(device) for k, v in {**big, **small}.items()}


@pytest.mark.skipif(codecs.gpu_codecs_available(), reason="the CPU path: this process codes on its GPU")
def test_cpu_save_and_load_stay_within_the_bound_for_a_state_many_times_it(tmp_path: Path) -> None:
    save_bound = pipeline.save_staging_bound(workers=WORKERS, chunk_bytes=MIB, gpu_batch_bytes=0)
    load_bound = pipeline.load_staging_bound(workers=WORKERS, chunk_bytes=MIB, gpu_batch_bytes=0)
    state = _state(128 * MIB)
    assert sum(t.numel() * 4 for t in state.values()) > 12 * save_bound
    with staging.METER.watch() as saving:
        nce.save(state, tmp_path / "s.pt", chunk_mb=1, workers=WORKERS)
    with staging.METER.watch() as loading:
        loaded = nce.load(tmp_path / "s.pt", workers=WORKERS)
    assert 0 < saving.peak_bytes <= save_bound, (saving.peak_bytes, save_bound)
    assert 0 < loading.peak_bytes <= load_bound, (loading.peak_bytes, load_bound)
    assert staging.METER.held == 0, "a staging buffer was never given back"
    for key, tensor in state.items():
        assert_same_tensor(tensor, loaded[key], key)


@pytest.mark.skipif(codecs.gpu_codecs_available(), reason="the CPU path: this process codes on its GPU")
def test_an_async_save_over_its_cap_writes_the_rest_within_the_bound(tmp_path: Path) -> None:
    bound = pipeline.save_staging_bound(workers=WORKERS, chunk_bytes=MIB, gpu_batch_bytes=0)
    state = _state(64 * MIB)
    with staging.METER.watch() as saving:
        pending = nce.save_async(state, tmp_path / "s.pt", chunk_mb=1, workers=WORKERS,
                                 host_budget_bytes=8 * MIB)
        pending.result(timeout=300)
    assert pending.blocked and pending.staged_bytes <= 8 * MIB
    assert 0 < saving.peak_bytes <= bound, (saving.peak_bytes, bound)
    assert staging.METER.held == 0


@pytest.mark.gpu
def test_gpu_save_and_load_stay_within_the_bound_for_a_state_many_times_it(tmp_path: Path) -> None:
    if not codecs.gpu_codecs_available():
        pytest.skip("needs nvCOMP")
    batch = 8 * MIB
    save_bound = pipeline.save_staging_bound(workers=pipeline.default_workers(), chunk_bytes=MIB,
                                             gpu_batch_bytes=batch)
    state = _state(512 * MIB, device="cuda")
    with staging.METER.watch() as saving:
        nce.save(state, tmp_path / "s.pt", chunk_mb=1, gpu_batch_mb=8)
    load_bound = pipeline.load_staging_bound(workers=pipeline.default_workers(), chunk_bytes=MIB,
                                             gpu_batch_bytes=batch)
    assert 512 * MIB > 6 * max(save_bound, load_bound)
    for where in ("cuda", "cpu"):
        with staging.METER.watch() as loading:
            loaded = nce.load(tmp_path / "s.pt", map_location=where, gpu_batch_mb=8)
        assert 0 < loading.peak_bytes <= load_bound, (where, loading.peak_bytes, load_bound)
        for key, tensor in state.items():
            assert_same_tensor(tensor, loaded[key], key)
    assert 0 < saving.peak_bytes <= save_bound, (saving.peak_bytes, save_bound)
    assert staging.METER.held == 0
