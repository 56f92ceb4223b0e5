"""Storages rebuilt from tensors of other files of the same checkpoint instead of stored twice.

Why: with DeepSpeed ZeRO-1/2, data-parallel rank 0 writes the whole 16-bit module while every
rank writes only its slice of the optimizer state, so at 64 ranks rank 0 writes about 8x more
than the others and every save waits for it. Yet those 16-bit weights are, bit for bit, the
fp32 master partitions the optimizer shards hold, rounded to 16 bits (and an fp32 module *is*
the master). So the module's file may record, for a span of its bytes, which elements of which
tensor of which other file it equals after a cast (`container.DerivedRange`), and readers
rebuild the span from there (`siblings`, or the DeepSpeed engine's all-gather).

This module holds the framework-free parts:
- `Piece`: what a writer knows about one saved tensor's elements and where they come from;
- `storage_ranges` and `merge_ranges`: those pieces as the byte ranges of one stored span;
- `same_after_cast`: the save-time check that a tensor's elements really are the cast of their
  source, on the device where both live; nothing is derived without it;
- `range_digest`: what identifies a range's bytes (format version 4): the writer records it,
  and every reader that rebuilds the range checks it (`check_digest`), so a source file that is
  not the one the range was saved with (another save's shard copied in its place) is refused
  instead of silently giving other weights;
- `copy_range`: the rebuild of one range from its source tensor, its digest checked.

A derived range is exact when the cast computes the same bits where the file is read as where it
was checked. `Tensor.to` rounds to nearest even on every torch device for every value but NaN
(whose bit pattern differs between CPU vector code, CPU scalar code and CUDA), so a fragment
whose source holds a NaN is never derived when the dtypes differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .container import DTYPE_NAMES, DTYPES, DerivedRange
from .errors import CorruptCheckpointError
from .formats import DIGEST_PRIME

#: Elements compared per step in `same_after_cast`: bounds the temporary cast copy.
_CHECK_STEP = 1 << 26
#: `range_digest`'s slices (`_digest_step`), and its rows: the sum of k * s_k is taken as row
#: and column sums of a grid of `_DIGEST_ROW` columns, each term kept below 2**63.
_DIGEST_STEP_CPU = 1 << 20
_DIGEST_STEP_DEVICE = 1 << 26
_DIGEST_ROW = 1024
_WORD = 0xFFFFFFFF

_BITS_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + count)`` of a tensor being saved equal elements ``[offset,
    offset + count)`` of the tensor `key` in the checkpoint file `file`, cast to the saved
    tensor's dtype (which `same_after_cast` checked)."""

    start: int
    count: int
    file: str
    key: str
    offset: int


