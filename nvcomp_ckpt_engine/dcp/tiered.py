"""The node-local tier for DCP: a save written into the node's local folder, replicated, committed
there and drained to the checkpoint folder; a load restored from a local copy, a peer or the
checkpoint folder before it reads (docs/DCP.md, "Node-local tier").

A writer option cannot do it alone: DCP runs the writer's `finish` (``.metadata`` and the
manifest) on its coordinator only, and nothing of the writer runs on the other ranks afterwards,
while the tier's commit is collective (the replicas, each node's manifest, each rank's drain). So
`DcpLocalTier`, an object of the job's lifetime, wraps `dcp.save` and `dcp.load` and runs
`tiers.tiered.LocalTier` around them, on every rank. A DCP checkpoint folder is a tag folder: its
parent is the persistent tier and its name the tag.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

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


class DcpLocalTier:
    """The node-local tier of a DCP job: construct it on every rank at the same point (once the
    process group is initialized, or without one for a single process) and call `save`, `load`
    and `close` on every rank together.

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
        rank could not make its local tag folder (then before DCP starts)."""
        self.finish_drain()
        save_dir, tag = _split(checkpoint_dir)
        tier, rank = self.tier, self.collective.rank
        problem = None
        try:
            tier.prepare(tag)
        except (OSError, CheckpointError) as exc:  # every rank learns it before DCP's collectives
            problem = f"rank {rank}: {type(exc).__name__}: {exc}"
        problems = [p for p in self.collective.all_gather_object(
            problem, step="dcp-local-tier-prepare", timeout_s=tier.timeout_s) if p]
        if problems:
            raise CommitError(f"saving {tag!r} into the node-local tier ({tier.options.path}) "
                              "failed: " + "; ".join(problems))
        writer = NvcompFileSystemWriter(os.fspath(tier.root / tag), **writer_options)
        dcp.save(state_dict, storage_writer=writer, no_dist=self.collective.world_size == 1)
        found = [text for text in self.collective.all_gather_object(
            None if writer.committed is None else serialize_manifest(writer.committed).decode(),
            step="dcp-local-tier-manifest", timeout_s=tier.timeout_s) if text]
        if len(found) != 1:
            raise CommitError(f"saving {tag!r}: {len(found)} ranks committed a DCP manifest, "
                              "not the coordinator alone")
        manifest = parse_manifest(found[0].encode(), source=os.fspath(tier.root / tag))
        mine = [record for record in manifest.files if record.rank == rank]
        # No staging plan: DCP writes its files under their own names (a re-save overwrites in
        # place after the coordinator removed the old commit), and so do the replicas.
        result = tier.commit(tag, None, mine, error=None, layout=layout_record("dcp"),
                             step=None, versions=dict(manifest.versions))
        tier.after_commit(result, save_dir, latest=False)
        return result

    def finish_drain(self) -> commit.CommitResult | None:
        """Commit the persistent copy of the drain in progress (every rank); None if none was."""
        finished = self.tier.finish_drain()
        return None if finished is None else finished[0]

    def load(self, state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike,
             **reader_options: Any) -> Restored | None:
        """Restore `checkpoint_dir` into this node's local folder (its own copy, a peer's, or
        the persistent one for what no node holds) and `dcp.load` it from there; what the
        restore did. A folder without our manifest (a stock DCP checkpoint) is read where it
        is (None). `reader_options` are
        `NvcompFileSystemReader`'s."""
        save_dir, tag = _split(checkpoint_dir)
        restored = self.tier.restore(save_dir, tag)
        where = checkpoint_dir if restored is None else os.fspath(restored.root / tag)
        dcp.load(state_dict, storage_reader=NvcompFileSystemReader(where, **reader_options),
                 no_dist=self.collective.world_size == 1)
        return restored

    def close(self) -> None:
        """Commit the drain in progress and stop the tier's threads (every rank)."""
        try:
            self.finish_drain()
        finally:
            self.tier.close()


def _split(checkpoint_dir: str | os.PathLike) -> tuple[str, str]:
    """The persistent tier (the folder's parent) and the tag (its name)."""
    where = locations.location(checkpoint_dir)
    return os.fspath(where.parent), where.name


__all__ = ["DcpLocalTier"]
