"""The drain: a tag's files copied from the local tier to the persistent tier (``save_dir``).

Each rank copies the files it wrote itself (they are on its own node) into the persistent tag
folder that `commit.prepare_tag_dir` made (staged names for a re-save, as any save), in a
background thread that uses no collective. The persistent copy is committed later by every rank
together (`commit.commit_checkpoint`: the manifest is the commit point, ``latest`` moves after
it), so a drain killed midway leaves a tag folder without a manifest: a failed save that
discovery never loads and retention removes.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from collections.abc import Sequence

from .. import commit
from ..manifest import Manifest, ShardRecord
from ..storage import locations
from ..storage.locations import Location


@dataclasses.dataclass
class Drain:
    """One tag on its way to the persistent tier, on this rank."""

    tag: str
    manifest: Manifest
    records: tuple[ShardRecord, ...]
    future: cf.Future
    save_dir: str
    #: Whether ``latest`` is to name the tag once its persistent copy is committed.
    latest: bool

    def result(self) -> commit.TagPlan:
        """Wait for this rank's copies; the persistent tag's plan (raises what the copy raised)."""
        return self.future.result()


def copy_to_persistent(local_tag_dir: Location, save_dir: str, tag: str, rank: int,
                       records: Sequence[ShardRecord]) -> commit.TagPlan:
    """Copy `records`' files from `local_tag_dir` into ``save_dir/tag``; the tag's plan."""
    plan = commit.prepare_tag_dir(save_dir, tag, rank=rank)
    for record in records:
        locations.copy(local_tag_dir / record.path,
                       plan.tag_dir / (record.path + (plan.staging_suffix or "")), durable=True)
    return plan


def start(pool: cf.Executor, local_tag_dir: Location, save_dir: str, manifest: Manifest,
          rank: int, *, latest: bool) -> Drain:
    """Start copying this rank's files of `manifest`'s tag in `pool`."""
    own = tuple(r for r in manifest.files if r.rank == rank)
    future = pool.submit(copy_to_persistent, local_tag_dir, save_dir, manifest.tag, rank, own)
    return Drain(tag=manifest.tag, manifest=manifest, records=own, future=future,
                 save_dir=save_dir, latest=latest)


__all__ = ["Drain", "copy_to_persistent", "start"]
