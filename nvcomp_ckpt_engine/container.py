"""One shard file: the on-disk format, its writer and its validating reader.

Layout (docs/FORMAT.md is the specification; integers are little-endian):

    [0, 4096)        header: a pickle "guard" (so `torch.load` on the file raises a clear
                     message instead of an unpickling traceback), then at offset 1024 the magic
                     b"NVCOMPCK", u32 format version, u32 header size (4096), zero padding
    [4096, ...)      blobs, back to back with no gaps: the skeleton, then every storage's
                     compressed chunks in index order
    [index_offset, file_size - 32)   the JSON index (UTF-8)
    [file_size - 32, file_size)      trailer: u64 index offset, u64 index length,
                                     u32 CRC-32 of the index, u32 format version, b"NVCKEND\\n"

The index comes last so a shard is written in one sequential pass (sizes are known only after
compression). The reader trusts nothing: every offset and length is checked against the file
size and against each other (blobs must tile the region between header and index exactly),
declared sizes are checked against shape × dtype, and each blob's CRC-32 is checked before its
bytes are decoded.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import re
import struct
import zipfile
import zlib
from dataclasses import asdict, dataclass
from typing import Any

from .errors import CorruptCheckpointError, UnsupportedCheckpointError
from .formats import DIGEST_LIMIT, ITEMSIZES, MAX_EXPANSION, max_ratio, plane_width
from .checksums import crc32_combine
from .storage import Reader, ReaderIO, ShortReadError, Sink, locations

#: The newest format version. A writer uses the lowest version that expresses its file
#: (`version_for`): one using nothing beyond version 1 is version 1, byte for byte what earlier
#: releases wrote, so older readers keep reading it.
FORMAT_VERSION = 4
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3, 4)
#: The version that introduced storages with derived ranges (bytes held by another file).
DERIVED_VERSION = 2
#: The version that introduced Python attributes in the skeleton's tensor references,
#: ``("tensor", i, attributes)``: a version-2 reader would call them corruption.
TENSOR_ATTRIBUTES_VERSION = 3
#: The version whose derived ranges record the digest of their bytes as saved
#: (`DerivedRange.digest`): what identifies the source a reader rebuilds them from.
DERIVED_DIGEST_VERSION = 4


def version_for(*, derived: bool, tensor_attributes: bool, derived_digests: bool = False) -> int:
    """The lowest format version that holds a file with (or without) derived storages, their
    ranges' digests, and tensors carrying Python attributes (docs/FORMAT.md, "Versions")."""
    if derived_digests:
        return DERIVED_DIGEST_VERSION
    if tensor_attributes:
        return TENSOR_ATTRIBUTES_VERSION
    return DERIVED_VERSION if derived else 1
#: Characters a derived range's source file name may hold: a plain name in the same folder.
_SOURCE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,254}")
HEADER_SIZE = 4096
MAGIC = b"NVCOMPCK"
MAGIC_OFFSET = 1024
END_MAGIC = b"NVCKEND\n"
_HEADER_FIELDS = struct.Struct("<8sII")
_TRAILER = struct.Struct("<QQII8s")
TRAILER_SIZE = _TRAILER.size
#: Largest JSON index a reader accepts; a real one is well under a megabyte per 10k tensors.
MAX_INDEX_BYTES = 1 << 30
#: Largest raw chunk a reader accepts. With the most one payload byte may expand to (its codec's
#: bound, `formats.max_ratio`, else `MAX_EXPANSION`), it bounds what a hostile index can make the
#: decoder allocate: a storage's raw size is at most its stored bytes times that ratio.
MAX_CHUNK_BYTES = 1 << 30
#: Largest element count of a tensor (torch counts them in a signed 64-bit integer).
_MAX_NUMEL = (1 << 63) - 1
#: Dtypes whose tensors may require gradients (torch refuses it for the others).
_GRAD_DTYPES = ("float16", "bfloat16", "float32", "float64", "complex32", "complex64",
                "complex128")

TORCH_LOAD_MESSAGE = (
    "This file is an nvcomp_ckpt_engine compressed shard, not a torch.save file. Load it with "
    "nvcomp_ckpt_engine.load(path), or convert the checkpoint folder to plain torch files with "
    "`nvcomp-ckpt decompress CKPT_DIR OUT_DIR`."
)


