"""GPU codecs on NVIDIA nvCOMP: ANS, Zstd, GDeflate, Deflate, Bitcomp, Cascaded, LZ4.

Each codec compresses a batch of CUDA ``uint8`` chunks in one nvCOMP call, because nvCOMP is
fast only when it has many chunks to spread over the GPU. The work runs on a side CUDA stream
of the chunk's device, ordered after whatever the caller's current stream queued before, so a
training step on the default stream can overlap with it.

nvCOMP is imported lazily (``nvidia.nvcomp``, from the ``nvidia-nvcomp-cu13`` wheel): this module
imports on machines without CUDA or without nvCOMP, where `nvcomp_available()` is false and
constructing a codec raises `UnsupportedCheckpointError`.

Bitstreams. Zstd and Deflate are written in nvCOMP's ``RAW`` bitstream kind: standard formats
that CPU libraries decode, with no nvCOMP header. The others are written in ``NVCOMP_NATIVE``
kind: nvCOMP's own container, which only nvCOMP reads and whose layout may change between
nvCOMP major releases, hence `check_bitstream_compatible`.

- deflate: one raw RFC 1951 stream per chunk (``zlib.decompressobj(-15)`` reads it). nvCOMP
  6.0 codes one RAW stream with little parallelism (H200: 0.5-2 GB/s in 1 MiB streams; one
  16 MiB stream takes seconds), so GPU deflate suits small chunks only.
- zstd: a standard zstd *stream* per chunk: a skippable frame holding a table of frame sizes,
  then one zstd frame per `uncomp_chunk_size` bytes (1 MiB). A single RAW frame is coded and
  decoded nearly serially by nvCOMP (H200: 0.4 GB/s decode for a 64 MiB frame); independent
  frames run in parallel (16 MiB chunks: 1 MiB frames decode at 7-14 GB/s, 64 KiB frames at
  1.3-1.7 GB/s, where wrapping thousands of small frames costs more than coding them).
  ``zstd -d`` and python-zstandard's readers with ``read_across_frames=True`` decode the stream
  (plain ``ZstdDecompressor.decompress`` stops after the first frame). On the GPU, a payload
  without the table is decoded as one frame (what a CPU writes).
- cascaded: nvCOMP 6.0's Cascaded (default options) drops the last ``n % 4`` bytes of an
  ``n``-byte chunk, with no error (H200: every size from 1 to 79 that is not a multiple of 4,
  and 127, 255, 4097); so such chunks are zero-padded to a multiple of 4 before coding, and
  cut back after decoding. The size check after decoding is then exact only to those 4 bytes;
  the container's per-chunk checksum covers the rest.

Thread-safety: an `NvcompCodec` holds nvCOMP codec objects, which are thread-local by nvCOMP's
rules; use one `NvcompCodec` per thread. Each call synchronizes its side stream before it returns
(the compressed sizes must be known on the host), so the caller may free or reuse the chunks as
soon as a call returns.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Mapping

import torch

from ..errors import CodecError, UnsupportedCheckpointError
from .base import Codec

logger = logging.getLogger(__name__)

__all__ = [
    "NVCOMP_CODEC_NAMES",
    "NvcompCodec",
    "check_bitstream_compatible",
    "make_codec",
    "nvcomp_available",
    "nvcomp_version",
]

#: ANS ``data_type`` per element hint. nvCOMP's ANS has float modes for 16-bit ('<f2') and 32-bit
#: ('<f4') floats; it codes the bytes losslessly whatever they hold, so bf16 uses the 16-bit mode
#: too (H200, trained bf16 weights: 1.30x plain, 1.54x with '<f2'; docs/BENCHMARKS.md).
ANS_DATA_TYPES: dict[str, str] = {"bf2": "<f2", "f2": "<f2", "f4": "<f4"}

#: torch dtype used to view a chunk for each ANS ``data_type``, so nvCOMP sees typed input.
_VIEW_DTYPE: dict[str, torch.dtype] = {"<f2": torch.float16, "<f4": torch.float32}
_WIDTH: dict[str, int] = {"<f2": 2, "<f4": 4}

_PLAIN = "|u1"
_NATIVE = "native"
_RAW = "raw"

#: nvCOMP's Cascaded is handed whole multiples of this many bytes (see the module docstring).
_CASCADED_PAD_TO = 4

#: The zstd frame table: a skippable frame (magic, content length) whose content is a marker, the
#: uncompressed bytes per frame and each frame's compressed size, all little-endian u32.
_SKIPPABLE_MAGIC = 0x184D2A50
_TABLE_MARKER = b"nvCK"
_TABLE_FIXED = 16

#: What an empty chunk encodes to in the standard formats, so CPU decoders accept it too
#: (nvCOMP rejects empty inputs): a zstd frame of no content, and an empty final deflate block.
_ZSTD_EMPTY = bytes.fromhex("28b52ffd2000010000")
_DEFLATE_EMPTY = bytes.fromhex("0300")


@dataclass(frozen=True)
class _Algorithm:
    """What the engine needs to know about one nvCOMP algorithm."""

    nvcomp_name: str
    bitstream: str
    cpu_decodable: bool
    uncomp_chunk_size: int
    has_level: bool = False
    framed: bool = False
    pad_to: int = 1
    empty_stream: bytes = b""


_ALGORITHMS: dict[str, _Algorithm] = {
    # 1 MiB chunks gave ANS 2-4% more ratio than the default 64 KiB at the same speed (H200).
    "ans": _Algorithm("ANS", _NATIVE, False, 1 << 20),
    "zstd": _Algorithm("Zstd", _RAW, True, 1 << 20, framed=True, empty_stream=_ZSTD_EMPTY),
    "gdeflate": _Algorithm("GDeflate", _NATIVE, False, 1 << 16, has_level=True),
    "deflate": _Algorithm("Deflate", _RAW, True, 1 << 16, has_level=True, empty_stream=_DEFLATE_EMPTY),
    "bitcomp": _Algorithm("Bitcomp", _NATIVE, False, 1 << 16),
    "cascaded": _Algorithm("Cascaded", _NATIVE, False, 1 << 16, pad_to=_CASCADED_PAD_TO),
    "lz4": _Algorithm("LZ4", _NATIVE, False, 1 << 16),
}

#: The codec names this module provides, in the order the registry lists them.
NVCOMP_CODEC_NAMES: tuple[str, ...] = tuple(_ALGORITHMS)


def _import_nvcomp() -> ModuleType:
    """Import nvCOMP's Python module; only here, so that CPU-only installs import this file."""
    from nvidia import nvcomp  # noqa: PLC0415 - lazy on purpose

    return nvcomp


