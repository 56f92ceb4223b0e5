"""Broken and hostile checkpoint files: every fault is found by `nvcomp-ckpt verify` (no GPU),
and every hostile input gets a clear error, writes nothing outside the checkpoint folder and
runs no code from the file.

The checkpoint folder under attack is written by the real save path: two ranks (threads of this
process) save DeepSpeed-shaped state with `nvcomp_ckpt_engine.save` and commit it with
`commit.commit_checkpoint`, so its manifest, shards and `latest` are what a job writes.
docs/ATTACKS.md lists the abuses and what stops each; docs/RELIABILITY.md the counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import (
    api, cli, codecs, collectives, commit, compat, container, discovery, formats, lazy, manifest,
    manifest_files, state, transforms,
)
from nvcomp_ckpt_engine.cli.common import resolve_target
from nvcomp_ckpt_engine.cli.verify import verify_target
from nvcomp_ckpt_engine.codecs import nvcomp_gpu
from nvcomp_ckpt_engine.storage import locations
from nvcomp_ckpt_engine.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeObjectError,
    UnsupportedCheckpointError,
)

from conftest import assert_same_tensor

logger = logging.getLogger(__name__)

TAG = "global_step3"
LAYOUT = {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2}
#: Random positions flipped in the large shard (besides every byte of its index and trailer).
BIG_POSITIONS = 10_000
#: Random truncation lengths of the large shard.
BIG_TRUNCATIONS = 40


# ------------------------------------------------------------------ a real checkpoint folder


def rank_files(rank: int) -> list[str]:
    """DeepSpeed's file names: rank 0 also writes the model states."""
    optim = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    return ["mp_rank_00_model_states.pt", optim] if rank == 0 else [optim]


def rank_state(rank: int, name: str) -> dict[str, Any]:
    """Small DeepSpeed-like state: fp32 and bf16 tensors, an int step, plain Python values."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{name}".encode()))
    if name.startswith("mp_rank"):
        return {"module": {"inp.weight": torch.randn(12, 12, generator=g).bfloat16()},
                "global_steps": 3, "ds_version": "0.19.8"}
    return {"optimizer_state_dict": {
        "state": {0: {"exp_avg": torch.randn(200, generator=g),
                      "exp_avg_sq": torch.rand(200, generator=g), "step": torch.tensor(3.0)}},
        "fp32_flat_groups": [torch.randn(120, generator=g)]}, "zero_stage": 2}


def save_checkpoint(save_dir: Path, *, chunk_mb: float = 1 / 1024) -> Path:
    """Two ranks save and commit one checkpoint as the DeepSpeed engine does; the tag folder."""
    store = collectives.MemoryStore(timeout_s=30)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            collective = collectives.StoreCollective(store, rank=r, world_size=2, timeout_s=30)
            plan = commit.prepare_tag_dir(save_dir, TAG, rank=r)
            records = []
            for name in rank_files(r):
                info = api.save(rank_state(r, name), plan.write_path(plan.tag_dir / name),
                                algorithm="zstd", chunk_mb=chunk_mb)
                records.append(manifest.ShardRecord(
                    path=name, rank=r, raw_bytes=info.raw_bytes, file_bytes=info.file_bytes,
                    crc32=info.crc32, codecs=info.codecs))
            commit.commit_checkpoint(plan.tag_dir, records, collective=collective,
                                     layout=LAYOUT, timeout_s=30, plan=plan, step=3)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    discovery.write_latest(save_dir, TAG)
    return save_dir / TAG


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("files") / "ckpt")


@pytest.fixture()
def ckpt(folder: Path, tmp_path: Path) -> Path:
    """A private copy of the checkpoint folder (the save dir), for tests that damage it."""
    shutil.copytree(folder.parent, tmp_path / "ckpt", symlinks=True)
    return tmp_path / "ckpt"


def verify(target: Path) -> tuple[int, str]:
    """`nvcomp-ckpt verify -q TARGET`: exit status and everything it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = cli.main(["verify", "-q", str(target)])
    return status, out.getvalue()


def verify_faults(tag_dir: Path) -> list[str]:
    """The faults `nvcomp-ckpt verify` reports for a tag folder (its function, without the
    argument parsing and printing, which `verify` runs once per region kind)."""
    return verify_target(resolve_target(tag_dir, None), progress=False)


# ------------------------------------------------------------------ where a byte lies


@dataclass(frozen=True)
class Region:
    """A byte range of a file and what `verify` must name when a byte in it changes."""

    start: int
    end: int
    kind: str  # "header", "skeleton", "chunk", "index", "trailer", "manifest"
    words: tuple[str, ...] = ()


def shard_regions(path: Path) -> list[Region]:
    """The regions of an intact shard, in file order, tiling the whole file."""
    index = container.read_index(path)
    regions = [Region(0, container.HEADER_SIZE, "header")]
    skeleton = index.skeleton
    regions.append(Region(skeleton.offset, skeleton.offset + skeleton.length, "skeleton",
                          ("skeleton",)))
    for s, storage in enumerate(index.storages):
        for c, blob in enumerate(storage.chunks):
            keys = tuple(repr(t.key) for t in index.tensors if t.storage == s)[:1]
            regions.append(Region(blob.offset, blob.offset + blob.length, "chunk",
                                  keys + (f"(storage {s}, chunk {c})",)))
    trailer = index.file_bytes - container.TRAILER_SIZE
    regions.append(Region(regions[-1].end, trailer, "index"))
    regions.append(Region(trailer, index.file_bytes, "trailer"))
    assert [r.start for r in regions[1:]] == [r.end for r in regions[:-1]], "regions must tile"
    return regions


def region_at(regions: list[Region], pos: int) -> Region:
    return next(r for r in regions if r.start <= pos < r.end)