def _guard_pickle(message: str) -> bytes:
    """A protocol-2 pickle that calls nvcomp_ckpt_engine.compat.refuse_torch_load(message)."""
    text = message.encode("utf-8")
    return (
        b"\x80\x02cnvcomp_ckpt_engine.compat\nrefuse_torch_load\n"
        + b"X" + struct.pack("<I", len(text)) + text
        + b"\x85R."
    )


GUARD = _guard_pickle(TORCH_LOAD_MESSAGE)
if len(GUARD) > MAGIC_OFFSET:  # pragma: no cover - guards a future edit of the message
    raise RuntimeError("the torch.load guard no longer fits in front of the magic")


def header_bytes(version: int = FORMAT_VERSION) -> bytes:
    """The fixed 4096-byte header of a shard file."""
    header = bytearray(HEADER_SIZE)
    header[: len(GUARD)] = GUARD
    header[MAGIC_OFFSET : MAGIC_OFFSET + _HEADER_FIELDS.size] = _HEADER_FIELDS.pack(
        MAGIC, version, HEADER_SIZE
    )
    return bytes(header)


def __getattr__(name: str) -> Any:
    """`DTYPES` (format dtype name -> torch.dtype) and `DTYPE_NAMES` (its inverse), built on
    first use: reading and checking an index needs only `formats.ITEMSIZES`, not torch."""
    if name not in ("DTYPES", "DTYPE_NAMES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    dtypes = {n: getattr(torch, n) for n in ITEMSIZES}
    globals().update(DTYPES=dtypes, DTYPE_NAMES={dtype: n for n, dtype in dtypes.items()})
    return globals()[name]

#: Device strings a storage may record: device types that hold tensor data, and an index.
_DEVICE = re.compile(r"(cpu|cuda|xpu|mps|hpu|npu)(:\d{1,4})?")


@dataclass(frozen=True)
class Blob:
    """A run of bytes in the file: a compressed chunk or the skeleton.

    `stored_raw` marks a chunk kept uncompressed because the codec did not make it smaller.
    """

    offset: int
    length: int
    raw_length: int
    crc32: int
    stored_raw: bool = False

    def to_json(self) -> list[int]:
        return [self.offset, self.length, self.raw_length, self.crc32, int(self.stored_raw)]


@dataclass(frozen=True)
class DerivedRange:
    """Bytes of a storage that the file does not hold: they are elements of a tensor of another
    file of the same checkpoint, cast to `dtype` (format version 2).

    `at` is the byte offset in the storage, `count` the number of `dtype` elements; they come
    from elements ``[start, start + count)`` of the tensor whose key is `tensor` in the file
    named `file`, in the same folder, converted with ``Tensor.to(dtype)`` (round to nearest
    even, which every torch device computes alike for the values a writer accepts: no NaN).

    `digest` (format version 4) is `derived.range_digest` of the range's bytes as the writer saw
    them: a reader that rebuilds the range from its source computes it again and refuses a
    source that gives other bytes (another save's file in its place). None in files of
    versions 2 and 3, which recorded no identity of their sources.
    """

    at: int
    count: int
    dtype: str
    file: str
    tensor: str
    start: int
    digest: int | None = None

    @property
    def nbytes(self) -> int:
        return self.count * ITEMSIZES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        value = asdict(self)
        if self.digest is None:
            del value["digest"]
        return value


@dataclass(frozen=True)
class StorageEntry:
    """One stored byte span (a storage, or the part of it the saved tensors view).

    `chunks` hold the span's bytes except the `derived` ranges, in order: the bytes between
    (and around) the ranges, back to back.
    """

    nbytes: int
    dtype: str
    device: str
    codec: dict[str, Any]
    transform: dict[str, Any]
    chunks: tuple[Blob, ...]
    derived: tuple[DerivedRange, ...] = ()

    @property
    def stored_nbytes(self) -> int:
        """Bytes the chunks decode to: the span less its derived ranges."""
        return self.nbytes - sum(r.nbytes for r in self.derived)

    def stored_pieces(self) -> list[tuple[int, int]]:
        """The (start, end) byte ranges of the span that the chunks hold, in order."""
        return stored_pieces(self.nbytes, self.derived)


def stored_pieces(nbytes: int, derived: tuple[DerivedRange, ...] | list[DerivedRange]) -> list[tuple[int, int]]:
    """The (start, end) byte ranges of an `nbytes` span that its `derived` ranges (in order, not
    overlapping) leave to the chunks."""
    pieces, at = [], 0
    for r in derived:
        if r.at > at:
            pieces.append((at, r.at))
        at = r.at + r.nbytes
    if at < nbytes:
        pieces.append((at, nbytes))
    return pieces


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: a view (dtype, shape, stride, element offset) of a stored span."""

    key: str
    storage: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool
    parameter: bool


@dataclass(frozen=True)
class ShardIndex:
    """Everything a reader knows about a shard before decoding any tensor."""

    path: str
    format_version: int
    file_bytes: int
    writer: dict[str, Any]
    skeleton: Blob
    storages: tuple[StorageEntry, ...]
    tensors: tuple[TensorEntry, ...]
    #: CRC-32 of the whole file as the index describes it: header, each blob's recorded CRC,
    #: index and trailer, combined. It equals the file's real CRC exactly when every blob holds
    #: the bytes its CRC says, which the reader checks before decoding each one; so comparing it
    #: with the manifest costs no extra pass over the payload.
    crc32: int = 0

    @property
    def raw_bytes(self) -> int:
        return sum(s.nbytes for s in self.storages) + self.skeleton.length

    @property
    def codecs(self) -> tuple[str, ...]:
        return tuple(sorted({s.codec["name"] for s in self.storages}))

    @property
    def tensor_attributes(self) -> bool:
        """Whether this file's skeleton may carry Python attributes in its tensor references."""
        return self.format_version >= TENSOR_ATTRIBUTES_VERSION

    @property
    def derived_files(self) -> tuple[str, ...]:
        """The other files of the checkpoint this file's derived ranges read, by name."""
        return tuple(sorted({r.file for s in self.storages for r in s.derived}))


class ShardWriter:
    """Writes a shard in file order: header, skeleton, chunks, then the index and trailer."""

    def __init__(self, path: str | os.PathLike, *, durable: bool = True, direct: bool = False,
                 version: int = 1, sink: Sink | None = None) -> None:
        """`version`: the lowest that holds the file (`version_for`; docs/FORMAT.md,
        "Versions"). The bytes go to `sink`, or to one opened at `path` (a path or URL)."""
        if version not in SUPPORTED_FORMAT_VERSIONS:
            raise ValueError(f"cannot write shard format version {version}")
        self._file = _ChecksummedSink(sink if sink is not None else
                                      locations.open_sink(path, durable=durable, direct=direct))
        self._storages: list[dict[str, Any]] = []
        self._skeleton: Blob | None = None
        self._version = version
        self._file.append(header_bytes(version))

    def write_skeleton(self, data: bytes) -> None:
        offset = self._file.append(data)
        self._skeleton = Blob(offset, len(data), len(data), zlib.crc32(data))

    def begin_storage(
        self, *, nbytes: int, dtype: str, device: str, codec: dict[str, Any], transform: dict[str, Any],
        derived: tuple[DerivedRange, ...] = (),
    ) -> int:
        """Declare the next storage; its chunks follow with `append_chunk`. Returns its index.

        `derived` ranges (files of version 2 and later) are bytes of the span its chunks leave out.
        """
        entry: dict[str, Any] = {"nbytes": nbytes, "dtype": dtype, "device": device, "codec": codec,
                                 "transform": transform, "chunks": []}
        if derived:
            if self._version < DERIVED_VERSION:
                raise ValueError(f"derived storages need shard format version {DERIVED_VERSION}")
            if (self._version >= DERIVED_DIGEST_VERSION) != all(r.digest is not None for r in derived):
                raise ValueError(f"derived ranges have digests exactly in shard format version "
                                 f"{DERIVED_DIGEST_VERSION} and later (this file: {self._version})")
            entry["derived"] = [r.to_json() for r in derived]
        self._storages.append(entry)
        return len(self._storages) - 1

    def append_chunk(
        self, storage: int, payload: memoryview | bytes, *, raw_length: int, stored_raw: bool,
        crc32: int | None = None,
    ) -> Blob:
        """Append one chunk of `storage`; chunks must come in storage order, then byte order.

        `crc32` is the payload's CRC-32 when the caller computed it already (off this thread).
        """
        if storage != len(self._storages) - 1:
            raise ValueError("chunks must be appended in storage order")
        view = memoryview(payload).cast("B")
        crc = zlib.crc32(view) if crc32 is None else crc32
        offset = self._file.append(view, crc32=crc)
        blob = Blob(offset, len(view), raw_length, crc, stored_raw)
        self._storages[storage]["chunks"].append(blob.to_json())
        return blob

    def append_device_chunk(
        self, storage: int, payload: object, *, length: int, raw_length: int, stored_raw: bool,
        crc32: int,
    ) -> Blob:
        """`append_chunk` for a payload still in GPU memory (`length` bytes), written by a sink
        that takes device buffers (`Sink.append_device`); its CRC-32 comes from the caller,
        who computed it from a host copy."""
        if storage != len(self._storages) - 1:
            raise ValueError("chunks must be appended in storage order")
        offset = self._file.append_device(payload, length, crc32=crc32)
        blob = Blob(offset, length, raw_length, crc32, stored_raw)
        self._storages[storage]["chunks"].append(blob.to_json())
        return blob

    def finish(self, tensors: list[TensorEntry], writer_info: dict[str, Any]) -> tuple[int, int]:
        """Write index and trailer, make the file durable and visible; returns (size, crc32)."""
        if self._skeleton is None:
            raise ValueError("write_skeleton must be called before finish")
        index = {
            "format": "nvcomp_ckpt_engine.shard",
            "format_version": self._version,
            "writer": writer_info,
            "skeleton": self._skeleton.to_json(),
            "storages": self._storages,
            "tensors": [
                {**asdict(t), "shape": list(t.shape), "stride": list(t.stride)} for t in tensors
            ],
        }
        body = json.dumps(index, separators=(",", ":"), sort_keys=True).encode("utf-8")
        index_offset = self._file.append(body)
        self._file.append(
            _TRAILER.pack(index_offset, len(body), zlib.crc32(body), self._version, END_MAGIC)
        )
        size = self._file.finish()
        return size, self._file.crc32

    def abort(self) -> None:
        self._file.abort()


class _ChecksummedSink:
    """A sink that keeps the running CRC-32 of everything appended (the file's, which the
    manifest records), combined from the chunks' own CRCs where the caller has them."""

    def __init__(self, sink: Sink) -> None:
        self.sink, self.crc32 = sink, 0

    def append(self, data: bytes | bytearray | memoryview, *, crc32: int | None = None) -> int:
        view = memoryview(data).cast("B")
        offset = self.sink.append(view)
        self.crc32 = (zlib.crc32(view, self.crc32) if crc32 is None
                      else crc32_combine(self.crc32, crc32, len(view)))
        return offset

    def append_device(self, buffer: object, nbytes: int, *, crc32: int) -> int:
        offset = self.sink.append_device(buffer, nbytes)
        self.crc32 = crc32_combine(self.crc32, crc32, nbytes)
        return offset

    def finish(self) -> int:
        return self.sink.finish()

    def abort(self) -> None:
        self.sink.abort()


def is_shard_file(path: str | os.PathLike) -> bool:
    """True if `path` starts like one of our shard files (cheap: reads its first 1040 bytes)."""
    try:
        with locations.open_reader(path) as reader:
            head = reader.read(0, min(reader.size, MAGIC_OFFSET + _HEADER_FIELDS.size))
    except OSError:
        return False
    return _has_magic(head)


def _has_magic(head: bytes) -> bool:
    return len(head) >= MAGIC_OFFSET + 8 and head[MAGIC_OFFSET : MAGIC_OFFSET + 8] == MAGIC


#: How a legacy (non-zip) `torch.save` file starts: torch's magic number, pickled.
_LEGACY_TORCH_HEAD = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)


