"""One contract for every storage backend: the same tests, run against POSIX (a temporary
folder) and an S3 object store (a real S3 API server on 127.0.0.1, tests/s3_server.py).

What a caller may rely on whatever the backend: a sink's object is invisible until `finish`
and gone after `abort`; ranged reads return exactly the bytes asked for or raise naming the key;
`read_small` refuses an object over its cap unread; `publish` replaces in one step and
`if_absent` refuses an existing object; `list` is one level; `delete` and `delete_prefix`
tolerate what is missing and touch nothing beside the prefix; keys that leave the root are
refused by every method.
"""

from __future__ import annotations

import concurrent.futures as cf
import os

import pytest

from nvcomp_ckpt_engine.storage import PreconditionFailed, Storage, StorageError, TooLargeError

MiB = 1 << 20


@pytest.fixture(params=["posix", "s3"])
def storage(request, tmp_path) -> Storage:
    if request.param == "posix":
        from nvcomp_ckpt_engine.storage.posix import PosixStorage

        return PosixStorage(tmp_path)
    return request.getfixturevalue("s3_storage")


def _keys(infos) -> list[tuple[str, bool]]:
    return sorted((info.key, info.is_prefix) for info in infos)


def _sink(storage: Storage, key: str):
    """A sink for `key`, its prefix made first as every caller does (a folder on POSIX)."""
    if "/" in key:
        storage.ensure_prefix(key.rpartition("/")[0])
    return storage.open_sink(key)


def _write(storage: Storage, key: str, data: bytes) -> None:
    with _sink(storage, key) as sink:
        sink.append(data)
        sink.finish()


# -- sinks ----------------------------------------------------------------------------------------

def test_sink_appends_in_order_and_is_invisible_until_finish(storage):
    # More than two S3 parts (5 MiB each) in uneven appends: the multipart path, not one PUT.
    pieces = [os.urandom(n) for n in (3 * MiB, 4 * MiB + 7, 1, 4 * MiB)]
    sink = _sink(storage, "tag/shard.bin")
    offsets = [sink.append(piece) for piece in pieces]
    assert offsets == [0, 3 * MiB, 7 * MiB + 7, 7 * MiB + 8]
    assert not storage.exists("tag/shard.bin")
    assert "tag/shard.bin" not in [info.key for info in storage.list("tag")]
    assert sink.finish() == sum(map(len, pieces))
    assert storage.stat("tag/shard.bin").size == sum(map(len, pieces))
    with storage.open_reader("tag/shard.bin") as reader:
        assert reader.read(0, reader.size) == b"".join(pieces)


def test_small_sink_and_empty_object(storage):
    _write(storage, "small", b"abc")
    _write(storage, "empty", b"")
    assert storage.read_small("small", 10) == b"abc"
    assert storage.read_small("empty", 10) == b""
    assert storage.stat("empty").size == 0


@pytest.mark.parametrize("size", [10, 6 * MiB], ids=["one-put", "multipart"])
def test_sink_abort_leaves_nothing(storage, size):
    sink = _sink(storage, "tag/shard.bin")
    sink.append(os.urandom(size))
    sink.abort()
    sink.abort()  # twice is fine
    assert not storage.exists("tag/shard.bin")


def test_sink_aborts_on_exception_in_with(storage):
    with pytest.raises(RuntimeError, match="boom"):
        with _sink(storage, "tag/shard.bin") as sink:
            sink.append(os.urandom(6 * MiB))
            raise RuntimeError("boom")
    assert not storage.exists("tag/shard.bin")
    assert _keys(storage.list("tag")) == []


def test_finish_replaces_an_existing_object(storage):
    _write(storage, "obj", b"old bytes")
    _write(storage, "obj", b"new")
    assert storage.read_small("obj", 100) == b"new"


# -- ranged reads ---------------------------------------------------------------------------------

