"""Asynchronous saves: same bytes as a synchronous save, immune to later changes, bounded memory."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import api

from conftest import assert_same_tensor


def _state() -> dict:
    torch.manual_seed(0)
    return {"w": torch.randn(200_000), "b": torch.randn(1000).bfloat16(), "step": 3}


def test_async_writes_the_same_bytes_as_sync(tmp_path):
    state = _state()
    nce.save(state, tmp_path / "sync.pt", chunk_mb=1 / 16)
    pending = nce.save_async(state, tmp_path / "async.pt", chunk_mb=1 / 16, host_budget_bytes=1 << 30)
    info = pending.result(timeout=60)
    assert not pending.blocked
    assert (tmp_path / "sync.pt").read_bytes() == (tmp_path / "async.pt").read_bytes()
    assert info.file_bytes == (tmp_path / "async.pt").stat().st_size


def test_the_captured_state_is_immune_to_later_updates(tmp_path):
    state = _state()
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    pending = nce.save_async(state, tmp_path / "a.pt", chunk_mb=1 / 64, host_budget_bytes=1 << 30)
    state["w"].add_(1.0)  # the optimizer step that follows the save
    state["b"].zero_()
    pending.result(timeout=60)
    out = nce.load(tmp_path / "a.pt")
    assert_same_tensor(out["w"], expected["w"])
    assert_same_tensor(out["b"], expected["b"])


def test_over_the_host_budget_the_save_blocks_and_says_so(tmp_path):
    state = _state()
    pending = nce.save_async(state, tmp_path / "a.pt", chunk_mb=1 / 64, host_budget_bytes=64 << 10)
    assert pending.blocked and pending.done()
    assert pending.staged_bytes <= 64 << 10
    out = nce.load(tmp_path / "a.pt")
    assert_same_tensor(out["w"], state["w"])


def test_a_failing_background_write_raises_from_result(tmp_path):
    pending = nce.save_async({"x": torch.ones(4)}, tmp_path / "missing_dir" / "a.pt",
                             host_budget_bytes=1 << 20)
    with pytest.raises(FileNotFoundError):
        pending.result(timeout=60)
    assert not (tmp_path / "missing_dir").exists()


def test_the_write_waits_for_its_start_signal(tmp_path):
    start = threading.Event()
    pending = nce.save_async(_state(), tmp_path / "a.pt", chunk_mb=1 / 16, host_budget_bytes=1 << 30,
                             start=start)
    time.sleep(0.3)
    assert not pending.done() and not (tmp_path / "a.pt").exists()
    start.set()
    pending.result(timeout=60)
    assert_same_tensor(nce.load(tmp_path / "a.pt")["w"], _state()["w"])


def test_without_its_start_signal_the_write_begins_after_a_bounded_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(api, "START_WAIT_S", 0.2)
    t0 = time.monotonic()
    pending = nce.save_async(_state(), tmp_path / "a.pt", chunk_mb=1 / 16, host_budget_bytes=1 << 30,
                             start=threading.Event())
    pending.result(timeout=60)
    assert time.monotonic() - t0 >= 0.2
    assert_same_tensor(nce.load(tmp_path / "a.pt")["w"], _state()["w"])


def test_saves_on_a_pool_the_caller_keeps_leave_it_open_and_write_the_same_bytes(tmp_path):
    """An engine's pool serves save after save (a failed one too) and is never shut down by
    them; the files are those of a save on its own pool."""
    import concurrent.futures as cf

    state = _state()
    nce.save(state, tmp_path / "sync.pt", chunk_mb=1 / 16)
    with cf.ThreadPoolExecutor(2) as pool:
        failed = nce.save_async(state, tmp_path / "missing_dir" / "a.pt", chunk_mb=1 / 16,
                                host_budget_bytes=1 << 30, pool=pool)
        with pytest.raises(FileNotFoundError):
            failed.result(timeout=60)
        for name, budget in (("a.pt", 1 << 30), ("b.pt", 1 << 30), ("blocked.pt", 64 << 10)):
            pending = nce.save_async(state, tmp_path / name, chunk_mb=1 / 16,
                                     host_budget_bytes=budget, pool=pool)
            pending.result(timeout=60)
            assert pending.blocked == (name == "blocked.pt")
            assert (tmp_path / name).read_bytes() == (tmp_path / "sync.pt").read_bytes()
        assert pool.submit(lambda: 7).result(timeout=10) == 7  # still open


def test_a_save_on_a_shared_pool_gives_its_jobs_back_before_its_memory(tmp_path, monkeypatch):
    """A capture that fails midway cancels its jobs not started and waits for the running ones
    before its staging lease closes, without shutting the caller's pool down."""
    import concurrent.futures as cf

    from nvcomp_ckpt_engine import pipeline

    real_stage = pipeline.stage

    def failing_stage(prepared, *, pool, **kwargs):
        real_stage(prepared, pool=pool, **kwargs)
        for _ in range(20):
            pool.submit(time.sleep, 0.01)
        raise RuntimeError("capture failed")

    monkeypatch.setattr(pipeline, "stage", failing_stage)
    with cf.ThreadPoolExecutor(1) as pool:
        with pytest.raises(RuntimeError, match="capture failed"):
            nce.save_async(_state(), tmp_path / "a.pt", host_budget_bytes=1 << 30, pool=pool)
        assert pool.submit(lambda: 7).result(timeout=10) == 7
        assert pool._work_queue.empty()  # the failed save's queued jobs were cancelled


def test_a_state_copied_in_pieces_is_written_as_the_live_state_would_be(tmp_path):
    """What the GPU snapshot of an async save encodes (`pipeline.write_snapshot`): every
    storage copied in pieces of whole chunks (`_Storage.copies`), written after the live state
    changed, gives the file a save of the state as it was gives. Host storages here; the copy
    on a GPU is the `gpu` tests' (tests/test_gpu_pipeline.py)."""
    import dataclasses

    from nvcomp_ckpt_engine import pipeline
    from nvcomp_ckpt_engine.options import CompressionOptions
    from nvcomp_ckpt_engine.pipeline import encode

    state = _state()
    nce.save(state, tmp_path / "sync.pt", chunk_mb=1 / 16)
    prepared = api._prepare(state, CompressionOptions(chunk_mb=1 / 16), workers=None, derive=None)
    piece = 3 * prepared.chunk_bytes
    storages = [dataclasses.replace(s, copies=encode._copied(s.bytes_view(), piece))
                for s in prepared.storages]
    assert max(len(s.copies) for s in storages) > 1  # "w" is cut into several pieces
    snapshot = pipeline.DeviceSnapshot(dataclasses.replace(prepared, storages=storages), 0, {})
    state["w"].add_(1.0)
    state["b"].zero_()
    pipeline.write_snapshot(snapshot, tmp_path / "copied.pt", durable=False)
    assert (tmp_path / "copied.pt").read_bytes() == (tmp_path / "sync.pt").read_bytes()
    assert pipeline.snapshot_on_device(prepared, 1 << 40, 1 << 40) is None  # no GPU storage
