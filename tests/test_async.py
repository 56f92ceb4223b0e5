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
