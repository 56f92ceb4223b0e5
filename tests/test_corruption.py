"""Every flipped byte and every truncation of a small shard is detected before its data is used.

The attacks tried, and what stops each, are listed in docs/ATTACKS.md.
"""

from __future__ import annotations

import json
import struct
import zlib

import pytest
import torch
from hypothesis import given, strategies as st

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import container

DETECTED = (nce.CorruptCheckpointError, nce.UnsupportedCheckpointError)


@pytest.fixture(scope="module")
def small_shard(tmp_path_factory):
    path = tmp_path_factory.mktemp("c") / "small.pt"
    state = {"w": torch.randn(300), "b": torch.arange(40, dtype=torch.int16), "meta": {"step": 7}}
    nce.save(state, path, chunk_mb=1 / 1024)  # many 1 KiB chunks: every region is exercised
    return path, path.read_bytes(), state


def _expect_detected(path, data: bytes) -> None:
    path.write_bytes(data)
    with pytest.raises(DETECTED):
        nce.load(path)
    with pytest.raises(DETECTED):
        container.verify_file(path)


def test_every_single_byte_flip_is_detected(small_shard, tmp_path):
    _, data, _ = small_shard
    assert len(data) < 64 * 1024
    target = tmp_path / "flipped.pt"
    for pos in range(len(data)):
        damaged = bytearray(data)
        damaged[pos] ^= 0x01 if pos % 2 else 0x80
        _expect_detected(target, bytes(damaged))


def test_every_truncation_is_detected(small_shard, tmp_path):
    _, data, _ = small_shard
    target = tmp_path / "short.pt"
    for length in range(len(data)):
        _expect_detected(target, data[:length])


def test_appended_bytes_are_detected(small_shard, tmp_path):
    _, data, _ = small_shard
    _expect_detected(tmp_path / "long.pt", data + b"\x00")


def test_a_file_that_is_not_ours(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"x": torch.ones(2)}, path)
    with pytest.raises(nce.CorruptCheckpointError, match="not an nvcomp_ckpt_engine shard"):
        nce.load(path)
    assert not nce.is_shard_file(path)


def _rewrite_index(data: bytes, edit) -> bytes:
    """Re-seal a shard after editing its index, so only the validator can catch the edit."""
    offset, length, _, version, end = struct.unpack("<QQII8s", data[-32:])
    index = json.loads(data[offset : offset + length])
    edit(index)
    body = json.dumps(index).encode()
    return data[:offset] + body + struct.pack("<QQII8s", offset, len(body), zlib.crc32(body), version, end)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda i: i["storages"][0].update(nbytes=1 << 40), "decode to"),
        (lambda i: i["storages"][0]["chunks"][0].__setitem__(2, 1 << 40), "out of range"),
        (lambda i: i["storages"][0]["chunks"][0].__setitem__(0, 0), "starts at byte"),
        (lambda i: i["tensors"][0].update(shape=[1 << 40]), "past the end"),
        (lambda i: i["tensors"][0].update(offset=-1), "not an integer"),
        (lambda i: i["tensors"][0].update(storage=99), "not an integer"),
        (lambda i: i.update(extra=1), "keys"),
        (lambda i: i["storages"][0].update(codec={"name": "brotli", "version": 1}), "unknown"),
        (lambda i: i["storages"][0].update(transform={"name": "xor", "version": 1}), "unknown transform"),
        (lambda i: i["tensors"][0].update(dtype="float128"), "unknown dtype"),
    ],
)
def test_hostile_index_values_get_clear_errors(small_shard, tmp_path, edit, message):
    _, data, _ = small_shard
    path = tmp_path / "edited.pt"
    path.write_bytes(_rewrite_index(data, edit))
    with pytest.raises(DETECTED, match=message):
        nce.load(path)


def test_future_format_version_is_unsupported(small_shard, tmp_path):
    _, data, _ = small_shard
    damaged = bytearray(data)
    future = container.FORMAT_VERSION + 1
    struct.pack_into("<I", damaged, container.MAGIC_OFFSET + 8, future)
    path = tmp_path / "future.pt"
    path.write_bytes(bytes(damaged))
    with pytest.raises(nce.UnsupportedCheckpointError, match=f"format version {future}"):
        nce.load(path)


def test_errors_name_the_file_tensor_and_chunk(small_shard, tmp_path):
    _, data, _ = small_shard
    index = container.read_index(small_shard[0])
    blob = index.storages[0].chunks[1]
    damaged = bytearray(data)
    damaged[blob.offset] ^= 0xFF
    path = tmp_path / "named.pt"
    path.write_bytes(bytes(damaged))
    with pytest.raises(nce.CorruptCheckpointError) as info:
        nce.load(path)
    text = str(info.value)
    assert str(path) in text and "chunk 1" in text and "'w'" in text


@given(st.binary(max_size=6000))
def test_arbitrary_bytes_never_crash_the_reader(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("fuzz") / "f.pt"
    path.write_bytes(container.header_bytes() + blob if blob[:1] == b"\x00" else blob)
    with pytest.raises(DETECTED):
        nce.load(path)


@given(st.data())
def test_random_index_mutations_never_crash_or_load_wrong_data(small_shard, tmp_path_factory, data):
    path0, original, state = small_shard
    damaged = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(damaged) - 1))
        damaged[pos] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("mut") / "m.pt"
    path.write_bytes(bytes(damaged))
    if bytes(damaged) == original:
        return
    with pytest.raises(DETECTED):
        nce.load(path)


def test_the_index_derived_file_crc_equals_the_files_crc(small_shard):
    """What the engine compares with the manifest instead of re-reading each shard."""
    import zlib

    path, data, _ = small_shard
    assert container.read_index(path).crc32 == zlib.crc32(data)


def test_a_damaged_chunk_changes_nothing_in_the_index_crc_but_fails_its_own(small_shard, tmp_path):
    """So a manifest CRC match alone never vouches for a chunk: the load still checks each one."""
    path, data, _ = small_shard
    blob = container.read_index(path).storages[0].chunks[0]
    damaged = bytearray(data)
    damaged[blob.offset] ^= 0x01
    target = tmp_path / "damaged.pt"
    target.write_bytes(bytes(damaged))
    assert container.read_index(target).crc32 == container.read_index(path).crc32
    with pytest.raises(nce.CorruptCheckpointError, match="checksum mismatch"):
        nce.load(target)