def is_torch_file(path: str | os.PathLike) -> bool:
    """True if `path` is a plain `torch.save` file: the zip format torch writes by default since
    1.6 (an archive holding ``data.pkl``), or the legacy pickle format (its magic number first).
    Nothing is unpickled, and whatever a damaged or hostile file does to the zip reader (a
    name that is not UTF-8 although flagged so, a bogus count or size) answers False."""
    try:
        with locations.open_reader(path) as reader, io.BufferedReader(ReaderIO(reader)) as f:
            if f.read(len(_LEGACY_TORCH_HEAD)) == _LEGACY_TORCH_HEAD:
                return True
            if not zipfile.is_zipfile(f):
                return False
            with zipfile.ZipFile(f) as archive:
                return any(name == "data.pkl" or name.endswith("/data.pkl")
                           for name in archive.namelist())
    except (OSError, zipfile.BadZipFile, UnicodeDecodeError, ValueError, EOFError,
            NotImplementedError, OverflowError):
        return False


class _Validator:
    """Turns a parsed JSON index into typed entries, raising on anything out of shape."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path}: corrupt index: {what}")

    def obj(self, value: Any, keys: set[str], where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{where} is not an object")
        if set(value) != keys:
            raise self.fail(f"{where} has keys {sorted(value)}, expected {sorted(keys)}")
        return value

    def int_(self, value: Any, where: str, *, low: int = 0, high: int = 1 << 62) -> int:
        if type(value) is not int or not low <= value <= high:
            raise self.fail(f"{where} = {value!r} is not an integer in [{low}, {high}]")
        return value

    def ints(self, value: Any, where: str) -> tuple[int, ...]:
        if not isinstance(value, list) or len(value) > 64:
            raise self.fail(f"{where} is not a list of at most 64 integers")
        return tuple(self.int_(v, where) for v in value)

    def str_(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise self.fail(f"{where} is not a string")
        return value

    def blob(self, value: Any, where: str) -> Blob:
        if not isinstance(value, list) or len(value) != 5:
            raise self.fail(f"{where} is not [offset, length, raw_length, crc32, stored_raw]")
        offset, length, raw, crc, stored_raw = (self.int_(v, where) for v in value)
        if stored_raw > 1 or crc >= 1 << 32 or raw > MAX_CHUNK_BYTES:
            raise self.fail(f"{where} = {value!r} is out of range")
        if stored_raw and raw != length:
            raise self.fail(f"{where}: an uncompressed chunk must be as long as its raw size")
        if raw > length * MAX_EXPANSION + 4096:
            raise self.fail(
                f"{where}: {length} stored bytes cannot decode to the declared {raw} bytes"
            )
        return Blob(offset, length, raw, crc, bool(stored_raw))

    def descriptor(self, value: Any, where: str) -> dict[str, Any]:
        """A codec or transform descriptor: name, integer version, and object-valued options."""
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise self.fail(f"{where} is not a descriptor with a name")
        if type(value.get("version")) is not int:
            raise self.fail(f"{where}.version = {value.get('version')!r} is not an integer")
        if not isinstance(value.get("options", {}), dict):
            raise self.fail(f"{where}.options = {value['options']!r} is not an object")
        if "library" in value and not isinstance(value["library"], str):
            raise self.fail(f"{where}.library is not a string")
        return value

    def device(self, value: Any, where: str) -> str:
        """Where a storage was saved: the `location` map_location sees, so a real device."""
        if not isinstance(value, str) or not _DEVICE.fullmatch(value):
            raise self.fail(f"{where} = {value!r} is not a device such as 'cpu' or 'cuda:0'")
        return value

    def storage(self, value: Any, where: str, version: int) -> StorageEntry:
        keys = {"nbytes", "dtype", "device", "codec", "transform", "chunks"}
        if version >= DERIVED_VERSION and isinstance(value, dict) and "derived" in value:
            keys = keys | {"derived"}
        v = self.obj(value, keys, where)
        dtype = self.str_(v["dtype"], f"{where}.dtype")
        if dtype not in ITEMSIZES:
            raise UnsupportedCheckpointError(f"{self.path}: {where} has unknown dtype {dtype!r}")
        if not isinstance(v["chunks"], list):
            raise self.fail(f"{where}.chunks is not a list")
        chunks = tuple(self.blob(c, f"{where}.chunks[{i}]") for i, c in enumerate(v["chunks"]))
        nbytes = self.int_(v["nbytes"], f"{where}.nbytes")
        derived = self.derived(v.get("derived"), f"{where}.derived", nbytes, version)
        stored = nbytes - sum(r.nbytes for r in derived)
        if sum(c.raw_length for c in chunks) != stored:
            raise self.fail(f"{where}: chunks decode to {sum(c.raw_length for c in chunks)} bytes, "
                            f"the storage declares {stored}"
                            + (f" ({nbytes} less {nbytes - stored} derived)" if derived else ""))
        codec = self.descriptor(v["codec"], f"{where}.codec")
        transform = self.descriptor(v["transform"], f"{where}.transform")
        ratio, width = self.known(max_ratio, codec), self.known(plane_width, transform)
        for i, c in enumerate(chunks):
            if not c.stored_raw and ratio is not None and c.raw_length > c.length * ratio:
                raise self.fail(f"{where}.chunks[{i}]: {c.length} stored bytes of {codec['name']} "
                                f"cannot decode to the declared {c.raw_length} bytes (at most "
                                f"{ratio}x)")
            if c.raw_length % width:
                raise self.fail(f"{where}.chunks[{i}]: {c.raw_length} bytes are not a whole "
                                f"number of the transform's {width}-byte elements")
        return StorageEntry(nbytes, dtype, self.device(v["device"], f"{where}.device"),
                            codec, transform, chunks, derived)

    def known(self, check: Any, descriptor: dict[str, Any]) -> Any:
        """`check(descriptor)` (a codec's or transform's bound), naming the file when this
        version does not know the descriptor."""
        try:
            return check(descriptor)
        except UnsupportedCheckpointError as exc:
            raise UnsupportedCheckpointError(f"{self.path}: {exc}") from None

    def derived(self, value: Any, where: str, nbytes: int, version: int) -> tuple[DerivedRange, ...]:
        """A storage's derived ranges: in order, inside the span, not overlapping, from a plain
        file name (no folder: the source lies beside this file); from version 4 on each with
        the digest of its bytes."""
        if value is None:
            return ()
        if not isinstance(value, list) or not value:
            raise self.fail(f"{where} is not a non-empty list")
        keys = {"at", "count", "dtype", "file", "tensor", "start"}
        if version >= DERIVED_DIGEST_VERSION:
            keys.add("digest")
        ranges, end = [], 0
        for i, item in enumerate(value):
            at = f"{where}[{i}]"
            v = self.obj(item, keys, at)
            dtype = self.str_(v["dtype"], f"{at}.dtype")
            if dtype not in ITEMSIZES:
                raise UnsupportedCheckpointError(f"{self.path}: {at} has unknown dtype {dtype!r}")
            name = self.str_(v["file"], f"{at}.file")
            if not _SOURCE_NAME.fullmatch(name) or name in (".", ".."):
                raise self.fail(f"{at}.file = {name!r} is not a plain file name")
            r = DerivedRange(self.int_(v["at"], f"{at}.at"), self.int_(v["count"], f"{at}.count", low=1),
                             dtype, name, self.str_(v["tensor"], f"{at}.tensor"),
                             self.int_(v["start"], f"{at}.start"),
                             self.int_(v["digest"], f"{at}.digest", high=DIGEST_LIMIT - 1)
                             if "digest" in v else None)
            if r.at < end or r.at + r.nbytes > nbytes:
                raise self.fail(f"{at} covers bytes [{r.at}, {r.at + r.nbytes}), which overlap the "
                                f"previous range or leave the {nbytes}-byte storage")
            end = r.at + r.nbytes
            ranges.append(r)
        return tuple(ranges)

    def tensor(self, value: Any, where: str, storages: tuple[StorageEntry, ...]) -> TensorEntry:
        v = self.obj(value, {"key", "storage", "dtype", "shape", "stride", "offset",
                             "requires_grad", "parameter"}, where)
        key = self.str_(v["key"], f"{where}.key")
        where = f"{where} ({key!r})"
        storage = self.int_(v["storage"], f"{where}.storage", high=max(len(storages) - 1, 0))
        if not storages:
            raise self.fail(f"{where} refers to a storage, but the file has none")
        dtype = self.str_(v["dtype"], f"{where}.dtype")
        if dtype not in ITEMSIZES:
            raise UnsupportedCheckpointError(f"{self.path}: {where} has unknown dtype {dtype!r}")
        shape, stride = self.ints(v["shape"], f"{where}.shape"), self.ints(v["stride"], f"{where}.stride")
        if len(shape) != len(stride):
            raise self.fail(f"{where}: shape and stride differ in length")
        offset = self.int_(v["offset"], f"{where}.offset")
        if not isinstance(v["requires_grad"], bool) or not isinstance(v["parameter"], bool):
            raise self.fail(f"{where}: requires_grad/parameter are not booleans")
        if v["requires_grad"] and dtype not in _GRAD_DTYPES:
            raise self.fail(f"{where}: a {dtype} tensor cannot require gradients")
        itemsize = ITEMSIZES[dtype]
        extent = 0 if 0 in shape else offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        if extent * itemsize > storages[storage].nbytes:
            raise self.fail(f"{where} reaches byte {extent * itemsize}, past the end of its "
                            f"storage ({storages[storage].nbytes} bytes)")
        if math.prod(shape) > _MAX_NUMEL:  # a view repeating elements (stride 0) still counts them
            raise self.fail(f"{where}: shape {list(shape)} has more elements than a tensor can")
        return TensorEntry(key, storage, dtype, shape, stride, offset,
                           v["requires_grad"], v["parameter"])


def _parse_header(path: str, head: bytes, file_bytes: int) -> int:
    if file_bytes < HEADER_SIZE + TRAILER_SIZE or not _has_magic(head):
        if is_torch_file(path):
            raise UnsupportedCheckpointError(
                f"{path}: a plain torch.save file, not an nvcomp_ckpt_engine shard: read it with "
                "torch.load(path); `nvcomp-ckpt compress --trusted SRC_DIR DST_DIR` converts a "
                "folder of such files into engine shards (--trusted because DeepSpeed's files "
                "hold objects that torch.load refuses without it: for files you trust)"
            )
        raise CorruptCheckpointError(
            f"{path}: not an nvcomp_ckpt_engine shard (no magic bytes, or shorter than the "
            f"{HEADER_SIZE + TRAILER_SIZE}-byte minimum: {file_bytes} bytes)"
        )
    if head[: len(GUARD)] != GUARD:
        raise CorruptCheckpointError(f"{path}: corrupt header (the torch.load guard is damaged)")
    _, version, header_size = _HEADER_FIELDS.unpack_from(head, MAGIC_OFFSET)
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise UnsupportedCheckpointError(
            f"{path}: shard format version {version}, but this nvcomp_ckpt_engine reads "
            f"version(s) {SUPPORTED_FORMAT_VERSIONS}; upgrade nvcomp_ckpt_engine to read it"
        )
    if header_size != HEADER_SIZE or any(head[len(GUARD) : MAGIC_OFFSET]) or any(
        head[MAGIC_OFFSET + _HEADER_FIELDS.size :]
    ):
        raise CorruptCheckpointError(f"{path}: corrupt header")
    return version


def _read_exact(reader: Reader, offset: int, length: int, path: str, what: str) -> bytes:
    try:
        return reader.read(offset, length)
    except ShortReadError as exc:
        got = max(0, exc.end - offset)
        raise CorruptCheckpointError(f"{path}: {what} is truncated ({got} of {length} bytes)") from None


def read_index(path: str | os.PathLike) -> ShardIndex:
    """Read and validate a shard's header, index and trailer (no payload is read)."""
    path = os.fspath(path)
    with locations.open_reader(path) as f:
        file_bytes = f.size
        head = f.read(0, min(HEADER_SIZE, file_bytes))
        version = _parse_header(path, head, file_bytes)
        trailer = _read_exact(f, file_bytes - TRAILER_SIZE, TRAILER_SIZE, path, "trailer")
        index_offset, index_length, index_crc, trailer_version, end = _TRAILER.unpack(trailer)
        if end != END_MAGIC or trailer_version != version:
            raise CorruptCheckpointError(f"{path}: corrupt or missing trailer (file truncated?)")
        if (index_length > MAX_INDEX_BYTES or index_offset < HEADER_SIZE
                or index_offset + index_length + TRAILER_SIZE != file_bytes):
            raise CorruptCheckpointError(
                f"{path}: trailer places the index at [{index_offset}, +{index_length}), which "
                f"does not end where the {file_bytes}-byte file's trailer starts"
            )
        body = _read_exact(f, index_offset, index_length, path, "index")
    if zlib.crc32(body) != index_crc:
        raise CorruptCheckpointError(f"{path}: index checksum mismatch (corrupt index)")
    index = _build_index(path, version, file_bytes, index_offset, body)
    crc = zlib.crc32(head)
    for blob in [index.skeleton, *(c for s in index.storages for c in s.chunks)]:
        crc = crc32_combine(crc, blob.crc32, blob.length)
    crc = zlib.crc32(trailer, zlib.crc32(body, crc))
    return dataclasses.replace(index, crc32=crc)


