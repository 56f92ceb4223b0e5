"""The node-local tier for DCP: a save written into the node's local folder, replicated, committed
there and drained to the checkpoint folder; a load restored from a local copy, a peer or the
checkpoint folder before it reads (docs/DCP.md, "Node-local tier").

A writer option cannot do it alone: DCP runs the writer's `finish` (``.metadata`` and the
manifest) on its coordinator only, and nothing of the writer runs on the other ranks afterwards,
while the tier's commit is collective (the replicas, each node's manifest, each rank's drain). So
`DcpLocalTier`, an object of the job's lifetime, wraps `dcp.save`, `dcp.async_save` and
`dcp.load` and runs `tiers.tiered.LocalTier` around them, on every rank. A DCP checkpoint folder
is a tag folder: its parent is the persistent tier and its name the tag.

An async save's commit cannot run in DCP's background save either (DCP calls nothing of ours
after `finish`, and only on the coordinator), so a thread of the tier waits for DCP's future on
every rank and then commits: the same commit as a synchronous save's, agreeing through the job's
store and sending replicas on a gloo group the training thread never uses.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import os
import uuid
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .. import commit
from ..collectives import Collective, TorchDistributedCollective
from ..config import NvcompConfig
from ..errors import CheckpointError, CommitError
from ..manifest import layout_record, parse_manifest, serialize_manifest
from ..storage import locations
from ..tiers import transfer
from ..tiers.tiered import LocalTier, LocalTierOptions, Restored
from .reader import NvcompFileSystemReader
from .writer import NvcompFileSystemWriter

#: How long each collective step of the tier waits (the DeepSpeed engine's default commit timeout).
DEFAULT_TIMEOUT_S = 1800.0


class TierSaveFuture(cf.Future):
    """What `DcpLocalTier.async_save` returns: done once the save is committed in the node-local
    tier (its result the commit's `commit.CommitResult`), or failed with the error that ended it
    (a `CommitError` on every rank alike). `reported` turns true once a caller took its result or
    its exception, so the tier's next call does not raise that error a second time."""

    def __init__(self) -> None:
        super().__init__()
        self.reported = False

    def result(self, timeout: float | None = None) -> commit.CommitResult:
        try:
            return super().result(timeout)
        finally:
            self.reported = self.reported or self.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return super().exception(timeout)
        finally:
            self.reported = self.reported or self.done()


class _TierWriter(NvcompFileSystemWriter):
    """The writer of a save into the node-local tier. Its `finish` makes the manifest without
    writing it: the tier's commit writes it on every node once every replica is in, and a
    manifest of DCP's finish in the coordinator's local folder before that would make that
    node's copy look complete if the replicas then failed or the job died."""

    publishes_manifest = False


class DcpLocalTier:
    """The node-local tier of a DCP job: construct it on every rank at the same point (once the
    process group is initialized, or without one for a single process) and call `save`,
    `async_save`, `wait`, `load` and `close` on every rank together.

    Args:
        local_tier: the engine's ``"local_tier"`` keys (`tiers.tiered.LocalTierOptions`, or a
            mapping checked as the DeepSpeed config's section is).
        local_world_size: ranks per node (default: ``LOCAL_WORLD_SIZE``, else every rank on one).
        timeout_s: how long each collective step waits.
    """

    def __init__(self, local_tier: LocalTierOptions | Mapping[str, Any], *,
                 local_world_size: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        options = NvcompConfig(local_tier=local_tier).local_tier  # checked, each key named
        collective = TorchDistributedCollective(timeout_s=timeout_s)
        per_node = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", collective.world_size))
        channel = transfer.TorchChannel(collective.gloo_group()) if collective.world_size > 1 else None
        self.tier = LocalTier(options, collective, local_world_size=per_node, channel=channel,
                              timeout_s=timeout_s)
        self._job = collective
        #: The gloo group of async saves (`_background_group`), the thread that commits them,
        #: and the one in progress.
        self._background: Any = None
        self._committing: cf.ThreadPoolExecutor | None = None
        self._pending: TierSaveFuture | None = None

    @property
    def collective(self) -> Collective:
        return self.tier.collective

    def save(self, state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike,
             **writer_options: Any) -> commit.CommitResult:
        """`dcp.save` into this node's local copy of `checkpoint_dir`, then the local commit
        (every file on its replica nodes, each node's manifest) and, every `persist_every`-th
        save, the drain into `checkpoint_dir`, committed at the next `save` or at `close`.
        `writer_options` are `NvcompFileSystemWriter`'s. CommitError on every rank if a rank's
        save or a replica failed (the local tag then has no tier manifest on any node), or if a
        rank could not make its local tag folder (then before DCP starts). An async save in
        progress is waited for first (`finish_drain`)."""
        self.finish_drain()
        save_dir, tag, writer, _ = self._start(checkpoint_dir, writer_options)
        dcp.save(state_dict, storage_writer=writer, no_dist=self.collective.world_size == 1)
        return self._commit(writer, save_dir, tag)

    def async_save(self, state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike,
                   **writer_options: Any) -> TierSaveFuture:
        """`save` through `dcp.async_save`: returns once DCP has copied the state into CPU
        memory (the writer is its own stager, so later optimizer steps cannot change what is
        written). The rank files are then written and, once DCP's save has finished on every
        rank, committed in the node-local tier as `save` commits (replicas, each node's
        manifest, the drain started when due), in the background on every rank: DCP and the
        replicas use a gloo group of their own and the commit agrees through the job's store,
        so the training thread's collectives go on beside them.

        A failure in the background (a rank file's write, a replica, a node's manifest) fails
        the future on every rank with a `CommitError` naming the ranks and their errors (a
        rank file's path with them), and nothing is committed: no node's copy gets the tag's
        manifest and nothing is drained. The tier's next call waits for the save and raises
        that error too unless the future already reported it (`TierSaveFuture.reported`)."""
        self.finish_drain()
        save_dir, tag, writer, token = self._start(checkpoint_dir, writer_options)
        group = self._background_group()
        # Both made before DCP starts: one that fails then leaves no save without its commit.
        collective = self._job.for_background(f"nvcomp_ckpt_engine/dcp-tier/{token}")
        channel = transfer.TorchChannel(group) if self.collective.world_size > 1 else None
        response = dcp.async_save(state_dict, storage_writer=writer, process_group=group,
                                  no_dist=self.collective.world_size == 1)
        written = getattr(response, "upload_completion", response)  # DCP's async stagers' form
        future = self._pending = TierSaveFuture()
        if self._committing is None:
            self._committing = cf.ThreadPoolExecutor(1, thread_name_prefix="nvckpt-dcp-commit")
        self._committing.submit(self._commit_when_written, future, written, writer, save_dir,
                                tag, collective, channel)
        return future

    def wait(self) -> commit.CommitResult | None:
        """Wait for the async save in progress (every rank): its commit's result; None when
        none was in progress, or when it failed and its future already reported that. Its error
        (on every rank alike) when no caller has taken it from the future."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        unreported = not pending.reported
        error = pending.exception()
        if error is None:
            return pending.result()
        if unreported:
            raise error
        return None

    def finish_drain(self) -> commit.CommitResult | None:
        """Wait for the async save in progress (`wait`), then commit the persistent copy of the
        drain in progress (every rank); None if none was. The async save's error, if `wait`
        raises one, comes after that commit."""
        try:
            self.wait()
        finally:
            finished = self.tier.finish_drain()
        return None if finished is None else finished[0]

    def load(self, state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike,
             **reader_options: Any) -> Restored | None:
        """Restore `checkpoint_dir` into this node's local folder (its own copy, a peer's, or
        the persistent one for what no node holds) and `dcp.load` it from there; what the
        restore did. A folder without our manifest (a stock DCP checkpoint) is read where it
        is (None). `reader_options` are `NvcompFileSystemReader`'s. An async save in progress
        is waited for first (`wait`)."""
        self.wait()
        save_dir, tag = _split(checkpoint_dir)
        restored = self.tier.restore(save_dir, tag)
        where = checkpoint_dir if restored is None else os.fspath(restored.root / tag)
        dcp.load(state_dict, storage_reader=NvcompFileSystemReader(where, **reader_options),
                 no_dist=self.collective.world_size == 1)
        return restored

    def close(self) -> None:
        """Wait for the async save in progress, commit the drain in progress and stop the
        tier's threads (every rank)."""
        try:
            self.finish_drain()
        finally:
            if self._committing is not None:
                self._committing.shutdown(wait=True)
                self._committing = None
            self.tier.close()

    # ------------------------------------------------------------------------------ inside

    def _start(self, checkpoint_dir: str | os.PathLike, writer_options: Mapping[str, Any],
               ) -> tuple[str, str, NvcompFileSystemWriter, str]:
        """A save's start, every rank: this node's local tag folder made (a rank that could
        not fails the save on every rank before DCP starts) and the writer into it; the
        persistent tier, the tag, the writer and a token of this save (rank 0's, on every
        rank: the keys of its background commit in the job's store)."""
        save_dir, tag = _split(checkpoint_dir)
        tier, rank = self.tier, self.collective.rank
        mine: dict[str, Any] = {"problem": None, "token": uuid.uuid4().hex}
        try:
            tier.prepare(tag)
        except (OSError, CheckpointError) as exc:  # every rank learns it before DCP's collectives
            mine["problem"] = f"rank {rank}: {type(exc).__name__}: {exc}"
        everyone = self.collective.all_gather_object(mine, step="dcp-local-tier-prepare",
                                                     timeout_s=tier.timeout_s)
        problems = [e["problem"] for e in everyone if e["problem"]]
        if problems:
            raise CommitError(f"saving {tag!r} into the node-local tier ({tier.options.path}) "
                              "failed: " + "; ".join(problems))
        writer = _TierWriter(os.fspath(tier.root / tag), **writer_options)
        return save_dir, tag, writer, everyone[0]["token"]

    def _commit(self, writer: NvcompFileSystemWriter, save_dir: str, tag: str, *,
                collective: Collective | None = None,
                channel: transfer.Channel | None = None) -> commit.CommitResult:
        """The tier's commit of a save DCP has finished on every rank (`collective` and
        `channel`: a background commit's own), then the drain started when due."""
        tier, collective = self.tier, collective or self.collective
        found = [text for text in collective.all_gather_object(
            None if writer.committed is None else serialize_manifest(writer.committed).decode(),
            step="dcp-local-tier-manifest", timeout_s=tier.timeout_s) if text]
        if len(found) != 1:
            raise CommitError(f"saving {tag!r}: {len(found)} ranks committed a DCP manifest, "
                              "not the coordinator alone")
        manifest = parse_manifest(found[0].encode(), source=os.fspath(tier.root / tag))
        mine = [record for record in manifest.files if record.rank == collective.rank]
        # No staging plan: DCP writes its files under their own names (a re-save overwrites in
        # place after the coordinator removed the old commit), and so do the replicas.
        result = tier.commit(tag, None, mine, error=None, layout=layout_record("dcp"),
                             step=None, versions=dict(manifest.versions), collective=collective,
                             channel=channel)
        tier.after_commit(result, save_dir, latest=False)
        return result

    def _commit_when_written(self, future: TierSaveFuture, written: cf.Future,
                             writer: NvcompFileSystemWriter, save_dir: str, tag: str,
                             collective: Collective, channel: transfer.Channel | None) -> None:
        """The background half of `async_save`: DCP's save awaited, then the tier's commit;
        `future` gets the outcome."""
        try:
            try:
                written.result()
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                raise CommitError(
                    f"saving {tag!r} into the node-local tier ({self.tier.options.path}) failed "
                    f"in the background: {_failures(exc, self.collective.rank)}. Nothing was "
                    "committed: no node's copy has the tag's manifest, nothing was drained"
                ) from exc
            result = self._commit(writer, save_dir, tag, collective=collective, channel=channel)
        except BaseException as exc:  # whatever ended the save is the future's outcome
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _background_group(self) -> Any:
        """The gloo group of async saves, made at the first one on every rank (None without a
        process group): DCP's background save and its replicas use it, the training thread
        never does (collectives of two threads on one group can hang)."""
        if self._background is None and dist.is_available() and dist.is_initialized():
            self._background = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self.tier.timeout_s))
        return self._background


def _failures(exc: BaseException, rank: int) -> str:
    """Each failed rank's error out of DCP's exception (its `failures`: rank -> (exception,
    traceback)), or this rank's own error."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        return "; ".join(f"rank {r}: {type(error).__name__}: {error}"
                         for r, (error, _) in sorted(failures.items()))
    return f"rank {rank}: {type(exc).__name__}: {exc}"


def _split(checkpoint_dir: str | os.PathLike) -> tuple[str, str]:
    """The persistent tier (the folder's parent) and the tag (its name)."""
    where = locations.location(checkpoint_dir)
    return os.fspath(where.parent), where.name


__all__ = ["DcpLocalTier", "TierSaveFuture"]
