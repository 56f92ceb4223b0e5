"""The one interface every codec implements.

A codec turns chunks (1-D contiguous ``torch.uint8`` tensors) into compressed payloads and back.
GPU codecs (nvCOMP) take and return CUDA tensors on the chunk's own device; CPU codecs take and
return CPU tensors. Batches exist because nvCOMP is fast only when it is handed many chunks in
one call; CPU codecs may simply loop (or use a thread pool).
"""

from __future__ import annotations

import abc
from typing import Any

import torch

#: Element type hints, by torch dtype: what ANS's ``data_type`` modes need to know about the
#: bytes.  Byte-oriented codecs ignore them.
ELEMENT_BY_DTYPE: dict[torch.dtype, str] = {
    torch.bfloat16: "bf2",
    torch.float16: "f2",
    torch.float32: "f4",
    torch.float64: "f8",
    torch.complex64: "f4",
    torch.complex128: "f8",
    torch.int16: "i2",
    torch.int32: "i4",
    torch.int64: "i8",
    torch.uint16: "u2",
    torch.uint32: "u4",
    torch.uint64: "u8",
}


def element_of(dtype: torch.dtype) -> str:
    """The element hint for `dtype`; ``"u1"`` (plain bytes) for everything else."""
    return ELEMENT_BY_DTYPE.get(dtype, "u1")


class Codec(abc.ABC):
    """A lossless byte codec; see the module docstring for the contract."""

    #: Stable name stored in files ("zstd", "deflate", "none", "ans", "gdeflate", ...).
    name: str
    #: Major version of the bitstream this codec writes; a reader refuses another major.
    version: int = 1
    #: Where encode/decode run: "cpu" or "cuda".
    device: str = "cpu"
    #: True if a CPU-only machine can decode what this codec wrote.
    cpu_decodable: bool = True
    #: Bytes the codec codes with one model (nvCOMP's internal chunk), 0 for one that adapts
    #: along the data: a sample must give each byte plane at least this much (`selection`).
    frame_bytes: int = 0

    @abc.abstractmethod
    def encode_batch(self, chunks: list[torch.Tensor], *, element: str = "u1") -> list[torch.Tensor]:
        """Compress each chunk; returns one 1-D uint8 payload per chunk, on the codec's device."""

    @abc.abstractmethod
    def decode_batch(
        self, payloads: list[torch.Tensor], outs: list[torch.Tensor], *, element: str = "u1"
    ) -> None:
        """Decompress each payload into the matching pre-sized uint8 tensor of `outs`.

        Raises `CorruptCheckpointError` (via the caller's context) or `CodecError` when a payload
        does not decode to exactly ``outs[i].numel()`` bytes.
        """

    def descriptor(self) -> dict[str, Any]:
        """What a file records about this codec: enough to pick the decoder and check versions."""
        return {"name": self.name, "version": self.version}