def nvcomp_version() -> str | None:
    """The installed nvCOMP version ("X.Y.Z"), or None if nvCOMP cannot be imported. Never raises."""
    try:
        return str(_import_nvcomp().__version__)
    except Exception:  # noqa: BLE001 - a broken install must read as "not available", not crash
        return None


def nvcomp_available() -> bool:
    """True if nvCOMP imports and a CUDA device is usable here. Never raises."""
    try:
        return nvcomp_version() is not None and torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - same reason as nvcomp_version
        return False


def _major(version: str) -> int:
    """The major number of an "X.Y.Z" version string."""
    return int(version.split(".", 1)[0])


def check_bitstream_compatible(descriptor: dict[str, Any]) -> None:
    """Refuse a codec descriptor whose nvCOMP-native bitstream this installation cannot read.

    RAW bitstreams (zstd, deflate) are standard formats and pass whatever wrote them. Native
    bitstreams must come from the same nvCOMP major release as the one installed here.

    Raises `UnsupportedCheckpointError` naming both versions, or saying that no nvCOMP is here.
    """
    options = descriptor.get("options", {})
    if options.get("bitstream") == _RAW:
        return
    name = descriptor.get("name", "?")
    library = str(descriptor.get("library", ""))
    kind, _, written = library.partition(" ")
    if kind != "nvcomp" or not written[:1].isdigit():
        raise UnsupportedCheckpointError(
            f"codec {name!r}: the file does not record which nvCOMP wrote its native bitstream "
            f"(library={library!r}); it cannot be checked against this installation"
        )
    installed = nvcomp_version()
    if installed is None:
        raise UnsupportedCheckpointError(
            f"codec {name!r} was written by nvCOMP {written} and needs nvCOMP {_major(written)}.x "
            "on a CUDA GPU; nvCOMP is not installed here. Load it on a GPU node, or convert it "
            "there with `nvcomp-ckpt decompress`"
        )
    if _major(installed) != _major(written):
        raise UnsupportedCheckpointError(
            f"codec {name!r} was written by nvCOMP {written}, but nvCOMP {installed} is installed "
            f"here: native bitstreams are not compatible across major versions. Install "
            f"nvidia-nvcomp-cu13 {_major(written)}.x, or convert the file with `nvcomp-ckpt "
            f"decompress` where that version is installed"
        )


