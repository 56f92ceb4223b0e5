"""Which codec encodes a tensor, and which codec decodes a stored payload.

The choice is explicit and visible: `plan_for` says which codec and transform a tensor of a
given dtype and device gets, `decoder_for` which implementation reads a stored descriptor, and
`backend_summary` which backends this process has. Nothing falls back silently: a GPU-only codec
asked for where no GPU (or no nvCOMP) exists raises, and a CUDA tensor saved without nvCOMP
installed takes the CPU path with one log line, at the first save, saying so.

Measured choices behind ``algorithm="auto"`` (docs/BENCHMARKS.md), the plan by dtype:
- on a GPU: nvCOMP ANS with its float ``data_type`` mode for bf16/fp16/fp32 (1.50x on bf16
  weights, 1.16–1.20x on fp32 master weights and Adam moments, over 100 GB/s on an H200);
- portable, or on the CPU: Zstd after the byte-plane transform (1.44x bf16, 1.17–1.22x fp32),
  which a CPU decodes and nvCOMP writes as a standard zstd frame.
`candidates_for` adds plans of the same speed that code some parts smaller (ANS after byte
planes: Adam's second moments), and `selection` picks per storage from a sample.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedCheckpointError
from ..formats import ALGORITHMS, check_descriptor
from .base import Codec, element_of
from .cpu import DeflateCodec, NoneCodec, ZstdCodec

logger = logging.getLogger(__name__)

#: Codecs with a CPU implementation and a standard bitstream (readable with or without a GPU).
PORTABLE = ("zstd", "deflate", "none")
#: Codecs that run only in nvCOMP on a CUDA device.
GPU_ONLY = ("ans", "gdeflate", "bitcomp", "cascaded", "lz4")
#: Byte-oriented codecs that gain from the byte-plane transform on float data.
_PLANE_FRIENDLY = ("zstd", "deflate", "gdeflate", "lz4")
_FLOAT_DTYPES = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
)


@dataclass(frozen=True)
class Plan:
    """How one storage is encoded: the codec, the byte-plane width (1 = none), the element hint."""

    codec: Codec
    width: int
    element: str


@functools.cache
def _gpu_module():
    """The nvCOMP codec module, or None where nvCOMP or CUDA is missing."""
    from . import nvcomp_gpu

    if not nvcomp_gpu.nvcomp_available() or not torch.cuda.is_available():
        return None
    return nvcomp_gpu


@functools.cache
def _announce_cpu_codecs() -> None:
    """Say once per process, at the first save without GPU codecs, what compresses instead.

    Only saves call it: a read compresses nothing, and a reader that needs a GPU codec it lacks
    gets its own error from `decoder_for`.
    """
    from . import nvcomp_gpu

    if not nvcomp_gpu.nvcomp_available():
        logger.warning(
            "nvcomp_ckpt_engine: nvCOMP is not installed, so every tensor is compressed with the "
            "CPU codecs (zstd, deflate)%s. Install the extra 'nvcomp_ckpt_engine[cu13]' (or "
            "[cu12]) on GPU machines for GPU compression.",
            " although CUDA is available" if torch.cuda.is_available() else "",
        )
    else:
        logger.info("nvcomp_ckpt_engine: no CUDA device; using the CPU codecs (zstd, deflate)")


def gpu_codecs_available() -> bool:
    """True when nvCOMP and a CUDA device are usable in this process."""
    return _gpu_module() is not None


def backend_summary() -> dict[str, Any]:
    """What this process can encode and decode with, for logs and `nvcomp-ckpt` output."""
    gpu = _gpu_module()
    return {
        "cuda": torch.cuda.is_available(),
        "nvcomp": gpu.nvcomp_version() if gpu else None,
        "codecs": sorted(PORTABLE + (GPU_ONLY if gpu else ())),
    }


def validate_algorithm(algorithm: str, *, portable: bool) -> None:
    """Reject an unknown algorithm, or a GPU-only one combined with ``portable=True``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"'algorithm' = {algorithm!r} is an unknown algorithm; expected one of "
                         f"{list(ALGORITHMS)}")
    if portable and algorithm in GPU_ONLY:
        raise ValueError(
            f"'algorithm' = {algorithm!r} writes an nvCOMP-only bitstream, but \"portable\" asks "
            f"for files a CPU can decode; use one of {['auto', *PORTABLE]} or turn \"portable\" off"
        )


def _planes_for(dtype: torch.dtype, codec_name: str, element_size: int) -> int:
    if dtype in _FLOAT_DTYPES and codec_name in _PLANE_FRIENDLY and element_size > 1:
        return element_size
    return 1