def same_after_cast(target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor (on `source`'s device, no host sync): whether the 1-D `target` holds
    exactly the bits of ``source.to(target.dtype)``. False where a cast would have to round a
    NaN (see the module docstring). `target` is moved to `source`'s device in slices if needed."""
    if target.numel() != source.numel() or target.dim() != 1 or source.dim() != 1:
        raise ValueError(f"same_after_cast compares 1-D tensors of one size, got {tuple(target.shape)} "
                         f"and {tuple(source.shape)}")
    bits = _BITS_OF_WIDTH[target.element_size()]
    result = torch.ones((), dtype=torch.bool, device=source.device)
    for lo in range(0, source.numel(), _CHECK_STEP):
        part = source[lo : lo + _CHECK_STEP]
        want = target[lo : lo + _CHECK_STEP].to(source.device)
        if part.dtype != want.dtype:
            result &= ~torch.isnan(part).any()
        result &= (part.to(want.dtype).view(bits) == want.view(bits)).all()
    return result


def range_digest(data: torch.Tensor) -> torch.Tensor:
    """The digest of the bytes of the 1-D uint8 tensor `data` (`formats.DIGEST_PRIME`'s
    definition: ``A * 2**31 + B``, Fletcher's two sums of its 32-bit words), as a 0-d int64
    tensor on `data`'s device: no host sync, so a caller digesting many ranges waits once.

    Integer arithmetic only, every intermediate below 2**63, so every device computes the same
    value in any order of summation. The words are read eight bytes at a time (an int64 view:
    its low and high halves are two words) in slices of `_digest_step` bytes through two
    scratch buffers of that size (elementwise work into fresh memory runs at page-fault speed
    on a CPU); a slice that is not 8-byte aligned or not a whole number of rows is copied,
    zero-padded (zero words add nothing to either sum).
    """
    device = data.device
    step = _digest_step(device)
    rows_bytes = 8 * _DIGEST_ROW
    a = torch.zeros((), dtype=torch.int64, device=device)
    b = torch.zeros((), dtype=torch.int64, device=device)
    words = min(step, -(-data.numel() // rows_bytes) * rows_bytes) // 8
    low = torch.empty(words, dtype=torch.int64, device=device)
    high = torch.empty_like(low)
    weights = torch.arange(max(words // _DIGEST_ROW, _DIGEST_ROW), dtype=torch.int64, device=device)
    for lo in range(0, data.numel(), step):
        chunk = data[lo : lo + step]
        if chunk.storage_offset() % 8 or chunk.numel() % rows_bytes:
            padded = torch.zeros(-(-chunk.numel() // rows_bytes) * rows_bytes, dtype=torch.uint8, device=device)
            padded[: chunk.numel()] = chunk
            chunk = padded
        pairs = chunk.view(torch.int64)
        count = pairs.numel()
        low_words, high_words = low[:count], high[:count]
        torch.bitwise_and(pairs, _WORD, out=low_words)  # word 2k: the low half
        torch.bitwise_right_shift(pairs, 32, out=high_words)
        high_words.bitwise_and_(_WORD)  # word 2k + 1: the high half
        high_sum = high_words.sum() % DIGEST_PRIME
        low_words.add_(high_words)  # s_k = w_2k + w_2k+1
        grid = low_words.view(-1, _DIGEST_ROW)
        by_row = grid.sum(dim=1) % DIGEST_PRIME
        by_column = grid.sum(dim=0) % DIGEST_PRIME
        total = by_row.sum() % DIGEST_PRIME  # sum of s_k
        # sum of k * s_k, k = row * _DIGEST_ROW + column
        weighted = (_DIGEST_ROW * ((weights[: grid.shape[0]] * by_row).sum() % DIGEST_PRIME)
                    + (weights[:_DIGEST_ROW] * by_column).sum()) % DIGEST_PRIME
        # words 2k and 2k + 1 of the slice are words base + 2k and base + 2k + 1 of the range:
        # sum (j + 1) w_j = (base + 1) sum s_k + sum w_2k+1 + 2 sum k s_k
        base = lo // 4
        a = (a + total) % DIGEST_PRIME
        b = (b + (base + 1) % DIGEST_PRIME * total + high_sum + 2 * weighted) % DIGEST_PRIME
    return a * (1 << 31) + b


def _digest_step(device: torch.device) -> int:
    """Bytes `range_digest` reads per slice: 1 MiB on a CPU (its scratch stays in cache),
    64 MiB elsewhere (fewer kernel launches; 128 MiB of scratch)."""
    return _DIGEST_STEP_CPU if device.type == "cpu" else _DIGEST_STEP_DEVICE


def check_digest(r: DerivedRange, data: torch.Tensor, *, where: str, source: str) -> None:
    """Refuse the rebuilt bytes `data` of range `r` unless they have the digest the writer
    recorded (ranges of files before version 4 have none: nothing to check). `where` names the
    derived file and storage, `source` the file the bytes were rebuilt from."""
    if r.digest is None:
        return
    got = int(range_digest(data))
    if got != r.digest:
        raise CorruptCheckpointError(
            f"{where}: elements [{r.start}, {r.start + r.count}) of {r.tensor!r} in {source} are "
            f"not the ones this file was saved with (digest {got:#010x}, recorded {r.digest:#010x}): "
            f"{source} is not the file saved beside it (another save's file in its place?)")


def storage_ranges(base: int, dtype: torch.dtype, pieces: Sequence[Piece]) -> list[DerivedRange]:
    """`pieces` of one tensor whose first element is byte `base` of its stored span, as ranges."""
    itemsize = dtype.itemsize
    return [DerivedRange(base + p.start * itemsize, p.count, DTYPE_NAMES[dtype], p.file, p.key, p.offset)
            for p in pieces if p.count > 0]


def merge_ranges(ranges: list[DerivedRange]) -> list[DerivedRange] | None:
    """Ranges of one span in order, duplicates dropped (tensors that view the same elements, as
    tied weights do) and neighbours that continue each other joined; None if two overlap
    otherwise (the span is then stored whole)."""
    merged: list[DerivedRange] = []
    for r in sorted(set(ranges), key=lambda r: (r.at, r.nbytes)):
        if merged:
            last = merged[-1]
            end = last.at + last.nbytes
            if r.at < end:
                return None
            if (r.at == end and (r.dtype, r.file, r.tensor) == (last.dtype, last.file, last.tensor)
                    and r.start == last.start + last.count):
                merged[-1] = DerivedRange(last.at, last.count + r.count, last.dtype, last.file,
                                          last.tensor, last.start)
                continue
        merged.append(r)
    return merged


def copy_range(r: DerivedRange, source: torch.Tensor, out: torch.Tensor, *, where: str,
               source_path: str) -> None:
    """Write range `r` of the uint8 span `out` from the 1-D `source` tensor (its elements
    ``[r.start, r.start + r.count)``, cast), then check its digest (`check_digest`). `where`
    names the range in errors, `source_path` the file `source` was read from."""
    if r.start + r.count > source.numel():
        raise CorruptCheckpointError(
            f"{where}: elements [{r.start}, {r.start + r.count}) of {r.tensor!r} in {source_path} "
            f"are asked for, but that tensor has {source.numel()} elements")
    if not source.dtype.is_floating_point:
        raise CorruptCheckpointError(f"{where}: {r.tensor!r} in {source_path} is a {source.dtype} "
                                     "tensor; derived ranges are cast from floating-point tensors only")
    piece = source[r.start : r.start + r.count].to(device=out.device, dtype=DTYPES[r.dtype])
    span = out[r.at : r.at + r.nbytes]
    span.copy_(piece.view(torch.uint8))
    check_digest(r, span, where=where, source=source_path)


__all__ = ["Piece", "check_digest", "copy_range", "merge_ranges", "range_digest", "same_after_cast",
           "storage_ranges"]