def make_codec(name: str, **options: Any) -> NvcompCodec:
    """The codec `name`, built from options as its `descriptor()` records them.

    This is how a reader rebuilds the encoder's codec: ``make_codec(d["name"], **d["options"])``
    (after `check_bitstream_compatible(d)`). A recorded ``bitstream`` must be the one this
    codec writes; unknown option names raise `UnsupportedCheckpointError`, since they mean a
    newer writer.
    """
    if name not in _ALGORITHMS:
        raise UnsupportedCheckpointError(
            f"unknown nvCOMP codec {name!r}; this version knows {NVCOMP_CODEC_NAMES}"
        )
    bitstream = options.pop("bitstream", _ALGORITHMS[name].bitstream)
    if bitstream != _ALGORITHMS[name].bitstream:
        raise UnsupportedCheckpointError(
            f"codec {name!r} with bitstream {bitstream!r}: this version writes and reads only "
            f"{_ALGORITHMS[name].bitstream!r}"
        )
    unknown = set(options) - {"uncomp_chunk_size", "data_types", "level"}
    if unknown:
        raise UnsupportedCheckpointError(
            f"codec {name!r} has options {sorted(unknown)} that this version does not know; "
            "upgrade nvcomp_ckpt_engine to read this file"
        )
    return NvcompCodec(name, **options)


def _check_chunks(chunks: list[torch.Tensor], what: str) -> None:
    """Reject anything but 1-D contiguous CUDA uint8 tensors, with the remedy in the message."""
    for i, t in enumerate(chunks):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
            raise TypeError(
                f"{what}[{i}] must be a 1-D torch.uint8 tensor; view it with "
                "`t.reshape(-1).view(torch.uint8)` first"
            )
        if not t.is_cuda:
            raise ValueError(f"{what}[{i}] is on {t.device}; nvCOMP codecs need CUDA tensors")
        if not t.is_contiguous():
            raise ValueError(f"{what}[{i}] is not contiguous; call .contiguous() first")
        if t.device != chunks[0].device:
            raise ValueError(f"{what} mixes {chunks[0].device} and {t.device}; one device per batch")


def _staged(tensors: list[torch.Tensor], alignment: int) -> list[torch.Tensor]:
    """`tensors` if all start aligned, else aligned copies made by one concatenation.

    nvCOMP needs aligned buffers; zstd frames sit at arbitrary offsets of a payload, and one
    `torch.cat` (with zero padding between pieces) costs far less than a copy per frame.
    """
    if all(t.data_ptr() % alignment == 0 for t in tensors):
        return tensors
    pad = torch.zeros(alignment, dtype=torch.uint8, device=tensors[0].device)
    pieces, offsets, offset = [], [], 0
    for t in tensors:
        offsets.append(offset)
        gap = -t.numel() % alignment
        pieces += [t, pad[:gap]]
        offset += t.numel() + gap
    staged = torch.cat(pieces)
    return [staged[o : o + t.numel()] for o, t in zip(offsets, tensors)]


def _round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def _typed(t: torch.Tensor, data_type: str) -> torch.Tensor:
    """View uint8 `t` as the element type nvCOMP's `data_type` expects (bytes stay the same)."""
    dtype = _VIEW_DTYPE.get(data_type)
    return t if dtype is None else t.view(dtype)


def _frame_table(frame_bytes: int, sizes: list[int]) -> bytes:
    """The skippable frame that lists the compressed size of each zstd frame of a payload."""
    content = _TABLE_MARKER + struct.pack(f"<I{len(sizes)}I", frame_bytes, *sizes)
    return struct.pack("<II", _SKIPPABLE_MAGIC, len(content)) + content


