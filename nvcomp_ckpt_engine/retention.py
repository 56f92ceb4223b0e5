"""Retention: keep the newest complete checkpoints, delete older ones and provable debris.

`apply_retention` keeps the newest `keep_last` complete checkpoints, never deletes the tag
`latest` names or a protected one (the one just committed, one being written), and deletes only
folders holding a valid manifest of ours, renaming each to a hidden trash name first so a crash
mid-deletion leaves nothing that looks like a checkpoint. Leftovers of failed saves (temp files,
unreferenced staged files, folders without a manifest that are older than the newest complete
checkpoint) are logged and removed when they are provably ours; anything else is left alone and
reported. A folder whose manifest cannot be read (damaged, or written by another version) is
never provably a failed save, so it is left alone too. A universal checkpoint
(`nvcomp-ckpt to-universal`, its layout's ``kind``) is not one of the job's saves: it is neither
counted among those kept nor deleted, whatever its age. Call it on one rank per storage (rank 0;
each node's leader with node-local storage), after the commit, and never while another save
writes into an unprotected tag.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
from collections.abc import Iterable, Mapping

from .discovery import (
    TagState, newest_first, read_latest, tag_folders, tag_state, why_not_failed_save,
)
from .fileio import PARTIAL_SUFFIX
from .manifest import MANIFEST_NAME, STAGE_SUFFIX_RE, UNIVERSAL_LAYOUT_KIND
from .storage import join, locations, open_storage
from .storage.locations import Location

logger = logging.getLogger(__name__)

#: Suffix of a tag folder being deleted by `apply_retention`.
TRASH_SUFFIX = ".nvckpt-deleting"


@dataclasses.dataclass(frozen=True)
class RetentionReport:
    """What `apply_retention` did: tags kept and deleted, leftover files removed, and what it
    left alone (with why) although it looked like debris."""

    kept: tuple[str, ...]
    deleted: tuple[str, ...]
    leftovers_removed: tuple[str, ...]
    left_alone: tuple[str, ...]


def apply_retention(
    save_dir: str | os.PathLike,
    keep_last: int,
    *,
    protect: Iterable[str | None] = (),
    local_only: bool = False,
    resumed_from: str | None = None,
    passed_over: Mapping[str, str] | None = None,
) -> RetentionReport:
    """Keep the newest `keep_last` complete checkpoints; delete older ones and provable debris.

    Never deletes: the tag `latest` names, tags in `protect` (pass the one just committed and
    any being written), folders without a valid manifest of ours unless they are provably
    failed saves of ours (no manifest file at all, our marker, only regular files, older than
    the newest complete checkpoint), symlinks, or anything when there are fewer than
    `keep_last` complete checkpoints. A folder is renamed to a hidden trash name before its contents are deleted, so
    a crash mid-way leaves nothing that looks like a checkpoint; the next call finishes it.

    `resumed_from`: the tag the job resumed from, and `passed_over`: the newer tags its load
    passed over, with why (a damaged file, `"fallback_to_complete"`). A checkpoint newer than
    the one resumed from is deleted only as any other older than the ones kept is, but with a
    warning that says so and why it was not resumed from, never as a routine deletion.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    save_dir = locations.location(save_dir)
    # Only compared with folder names, so a None or a garbage entry (say, from an unusable
    # latest file) protects nothing and harms nothing.
    protected = {t for t in protect if isinstance(t, str)}
    latest = read_latest(save_dir)
    if latest is not None:
        protected.add(latest)
    removed = _finish_trash(save_dir)
    states = [
        tag_state(tag, path, local_only=local_only, check_crc=False)
        for tag, path in tag_folders(save_dir)
    ]
    converted = sorted(s.tag for s in states
                       if s.complete and s.manifest.layout.get("kind") == UNIVERSAL_LAYOUT_KIND)
    protected.update(converted)
    complete = newest_first(s for s in states if s.complete and s.tag not in converted)
    kept = complete[:keep_last]
    resumed = next((s for s in complete if s.tag == resumed_from), None)
    sweep = _Sweep(
        save_dir=save_dir,
        resumed_from=resumed_from,
        resumed_ns=resumed.manifest.created_unix_ns if resumed is not None else None,
        passed_over=dict(passed_over or {}),
        protected=frozenset(protected),
        kept=frozenset(s.tag for s in kept),
        # Tags older than the oldest kept go; with too few complete ones, none do.
        cutoff_ns=kept[-1].manifest.created_unix_ns if len(complete) >= keep_last else None,
        newest_ns=complete[0].manifest.created_unix_ns if complete else None,
    )
    deleted: list[str] = []
    left = [f"{tag}: a universal checkpoint (nvcomp-ckpt to-universal), never deleted by "
            "keep_last" for tag in converted]
    for state in states:
        gone, cleaned, untouched = sweep.apply(state)
        deleted += gone
        removed += cleaned
        left += untouched
    removed += _remove_save_dir_temps(save_dir)
    return RetentionReport(
        kept=tuple(s.tag for s in kept),
        deleted=tuple(deleted),
        leftovers_removed=tuple(removed),
        left_alone=tuple(left),
    )


