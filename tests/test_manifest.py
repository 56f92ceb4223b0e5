"""The manifest as a document: schema, checksum, canonical form, path safety, its file
(the files it lists are checked against it in test_manifest_files.py).

Framework-free and fast: no torch, no processes. Every error path checks the text a user sees
(the file, the field, expected against actual).
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import zlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nvcomp_ckpt_engine import manifest as mf
from nvcomp_ckpt_engine.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DataParallelSizeError,
    IncompleteCheckpointError,
    UnsupportedCheckpointError,
)
from nvcomp_ckpt_engine.manifest import ShardRecord

SUFFIX_R1 = ".nvckpt-stage-r1-0123456789ab"


def record(path: str = "f0.pt", rank: int = 0, data: bytes = b"", **kw) -> ShardRecord:
    fields = dict(
        path=path, rank=rank, raw_bytes=2 * len(data), file_bytes=len(data),
        crc32=zlib.crc32(data), codecs=("zstd/1",), node="node0",
    )
    fields.update(kw)
    return ShardRecord(**fields)


def small_manifest(**kw) -> mf.Manifest:
    fields = dict(
        tag="global_step7",
        world_size=2,
        files=[record("a.pt", 0, b"aaaa"), record("sub/b.pt", 1, b"bb")],
        layout=mf.layout_record("deepspeed", dp=2, tp=1, pp=1, zero_stage=2),
        versions={"nvcomp_ckpt_engine": "0.1.0"},
        step=7,
        created_unix_ns=1_700_000_000_000_000_000,
        pending={1: SUFFIX_R1},
    )
    fields.update(kw)
    return mf.build_manifest(**fields)


def resealed(document: dict) -> bytes:
    """A document with a correct checksum for whatever it holds, in the canonical layout where
    that is possible (so schema checks, not the checksum, are what reject it)."""
    covered = {"body": document["body"], "format": document["format"],
               "version": document["version"]}
    canonical = json.dumps(covered, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    document = dict(document, sha256=hashlib.sha256(canonical.encode()).hexdigest())
    return (json.dumps(document, indent=1) + "\n").encode()


def document_of(manifest: mf.Manifest) -> dict:
    return json.loads(mf.serialize_manifest(manifest))


# ---------------------------------------------------------------------------------------------
# Round trips and the bytes on disk.


def test_round_trip_bytes_and_file(tmp_path: Path) -> None:
    manifest = small_manifest()
    data = mf.serialize_manifest(manifest)
    assert mf.parse_manifest(data) == manifest
    assert data.startswith(b'{\n "format": "nvcomp_ckpt_engine.manifest",\n "version": 1,\n')
    assert data.endswith(b"}\n") and data.isascii()
    json.loads(data)  # plain JSON for any other tool
    path = mf.write_manifest(tmp_path, manifest)
    assert path == tmp_path / mf.MANIFEST_NAME and path.read_bytes() == data
    assert mf.read_manifest(tmp_path) == manifest
    assert os.listdir(tmp_path) == [mf.MANIFEST_NAME]  # no temp file left behind


def test_one_record_per_line_sorted_by_rank_node_path() -> None:
    files = [record("z.pt", 1), record("b.pt", 0), record("a.pt", 1), record("c.pt", 0)]
    manifest = small_manifest(files=files, pending={})
    assert [(r.rank, r.path) for r in manifest.files] == [
        (0, "b.pt"), (0, "c.pt"), (1, "a.pt"), (1, "z.pt")
    ]
    lines = mf.serialize_manifest(manifest).decode().splitlines()
    assert sum(line.lstrip().startswith('{"codecs"') for line in lines) == 4


def test_empty_manifest_and_properties() -> None:
    manifest = small_manifest(files=[], pending={}, step=None, layout={}, versions={})
    assert mf.parse_manifest(mf.serialize_manifest(manifest)) == manifest
    full = small_manifest()
    assert full.raw_bytes == 12 and full.file_bytes == 6


SIZES = st.integers(1, (1 << 24) - 1)
#: Every kind of layout a writer records (`layout_record`), and a bare one of sizes alone.
LAYOUTS = st.one_of(
    st.builds(mf.layout_record, st.sampled_from(["dcp", "megatron", "torch"])),
    st.builds(mf.layout_record, st.just("deepspeed"), dp=SIZES, tp=SIZES, pp=SIZES,
              zero_stage=st.none() | st.integers(0, 3)),
    st.builds(mf.layout_record, st.just("deepspeed"), kind=st.just(mf.UNIVERSAL_LAYOUT_KIND),
              zero_stage=st.integers(0, 3), source_dp=SIZES, source_tp=SIZES, source_pp=SIZES),
    st.dictionaries(st.sampled_from(["dp", "tp", "pp", "zero_stage"]), st.integers(1, 3)),
)


@given(
    layout=LAYOUTS,
    paths=st.lists(
        st.from_regex(r"[A-Za-z0-9_-]{1,8}(/[A-Za-z0-9_.-]{1,8}){0,2}", fullmatch=True).filter(
            lambda p: all(part not in (".", "..") for part in p.split("/"))
        ),
        unique=True,
        max_size=5,
    ),
)
def test_round_trip_property(layout: dict, paths: list[str]) -> None:
    files = [record(p, i % 3, p.encode()) for i, p in enumerate(paths)]
    manifest = small_manifest(files=files, layout=layout, world_size=3, pending={})
    assert mf.parse_manifest(mf.serialize_manifest(manifest)) == manifest


# ---------------------------------------------------------------------------------------------
# Damage: every flipped byte, every truncation, arbitrary bytes.


def test_every_flipped_byte_is_detected() -> None:
    """Each byte XORed with each of 1..255, i.e. every single-byte change of the file."""
    data = mf.serialize_manifest(small_manifest())
    undetected = []
    for offset in range(len(data)):
        for mask in range(1, 256):
            damaged = bytearray(data)
            damaged[offset] ^= mask
            try:
                mf.parse_manifest(bytes(damaged), source="m.json")
            except CorruptCheckpointError as exc:
                assert str(exc).startswith("m.json: ")
            else:
                undetected.append((offset, mask))
    assert undetected == []


def test_every_truncation_and_extension_is_detected() -> None:
    data = mf.serialize_manifest(small_manifest())
    for n in range(len(data)):
        with pytest.raises(CorruptCheckpointError, match="^m.json: "):
            mf.parse_manifest(data[:n], source="m.json")
    for extra in (b"\n", b" ", b"{}", b"\x00"):
        with pytest.raises(CorruptCheckpointError):
            mf.parse_manifest(data + extra)


@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_checkpoint_errors(data: bytes) -> None:
    with pytest.raises(CheckpointError):
        mf.parse_manifest(data)


@given(st.data())
def test_damaged_values_with_a_valid_checksum_name_the_field(data: st.DataObject) -> None:
    """Resealed documents pass the checksum, so the schema itself must reject them."""
    document = document_of(small_manifest())
    body = document["body"]
    where = data.draw(st.sampled_from(
        ["tag", "world_size", "step", "created_unix_ns", "layout", "versions", "pending",
         "node_local_storage", "files", "files[0]", "files[0].path", "files[0].rank",
         "files[0].crc32", "files[0].file_bytes", "files[0].raw_bytes", "files[0].codecs",
         "files[0].node", "files[1].kind"]
    ))
    value = data.draw(st.sampled_from(
        [None, True, -1, 2**64, 1.5, "", "x" * 300, "../up", "/abs", [], [1], {}, {"k": 1}]
    ))
    target, key = body, where
    if where.startswith("files["):
        index, _, key = where[len("files["):].partition("].")
        target = body["files"]
        if not key:
            target, key = body["files"], int(index.rstrip("]"))
        else:
            target = body["files"][int(index)]
    target[key] = value
    with pytest.raises(CorruptCheckpointError, match="^m.json: ") as info:
        mf.parse_manifest(resealed(document), source="m.json")
    if "not in canonical form" in str(info.value):
        mf._manifest_from_body(body)  # only the layout was off: the value itself is valid
    else:
        assert where.split("[")[0].split(".")[0] in str(info.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(extra=1), r"unknown keys \['extra'\]"),
        (lambda d: d["body"].update(extra=1), r"body has unknown keys \['extra'\]"),
        (lambda d: d["body"].pop("step"), r"body has unknown keys \[\] and lacks keys \['step'\]"),
        (lambda d: d["body"]["files"][0].update(mode=0o644),
         r"files\[0\] has unknown keys \['mode'\]"),
        (lambda d: d["body"]["files"][1].update(kind="symlink"),
         r"files\[1\]\.kind is 'symlink'; this reader knows only 'shard'"),
        (lambda d: d["body"]["files"][0].update(path="../../etc/passwd"),
         r"files\[0\]\.path '\.\./\.\./etc/passwd' has an empty, '\.' or '\.\.' component"),
        (lambda d: d["body"]["files"][0].update(rank=True), r"files\[0\]\.rank must be an int"),
        (lambda d: d["body"]["files"][0].update(rank=5),
         r"files\[0\] \('a\.pt'\) has rank 5, outside world size 2"),
        (lambda d: d["body"]["files"][1].update(path="a.pt", rank=0),
         r"path 'a\.pt' is listed twice: by rank 0 and by rank 0"),
        (lambda d: d["body"].update(pending={"0": SUFFIX_R1}),
         r"pending\.0 must look like '\.nvckpt-stage-r0-<12 hex>'"),
        (lambda d: d["body"].update(layout={"dp": "2"}), r"layout\.dp must be an int"),
        (lambda d: d["body"].update(versions={"a": 1}), r"versions\.a must be a str"),
        (lambda d: d.update(format="other"), r"field format is not 'nvcomp_ckpt_engine\.manifest'"),
    ],
)
def test_schema_violations_are_named(change, message: str) -> None:
    document = document_of(small_manifest())
    change(document)
    with pytest.raises(CorruptCheckpointError, match=f"^m.json: .*{message}"):
        mf.parse_manifest(resealed(document), source="m.json")


def test_checksum_and_canonical_form_messages() -> None:
    data = mf.serialize_manifest(small_manifest())
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch: field sha256 says"):
        mf.parse_manifest(data.replace(b'"global_step7"', b'"global_step8"'), source="m")
    with pytest.raises(CorruptCheckpointError, match="not in canonical form .*byte"):
        mf.parse_manifest(data.replace(b'": ', b'":  ', 1), source="m")
    with pytest.raises(CorruptCheckpointError, match="version field is damaged"):
        mf.parse_manifest(data.replace(b'"version": 1', b'"version": 4'), source="m")
    duplicated = data.replace(b' "version": 1,', b' "version": 1,\n "version": 1,')
    with pytest.raises(CorruptCheckpointError, match="duplicate key 'version'"):
        mf.parse_manifest(duplicated, source="m")
    with pytest.raises(CorruptCheckpointError, match="non-ASCII byte 0xc3 at offset"):
        mf.parse_manifest(data.replace(b"global", "glöbal".encode()), source="m")
    with pytest.raises(CorruptCheckpointError, match="empty file"):
        mf.parse_manifest(b"", source="m")


def test_newer_version_is_unsupported_not_corrupt() -> None:
    document = document_of(small_manifest())
    document["version"] = 4
    with pytest.raises(UnsupportedCheckpointError, match="manifest version 4; .* reads version 1 and 2 and 3. "
                       "Upgrade nvcomp_ckpt_engine"):
        mf.parse_manifest(resealed(document), source="m")


def test_oversized_manifest_is_refused_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(CorruptCheckpointError, match="more than the 100 a manifest may have"):
        mf.parse_manifest(mf.serialize_manifest(small_manifest()), source="m")


def test_deeply_nested_json_is_corrupt_not_a_crash() -> None:
    with pytest.raises(CorruptCheckpointError):
        mf.parse_manifest(b"[" * 100_000 + b"]" * 100_000)


# ---------------------------------------------------------------------------------------------
# Building: caller mistakes are TypeError/ValueError naming the field.


@pytest.mark.parametrize(
    "bad",
    ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a/.", "a\\b", "C:/x", "a/\x00b",
     "x.nvckpt-partial", "y.pt.nvckpt-stage-r0-0123456789ab", mf.MANIFEST_NAME,
     mf.TAG_MARKER_NAME, "a/" + "n" * 256, "tab\there"],
)
def test_unsafe_record_paths_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="^path "):
        record(bad)


@pytest.mark.parametrize("good", ["a.pt", "sub/dir/file.pt", "..hidden", "a..b", "x y.pt",
                                  "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                  "sub/nvcomp_manifest.json"])
def test_safe_record_paths_are_accepted(good: str) -> None:
    assert record(good).path == good


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"rank": -1}, ValueError, r"rank must be in \[0, "),
        ({"rank": 1.0}, TypeError, "rank must be an int, got float"),
        ({"crc32": 2**32}, ValueError, r"crc32 must be in \[0, 4294967295\]"),
        ({"file_bytes": True}, TypeError, "file_bytes must be an int, got bool"),
        ({"codecs": "zstd"}, TypeError, "codecs must be a sequence of codec names"),
        ({"codecs": ("zs td",)}, ValueError, r"codecs\[0\] must match"),
        ({"node": ""}, ValueError, "node must have 1 to 255 characters"),
        ({"path": 3}, TypeError, "path must be a str, got int"),
    ],
)
def test_record_field_errors(kw: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        record(**kw)


def test_build_cross_checks() -> None:
    with pytest.raises(ValueError, match=r"files\[1\] \('b'\) has rank 2, outside world size 2"):
        small_manifest(files=[record("a"), record("b", 2)])
    with pytest.raises(ValueError, match="path 'a' is listed twice: by rank 0 and by rank 1"):
        small_manifest(files=[record("a", 0), record("a", 1)])
    with pytest.raises(ValueError, match="path 'a' on node 'n1' is listed twice"):
        small_manifest(files=[record("a", 0, node="n1"), record("a", 1, node="n1")],
                       node_local_storage=True)
    same_path_two_nodes = [record("a", 0, node="n0"), record("a", 1, node="n1")]
    assert len(small_manifest(files=same_path_two_nodes, node_local_storage=True).files) == 2
    with pytest.raises(ValueError, match=r"pending key must be in \[0, 1\]"):
        small_manifest(pending={5: ".nvckpt-stage-r5-0123456789ab"})
    with pytest.raises(TypeError, match=r"files\[0\] must be a ShardRecord"):
        small_manifest(files=[{"path": "a"}])
    with pytest.raises(ValueError, match="tag '../x' has an empty"):
        small_manifest(tag="../x")
    with pytest.raises(ValueError, match=r"layout\.dp must be finite"):
        small_manifest(layout={"dp": float("nan")})
    with pytest.raises(ValueError, match=r"layout\.zero_stage must be in \[0, "):
        small_manifest(layout={"zero_stage": -1})


def test_manifest_is_immutable() -> None:
    manifest = small_manifest()
    with pytest.raises(AttributeError):
        manifest.tag = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        manifest.layout["dp"] = 3  # type: ignore[index]


# ---------------------------------------------------------------------------------------------
# Reading from disk.


def test_read_manifest_errors(tmp_path: Path) -> None:
    with pytest.raises(IncompleteCheckpointError, match=f"{tmp_path}: no nvcomp_manifest.json"):
        mf.read_manifest(tmp_path)
    (tmp_path / mf.MANIFEST_NAME).write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match=f"{tmp_path / mf.MANIFEST_NAME}: empty"):
        mf.read_manifest(tmp_path)
    (tmp_path / mf.MANIFEST_NAME).unlink()
    (tmp_path / mf.MANIFEST_NAME).mkdir()
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        mf.read_manifest(tmp_path)


def test_read_manifest_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / mf.MANIFEST_NAME)
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        mf.read_manifest(tmp_path)


def test_a_sparse_manifest_far_larger_than_a_manifest_may_be_is_refused_unread(
        tmp_path: Path) -> None:
    """A manifest made sparse and larger than `MAX_MANIFEST_BYTES` (1 byte past it, 256 MiB of
    holes) is refused by its size from fstat, before a byte is read: the reader allocated the
    256 MiB first."""
    import tracemalloc

    mf.write_manifest(tmp_path, small_manifest(), durable=False)
    os.truncate(tmp_path / mf.MANIFEST_NAME, mf.MAX_MANIFEST_BYTES + 1)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=rf"{mf.MANIFEST_NAME}: "
                           rf"{mf.MAX_MANIFEST_BYTES + 1} bytes, more than the .*refused unread"):
            mf.read_manifest(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse it"


def test_check_layout() -> None:
    manifest = small_manifest()
    mf.check_layout(manifest, {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3})
    mf.check_layout(manifest, {"tp": 1})  # missing keys are not compared
    with pytest.raises(UnsupportedCheckpointError, match=r"ckpt \(tag 'global_step7'\) was saved "
                       r"with a different parallel layout \(dp: saved 2, now 4; tp: saved 1, now "
                       r"2\)\. Load it with the saved layout, or `nvcomp-ckpt decompress`"):
        mf.check_layout(manifest, {"dp": 4, "tp": 2, "pp": 1}, source="ckpt")
    with pytest.raises(UnsupportedCheckpointError) as info:
        mf.check_layout(manifest, {"dp": 4, "tp": 2, "pp": 1}, source="ckpt")
    assert not isinstance(info.value, DataParallelSizeError)  # not the data-parallel size alone
    with pytest.raises(DataParallelSizeError) as info:
        mf.check_layout(manifest, {"dp": 4}, source="ckpt")
    assert "DeepSpeed" not in str(info.value) and "ds_config" not in str(info.value)
    with pytest.raises(UnsupportedCheckpointError, match=r"now 4\)\. The adapter's own route$"):
        mf.check_layout(manifest, {"dp": 4}, source="ckpt", remedy="The adapter's own route")
    mf.check_layout(manifest, {"dp": 4}, keys=("tp", "pp"))


# ---------------------------------------------------------------------------------------------
# The layout: one schema, one builder, for every writer.

GOLDEN = Path(__file__).parent / "golden"


def test_layout_record_builds_the_one_schema() -> None:
    """Its arguments are the schema's keys, so a writer cannot spell a key otherwise."""
    arguments = inspect.signature(mf.layout_record).parameters
    assert set(arguments) == set(mf.LAYOUT_SCHEMA)
    assert mf.layout_record("deepspeed", dp=4, tp=2, pp=1, zero_stage=2) == {
        "dp": 4, "framework": "deepspeed", "pp": 1, "tp": 2, "zero_stage": 2}
    assert mf.layout_record("dcp") == {"framework": "dcp"}
    with pytest.raises(ValueError, match=r"layout of framework 'deepspeed' lacks keys "
                       r"\['tp', 'pp'\], which a load compares"):
        mf.layout_record("deepspeed", dp=2)
    with pytest.raises(ValueError, match=r"kind 'deepspeed-universal' lacks keys \['source_dp'"):
        mf.layout_record("deepspeed", kind=mf.UNIVERSAL_LAYOUT_KIND, zero_stage=2)
    with pytest.raises(ValueError, match=r"layout\.framework must be one of \['dcp', "):
        mf.layout_record("deepspeeed")
    with pytest.raises(ValueError, match=r"layout\.zero_stage must be in \[0, 3\]"):
        mf.layout_record("deepspeed", dp=1, tp=1, pp=1, zero_stage=4)