def _build_index(path: str, version: int, file_bytes: int, index_offset: int, body: bytes) -> ShardIndex:
    v = _Validator(path)
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError) as exc:  # ValueError: also a number too long to parse
        raise v.fail(f"not valid JSON ({exc})") from exc
    top = v.obj(raw, {"format", "format_version", "writer", "skeleton", "storages", "tensors"}, "index")
    if top["format"] != "nvcomp_ckpt_engine.shard" or top["format_version"] != version:
        raise v.fail("format name or version disagree with the header")
    if not isinstance(top["writer"], dict):
        raise v.fail("writer is not an object")
    if not isinstance(top["storages"], list) or not isinstance(top["tensors"], list):
        raise v.fail("storages/tensors are not lists")
    skeleton = v.blob(top["skeleton"], "skeleton")
    storages = tuple(v.storage(s, f"storages[{i}]", version) for i, s in enumerate(top["storages"]))
    tensors = tuple(v.tensor(t, f"tensors[{i}]", storages) for i, t in enumerate(top["tensors"]))
    _check_tiling(v, skeleton, storages, index_offset)
    return ShardIndex(path, version, file_bytes, top["writer"], skeleton, storages, tensors)


def _check_tiling(v: _Validator, skeleton: Blob, storages: tuple[StorageEntry, ...], end: int) -> None:
    """Blobs must cover [HEADER_SIZE, index offset) exactly, in order, without gaps or overlap."""
    expected = HEADER_SIZE
    blobs = [("skeleton", skeleton)] + [
        (f"storages[{i}].chunks[{j}]", c) for i, s in enumerate(storages) for j, c in enumerate(s.chunks)
    ]
    for where, blob in blobs:
        if blob.offset != expected:
            raise v.fail(f"{where} starts at byte {blob.offset}, expected {expected}")
        expected += blob.length
    if expected != end:
        raise v.fail(f"blobs end at byte {expected}, but the index starts at {end}")