@dataclasses.dataclass(frozen=True)
class _Sweep:
    """The retention decision for each tag folder (see `apply_retention`)."""

    save_dir: Location
    resumed_from: str | None
    resumed_ns: int | None
    passed_over: dict[str, str]
    protected: frozenset[str]
    kept: frozenset[str]
    cutoff_ns: int | None
    newest_ns: int | None

    def apply(self, state: TagState) -> tuple[list[str], list[str], list[str]]:
        """(tags deleted, leftover files removed, things left alone and why) for one folder."""
        if state.tag in self.protected:
            return [], [], _report_leftovers(state) if state.manifest is not None else []
        if _is_link(self.save_dir, state.tag):  # never deleted, nor cleaned: it points elsewhere
            note = [] if state.tag in self.kept else [f"{state.tag}: a symlink, never deleted"]
            return [], [], note
        if state.tag in self.kept:
            return [], _remove_leftovers(state), []
        if state.manifest is not None:
            if self.cutoff_ns is not None and state.manifest.created_unix_ns < self.cutoff_ns:
                newer = self._newer_than_resumed(state)
                _remove_tag(self.save_dir, state.tag, "older than the ones kept" + newer,
                            level=logging.WARNING if newer else logging.INFO)
                return [state.tag], [], []
            return [], _remove_leftovers(state), []
        if self.newest_ns is None or _mtime_ns(self.save_dir, state.tag) >= self.newest_ns:
            return [], [], []  # no manifest, but maybe a save in flight: not ours to judge
        why_not = why_not_failed_save(state.path)
        if why_not is None:
            _remove_tag(self.save_dir, state.tag, "a failed save of ours: no valid manifest")
            return [state.tag], [], []
        logger.warning(
            "%s has no valid manifest (%s) but is left alone: %s",
            state.path, state.problem, why_not,
        )
        return [], [], [f"{state.tag}: no valid manifest, {why_not}"]


    def _newer_than_resumed(self, state: TagState) -> str:
        """Why `state`, a checkpoint newer than the one the job resumed from, was not resumed
        from, for the deletion's message ("": it is not newer)."""
        why = self.passed_over.get(state.tag)
        if why is not None:
            return (f", though newer than {self.resumed_from!r}, which this job resumed from: "
                    f"its load was passed over ({why})")
        if self.resumed_ns is not None and state.manifest.created_unix_ns > self.resumed_ns:
            return (f", though newer than {self.resumed_from!r}, which this job resumed from "
                    "(the checkpoint latest or the load's tag named)")
        return ""


def _is_link(save_dir: Location, tag: str) -> bool:
    try:
        return open_storage(save_dir).stat(tag).is_link
    except OSError:
        return False


#: How coarse an object store's modification times are (S3's are whole seconds): added to the
#: newest object's time under a tag, so that a save of the same second counts as newer.
_STORE_TIME_RESOLUTION_S = 1.0