def test_ranged_reads_from_threads(storage):
    data = os.urandom(2 * MiB + 3)
    _write(storage, "shard", data)
    ranges = [(0, 1), (5, 1000), (MiB - 3, MiB), (len(data) - 9, 9), (17, 0)]
    with storage.open_reader("shard") as reader:
        assert reader.size == len(data)

        def one(span: tuple[int, int]) -> bytes:
            buf = bytearray(span[1])
            reader.read_into(span[0], memoryview(buf))
            return bytes(buf)

        with cf.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(one, ranges * 3))
    assert got == [data[o:o + n] for o, n in ranges * 3]


def test_read_past_the_end_raises_naming_the_key(storage):
    _write(storage, "tag/short", b"0123456789")
    with storage.open_reader("tag/short") as reader:
        with pytest.raises(StorageError, match="tag/short"):
            reader.read(5, 6)
        assert reader.read(5, 5) == b"56789"


def test_missing_object_raises_file_not_found(storage):
    for call in (lambda: storage.open_reader("nothing"), lambda: storage.read_small("nothing", 10),
                 lambda: storage.stat("nothing")):
        with pytest.raises(FileNotFoundError, match="nothing"):
            call()
    assert not storage.exists("nothing")


# -- small objects and publish --------------------------------------------------------------------

def test_read_small_refuses_over_the_cap(storage):
    _write(storage, "manifest.json", b"x" * 101)
    assert storage.read_small("manifest.json", 101) == b"x" * 101
    with pytest.raises(TooLargeError, match="manifest.json") as caught:
        storage.read_small("manifest.json", 100, what="a manifest")
    assert (caught.value.size, caught.value.limit) == (101, 100)
    assert "a manifest" in str(caught.value)


def test_publish_replaces_in_one_step(storage):
    storage.publish("latest", b"global_step1")
    storage.publish("latest", b"global_step2")
    assert storage.read_small("latest", 100) == b"global_step2"
    assert [info.key for info in storage.list("")] == ["latest"]  # no temporary left beside it


def test_publish_if_absent_refuses_an_existing_object(storage):
    storage.ensure_prefix("tag")
    storage.publish("tag/manifest.json", b"first", if_absent=True)
    with pytest.raises(PreconditionFailed, match="tag/manifest.json"):
        storage.publish("tag/manifest.json", b"second", if_absent=True)
    assert storage.read_small("tag/manifest.json", 100) == b"first"


# -- list, stat, delete ---------------------------------------------------------------------------

def test_list_is_one_level(storage):
    for key in ("a", "d/b", "d/e/c", "dx/f"):
        _write(storage, key, key.encode())
    assert _keys(storage.list("")) == [("a", False), ("d", True), ("dx", True)]
    assert _keys(storage.list("d")) == [("d/b", False), ("d/e", True)]
    assert _keys(storage.list("nothing")) == []
    (entry,) = [info for info in storage.list("d") if not info.is_prefix]
    assert entry.size == 3


def test_stat(storage):
    _write(storage, "d/b", b"12345")
    info = storage.stat("d/b")
    assert (info.key, info.size, info.is_prefix) == ("d/b", 5, False)
    assert info.mtime > 0
    assert storage.stat("d").is_prefix


def test_delete_and_delete_prefix(storage):
    for key in ("t1/a", "t1/sub/b", "t10/c", "t2"):
        _write(storage, key, b"x")
    storage.delete("t2")
    storage.delete("t2")  # missing: fine
    assert not storage.exists("t2")
    storage.delete_prefix("t1")
    storage.delete_prefix("t1")
    assert _keys(storage.list("")) == [("t10", True)]  # a sibling whose name starts alike stays
    assert storage.exists("t10/c")


def test_delete_prefix_of_a_plain_object_is_refused_and_keeps_it(storage):
    _write(storage, "t3", b"x")
    with pytest.raises(NotADirectoryError, match="t3"):
        storage.delete_prefix("t3")
    assert storage.exists("t3")


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/./b", "a/../../b", "", "s3://other-bucket/x"])
def test_keys_that_leave_the_root_are_refused(storage, key):
    calls = [lambda: storage.open_sink(key), lambda: storage.open_reader(key),
             lambda: storage.read_small(key, 10), lambda: storage.publish(key, b"x"),
             lambda: storage.stat(key), lambda: storage.delete(key), lambda: storage.delete_prefix(key)]
    for call in calls:
        with pytest.raises(ValueError):
            call()