def plan_for(dtype: torch.dtype, device: torch.device, *, algorithm: str, portable: bool) -> Plan:
    """The codec and transform for a storage of `dtype` living on `device`.

    `dtype` is the element type of the tensors that view the storage (``torch.uint8`` when views
    of different types share it). CUDA data is encoded on its GPU when nvCOMP is usable; CPU data
    on the CPU when no GPU is usable, and otherwise streamed through the current GPU.
    """
    validate_algorithm(algorithm, portable=portable)
    element_size = torch.empty(0, dtype=dtype).element_size()
    if algorithm == "none":
        return Plan(NoneCodec(), 1, "u1")
    gpu = _gpu_module()
    if gpu is None:
        _announce_cpu_codecs()
    # With a GPU at hand, CPU-resident state (ZeRO-Offload) is streamed through it too: nvCOMP
    # encodes at 100+ GB/s against ~1 GB/s for CPU zstd, so the save stays bound by the storage.
    # nvCOMP's Deflate runs at 1-2 GB/s on a GPU, slower than zlib across a node's cores: deflate
    # is always encoded on the CPU.
    use_gpu = gpu is not None and algorithm != "deflate"
    if algorithm == "auto":
        algorithm = "ans" if use_gpu and not portable else "zstd"
    if algorithm in GPU_ONLY and gpu is None:
        raise UnsupportedCheckpointError(
            f"algorithm {algorithm!r} runs only in nvCOMP on a CUDA device, and this process has "
            f"{'no nvCOMP' if torch.cuda.is_available() else 'no CUDA device'}; use 'zstd', "
            "'deflate' or 'auto', or install nvcomp_ckpt_engine[cu13] on a GPU machine"
        )
    width = _planes_for(dtype, algorithm, element_size)
    element = element_of(dtype) if width == 1 else "u1"
    if use_gpu:
        return Plan(gpu.make_codec(algorithm), width, element)
    codec = ZstdCodec() if algorithm == "zstd" else DeflateCodec()
    return Plan(codec, width, element)


def candidates_for(dtype: torch.dtype, device: torch.device, *, algorithm: str, portable: bool) -> list[Plan]:
    """The plans `auto` may choose from for a storage, by measuring a sample (`selection`);
    the first is `plan_for`'s, the choice by dtype alone, which stays unless another codes the
    sample smaller. Only plans as fast as it are offered:
    - nvCOMP ANS with its float mode (the dtype choice on a GPU) and ANS after the byte-plane
      transform, which codes fp32 Adam second moments smaller (1.248x against 1.210x measured,
      docs/BENCHMARKS.md) at ANS speed;
    - Zstd after the byte-plane transform (the dtype choice on the CPU, or portable) and plain
      Zstd, which wins on bytes that are not floating-point numbers (text, packed integers).
    Any other `algorithm`, or a dtype without planes, has one candidate.
    """
    first = plan_for(dtype, device, algorithm=algorithm, portable=portable)
    element_size = torch.empty(0, dtype=dtype).element_size()
    if algorithm != "auto" or dtype not in _FLOAT_DTYPES or element_size == 1:
        return [first]
    if first.codec.name == "ans" and first.width == 1:
        return [first, Plan(first.codec, element_size, "u1")]
    if first.codec.name == "zstd" and first.width > 1:
        return [first, Plan(first.codec, 1, element_of(dtype))]
    return [first]


def encoder_for_this_thread(codec: Codec) -> Codec:
    """A codec that writes exactly what `codec` writes (the same descriptor), for the calling
    thread: nvCOMP's codec objects belong to the thread that made them (`nvcomp_gpu`), so a GPU
    codec made on another thread is made anew from its descriptor; CPU codecs are shared."""
    if codec.device != "cuda":
        return codec
    descriptor = codec.descriptor()
    return _gpu_module().make_codec(descriptor["name"], **descriptor.get("options", {}))


def decoder_for(descriptor: dict[str, Any], *, on_cuda: bool) -> Codec:
    """The codec that decodes payloads stored with `descriptor`.

    `on_cuda` says the payload's destination is a CUDA device, where nvCOMP decodes portable
    bitstreams too. Raises `UnsupportedCheckpointError` for an unknown codec or major version,
    an nvCOMP bitstream from an incompatible nvCOMP release, or a GPU-only codec without a GPU
    (naming both ways out).
    """
    check_descriptor(descriptor)
    name = descriptor["name"]
    if name == "none":
        return NoneCodec()
    gpu = _gpu_module()
    if name in GPU_ONLY:
        if gpu is None:
            raise UnsupportedCheckpointError(
                f"this file was compressed with nvCOMP {name.upper()}, which only a GPU can "
                "decode, and this process has "
                f"{'no nvCOMP installed' if torch.cuda.is_available() else 'no CUDA device'}. "
                "Load it on a GPU node with nvcomp_ckpt_engine[cu13] installed, or convert it there "
                "with `nvcomp-ckpt decompress CKPT_DIR OUT_DIR` (plain torch files) or "
                "`nvcomp-ckpt compress --portable` (CPU-readable zstd)."
            )
        gpu.check_bitstream_compatible(descriptor)
        return gpu.make_codec(name, **descriptor.get("options", {}))
    if on_cuda and gpu is not None and descriptor.get("library"):
        gpu.check_bitstream_compatible(descriptor)
        return gpu.make_codec(name, **descriptor.get("options", {}))
    level = descriptor.get("options", {}).get("level", 1)
    return ZstdCodec(level) if name == "zstd" else DeflateCodec(level)


__all__ = [
    "GPU_ONLY",
    "PORTABLE",
    "Codec",
    "Plan",
    "backend_summary",
    "candidates_for",
    "decoder_for",
    "encoder_for_this_thread",
    "gpu_codecs_available",
    "plan_for",
    "validate_algorithm",
]
