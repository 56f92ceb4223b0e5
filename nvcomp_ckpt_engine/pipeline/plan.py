"""Planning a save: tensors grouped into the storages they view, each storage's codec plan,
the ranges other files hold (derived), and the units of work the encoder takes, in file order.

Each storage is stored once, as the span of it the tensors view, so storage sharing and strides
load exactly as saved; tensors with the conjugate or negative bit are resolved first, since the
format stores memory.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import container, derived, selection, state
from ..codecs import Plan, candidates_for
from ..container import _GRAD_DTYPES as GRAD_DTYPES  # the reader's rule, shared
from ..container import DTYPE_NAMES, DerivedRange, TensorEntry

logger = logging.getLogger(__name__)

#: Chunk sizes are multiples of this, so every element width (1..16 bytes) divides them.
_ALIGN = 16


@dataclass
class _Storage:
    """A storage to save: the span of it the tensors view, those tensors' dtypes, and the
    ranges of the span that other files of the checkpoint hold (`derived`, not written)."""

    source: torch.Tensor  # a tensor whose untyped storage this is
    lo: int
    hi: int
    dtypes: set[torch.dtype]
    derived: list[DerivedRange] = dataclasses.field(default_factory=list)
    #: An async save's copy of the span (`encode.snapshot_on_device`), in pieces that tile it,
    #: each a whole number of chunks: what is encoded in place of the live state.
    copies: tuple[torch.Tensor, ...] = ()

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.dtypes)) if len(self.dtypes) == 1 else torch.uint8

    def bytes_view(self) -> torch.Tensor:
        """The span as a 1-D uint8 tensor over the same memory (no copy)."""
        view = torch.empty(0, dtype=torch.uint8, device=self.source.device)
        return view.set_(self.source.untyped_storage(), self.lo, (self.hi - self.lo,), (1,))

    def stored_views(self) -> list[torch.Tensor]:
        """The parts of the span the file holds (all of it, or what its derived ranges leave;
        a snapshot's `copies` when it has them)."""
        if self.copies:
            return list(self.copies)
        span = self.bytes_view()
        return [span[a:b] for a, b in container.stored_pieces(self.hi - self.lo, self.derived)]


def _extent(t: torch.Tensor) -> int:
    """Elements from the tensor's storage offset to one past its last element."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _check_saveable(t: torch.Tensor, key: str) -> None:
    """Refuse, naming `key`, what the format cannot store as torch.save would keep it: a file
    that loads other than saved (or not at all) is worse than a save that stops."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"tensor {key!r} is a {type(t).__name__}; nvcomp_ckpt_engine.save stores "
                        "plain tensors and nn.Parameter (convert subclasses such as DTensor first)")
    shadowing = sorted(name for name in vars(t) if state.shadows_tensor(name))
    if shadowing:
        raise TypeError(f"tensor {key!r} carries the attribute {shadowing[0]!r}, which "
                        "torch.Tensor defines; a load would refuse it (it would replace that "
                        "method or property): delete it before saving")
    if t.layout != torch.strided or t.is_nested or t.is_quantized or t.device.type == "meta":
        kind = "nested, " if t.is_nested else "quantized, " if t.is_quantized else ""
        raise TypeError(f"tensor {key!r} ({kind}{t.layout}, {t.device}) is not a dense strided "
                        "tensor with data; nvcomp_ckpt_engine.save cannot store it")
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"tensor {key!r} has dtype {t.dtype}, which the format does not list")
    if t.requires_grad and DTYPE_NAMES[t.dtype] not in GRAD_DTYPES:
        raise TypeError(f"tensor {key!r} ({t.dtype}) requires grad, which torch allows no "
                        f"{t.dtype} tensor to load with; save t.detach() instead")


