"""How much a save or a load holds at once: CPU codec threads, GPU batches in flight, and the
host staging memory these give (`staging.METER`), a bound independent of the size of the state.

The batch counts live here, beside the bounds they set, so a change to either is one change.
"""

from __future__ import annotations

import os

#: Encoded GPU batches waiting for the writer, at most (raw bytes / gpu_batch_bytes): with the
#: one being encoded, a save's pinned host memory stays within 4 batches (1 GiB by default).
STAGED_BATCHES = 3
#: GPU batches' bytes read (or being read) ahead of the decoder, at most, in batches of the
#: reader's size (1 GiB at the default 256 MiB; at least one batch).
READ_AHEAD_BATCHES = 4
#: Decoded GPU batches on their way into host memory at once (see `decode._ShardReader`).
COPY_AHEAD = 2


def default_workers() -> int:
    """CPU codec threads: every core, since zstd and zlib release the GIL while they work."""
    return max(1, min(8, os.cpu_count() or 1))


def save_staging_bound(*, workers: int, chunk_bytes: int, gpu_batch_bytes: int) -> int:
    """The most host staging memory (`staging.METER`) a save holds at once, whatever the size of
    the state: `STAGED_BATCHES` + 1 GPU batches of pinned payloads (the batches waiting for the
    writer and the one being copied off the GPU), and for CPU-coded chunks 2 x `workers` + 1
    payloads waiting for the writer plus, in each worker, a chunk's host copy and planes while
    it is coded. Pass ``gpu_batch_bytes=0`` for a save that codes nothing on a GPU."""
    return (STAGED_BATCHES + 1) * gpu_batch_bytes + (4 * workers + 1) * chunk_bytes


def load_staging_bound(*, workers: int, chunk_bytes: int, gpu_batch_bytes: int) -> int:
    """The most host staging memory (`staging.METER`) a load holds at once, whatever the size of
    the file: `READ_AHEAD_BATCHES` GPU batches read ahead, one more whose copy to the GPU is in
    flight, and `COPY_AHEAD` + 1 decoded batches on their way into host memory; for CPU-coded
    chunks, a chunk's read buffer and planes in each worker. Pass ``gpu_batch_bytes=0`` for a
    file that decodes nothing on a GPU."""
    return (READ_AHEAD_BATCHES + 1 + COPY_AHEAD + 1) * gpu_batch_bytes + 2 * workers * chunk_bytes
