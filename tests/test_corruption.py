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


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_a_plain_torch_file_is_named_as_one_not_as_corrupt(tmp_path, zip_format):
    path = tmp_path / "plain.pt"
    torch.save({"x": torch.ones(2)}, path, _use_new_zipfile_serialization=zip_format)
    with pytest.raises(nce.UnsupportedCheckpointError) as info:
        nce.load(path)
    message = str(info.value)
    assert "plain torch.save file" in message and "corrupt" not in message.lower()
    assert "torch.load" in message and "nvcomp-ckpt compress" in message
    assert not nce.is_shard_file(path)


def test_a_file_that_is_not_ours(tmp_path):
    path = tmp_path / "random.bin"
    path.write_bytes(bytes(range(256)) * 20)
    with pytest.raises(nce.CorruptCheckpointError, match="not an nvcomp_ckpt_engine shard"):
        nce.load(path)


def test_a_save_into_a_missing_folder_names_the_target(tmp_path):
    target = tmp_path / "no_such_folder" / "shard.pt"
    with pytest.raises(FileNotFoundError) as info:
        nce.save({"x": torch.ones(2)}, target)
    message = str(info.value)
    assert str(target) in message and "does not exist" in message
    assert "partial" not in message
    assert not target.parent.exists()


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


# ------------------------------------------------- hostile values in a resealed index, at random

_EDGE_INTS = st.sampled_from([0, 1, 2, 3, 4, 7, 300, 1 << 31, 1 << 40, 1 << 62, (1 << 62) + 1])
_DEVICES = ["cpu", "cpu:0", "cuda", "cuda:0", "cuda:9999", "xpu:0", "mps", "hpu", "npu:3"]
_CODECS = [{"name": "zstd", "version": 1, "options": {"level": 1}}, {"name": "zstd", "version": 2},
           {"name": "deflate", "version": 1}, {"name": "none", "version": 1},
           {"name": "ans", "version": 1, "library": "nvcomp 6.0.0"}, {"name": "auto", "version": 1}]
_TRANSFORMS = [{"name": "none", "version": 1}, {"name": "byteplanes", "version": 1, "width": 4},
               {"name": "byteplanes", "version": 1, "width": 2},
               {"name": "byteplanes", "version": 1, "width": 3}, {"name": "xor", "version": 1}]


@given(data=st.data())
def test_hostile_index_values_are_checkpoint_errors_or_load(small_shard, tmp_path_factory, data):
    """Any combination of edge values in a tensor entry and a storage entry (CRCs resealed):
    the load returns, or raises a CheckpointError naming the file; nothing else escapes."""
    _, original, _ = small_shard
    rank = data.draw(st.integers(0, 3))

    def edit(index):
        tensor, storage = index["tensors"][0], index["storages"][0]
        tensor["shape"] = data.draw(st.lists(_EDGE_INTS, max_size=rank, min_size=rank))
        tensor["stride"] = data.draw(st.lists(_EDGE_INTS, max_size=rank, min_size=rank))
        tensor["offset"] = data.draw(_EDGE_INTS)
        tensor["dtype"] = data.draw(st.sampled_from(sorted(container.DTYPES)))
        tensor["requires_grad"], tensor["parameter"] = data.draw(st.booleans()), data.draw(st.booleans())
        storage["device"] = data.draw(st.sampled_from(_DEVICES))
        storage["codec"] = data.draw(st.sampled_from(_CODECS))
        storage["transform"] = data.draw(st.sampled_from(_TRANSFORMS))
        if data.draw(st.booleans()):
            for chunk in storage["chunks"]:
                chunk[2], chunk[4] = chunk[1] * data.draw(st.sampled_from([1, 2, 1033, 32768])), 0
            storage["nbytes"] = sum(chunk[2] for chunk in storage["chunks"])

    path = tmp_path_factory.mktemp("hostile") / "h.pt"
    path.write_bytes(_rewrite_index(original, edit))
    try:
        nce.load(path)
    except nce.CheckpointError as exc:
        assert str(path) in str(exc), exc