def _resolved(t: torch.Tensor, key: str) -> torch.Tensor:
    """`t` with its conjugate and negative bits applied to the data.

    Such a tensor views memory holding the values before the conjugation or negation, and the
    format stores memory: the bytes alone would load un-conjugated or un-negated. The values are
    computed from that memory, viewed without the bits, by `conj_physical` and `neg` (IEEE
    negation: +0.0 becomes -0.0; torch's own `resolve_neg` and same-layout `copy_` give +0.0
    for a complex zero). The copy has storage of its own (so it no longer shares storage with
    the tensor it viewed) and keeps `requires_grad` and the Parameter type. A dtype torch has no
    negation for (unsigned integers, float8) is a `TypeError` naming `key`.
    """
    if not (t.is_conj() or t.is_neg()):
        return t
    values = torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    if t.is_conj():
        values = values.conj_physical()
    if t.is_neg():
        try:
            values = torch.neg(values)
        except (RuntimeError, NotImplementedError) as exc:
            raise TypeError(f"tensor {key!r} ({t.dtype}) has the negative bit, and torch cannot "
                            f"negate it ({exc}); nvcomp_ckpt_engine.save cannot store it") from exc
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(values, requires_grad=t.requires_grad)
    return values.requires_grad_(t.requires_grad)


def _span(t: torch.Tensor, key: str) -> tuple[tuple[str, int], int, int, int]:
    """(storage identity, start byte, end byte, storage bytes) of what `t` views.

    torch's own refusals (a tensor without a usable storage) become a `TypeError` naming `key`.
    """
    try:
        itemsize = t.element_size()
        start = t.storage_offset() * itemsize
        end = start + _extent(t) * itemsize
        storage = t.untyped_storage()
        ident = (str(t.device), storage.data_ptr()) if t.numel() else ("empty", id(t))
        return ident, start, end, storage.nbytes()
    except RuntimeError as exc:
        raise TypeError(f"tensor {key!r} ({t.dtype}, {t.device}): torch cannot give its storage "
                        f"({exc}); nvcomp_ckpt_engine.save cannot store it") from exc


def group_storages(tensors: list[torch.Tensor], keys: list[str]) -> tuple[list[_Storage], list[TensorEntry]]:
    """Group tensors by the storage they view; each storage is stored once (its used span).

    Two storages may start at the same address (two `torch.from_numpy` views of one array
    begin where the array does): they are grouped, and the larger one is read.
    """
    storages: list[_Storage] = []
    largest: list[int] = []
    by_key: dict[tuple[str, int], int] = {}
    placed: list[tuple[torch.Tensor, int, int]] = []  # (tensor, storage index, byte start)
    for t, key in zip(tensors, keys):
        _check_saveable(t, key)
        t = _resolved(t, key)
        ident, start, end, nbytes = _span(t, key)
        if ident not in by_key:
            by_key[ident] = len(storages)
            storages.append(_Storage(t, start - start % _ALIGN, end, {t.dtype}))
            largest.append(nbytes)
        idx = by_key[ident]
        s = storages[idx]
        if nbytes > largest[idx]:
            s.source, largest[idx] = t, nbytes
        s.lo, s.hi = min(s.lo, start - start % _ALIGN), max(s.hi, end)
        s.dtypes.add(t.dtype)
        placed.append((t, idx, start))
    entries = [
        TensorEntry(key, idx, DTYPE_NAMES[t.dtype], tuple(t.shape), tuple(t.stride()),
                    (start - storages[idx].lo) // t.element_size(), t.requires_grad,
                    isinstance(t, torch.nn.Parameter))
        for key, (t, idx, start) in zip(keys, placed)
    ]
    return storages, entries


@dataclass(frozen=True)
class Job:
    """Chunks of one storage to encode together (one CPU chunk, or a batch for the GPU)."""

    storage: int
    chunks: list[torch.Tensor]
    plan: Plan

    @property
    def nbytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def snapshot(self) -> "Job":
        """A copy of the chunks in host memory, immune to later changes of the live tensors."""
        return Job(self.storage, [c.to("cpu", copy=True) for c in self.chunks], self.plan)


