"""Fuzzing the two parsers that read untrusted bytes: the shard reader (`container.read_index`,
then `nvcomp_ckpt_engine.load`) and the manifest parser (`manifest.parse_manifest`).

The property is the same everywhere: whatever the bytes, the reader either returns a valid
result or raises one of the engine's `CheckpointError`s; never another exception, a hang or a
huge allocation. Besides raw bytes, the inputs are *structured* mutations of valid files whose
checksums are then recomputed (a forger's file, or a bug in a writer), so the validators behind
the checksums are reached.

Example counts come from the hypothesis profile (tests/conftest.py): "ci" by default, a longer
run with HYPOTHESIS_PROFILE=long; docs/RELIABILITY.md gives the command and the last counts.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import container, manifest
from nvcomp_ckpt_engine.errors import CheckpointError

#: Each fuzz test runs this many times the profile's example count (ci: 60 -> 600 examples;
#: long: 2000 -> 20,000).
SCALE = 10
#: CI runs a fixed sequence of examples (derandomized, no example database), so a test passes
#: or fails the same way on every run; the long profile explores afresh each time.
LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
FUZZ = settings(max_examples=SCALE * settings.default.max_examples, deadline=None,
                derandomize=not LONG, database=settings.default.database if LONG else None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

JSON_LEAVES = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)


# ------------------------------------------------------------------------- sample files


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """A small shard with what real state holds: several dtypes, a view sharing a storage,
    a parameter, 0-d and empty tensors, Python values, many chunks."""
    path = tmp_path_factory.mktemp("fuzz") / "shard.pt"
    base = torch.randn(64)
    state = {"w": torch.nn.Parameter(torch.randn(8, 8)), "b": torch.randn(40).bfloat16(),
             "view": base[8:40:2], "base": base, "step": torch.tensor(3),
             "empty": torch.empty(0, 3), "ids": torch.arange(20, dtype=torch.int16),
             "meta": {"lr": 0.1, "betas": (0.9, 0.999), "name": "adam"}}
    nce.save(state, path, algorithm="zstd", chunk_mb=1 / 1024)
    return path, path.read_bytes()


@pytest.fixture(scope="module")
def manifest_bytes() -> bytes:
    records = [manifest.ShardRecord(path=f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", rank=r,
                                    raw_bytes=1000 + r, file_bytes=900 + r, crc32=r,
                                    codecs=("zstd",), node="node0") for r in range(2)]
    found = manifest.build_manifest(tag="global_step3", world_size=2, files=records,
                                    layout={"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2},
                                    versions={"torch": "2.13.0"}, step=3,
                                    created_unix_ns=1_700_000_000_000_000_000,
                                    pending={1: ".nvckpt-stage-r1-0123456789ab"})
    return manifest.serialize_manifest(found)


# ------------------------------------------------------------------ mutating JSON documents


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON document, as a key path (the root is ())."""
    found = [prefix]
    if isinstance(obj, dict):
        for key, value in obj.items():
            found += _paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            found += _paths(value, prefix + (i,))
    return found


@st.composite
def mutated(draw: Any, document: Any) -> Any:
    """`document` after 1 to 3 edits: a value replaced, a key or element removed, a key added."""
    doc = json.loads(json.dumps(document))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        op = draw(st.sampled_from(["replace", "remove", "add"]))
        if not path:
            doc = draw(JSON_VALUES) if op == "replace" else doc
            continue
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if op == "replace":
            parent[path[-1]] = draw(JSON_VALUES)
        elif op == "remove":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(JSON_VALUES)
        else:
            parent.insert(path[-1], draw(JSON_VALUES))
    return doc


def reseal_shard(data: bytes, index: Any) -> bytes:
    """`data` with its index replaced by `index`, and CRC and trailer made to fit."""
    offset, _, _, version, end = struct.unpack("<QQII8s", data[-container.TRAILER_SIZE:])
    body = json.dumps(index).encode()
    return data[:offset] + body + struct.pack("<QQII8s", offset, len(body), zlib.crc32(body),
                                              version, end)


def reseal_manifest(document: Any) -> bytes:
    """A manifest document with its SHA-256 recomputed where the envelope allows it."""
    if isinstance(document, dict) and {"body", "format", "version"} <= set(document):
        covered = {k: document[k] for k in ("body", "format", "version")}
        try:
            canonical = json.dumps(covered, sort_keys=True, separators=(",", ":"),
                                   ensure_ascii=True, allow_nan=False)
            document["sha256"] = hashlib.sha256(canonical.encode("ascii")).hexdigest()
        except (TypeError, ValueError):
            pass  # a key type or value JSON cannot hash canonically: leave the old checksum
    return json.dumps(document).encode()