def _mtime_ns(save_dir: Location, tag: str) -> int:
    """The tag folder's modification time (of where a link leads), in ns; 0 if it is gone. An
    object store's prefix has no time of its own: there it is the newest object's under it (plus
    the store's time resolution), so that a save still writing counts as new; an upload not yet
    finished is not listed, which is why `apply_retention`'s `protect` names the tags being
    written."""
    try:
        storage = open_storage(save_dir)
        if storage.capabilities.local:
            return int(locations.stat(save_dir / tag).mtime * 1e9)
        newest, prefixes = 0.0, [tag]
        while prefixes:
            for entry in storage.list(prefixes.pop()):
                if entry.is_prefix:
                    prefixes.append(entry.key)
                else:
                    newest = max(newest, entry.mtime)
        return int((newest + _STORE_TIME_RESOLUTION_S) * 1e9)
    except OSError:
        return 0


def _remove_tag(save_dir: Location, tag: str, why: str, *, level: int = logging.INFO) -> None:
    """Rename the tag folder to a trash name (one durable step: a crash leaves no half-deleted
    tag under its own name), then delete the trash. Without a rename (an object store): delete
    the manifest first, so that a crash mid-way leaves what a failed save leaves (the marker, no
    manifest), which the next call removes, then everything under the tag (`delete_prefix`,
    which also aborts the multipart uploads of writers that died there)."""
    storage = open_storage(save_dir)
    if not storage.capabilities.atomic_rename:
        logger.log(level, "retention: deleting %s (%s)", save_dir / tag, why)
        storage.delete(join(tag, MANIFEST_NAME))
        storage.delete_prefix(tag)
        return
    parent, name = posixpath.split(tag)
    trash = join(parent, f".{name}{TRASH_SUFFIX}")
    if storage.exists(trash):
        storage.delete_prefix(trash)
    storage.rename(tag, trash)
    storage.sync_prefix(parent)
    logger.log(level, "retention: deleting %s (%s)", save_dir / tag, why)
    storage.delete_prefix(trash)


def _finish_trash(save_dir: Location) -> list[str]:
    removed = []
    storage = open_storage(save_dir)
    for entry in storage.list():
        if entry.key.endswith(TRASH_SUFFIX) and entry.is_prefix and not entry.is_link:
            logger.info("retention: finishing the deletion of %s", save_dir / entry.key)
            storage.delete_prefix(entry.key)
            removed.append(entry.key)
    return removed


def _leftovers(state: TagState) -> list[str]:
    """Our temp files, and staged files the manifest does not need, anywhere in the folder
    (links to folders are not followed): their keys under the tag folder."""
    wanted = set(state.manifest.pending.values()) if state.manifest else set()
    storage = open_storage(state.path)
    found, folders = [], [""]
    while folders:
        for entry in storage.list(folders.pop()):
            name = posixpath.basename(entry.key)
            if entry.is_prefix:
                if not entry.is_link:
                    folders.append(entry.key)
                continue
            stage = STAGE_SUFFIX_RE.search(name)
            if name.endswith(PARTIAL_SUFFIX) or (
                stage is not None and stage.end() == len(name) and stage.group(0) not in wanted
            ):
                found.append(entry.key)
    return sorted(found)


def _report_leftovers(state: TagState) -> list[str]:
    return [
        f"{join(state.path.name, key)}: leftover in protected tag {state.tag!r}"
        for key in _leftovers(state)
    ]


def _remove_leftovers(state: TagState) -> list[str]:
    removed = []
    for key in _leftovers(state):
        logger.info("retention: removing leftover %s of an interrupted write", state.path / key)
        storage = open_storage(state.path)
        if not storage.exists(key):
            continue
        storage.delete(key)
        removed.append(join(state.path.name, key))
    return removed


def _remove_save_dir_temps(save_dir: Location) -> list[str]:
    """Temp files of interrupted atomic writes of `latest` (or of anything else we write there)."""
    removed = []
    storage = open_storage(save_dir)
    for entry in storage.list():
        if (entry.key.endswith(PARTIAL_SUFFIX) and not entry.is_prefix and not entry.is_link
                and not entry.special):
            logger.info("retention: removing leftover %s of an interrupted write", save_dir / entry.key)
            storage.delete(entry.key)
            removed.append(entry.key)
    return removed


__all__ = [
    "RetentionReport",
    "TRASH_SUFFIX",
    "apply_retention",
]