def checkpoint_files(tag_dir: Path) -> list[tuple[Path, list[Region]]]:
    """Every file of the checkpoint with its regions: the shards, and the manifest."""
    found = manifest.read_manifest(tag_dir)
    files = [(tag_dir / r.path, shard_regions(tag_dir / r.path)) for r in found.files]
    path = manifest.manifest_path(tag_dir)
    return files + [(path, [Region(0, path.stat().st_size, "manifest")])]


def flip_byte(pos: int) -> int:
    """The bit mask flipped at `pos`: every bit position is exercised across the file."""
    return 1 << (pos % 8)


@contextlib.contextmanager
def flipped(path: Path, pos: int) -> Any:
    """`path` with the byte at `pos` flipped, in place; restored afterwards."""
    fd = os.open(path, os.O_RDWR)
    try:
        original = os.pread(fd, 1, pos)
        os.pwrite(fd, bytes([original[0] ^ flip_byte(pos)]), pos)
        try:
            yield
        finally:
            os.pwrite(fd, original, pos)
    finally:
        os.close(fd)


def assert_named(faults: list[str], path: Path, region: Region, where: str) -> None:
    """A fault was reported, naming the file, and the tensor and chunk for chunk bytes."""
    assert faults, f"{where}: not detected"
    text = "\n".join(faults)
    assert path.name in text, f"{where}: the file is not named: {text}"
    for word in region.words:
        assert word in text, f"{where}: {word!r} is not named: {text}"


# --------------------------------------------------------- 7a: every byte of a small folder


def test_the_small_checkpoint_is_whole_and_small(folder: Path) -> None:
    total = sum(p.stat().st_size for p, _ in checkpoint_files(folder))
    assert total <= 64 * 1024, total
    assert verify(folder) == (0, f"{folder}: OK\n")
    assert verify(folder.parent) == (0, f"{folder}: OK\n")  # the save dir, through `latest`
    kinds = {r.kind for _, regions in checkpoint_files(folder) for r in regions}
    assert kinds == {"header", "skeleton", "chunk", "index", "trailer", "manifest"}


def test_every_flipped_byte_is_found_by_verify(folder: Path) -> None:
    """Every byte of every shard and of the manifest, flipped in turn (restored after)."""
    positions = 0
    for path, regions in checkpoint_files(folder):
        for region in regions:
            for pos in range(region.start, region.end):
                with flipped(path, pos):
                    assert_named(verify_faults(folder), path, region, f"{path.name} byte {pos}")
                positions += 1
    assert verify_faults(folder) == []
    logger.info("small checkpoint: %d flipped positions detected", positions)


def test_every_truncation_is_found_by_verify(folder: Path) -> None:
    """Every shorter length of every shard and of the manifest, 0 included."""
    lengths = 0
    for path, _ in checkpoint_files(folder):
        original = path.read_bytes()
        try:
            for length in range(len(original)):
                os.truncate(path, length)
                assert_named(verify_faults(folder), path, Region(0, 0, "any"),
                             f"{path.name} cut to {length}")
                with open(path, "r+b") as f:
                    f.seek(length)
                    f.write(original[length:])
                lengths += 1
        finally:
            path.write_bytes(original)
    assert verify_faults(folder) == []
    logger.info("small checkpoint: %d truncations detected", lengths)


def test_verify_command_exits_non_zero_naming_file_tensor_and_chunk(folder: Path) -> None:
    """The command itself, once per region of every file: exit status 1 and a FAULT line."""
    for path, regions in checkpoint_files(folder):
        for region in regions:
            pos = (region.start + region.end) // 2
            with flipped(path, pos):
                status, output = verify(folder)
            assert status == 1, output
            faults = [line for line in output.splitlines() if line.startswith("FAULT: ")]
            assert_named(faults, path, region, f"{path.name} byte {pos} ({region.kind})")


# ------------------------------------------------------ 7b: random bytes of a large shard


