"""The distributed commit: every rank's shard records become one manifest, then `latest`.

This module prepares a tag folder for a save and runs the commit protocol (reports -> global
manifest -> renames of a re-save). The ranks talk through `collectives.py`; `latest` is read
and written by `discovery.py`, which also finds and resolves checkpoints to load; old
checkpoints and debris go by `retention.py`.

Why this exists
---------------
DeepSpeed 0.19.8 saves like this: rank 0 makes `save_dir`, barrier; every rank calls the
checkpoint engine's `create(info)`, then `save(state, path)` for each of its files (no barrier),
then `commit(info)`; then rank 0 writes `save_dir/latest` (the tag, no fsync), then a barrier.
Nothing stops rank 0 from writing `latest` before other ranks' files are on storage, and nothing
marks a tag folder as complete. Here a checkpoint is complete if and only if its manifest
(`manifest.py`) exists and agrees with its files, and the manifest is written only after every
rank has reported its files durable.

Call sequence (what the DeepSpeed adapter does; every step on every rank unless said)
-------------------------------------------------------------------------------------
1. `create(info)`: `plan = prepare_tag_dir(save_dir, tag, rank=...)`: makes the tag folder, marks
   it as the engine's, and says where this rank writes (staged names for a re-save).
2. `save(state, path)`: write through a storage sink at `plan.write_path(path)`, then keep
   a `ShardRecord(path=plan.record_path(path), ...)`. A failing `save` should *remember* its
   exception instead of raising, so that the rank still reaches step 3 and every rank learns of
   the failure (otherwise the others wait there until `timeout_s`, then name it as missing).
3. `commit(info)`: `commit_checkpoint(tag_dir, records, collective=..., layout=..., plan=plan,
   error=remembered_exception, timeout_s=...)`. It runs up to three named collective steps:
   - "report": all ranks exchange their records and error status. Any error, or ranks that
     disagree on the tag, and *every* rank raises `CommitError` naming the ranks at fault and
     their errors; no manifest is written, so the tag stays incomplete.
   - "publish": every rank builds the manifest from the reports and validates the global set
     of records (no path twice, ranks in range; the same result on every rank); rank 0 (each
     node's first rank with node-local storage) writes it atomically (temp, fsync, rename,
     fsync of the folder and of `save_dir`); then every rank learns whether that worked. No
     rank returns before the manifest is durable, and all raise if it is not. Every rank
     returns the same `CommitResult` (the manifest and its totals).
   - "finalize", only for a re-save (below): each rank renames its staged files into place.
4. Rank 0: `discovery.write_latest(save_dir, tag)` (atomic and durable); DeepSpeed then
   rewrites `latest` with the same text without fsync, which `discovery.read_latest` survives.
   Optionally `retention.apply_retention(save_dir, keep_last, protect={tag})`.
On load, every rank calls `discovery.resolve_load_tag(save_dir, tag)` before reading files.

A rank that never arrives makes the others raise `CommitError` within `timeout_s` naming it (as
far as the collective can tell: `StoreCollective` always can; `TorchDistributedCollective`
reports what gloo's monitored barrier reports). After such a timeout the collective's sequence is
out of step: do not reuse it; the job should stop.

Re-saving a tag that already has a manifest
-------------------------------------------
This happens when training resumes at step N and saves step N again, or when a script reuses a
fixed tag (`tag="last"`). Overwriting files in place would leave, after a crash, the old manifest
beside some new files: mixed state that may even pass a size check. Deleting the old manifest
first (so the tag reads "incomplete") is safe but throws away a good checkpoint, possibly the
only one. We keep the old one loadable instead:

- `prepare_tag_dir` sees the manifest and gives the rank a random staging suffix; the rank writes
  every file as `<path><suffix>` (DeepSpeed's path plus a suffix its loaders never glob for).
  The old manifest and old files are untouched: a crash now leaves the old checkpoint whole.
- "publish" replaces the manifest by one that lists the final paths and, in `pending`, each
  rank's suffix. From that atomic rename on the new checkpoint is the truth: for a pending
  record the staged file, while it exists, is the record's file, and renaming it over the final
  name is atomic, so the record's bytes are always under exactly one of the two names.
- "finalize": each rank renames its staged files over the old ones. A crash between "publish"
  and the end of "finalize" leaves some renames undone; `discovery.resolve_load_tag` (and
  `finish_pending_renames`) completes them before anything is loaded, idempotently, so several
  ranks may do it at once.
Cost: during a re-save both versions are on disk (twice the tag's size). Files the old
checkpoint had and the new one does not (a changed world size) stay in the folder, unlisted.

On a storage without atomic rename (an object store: `capabilities.atomic_rename` False) there
is no staging: the leader deletes the old manifest in `prepare_tag_dir`, so the tag reads
"incomplete" from then on, every rank waits in a barrier until that delete has landed (given
the job's collective), the ranks write under the final keys, and "publish" puts the new
manifest (with ``if_absent``: two writers cannot both commit the tag). A crash leaves a tag
without a manifest: a failed save, which `apply_retention` deletes once a newer checkpoint is
complete. The old checkpoint is given up when the re-save starts: on a store, save new tags.

"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import secrets
import socket
import time
import traceback
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .storage import join, locations, open_storage
from .storage.locations import Location
from .collectives import MAX_RANKS_SHOWN, Collective, ranks_text
from .errors import CommitError
from .manifest import (
    MANIFEST_NAME,
    TAG_MARKER_NAME,
    Manifest,
    ShardRecord,
    build_manifest,
    validate_relative_path,
    validate_tag,
    write_manifest,
)

logger = logging.getLogger(__name__)

#: Longest error text one rank sends (tracebacks can be huge).
_MAX_ERROR_CHARS = 2000
_MARKER_BYTES = b'{"format": "nvcomp_ckpt_engine.tag", "version": 1}\n'


# ---------------------------------------------------------------------------------------------
# Preparing a tag folder.

@dataclasses.dataclass(frozen=True)
class TagPlan:
    """Where one rank writes its files for one save (from `prepare_tag_dir`).

    `staging_suffix` is None for a fresh tag: files go to their final names. For a re-save of a
    tag that has a manifest it is this rank's random suffix, and files go to `<path><suffix>`
    until the commit renames them (see the module docstring).
    """

    save_dir: Location
    tag: str
    tag_dir: Location
    rank: int
    staging_suffix: str | None

    def record_path(self, path: str | os.PathLike) -> str:
        """`path` (as DeepSpeed passes it, under the tag folder) relative to the tag folder."""
        if locations.is_url(self.tag_dir):
            return validate_relative_path(locations.relative_to(path, self.tag_dir))
        relative = os.path.relpath(os.path.abspath(path), os.path.abspath(self.tag_dir))
        return validate_relative_path(Path(relative).as_posix())

    def write_path(self, path: str | os.PathLike) -> Location:
        """Where to write the file DeepSpeed asked for at `path` in this save."""
        relative = self.record_path(path)
        return self.tag_dir / (relative + (self.staging_suffix or ""))


def prepare_tag_dir(
    save_dir: str | os.PathLike,
    tag: str,
    *,
    rank: int,
    leader: bool | None = None,
    durable: bool = True,
    collective: Collective | None = None,
    timeout_s: float | None = None,
) -> TagPlan:
    """Create the tag folder if needed and decide how this rank writes into it.

    Every rank calls it in the engine's `create`. On a storage that can rename there is no
    barrier after it, so it never deletes anything (another rank may already be writing), and
    every rank makes sure the folder carries the marker that tells `apply_retention` the folder
    is the engine's before it writes anything there: whatever a crash leaves, no file of ours sits in an unmarked folder.
    (Usually one rank writes the marker and the others see it; a race writes it twice, the same
    bytes, atomically.) `leader` (default: rank 0; with node-local storage, each node's local
    rank 0) also makes the folder's own directory entry durable.

    On a storage that cannot rename (an object store) a re-save writes under the final keys, so
    the leader deletes the old manifest first; with `collective` every rank then waits in one
    barrier (step ``prepare-tag``, at most `timeout_s`) until that delete has landed, so no rank
    replaces a shard while the old manifest still names the tag complete. Every rank takes
    part whether or not it saw a manifest (they could see the store at different moments), and
    does so even when its own preparation failed, so a failure leaves no rank waiting.
    """
    tag = validate_tag(tag)
    save_dir = locations.location(save_dir)
    tag_dir = save_dir / tag
    storage = open_storage(save_dir)
    is_leader = rank == 0 if leader is None else leader
    in_place = not storage.capabilities.atomic_rename
    suffix = None
    try:
        storage.ensure_prefix(tag)
        marker = join(tag, TAG_MARKER_NAME)
        if not storage.exists(marker):
            storage.publish(marker, _MARKER_BYTES, durable=durable)
        if is_leader and durable:
            parent = Path(tag).parent.as_posix()
            storage.sync_prefix("" if parent == "." else parent)
            if parent != ".":
                storage.sync_prefix()
        if in_place:
            if is_leader and storage.exists(join(tag, MANIFEST_NAME)):
                logger.warning(
                    "%s already has a manifest and this storage cannot rename: its manifest is "
                    "deleted and the tag is re-saved in place (the old checkpoint is given up)", tag_dir)
                storage.delete(join(tag, MANIFEST_NAME))
        elif storage.exists(join(tag, MANIFEST_NAME)):
            suffix = f".nvckpt-stage-r{rank}-{secrets.token_hex(6)}"
            logger.info(
                "%s already has a manifest: rank %d writes under staged names (suffix %s) so the "
                "existing checkpoint stays loadable until this save commits", tag_dir, rank, suffix,
            )
    finally:
        if in_place and collective is not None:
            collective.barrier(step="prepare-tag", timeout_s=timeout_s)
    return TagPlan(save_dir=save_dir, tag=tag, tag_dir=tag_dir, rank=rank, staging_suffix=suffix)


# ---------------------------------------------------------------------------------------------
# The commit.

@dataclasses.dataclass(frozen=True)
class CommitResult:
    """What was committed, identical on every rank: the manifest and its totals (for logs)."""

    tag: str
    world_size: int
    files: int
    raw_bytes: int
    file_bytes: int
    staged: bool
    manifest: Manifest


def commit_checkpoint(
    tag_dir: str | os.PathLike,
    my_records: Iterable[ShardRecord],
    *,
    collective: Collective,
    layout: Mapping[str, Any],
    timeout_s: float,
    durable: bool = True,
    plan: TagPlan | None = None,
    error: BaseException | str | None = None,
    step: int | None = None,
    versions: Mapping[str, str] | None = None,
    node_local_storage: bool = False,
    node: str | None = None,
    every_node_writes: bool = False,
) -> CommitResult:
    """Commit one checkpoint: called by every rank once its files are durable.

    `my_records` are this rank's files (their `rank` must be this rank); `error`, if given, is
    why this rank's save failed, and makes every rank raise. `plan` is this rank's
    `prepare_tag_dir` result (without it a re-save overwrites files in place). `layout` (dp/tp/pp
    sizes, ZeRO stage, ...; rank 0's is recorded) and `versions` go into the manifest. Each
    collective step waits at most `timeout_s`. With `node_local_storage`, the first rank of
    each node (by `node`, default this host's name) writes the manifest into its node's folder;
    `every_node_writes` does the same for a manifest that lists every file of the tag (the
    node-local tier, whose nodes each hold a copy of the tag's manifest: `tiers`).

    Returns the committed manifest and its totals, the same on every rank (`staged`: this was a
    re-save, whose files were renamed into place). Raises CommitError on every rank if
    any rank failed, disagreed or did not arrive, or if the manifest could not be written; the
    message names the ranks and their errors.
    """
    tag_dir = locations.location(tag_dir)
    tag = plan.tag if plan is not None else tag_dir.name
    rank, world_size = collective.rank, collective.world_size
    payload = _report_payload(
        tag_dir, tag, my_records, rank, world_size, plan, error, layout if rank == 0 else None
    )
    payload["node"] = node or socket.gethostname()
    reports = _step(collective, payload, "report", timeout_s, tag)
    _raise_report_failures(reports, tag, world_size)
    try:
        manifest = _global_manifest(
            tag, reports, step=step, versions=versions, node_local_storage=node_local_storage
        )
    except (TypeError, ValueError) as exc:
        # Every rank builds the manifest from the same reports with the same code, so every
        # rank fails here alike and none is left waiting in the next step.
        raise CommitError(
            f"commit of checkpoint {tag!r}: the ranks' records do not fit together: {exc}. No "
            "manifest was written, so the checkpoint is incomplete"
        ) from exc
    outcome = None
    if rank in _manifest_writers(reports, node_local_storage or every_node_writes):
        outcome = _write_global_manifest(tag_dir, manifest, durable, node_local_storage)
    statuses = _step(collective, {"error": outcome}, "publish", timeout_s, tag)
    _raise_status_failures(
        statuses, tag, "the manifest could not be written (or not made durable): count this "
        "checkpoint as failed; a load uses it only if its manifest turns out complete",
    )
    if manifest.pending:
        outcome = None
        if plan is not None and plan.staging_suffix is not None:
            outcome = _finish_own_renames(tag_dir, payload["records"], plan.staging_suffix, durable)
        statuses = _step(collective, {"error": outcome}, "finalize", timeout_s, tag)
        _raise_status_failures(
            statuses, tag, "the manifest is written and the checkpoint complete, but renames "
            "of staged files failed; resolve_load_tag retries them before a load",
        )
    return CommitResult(
        tag=tag,
        world_size=world_size,
        files=len(manifest.files),
        raw_bytes=manifest.raw_bytes,
        file_bytes=manifest.file_bytes,
        staged=bool(manifest.pending),
        manifest=manifest,
    )


def _step(collective: Collective, obj: Any, step: str, timeout_s: float, tag: str) -> list[Any]:
    try:
        values = collective.all_gather_object(obj, step=step, timeout_s=timeout_s)
    except CommitError as exc:
        raise CommitError(f"commit of checkpoint {tag!r}: {exc}") from exc
    if len(values) != collective.world_size:
        raise CommitError(
            f"commit of checkpoint {tag!r}: step {step!r} returned {len(values)} values for "
            f"{collective.world_size} ranks"
        )
    return values


def _describe_error(error: BaseException | str) -> str:
    if isinstance(error, BaseException):
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        frames = traceback.extract_tb(error.__traceback__)
        if frames:
            last = frames[-1]
            text += f" (at {Path(last.filename).name}:{last.lineno} in {last.name})"
    else:
        text = str(error)
    return text[:_MAX_ERROR_CHARS]


def _report_payload(
    tag_dir: Location,
    tag: str,
    my_records: Iterable[ShardRecord],
    rank: int,
    world_size: int,
    plan: TagPlan | None,
    error: BaseException | str | None,
    layout: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """This rank's report. Problems found here become this rank's error, never an exception:
    raising before the collective would leave the other ranks waiting for us."""
    suffix = plan.staging_suffix if plan is not None else None
    problem = None if error is None else _describe_error(error)
    records: list[dict[str, Any]] = []
    layout_json = None
    if problem is None:
        try:
            own = list(my_records)
            problem = _check_own_records(tag_dir, own, rank, suffix)
            records = [r.to_json() for r in own] if problem is None else []
            # What the layout will look like after a trip through a collective (tuples become
            # lists), and a check that it can make that trip.
            if layout is not None:
                layout_json = json.loads(json.dumps(layout, allow_nan=False))
        except Exception as exc:
            problem = _describe_error(exc)
    return {
        "tag": tag,
        "world_size": world_size,
        "time_ns": time.time_ns(),
        "error": problem,
        "records": [] if problem else records,
        "staging_suffix": suffix,
        "layout": layout_json,
    }


def _check_own_records(
    tag_dir: Location, records: list[ShardRecord], rank: int, suffix: str | None
) -> str | None:
    """Cheap self-check (a stat per file) so a wrong record fails the commit, not a later load."""
    for record in records:
        if not isinstance(record, ShardRecord):
            return f"TypeError: records must be ShardRecord, got {type(record).__name__}"
        if record.rank != rank:
            return (
                f"ValueError: record {record.path!r} says rank {record.rank}, but this is "
                f"rank {rank}"
            )
        path = tag_dir / (record.path + (suffix or ""))
        try:
            size = locations.stat(path).size
        except OSError as exc:
            return f"{type(exc).__name__}: the file of record {record.path!r}: {exc}"
        if size != record.file_bytes:
            return (
                f"ValueError: {path} has {size} bytes but its record says {record.file_bytes} "
                "(was the file finished before the record was made?)"
            )
    return None


def _raise_report_failures(reports: list[Any], tag: str, world_size: int) -> None:
    problems = {}
    for rank, report in enumerate(reports):
        if not isinstance(report, dict):
            problems[rank] = f"sent {type(report).__name__}, not a report"
        elif report.get("error"):
            problems[rank] = report["error"]
        elif report.get("tag") != tag:
            problems[rank] = f"is committing tag {report.get('tag')!r}, not {tag!r}"
        elif report.get("world_size") != world_size:
            problems[rank] = f"has world size {report.get('world_size')!r}, not {world_size}"
    if problems:
        raise CommitError(_failure_text(tag, problems, world_size, (
            "no manifest was written, so the checkpoint is incomplete and the previous "
            "complete one stays the one to load"
        )))


def _raise_status_failures(statuses: list[Any], tag: str, consequence: str) -> None:
    problems = {
        rank: status["error"]
        for rank, status in enumerate(statuses)
        if isinstance(status, dict) and status.get("error")
    }
    if problems:
        raise CommitError(_failure_text(tag, problems, len(statuses), consequence))


def _failure_text(tag: str, problems: dict[int, str], world_size: int, consequence: str) -> str:
    ranks = sorted(problems)
    shown = "; ".join(f"rank {r}: {problems[r]}" for r in ranks[:MAX_RANKS_SHOWN])
    more = len(ranks) - MAX_RANKS_SHOWN
    return (
        f"commit of checkpoint {tag!r} failed on {len(ranks)} of {world_size} ranks "
        f"{ranks_text(ranks)}: {shown}{f'; and {more} more' if more > 0 else ''}. "
        f"{consequence[0].upper()}{consequence[1:]}."
    )


def _manifest_writers(reports: list[dict[str, Any]], node_local_storage: bool) -> set[int]:
    """Rank 0 writes the manifest; with node-local storage, the first rank of every node."""
    if not node_local_storage:
        return {0}
    first: dict[str, int] = {}
    for rank, report in enumerate(reports):
        first.setdefault(report["node"], rank)
    return set(first.values())


def _engine_version() -> str:
    try:
        from ._version import __version__

        return str(__version__)
    except ImportError:
        try:
            return importlib.metadata.version("nvcomp_ckpt_engine")
        except importlib.metadata.PackageNotFoundError:
            return "unknown"


def _global_manifest(
    tag: str,
    reports: list[dict[str, Any]],
    *,
    step: int | None,
    versions: Mapping[str, str] | None,
    node_local_storage: bool,
) -> Manifest:
    """The manifest of the gathered reports; deterministic, so every rank builds the same one.

    Validates the global set: every record well-formed and of its reporting rank, no path twice
    (per node with node-local storage). Raises TypeError/ValueError naming the rank and record.
    """
    records = [
        ShardRecord.from_json(obj, field=f"rank {rank} record {i}")
        for rank, report in enumerate(reports)
        for i, obj in enumerate(report["records"])
    ]
    pending = {
        rank: report["staging_suffix"]
        for rank, report in enumerate(reports)
        if report["staging_suffix"]
    }
    return build_manifest(
        tag=tag,
        world_size=len(reports),
        files=records,
        layout=reports[0]["layout"] or {},
        versions={"nvcomp_ckpt_engine": _engine_version(), **(versions or {})},
        step=step,
        created_unix_ns=reports[0]["time_ns"],
        node_local_storage=node_local_storage,
        pending=pending,
    )


def _write_global_manifest(
    tag_dir: Location, manifest: Manifest, durable: bool, node_local_storage: bool = False
) -> str | None:
    """Write the manifest (the commit point); the error text, or None. On a storage without
    atomic rename the tag has no manifest here (`prepare_tag_dir` deleted a re-save's), so the
    manifest is put only if still absent: a second writer of the tag fails instead of replacing
    the first one's commit.

    Catches everything: an exception here must reach the other ranks through "publish", not
    leave them waiting for a rank that died in its own error handling.
    """
    try:
        if_absent = not node_local_storage and not open_storage(tag_dir).capabilities.atomic_rename
        write_manifest(tag_dir, manifest, durable=durable, if_absent=if_absent)
        if durable:
            open_storage(tag_dir.parent).sync_prefix()
    except Exception as exc:
        logger.error("writing the manifest of %s failed", tag_dir, exc_info=True)
        return _describe_error(exc)
    logger.info(
        "committed %s: %d files, %d bytes on disk for %d raw bytes",
        tag_dir, len(manifest.files), manifest.file_bytes, manifest.raw_bytes,
    )
    return None


def _finish_own_renames(
    tag_dir: Location, records: list[dict[str, Any]], suffix: str, durable: bool
) -> str | None:
    try:
        _rename_staged(tag_dir, [r["path"] for r in records], suffix, durable)
    except Exception as exc:
        logger.error("renaming staged files in %s failed", tag_dir, exc_info=True)
        return _describe_error(exc)
    return None


def _rename_staged(tag_dir: Location, paths: Iterable[str], suffix: str, durable: bool) -> int:
    """Rename `<path><suffix>` over `<path>` where it still exists; idempotent."""
    storage = open_storage(tag_dir)
    renamed, folders = 0, set()
    for path in paths:
        try:
            storage.rename(path + suffix, path)
        except FileNotFoundError:
            continue  # already renamed (by us earlier, or by another rank's recovery)
        renamed += 1
        folders.add(Path(path).parent.as_posix())
    if durable:
        for folder in sorted(folders):
            storage.sync_prefix("" if folder == "." else folder)
    return renamed


def rename_staged(tag_dir: str | os.PathLike, paths: Iterable[str], suffix: str, *,
                  durable: bool = True) -> int:
    """Rename each ``<path><suffix>`` over ``<path>`` in `tag_dir` where it still exists, after
    the commit of a re-save: files a rank holds beside its own records (the node-local tier's
    replicas). Idempotent; the count."""
    return _rename_staged(locations.location(tag_dir), paths, suffix, durable)


def finish_pending_renames(
    tag_dir: str | os.PathLike,
    manifest: Manifest,
    *,
    ranks: Iterable[int] | None = None,
    durable: bool = True,
) -> int:
    """Complete the renames of an interrupted re-save (see the module docstring); the count.

    Safe to run on many ranks at once and again after a crash. Needs write access to the tag
    folder; on a read-only copy, load after running it once where it is writable.
    """
    tag_dir = locations.location(tag_dir)
    wanted = None if ranks is None else set(ranks)
    renamed = 0
    for rank, suffix in manifest.pending.items():
        if wanted is not None and rank not in wanted:
            continue
        paths = [r.path for r in manifest.files if r.rank == rank]
        renamed += _rename_staged(tag_dir, paths, suffix, durable)
    if renamed:
        logger.warning(
            "%s: completed %d renames of staged files left by an interrupted re-save",
            tag_dir, renamed,
        )
    return renamed


__all__ = [
    "CommitResult",
    "TagPlan",
    "commit_checkpoint",
    "finish_pending_renames",
    "prepare_tag_dir",
    "rename_staged",
]
