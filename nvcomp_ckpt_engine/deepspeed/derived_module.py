"""The module of a ZeRO-1/2 save, stored as derived from the optimizer shards' fp32 partitions.

DeepSpeed's data-parallel rank 0 writes the whole module (2 bytes a parameter in bf16) while
every rank writes 12 bytes a parameter divided by the data-parallel size of optimizer state, so
at scale rank 0 is the straggler every save waits for. With ZeRO-1/2 each parameter of the
module is a view of a flat 16-bit buffer whose partition k is, rounded, rank k's fp32 master
partition (the fp32 module *is* the master), which rank k's shard holds anyway.

Save (`plan_module`, on every rank from `create`): each rank checks, on the device where its
state lives, that the module's elements inside its own partition equal its fp32 partition cast
to the module's dtype (`derived.same_after_cast`: the whole partition at once, else per
parameter); one gather over the job tells every rank which parameters passed on every rank
that holds a piece of them. A parameter that passed everywhere is saved as `derived.Piece` s
pointing into the shards (`ModulePlan.pieces`); anything else — a parameter that failed or
holds a NaN, buffers, frozen parameters, groups whose partitions are not one per data-parallel
rank (MoE experts over an expert-parallel group) — is stored as before. Each rank then checks
that its shard holds the checked partition at the key the plan names (`ModulePlan.check_shard`).

Load inside a live DeepSpeed job (`ModuleGather`): each rank decodes the partitions it owns,
casts them, checks each range's digest (the source is the shard the module was saved with:
`derived.check_digest`), and the data-parallel group all-gathers the module in rounds of
bounded size; the decoded partitions are kept for the optimizer load that follows. Where the
world differs (a ``load_module_only`` at another data-parallel size), or outside
``load_checkpoint``, the engine reads the shards it needs instead (`siblings`, as every tool
does).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import derived, state, verdict
from ..collectives import Collective
from ..container import DTYPES, DerivedRange, ShardIndex, storage_name
from ..errors import CheckpointError
from . import _compat

logger = logging.getLogger(__name__)

#: Bytes the data-parallel group gathers per round, all ranks together: bounds the device
#: memory the rebuild takes beside the model.
GATHER_ROUND_BYTES = 1 << 30

_Identity = tuple[str, int, int, int, torch.dtype]


def _identity(t: torch.Tensor) -> _Identity:
    """What a module state-dict tensor shares with the parameter it detaches from."""
    return (str(t.device), t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)


def _offset_in(param: torch.Tensor, flat: torch.Tensor) -> int | None:
    """Where `param` starts in `flat` (elements), if it is a contiguous view of it."""
    if (param.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
            or param.dtype != flat.dtype or not param.is_contiguous()):
        return None
    offset = param.storage_offset() - flat.storage_offset()
    return offset if 0 <= offset and offset + param.numel() <= flat.numel() else None


@dataclass(frozen=True)
class ModulePlan:
    """What a save derives: pieces by parameter, and what this rank's shard must hold."""

    pieces: dict[_Identity, list[derived.Piece]]
    own_shard: str
    own_keys: dict[str, torch.Tensor]  # key -> the partition this rank checked, if referenced

    def pieces_for(self, t: torch.Tensor) -> list[derived.Piece]:
        """The `api.save` ``derive`` callback: a module tensor's pieces (none for others)."""
        return self.pieces.get(_identity(t), []) if t.numel() else []

    def check_shard(self, state_dict: Any, name: str) -> None:
        """Raise unless the shard `name` being saved holds each partition the plan points to,
        under its key: the module file names them, so a mismatch would make it unreadable."""
        if name != self.own_shard or not self.own_keys:
            return
        keys = state.tensor_keys(state_dict)
        for key, partition in self.own_keys.items():
            held = keys.get(key)
            if held is None or held.untyped_storage().data_ptr() != partition.untyped_storage().data_ptr() \
                    or held.storage_offset() != partition.storage_offset():
                raise CheckpointError(
                    f"{name}: the module of this checkpoint is derived from its fp32 partition "
                    f"{key!r}, but the shard DeepSpeed saves does not hold that partition under "
                    "that key (an unexpected DeepSpeed optimizer state layout)")


def _check_own_partition(groups: list[_compat.ZeroGroup]) -> list[list[int]]:
    """Per group, the parameters this rank cannot vouch for: not a view of the flat buffer, or
    its elements inside this rank's partition differ from the cast partition.

    The whole partition's range of the flat buffer is compared first, in one pass: when it
    equals the cast partition (the rule in ZeRO-1/2), every parameter's part of it does, and
    the save's stall is spared a comparison per parameter (hundreds of small GPU kernels).
    Otherwise each parameter is compared on its own, to keep deriving those that are equal."""
    bad: list[list[int]] = []
    for group in groups:
        size = group.partition_size
        lo, hi = group.partition_id * size, (group.partition_id + 1) * size
        if group.partition.numel() != size:
            bad.append(list(range(len(group.params))))
            continue
        offsets = [_offset_in(param, group.flat) for param in group.params]
        unviewed = [j for j, offset in enumerate(offsets) if offset is None]
        own_range = group.flat.detach().reshape(-1)[lo:hi]
        if bool(derived.same_after_cast(own_range, group.partition.detach())):
            bad.append(unviewed)
        else:
            bad.append(_check_each_parameter(group, offsets, unviewed, lo, hi))
    return bad


