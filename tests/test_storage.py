"""The storage interface: the contract every backend keeps (run here against `PosixStorage`),
the POSIX backend's own promises (links out refused, conditional publish), the resolution of a
user's location, and the fault-injecting wrapper the crash tests use."""

from __future__ import annotations

import os
import threading

import pytest

from nvcomp_ckpt_engine import fileio
from nvcomp_ckpt_engine.storage import (PreconditionFailed, ShortReadError, StorageError, open_storage,
                                        storage_for)
from nvcomp_ckpt_engine.storage.faults import Fault, FaultyStorage, SimulatedCrash
from nvcomp_ckpt_engine.storage.posix import PosixStorage


@pytest.fixture
def storage(tmp_path):
    return PosixStorage(tmp_path)


# ---------------------------------------------------------------------------- the contract

def test_a_sink_is_invisible_until_finish_then_whole(storage) -> None:
    storage.ensure_prefix("tag")
    sink = storage.open_sink("tag/a.bin")
    assert sink.append(b"hello ") == 0
    assert sink.append(memoryview(b"world")) == 6
    assert not storage.exists("tag/a.bin")
    assert sink.finish() == 11
    assert storage.read_small("tag/a.bin", 100) == b"hello world"
    assert [o.key for o in storage.list("tag")] == ["tag/a.bin"]


def test_an_aborted_sink_leaves_nothing(storage) -> None:
    with pytest.raises(RuntimeError):
        with storage.open_sink("a.bin") as sink:
            sink.append(b"x" * 1000)
            raise RuntimeError("the writer failed")
    assert list(storage.list()) == []


def test_ranged_reads_fill_the_buffer_or_refuse(storage) -> None:
    storage.publish("a.bin", bytes(range(256)))
    with storage.open_reader("a.bin") as reader:
        assert reader.size == 256
        assert reader.read(10, 5) == bytes(range(10, 15))
        buf = bytearray(6)
        reader.read_into(250, memoryview(buf))
        assert bytes(buf) == bytes(range(250, 256))
        with pytest.raises(ShortReadError, match="a.bin") as info:
            reader.read(250, 7)
        assert info.value.end == 256


def test_reads_from_threads_share_one_reader(storage) -> None:
    data = os.urandom(1 << 20)
    storage.publish("a.bin", data)
    got = {}
    with storage.open_reader("a.bin") as reader:
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, reader.read(i << 16, 1 << 16)))
                   for i in range(16)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    assert b"".join(got[i] for i in range(16)) == data


def test_small_reads_are_capped_unread(storage) -> None:
    storage.publish("m.json", b"x" * 101)
    with pytest.raises(ValueError, match="m.json.*101 bytes.*100"):
        storage.read_small("m.json", 100, what="a manifest")


def test_publish_replaces_and_if_absent_refuses_a_second_writer(storage) -> None:
    storage.publish("latest", b"one")
    storage.publish("latest", b"two")
    assert storage.read_small("latest", 10) == b"two"
    storage.publish("m.json", b"first", if_absent=True)
    with pytest.raises(PreconditionFailed, match="m.json"):
        storage.publish("m.json", b"second", if_absent=True)
    assert storage.read_small("m.json", 10) == b"first"
    assert [o.key for o in storage.list()] == ["latest", "m.json"]  # no temporary left