@pytest.mark.parametrize("key, meant", [
    ("dp_size", "dp"), ("tp_size", "tp"), ("zero_stag", "zero_stage"), ("sourcedp", "source_dp"),
])
def test_a_misspelled_layout_key_is_refused_when_written_and_read(key: str, meant: str) -> None:
    """A layout key a load does not compare would let a checkpoint skip the layout check."""
    layout = {**mf.layout_record("deepspeed", dp=2, tp=1, pp=1), key: 2}
    words = rf"layout has unknown key '{key}' \(did you mean '{meant}'\?\); a layout holds only"
    with pytest.raises(ValueError, match=words):
        small_manifest(layout=layout)
    document = document_of(small_manifest())
    document["body"]["layout"] = layout
    with pytest.raises(CorruptCheckpointError, match=f"^m.json: {words}"):
        mf.parse_manifest(resealed(document), source="m.json")


def test_an_old_compress_manifest_is_read_in_todays_keys() -> None:
    """`nvcomp-ckpt compress` 0.1.0 wrote dp_size/tp_size/pp_size (golden file: its manifest of
    a plain ZeRO-2 checkpoint at data-parallel size 2): read as dp/tp/pp, so a load at another
    size is refused as for a checkpoint the engine saved; anything else with those keys is not."""
    data = (GOLDEN / "compress_0.1.0_manifest.json").read_bytes()
    found = mf.parse_manifest(data, source="m.json")
    assert dict(found.layout) == mf.layout_record("deepspeed", dp=2, tp=1, pp=1, zero_stage=2)
    assert dict(found.versions) == {"deepspeed": "0.19.8", "nvcomp_ckpt_engine": "0.1.0"}
    with pytest.raises(UnsupportedCheckpointError, match=r"dp: saved 2, now 4"):
        mf.check_layout(found, mf.layout_record("deepspeed", dp=4, tp=1, pp=1, zero_stage=2))
    assert mf.parse_manifest(mf.serialize_manifest(found)) == found  # rewritten: today's keys
    with pytest.raises(CorruptCheckpointError, match="not in canonical form"):
        mf.parse_manifest(data.replace(b'"zero_stage": 2}', b'"zero_stage": 2 }'), source="m")
    document = json.loads(data)
    del document["body"]["layout"]["world_size"]  # not the layout compress wrote
    with pytest.raises(CorruptCheckpointError,
                       match=r"unknown key 'deepspeed_version'; a layout holds only"):
        mf.parse_manifest(resealed(document), source="m.json")


