"""The save pipeline on the CPU path: file order whatever order encoders finish in, back-pressure
on a slow writer, and staging memory bounded whatever the size of the state."""

from __future__ import annotations

import concurrent.futures as cf
import random
import threading
import time

import pytest
import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine.errors import CheckpointError
from nvcomp_ckpt_engine import container, pipeline, staging, state
from nvcomp_ckpt_engine.pipeline import bounds, decode, encode

from conftest import assert_same_tensor

CHUNK = 64 << 10


def _state() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(40_000 + 997 * i, generator=gen) for i in range(6)}


def _prepared(obj: dict, *, gpu_batch_bytes: int = 256 << 20) -> pipeline.PreparedShard:
    flat = state.flatten(obj)
    # Deflate: a CPU codec on every machine (a GPU machine streams CPU tensors through nvCOMP).
    return pipeline.prepare_shard(flat.skeleton, flat.tensors, flat.keys, algorithm="deflate",
                                  portable=False, chunk_bytes=CHUNK, writer_info={},
                                  gpu_batch_bytes=gpu_batch_bytes)


def _check_loads(path, obj: dict) -> None:
    back = nce.load(path)
    for key, tensor in obj.items():
        assert_same_tensor(back[key], tensor)


def test_chunks_land_in_file_order_when_encoders_finish_out_of_order(tmp_path, monkeypatch):
    real = encode._encode_cpu
    rng = random.Random(0)

    def jittery(job):
        time.sleep(rng.random() * 0.01)
        return real(job)

    monkeypatch.setattr(encode, "_encode_cpu", jittery)
    obj = _state()
    pipeline.write_prepared(_prepared(obj), tmp_path / "a.nvckpt", durable=False, workers=4)
    index = container.read_index(tmp_path / "a.nvckpt")
    offsets = [blob.offset for entry in index.storages for blob in entry.chunks]
    assert offsets == sorted(offsets) and len(offsets) > 12
    _check_loads(tmp_path / "a.nvckpt", obj)


class _Gauge:
    """Units encoded but not yet written, and the most seen at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.peak = 0
        self.bytes_now = self.bytes_peak = 0

    def add(self, units: int, nbytes: int) -> None:
        with self.lock:
            self.now += units
            self.bytes_now += nbytes
            self.peak = max(self.peak, self.now)
            self.bytes_peak = max(self.bytes_peak, self.bytes_now)


def _instrument(monkeypatch, gauge: _Gauge, write_delay: float) -> None:
    """Count a unit when its encoding starts and uncount it when the writer has appended it."""
    real_encode, real_append = encode._encode_cpu, container.ShardWriter.append_chunk

    def counted(job):
        gauge.add(1, job.nbytes)
        return real_encode(job)

    def append_chunk(self, storage, payload, *, raw_length, **kwargs):
        time.sleep(write_delay)  # a slow file system
        blob = real_append(self, storage, payload, raw_length=raw_length, **kwargs)
        gauge.add(-1, -raw_length)
        return blob

    monkeypatch.setattr(encode, "_encode_cpu", counted)
    monkeypatch.setattr(container.ShardWriter, "append_chunk", append_chunk)


def test_a_slow_writer_holds_back_the_encoders(tmp_path, monkeypatch):
    gauge = _Gauge()
    _instrument(monkeypatch, gauge, write_delay=0.005)
    obj = _state()
    prepared = _prepared(obj)
    units = sum(1 for _ in prepared.jobs())
    workers = 2
    pipeline.write_prepared(prepared, tmp_path / "a.nvckpt", durable=False, workers=workers)
    # At most 2 x workers units wait for the writer, plus the one being handed over.
    assert units > 4 * workers and gauge.peak <= 2 * workers + 1
    assert gauge.now == 0
    _check_loads(tmp_path / "a.nvckpt", obj)


@pytest.mark.parametrize("scale", [1, 4])
def test_staged_bytes_stay_within_the_batch_budget_whatever_the_state_size(tmp_path, monkeypatch, scale):
    gauge = _Gauge()
    _instrument(monkeypatch, gauge, write_delay=0.002)
    gen = torch.Generator().manual_seed(scale)
    obj = {"big": torch.randn(scale * 300_000, generator=gen)}
    batch = 2 * CHUNK
    prepared = _prepared(obj, gpu_batch_bytes=batch)
    pipeline.write_prepared(prepared, tmp_path / "a.nvckpt", durable=False, workers=8)
    # Budget: STAGED_BATCHES batches waiting, plus the unit being encoded.
    assert gauge.bytes_peak <= bounds.STAGED_BATCHES * batch + CHUNK
    _check_loads(tmp_path / "a.nvckpt", obj)


class _HostArena(staging.PinnedArena):
    """The arena's bookkeeping with plain host memory (no CUDA here)."""

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)


