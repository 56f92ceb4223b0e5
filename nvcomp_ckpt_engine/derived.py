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
from .formats import DIGEST_BASE, DIGEST_PRIME

#: Elements compared per step in `same_after_cast`: bounds the temporary cast copy.
_CHECK_STEP = 1 << 26
#: 32-bit words digested per step in `range_digest`: bounds its int64 scratch (about 300 MiB).
_DIGEST_STEP = 1 << 22

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
    definition), as a 0-d int64 tensor on `data`'s device: no host sync, so a caller digesting
    many ranges waits once. Slices of `_DIGEST_STEP` words bound the scratch it takes."""
    whole = data.numel() // 4 * 4
    tail = data[whole:]
    if tail.numel():  # the last word, zero-padded
        tail = torch.cat([tail, tail.new_zeros(4 - tail.numel())])
    words = data[:whole].view(-1, 4)
    place = torch.tensor([1, 1 << 8, 1 << 16, 1 << 24], dtype=torch.int64, device=data.device)
    count = words.shape[0] + (1 if tail.numel() else 0)
    powers = _powers(min(count, _DIGEST_STEP), data.device)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for lo in range(0, count, _DIGEST_STEP):
        part = words[lo : lo + _DIGEST_STEP]
        if lo + _DIGEST_STEP >= count and tail.numel():
            part = torch.cat([part, tail.view(1, 4)])
        values = (part.to(torch.int64) * place).sum(dim=1) % DIGEST_PRIME
        step = (values * powers[: values.numel()] % DIGEST_PRIME).sum() % DIGEST_PRIME
        total = (total + step * pow(DIGEST_BASE, lo, DIGEST_PRIME)) % DIGEST_PRIME
    return total


def _powers(n: int, device: torch.device) -> torch.Tensor:
    """``DIGEST_BASE ** j mod DIGEST_PRIME`` for j in [0, n), as int64 on `device`."""
    powers = torch.ones(1, dtype=torch.int64, device=device)
    while powers.numel() < n:
        powers = torch.cat([powers, powers * pow(DIGEST_BASE, powers.numel(), DIGEST_PRIME) % DIGEST_PRIME])
    return powers[:n]


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
