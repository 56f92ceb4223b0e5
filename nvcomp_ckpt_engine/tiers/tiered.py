"""`LocalTier`: a save into the node-local tier, its replicas, its drain, and the restore a load
starts with; every rank of the job calls each method at the same point.

Save (`prepare` at the save's start, `commit` once this rank's files are durable): the files go
into this node's local tag folder; `commit` gathers every rank's records, sends each file to its
replica ranks (`placement`, `transfer`), writes the local manifest, and commits the tag on every
node (`commit.commit_checkpoint` with every node's first rank writing the tag's manifest into
its own folder): the local commit point, after every file and every replica is durable. Every
`persist_every`-th local commit starts the drain (`drain`); `finish_drain`, at the next save or
at the end, commits the persistent copy (its manifest, then ``latest``), or
`finish_drain_in_background` does in the drain's thread (async saves: out of the next stall).

Load (`restore`): every node's inventory and the persistent tier's complete tags are gathered,
every rank chooses the same tag and sources (`sources`), the node's ranks each read the CRC-32s
of a share of the chosen tag's local files (`local.check_shares`; a damaged one makes the
choice again), the files each node lacks are copied from a peer (`transfer`) or, only where
no node holds them, from the persistent tier; each node then holds the whole tag, committed in
its local folder, and the load reads it there.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import commit, discovery, manifest_files
from ..collectives import Collective
from ..errors import CheckpointError, IncompleteCheckpointError
from ..manifest import (
    Manifest, ShardRecord, parse_manifest, read_manifest, serialize_manifest, write_manifest,
)
from ..storage import locations
from ..storage.locations import Location
from . import drain, local, sources, transfer
from .placement import NodeLayout

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LocalTierOptions:
    """The ``"local_tier"`` section: the local folder (``{node}`` is the node's index), the
    copies of each file on other nodes, the local tags kept, and how often a local checkpoint
    is drained to the persistent tier (every n-th, the first included)."""

    path: str
    replicas: int = 1
    keep_last: int = 2
    persist_every: int = 1


@dataclasses.dataclass(frozen=True)
class Replicated:
    """What this rank's part of a save's replicas did: the replica files it received, the files
    its node holds by placement, and the first error (None: every transfer of its went well)."""

    received: list[str]
    held: list[str]
    error: BaseException | None


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `restore` did: this node's local folder, where the tag now lies complete; the bytes
    read from the persistent tier (0 when local copies and replicas held everything) and those
    copied between nodes, over all nodes (the same on every rank)."""

    root: Location
    tag: str
    persistent_bytes: int
    peer_bytes: int


class LocalTier:
    """One rank's side of the node-local tier."""

    def __init__(self, options: LocalTierOptions, collective: Collective, *, local_world_size: int,
                 channel: transfer.Channel | None, timeout_s: float,
                 chunk_bytes: int = transfer.CHUNK_BYTES) -> None:
        self.options = options
        self.collective = collective
        self.local_world_size = local_world_size
        self.channel = channel
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self._layout: NodeLayout | None = None
        self._saves = 0
        self._drain: drain.Drain | None = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._replicating: cf.ThreadPoolExecutor | None = None
        #: Bytes this rank read from the persistent tier in its restores, and sent to its
        #: replica ranks in its saves (its compressed files, once per replica).
        self.persistent_bytes_read = 0
        self.replica_bytes_sent = 0

    # ------------------------------------------------------------------------------- where

    @property
    def layout(self) -> NodeLayout:
        """The job's nodes (an all-gather on first use: call it on every rank)."""
        if self._layout is None:
            sizes = self.collective.all_gather_object(
                self.local_world_size, step="local-tier-layout", timeout_s=self.timeout_s)
            self._layout = NodeLayout.of(sizes)
        return self._layout

    @property
    def node(self) -> int:
        return self.layout.node_of(self.collective.rank)

    @property
    def root(self) -> Location:
        return local.node_root(self.options.path, self.node)

    @property
    def leader(self) -> bool:
        """This rank writes its node's shared files (the local manifest, retention)."""
        return self.layout.local_rank(self.collective.rank) == 0

    def relocate(self, path: str, save_dir: str, tag: str) -> str:
        """DeepSpeed's `path` under ``save_dir/tag``, in this node's local tag folder."""
        relative = os.path.relpath(os.path.abspath(path), os.path.abspath(os.path.join(save_dir, tag)))
        if relative.startswith(os.pardir):
            raise ValueError(f"{path} is not inside the tag folder {os.path.join(save_dir, tag)}")
        return os.path.join(os.fspath(self.root), tag, relative)

    # -------------------------------------------------------------------------------- save

    def prepare(self, tag: str) -> commit.TagPlan:
        """The local tag folder of a new save, made and marked (`commit.prepare_tag_dir`)."""
        return commit.prepare_tag_dir(os.fspath(self.root), tag, rank=self.collective.rank,
                                      leader=self.leader)

    def replicate(self, tag: str, plan: commit.TagPlan | None, records: Sequence[ShardRecord], *,
                  error: BaseException | None, collective: Collective | None = None,
                  channel: transfer.Channel | None = None) -> Replicated:
        """Send this rank's files to its replica ranks and receive theirs (every rank, at the
        same point): the records all-gathered, then the transfers on their fixed schedule.
        Nothing is sent when any rank's save failed. `collective` and `channel` default to the
        tier's own; a background thread passes its own (`replicate_in_background`)."""
        collective = collective or self.collective
        channel = channel or self.channel
        tag_dir = self.root / tag
        suffix = plan.staging_suffix if plan is not None else None
        mine = [r.to_json() for r in records] if error is None else None
        everyone = collective.all_gather_object(
            {"records": mine}, step="local-tier-records", timeout_s=self.timeout_s)
        if error is not None or any(e["records"] is None for e in everyone):
            return Replicated(received=[], held=[], error=error)
        try:
            report = transfer.run_transfers(
                self._replica_transfers(everyone), rank=collective.rank, channel=channel,
                source=lambda p: tag_dir / (p + (suffix or "")),
                target=lambda p: tag_dir / (p + (suffix or "")),
                timeout_s=self.timeout_s, chunk_bytes=self.chunk_bytes)
        except CheckpointError as exc:
            return Replicated(received=[], held=[], error=exc)
        self.replica_bytes_sent += report.sent_bytes
        if report.errors:
            error = CheckpointError("replicas failed: " + "; ".join(
                f"{p}: {why}" for p, why in sorted(report.errors.items())))
        held = [r["path"] for rank, e in enumerate(everyone) for r in e["records"]
                if self.node in self.layout.holders(rank, self.options.replicas)]
        return Replicated(received=report.received, held=held, error=error)

    def replicate_in_background(self, tag: str, plan: commit.TagPlan | None,
                                records_of: Callable[[], tuple[list[ShardRecord], BaseException | None]],
                                collective: Collective, channel: transfer.Channel) -> cf.Future:
        """`replicate` in a thread of its own, once `records_of()` has this rank's records (it
        waits for an async save's writes): the replicas travel beside training, and the
        deferred commit finds them done. `collective` must be usable from that thread (a store's,
        `collectives.StoreCollective`) and `channel` on a group the training thread never uses;
        every rank starts it at the same step."""
        if self._replicating is None:
            self._replicating = cf.ThreadPoolExecutor(1, thread_name_prefix="nvckpt-replicas")

        def run() -> Replicated:
            records, error = records_of()
            try:
                return self.replicate(tag, plan, records, error=error, collective=collective,
                                      channel=channel)
            except Exception as exc:  # the commit reports it, on every rank
                return Replicated(received=[], held=[], error=exc)

        return self._replicating.submit(run)

    def commit(self, tag: str, plan: commit.TagPlan | None, records: Sequence[ShardRecord], *,
               error: BaseException | None, layout: Mapping[str, Any], step: int | None,
               versions: Mapping[str, str], replicated: Replicated | None = None,
               collective: Collective | None = None,
               channel: transfer.Channel | None = None) -> commit.CommitResult:
        """The local commit on every node, after the replicas (`replicated`, or `replicate` run
        now); CommitError on every rank if any rank's save or any replica failed (the tag then
        has no local manifest anywhere). `collective` and `channel` default to the tier's own;
        a commit in a background thread passes its own, as `replicate_in_background` does."""
        tag_dir = self.root / tag
        suffix = plan.staging_suffix if plan is not None else None
        if replicated is None:
            replicated = self.replicate(tag, plan, records, error=error, collective=collective,
                                        channel=channel)
        error = error or replicated.error
        if error is None and self.leader:
            try:
                local.write_local_manifest(tag_dir, local.LocalManifest(tag, self.node,
                                                                         tuple(replicated.held)))
            except OSError as exc:
                error = exc
        result = commit.commit_checkpoint(
            tag_dir, records,
            collective=collective or self.collective, layout=layout, timeout_s=self.timeout_s, plan=plan,
            error=error, step=step, versions=versions, node=f"node{self.node}",
            every_node_writes=True)
        if suffix and replicated.received:
            commit.rename_staged(tag_dir, replicated.received, suffix)
        return result

    def _replica_transfers(self, everyone: Sequence[Mapping[str, Any]]) -> list[transfer.Transfer]:
        """Every file to the same local rank on each of the next `replicas` nodes, in one order."""
        layout, found = self.layout, []
        for rank, entry in enumerate(everyone):
            for record in entry["records"]:
                for receiver in layout.replica_ranks(rank, self.options.replicas):
                    found.append(transfer.Transfer(path=record["path"], size=record["file_bytes"],
                                                   crc32=record["crc32"], sender=rank, receiver=receiver))
        return found

    def after_commit(self, result: commit.CommitResult, save_dir: str, latest: bool = True) -> bool:
        """Local retention, and the drain of every `persist_every`-th save started (`latest`:
        whether ``latest`` is to name it once persistent); whether it was (every rank decides
        alike: the save count is the same everywhere)."""
        due = self._saves % self.options.persist_every == 0
        self._saves += 1
        if due:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="nvckpt-drain")
            self._drain = drain.start(self._pool, self.root / result.tag, save_dir,
                                      result.manifest, self.collective.rank, latest=latest)
        if self.leader:
            protect = {result.tag} | ({self._drain.tag} if self._drain is not None else set())
            try:
                local.apply_local_retention(self.root, self.options.keep_last, protect=protect)
            except (OSError, CheckpointError):
                logger.error("local tier %s: retention failed", self.root, exc_info=True)
        return due

    @property
    def draining(self) -> str | None:
        """The tag whose drain has started and is not committed yet."""
        return None if self._drain is None else self._drain.tag

    def finish_drain(self) -> tuple[commit.CommitResult, str, bool] | None:
        """Wait for this rank's part of the drain in progress and commit the persistent copy
        (every rank together): the commit's result, the save folder, and whether ``latest`` is
        to name the tag now; None when no drain was in progress. CommitError on every rank if
        any rank's copy failed: the persistent tag then has no manifest (a failed save)."""
        pending, self._drain = self._drain, None
        if pending is None:
            return None
        return self._commit_drain(pending, self.collective)

    def finish_drain_in_background(
        self, collective: Collective,
        then: Callable[[tuple[commit.CommitResult, str, bool] | None, Exception | None], None],
    ) -> cf.Future | None:
        """`finish_drain` in the drain's own thread, right after its copies, agreeing through
        `collective` (usable from that thread: `collectives.StoreCollective`), then
        ``then(done, error)`` there (what `finish_drain` returns, or what it raised):
        the persistent commit runs beside training, not in the next save's stall. The future
        is done once both are; None when no drain was in progress. Every rank calls it at the
        same point."""
        pending, self._drain = self._drain, None
        if pending is None or self._pool is None:
            return None

        def run() -> None:
            try:
                done = self._commit_drain(pending, collective)
            except Exception as exc:  # `then` reports it
                then(None, exc)
                return
            then(done, None)

        return self._pool.submit(run)  # after the copies: the pool has one thread

    def _commit_drain(self, pending: drain.Drain,
                      collective: Collective) -> tuple[commit.CommitResult, str, bool]:
        save_dir = pending.save_dir
        plan, error = None, None
        try:
            plan = pending.result()
        except Exception as exc:  # reported by the commit, on every rank
            logger.error("rank %d: draining %s to %s failed: %s", self.collective.rank,
                         pending.tag, save_dir, exc)
            error = exc
        manifest = pending.manifest
        result = commit.commit_checkpoint(
            locations.location(save_dir) / pending.tag, pending.records, collective=collective,
            layout=_plain(manifest.layout), timeout_s=self.timeout_s, plan=plan, error=error,
            step=manifest.step, versions=dict(manifest.versions))
        return result, save_dir, pending.latest

    def close(self) -> None:
        for pool in (self._pool, self._replicating):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._replicating = None

    # -------------------------------------------------------------------------------- load

    def restore(self, save_dir: str, tag: str | None) -> Restored | None:
        """Make `tag` (None: the newest tag complete in some tier) complete in every node's local
        folder, from the nearest copies; None: no tier holds a checkpoint of ours (by that tag),
        for the caller's own resolution (a plain DeepSpeed checkpoint in `save_dir`, or a fresh
        start). IncompleteCheckpointError on every rank when `tag` (or, with none asked for,
        every tag found) is complete in no tier, naming what was lost."""
        rank = self.collective.rank
        mine: dict[str, Any] = {"copies": None, "persistent": None, "error": None}
        try:
            if self.leader:  # sizes only: the CRCs of the chosen tag alone are read below
                mine["copies"] = {name: local.copy_to_json(copy) for name, copy in
                                  local.inventory(self.root, check_crc=False).items()}
            if rank == 0:
                mine["persistent"] = {name: serialize_manifest(found).decode()
                                      for name, found in _persistent_tags(save_dir).items()}
        except (OSError, CheckpointError) as exc:
            mine["error"] = f"rank {rank}: {type(exc).__name__}: {exc}"
        everyone = self.collective.all_gather_object(mine, step="local-tier-inventory",
                                                     timeout_s=self.timeout_s)
        problems = [e["error"] for e in everyone if e["error"]]
        if problems:
            raise IncompleteCheckpointError("the inventory of the tiers failed: " + "; ".join(problems))
        layout = self.layout
        copies = [{name: local.copy_from_json(obj) for name, obj in
                   everyone[layout.rank_at(node, 0)]["copies"].items()} for node in range(layout.nodes)]
        persistent = {name: parse_manifest(text.encode(), source=f"{save_dir}/{name}")
                      for name, text in everyone[0]["persistent"].items()}
        plan, passed_over = self._choose(copies, persistent, tag)
        lost = "; ".join(f"{name}: {why}" for name, why in passed_over.items())
        if plan is None:
            if passed_over:
                raise IncompleteCheckpointError(
                    f"no checkpoint {'named ' + repr(tag) + ' ' if tag else ''}is complete in the "
                    f"node-local tier ({self.options.path}) or in {save_dir}: {lost}")
            return None
        if passed_over and rank == 0:
            logger.warning("the node-local tier and %s lost newer checkpoints: %s; resuming from %r, "
                           "the newest complete in some tier", save_dir, lost, plan.tag)
        return self._restore(save_dir, plan)

    def _choose(self, copies: list[dict[str, local.NodeCopy]], persistent: Mapping[str, Manifest],
                tag: str | None) -> tuple[sources.RestorePlan | None, dict[str, str]]:
        """`sources.choose` on copies whose CRC-32s are read for the tag it chooses, choosing
        again while that finds a damaged one: only the chosen tag's bytes are read, not those
        of every tag a node keeps. Each rank of a node that holds the tag reads its share of
        the node's files (`local.check_shares`, on a few threads); the shares are all-gathered
        and merged per node alike on every rank, so every rank reaches the same verdict."""
        layout, rank = self.layout, self.collective.rank
        checked: set[str] = set()
        while True:
            plan, passed_over = sources.choose(copies, persistent, tag=tag)
            if plan is None or plan.tag in checked:
                return plan, passed_over
            checked.add(plan.tag)
            mine = None
            held = copies[self.node].get(plan.tag)
            if held is not None:
                share = local.check_shares(held, layout.ranks_per_node)[layout.local_rank(rank)]
                threads = manifest_files.default_crc_threads(sharing=layout.ranks_per_node)
                try:
                    mine = local.check_share(self.root, held, share, threads=threads).to_json()
                except Exception as exc:  # reported on every rank, not left to hang the others
                    mine = {"error": f"rank {rank}: {type(exc).__name__}: {exc}"}
            everyone = self.collective.all_gather_object(mine, step="local-tier-crc",
                                                         timeout_s=self.timeout_s)
            problems = [e["error"] for e in everyone if e and "error" in e]
            if problems:
                raise IncompleteCheckpointError("checking the local copies failed: " + "; ".join(problems))
            for node in range(layout.nodes):
                if plan.tag in copies[node]:
                    copies[node][plan.tag] = local.merge_checks(
                        copies[node][plan.tag],
                        (local.CheckedShare.from_json(everyone[r]) for r in layout.ranks_of(node)))

    def _restore(self, save_dir: str, plan: sources.RestorePlan) -> Restored:
        layout, rank = self.layout, self.collective.rank
        tag_dir = self.root / plan.tag
        records = {r.path: r for r in plan.manifest.files}
        error: str | None = None
        try:
            commit.prepare_tag_dir(os.fspath(self.root), plan.tag, rank=rank, leader=self.leader)
        except (OSError, CheckpointError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        # The files of a fetch are spread over the node's ranks, sender and receiver alike.
        transfers, from_persistent = [], []
        for i, fetch in enumerate(plan.fetches):
            receiver = layout.rank_at(fetch.node, i)
            if fetch.source == sources.PERSISTENT:
                if receiver == rank:
                    from_persistent.append(fetch.path)
                continue
            record = records[fetch.path]
            transfers.append(transfer.Transfer(path=fetch.path, size=record.file_bytes,
                                               crc32=record.crc32, receiver=receiver,
                                               sender=layout.rank_at(fetch.source, i)))
        report = transfer.run_transfers(
            transfers, rank=rank, channel=self.channel, source=lambda p: tag_dir / p,
            target=lambda p: tag_dir / p, timeout_s=self.timeout_s, chunk_bytes=self.chunk_bytes)
        persistent_bytes = 0
        for path in from_persistent:
            try:
                persistent_bytes += locations.copy(locations.location(save_dir) / plan.tag / path,
                                                   tag_dir / path)
            except OSError as exc:
                report.errors[path] = f"copying it from {save_dir}: {type(exc).__name__}: {exc}"
        self.persistent_bytes_read += persistent_bytes
        if report.errors:
            error = "; ".join(f"{p}: {why}" for p, why in sorted(report.errors.items()))
        statuses = self.collective.all_gather_object(error, step="local-tier-restore",
                                                     timeout_s=self.timeout_s)
        failed = {r: e for r, e in enumerate(statuses) if e}
        if failed:
            raise IncompleteCheckpointError(
                f"restoring {plan.tag!r} into the node-local tier failed: " + "; ".join(
                    f"rank {r}: {e}" for r, e in sorted(failed.items())))
        outcome = None
        if self.leader:
            try:
                if not _same_manifest(tag_dir, plan.manifest):
                    write_manifest(tag_dir, plan.manifest)
            except (OSError, CheckpointError) as exc:
                outcome = f"rank {rank}: writing the manifest of {tag_dir}: {exc}"
        outcomes = self.collective.all_gather_object(outcome, step="local-tier-restored",
                                                     timeout_s=self.timeout_s)
        if any(outcomes):
            raise IncompleteCheckpointError("; ".join(o for o in outcomes if o))
        if rank == 0:
            logger.info("restored %r into the node-local tier: %d files from peers, %d bytes "
                        "from %s", plan.tag, len(transfers),
                        plan.persistent_bytes(), save_dir)
        return Restored(root=self.root, tag=plan.tag, persistent_bytes=plan.persistent_bytes(),
                        peer_bytes=sum(t.size for t in transfers))


def _persistent_tags(save_dir: str) -> dict[str, Manifest]:
    """The tags complete in the persistent tier, by tag: a manifest, and every file it lists
    with its size (a stat each: no file's bytes are read here)."""
    where = locations.location(save_dir)
    found = {}
    for tag, path in discovery.tag_folders(where):
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        _, problems = manifest_files.check_files(path, manifest, check_crc=False, allow_pending=True)
        if not problems:
            found[tag] = manifest
    return found


def _plain(value: Any) -> Any:
    """A manifest's read-only mappings and tuples as the JSON types a commit records."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _same_manifest(tag_dir: Location, manifest: Manifest) -> bool:
    try:
        return local.manifest_identity(read_manifest(tag_dir)) == local.manifest_identity(manifest)
    except CheckpointError:
        return False


__all__ = ["LocalTier", "LocalTierOptions", "Restored"]