def _check_each_parameter(group: _compat.ZeroGroup, offsets: list[int | None], unviewed: list[int],
                          lo: int, hi: int) -> list[int]:
    """`_check_own_partition` for one group whose range as a whole differs: the parameters
    not in `unviewed` whose elements in ``[lo, hi)`` differ from the cast partition, with
    `unviewed`, in order."""
    failed = list(unviewed)
    checked: list[tuple[int, torch.Tensor]] = []
    for j, (param, offset) in enumerate(zip(group.params, offsets)):
        if offset is not None:
            a, b = max(offset, lo), min(offset + param.numel(), hi)
            if a < b:
                part = param.detach().reshape(-1)[a - offset : b - offset]
                checked.append((j, derived.same_after_cast(part, group.partition.detach()[a - lo : b - lo])))
    if checked:
        verdicts = torch.stack([ok for _, ok in checked]).cpu().tolist()
        failed += [j for (j, _), ok in zip(checked, verdicts) if not ok]
    return sorted(failed)


def plan_module(collective: Collective, save_dir: str, tag: str, *, node_local: bool,
                timeout_s: float) -> ModulePlan | None:
    """Decide which module parameters this save derives (every rank; one gather). None when
    nothing is derived: not a ZeRO-1/2 save, node-local storage (the shards would lie on other
    nodes' disks), pipeline parallelism, or a rank that could not check its partition."""
    engine = _compat.saving_engine()
    payload: dict[str, Any] | None = None
    groups = None
    if engine is not None and not node_local and _compat.parallel_layout(1).get("pp", 1) == 1:
        try:
            groups = _compat.zero_groups(engine)
            if groups is not None:
                model, shard = _compat.checkpoint_file_names(engine, save_dir, tag)
                payload = {
                    "model": model, "shard": shard, "writes_shard": _compat.writes_zero_shard(engine),
                    "groups": [[g.partition_id, g.partition_count, g.partition_size] for g in groups],
                    "bad": _check_own_partition(groups),
                }
        except Exception:  # a rank that cannot check makes the save store its module as before
            logger.warning("could not check the module against the fp32 partitions; the module "
                           "is stored whole", exc_info=True)
            payload = None
    payloads = collective.all_gather_object(payload, step="derived-module", timeout_s=timeout_s)
    if payload is None or groups is None or any(p is None for p in payloads):
        return None
    peers = [p for p in payloads if p["model"] == payload["model"]]
    pieces: dict[_Identity, list[derived.Piece]] = {}
    own_keys: dict[str, torch.Tensor] = {}
    for g, group in enumerate(groups):
        shards = _shards_by_partition(peers, g, payload["groups"][g])
        if shards is None:
            continue
        bad = {j for peer in peers for j in peer["bad"][g]}
        size = group.partition_size
        for j, param in enumerate(group.params):
            offset = _offset_in(param, group.flat)
            if j in bad or offset is None or param.numel() == 0:
                continue
            first, last = offset // size, (offset + param.numel() - 1) // size
            pieces[_identity(param.detach())] = [
                derived.Piece(max(offset, k * size) - offset,
                              min(offset + param.numel(), (k + 1) * size) - max(offset, k * size),
                              shards[k], group.key, max(offset, k * size) - k * size)
                for k in range(first, last + 1)
            ]
            if first <= group.partition_id <= last:
                own_keys[group.key] = group.partition
    return ModulePlan(pieces, payload["shard"], own_keys) if pieces else None


def _shards_by_partition(peers: list[dict[str, Any]], g: int, mine: list[int]) -> list[str] | None:
    """The shard holding each partition of group `g`, from the ranks sharing this module file;
    None unless every partition is held by exactly one of them, all shaped alike."""
    count, size = mine[1], mine[2]
    by_id: dict[int, list[str]] = {}
    for peer in peers:
        if len(peer["groups"]) <= g or peer["groups"][g][1:] != [count, size] or not peer["writes_shard"]:
            return None
        by_id.setdefault(peer["groups"][g][0], []).append(peer["shard"])
    if sorted(by_id) != list(range(count)) or any(len(v) != 1 for v in by_id.values()):
        return None
    return [by_id[k][0] for k in range(count)]


# ------------------------------------------------------------------------------------- load


