"""Which way a shard's GPU-coded payloads travel to its file (`io_path`), and the sink for it.

``"pinned"``: the encoder copies each GPU batch's payloads into pinned host memory (one copy,
one sync), checksums them there and the storage's sink writes them from host memory: every
backend. ``"gds"``: the payloads stay in GPU memory and a sink that takes device buffers writes
them (`storage.gds`, kvikio: cuFile with nvidia-fs, its compatibility mode otherwise); the
encoder still copies them to host memory for their CRC-32s (the index records one per chunk,
and the file's), but that copy is given back once checksummed, not held until written. Local
files only. ``"auto"`` is `options.AUTO_IO_PATH`, which only a measurement changes; where it says
``"gds"`` and the GDS sink cannot be had (no kvikio, no GPU, a URL), ``"auto"`` is pinned.

What the manifest records per file (`ShardInfo.io`, `manifest.IO_RECORDS`): ``"gds"`` or
``"gds-compat"`` (GPU payloads written from GPU memory), ``"pinned"`` (through pinned host
memory), ``"host"`` (no GPU-coded payload: the file was coded in host memory).
"""

from __future__ import annotations

import os

import torch

from ..options import AUTO_IO_PATH, check_io_path
from ..storage import Sink, gds, locations


def resolve(io_path: str, path: str | os.PathLike) -> str:
    """``"gds"`` or ``"pinned"``: the way a save to `path` with `io_path` writes GPU payloads.
    ``"gds"`` asked for where it cannot be had is a ValueError naming the option and why."""
    check_io_path(io_path)
    wanted = AUTO_IO_PATH if io_path == "auto" else io_path
    if wanted == "pinned":
        return "pinned"
    why = _why_not_gds(path)
    if why is None:
        return "gds"
    if io_path == "auto":
        return "pinned"
    raise ValueError(f"'io_path' = \"gds\" cannot write {os.fspath(path)}: {why}; set io_path to "
                     '"auto" or "pinned" to write through pinned host memory')


def check_here(io_path: str, *, origin: str = "") -> None:
    """A ValueError naming the option (after `origin`: a config section's name) where `io_path`
    asks for ``"gds"`` and this process cannot have the GDS sink for any file (no kvikio, no
    CUDA device): for a job to fail when it starts, not at its first save."""
    why = _why_not_here() if check_io_path(io_path, origin=origin) == "gds" else None
    if why is not None:
        raise ValueError(f"{origin}'io_path' = \"gds\" cannot be used here: {why}; set it to "
                         '"auto" or "pinned" to write through pinned host memory')


def _why_not_gds(path: str | os.PathLike) -> str | None:
    if locations.is_url(path):
        return "GPUDirect Storage writes local files only"
    return _why_not_here()


def _why_not_here() -> str | None:
    if not gds.kvikio_available():
        return ("it needs kvikio, which this Python cannot import (install the extra for this "
                "machine's CUDA: nvcomp_ckpt_engine[gds-cu12] or [gds-cu13])")
    if not torch.cuda.is_available():
        return "it writes from GPU memory and this process has no CUDA device"
    return None


def open_sink(path: str | os.PathLike, *, way: str, durable: bool, direct: bool) -> Sink:
    """The sink a shard at `path` is written through: the GDS sink for `way` ``"gds"`` (which
    ignores `direct`: kvikio opens the file with and without O_DIRECT itself), else the
    storage's own."""
    if way == "gds":
        return locations.open_device_sink(path, durable=durable)
    return locations.open_sink(path, durable=durable, direct=direct)


__all__ = ["check_here", "open_sink", "resolve"]