@pytest.fixture(scope="module")
def big_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One shard over 100 MB: compressed fp32 chunks and incompressible (stored raw) bytes."""
    path = tmp_path_factory.mktemp("big") / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    g = torch.Generator().manual_seed(0)
    state = {"exp_avg": torch.randn(16 << 20, generator=g),
             "noise": torch.randint(0, 256, (56 << 20,), dtype=torch.uint8, generator=g),
             "step": 3}
    nce.save(state, path, algorithm="zstd", chunk_mb=1)
    assert path.stat().st_size > 100 * 2**20
    return path


def region_faults(path: Path, regions: list[Region], pos: int) -> list[str]:
    """What `container.verify_file` (the check `verify` runs on each shard) reports for a
    change at `pos`, reading only the bytes that can differ: the header, trailer and index
    (`read_index`) and the one blob holding `pos`. Every other blob is byte-identical to the
    intact file, so its checksum check would pass exactly as it did there."""
    try:
        index = container.read_index(path)
    except CheckpointError as exc:
        return [str(exc)]
    region = region_at(regions, pos)
    blobs = {(b.offset, b.length): (s, c) for s, st in enumerate(index.storages)
             for c, b in enumerate(st.chunks)}
    with locations.open_reader(path) as f:
        try:
            if region.kind == "skeleton":
                container.read_skeleton(f, index)
            elif region.kind == "chunk":
                s, c = blobs[(region.start, region.end - region.start)]
                container.read_blob(f, index.storages[s].chunks[c], path=str(path),
                                    what=container.chunk_name(index, s, c))
        except CheckpointError as exc:
            return [str(exc)]
    return []


def test_random_flips_in_a_large_shard_are_found(big_shard: Path) -> None:
    regions = shard_regions(big_shard)
    rng = random.Random(20261129)
    size = big_shard.stat().st_size
    tail = [r for r in regions if r.kind in ("index", "trailer")]
    positions = [rng.randrange(size) for _ in range(BIG_POSITIONS)]
    positions += [pos for r in tail for pos in range(r.start, r.end)]  # every index byte
    for pos in positions:
        region = region_at(regions, pos)
        with flipped(big_shard, pos):
            assert_named(region_faults(big_shard, regions, pos), big_shard, region,
                         f"byte {pos} ({region.kind})")
    kinds = {region_at(regions, pos).kind for pos in positions}
    assert {"chunk", "index", "trailer"} <= kinds, kinds
    container.verify_file(big_shard)  # restored intact
    logger.info("large shard (%d bytes): %d flipped positions detected", size, len(positions))


def test_full_verify_of_a_large_shard_agrees(big_shard: Path) -> None:
    """The whole-file check and the command on a few positions, as a cross-check of the above."""
    regions = shard_regions(big_shard)
    rng = random.Random(7)
    for region in [r for r in regions if r.kind != "chunk"] + rng.sample(regions, 3):
        pos = rng.randrange(region.start, region.end)
        with flipped(big_shard, pos):
            with pytest.raises((CorruptCheckpointError, UnsupportedCheckpointError)) as info:
                container.verify_file(big_shard)
            status, output = verify(big_shard)
        assert status == 1 and big_shard.name in output, output
        assert_named([str(info.value)], big_shard, region, f"byte {pos}")


def test_random_truncations_of_a_large_shard_are_found(big_shard: Path) -> None:
    rng = random.Random(11)
    size = big_shard.stat().st_size
    lengths = [rng.randrange(size) for _ in range(BIG_TRUNCATIONS)] + [size - 1, 0]
    for length in lengths:
        with open(big_shard, "rb") as f:
            f.seek(length)
            tail = f.read()
        os.truncate(big_shard, length)
        try:
            with pytest.raises(CorruptCheckpointError, match=big_shard.name):
                container.read_index(big_shard)
        finally:
            with open(big_shard, "r+b") as f:
                f.seek(length)
                f.write(tail)
    assert big_shard.stat().st_size == size


# ------------------------------------------------------------------------ 7c: hostile input


def reseal_index(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a shard's JSON index and fix its CRC and trailer, so only validation can object."""
    data = path.read_bytes()
    offset, length, _, version, end = struct.unpack("<QQII8s", data[-container.TRAILER_SIZE:])
    index = json.loads(data[offset:offset + length])
    edit(index)
    body = json.dumps(index).encode()
    path.write_bytes(data[:offset] + body + struct.pack(
        "<QQII8s", offset, len(body), zlib.crc32(body), version, end))