def test_the_staging_arena_reuses_its_memory_once_every_capture_is_written():
    arena = _HostArena(segment_bytes=1000)
    first, second = arena.open(), arena.open()  # two files of one checkpoint
    a, b, c = first.take(600), second.take(300), first.take(500)
    assert arena.pinned_bytes == 2000  # c did not fit behind a and b: a second segment
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != c.untyped_storage().data_ptr()
    assert b.data_ptr() == a.data_ptr() + 600  # consecutive slices, no rounding
    big = second.take(2500)  # larger than a segment: a segment of its own
    assert big.numel() == 2500 and arena.pinned_bytes == 4500
    first.close()
    tail = second.take(10)  # a lease is still open: nothing is reused yet
    assert tail.data_ptr() not in (a.data_ptr(), b.data_ptr(), c.data_ptr()) and arena.pinned_bytes == 5500
    assert not arena.release()
    second.close()
    again = arena.open()
    assert again.take(600).data_ptr() == a.data_ptr() and arena.pinned_bytes == 5500
    again.close()
    with pytest.raises(RuntimeError, match="closed"):
        again.take(1)
    assert arena.release() and arena.pinned_bytes == 0


def test_a_failed_pinning_names_the_settings_that_avoid_it():
    class _Refusing(staging.PinnedArena):
        def _allocate(self, nbytes):
            return super()._allocate(1 << 60)  # more than any host has

    lease = _Refusing(segment_bytes=1000).open()
    with pytest.raises(CheckpointError, match="async_host_memory_gb"):
        lease.take(10)


def test_loads_read_ahead_in_order_within_the_byte_limit():
    """The load's read-ahead (the GPU path's reads): results in item order, never more than
    the limit in flight (and always at least one item, however large)."""
    sizes = [5, 1, 1, 1, 8, 2, 2, 3, 1, 1, 1, 1]
    gauge = _Gauge()
    with cf.ThreadPoolExecutor(4) as pool:
        def start(k):
            gauge.add(1, sizes[k])
            return pool.submit(lambda: (time.sleep(random.random() * 0.002), k)[1])

        seen = []
        for k in decode._read_ahead(list(range(len(sizes))), start, size=sizes.__getitem__, limit=6):
            seen.append(k)
            gauge.add(-1, -sizes[k])
    assert seen == list(range(len(sizes)))
    assert gauge.bytes_peak == 8  # the 8-byte item alone; otherwise within 6
    assert gauge.peak >= 4  # small items were read several at a time


def test_closing_the_read_ahead_cancels_what_has_not_started():
    started, cancelled = [], []

    def start(k):
        future = cf.Future()
        started.append(k)
        if k == 0:
            future.set_result(k)
        future.add_done_callback(lambda f: cancelled.append(k) if f.cancelled() else None)
        return future

    reads = decode._read_ahead(list(range(10)), start, size=lambda k: 1, limit=3)
    assert next(reads) == 0
    reads.close()
    assert started == [0, 1, 2] and cancelled == [1, 2]


def test_a_failed_read_surfaces_in_order():
    def start(k):
        future = cf.Future()
        if k == 2:
            future.set_exception(OSError("EIO"))
        else:
            future.set_result(k)
        return future

    seen = []
    with pytest.raises(OSError, match="EIO"):
        for k in decode._read_ahead(list(range(5)), start, size=lambda k: 1, limit=2):
            seen.append(k)
    assert seen == [0, 1]


def test_a_waiting_batch_holds_its_whole_encode_buffer_and_a_copy_of_each_raw_chunk():
    """An async capture's GPU budget counts what its payloads keep alive: payloads are slices of
    one encode buffer (sized by the codec's bound), so the buffer counts whole, once; a chunk
    stored raw is cloned to wait, so it counts its own bytes. Plain tensors, on any device."""
    from nvcomp_ckpt_engine.pipeline.encode import _held_bytes

    buffer = torch.empty(1000, dtype=torch.uint8)
    payloads = [buffer[0:100], buffer[400:450]]
    raw = torch.empty(300, dtype=torch.uint8)
    assert _held_bytes(payloads + [raw], [False, False, True]) == 1000 + 300
    assert _held_bytes([raw], [True]) == 300
    assert _held_bytes([], []) == 0
