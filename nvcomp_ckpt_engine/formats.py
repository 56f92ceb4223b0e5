"""The file format's torch-free facts: dtype names and element sizes, stored codec names and how
far each can expand, the byte-plane transform's element width, and the general expansion bound.

A reader checks a shard's index against these without torch (`nvcomp-ckpt inspect`/`verify` run
where torch is not installed); the torch side (codecs, transforms, state, container's dtype table)
imports them from here, so each fact lives in one place.
"""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedCheckpointError

#: Bytes per element of each dtype name the file format stores; the names are torch's attribute
#: names (`torch.<name>`), written out because the file format never follows torch's repr.
ITEMSIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}

#: The floating-point dtype names (`torch.dtype.is_floating_point`): what a derived range's
#: source tensor must be.
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
                "float8_e4m3fnuz", "float8_e5m2fnuz")

#: A derived range's digest (format version 4, `derived.range_digest`): its bytes, zero-padded to
#: a multiple of 4, read as little-endian unsigned 32-bit words w_0..w_{n-1}, give Fletcher's two
#: sums ``A = sum(w_j) mod DIGEST_PRIME`` and ``B = sum((j + 1) * w_j) mod DIGEST_PRIME``, and the
#: digest is ``A * 2**31 + B``. Integer sums that every device computes alike, where the bytes
#: are (a GPU, for a module being saved or rebuilt there).
DIGEST_PRIME = (1 << 31) - 1
#: Digests are below this bound.
DIGEST_LIMIT = 1 << 62

#: The codec names a writer accepts ("auto" picks one per storage; the rest are stored names).
ALGORITHMS = ("auto", "ans", "zstd", "gdeflate", "deflate", "bitcomp", "cascaded", "lz4", "none")

#: The file format's expansion bound: what a skeleton may build per byte of it (every call and
#: BUILD is charged before it runs), and what a chunk may decode to per stored byte when its
#: codec does not bound that itself (container).
MAX_EXPANSION = 65536

#: The most raw bytes one stored byte can decode to, for the codecs whose bitstream bounds it:
#: a zstd block of at most 128 KiB can be a 4-byte RLE block (32,768x); a deflate match of 258
#: bytes costs at least 2 bits (1,032x); "none" stores bytes as they are. nvCOMP's own formats
#: publish no bound: the file format's general one applies to them (`max_ratio`).
_MAX_RATIO = {"zstd": 32768, "deflate": 1032, "none": 1}

#: What a reader allocates for a storage (or a run of its chunks) on the word of the index
#: alone, per stored byte: real float checkpoints code at 1.2-1.6x, so 16x leaves them all on
#: the fast path, while a forged index asking for more (nvCOMP's formats may declare 65,536x,
#: zstd 32,768x) must first prove it by decoding (`plausible_raw`).
PLAUSIBLE_EXPANSION = 16
#: Raw bytes a storage may declare beyond `PLAUSIBLE_EXPANSION` x its stored bytes without
#: proof, so small tensors (a step counter, a zero bias) never pay for one.
PLAUSIBLE_SLACK = 1 << 20


def check_descriptor(descriptor: dict[str, Any]) -> None:
    """Raise `UnsupportedCheckpointError` for a codec name or major version this version does
    not know (without looking for a decoder: that needs no GPU)."""
    name = descriptor.get("name")
    version = descriptor.get("version")
    if name not in ALGORITHMS or name == "auto" or version != 1:
        raise UnsupportedCheckpointError(
            f"codec {name!r} version {version!r} is unknown to this nvcomp_ckpt_engine; "
            "upgrade it to read this file"
        )


def max_ratio(descriptor: dict[str, Any]) -> int | None:
    """How many raw bytes one stored byte of this codec can decode to at most (None: the codec
    does not bound it). Raises like `check_descriptor`."""
    check_descriptor(descriptor)
    return _MAX_RATIO.get(descriptor["name"])


def plausible_raw(stored: int) -> int:
    """The most raw bytes a reader allocates for `stored` bytes of chunks before they have
    decoded: above it, the chunks are first decoded into scratch of at most this size (or one
    chunk) and checked to produce exactly what they declare."""
    return stored * PLAUSIBLE_EXPANSION + PLAUSIBLE_SLACK


def plane_width(descriptor: dict[str, Any]) -> int:
    """The element width a stored transform descriptor asks for; 1 means no transform.

    Raises `UnsupportedCheckpointError` for a transform this version does not know.
    """
    name = descriptor.get("name")
    if descriptor.get("version") != 1 or name not in ("none", "byteplanes"):
        raise UnsupportedCheckpointError(
            f"unknown transform {descriptor!r}; this nvcomp_ckpt_engine knows 'none/1' and "
            "'byteplanes/1' — upgrade nvcomp_ckpt_engine to read this file"
        )
    if name == "none":
        return 1
    width = descriptor.get("width")
    if not isinstance(width, int) or width not in (2, 4, 8, 16):
        raise UnsupportedCheckpointError(f"byteplanes transform with invalid width {width!r}")
    return width


__all__ = [
    "ALGORITHMS", "DIGEST_LIMIT", "DIGEST_PRIME", "FLOAT_DTYPES", "ITEMSIZES", "MAX_EXPANSION",
    "PLAUSIBLE_EXPANSION", "PLAUSIBLE_SLACK", "check_descriptor", "max_ratio", "plane_width",
    "plausible_raw",
]
