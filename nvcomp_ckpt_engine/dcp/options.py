"""The compression options of the DCP writer and the Megatron-Core strategy (one frozen record)."""

from __future__ import annotations

import dataclasses

from ..api import DEFAULT_CHUNK_MB, DEFAULT_GPU_BATCH_MB
from ..codecs import validate_algorithm
from ..config import MAX_CHUNK_MB, MIN_CHUNK_MB


@dataclasses.dataclass(frozen=True)
class CompressionOptions:
    """How a rank's items are compressed; picklable, so Megatron-Core's writer processes get it.

    algorithm / portable / chunk_mb / gpu_batch_mb mean what they mean for
    `nvcomp_ckpt_engine.save`; `workers` is the number of CPU codec threads (None: one per
    core, at most 8).
    """

    algorithm: str = "auto"
    portable: bool = False
    chunk_mb: float = DEFAULT_CHUNK_MB
    workers: int | None = None
    gpu_batch_mb: float = DEFAULT_GPU_BATCH_MB

    def __post_init__(self) -> None:
        validate_algorithm(self.algorithm, portable=self.portable)
        if not isinstance(self.chunk_mb, (int, float)) or not (
            MIN_CHUNK_MB <= self.chunk_mb <= MAX_CHUNK_MB
        ):
            raise ValueError(
                f"chunk_mb must be between {MIN_CHUNK_MB} and {MAX_CHUNK_MB} MiB, got "
                f"{self.chunk_mb!r}"
            )
        if self.workers is not None and (type(self.workers) is not int or self.workers < 1):
            raise ValueError(f"workers must be a positive integer or None, got {self.workers!r}")
        if not isinstance(self.gpu_batch_mb, (int, float)) or not self.gpu_batch_mb > 0:
            raise ValueError(f"gpu_batch_mb must be a positive number, got {self.gpu_batch_mb!r}")

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mb * (1 << 20))

    @property
    def gpu_batch_bytes(self) -> int:
        return int(self.gpu_batch_mb * (1 << 20))