def _chunk_views(span: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    return [span[i : i + chunk_bytes] for i in range(0, span.numel(), chunk_bytes)]


@dataclass
class PreparedShard:
    """A state planned for writing: skeleton, storages, their codecs, and the tensor index."""

    skeleton: bytes
    storages: list[_Storage]
    plans: list[Plan]
    entries: list[TensorEntry]
    chunk_bytes: int
    gpu_batch_bytes: int
    writer_info: dict[str, Any]
    #: Whether the skeleton's tensor references carry Python attributes (`state.Flattened`).
    tensor_attributes: bool = False

    @property
    def raw_bytes(self) -> int:
        return sum(s.hi - s.lo for s in self.storages) + len(self.skeleton)

    @property
    def version(self) -> int:
        """The lowest shard format version that holds this file (`container.version_for`): its
        derived ranges, if any, record their digests (`_mark_derived`)."""
        has_derived = any(s.derived for s in self.storages)
        return container.version_for(derived=has_derived, derived_digests=has_derived,
                                     tensor_attributes=self.tensor_attributes)

    def jobs(self) -> Iterator[Job]:
        """Units of work in file order: one CPU chunk, or a batch of GPU chunks of one storage."""
        for i, (s, plan) in enumerate(zip(self.storages, self.plans)):
            chunks = [c for view in s.stored_views() for c in _chunk_views(view, self.chunk_bytes)]
            if plan.codec.device != "cuda":
                for c in chunks:
                    yield Job(i, [c], plan)
                continue
            batch: list[torch.Tensor] = []
            for c in chunks:
                if batch and sum(b.numel() for b in batch) + c.numel() > self.gpu_batch_bytes:
                    yield Job(i, batch, plan)
                    batch = []
                batch.append(c)
            if batch:
                yield Job(i, batch, plan)


def prepare_shard(
    skeleton: bytes,
    tensors: list[torch.Tensor],
    keys: list[str],
    *,
    algorithm: str,
    portable: bool,
    chunk_bytes: int,
    writer_info: dict[str, Any],
    gpu_batch_bytes: int = 256 << 20,
    derive: Callable[[torch.Tensor], Sequence[derived.Piece]] | None = None,
    tensor_attributes: bool = False,
    choice_cache: selection.ChoiceCache | None = None,
    part: str = "",
) -> PreparedShard:
    """Group tensors into storages and choose each storage's codec and transform.

    `choice_cache`: `auto`'s choices for file `part` kept from an earlier save of it with the
    same storages (`selection.ChoiceCache`), so a job's repeated saves neither sample nor make
    codecs again (until the cache's recheck).

    `tensor_attributes`: the skeleton's tensor references carry Python attributes (the file is
    then format version 3: `PreparedShard.version`).

    `derive(tensor)` says which elements of a tensor other files of the checkpoint hold (the
    caller checked them, `derived.same_after_cast`); those bytes are not written but recorded as
    derived ranges of the tensor's storage (`container.DerivedRange`).
    """
    if chunk_bytes < _ALIGN or chunk_bytes > container.MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size {chunk_bytes} is outside [{_ALIGN}, {container.MAX_CHUNK_BYTES}] bytes")
    storages, entries = group_storages(tensors, keys)
    if derive is not None:
        _mark_derived(storages, entries, tensors, derive)
    chunk_bytes -= chunk_bytes % _ALIGN
    choices = None
    if choice_cache is not None:
        choices = choice_cache.for_part(part, _signature(storages, entries, algorithm, portable,
                                                         chunk_bytes))
    return PreparedShard(skeleton, storages, _choose_plans(storages, entries, algorithm, portable,
                                                           chunk_bytes, choices), entries,
                         chunk_bytes, max(gpu_batch_bytes, chunk_bytes), writer_info, tensor_attributes)


def _first_keys(entries: list[TensorEntry]) -> dict[int, str]:
    """Each storage's first tensor key: what names its role (`selection.role`)."""
    first_key: dict[int, str] = {}
    for entry in entries:
        first_key.setdefault(entry.storage, entry.key)
    return first_key


def _signature(storages: list[_Storage], entries: list[TensorEntry], algorithm: str,
               portable: bool, chunk_bytes: int) -> tuple[Any, ...]:
    """What `auto`'s choices for a file depend on, but the values: the options, and each
    storage's first key, dtype, size and device."""
    first_key = _first_keys(entries)
    return (algorithm, portable, chunk_bytes,
            tuple((first_key.get(i, ""), s.dtype, s.hi - s.lo, str(s.source.device))
                  for i, s in enumerate(storages)))


def _choose_plans(storages: list[_Storage], entries: list[TensorEntry], algorithm: str,
                  portable: bool, chunk_bytes: int,
                  choices: selection.Choices | None = None) -> list[Plan]:
    """Each storage's plan: among its dtype's candidates, the one that codes a sample of it
    smallest, chosen once per role of the file (`selection`).

    The candidates (and their codec objects) are made once per (dtype, device type) for the
    whole shard: nvCOMP codecs own CUDA streams and scratch worth creating once, not once per
    parameter. A role's choice is kept once it was made on a storage large enough to sample.
    `choices`: those of an earlier save of the same file, filled further here (a new one
    without).
    """
    first_key = _first_keys(entries)
    choices = choices or selection.Choices()
    candidates, chosen = choices.candidates, choices.chosen
    plans = []
    for i, s in enumerate(storages):
        kind = (s.dtype, s.source.device.type)
        if kind not in candidates:
            candidates[kind] = candidates_for(s.dtype, s.source.device, algorithm=algorithm, portable=portable)
        role = (selection.role(first_key.get(i, "")), *kind)
        if role in chosen:
            plans.append(chosen[role])
            continue
        span = max(s.stored_views(), key=lambda view: view.numel(), default=None)
        if span is None:  # nothing stored (empty, or wholly derived)
            plans.append(candidates[kind][0])
            continue
        plans.append(selection.choose(candidates[kind], span, chunk_bytes=chunk_bytes))
        if span.numel() >= selection.MIN_SAMPLED_BYTES:
            chosen[role] = plans[-1]
    return plans


def _mark_derived(storages: list[_Storage], entries: list[TensorEntry], tensors: list[torch.Tensor],
                  derive: Callable[[torch.Tensor], Sequence[derived.Piece]]) -> None:
    """Record in each storage the ranges `derive` says other files hold (see `prepare_shard`).

    Only contiguous tensors are derived; a storage whose ranges would overlap other than exactly
    (tensors viewing the same elements) keeps all its bytes. Each range records the digest of its
    bytes as they are now (`derived.range_digest`, computed where they live, one host sync per
    device for the whole file: a sync per storage cost an async save's stall one per parameter
    of the module): what a reader checks the source it rebuilds them from against.
    """
    wanted: dict[int, list[DerivedRange]] = collections.defaultdict(list)
    for t, entry in zip(tensors, entries):
        pieces = derive(t)
        if pieces and t.is_contiguous():
            base = entry.offset * t.element_size()
            wanted[entry.storage].extend(derived.storage_ranges(base, t.dtype, pieces))
    digests: dict[torch.device, list[torch.Tensor]] = collections.defaultdict(list)
    marked: list[tuple[int, list[DerivedRange]]] = []
    for i, ranges in wanted.items():
        merged = derived.merge_ranges(ranges)
        if merged is None:
            logger.debug("storage %d: derived ranges overlap; stored whole", i)
            continue
        span = storages[i].bytes_view()
        digests[span.device] += [derived.range_digest(span[r.at : r.at + r.nbytes]) for r in merged]
        marked.append((i, merged))
    values = {device: iter(torch.stack(found).tolist()) for device, found in digests.items()}
    for i, merged in marked:
        on = values[storages[i].source.device]
        storages[i].derived = [dataclasses.replace(r, digest=next(on)) for r in merged]
