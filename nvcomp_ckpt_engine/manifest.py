"""The manifest: the one file whose presence makes a checkpoint complete.

A tag folder (`save_dir/tag/`) holds every rank's shard files and, once all of them are durable,
one `nvcomp_manifest.json`, written last by the distributed commit (`commit.py`). A checkpoint is
complete if and only if its manifest exists, is intact, and agrees with the files; a folder
without one is an interrupted save, whatever else it holds. This module is the manifest as a
document: its schema, its checksum, its validation, its file (read and written atomically); the
files it lists are checked against it on disk by `manifest_files`. Neither imports torch nor
DeepSpeed, so the CLI can inspect and verify checkpoints on machines without either.

On-disk form, version 1
-----------------------
ASCII JSON, top-level keys in this order, one body key and one file record per line, ending
with one newline::

    {
     "format": "nvcomp_ckpt_engine.manifest",
     "version": 1,
     "sha256": "<64 lowercase hex digits>",
     "body": {
      "created_unix_ns": 1764403200000000000,   # when the commit ran (rank 0's clock)
      "files": [                                # one record per shard file, by (rank, node, path)
       {"codecs": ["zstd/1"], "crc32": 305419896, "file_bytes": 1048576, "kind": "shard",
        "node": "node017", "path": "zero_pp_rank_3_mp_rank_00_optim_states.pt", "rank": 3,
        "raw_bytes": 1258291}
      ],
      "layout": {"dp": 8, "framework": "deepspeed", "pp": 1, "tp": 1, "zero_stage": 2},
      "node_local_storage": false,              # paths repeat per node when true
      "pending": {"3": ".nvckpt-stage-r3-0123456789ab"},         # see "Re-saving a tag" below
      "step": 100,                              # or null
      "tag": "global_step100",
      "versions": {"nvcomp_ckpt_engine": "0.1.0"},
      "world_size": 8
     }
    }

(Shown with comments and wrapped lines for reading; the file has neither.) Body keys, record
keys and layout keys are sorted. `sha256` is the SHA-256 of `{"body", "format", "version"}` as
compact canonical JSON (sorted keys, `,` and `:` separators, ASCII), so it covers everything but
itself. A reader also requires the file to be byte for byte what `serialize_manifest` writes for
the parsed content, so *every* changed byte is caught: a changed value by the checksum, a changed
space, key order or final newline by the canonical form. Unknown keys and unknown record kinds
are errors, never skipped: the file is the contract. A different `version` is
`UnsupportedCheckpointError` (a newer writer); anything else wrong is `CorruptCheckpointError`,
naming the manifest file and the field.

Version 2 is version 1 with ``zero_partitions`` in the layout (below); a manifest is written in
the lowest version that holds it (`manifest_version`), so one without the record is byte for
byte a version-1 manifest and older readers keep reading it, while a version-1 reader refuses
one with the record as newer instead of calling it damaged. A version that disagrees with the
content (a record in a version-1 manifest) is not the canonical form, and refused as damaged.

Version 3 adds ``io`` to file records: the way the file's GPU payloads reached it (`IO_RECORDS`:
``"gds"``, ``"gds-compat"``, ``"pinned"``, ``"host"``; `pipeline.io_path`), for a reader
comparing saves. A record may lack it (files listed by writers that do not know it, a DCP
``.metadata``); a manifest with no ``io`` in any record is written as version 1 or 2, as before,
and a version-2 reader refuses a version-3 one as newer. It is a record of the save, not
checked against the file.

The layout
----------
`layout` says how the files were saved, so that a load at another parallel layout is refused
(`check_layout`). Its keys are one schema for every writer (`LAYOUT_SCHEMA`), built by one
function (`layout_record`): the DeepSpeed engine, `nvcomp-ckpt compress` and `to-universal`, the
DCP writer and the Megatron strategy all call it, so a reader finds the keys it compares, and a
key spelled otherwise (``dp_size`` for ``dp``) is refused when written and when read. A
DeepSpeed layout records ``dp``, ``tp`` and ``pp``; a universal one (``kind``
``deepspeed-universal``) its ZeRO stage and the sizes of the checkpoint it was made from. A
ZeRO-1/2 save also records ``zero_partitions``: where each parameter sits in the flat
partitions, for a load at another data-parallel size (docs/FORMAT.md, `reshard`).

`nvcomp-ckpt compress` of version 0.1.0 wrote ``dp_size``, ``tp_size`` and ``pp_size`` (with
``world_size``, ``node_local_storage`` and ``deepspeed_version``, said elsewhere in the body):
a manifest with exactly that layout is read as today's (``dp``, ``tp``, ``pp``; the DeepSpeed
version in `versions`), so such a checkpoint keeps loading, and its layout is checked.

Paths
-----
Record paths are POSIX, relative to the tag folder, and may not leave it: no absolute paths, no
`..`, `.` or empty components, no backslashes or drive letters, and nothing in the engine's own
namespace (names containing `.nvckpt-`, the manifest, the tag marker). Links are a matter of the
files on disk: `manifest_files.verify_files` refuses a file whose real path is outside the real
tag folder, and anything that is not a regular file (opening a FIFO would hang a load).

Re-saving a tag
---------------
When a tag that already has a manifest is saved again, each rank writes its files under a staged
name (`<path><suffix>`, suffix `.nvckpt-stage-r<rank>-<12 hex>`) so the old checkpoint stays
loadable until the new manifest replaces the old one. The new manifest lists the final paths and,
in `pending`, each staging rank's suffix: for such a record the staged file, while it exists, *is*
the record's file (the rename to the final name is atomic, so one of the two always holds the new
bytes; `manifest_files.record_file`). `commit.finish_pending_renames` completes the renames; the
suffixes are random per save, so an older manifest never mistakes a newer save's staged files
for its own.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import re
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .storage import locations
from .errors import (
    CorruptCheckpointError, DataParallelSizeError, IncompleteCheckpointError, UnsupportedCheckpointError,
)

#: File name of the manifest inside a tag folder.
MANIFEST_NAME = "nvcomp_manifest.json"
#: `format` value of every manifest.
FORMAT_NAME = "nvcomp_ckpt_engine.manifest"
#: The newest manifest schema version, which this module writes where a manifest needs it
#: (`manifest_version`), and every version it reads.
FORMAT_VERSION = 3
READ_VERSIONS = (1, 2, 3)
#: Marker file `commit.prepare_tag_dir` leaves in every tag folder the engine saved into.
TAG_MARKER_NAME = ".nvcomp_ckpt_engine_tag"
#: Names containing this are the engine's own (temp, staged, trash); records may not use it.
RESERVED_MARK = ".nvckpt-"
#: Upper bound on a manifest's size: about a million records; larger means a damaged file.
MAX_MANIFEST_BYTES = 256 << 20
#: Shape of a staged-file suffix (see "Re-saving a tag").
STAGE_SUFFIX_RE = re.compile(r"\.nvckpt-stage-r(?P<rank>[0-9]+)-[0-9a-f]{12}")

_INT64_MAX = 2**63 - 1
_MAX_PATH_CHARS = 4096
_MAX_NAME_CHARS = 255
_TOP_KEYS = ("format", "version", "sha256", "body")
_BODY_KEYS = frozenset(
    {"created_unix_ns", "files", "layout", "node_local_storage", "pending", "step", "tag",
     "versions", "world_size"}
)
_RECORD_KEYS = frozenset(
    {"codecs", "crc32", "file_bytes", "kind", "node", "path", "rank", "raw_bytes"}
)
#: The record key that may be absent (version 3; see "On-disk form").
_RECORD_IO = "io"
#: What a record's ``io`` may say: how the file's GPU payloads reached it (`pipeline.io_path`).
IO_RECORDS = frozenset({"gds", "gds-compat", "pinned", "host"})
_RECORD_KIND = "shard"
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_CODEC_RE = re.compile(r"[A-Za-z0-9_.+/-]{1,64}")
#: `kind` of the layout of DeepSpeed's universal checkpoint (`nvcomp-ckpt to-universal`).
UNIVERSAL_LAYOUT_KIND = "deepspeed-universal"
#: Every key a manifest's layout may hold and its values: an int in a range, or a name from a
#: set (see "The layout" above; `layout_record` is its one builder).
LAYOUT_SCHEMA: Mapping[str, range | frozenset[str] | type] = MappingProxyType({
    "framework": frozenset({"dcp", "deepspeed", "megatron", "torch"}),
    "kind": frozenset({UNIVERSAL_LAYOUT_KIND}),
    "dp": range(1, 1 << 24), "tp": range(1, 1 << 24), "pp": range(1, 1 << 24),
    "zero_stage": range(0, 4),
    "source_dp": range(1, 1 << 24), "source_tp": range(1, 1 << 24),
    "source_pp": range(1, 1 << 24),
    # Where each parameter sits in the ZeRO-1/2 flat partitions (`_check_zero_partitions`).
    "zero_partitions": list,
})
#: The keys of one param group's record in ``zero_partitions``, and of one parameter's.
_ZERO_GROUP_KEYS = frozenset({"alignment", "partition_numel", "params"})
_ZERO_PARAM_KEYS = frozenset({"dtype", "name", "offset", "shape"})
#: The keys a layout of each (framework, kind) must hold: those its readers compare.
_LAYOUT_REQUIRED = {
    ("deepspeed", None): ("dp", "tp", "pp"),
    ("deepspeed", UNIVERSAL_LAYOUT_KIND): ("zero_stage", "source_dp", "source_tp", "source_pp"),
}
#: The layout keys `nvcomp-ckpt compress` 0.1.0 wrote, and today's name of each it kept.
_OLD_COMPRESS_NAMES = {"dp_size": "dp", "tp_size": "tp", "pp_size": "pp"}
_OLD_COMPRESS_ALWAYS = frozenset({"framework", "node_local_storage", "world_size",
                                  *_OLD_COMPRESS_NAMES})
_OLD_COMPRESS_SOMETIMES = frozenset({"deepspeed_version", "zero_stage"})


# ---------------------------------------------------------------------------------------------
# Field validation. These raise TypeError/ValueError naming the field: caller misuse when
# building, re-raised as CorruptCheckpointError (with the file's name) when parsing.


def _check_int(value: Any, field: str, *, lo: int = 0, hi: int = _INT64_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{field} must be in [{lo}, {hi}], got {value}")
    return int(value)


def _check_text(value: Any, field: str, *, max_chars: int = _MAX_NAME_CHARS) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, got {type(value).__name__} {value!r}")
    if not value or len(value) > max_chars:
        raise ValueError(f"{field} must have 1 to {max_chars} characters, got {len(value)}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError(f"{field} must not contain control characters, got {value!r}")
    return value


def validate_relative_path(path: Any, *, field: str = "path") -> str:
    """Return `path` if it is a safe POSIX path relative to a tag folder; raise otherwise.

    Safe means it cannot name anything outside the folder by itself (symlinks are checked when
    files are opened) and does not collide with the engine's own files.
    """
    path = _check_text(path, field, max_chars=_MAX_PATH_CHARS)
    if "\\" in path:
        raise ValueError(f"{field} {path!r} contains a backslash; use '/' (POSIX) separators")
    if path.startswith("/") or re.match(r"[A-Za-z]:", path):
        raise ValueError(f"{field} {path!r} is absolute; it must be relative to the tag folder")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(
                f"{field} {path!r} has an empty, '.' or '..' component; it must stay inside "
                "the tag folder"
            )
        if len(part) > _MAX_NAME_CHARS:
            raise ValueError(f"{field} {path!r} has a component longer than {_MAX_NAME_CHARS}")
        if RESERVED_MARK in part:
            raise ValueError(
                f"{field} {path!r} uses the engine's reserved name mark {RESERVED_MARK!r}"
            )
    if path in (MANIFEST_NAME, TAG_MARKER_NAME):
        raise ValueError(f"{field} {path!r} is reserved for the engine's own file")
    return path


def validate_tag(tag: Any, *, field: str = "tag") -> str:
    """Return `tag` if it can name a tag folder under save_dir (same rules as record paths)."""
    tag = validate_relative_path(tag, field=field)
    if tag != tag.strip():
        raise ValueError(f"{field} {tag!r} has leading or trailing whitespace")
    return tag


def _check_codecs(value: Any, field: str) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{field} must be a sequence of codec names, got {value!r}")
    names = tuple(value)
    for i, name in enumerate(names):
        if not isinstance(name, str) or not _CODEC_RE.fullmatch(name):
            raise ValueError(
                f"{field}[{i}] must match {_CODEC_RE.pattern} (e.g. 'zstd/1'), got {name!r}"
            )
    return names


def _json_value(value: Any, field: str, depth: int = 0) -> Any:
    """A checked deep copy of a JSON value: dicts with str keys, lists, scalars, finite floats."""
    if depth > 16:
        raise ValueError(f"{field} is nested deeper than 16 levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{field} must be finite, got {value!r}")
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for key in sorted(value, key=str):
            if not isinstance(key, str):
                raise TypeError(f"{field} keys must be str, got {type(key).__name__} {key!r}")
            out[key] = _json_value(value[key], f"{field}.{key}", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_json_value(v, f"{field}[{i}]", depth + 1) for i, v in enumerate(value)]
    raise TypeError(f"{field} must be a JSON value, got {type(value).__name__} {value!r}")


def _check_layout(layout: Any, field: str = "layout") -> dict[str, Any]:
    if not isinstance(layout, Mapping):
        raise TypeError(f"{field} must be a dict, got {type(layout).__name__}")
    checked = _json_value(layout, field)
    for key, value in checked.items():
        allowed = LAYOUT_SCHEMA.get(key)
        if allowed is None:
            raise ValueError(_unknown_layout_key(key, field))
        if allowed is list:
            _check_zero_partitions(value, f"{field}.{key}")
        elif isinstance(allowed, range):
            _check_int(value, f"{field}.{key}", lo=allowed.start, hi=allowed.stop - 1)
        elif not isinstance(value, str) or value not in allowed:
            raise ValueError(f"{field}.{key} must be one of {sorted(allowed)}, got {value!r}")
    required = _LAYOUT_REQUIRED.get((checked.get("framework"), checked.get("kind")), ())
    missing = [key for key in required if key not in checked]
    if missing:
        raise ValueError(
            f"{field} of framework {checked.get('framework')!r}"
            + (f" and kind {checked['kind']!r}" if "kind" in checked else "")
            + f" lacks keys {missing}, which a load compares"
        )
    return checked


def _check_zero_partitions(groups: Any, field: str) -> None:
    """The shape of a ``zero_partitions`` record (see "The layout"): per param group its
    alignment, the elements of each rank's flat partition, and its parameters in flat order,
    each with its name, shape, dtype and element offset in the group's flat buffer. Whether the
    offsets fit together is the reader's check (`reshard.ZeroLayout`)."""
    if not isinstance(groups, list):
        raise TypeError(f"{field} must be a list of param groups, got {type(groups).__name__}")
    for g, group in enumerate(groups):
        where = f"{field}[{g}]"
        if not isinstance(group, Mapping):
            raise TypeError(f"{where} must be an object, got {type(group).__name__}")
        _check_keys(group, _ZERO_GROUP_KEYS, where)
        _check_int(group["alignment"], f"{where}.alignment", lo=1, hi=1 << 20)
        _check_int(group["partition_numel"], f"{where}.partition_numel")
        if not isinstance(group["params"], list):
            raise TypeError(f"{where}.params must be a list, got {type(group['params']).__name__}")
        for i, param in enumerate(group["params"]):
            at = f"{where}.params[{i}]"
            if not isinstance(param, Mapping):
                raise TypeError(f"{at} must be an object, got {type(param).__name__}")
            _check_keys(param, _ZERO_PARAM_KEYS, at)
            _check_text(param["name"], f"{at}.name", max_chars=_MAX_PATH_CHARS)
            _check_text(param["dtype"], f"{at}.dtype")
            _check_int(param["offset"], f"{at}.offset")
            if not isinstance(param["shape"], list):
                raise TypeError(f"{at}.shape must be a list, got {type(param['shape']).__name__}")
            for d, size in enumerate(param["shape"]):
                _check_int(size, f"{at}.shape[{d}]")