def _parse_frame_table(head: bytes, frame_bytes: int, frames: int, payload_bytes: int) -> list[int] | None:
    """Compressed frame sizes from a payload's leading bytes; None if it has no table.

    Raises ValueError (turned into `CodecError` by the caller) for a table that does not fit.
    """
    if len(head) < 8 or struct.unpack_from("<I", head)[0] != _SKIPPABLE_MAGIC:
        return None
    content_bytes = struct.unpack_from("<I", head, 4)[0]
    if head[8:12] != _TABLE_MARKER or content_bytes != 8 + 4 * frames or len(head) < 8 + content_bytes:
        raise ValueError(f"its frame table is not one for {frames} frames")
    written_frame_bytes, *sizes = struct.unpack_from(f"<I{frames}I", head, 12)
    if written_frame_bytes != frame_bytes:
        raise ValueError(f"it has {written_frame_bytes}-byte frames, the descriptor says {frame_bytes}")
    if 8 + content_bytes + sum(sizes) != payload_bytes:
        total = 8 + content_bytes + sum(sizes)
        raise ValueError(f"its frame sizes add up to {total} bytes, not {payload_bytes}")
    return sizes


class NvcompCodec(Codec):
    """One nvCOMP algorithm behind the `Codec` interface, on CUDA uint8 chunks.

    Options (keyword-only, recorded in `descriptor`):
      uncomp_chunk_size: nvCOMP's internal chunk size in bytes (ANS: 1 MiB, others 64 KiB); for
        zstd, the uncompressed bytes per zstd frame (1 MiB).
      data_types: ANS only: element hint -> ANS ``data_type`` (default `ANS_DATA_TYPES`; ``{}``
        for plain byte-wise ANS). A chunk that is not a whole number of elements is coded plain.
      level: GDeflate/Deflate only: nvCOMP's ``algorithm_type`` 0-5 (default 1).

    Empty chunks never reach nvCOMP (it rejects size 0): they encode to an empty payload, or for
    zstd and deflate to the standard empty stream.
    """

    device = "cuda"

    def __init__(
        self,
        name: str,
        *,
        uncomp_chunk_size: int | None = None,
        data_types: Mapping[str, str] | None = None,
        level: int | None = None,
    ) -> None:
        if name not in _ALGORITHMS:
            raise ValueError(f"unknown nvCOMP codec {name!r}; choose one of {NVCOMP_CODEC_NAMES}")
        algo = _ALGORITHMS[name]
        if level is not None and not algo.has_level:
            raise ValueError(f"codec {name!r} has no level; only gdeflate and deflate take one")
        if level is not None and not 0 <= level <= 5:
            raise ValueError(f"level must be 0-5 (nvCOMP algorithm_type), got {level}")
        if data_types is not None and name != "ans":
            raise ValueError(f"codec {name!r} has no data_types; only ans takes them")
        if data_types and not set(data_types.values()) <= set(_WIDTH):
            raise ValueError(f"ANS data_types must map to {sorted(_WIDTH)}, got {dict(data_types)}")
        if uncomp_chunk_size is not None and (uncomp_chunk_size <= 0 or uncomp_chunk_size % 16):
            raise ValueError(f"uncomp_chunk_size must be a positive multiple of 16, got {uncomp_chunk_size}")
        version = nvcomp_version()
        if version is None:
            raise UnsupportedCheckpointError(
                f"GPU codec {name!r} needs nvCOMP (pip install nvidia-nvcomp-cu13) on a CUDA "
                "machine; it is not importable here"
            )
        self.name = name
        self.cpu_decodable = algo.cpu_decodable
        self._algo = algo
        self._version = version
        self._chunk_size = uncomp_chunk_size or algo.uncomp_chunk_size
        self.frame_bytes = self._chunk_size
        self._data_types = dict(ANS_DATA_TYPES if data_types is None else data_types) if name == "ans" else {}
        self._level = level
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._codecs: dict[tuple[int, str], Any] = {}

    def descriptor(self) -> dict[str, Any]:
        """Name, bitstream version, options and the nvCOMP version that wrote the bitstream."""
        options: dict[str, Any] = {
            "bitstream": self._algo.bitstream,
            "uncomp_chunk_size": self._chunk_size,
        }
        if self.name == "ans":
            options["data_types"] = dict(self._data_types)
        if self._algo.has_level:
            options["level"] = 1 if self._level is None else self._level
        return {
            "name": self.name,
            "version": self.version,
            "options": options,
            "library": f"nvcomp {self._version}",
        }

    def data_type_for(self, element: str, nbytes: int) -> str:
        """The nvCOMP ``data_type`` for a chunk: typed only if the chunk holds whole elements
        (nvCOMP 6.0's ANS '<f2' decodes an odd-sized chunk to wrong bytes, with no error)."""
        data_type = self._data_types.get(element, _PLAIN)
        return data_type if nbytes % _WIDTH.get(data_type, 1) == 0 else _PLAIN

    def encode_batch(self, chunks: list[torch.Tensor], *, element: str = "u1") -> list[torch.Tensor]:
        """Compress each chunk; returns one 1-D CUDA uint8 payload per chunk, in order.

        Payloads may be views into buffers allocated per call. Raises `CodecError` if nvCOMP fails.
        """
        _check_chunks(chunks, "chunks")
        if self._algo.framed:
            payloads = self._encode_framed(chunks, element)
        else:
            units = [c if c.numel() % self._algo.pad_to == 0 else self._padded(c) for c in chunks]
            payloads = self._encode_units(units, element)
        if self._algo.empty_stream and any(c.numel() == 0 for c in chunks):
            empty = torch.tensor(list(self._algo.empty_stream), dtype=torch.uint8, device=chunks[0].device)
            payloads = [empty if c.numel() == 0 else p for c, p in zip(chunks, payloads)]
        return payloads

    def decode_batch(
        self, payloads: list[torch.Tensor], outs: list[torch.Tensor], *, element: str = "u1"
    ) -> None:
        """Decompress each payload straight into `outs[i]` (through a copy only where needed).

        Raises `CodecError` if a payload does not decode to exactly ``outs[i].numel()`` bytes.
        """
        if len(payloads) != len(outs):
            raise ValueError(f"got {len(payloads)} payloads but {len(outs)} output tensors")
        _check_chunks(payloads + outs, "payloads + outs")
        empty_sizes = {0, len(self._algo.empty_stream)}
        for i, (payload, out) in enumerate(zip(payloads, outs)):
            wrong_empty = out.numel() == 0 and payload.numel() not in empty_sizes
            if wrong_empty or (out.numel() and not payload.numel()):
                raise CodecError(
                    f"{self.name}: payload {i} has {payload.numel()} bytes but its output has "
                    f"{out.numel()}: only an empty chunk has an empty payload (or the empty stream)"
                )
        if self._algo.framed:
            self._decode_framed(payloads, outs, element)
            return
        pad_to = self._algo.pad_to
        targets = [o if o.numel() % pad_to == 0 else o.new_empty(_round_up(o.numel(), pad_to)) for o in outs]
        self._decode_units(payloads, targets, element)
        for target, out in zip(targets, outs):
            if target is not out:
                out.copy_(target[: out.numel()])

    def _padded(self, chunk: torch.Tensor) -> torch.Tensor:
        """`chunk` zero-padded to the next multiple of the algorithm's `pad_to` bytes."""
        padded = chunk.new_zeros(_round_up(chunk.numel(), self._algo.pad_to))
        padded[: chunk.numel()] = chunk
        return padded

    def _encode_framed(self, chunks: list[torch.Tensor], element: str) -> list[torch.Tensor]:
        """Zstd: code every `uncomp_chunk_size` slice as its own frame, then join each chunk's
        frames behind its frame table (one host-to-device copy for all tables)."""
        frames_of = [list(c.split(self._chunk_size)) if c.numel() else [] for c in chunks]
        coded = self._encode_units([f for frames in frames_of for f in frames], element)
        per_chunk, start = [], 0
        for frames in frames_of:
            per_chunk.append(coded[start : start + len(frames)])
            start += len(frames)
        tables = [_frame_table(self._chunk_size, [f.numel() for f in c]) if c else b"" for c in per_chunk]
        joined = b"".join(tables)
        if joined:
            table_dev = torch.frombuffer(bytearray(joined), dtype=torch.uint8).to(chunks[0].device)
        payloads, offset = [], 0
        for chunk, table, frames in zip(chunks, tables, per_chunk):
            if not frames:
                payloads.append(chunk.new_empty(0))
                continue
            payloads.append(torch.cat([table_dev[offset : offset + len(table)], *frames]))
            offset += len(table)
        return payloads

    def _decode_framed(self, payloads: list[torch.Tensor], outs: list[torch.Tensor], element: str) -> None:
        """Zstd: read every payload's frame table (one device-to-host copy), then decode all
        frames of the batch in one nvCOMP call, each straight into its slice of the output."""
        live = [i for i, o in enumerate(outs) if o.numel()]
        counts = {i: -(-outs[i].numel() // self._chunk_size) for i in live}
        heads = [payloads[i][: _TABLE_FIXED + 4 * counts[i]] for i in live]
        host = torch.cat(heads).cpu().numpy().tobytes() if heads else b""
        frame_payloads, frame_outs, offset = [], [], 0
        for i, head in zip(live, heads):
            blob = host[offset : offset + head.numel()]
            offset += head.numel()
            try:
                sizes = _parse_frame_table(blob, self._chunk_size, counts[i], payloads[i].numel())
            except ValueError as exc:
                raise CodecError(f"zstd payload {i} ({payloads[i].numel()} bytes) is damaged: {exc}") from exc
            if sizes is None:
                frame_payloads.append(payloads[i])
                frame_outs.append(outs[i])
                continue
            frame_payloads += list(payloads[i][_TABLE_FIXED + 4 * counts[i] :].split(sizes))
            frame_outs += list(outs[i].split(self._chunk_size))
        self._decode_units(frame_payloads, frame_outs, element)

    def _groups(self, sized: list[torch.Tensor], element: str) -> dict[tuple[str, int], list[int]]:
        """Indices of the non-empty units, grouped by nvCOMP ``data_type`` and, for RAW
        bitstreams, by size class: nvCOMP sizes every RAW output slot of a call for the largest
        input, so mixing a 16 MiB chunk with many tiny ones would waste memory."""
        groups: dict[tuple[str, int], list[int]] = {}
        for i, t in enumerate(sized):
            if t.numel():
                size_class = t.numel().bit_length() if self._algo.bitstream == _RAW else 0
                groups.setdefault((self.data_type_for(element, t.numel()), size_class), []).append(i)
        return groups

    def _encode_units(self, units: list[torch.Tensor], element: str) -> list[torch.Tensor]:
        """Encode units (chunks or zstd frames) group by group; empty units give empty payloads."""
        payloads = [u.new_empty(0) for u in units]
        for (data_type, _), indices in self._groups(units, element).items():
            for i, payload in zip(indices, self._encode_group([units[i] for i in indices], data_type)):
                payloads[i] = payload
        return payloads

    def _decode_units(self, payloads: list[torch.Tensor], outs: list[torch.Tensor], element: str) -> None:
        """Decode units group by group into `outs` (empty units were checked by the caller)."""
        for (data_type, _), indices in self._groups(outs, element).items():
            self._decode_group([payloads[i] for i in indices], [outs[i] for i in indices], data_type, indices)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream of `device`, created on first use."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]

    def _nvcomp_codec(self, device: torch.device, data_type: str) -> Any:
        """The nvCOMP codec object for (device, data_type), created on first use."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, data_type)
        if key not in self._codecs:
            nvcomp = _import_nvcomp()
            kinds = nvcomp.BitstreamKind
            kind = kinds.RAW if self._algo.bitstream == _RAW else kinds.NVCOMP_NATIVE
            kwargs: dict[str, Any] = {
                "algorithm": self._algo.nvcomp_name,
                "device_id": index,
                "cuda_stream": self._stream(device).cuda_stream,
                "uncomp_chunk_size": self._chunk_size,
                "bitstream_kind": kind,
            }
            if data_type != _PLAIN:
                kwargs["data_type"] = data_type
            if self._level is not None:
                kwargs["algorithm_type"] = self._level
            logger.debug("creating nvCOMP codec %s on cuda:%d", kwargs, index)
            self._codecs[key] = nvcomp.Codec(**kwargs)
        return self._codecs[key]

    def _encode_group(self, chunks: list[torch.Tensor], data_type: str) -> list[torch.Tensor]:
        """One nvCOMP encode call for same-typed, non-empty chunks of one device.

        Every buffer is allocated on the caller's stream, and the side stream waits for it before
        nvCOMP runs: payloads then belong to the caller's stream for the caching allocator, and
        reading the compressed sizes synchronizes the side stream before anything is returned.
        """
        nvcomp = _import_nvcomp()
        device = chunks[0].device
        stream = self._stream(device)
        try:
            codec = self._nvcomp_codec(device, data_type)
            alignment = max(codec.get_required_compression_alignment(), 16)
            inputs = [_typed(t, data_type) for t in _staged(chunks, alignment)]
            capacities = self._capacities(codec, inputs, stream)
            offsets = _offsets(capacities, alignment)
            buffer = torch.empty(offsets[-1] + capacities[-1], dtype=torch.uint8, device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            sources = nvcomp.as_arrays(inputs, cuda_stream=stream.cuda_stream)
            targets = nvcomp.as_arrays(buffer, offsets, capacities, cuda_stream=stream.cuda_stream)
            sizes = list(codec.encode(sources, out=targets).buffer_sizes)
        except (RuntimeError, ValueError, TypeError) as exc:
            total = sum(t.numel() for t in chunks)
            raise CodecError(
                f"nvCOMP {self._algo.nvcomp_name} ({data_type}) failed to encode {len(chunks)} "
                f"chunks ({total} bytes) on {device}: {exc}"
            ) from exc
        torch.cuda.current_stream(device).wait_stream(stream)
        return [buffer[off : off + size] for off, size in zip(offsets, sizes)]

    def _capacities(self, codec: Any, inputs: list[torch.Tensor], stream: torch.cuda.Stream) -> list[int]:
        """Output slot size per input: nvCOMP's bound for it (asked once per distinct size), or
        for RAW bitstreams the bound of the group's largest input, which nvCOMP requires."""
        nvcomp = _import_nvcomp()
        bound: dict[int, int] = {}
        for t in inputs:
            nbytes = t.numel() * t.element_size()
            if nbytes not in bound:
                array = nvcomp.as_array(t, cuda_stream=stream.cuda_stream)
                bound[nbytes] = int(codec.get_max_comp_buffer_size(array))
        if self._algo.bitstream == _RAW:
            return [max(bound.values())] * len(inputs)
        return [bound[t.numel() * t.element_size()] for t in inputs]

    def _decode_group(
        self, payloads: list[torch.Tensor], outs: list[torch.Tensor], data_type: str, indices: list[int]
    ) -> None:
        """One nvCOMP decode call for same-typed, non-empty chunks; checks every decoded size.

        Same stream discipline as `_encode_group`; a misaligned output is decoded into a temporary
        and copied, on the caller's stream, after the side stream is done.
        """
        nvcomp = _import_nvcomp()
        device = outs[0].device
        stream = self._stream(device)
        try:
            codec = self._nvcomp_codec(device, data_type)
            alignment = max(codec.get_required_decompression_alignment(), 16)
            sources_t = _staged(payloads, alignment)
            targets_t = [o if o.data_ptr() % alignment == 0 else torch.empty_like(o) for o in outs]
            stream.wait_stream(torch.cuda.current_stream(device))
            sources = nvcomp.as_arrays(sources_t, cuda_stream=stream.cuda_stream)
            targets = nvcomp.as_arrays(targets_t, cuda_stream=stream.cuda_stream)
            sizes = list(codec.decode(sources, out=targets).buffer_sizes)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise CodecError(
                f"nvCOMP {self._algo.nvcomp_name} ({data_type}) failed to decode units {indices} "
                f"(payload bytes {[p.numel() for p in payloads][:8]}, expected output bytes "
                f"{[o.numel() for o in outs][:8]}) on {device}: {exc}"
            ) from exc
        torch.cuda.current_stream(device).wait_stream(stream)
        for i, size, out, target in zip(indices, sizes, outs, targets_t):
            if size != out.numel():
                raise CodecError(
                    f"nvCOMP {self._algo.nvcomp_name}: unit {i} (a chunk, or a zstd frame) decoded "
                    f"to {size} bytes, "
                    f"expected {out.numel()}"
                )
            if target is not out:
                out.copy_(target)


def _offsets(capacities: list[int], alignment: int) -> list[int]:
    """Start of each compressed slot in one output buffer, every slot aligned for nvCOMP."""
    offsets = [0]
    for cap in capacities[:-1]:
        offsets.append(offsets[-1] + _round_up(cap, alignment))
    return offsets