class ModuleGather:
    """Fills a module file's derived ranges inside a live DeepSpeed load: each member of the
    data-parallel `group` casts the ranges of the sources it owns, and the group all-gathers
    them in rounds of at most `GATHER_ROUND_BYTES` (see the module docstring).

    `owner` gives each source file's owner as a rank of `group`; `source(name, key)` decodes a
    source tensor this rank owns (flattened; the engine keeps what its optimizer load reuses).
    Every member must call `fill` for the same file, or `fail` if it could not get that far:
    the first collective is a status exchange, so one rank's error is raised on all of them.
    """

    def __init__(self, group: Any, owner: dict[str, int],
                 source: Callable[[str, str], torch.Tensor]) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group, self.owner, self.source = group, owner, source
        self.me = dist.get_rank(group=group)
        self.size = dist.get_world_size(group=group)
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if dist.get_backend(group) == "nccl" else torch.device("cpu"))

    def _streams(self, index: ShardIndex) -> list[list[tuple[int, DerivedRange]]]:
        """Per group member, the ranges it sends, in the order it sends them."""
        streams: list[list[tuple[int, DerivedRange]]] = [[] for _ in range(self.size)]
        for i, entry in enumerate(index.storages):
            for r in entry.derived:
                streams[self.owner[r.file]].append((i, r))
        return streams

    def _exchange_status(self, error: BaseException | None, path: str) -> None:
        """Every member's outcome so far; one failed: every member raises the same error, naming
        the rank (global) and file at fault (`verdict`)."""
        statuses: list[Any] = [None] * self.size
        mine = None if error is None else verdict.fault_of(error, self._dist.get_rank()).to_json()
        self._dist.all_gather_object(statuses, mine, group=self.group)
        faults = [None if doc is None else verdict.Fault.from_json(doc, member)
                  for member, doc in enumerate(statuses)]
        found = verdict.verdict(faults, what=f"rebuilding the module {path}")
        if found is not None:
            raise found from error

    def fail(self, error: BaseException, path: str) -> None:
        """Join the status exchange of a `fill` this rank never reached, with its error."""
        self._exchange_status(error, path)

    def fill(self, index: ShardIndex, outs: dict[int, torch.Tensor]) -> None:
        """A `pipeline.DerivedFiller` for `index` (every member, in step)."""
        streams = self._streams(index)
        send = torch.empty(0, dtype=torch.uint8, device=self.device)
        error: BaseException | None = None
        try:
            pieces = []
            for i, r in streams[self.me]:
                piece = self.source(r.file, r.tensor)[r.start : r.start + r.count]
                piece = piece.to(self.device, DTYPES[r.dtype]).reshape(-1).view(torch.uint8)
                derived.check_digest(r, piece, where=f"{index.path}: {storage_name(index, i)})",
                                     source=os.path.join(os.path.dirname(index.path), r.file))
                pieces.append(piece)
            if pieces:
                send = torch.cat(pieces)
            del pieces
        except Exception as exc:  # raised on every member by the status exchange
            error = exc
        self._exchange_status(error, index.path)
        longest = max(sum(r.nbytes for _, r in stream) for stream in streams)
        if self.size == 1:
            _scatter(streams[0], send, 0, outs)
            return
        step = min(longest, max(1 << 20, GATHER_ROUND_BYTES // self.size))
        for lo in range(0, longest, step):
            mine = send[lo : lo + step]
            chunk = torch.empty(step, dtype=torch.uint8, device=self.device)
            chunk[: mine.numel()].copy_(mine)
            chunk[mine.numel() :].zero_()
            received = [torch.empty_like(chunk) for _ in range(self.size)]
            self._dist.all_gather(received, chunk, group=self.group)
            for member, stream in enumerate(streams):
                _scatter(stream, received[member], lo, outs)


def _scatter(stream: list[tuple[int, DerivedRange]], data: torch.Tensor, lo: int,
             outs: dict[int, torch.Tensor]) -> None:
    """Copy bytes ``[lo, lo + len(data))`` of a member's stream into the ranges they belong to."""
    hi, at = lo + data.numel(), 0
    for i, r in stream:
        start, end = max(at, lo), min(at + r.nbytes, hi)
        if start < end:
            outs[i][r.at + start - at : r.at + end - at].copy_(data[start - lo : end - lo])
        at += r.nbytes
        if at >= hi:
            return


def module_gather(engine: Any, owners: dict[str, int], source: Callable[[str, str], torch.Tensor]
                  ) -> ModuleGather | None:
    """A `ModuleGather` over `engine`'s data-parallel group when every source's owner (a global
    rank, from the manifest) is a member of it; else None (the sources are read directly)."""
    import torch.distributed as dist

    group = _compat.data_parallel_group(engine) if engine is not None else None
    if group is None or not dist.is_initialized():
        return None
    members = dist.get_process_group_ranks(group)
    if not all(rank in members for rank in owners.values()):
        return None
    return ModuleGather(group, {name: members.index(rank) for name, rank in owners.items()}, source)


__all__ = ["GATHER_ROUND_BYTES", "ModuleGather", "ModulePlan", "module_gather", "plan_module"]