def _unknown_layout_key(key: str, field: str) -> str:
    """The error for a layout key outside the schema, with the key it likely means."""
    close = difflib.get_close_matches(key, LAYOUT_SCHEMA, n=1)
    meant = _OLD_COMPRESS_NAMES.get(key) or (close[0] if close else None)
    return (f"{field} has unknown key {key!r}" + (f" (did you mean {meant!r}?)" if meant else "")
            + f"; a layout holds only {sorted(LAYOUT_SCHEMA)}")


def layout_record(
    framework: str,
    *,
    dp: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    zero_stage: int | None = None,
    kind: str | None = None,
    source_dp: int | None = None,
    source_tp: int | None = None,
    source_pp: int | None = None,
    zero_partitions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The `layout` a manifest records, checked against `LAYOUT_SCHEMA`; raises ValueError.

    The one builder of it, for every writer, so that what a save records is what a load
    compares (`check_layout`, with a layout built here too): `dp`, `tp`, `pp` are the data-,
    tensor- and pipeline-parallel sizes, `zero_stage` DeepSpeed's; a universal checkpoint's
    (`kind` `UNIVERSAL_LAYOUT_KIND`) records the sizes of its source as `source_dp`,
    `source_tp`, `source_pp`. `zero_partitions`: what a load at another data-parallel size
    needs of a ZeRO-1/2 save (`reshard.ZeroLayout.to_record`). Arguments left None are not
    recorded.
    """
    fields = {"framework": framework, "dp": dp, "tp": tp, "pp": pp, "zero_stage": zero_stage,
              "kind": kind, "source_dp": source_dp, "source_tp": source_tp,
              "source_pp": source_pp, "zero_partitions": zero_partitions}
    return _check_layout({key: value for key, value in fields.items() if value is not None})


def _read_old_compress_layout(
    layout: Mapping[str, Any], versions: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The layout and versions of a manifest `nvcomp-ckpt compress` 0.1.0 wrote, in today's
    keys; None for any other layout. Its DeepSpeed version moves to `versions`; its world size
    and node-local flag, which the body holds, are dropped."""
    keys = set(layout)
    if (layout.get("framework") != "deepspeed" or not _OLD_COMPRESS_ALWAYS <= keys
            or not keys <= _OLD_COMPRESS_ALWAYS | _OLD_COMPRESS_SOMETIMES):
        return None
    _check_int(layout["world_size"], "layout.world_size", lo=1)
    if not isinstance(layout["node_local_storage"], bool):
        raise TypeError(f"layout.node_local_storage must be a bool, got "
                        f"{layout['node_local_storage']!r}")
    current = {new: layout[old] for old, new in _OLD_COMPRESS_NAMES.items()}
    if "zero_stage" in layout:
        current["zero_stage"] = layout["zero_stage"]
    versions = dict(versions)
    if "deepspeed_version" in layout:
        versions.setdefault("deepspeed", layout["deepspeed_version"])
    return layout_record("deepspeed", **current), versions


def _check_versions(versions: Any, field: str = "versions") -> dict[str, str]:
    if not isinstance(versions, Mapping):
        raise TypeError(f"{field} must be a dict of str to str, got {type(versions).__name__}")
    out = {}
    for key in sorted(versions, key=str):
        _check_text(key, f"{field} key")
        out[key] = _check_text(versions[key], f"{field}.{key}")
    return out


def _check_pending(pending: Any, world_size: int, field: str = "pending") -> dict[int, str]:
    if not isinstance(pending, Mapping):
        raise TypeError(f"{field} must be a dict of rank to suffix, got {type(pending).__name__}")
    out = {}
    for key, suffix in pending.items():
        if isinstance(key, str) and re.fullmatch(r"0|[1-9][0-9]{0,8}", key):
            key = int(key)
        rank = key
        rank = _check_int(rank, f"{field} key", hi=world_size - 1)
        suffix = _check_text(suffix, f"{field}.{rank}")
        match = STAGE_SUFFIX_RE.fullmatch(suffix)
        if match is None or int(match["rank"]) != rank:
            raise ValueError(
                f"{field}.{rank} must look like '.nvckpt-stage-r{rank}-<12 hex>', got {suffix!r}"
            )
        out[rank] = suffix
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------
# The records and the manifest.


@dataclasses.dataclass(frozen=True)
class ShardRecord:
    """One shard file as its writer reported it: where it is, who wrote it, how big, its CRC.

    `path` is POSIX and relative to the tag folder; `crc32` covers the whole file (what
    the shard writer computes while writing); `raw_bytes` is the uncompressed
    payload size (for the compression ratio), `file_bytes` the size on disk. `node` is the
    writer's host name: with node-local storage each node sees only its own files. `io`: the
    way its GPU payloads were written (`IO_RECORDS`), None where the writer did not say.
    """

    path: str
    rank: int
    raw_bytes: int
    file_bytes: int
    crc32: int
    codecs: tuple[str, ...] = ()
    node: str = dataclasses.field(default_factory=socket.gethostname)
    io: str | None = None

    def __post_init__(self) -> None:
        validate_relative_path(self.path)
        _check_int(self.rank, "rank")
        _check_int(self.raw_bytes, "raw_bytes")
        _check_int(self.file_bytes, "file_bytes")
        _check_int(self.crc32, "crc32", hi=0xFFFFFFFF)
        object.__setattr__(self, "codecs", _check_codecs(self.codecs, "codecs"))
        _check_text(self.node, "node")
        if self.io is not None and (not isinstance(self.io, str) or self.io not in IO_RECORDS):
            raise ValueError(f"io is {self.io!r}; expected one of {sorted(IO_RECORDS)}")

    def to_json(self) -> dict[str, Any]:
        """The record as it appears in the manifest (also what ranks exchange at commit)."""
        record = {
            "codecs": list(self.codecs),
            "crc32": self.crc32,
            "file_bytes": self.file_bytes,
            "kind": _RECORD_KIND,
            "node": self.node,
            "path": self.path,
            "rank": self.rank,
            "raw_bytes": self.raw_bytes,
        }
        if self.io is not None:
            record[_RECORD_IO] = self.io
        return dict(sorted(record.items()))

    @classmethod
    def from_json(cls, obj: Any, *, field: str = "record") -> ShardRecord:
        """Parse a record; unknown keys or kinds raise ValueError naming `field`."""
        if not isinstance(obj, Mapping):
            raise TypeError(f"{field} must be an object, got {type(obj).__name__}")
        kind = obj.get("kind")
        if kind != _RECORD_KIND:
            raise ValueError(
                f"{field}.kind is {kind!r}; this reader knows only {_RECORD_KIND!r} (a newer "
                "nvcomp_ckpt_engine may have written it)"
            )
        _check_keys(obj, (_RECORD_KEYS | {_RECORD_IO}) if _RECORD_IO in obj else _RECORD_KEYS, field)
        if not isinstance(obj["codecs"], list):
            raise TypeError(f"{field}.codecs must be a list, got {type(obj['codecs']).__name__}")
        try:
            return cls(
                path=obj["path"], rank=obj["rank"], raw_bytes=obj["raw_bytes"],
                file_bytes=obj["file_bytes"], crc32=obj["crc32"], codecs=obj["codecs"],
                node=obj["node"], io=obj.get(_RECORD_IO),
            )
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{field}.{exc}") from None


def _check_keys(obj: Mapping, expected: frozenset[str], field: str) -> None:
    keys = set(obj)
    if keys != expected:
        unknown, missing = sorted(keys - expected), sorted(expected - keys)
        raise ValueError(f"{field} has unknown keys {unknown} and lacks keys {missing}")


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The parsed, validated content of one manifest (see the module docstring for the schema).

    Build one with `build_manifest`, which checks every field and the records against each
    other; the constructor itself does not validate.
    """

    tag: str
    created_unix_ns: int
    step: int | None
    world_size: int
    layout: Mapping[str, Any]
    versions: Mapping[str, str]
    files: tuple[ShardRecord, ...]
    node_local_storage: bool = False
    pending: Mapping[int, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    @property
    def raw_bytes(self) -> int:
        """Uncompressed bytes of all files."""
        return sum(r.raw_bytes for r in self.files)

    @property
    def file_bytes(self) -> int:
        """Bytes on disk of all files."""
        return sum(r.file_bytes for r in self.files)


def build_manifest(
    *,
    tag: str,
    world_size: int,
    files: Iterable[ShardRecord],
    layout: Mapping[str, Any],
    versions: Mapping[str, str] | None = None,
    step: int | None = None,
    created_unix_ns: int,
    node_local_storage: bool = False,
    pending: Mapping[int, str] | None = None,
) -> Manifest:
    """Validate everything a manifest says and return it; raises TypeError/ValueError.

    Checks across records: ranks below `world_size`, no path listed twice (per node when
    `node_local_storage`, since each node then has its own folder), staging suffixes only for
    ranks that exist.
    """
    validate_tag(tag)
    world_size = _check_int(world_size, "world_size", lo=1, hi=1 << 24)
    if step is not None:
        _check_int(step, "step")
    _check_int(created_unix_ns, "created_unix_ns")
    if not isinstance(node_local_storage, bool):
        raise TypeError(f"node_local_storage must be a bool, got {node_local_storage!r}")
    records = []
    for i, record in enumerate(files):
        if not isinstance(record, ShardRecord):
            raise TypeError(f"files[{i}] must be a ShardRecord, got {type(record).__name__}")
        if record.rank >= world_size:
            raise ValueError(
                f"files[{i}] ({record.path!r}) has rank {record.rank}, outside world size "
                f"{world_size}"
            )
        records.append(record)
    records.sort(key=lambda r: (r.rank, r.node, r.path))
    _check_unique_paths(records, node_local_storage)
    return Manifest(
        tag=tag,
        created_unix_ns=created_unix_ns,
        step=step,
        world_size=world_size,
        layout=MappingProxyType(_check_layout(layout)),
        versions=MappingProxyType(_check_versions(versions or {})),
        files=tuple(records),
        node_local_storage=node_local_storage,
        pending=MappingProxyType(_check_pending(pending or {}, world_size)),
    )


def _check_unique_paths(records: list[ShardRecord], node_local_storage: bool) -> None:
    seen: dict[tuple[str, str], ShardRecord] = {}
    for record in records:
        key = (record.node if node_local_storage else "", record.path)
        other = seen.setdefault(key, record)
        if other is not record:
            where = f" on node {record.node!r}" if node_local_storage else ""
            raise ValueError(
                f"path {record.path!r}{where} is listed twice: by rank {other.rank} and by rank "
                f"{record.rank} (two ranks would overwrite each other's file)"
            )


# ---------------------------------------------------------------------------------------------
# Bytes.


def _body_json(manifest: Manifest) -> dict[str, Any]:
    return {
        "created_unix_ns": manifest.created_unix_ns,
        "files": [r.to_json() for r in manifest.files],
        "layout": dict(manifest.layout),
        "node_local_storage": manifest.node_local_storage,
        "pending": {str(rank): suffix for rank, suffix in manifest.pending.items()},
        "step": manifest.step,
        "tag": manifest.tag,
        "versions": dict(manifest.versions),
        "world_size": manifest.world_size,
    }


def manifest_version(manifest: Manifest) -> int:
    """The lowest version that holds `manifest`: 3 for a file record with ``io``, 2 for a
    layout with ``zero_partitions`` (a reader of an older version refuses it, asking for an
    upgrade, instead of calling it damaged), 1 for anything else, byte for byte what version-1
    writers wrote."""
    if any(record.io is not None for record in manifest.files):
        return 3
    return 2 if "zero_partitions" in manifest.layout else 1


def _document_sha256(body: Any, version: Any = FORMAT_VERSION) -> str:
    """SHA-256 over the canonical JSON of everything in the document but the checksum itself.

    Raises ValueError for values JSON cannot represent canonically (an overflowed float).
    """
    covered = {"body": body, "format": FORMAT_NAME, "version": version}
    canonical = json.dumps(
        covered, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def serialize_manifest(manifest: Manifest) -> bytes:
    """The manifest's file content: canonical, checksummed JSON with one record per line.

    Written by hand rather than with `json.dumps(indent=...)` so that each record stays on one
    line (readable with `less` or `grep` at thousands of ranks); every value is still produced by
    `json.dumps`, so the text is valid JSON and deterministic.
    """
    body = _body_json(manifest)
    version = manifest_version(manifest)
    lines = [
        "{",
        f' "format": {_compact(FORMAT_NAME)},',
        f' "version": {version},',
        f' "sha256": "{_document_sha256(body, version)}",',
        ' "body": {',
    ]
    items = list(body.items())
    for i, (key, value) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        if key == "files" and value:
            lines.append(f"  {_compact(key)}: [")
            lines.extend(
                f"   {_compact(record)}{',' if j < len(value) - 1 else ''}"
                for j, record in enumerate(value)
            )
            lines.append(f"  ]{comma}")
        else:
            lines.append(f"  {_compact(key)}: {_compact(value)}{comma}")
    lines += [" }", "}", ""]
    return "\n".join(lines).encode("ascii")


def _compact(value: Any) -> str:
    # Keys are already sorted where the schema says so; sort_keys would also reorder nothing.
    return json.dumps(value, separators=(", ", ": "), ensure_ascii=True, allow_nan=False)


def parse_manifest(data: bytes, *, source: str = "<manifest bytes>") -> Manifest:
    """Parse and fully validate manifest bytes; errors name `source` and the field at fault."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(
            f"{source}: {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have"
        )
    document = _decode_json(data, source)
    body = _check_envelope(document, source)
    try:
        manifest, as_written = _manifest_from_body(body)
    except (TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{source}: {exc}") from None
    canonical = serialize_manifest(as_written)
    if canonical != data:
        offset = next(
            (i for i, (a, b) in enumerate(zip(canonical, data, strict=False)) if a != b),
            min(len(canonical), len(data)),
        )
        raise CorruptCheckpointError(
            f"{source}: the checksum matches but the file is not in canonical form (first "
            f"difference at byte {offset}; {len(data)} bytes, expected {len(canonical)}): it was "
            "edited or damaged outside its values"
        )
    return manifest


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-finite number {name}")


def _decode_json(data: bytes, source: str) -> Any:
    if not data:
        raise CorruptCheckpointError(f"{source}: empty file (the write did not finish)")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(
            f"{source}: non-ASCII byte 0x{data[exc.start]:02x} at offset {exc.start}; a manifest "
            "is ASCII"
        ) from None
    try:
        return json.loads(
            text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant
        )
    except json.JSONDecodeError as exc:
        raise CorruptCheckpointError(
            f"{source}: not valid JSON ({exc.msg} at byte {exc.pos}); truncated or damaged"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{source}: not a valid manifest: {exc}") from None


def _check_envelope(document: Any, source: str) -> dict[str, Any]:
    """Check format, version and checksum; return the body (still unvalidated)."""
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(
            f"{source}: field format is not {FORMAT_NAME!r}; not an nvcomp_ckpt_engine manifest "
            "or damaged"
        )
    try:
        _check_keys(document, frozenset(_TOP_KEYS), "the top level")
    except ValueError as exc:
        raise CorruptCheckpointError(f"{source}: {exc}") from None
    stored, version = document["sha256"], document["version"]
    if not isinstance(stored, str) or not _SHA256_RE.fullmatch(stored):
        raise CorruptCheckpointError(f"{source}: field sha256 is not 64 hex digits: {stored!r}")
    try:
        computed = _document_sha256(document["body"], version)
        as_known = {v: _document_sha256(document["body"], v) for v in READ_VERSIONS}
    except ValueError as exc:
        raise CorruptCheckpointError(f"{source}: field body: {exc}") from None
    if isinstance(version, bool) or version not in READ_VERSIONS:
        for known, checksum in as_known.items():
            if stored == checksum:
                raise CorruptCheckpointError(
                    f"{source}: field version is {version!r} but the checksum is that of "
                    f"version {known}: the version field is damaged"
                )
        raise UnsupportedCheckpointError(
            f"{source}: manifest version {version!r}; this installation reads version "
            f"{' and '.join(map(str, READ_VERSIONS))}. Upgrade nvcomp_ckpt_engine to read it (or "
            "the file is damaged)"
        )
    if computed != stored:
        raise CorruptCheckpointError(
            f"{source}: checksum mismatch: field sha256 says {stored}, the content hashes to "
            f"{computed}; the manifest is damaged"
        )
    if not isinstance(document["body"], dict):
        raise CorruptCheckpointError(f"{source}: field body is not an object")
    return document["body"]


def _manifest_from_body(body: dict[str, Any]) -> tuple[Manifest, Manifest]:
    """The manifest the body says, and the one whose serialization the file must be: the same,
    but for an old `compress` layout (read in today's keys, written in its own)."""
    _check_keys(body, _BODY_KEYS, "body")
    files = body["files"]
    if not isinstance(files, list):
        raise TypeError(f"files must be a list, got {type(files).__name__}")
    records = [ShardRecord.from_json(obj, field=f"files[{i}]") for i, obj in enumerate(files)]
    if not isinstance(body["node_local_storage"], bool):
        raise TypeError(f"node_local_storage must be a bool, got {body['node_local_storage']!r}")
    for key in ("layout", "versions", "pending"):  # build_manifest also takes None for these
        if not isinstance(body[key], dict):
            raise TypeError(f"{key} must be an object, got {type(body[key]).__name__}")
    world_size = _check_int(body["world_size"], "world_size", lo=1, hi=1 << 24)
    layout, versions = body["layout"], body["versions"]
    old_compress = _read_old_compress_layout(layout, versions)
    found = build_manifest(
        tag=body["tag"],
        world_size=world_size,
        files=records,
        layout=layout if old_compress is None else old_compress[0],
        versions=versions if old_compress is None else old_compress[1],
        step=body["step"],
        created_unix_ns=body["created_unix_ns"],
        node_local_storage=body["node_local_storage"],
        pending=body["pending"],
    )
    if old_compress is None:
        return found, found
    return found, dataclasses.replace(
        found, layout=MappingProxyType(_json_value(layout, "layout")),
        versions=MappingProxyType(_check_versions(versions)))


# ---------------------------------------------------------------------------------------------
# The manifest's own file.


def manifest_path(tag_dir: str | os.PathLike) -> Path | locations.UrlLocation:
    """Where the manifest of the checkpoint in `tag_dir` (a folder or a URL) lives."""
    return locations.location(tag_dir) / MANIFEST_NAME


def write_manifest(
    tag_dir: str | os.PathLike, manifest: Manifest, *, durable: bool = True, if_absent: bool = False
) -> Path | locations.UrlLocation:
    """Publish `manifest` in `tag_dir` atomically (temp, fsync, rename, fsync of the folder; one
    PUT on an object store). `if_absent`: refuse (`PreconditionFailed`) if the tag already has
    one, so that two writers cannot both commit it.

    This is the commit point of a checkpoint: call it only once every file it lists is durable.
    """
    path = manifest_path(tag_dir)
    locations.publish(path, serialize_manifest(manifest), durable=durable, if_absent=if_absent)
    return path


def read_manifest(tag_dir: str | os.PathLike) -> Manifest:
    """Read and validate the manifest of `tag_dir`.

    Raises IncompleteCheckpointError when there is none (the save did not finish),
    CorruptCheckpointError when it is damaged, UnsupportedCheckpointError for a newer version.
    """
    path = manifest_path(tag_dir)
    try:
        data = locations.read_small(path, MAX_MANIFEST_BYTES, what="a manifest")
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{tag_dir}: no {MANIFEST_NAME}: the save of this checkpoint did not finish, or "
            "nvcomp_ckpt_engine did not write it"
        ) from None
    except ValueError as exc:  # larger than a manifest may be, or not a regular file
        raise CorruptCheckpointError(str(exc)) from None
    return parse_manifest(data, source=str(path))


# ---------------------------------------------------------------------------------------------
# The saved parallel layout against the caller's.


def check_layout(
    manifest: Manifest,
    layout: Mapping[str, Any],
    *,
    keys: Iterable[str] = ("dp", "tp", "pp"),
    source: str = "the checkpoint",
    remedy: str | None = None,
) -> None:
    """Raise UnsupportedCheckpointError if `layout` differs from the saved one in any of `keys`
    (`DataParallelSizeError` where only the data-parallel size does).

    `layout` is built by `layout_record`, as the saved one was. Keys missing on either side are
    not compared (a DeepSpeed layout always records dp, tp and pp; other frameworks' may record
    none). `remedy` ends the message: what the caller's framework offers (its adapter's own
    text); the default names only what holds for every framework.
    """
    diffs = [
        f"{key}: saved {manifest.layout[key]!r}, now {layout[key]!r}"
        for key in keys
        if key in manifest.layout and key in layout and manifest.layout[key] != layout[key]
    ]
    if diffs:
        only_dp = all(diff.startswith("dp:") for diff in diffs)
        raise (DataParallelSizeError if only_dp else UnsupportedCheckpointError)(
            f"{source} (tag {manifest.tag!r}) was saved with a different parallel layout ("
            + "; ".join(diffs)
            + "). "
            + (remedy or "Load it with the saved layout, or `nvcomp-ckpt decompress` it to "
               "plain torch files and convert those with your framework's own tools")
        )


__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "LAYOUT_SCHEMA",
    "MANIFEST_NAME",
    "RESERVED_MARK",
    "STAGE_SUFFIX_RE",
    "TAG_MARKER_NAME",
    "UNIVERSAL_LAYOUT_KIND",
    "Manifest",
    "ShardRecord",
    "build_manifest",
    "check_layout",
    "layout_record",
    "manifest_version",
    "manifest_path",
    "parse_manifest",
    "read_manifest",
    "serialize_manifest",
    "validate_relative_path",
    "validate_tag",
    "write_manifest",
]
