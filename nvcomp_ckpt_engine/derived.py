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
- `copy_range`: the rebuild of one range from its source tensor.

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

#: Elements compared per step in `same_after_cast`: bounds the temporary cast copy.
_CHECK_STEP = 1 << 26

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


def copy_range(r: DerivedRange, source: torch.Tensor, out: torch.Tensor, *, where: str) -> None:
    """Write range `r` of the uint8 span `out` from the 1-D `source` tensor (its elements
    ``[r.start, r.start + r.count)``, cast). `where` names the range in errors."""
    if r.start + r.count > source.numel():
        raise CorruptCheckpointError(
            f"{where}: elements [{r.start}, {r.start + r.count}) of {r.tensor!r} in {r.file} are "
            f"asked for, but that tensor has {source.numel()} elements")
    if not source.dtype.is_floating_point:
        raise CorruptCheckpointError(f"{where}: {r.tensor!r} in {r.file} is a {source.dtype} tensor; "
                                     "derived ranges are cast from floating-point tensors only")
    piece = source[r.start : r.start + r.count].to(device=out.device, dtype=DTYPES[r.dtype])
    out[r.at : r.at + r.nbytes].copy_(piece.view(torch.uint8))


__all__ = ["Piece", "copy_range", "merge_ranges", "same_after_cast", "storage_ranges"]