def reseal_manifest(tag_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a manifest's JSON document and recompute its SHA-256 (as a forger would)."""
    path = manifest.manifest_path(tag_dir)
    document = json.loads(path.read_text())
    edit(document)
    covered = {k: document[k] for k in ("body", "format", "version")}
    canonical = json.dumps(covered, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    document["sha256"] = hashlib.sha256(canonical.encode("ascii")).hexdigest()
    path.write_text(json.dumps(document))


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its size and modification time (symlinks not followed)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            info = os.lstat(os.path.join(folder, name))
            found[os.path.relpath(os.path.join(folder, name), root)] = (
                info.st_size, info.st_mtime_ns)
    return found


@contextlib.contextmanager
def nothing_written_outside(tmp_path: Path, *inside: Path) -> Any:
    """Fail if anything under `tmp_path` but outside the folders `inside` changes."""
    def outside() -> dict[str, tuple[int, int]]:
        skip = [os.path.relpath(p, tmp_path) for p in inside]
        return {k: v for k, v in tree(tmp_path).items()
                if not any(k == s or k.startswith(s + os.sep) for s in skip)}

    before = outside()
    yield
    assert outside() == before


OPTIM1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def test_files_that_are_not_ours(tmp_path: Path) -> None:
    samples = {"torch.pt": None, "random.bin": random.Random(1).randbytes(9000),
               "empty.pt": b"", "text.json": b'{"format": "nvcomp_ckpt_engine.shard"}'}
    for name, data in samples.items():
        path = tmp_path / name
        if data is None:
            torch.save({"x": torch.ones(2)}, path)
        else:
            path.write_bytes(data)
        expected = (UnsupportedCheckpointError, "plain torch.save file") if data is None else (
            CorruptCheckpointError, "not an nvcomp_ckpt_engine shard")
        with pytest.raises(expected[0], match=expected[1]):
            nce.load(path)
        status, output = verify(path)
        assert status == 1 and name in output, output
    other = tmp_path / "tag"
    other.mkdir()
    (other / manifest.MANIFEST_NAME).write_text('{"format": "orbax", "version": 1}')
    with pytest.raises(CorruptCheckpointError, match="not an nvcomp_ckpt_engine manifest"):
        manifest.read_manifest(other)


def test_future_format_versions_ask_for_an_upgrade(ckpt: Path) -> None:
    shard = ckpt / TAG / OPTIM1
    data = bytearray(shard.read_bytes())
    future = container.FORMAT_VERSION + 1
    struct.pack_into("<I", data, container.MAGIC_OFFSET + 8, future)
    shard.write_bytes(bytes(data))
    with pytest.raises(UnsupportedCheckpointError, match=f"format version {future}.*upgrade"):
        nce.load(shard)
    newer = manifest.FORMAT_VERSION + 1
    reseal_manifest(ckpt / TAG, lambda doc: doc.update(version=newer))
    with pytest.raises(UnsupportedCheckpointError, match=f"manifest version {newer}.*Upgrade"):
        manifest.read_manifest(ckpt / TAG)
    status, output = verify(ckpt / TAG)
    assert status == 1 and f"manifest version {newer}" in output and f"format version {future}" in output


@pytest.mark.skipif(codecs.gpu_codecs_available(), reason="this machine decodes ANS")
def test_a_codec_this_machine_lacks_names_the_ways_out(ckpt: Path) -> None:
    shard = ckpt / TAG / OPTIM1
    reseal_index(shard, lambda index: index["storages"][0].update(codec={
        "name": "ans", "version": 1, "library": "nvcomp 6.0.0",
        "options": {"bitstream": "native", "data_type": "uint8"}}))
    with pytest.raises(UnsupportedCheckpointError) as info:
        nce.load(shard, map_location="cpu")
    text = str(info.value)
    assert "ANS" in text and "GPU" in text and "nvcomp-ckpt decompress" in text, text
    container.verify_file(shard)  # checking needs no decoder: `verify` works without a GPU
    assert verify(shard)[0] == 0


def test_an_nvcomp_bitstream_of_another_major_release_is_refused(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a GPU node with nvCOMP 6 installed: the descriptor says nvCOMP 5 wrote it."""
    shard = ckpt / TAG / OPTIM1
    reseal_index(shard, lambda index: index["storages"][0].update(codec={
        "name": "ans", "version": 1, "library": "nvcomp 5.1.0",
        "options": {"bitstream": "native", "data_type": "uint8"}}))

    def make_codec(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an incompatible bitstream reached the decoder")

    gpu = type("FakeGpuModule", (), {"check_bitstream_compatible":
                                     staticmethod(nvcomp_gpu.check_bitstream_compatible),
                                     "make_codec": staticmethod(make_codec)})
    monkeypatch.setattr(codecs, "_gpu_module", lambda: gpu)
    monkeypatch.setattr(nvcomp_gpu, "nvcomp_version", lambda: "6.0.0")
    with pytest.raises(UnsupportedCheckpointError) as info:
        nce.load(shard, map_location="cpu")
    assert "5.1.0" in str(info.value) and "6.0.0" in str(info.value), info.value


def test_a_standard_bitstream_loads_whatever_nvcomp_wrote_it(ckpt: Path) -> None:
    """zstd is a standard format: a "library" from another nvCOMP release does not matter."""
    shard = ckpt / TAG / OPTIM1
    expected = nce.load(shard)
    reseal_index(shard, lambda index: [s["codec"].update(library="nvcomp 99.0.0")
                                       for s in index["storages"]])
    got = nce.load(shard)
    for key in ("exp_avg", "exp_avg_sq"):
        assert_same_tensor(got["optimizer_state_dict"]["state"][0][key],
                           expected["optimizer_state_dict"]["state"][0][key], key)


def test_a_different_world_size_names_the_conversion(folder: Path) -> None:
    found = manifest.read_manifest(folder)
    with pytest.raises(UnsupportedCheckpointError) as info:
        manifest.check_layout(found, {"dp": 4, "tp": 1, "pp": 1}, source=str(folder))
    text = str(info.value)
    assert "dp: saved 2, now 4" in text and "nvcomp-ckpt decompress" in text, text
    manifest.check_layout(found, {"dp": 4, "tp": 1, "pp": 1}, keys=("tp", "pp"))  # weights only


def test_a_missing_rank_file_is_named(ckpt: Path) -> None:
    (ckpt / TAG / OPTIM1).unlink()
    for fallback in (False, True):
        with pytest.raises(IncompleteCheckpointError) as info:
            discovery.resolve_load_tag(ckpt, fallback_to_complete=fallback)
        assert OPTIM1 in str(info.value) and "missing" in str(info.value), info.value
    status, output = verify(ckpt / TAG)
    assert status == 1 and OPTIM1 in output and "missing" in output, output


@pytest.mark.parametrize("bad", ["/etc/passwd", "../outside.pt", "a/../../outside.pt",
                                 "./x.pt", "a\\..\\x.pt", "C:/x.pt"])
def test_manifest_paths_outside_the_folder_are_refused(ckpt: Path, tmp_path: Path,
                                                       bad: str) -> None:
    reseal_manifest(ckpt / TAG, lambda doc: doc["body"]["files"][0].update(path=bad))
    with nothing_written_outside(tmp_path, ckpt):
        with pytest.raises(CorruptCheckpointError) as info:
            manifest.read_manifest(ckpt / TAG)
        assert repr(bad) in str(info.value), info.value
        with pytest.raises(IncompleteCheckpointError):
            discovery.resolve_load_tag(ckpt)
        status, output = verify(ckpt / TAG)
    assert status == 1 and repr(bad) in output, output


def _symlink_out(tag_dir: Path, outside: Path) -> None:
    """Move rank 1's shard out of the folder and leave a symlink to it (same bytes, CRC)."""
    outside.mkdir()
    (tag_dir / OPTIM1).rename(outside / OPTIM1)
    (tag_dir / OPTIM1).symlink_to(outside / OPTIM1)


def test_a_symlink_out_of_the_folder_is_refused(ckpt: Path, tmp_path: Path) -> None:
    _symlink_out(ckpt / TAG, tmp_path / "outside")
    with nothing_written_outside(tmp_path, ckpt, tmp_path / "out"):
        with pytest.raises(CorruptCheckpointError, match="outside the tag folder"):
            manifest_files.verify_files(ckpt / TAG, manifest.read_manifest(ckpt / TAG))
        with pytest.raises(IncompleteCheckpointError, match="outside the tag folder"):
            discovery.resolve_load_tag(ckpt)
        status, output = verify(ckpt / TAG)
        assert status == 1 and "outside the tag folder" in output, output
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            status = cli.main(["decompress", "-q", str(ckpt / TAG), str(tmp_path / "out")])
        assert status == 1 and "outside the tag folder" in out.getvalue(), out.getvalue()
    assert not list((tmp_path / "out").rglob("*.pt"))


def test_a_pending_rename_through_a_symlinked_folder_is_not_done(ckpt: Path,
                                                                  tmp_path: Path) -> None:
    """A forged re-save manifest whose staged file sits behind a symlinked sub-folder: the
    load refuses it, and nothing outside the checkpoint folder is renamed."""
    tag_dir = ckpt / TAG
    outside = tmp_path / "outside"
    outside.mkdir()
    suffix = ".nvckpt-stage-r1-0123456789ab"
    (tag_dir / OPTIM1).rename(outside / (OPTIM1 + suffix))
    (tag_dir / "sub").symlink_to(outside)
    found = manifest.read_manifest(tag_dir)
    records = [manifest.ShardRecord(**{**{f: getattr(r, f) for f in (
        "path", "rank", "raw_bytes", "file_bytes", "crc32", "codecs", "node")},
        "path": f"sub/{r.path}" if r.path == OPTIM1 else r.path}) for r in found.files]
    forged = manifest.build_manifest(
        tag=TAG, world_size=2, files=records, layout=dict(found.layout), step=3,
        created_unix_ns=found.created_unix_ns, pending={1: suffix})
    manifest.write_manifest(tag_dir, forged)
    with nothing_written_outside(tmp_path, ckpt):
        with pytest.raises(IncompleteCheckpointError, match="outside the tag folder"):
            discovery.resolve_load_tag(ckpt)
        assert verify(tag_dir)[0] == 1
    assert sorted(p.name for p in outside.iterdir()) == [OPTIM1 + suffix]


def _declare(raw: int) -> Callable[[dict[str, Any]], None]:
    """An index edit: the first chunk (made a compressed one) decodes to `raw` bytes."""
    def edit(index: dict[str, Any]) -> None:
        index["storages"][0]["chunks"][0][2:] = [raw, index["storages"][0]["chunks"][0][3], 0]

    return edit


@pytest.mark.parametrize("edit, message", [
    (lambda i: i["storages"][0].update(nbytes=1 << 40), "decode to"),
    (_declare(1 << 40), "out of range"),
    (_declare(1 << 29), "cannot decode to"),
    (lambda i: i["tensors"][0].update(shape=[1 << 40]), "past the end"),
    (lambda i: i["tensors"][0].update(shape=[2] * 65, stride=[1] * 65), "at most 64"),
    (lambda i: i["tensors"][0].update(shape=[1 << 62, 1 << 62], stride=[1, 1]), "past the end"),
    (lambda i: i["tensors"][0].update(offset=1 << 62), "past the end"),
    (lambda i: i.update(skeleton=[4096, 8, 1 << 30, 0, 0]), "cannot decode to"),
    (lambda i: i.update(writer=[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]), "writer is not an object"),
])
def test_absurd_sizes_are_refused_before_allocating(ckpt: Path, edit: Callable, message: str
                                                    ) -> None:
    shard = ckpt / TAG / OPTIM1
    reseal_index(shard, edit)
    with pytest.raises(CorruptCheckpointError, match=message):
        nce.load(shard)
    with pytest.raises(CorruptCheckpointError, match=message):
        container.read_index(shard)


@pytest.mark.parametrize("device", ["xyz", "", "meta", "cpu:99999999999999999999"])
def test_an_index_naming_an_impossible_device_is_corruption(ckpt: Path, device: str) -> None:
    """Where a storage was saved is the `location` map_location sees; a forged one must be
    reported as a damaged file, not as torch's device-string error, and never load as
    tensors without data (the meta device)."""
    shard = ckpt / TAG / OPTIM1
    reseal_index(shard, lambda index: index["storages"][0].update(device=device))
    with pytest.raises(CorruptCheckpointError, match=OPTIM1):
        nce.load(shard)


@pytest.mark.parametrize("options", [None, [], "level=1", 3])
def test_codec_options_that_are_not_an_object_are_corruption(ckpt: Path, options: Any) -> None:
    """Found by tests/test_fuzz.py's long profile: a descriptor's options must be an object."""
    shard = ckpt / TAG / OPTIM1
    reseal_index(shard, lambda index: index["storages"][0]["codec"].update(options=options))
    with pytest.raises(CorruptCheckpointError, match=OPTIM1):
        nce.load(shard)


def test_an_index_length_of_a_terabyte_is_refused(ckpt: Path) -> None:
    shard = ckpt / TAG / OPTIM1
    data = bytearray(shard.read_bytes())
    struct.pack_into("<Q", data, len(data) - container.TRAILER_SIZE + 8, 1 << 40)
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="trailer places the index"):
        nce.load(shard)


def test_a_deeply_nested_index_is_corruption_not_a_crash(ckpt: Path) -> None:
    shard = ckpt / TAG / OPTIM1
    data = shard.read_bytes()
    offset, _, _, version, end = struct.unpack("<QQII8s", data[-container.TRAILER_SIZE:])
    body = b"[" * 200_000 + b"]" * 200_000
    shard.write_bytes(data[:offset] + body + struct.pack(
        "<QQII8s", offset, len(body), zlib.crc32(body), version, end))
    with pytest.raises(CorruptCheckpointError):
        nce.load(shard)


def test_a_chunk_at_the_expansion_bound_allocates_little_and_fails_cleanly(ckpt: Path) -> None:
    """The most a hostile index may declare for a chunk (its codec's bound: 32,768x for zstd)
    is decoded into scratch of that chunk's size, before its storage is allocated, and found
    not to produce it."""
    shard = ckpt / TAG / OPTIM1
    index = container.read_index(shard)
    blob = index.storages[0].chunks[0]
    declared = blob.length * formats.max_ratio(index.storages[0].codec)
    grow = declared - blob.raw_length

    def edit(i: dict[str, Any]) -> None:
        _declare(declared)(i)
        i["storages"][0]["nbytes"] += grow

    reseal_index(shard, edit)
    assert container.read_index(shard).storages[0].nbytes < 1 << 30
    with pytest.raises(CorruptCheckpointError, match="does not decode"):
        nce.load(shard)


def _spread(codec: dict[str, Any], ratio: int) -> Callable[[dict[str, Any]], None]:
    """An index edit: every chunk of storage 0 declares `ratio` times its stored bytes (made
    compressed chunks of `codec`), and the storage the sum: a 1 MB file could ask for 64 GiB."""
    def edit(index: dict[str, Any]) -> None:
        storage = index["storages"][0]
        storage["codec"] = codec
        for chunk in storage["chunks"]:
            chunk[2], chunk[4] = chunk[1] * ratio, 0
        storage["nbytes"] = sum(chunk[2] for chunk in storage["chunks"])

    return edit


@pytest.mark.parametrize("codec, ratio", [
    ({"name": "zstd", "version": 1, "options": {"level": 1}}, 32768 + 1),
    ({"name": "zstd", "version": 1, "options": {"level": 1}}, 65536),
    ({"name": "deflate", "version": 1, "options": {"level": 1}}, 1033),
    ({"name": "none", "version": 1}, 2),
])
def test_a_storage_cannot_declare_more_than_its_codec_can_decode(
        ckpt: Path, codec: dict[str, Any], ratio: int) -> None:
    """The total a storage may ask for is its stored bytes times its codec's maximum ratio,
    checked with the index, before anything is allocated or read."""
    shard = ckpt / TAG / OPTIM1
    reseal_index(shard, _spread(codec, ratio))
    with pytest.raises(CorruptCheckpointError, match="cannot decode to.*at most"):
        container.read_index(shard)
    with pytest.raises(CorruptCheckpointError, match=OPTIM1):
        nce.load(shard)


@contextlib.contextmanager
def largest_allocation() -> Any:
    """The largest tensor torch was asked for (`torch.empty`, `torch.empty_like`) inside the
    block, in bytes, as a one-element list filled in as the block runs: every buffer a load
    decodes into is made by one of them."""
    largest = [0]
    calls = {name: getattr(torch, name) for name in ("empty", "empty_like")}

    def spy(name: str) -> Callable[..., torch.Tensor]:
        def allocate(*args: Any, **kwargs: Any) -> torch.Tensor:
            if name == "empty" and args and isinstance(args[0], int):
                dtype = kwargs.get("dtype") or torch.get_default_dtype()
                largest[0] = max(largest[0], args[0] * dtype.itemsize)
            result = calls[name](*args, **kwargs)
            largest[0] = max(largest[0], result.numel() * result.element_size())
            return result
        return allocate

    with pytest.MonkeyPatch.context() as patch:
        for name in calls:
            patch.setattr(torch, name, spy(name))
        yield largest


#: What the forged chunks below declare per stored byte: past `formats.PLAUSIBLE_EXPANSION`,
#: within zstd's 32,768, so only decoding can tell that they lie.
FORGED_RATIO = 30_000


def forge_declared_sizes(path: Path, codec: dict[str, Any] | None = None) -> None:
    """Make the one storage of the file at `path` (a tensor of compressed chunks) declare
    `FORGED_RATIO` times its stored bytes, chunk by chunk (as `codec`, when given), its tensor
    as long: only decoding the chunks can tell."""
    def edit(index: dict[str, Any]) -> None:
        _spread(codec or index["storages"][0]["codec"], FORGED_RATIO)(index)
        index["tensors"][0]["shape"] = [index["storages"][0]["nbytes"]]

    reseal_index(path, edit)
    assert not any(c.stored_raw for c in container.read_index(path).storages[0].chunks)


def forged_storage(tmp_path: Path, codec: dict[str, Any] | None = None) -> Path:
    """A file written by the library's writer (64 chunks of 1 KiB that zstd shrinks about 3x),
    then forged (`forge_declared_sizes`): its storage asks for 671 MB from a 30 KB file."""
    data = torch.randint(0, 4, (64 << 10,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    path = tmp_path / "forged.nvckpt"
    nce.save({"buffer": data}, path, algorithm="zstd", chunk_mb=1 / 1024)
    forge_declared_sizes(path, codec)
    return path


def test_a_storage_declaring_more_than_it_plausibly_holds_is_proven_before_allocation(
        tmp_path: Path) -> None:
    """Chunks declaring 30,000x their bytes (what zstd's bound allows, and any nvCOMP format's)
    are decoded into scratch of one chunk before their storage is allocated: the load fails at
    the first chunk, naming the file and the chunk, having allocated a chunk's size."""
    path = forged_storage(tmp_path)
    index = container.read_index(path)
    declared, chunk = index.storages[0].nbytes, max(c.raw_length for c in index.storages[0].chunks)
    assert declared > 500 << 20 and index.file_bytes < 64 << 10
    with largest_allocation() as largest, pytest.raises(CorruptCheckpointError) as info:
        nce.load(path)
    assert str(path) in str(info.value) and "chunk 0" in str(info.value), info.value
    assert largest[0] <= chunk + 1 and largest[0] < declared // 32, largest


def test_a_lazy_read_of_a_forged_storage_allocates_a_chunk_at_most(tmp_path: Path) -> None:
    """A read by element range asks for what the file's shapes say: the chunks that hold the
    range are proven before the range's buffer is allocated."""
    path = forged_storage(tmp_path)
    chunk = max(c.raw_length for c in container.read_index(path).storages[0].chunks)
    with lazy.LazyShard(path) as shard:
        with largest_allocation() as largest, pytest.raises(CorruptCheckpointError, match="chunk 0"):
            shard.read(shard.obj["buffer"])
        with pytest.raises(CorruptCheckpointError, match="chunk 3"):
            shard.read(shard.obj["buffer"], 3 * chunk, 2 * chunk)
    assert largest[0] <= chunk + 1, largest


@pytest.mark.parametrize("name", ["ans", "gdeflate", "bitcomp", "cascaded", "lz4"])
def test_a_forged_nvcomp_storage_fails_cleanly_allocating_little(tmp_path: Path, name: str) -> None:
    """nvCOMP's formats bound no chunk below 65,536x: a storage of them declaring 30,000x is a
    `CheckpointError` naming the file, allocating at most a chunk first (on a machine without a
    GPU the codec is refused before anything is allocated; on one, the proof refuses it)."""
    library = f"nvcomp {nvcomp_gpu.nvcomp_version() or '6.0.0'}"
    path = forged_storage(tmp_path, {"name": name, "version": 1, "library": library,
                                     "options": {"uncomp_chunk_size": 65536}})
    chunk = max(c.raw_length for c in container.read_index(path).storages[0].chunks)
    with largest_allocation() as largest, pytest.raises(CheckpointError) as info:
        nce.load(path, map_location="cpu")
    assert str(path) in str(info.value), info.value
    assert largest[0] <= chunk + 1, largest


def test_a_derived_range_is_allocated_only_once_its_forged_source_is_proven(tmp_path: Path) -> None:
    """A forged pair of files: a module whose derived range asks for every element its source
    tensor declares, and a source whose chunks declare 30,000x their bytes. The range would be
    allocated on the word of the source's index; the source is proven by decoding first, so the
    load fails naming the source's chunk 0, having allocated a chunk at most."""
    from nvcomp_ckpt_engine import derived

    master = torch.randint(0, 4, (16 << 10,), generator=torch.Generator().manual_seed(6)).float()
    source, key = tmp_path / "opt.pt", "master"
    nce.save({key: master}, source, algorithm="zstd", chunk_mb=1 / 1024)
    module = tmp_path / "module.pt"
    nce.save({"w": master.to(torch.bfloat16)}, module, algorithm="zstd",
             derive=lambda t: [derived.Piece(0, t.numel(), source.name, key, 0)])

    def forge_source(index: dict[str, Any]) -> None:
        _spread(index["storages"][0]["codec"], FORGED_RATIO)(index)
        index["tensors"][0]["shape"] = [index["storages"][0]["nbytes"] // 4]

    reseal_index(source, forge_source)
    count = container.read_index(source).tensors[0].shape[0]

    def forge_module(index: dict[str, Any]) -> None:
        storage = index["storages"][0]
        storage["derived"][0]["count"], storage["nbytes"] = count, 2 * count
        index["tensors"][0]["shape"] = [count]

    reseal_index(module, forge_module)
    chunk = max(c.raw_length for c in container.read_index(source).storages[0].chunks)
    assert 2 * count > 150 << 20
    with largest_allocation() as largest, pytest.raises(CorruptCheckpointError) as info:
        nce.load(module)
    assert str(source) in str(info.value) and "chunk 0" in str(info.value), info.value
    assert largest[0] <= chunk + 1, largest


def test_zero_filled_storages_are_proven_then_load_bit_exact(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The legitimate case past the plausible expansion: 64 MiB of zeros code to a few KB.
    Their chunks decode twice (proof, then into the storage), the honest float tensor beside
    them once, and both load bit-exact, whole and by range."""
    zeros, floats = torch.zeros(64 << 20, dtype=torch.uint8), torch.randn(1 << 20)
    path = tmp_path / "zeros.nvckpt"
    nce.save({"zeros": zeros, "floats": floats}, path, algorithm="zstd", chunk_mb=4)
    index = container.read_index(path)
    by_key = {t.key: index.storages[t.storage] for t in index.tensors}
    assert by_key["zeros"].nbytes > formats.plausible_raw(sum(c.length for c in by_key["zeros"].chunks))
    decoded: list[int] = []
    decode = codecs.cpu.ZstdCodec.decode_batch

    def counted(self: Any, payloads: list[torch.Tensor], outs: list[torch.Tensor], **kw: Any) -> None:
        decoded.extend(out.numel() for out in outs)
        decode(self, payloads, outs, **kw)

    monkeypatch.setattr(codecs.cpu.ZstdCodec, "decode_batch", counted)
    loaded = nce.load(path)
    compressed = {key: [c.raw_length for c in s.chunks if not c.stored_raw] for key, s in by_key.items()}
    assert sorted(decoded) == sorted(compressed["zeros"] * 2 + compressed["floats"])
    assert_same_tensor(zeros, loaded["zeros"], "zeros")
    assert_same_tensor(floats, loaded["floats"], "floats")
    with lazy.LazyShard(path) as shard:
        part = shard.read(shard.obj["zeros"], (4 << 20) - 5, 9 << 20)
        assert torch.equal(part, zeros[(4 << 20) - 5 : (13 << 20) - 5])


def reseal_index_text(path: Path, edit: Callable[[str], str]) -> None:
    """Like `reseal_index`, on the index's JSON text (for values `json` cannot produce)."""
    data = path.read_bytes()
    offset, length, _, version, end = struct.unpack("<QQII8s", data[-container.TRAILER_SIZE:])
    body = edit(data[offset:offset + length].decode()).encode()
    path.write_bytes(data[:offset] + body + struct.pack(
        "<QQII8s", offset, len(body), zlib.crc32(body), version, end))


def _first_tensor(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda index: index["tensors"][0].update(fields)


#: Index values that passed validation and then made torch or the JSON parser raise their own
#: errors (not naming the file): each must be a CheckpointError naming the file.
HOSTILE_INDEX_VALUES: dict[str, Callable[[dict[str, Any]], None]] = {
    "stride-0 shape overflowing numel": _first_tensor(shape=[1 << 40, 1 << 40], stride=[0, 0]),
    "stride-0 shape of 2^63 elements": _first_tensor(shape=[1 << 62, 2], stride=[0, 0]),
    "requires_grad on int32": _first_tensor(dtype="int32", requires_grad=True),
    "requires_grad on bool": _first_tensor(dtype="bool", requires_grad=True, shape=[4], stride=[1]),
    "parameter requiring grad on uint8": _first_tensor(dtype="uint8", requires_grad=True,
                                                       parameter=True, shape=[4], stride=[1]),
    "device xpu:0": lambda i: i["storages"][0].update(device="xpu:0"),
    "device hpu": lambda i: i["storages"][0].update(device="hpu"),
    "device mps": lambda i: i["storages"][0].update(device="mps"),
    "device cuda:9999": lambda i: i["storages"][0].update(device="cuda:9999"),
    "codec brotli": lambda i: i["storages"][0].update(codec={"name": "brotli", "version": 1}),
    "codec zstd/2": lambda i: i["storages"][0].update(codec={"name": "zstd", "version": 2}),
    "transform xor": lambda i: i["storages"][0].update(transform={"name": "xor", "version": 1}),
    "transform byteplanes/2": lambda i: i["storages"][0].update(
        transform={"name": "byteplanes", "version": 2, "width": 4}),
    "byteplanes of width 3": lambda i: i["storages"][0].update(
        transform={"name": "byteplanes", "version": 1, "width": 3}),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_INDEX_VALUES))
def test_hostile_index_values_are_checkpoint_errors_naming_the_file(ckpt: Path, name: str) -> None:
    if name.startswith("device cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    shard = ckpt / TAG / OPTIM1
    reseal_index(shard, HOSTILE_INDEX_VALUES[name])
    with pytest.raises(CheckpointError) as info:
        nce.load(shard)
    assert str(shard) in str(info.value), info.value


#: A number of 5,000 digits: Python's JSON parser refuses to convert it (ValueError).
HUGE = "9" * 5000


@pytest.mark.parametrize("pattern", [r'"nbytes": *\d+', r'"offset": *\d+', r'"chunks": *\[\[\d+'])
def test_integers_too_long_to_parse_are_corruption(ckpt: Path, pattern: str) -> None:
    shard = ckpt / TAG / OPTIM1
    reseal_index_text(shard, lambda text: re.sub(pattern, lambda m: re.sub(r"\d+", HUGE, m[0]),
                                                  text, count=1))
    with pytest.raises(CorruptCheckpointError, match="not valid JSON") as info:
        nce.load(shard)
    assert str(shard) in str(info.value)
    status, output = verify(shard)
    assert status == 1 and output.count("FAULT:") == 1 and str(shard) in output, output


def test_byte_plane_chunks_must_hold_whole_elements(tmp_path: Path) -> None:
    """A storage written through the library's own writer whose chunks (each a real zstd
    frame, CRCs right) split its float32 elements: the transform could not undo the planes."""
    codec = codecs.ZstdCodec()
    writer = container.ShardWriter(tmp_path / "split.pt", durable=False)
    writer.write_skeleton(state.flatten({"w": torch.zeros(2048)}).skeleton)
    storage = writer.begin_storage(nbytes=8192, dtype="float32", device="cpu",
                                   codec=codec.descriptor(), transform=transforms.byteplanes(4))
    for size in (4098, 4094):
        payload = codec.encode_batch([torch.zeros(size, dtype=torch.uint8)])[0]
        writer.append_chunk(storage, payload.numpy(), raw_length=size, stored_raw=False)
    writer.finish([container.TensorEntry("w", 0, "float32", (2048,), (1,), 0, False, False)], {})
    with pytest.raises(CorruptCheckpointError, match="whole number of the transform's 4-byte"):
        nce.load(tmp_path / "split.pt")


def test_verify_reports_one_fault_per_damaged_file_and_goes_on(ckpt: Path) -> None:
    """Three files damaged three ways (a number the JSON parser refuses, in a file whose
    manifest record was updated to match it; a flipped chunk byte; a truncation): three FAULT
    lines, one naming each file, and exit status 1."""
    model = ckpt / TAG / "mp_rank_00_model_states.pt"
    optim0 = ckpt / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    reseal_index_text(model, lambda text: re.sub(r'"nbytes": *\d+', f'"nbytes": {HUGE}', text,
                                                  count=1))
    data = model.read_bytes()
    found = manifest.read_manifest(ckpt / TAG)
    manifest.write_manifest(ckpt / TAG, dataclasses.replace(found, files=tuple(
        dataclasses.replace(r, file_bytes=len(data), crc32=zlib.crc32(data))
        if r.path == model.name else r for r in found.files)))
    blob = container.read_index(optim0).storages[0].chunks[0]
    data = bytearray(optim0.read_bytes())
    data[blob.offset] ^= 0x01
    optim0.write_bytes(bytes(data))
    (ckpt / TAG / OPTIM1).write_bytes((ckpt / TAG / OPTIM1).read_bytes()[:-7])
    status, output = verify(ckpt / TAG)
    faults = [line for line in output.splitlines() if line.startswith("FAULT: ")]
    assert status == 1 and len(faults) == 3, output
    for path, words in ((model, "not valid JSON"), (optim0, "chunk 0"), (ckpt / TAG / OPTIM1, "bytes")):
        (line,) = [f for f in faults if path.name in f]
        assert words in line, line
    assert "Traceback" not in output


class _RunsCode:
    """Unpickling this calls os.system: what a hostile skeleton would do."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.sentinel}",))


def test_no_code_from_a_file_runs_unless_trusted(tmp_path: Path) -> None:
    sentinel = tmp_path / "ran"
    shard = tmp_path / "ckpt" / TAG / "mp_rank_00_model_states.pt"
    shard.parent.mkdir(parents=True)
    nce.save({"module": {"w": torch.ones(3)}, "hook": _RunsCode(sentinel)}, shard)
    with pytest.raises(UnsafeObjectError, match="system"):
        nce.load(shard)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        assert cli.main(["inspect", str(shard)]) == 0
        assert cli.main(["verify", "-q", str(shard)]) == 0
    with pytest.raises(UnsafeObjectError):
        with compat.patch_torch_load():
            torch.load(shard, weights_only=False)
    assert not sentinel.exists()
    nce.load(shard, trusted=True)  # the payload is live: trusted=True runs it
    assert sentinel.exists()