def test_every_writer_builds_its_layout_with_layout_record() -> None:
    """No module of the package spells a layout itself: a `layout=` argument or a dict with a
    "framework" key anywhere but in `manifest.py` would be a second writer of the schema."""
    package = Path(mf.__file__).parent
    spelled = []
    for path in sorted(package.rglob("*.py")):
        if path == Path(mf.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            literal = [k.value for k in node.keywords if k.arg == "layout"] \
                if isinstance(node, ast.Call) else []
            if any(isinstance(value, ast.Dict) for value in literal) or (
                    isinstance(node, ast.Dict) and any(
                        isinstance(key, ast.Constant) and key.value == "framework"
                        for key in node.keys)):
                spelled.append(f"{path.relative_to(package)}:{node.lineno}")
    assert spelled == []


# ---------------------------------------------------------------------------------------------
# The I/O path a record may carry (version 3).


def test_io_record_round_trips_as_version_3(monkeypatch: pytest.MonkeyPatch) -> None:
    with_io = small_manifest(files=[record("a.pt", 0, b"aaaa", io="gds-compat"),
                                    record("sub/b.pt", 1, b"bb")])
    data = mf.serialize_manifest(with_io)
    assert json.loads(data)["version"] == 3
    assert b'"file_bytes": 4, "io": "gds-compat", "kind": "shard"' in data  # sorted, one line
    parsed = mf.parse_manifest(data, source="m")
    assert parsed == with_io and [r.io for r in parsed.files] == ["gds-compat", None]
    assert json.loads(mf.serialize_manifest(small_manifest()))["version"] == 1  # none: as before
    monkeypatch.setattr(mf, "READ_VERSIONS", (1, 2))  # a reader from before the record
    with pytest.raises(UnsupportedCheckpointError, match="manifest version 3; .* Upgrade"):
        mf.parse_manifest(data, source="m")


def _edited_in_place(data: bytes, old: bytes, new: bytes) -> bytes:
    """Canonical manifest bytes with `old` replaced by `new` and the checksum sealed again."""
    edited = data.replace(old, new)
    assert edited != data
    document = json.loads(edited)
    covered = {key: document[key] for key in ("body", "format", "version")}
    sha = hashlib.sha256(json.dumps(covered, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return edited.replace(document["sha256"].encode(), sha.encode())


def test_io_record_must_match_the_version_and_name_a_known_path() -> None:
    with_io = mf.serialize_manifest(small_manifest(files=[record("a.pt", 0, b"aaaa", io="pinned")]))
    without = mf.serialize_manifest(small_manifest())
    for forged in (_edited_in_place(with_io, b' "io": "pinned",', b""),  # version 3, no io
                   _edited_in_place(without, b'"file_bytes": 4, "kind"',  # version 1 with one
                                    b'"file_bytes": 4, "io": "pinned", "kind"')):
        with pytest.raises(CorruptCheckpointError, match="not in canonical form"):
            mf.parse_manifest(forged, source="m.json")
    document = json.loads(with_io)
    document["body"]["files"][0]["io"] = "nvme"
    with pytest.raises(CorruptCheckpointError, match=r"^m.json: files\[0\]\.io is 'nvme'; expected one of"):
        mf.parse_manifest(resealed(document), source="m.json")
    with pytest.raises(ValueError, match="io is 'posix'"):
        record("a.pt", io="posix")