def read_blob(f: Reader, blob: Blob, *, path: str, what: str, verify: bool = True) -> bytes:
    """The bytes of one blob, checked against its CRC-32 when `verify` (before any decoding)."""
    data = _read_exact(f, blob.offset, blob.length, path, what)
    if verify and zlib.crc32(data) != blob.crc32:
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch in {what} (bytes {blob.offset}..{blob.offset + blob.length})"
        )
    return data


def read_skeleton(f: Reader, index: ShardIndex, *, verify: bool = True) -> bytes:
    return read_blob(f, index.skeleton, path=index.path, what="the skeleton", verify=verify)


def storage_name(index: ShardIndex, storage: int) -> str:
    """How errors name a storage: the tensor keys that view it, and its number."""
    keys = [t.key for t in index.tensors if t.storage == storage]
    shown = ", ".join(repr(k) for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return f"tensor {shown} (storage {storage}"


def chunk_name(index: ShardIndex, storage: int, chunk: int) -> str:
    """How errors name a chunk: the tensor keys that view its storage, and the chunk number."""
    return f"{storage_name(index, storage)}, chunk {chunk})"


def verify_file(path: str | os.PathLike, index: ShardIndex | None = None) -> ShardIndex:
    """Check every checksum of a shard without decoding anything (no GPU needed).

    `index`: the shard's index as the caller read it already (`read_index` of `path`), so that
    a caller checking a whole tag reads each index once; else it is read here.
    """
    index = read_index(path) if index is None else index
    with locations.open_reader(index.path) as f:
        read_skeleton(f, index)
        for s, storage in enumerate(index.storages):
            for c, blob in enumerate(storage.chunks):
                read_blob(f, blob, path=index.path, what=chunk_name(index, s, c))
    return index


# DTYPES and DTYPE_NAMES are built on first use by the module's __getattr__ (no torch at import).
__all__ = [  # noqa: F822
    "Blob", "DTYPES", "DTYPE_NAMES", "DerivedRange", "FORMAT_VERSION", "ShardIndex", "ShardWriter",
    "StorageEntry", "TensorEntry", "chunk_name", "is_shard_file", "is_torch_file", "read_blob",
    "read_index", "read_skeleton", "verify_file", "version_for",
]
