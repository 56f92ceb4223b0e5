"""How a shard is compressed: one frozen options type with its defaults and its one validation.

Every writer takes these options: `save` / `save_async` as keyword arguments, the DCP writer
and the Megatron strategy as keyword arguments kept in a `CompressionOptions`, and the
DeepSpeed engine through `config.NvcompConfig`, which extends this type with DeepSpeed's own
keys. So a value is checked, and a default chosen, in one place only.

The options are what the written file is made of (codec, chunking, the nvCOMP batch). How
many CPU threads code it (`workers`) changes the speed, not the file, and the DeepSpeed
config has no such key: it is a separate keyword, checked by `check_workers`. How the payloads
travel to the file (`io_path`) changes the speed too: a keyword of `save` and a key of the
DeepSpeed config, checked by `check_io_path`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from .codecs import validate_algorithm

#: Default chunk size: large enough for nvCOMP and zstd to reach full speed, small enough that
#: chunks pipeline well and a damaged chunk costs little.
DEFAULT_CHUNK_MB = 16
#: Raw bytes per nvCOMP call: enough 1 MiB nvCOMP chunks to fill an H100/H200's SMs.
DEFAULT_GPU_BATCH_MB = 256
#: Accepted chunk sizes in MiB.
MIN_CHUNK_MB = 1 / 1024
MAX_CHUNK_MB = 1024
#: Accepted nvCOMP batch sizes in MiB.
MIN_GPU_BATCH_MB = 1
MAX_GPU_BATCH_MB = 16384
#: How GPU-coded payloads reach a local file (`io_path`): ``"pinned"`` copies them into pinned
#: host memory and writes them from there; ``"gds"`` hands them, still in GPU memory, to the
#: GPUDirect Storage sink (kvikio: `storage.gds`); ``"auto"`` is `AUTO_IO_PATH`.
IO_PATHS = ("auto", "pinned", "gds")
#: What ``"auto"`` means: the path measured faster in the 1.3B DeepSpeed benchmark
#: (docs/BENCHMARKS.md; `bench_deepspeed.py --variants auto,auto-gds`): ``"pinned"``, 6.99 s
#: until durable against 7.66 s for the sink in kvikio's compatibility mode on an H100 without
#: nvidia-fs; ``"gds"`` would make the GDS sink the default wherever kvikio is installed and the
#: file is local (elsewhere ``"auto"`` stays pinned).
AUTO_IO_PATH = "pinned"

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class CompressionOptions:
    """How a shard's tensors are compressed; picklable, so Megatron-Core's writer processes
    get it.

    Attributes:
        algorithm: ``"auto"`` (per storage, from a sample of it: nvCOMP ANS with its float
            modes or after byte planes on a GPU, zstd after byte planes or plain on the CPU:
            `selection`), or one of `formats.ALGORITHMS`. GPU-only codecs need nvCOMP and CUDA.
        portable: write only codecs a machine without a GPU can decode (zstd, deflate, none),
            for archives and GPU-less tools; slower to write on a GPU than ANS.
        chunk_mb: chunk size in MiB (1/1024 to 1024); each chunk is compressed, checksummed and
            written on its own.
        gpu_batch_mb: raw MiB handed to nvCOMP per call (1 to 16384); a save's extra GPU memory
            is about three times this (input planes, output, nvCOMP scratch) and its pinned host
            memory at most four times this, whatever the state's size (lower it if a save runs
            out of GPU memory: `pipeline.save_staging_bound`). A load in batches of this size
            holds at most five times it (decoding onto the GPU) or eight (into host memory).
    """

    algorithm: str = "auto"
    portable: bool = False
    chunk_mb: float = DEFAULT_CHUNK_MB
    gpu_batch_mb: float = DEFAULT_GPU_BATCH_MB

    #: Put before every error message: where the options were given (a config section's name).
    _ORIGIN: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self._check_bool("portable")
        try:
            validate_algorithm(self.algorithm, portable=self.portable)
        except ValueError as exc:
            raise ValueError(f"{self._ORIGIN}{exc}") from None
        self._check_range("chunk_mb", MIN_CHUNK_MB, MAX_CHUNK_MB, "1/1024")
        self._check_range("gpu_batch_mb", MIN_GPU_BATCH_MB, MAX_GPU_BATCH_MB, "1")

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mb * _MIB)

    @property
    def gpu_batch_bytes(self) -> int:
        return int(self.gpu_batch_mb * _MIB)

    @classmethod
    def _key(cls, field: str) -> str:
        """The name a user gives `field` by (a subclass may spell some differently)."""
        return field

    def _invalid(self, field: str, value: Any, expected: str) -> str:
        """The message for a bad value: where, which option, the value, what it accepts."""
        return f"{self._ORIGIN}{self._key(field)!r} = {value!r} is not valid; expected {expected}"

    def _check_bool(self, field: str) -> None:
        value = getattr(self, field)
        if not isinstance(value, bool):
            raise ValueError(self._invalid(field, value, "true or false"))

    def _check_range(self, field: str, low: float, high: float, low_text: str) -> None:
        value = getattr(self, field)
        if not (is_number(value) and low <= value <= high):
            raise ValueError(self._invalid(field, value, f"a number of MiB from {low_text} to {high}"))


def check_workers(workers: int | None) -> int | None:
    """`workers` (CPU codec threads) if it is a positive integer or None (one per core, at
    most 8), else a `ValueError` naming it."""
    if workers is not None and (type(workers) is not int or workers < 1):
        raise ValueError(f"'workers' = {workers!r} is not valid; expected a positive integer or None")
    return workers


def check_io_path(io_path: Any, *, origin: str = "") -> str:
    """`io_path` if it is one of `IO_PATHS`, else a `ValueError` naming the option (after
    `origin`, where it was given: a config section's name)."""
    if not isinstance(io_path, str) or io_path not in IO_PATHS:
        expected = ", ".join(f'"{p}"' for p in IO_PATHS)
        raise ValueError(f"{origin}'io_path' = {io_path!r} is not valid; expected one of {expected}")
    return io_path


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


__all__ = [
    "AUTO_IO_PATH",
    "DEFAULT_CHUNK_MB",
    "DEFAULT_GPU_BATCH_MB",
    "IO_PATHS",
    "MAX_CHUNK_MB",
    "MAX_GPU_BATCH_MB",
    "MIN_CHUNK_MB",
    "MIN_GPU_BATCH_MB",
    "CompressionOptions",
    "check_io_path",
    "check_workers",
    "is_number",
]
