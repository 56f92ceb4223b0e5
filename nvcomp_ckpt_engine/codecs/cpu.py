"""CPU codecs: zstd (the `zstandard` package), deflate (zlib) and `none`.

Their bitstreams are standard: a zstd frame and a raw RFC 1951 deflate stream. nvCOMP's Zstd
(RAW bitstream) and Deflate write the same formats on a GPU, which is what makes a `portable`
file readable on a machine without one, in both directions.

Both libraries release the GIL while they work, so the pipeline runs these codecs from a thread
pool to keep every core busy. Each call creates its own (cheap) compressor object, which makes
a codec instance safe to share between threads.
"""

from __future__ import annotations

import io
import zlib
from typing import Any

import numpy
import torch
import zstandard

from ..errors import CodecError
from .base import Codec


def _as_buffer(chunk: torch.Tensor) -> memoryview:
    if chunk.device.type != "cpu" or chunk.dtype != torch.uint8 or not chunk.is_contiguous():
        raise ValueError("CPU codecs take contiguous CPU uint8 tensors")
    return memoryview(chunk.numpy()).cast("B")


def _from_bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _fill(out: torch.Tensor, data: bytes, codec: str) -> None:
    if len(data) != out.numel():
        raise CodecError(f"{codec} payload decoded to {len(data)} bytes, expected {out.numel()}")
    if data:
        out.numpy()[:] = numpy.frombuffer(data, dtype=numpy.uint8)


class ZstdCodec(Codec):
    """Zstandard on the CPU; `level` trades speed for ratio (1 is fast, 3 is zstd's default)."""

    name = "zstd"

    def __init__(self, level: int = 1) -> None:
        self.level = level

    def encode_batch(self, chunks: list[torch.Tensor], *, element: str = "u1") -> list[torch.Tensor]:
        compressor = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
        return [_from_bytes(compressor.compress(_as_buffer(c))) for c in chunks]

    def decode_batch(
        self, payloads: list[torch.Tensor], outs: list[torch.Tensor], *, element: str = "u1"
    ) -> None:
        decompressor = zstandard.ZstdDecompressor()
        for payload, out in zip(payloads, outs, strict=True):
            # A payload is a zstd stream of one frame (CPU-written) or several (nvCOMP writes one
            # per MiB behind a skippable frame): read across frames, and never more than the
            # size the index declares plus one byte, which exposes a payload that is too long.
            reader = decompressor.stream_reader(
                io.BytesIO(_as_buffer(payload)), read_across_frames=True
            )
            try:
                data = reader.read(out.numel() + 1) if out.numel() else reader.read(1)
            except zstandard.ZstdError as exc:
                raise CodecError(f"zstd could not decode the payload: {exc}") from exc
            _fill(out, data, "zstd")

    def descriptor(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "options": {"level": self.level}}


class DeflateCodec(Codec):
    """Raw deflate (RFC 1951, no zlib header) with zlib on the CPU."""

    name = "deflate"

    def __init__(self, level: int = 1) -> None:
        self.level = level

    def encode_batch(self, chunks: list[torch.Tensor], *, element: str = "u1") -> list[torch.Tensor]:
        out = []
        for chunk in chunks:
            compressor = zlib.compressobj(self.level, zlib.DEFLATED, -15)
            out.append(_from_bytes(compressor.compress(_as_buffer(chunk)) + compressor.flush()))
        return out

    def decode_batch(
        self, payloads: list[torch.Tensor], outs: list[torch.Tensor], *, element: str = "u1"
    ) -> None:
        for payload, out in zip(payloads, outs, strict=True):
            decompressor = zlib.decompressobj(-15)
            try:
                data = decompressor.decompress(_as_buffer(payload), out.numel())
                complete = decompressor.eof and not decompressor.unconsumed_tail
            except zlib.error as exc:
                raise CodecError(f"deflate could not decode the payload: {exc}") from exc
            if not complete:
                raise CodecError("deflate payload does not end where the index says it does")
            _fill(out, data, "deflate")

    def descriptor(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "options": {"level": self.level}}


class NoneCodec(Codec):
    """Stores bytes as they are: for data that does not compress, and for `algorithm="none"`."""

    name = "none"

    def encode_batch(self, chunks: list[torch.Tensor], *, element: str = "u1") -> list[torch.Tensor]:
        return list(chunks)

    def decode_batch(
        self, payloads: list[torch.Tensor], outs: list[torch.Tensor], *, element: str = "u1"
    ) -> None:
        for payload, out in zip(payloads, outs, strict=True):
            if payload.numel() != out.numel():
                raise CodecError(f"stored chunk holds {payload.numel()} bytes, expected {out.numel()}")
            out.copy_(payload)