def read_shard(path: Path) -> None:
    """Read a shard as a tool and as a loader would; only CheckpointError may escape."""
    try:
        container.read_index(path)
    except CheckpointError:
        return
    try:
        container.verify_file(path)
        nce.load(path, map_location="cpu")
    except CheckpointError:
        pass


# ---------------------------------------------------------------------------- the shard


@FUZZ
@given(blob=st.binary(max_size=8192), keep_header=st.booleans())
def test_arbitrary_bytes_as_a_shard(shard: tuple[Path, bytes], blob: bytes,
                                    keep_header: bool) -> None:
    path = shard[0].with_name("bytes.pt")
    path.write_bytes((container.header_bytes() if keep_header else b"") + blob)
    read_shard(path)


@FUZZ
@given(data=st.data())
def test_mutated_shard_index_resealed(shard: tuple[Path, bytes], data: Any) -> None:
    path, original = shard
    index = container.read_index(path)
    offset = index.file_bytes - container.TRAILER_SIZE
    start = index.storages[-1].chunks[-1].offset + index.storages[-1].chunks[-1].length
    document = json.loads(original[start:offset])
    target = path.with_name("index.pt")
    target.write_bytes(reseal_shard(original, data.draw(mutated(document))))
    read_shard(target)


@FUZZ
@given(data=st.data())
def test_byte_edits_of_a_shard_are_detected(shard: tuple[Path, bytes], data: Any) -> None:
    """Overwrites, insertions and deletions anywhere: the unchanged CRCs must notice."""
    path, original = shard
    damaged = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(damaged) - 1))
        op = data.draw(st.sampled_from(["set", "insert", "delete"]))
        if op == "set":
            damaged[pos] = data.draw(st.integers(0, 255))
        elif op == "insert":
            damaged[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
        else:
            del damaged[pos:pos + data.draw(st.integers(1, 16))]
    if bytes(damaged) == original:
        return
    target = path.with_name("edited.pt")
    target.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError):
        container.verify_file(target)
    with pytest.raises(CheckpointError):
        nce.load(target, map_location="cpu")


# ------------------------------------------------------------------------- the manifest


@FUZZ
@given(blob=st.binary(max_size=4096))
def test_arbitrary_bytes_as_a_manifest(blob: bytes) -> None:
    try:
        manifest.parse_manifest(blob)
    except CheckpointError:
        pass


@FUZZ
@given(data=st.data())
def test_mutated_manifest_resealed(manifest_bytes: bytes, data: Any) -> None:
    document = data.draw(mutated(json.loads(manifest_bytes)))
    blob = reseal_manifest(document)
    try:
        parsed = manifest.parse_manifest(blob)
    except CheckpointError:
        return
    # Accepted: then it is exactly what the writer would write for its content.
    assert manifest.serialize_manifest(parsed) == blob


RECORD_PATHS = st.one_of(
    st.from_regex(r"[a-z_]{1,12}(/[a-z_0-9.]{1,12}){0,2}\.pt", fullmatch=True),
    st.sampled_from(["/abs.pt", "../up.pt", "a/../b.pt", "./a.pt", "a//b.pt", "a\\b.pt",
                     "C:/x.pt", "nvcomp_manifest.json", "x.nvckpt-stage-r0-0123456789ab", ""]),
    st.text(max_size=16))


@FUZZ
@given(paths=st.lists(RECORD_PATHS, min_size=1, max_size=4),
       ranks=st.lists(st.integers(-1, 4), min_size=4, max_size=4),
       sizes=st.lists(st.integers(-1, 2**64), min_size=4, max_size=4),
       world_size=st.integers(0, 4), step=st.none() | st.integers(-1, 2**63),
       layout=st.dictionaries(st.sampled_from(["dp", "tp", "pp", "zero_stage", "x"]),
                              JSON_LEAVES, max_size=4))
def test_built_manifests_round_trip_or_are_refused(paths: list[str], ranks: list[int],
                                                   sizes: list[int], world_size: int,
                                                   step: int | None, layout: dict) -> None:
    """Whatever a writer passes: refused with TypeError/ValueError when building, or written,
    parsed back equal, and never naming a path outside the tag folder."""
    try:
        records = [manifest.ShardRecord(path=p, rank=ranks[i], raw_bytes=sizes[i],
                                        file_bytes=sizes[-1 - i], crc32=sizes[i] % 2**32,
                                        codecs=("zstd",), node="n0")
                   for i, p in enumerate(paths)]
        built = manifest.build_manifest(tag="t", world_size=world_size, files=records,
                                        layout=layout, step=step, created_unix_ns=1)
        blob = manifest.serialize_manifest(built)
    except (TypeError, ValueError):
        return
    parsed = manifest.parse_manifest(blob)
    assert parsed == built
    for record in parsed.files:
        parts = record.path.split("/")
        assert not record.path.startswith("/") and ".." not in parts and "" not in parts