def test_missing_keys_name_themselves_and_deletes_are_idempotent(storage) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        storage.open_reader("nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        storage.stat("nope")
    storage.delete("nope")
    storage.delete_prefix("nope")
    assert list(storage.list("nope")) == []


def test_delete_prefix_removes_a_tag(storage) -> None:
    storage.ensure_prefix("t/sub")
    storage.publish("t/sub/a", b"a")
    storage.publish("t/b", b"b")
    assert [(o.key, o.is_prefix) for o in storage.list("t")] == [("t/b", False), ("t/sub", True)]
    storage.delete_prefix("t")
    assert not storage.exists("t")


@pytest.mark.parametrize("key", ["", "/abs", "../up", "a/../b", "a//b", "a/./b"])
def test_keys_that_leave_the_root_are_refused(storage, key) -> None:
    with pytest.raises(ValueError, match="storage key"):
        storage.open_sink(key)


# ----------------------------------------------------------------------- the POSIX backend

def test_posix_refuses_a_link_out_of_its_root(tmp_path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(outside / "secret")
    (root / "dir").symlink_to(outside)
    storage = PosixStorage(root)
    for read in (lambda: storage.open_reader("link"), lambda: storage.read_small("link", 10),
                 lambda: storage.open_sink("dir/new"), lambda: list(storage.list("dir"))):
        with pytest.raises(StorageError, match="outside"):
            read()
    assert storage.stat("link").is_link and not storage.stat("link").is_prefix  # described only
    assert [(o.key, o.is_prefix, o.is_link) for o in storage.list()] == [("dir", True, True),
                                                                          ("link", False, True)]
    storage.delete_prefix("dir")  # removes the link, never what it points to
    assert (outside / "secret").exists() and not (root / "dir").exists()


def test_posix_sinks_keep_direct_and_writeback(tmp_path, monkeypatch) -> None:
    """The sink is fileio's writer: O_DIRECT where granted, writeback started as it goes."""
    monkeypatch.setattr(fileio, "WRITEBACK_STEP", 4096)
    kicked = []
    monkeypatch.setattr(fileio, "_start_writeback", lambda fd, off, n: kicked.append((off, n)))
    storage = PosixStorage(tmp_path)
    sink = storage.open_sink("a", durable=True)
    sink.append(b"x" * 10000)
    sink.finish()
    assert kicked == [(0, 10000)]
    data = os.urandom(3 * fileio.DIRECT_ALIGN + 5)
    sink = storage.open_sink("b", direct=True)
    sink.append(data)
    sink.finish()
    assert (tmp_path / "b").read_bytes() == data


# ------------------------------------------------------------------ a location's storage

def test_locations_resolve_to_their_backend(tmp_path) -> None:
    storage, key = storage_for(tmp_path / "model.nvc")
    assert isinstance(storage, PosixStorage) and storage.root == tmp_path and key == "model.nvc"
    assert open_storage(str(tmp_path)).root == tmp_path
    with pytest.raises(ValueError, match="gs://x.*'gs'"):
        open_storage("gs://x/y")
    with pytest.raises(ValueError, match="s3://bucket"):
        storage_for("s3://bucket")


# ---------------------------------------------------------------------- the fault wrapper

def test_a_failed_append_aborts_the_sink(tmp_path) -> None:
    storage = FaultyStorage(PosixStorage(tmp_path), Fault("append", nth=2))
    with pytest.raises(OSError, match="injected failure of append"):
        with storage.open_sink("a") as sink:
            sink.append(b"1")
            sink.append(b"2")
    assert os.listdir(tmp_path) == []


def test_a_crash_at_finish_leaves_debris_and_no_object(tmp_path) -> None:
    storage = FaultyStorage(PosixStorage(tmp_path), Fault("finish", crash=True))
    with pytest.raises(SimulatedCrash):
        with storage.open_sink("a") as sink:
            sink.append(b"1")
            sink.finish()
    names = os.listdir(tmp_path)
    assert len(names) == 1 and names[0].endswith(fileio.PARTIAL_SUFFIX)  # as a killed writer leaves
    with pytest.raises(SimulatedCrash):
        storage.publish("b", b"")  # the storage is dead


def test_a_crash_after_publish_has_published(tmp_path) -> None:
    storage = FaultyStorage(PosixStorage(tmp_path), Fault("publish", key="m*", crash=True, after=True))
    storage.publish("latest", b"x")
    with pytest.raises(SimulatedCrash):
        storage.publish("m.json", b"m")
    assert (tmp_path / "m.json").read_bytes() == b"m"
    assert storage.calls == [("publish", "latest"), ("publish", "m.json")]


def test_the_fault_wrapper_passes_the_storages_check_through(tmp_path) -> None:
    """A storage that cannot be used says so at start through the wrapper too, and a fault
    planned at the check fires there."""
    class Unreachable(PosixStorage):
        def check(self) -> None:
            raise StorageError(f"{self.url}: endpoint unreachable")

    with pytest.raises(StorageError, match="endpoint unreachable"):
        FaultyStorage(Unreachable(tmp_path)).check()
    FaultyStorage(PosixStorage(tmp_path)).check()
    with pytest.raises(OSError, match="planned"):
        FaultyStorage(PosixStorage(tmp_path), Fault("check", error=OSError("planned"))).check()
