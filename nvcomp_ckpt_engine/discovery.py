"""Finding checkpoints: tag folders, their state, `latest`, and the tag a load should use.

A tag folder is a checkpoint when its manifest (`manifest.py`) exists and agrees with its
files. This module lists the tag folders of a save directory, judges each (complete, or why
not), and picks the tag to load (`resolve_load_tag`), completing an interrupted re-save's
renames (`commit.finish_pending_renames`) before anything is read.

`latest` lives here, reader and writer together: it is the pointer that discovery follows, and
the commit protocol itself never reads it (the adapter points it at a tag after the commit), so
the file's one format (a validated tag, UTF-8, atomically replaced) is defined in one place.

`latest`
--------
`latest` is DeepSpeed's pointer and we honour it when it names a complete checkpoint, even if a
newer complete one exists (that happens after a crash between a commit and the update of
`latest`, and when someone points `latest` back by hand to roll back; we log it, and the newer
one is one `tag=` away). It is not trusted beyond that: empty (DeepSpeed truncates the file
before writing it), garbage, or naming a missing or incomplete folder, it is unusable, and
`resolve_load_tag` either raises `IncompleteCheckpointError` naming `fallback_to_complete`, or,
with it, loads the newest complete checkpoint (by the manifest's creation time) with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from .storage import Storage, StorageError, TooLargeError, locations, open_storage
from .storage.locations import Location
from .commit import finish_pending_renames
from .container import is_shard_file
from .errors import CheckpointError, IncompleteCheckpointError
from .manifest import (
    MANIFEST_NAME,
    RESERVED_MARK,
    STAGE_SUFFIX_RE,
    TAG_MARKER_NAME,
    Manifest,
    read_manifest,
    validate_tag,
)
from .manifest_files import verify_files

logger = logging.getLogger(__name__)

#: DeepSpeed's pointer file in save_dir.
LATEST_NAME = "latest"
#: DeepSpeed's pointer file in a universal checkpoint's folder, which its universal load
#: (``"load_universal": true``) reads instead of `latest`.
LATEST_UNIVERSAL_NAME = "latest_universal"
#: Longest `latest` file we read; anything longer is garbage.
_MAX_LATEST_BYTES = 4096


# ---------------------------------------------------------------------------------------------
# latest.

@dataclasses.dataclass(frozen=True)
class LatestPointer:
    """What `save_dir/latest` says: a usable tag, or None and why not."""

    tag: str | None
    reason: str


def inspect_latest(save_dir: str | os.PathLike, *, name: str = LATEST_NAME) -> LatestPointer:
    """Read `latest` (or the pointer file `name`, e.g. `LATEST_UNIVERSAL_NAME`); unusable when
    missing, empty, garbage or naming a missing folder.

    The file is not required to name a *complete* checkpoint here; `resolve_load_tag` checks.
    """
    path = locations.location(save_dir) / name
    try:
        data = locations.read_small(path, _MAX_LATEST_BYTES, what="latest")
    except FileNotFoundError:
        return LatestPointer(None, f"{path} does not exist")
    except TooLargeError:
        return LatestPointer(None, f"{path} is longer than {_MAX_LATEST_BYTES} bytes: not a tag")
    except ValueError:
        return LatestPointer(None, f"{path} is not a regular file")
    except OSError as exc:
        return LatestPointer(None, f"{path} cannot be read: {exc}")
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return LatestPointer(None, f"{path} is not UTF-8 text: {data[:64]!r}")
    if not text:
        return LatestPointer(
            None, f"{path} is empty (a save was probably interrupted while DeepSpeed wrote it)"
        )
    try:
        tag = validate_tag(text)
    except ValueError as exc:
        return LatestPointer(None, f"{path} does not hold a usable tag: {exc}")
    if not _is_folder(open_storage(save_dir), tag):
        return LatestPointer(None, f"{path} names tag {tag!r}, but there is no such folder")
    return LatestPointer(tag, "")


def newer_than_universal(save_dir: str | os.PathLike) -> tuple[str, str] | None:
    """(the tag `latest` names, the tag `latest_universal` names) when both name checkpoints in
    `save_dir` and `latest`'s is of a later step: a universal load (which follows
    `latest_universal`) would then roll training back. None otherwise."""
    latest = inspect_latest(save_dir).tag
    universal = inspect_latest(save_dir, name=LATEST_UNIVERSAL_NAME).tag
    if latest is None or universal is None or latest == universal:
        return None
    where = locations.location(save_dir)
    newer, older = _step_of(where / latest), _step_of(where / universal)
    return (latest, universal) if newer is not None and older is not None and newer > older else None


def _step_of(tag_dir: Location) -> int | None:
    """The step of the checkpoint in `tag_dir`: its manifest's, else DeepSpeed's tag name's."""
    try:
        step = read_manifest(tag_dir).step
    except (OSError, CheckpointError):
        step = None
    if step is None:
        found = re.fullmatch(r"global_step(\d+)", tag_dir.name)
        step = int(found.group(1)) if found else None
    return step


def read_latest(save_dir: str | os.PathLike) -> str | None:
    """The tag `latest` names, or None if it is unusable (the reason is logged)."""
    pointer = inspect_latest(save_dir)
    if pointer.tag is None:
        logger.info("latest is unusable: %s", pointer.reason)
    return pointer.tag


def write_latest(
    save_dir: str | os.PathLike, tag: str, *, durable: bool = True, name: str = LATEST_NAME
) -> None:
    """Point `latest` (or the pointer file `name`, e.g. DeepSpeed's ``latest_universal``) at
    `tag` atomically and durably (DeepSpeed's own write is neither)."""
    locations.publish(locations.location(save_dir) / name, validate_tag(tag).encode("utf-8"), durable=durable)


def _is_folder(storage: Storage, key: str) -> bool:
    """Whether `key` is a folder (a prefix) of `storage`, or a link to one."""
    try:
        return storage.stat(key).is_prefix
    except (OSError, ValueError):  # missing, not a key
        return False


# ---------------------------------------------------------------------------------------------
# What is ours.


def is_engine_file(path: str | os.PathLike) -> bool:
    """Whether `path` is one of the engine's own bookkeeping files, by its name: the manifest,
    the tag marker, or a name holding `manifest.RESERVED_MARK` (a re-save's staged file, a
    temp file of an atomic write, a folder being deleted). No such file belongs to a checkpoint's
    contents: a converted copy leaves them out, and no DeepSpeed file is named so."""
    name = os.path.basename(os.fspath(path))
    return name in (MANIFEST_NAME, TAG_MARKER_NAME) or RESERVED_MARK in name


def is_engine_tag(folder: str | os.PathLike, *, read_files: bool = True) -> bool:
    """Whether `folder` is a tag folder the engine wrote into: the one rule the CLI, the
    DeepSpeed adapter, retention and loads share.

    It is when an entry at its top level is our manifest or tag marker (whatever its file
    type: a link planted under our name is judged, and refused, as ours), a re-save's staged
    file, or (`read_files`) a shard file. Temp files of atomic writes do not count: a save
    directory holds them too (an interrupted write of `latest`). A folder holding none of these
    is not ours: a save directory, or a plain DeepSpeed checkpoint, read as DeepSpeed reads it.
    ``read_files=False`` judges by names alone, opening no file: for a walk up a path's
    ancestors in search of its tag folder, where a folder above the tag (a user's own, with
    `nce.save` files in it) must neither be read file by file nor be taken for a tag.
    """
    storage = open_storage(folder)
    try:
        entries = list(storage.list())
    except StorageError:  # a folder that is a link out of its own path's folder: not listed
        return False
    if any(_claims(entry.key) for entry in entries):
        return True
    return read_files and any(not entry.is_prefix and is_shard_file(storage.describe(entry.key))
                              for entry in entries)


def enclosing_tag_folder(path: str | os.PathLike) -> Location | None:
    """The nearest folder (or URL prefix) above `path` that the engine made (`is_engine_tag`, by
    names alone), None if there is none. `path` itself is not resolved: a symlink is judged where
    it lies, as one of the folder's entries, not by where it points."""
    if locations.is_url(path):
        above, parents = locations.location(path), []
        while above.name:
            above = above.parent
            parents.append(above)
        parents = parents[:-1]  # the bucket itself holds no tag
    else:
        parents = list(Path(os.path.abspath(path)).parents)
    return next((f for f in parents if is_engine_tag(f, read_files=False)), None)


def _claims(name: str) -> bool:
    """Whether an entry so named says the folder holding it is ours: the manifest, the tag
    marker, or a re-save's staged file."""
    stage = STAGE_SUFFIX_RE.search(name)
    return name in (MANIFEST_NAME, TAG_MARKER_NAME) or (
        stage is not None and stage.end() == len(name))


def why_not_failed_save(folder: Location) -> str | None:
    """None if `folder` provably holds only what one of our failed saves leaves behind, so
    that retention may delete it; else why not.

    `is_engine_tag` says the engine wrote into a folder; deleting one asks for more: no manifest
    (a save publishes it, atomically, only once it is complete: one that cannot be read,
    damaged or of another version, may still describe a whole checkpoint), only regular files,
    and either our marker (every rank writes it before any file) or nothing but our own
    bookkeeping files (`is_engine_file`: a crash during the marker's own atomic write). A
    shard file or a staged name without the marker proves nothing: `nce.save` writes shards
    anywhere.
    """
    entries = {entry.key: entry for entry in open_storage(folder).list()}
    if MANIFEST_NAME in entries:
        return (
            f"it holds a {MANIFEST_NAME} that cannot be read, so it may be a complete "
            "checkpoint (a failed save never publishes one)"
        )
    for entry in entries.values():
        if entry.is_link or entry.is_prefix or entry.special:
            return f"it holds {entry.key!r}, which is not a regular file"
    if TAG_MARKER_NAME in entries:
        return None
    foreign = [name for name in entries if not is_engine_file(name)]
    if foreign:
        return (
            f"it has no {TAG_MARKER_NAME} marker and holds {foreign[0]!r}, so nvcomp_ckpt_engine "
            "did not create it"
        )
    return None


# ---------------------------------------------------------------------------------------------
# Finding and resolving checkpoints.

@dataclasses.dataclass(frozen=True)
class TagState:
    """One tag folder as found: its manifest (None if unreadable), complete or not, and why not."""

    tag: str
    path: Location
    manifest: Manifest | None
    complete: bool
    problem: str


def tag_folders(save_dir: Location) -> list[tuple[str, Location]]:
    """Top-level folders of save_dir that may be tags (not the engine's trash or temp names)."""
    try:
        entries = list(open_storage(save_dir).list())
    except NotADirectoryError:
        return []
    return sorted((entry.key, save_dir / entry.key) for entry in entries
                  if RESERVED_MARK not in entry.key and entry.is_prefix)


def tag_state(
    tag: str, path: Location, *, local_only: bool, check_crc: bool,
    crc_of: Callable[[Location], int | None] | None = None, found: Manifest | None = None,
) -> TagState:
    """Read `path`'s manifest (unless `found`, read already) and check its files (sizes; CRCs
    as asked); never raises."""
    try:
        manifest = read_manifest(path) if found is None else found
    except CheckpointError as exc:
        return TagState(tag, path, None, False, str(exc))
    try:
        verify_files(
            path, manifest, check_crc=check_crc, crc_of=crc_of, local_only=local_only,
            allow_pending=True,
        )
    except CheckpointError as exc:
        return TagState(tag, path, manifest, False, str(exc))
    return TagState(tag, path, manifest, True, "")


def newest_first(states: Iterable[TagState]) -> list[TagState]:
    """The states with a manifest, newest first (creation time, then step, then tag)."""
    def key(state: TagState) -> tuple[int, int, str]:
        manifest = state.manifest
        step = -1 if manifest.step is None else manifest.step
        return (manifest.created_unix_ns, step, state.tag)

    return sorted((s for s in states if s.manifest is not None), key=key, reverse=True)


def _complete_states(
    save_dir: Location, *, local_only: bool, check_crc: bool, exclude: Iterable[str] = ()
) -> list[TagState]:
    skip = set(exclude)
    states = [
        tag_state(tag, path, local_only=local_only, check_crc=check_crc)
        for tag, path in tag_folders(save_dir)
        if tag not in skip
    ]
    return newest_first(s for s in states if s.complete)


def find_complete_checkpoints(
    save_dir: str | os.PathLike, *, local_only: bool = False, check_crc: bool = False
) -> list[str]:
    """Tags of the complete checkpoints in save_dir, newest first (by the manifests' creation
    time, then step, then tag). Complete: a valid manifest whose files exist with the right
    sizes (and CRCs with `check_crc`). Only top-level folders are considered."""
    states = _complete_states(locations.location(save_dir), local_only=local_only, check_crc=check_crc)
    return [s.tag for s in states]


@dataclasses.dataclass(frozen=True)
class _Checks:
    """How far a candidate checkpoint's files are checked beyond their sizes (see
    `resolve_load_tag`)."""

    local_only: bool
    check_crc: bool
    crc_of: Callable[[Location], int | None] | None

    def state(self, tag: str, path: Location, found: Manifest | None = None) -> TagState:
        return tag_state(tag, path, local_only=self.local_only, check_crc=self.check_crc,
                         crc_of=self.crc_of, found=found)

    def newest_intact(self, save_dir: Location, exclude: Iterable[str] = ()) -> TagState | None:
        """The newest complete checkpoint whose files also pass these checks. Sizes are checked
        for every tag (a stat per file); CRCs newest first, only until one passes."""
        return self.first_intact(_complete_states(
            save_dir, local_only=self.local_only, check_crc=False, exclude=exclude))

    def first_intact(self, complete: Iterable[TagState]) -> TagState | None:
        """The first of `complete` (newest first, sizes checked) that passes these checks."""
        for state in complete:
            if not (self.check_crc or self.crc_of):
                return state
            checked = self.state(state.tag, state.path, state.manifest)
            if checked.complete:
                return checked
            logger.warning("%s is damaged: %s", state.path, checked.problem)
        return None


def newest_intact_checkpoint(
    save_dir: str | os.PathLike,
    *,
    exclude: Iterable[str] = (),
    local_only: bool = False,
    check_crc: bool = False,
    crc_of: Callable[[Location], int | None] | None = None,
) -> str | None:
    """The tag of the newest complete checkpoint in save_dir, other than `exclude`, whose files
    pass the checks `resolve_load_tag` describes; None if there is none."""
    state = _Checks(local_only, check_crc, crc_of).newest_intact(locations.location(save_dir), exclude)
    return None if state is None else state.tag


def resolve_load_tag(
    save_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    fallback_to_complete: bool = False,
    local_only: bool = False,
    check_crc: bool = False,
    crc_of: Callable[[Location], int | None] | None = None,
) -> str:
    """The tag to load (see `resolve_load_state`)."""
    return resolve_load_state(  # never None: no fresh_start_ok
        save_dir, tag, fallback_to_complete=fallback_to_complete, local_only=local_only,
        check_crc=check_crc, crc_of=crc_of,
    ).tag


def resolve_load_state(
    save_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    latest: LatestPointer | None = None,
    fresh_start_ok: bool = False,
    fallback_to_complete: bool = False,
    local_only: bool = False,
    check_crc: bool = False,
    crc_of: Callable[[Location], int | None] | None = None,
) -> TagState | None:
    """The tag to load, checked complete, with any interrupted re-save's renames completed;
    with the manifest it was judged by, so that a load need not read it again.

    With `tag`, that tag or IncompleteCheckpointError (never a substitute: it was asked for by
    name). Without, the tag `latest` names if that checkpoint is complete; if `latest` is
    unusable or names an incomplete or damaged checkpoint, the newest intact checkpoint when
    `fallback_to_complete` is true (with a warning naming it), else IncompleteCheckpointError
    naming it and the option. Every rank may call it; it only reads, except to complete renames.
    `latest`: the pointer as the caller read it already (else it is read here).

    `fresh_start_ok`, for a job that resumes if it can: without a tag, None when there is
    nothing to resume (no usable `latest`, no complete checkpoint) instead of the error. Whether
    there is anything, and which checkpoint it is, are judged from one reading of the manifests.

    A checkpoint is complete when its manifest is valid and its files have the recorded sizes;
    the checkpoint chosen is also checked further: every byte against the recorded CRC-32 with
    `check_crc`, else, with `crc_of`, each file's CRC-32 as `crc_of` gives it without reading
    the file (a shard's index records it: a damaged index, header or trailer is found so).
    """
    save_dir = locations.location(save_dir)
    checks = _Checks(local_only, check_crc, crc_of)
    if tag is not None:
        tag = validate_tag(tag)
        state = checks.state(tag, save_dir / tag)
        if not state.complete:
            raise IncompleteCheckpointError(
                f"checkpoint {tag!r} in {save_dir} is not complete: {state.problem}"
                + _newest_hint(checks, save_dir, tag)
            )
        return _ready(state)
    pointer = inspect_latest(save_dir) if latest is None else latest
    complete = None
    if fresh_start_ok and pointer.tag is None:
        complete = _complete_states(save_dir, local_only=local_only, check_crc=False)
        if not complete:
            logger.info("nothing to resume in %s (%s)", save_dir, pointer.reason)
            return None
    return _resolve_latest(save_dir, checks, pointer, fallback_to_complete, complete)


def _resolve_latest(
    save_dir: Location, checks: _Checks, pointer: LatestPointer, fallback_to_complete: bool,
    complete: list[TagState] | None = None,
) -> TagState:
    """The tag `pointer` names if complete, else the fallback `resolve_load_state` describes;
    `complete`: the complete checkpoints other than `pointer`'s, newest first, if found already."""
    if pointer.tag is not None:
        state = checks.state(pointer.tag, save_dir / pointer.tag)
        if state.complete:
            _note_newer(save_dir, state, checks.local_only)
            return _ready(state)
        problem = f"latest names {pointer.tag!r}, which is not complete: {state.problem}"
    else:
        problem = pointer.reason
    if complete is None:
        complete = _complete_states(save_dir, local_only=checks.local_only, check_crc=False,
                                    exclude=[pointer.tag] if pointer.tag else [])
    intact = checks.first_intact(complete)
    if not fallback_to_complete:
        hint = (
            f"; the newest complete checkpoint is {intact.tag!r}: pass "
            "fallback_to_complete=True to load it instead, or load it by tag"
            if intact is not None
            else "; there is no complete checkpoint in it"
        )
        raise IncompleteCheckpointError(f"cannot load from {save_dir}: {problem}{hint}")
    if intact is None:
        raise IncompleteCheckpointError(
            f"cannot load from {save_dir}: {problem}; and there is no complete checkpoint to "
            "fall back to"
        )
    logger.warning(
        "%s; falling back to the newest complete checkpoint %r in %s",
        problem, intact.tag, save_dir,
    )
    return _ready(intact)


def _ready(state: TagState) -> TagState:
    finish_pending_renames(state.path, state.manifest)
    return state


def _newest_hint(checks: _Checks, save_dir: Location, tag: str) -> str:
    intact = checks.newest_intact(save_dir, exclude=[tag])
    return f"; the newest complete checkpoint is {intact.tag!r}" if intact is not None else ""


def _note_newer(save_dir: Location, state: TagState, local_only: bool) -> None:
    others = _complete_states(save_dir, local_only=local_only, check_crc=False, exclude=[state.tag])
    newer = [s for s in others if s.manifest.created_unix_ns > state.manifest.created_unix_ns]
    if newer:
        logger.warning(
            "latest names %r, but %r in %s is a newer complete checkpoint (a crash between its "
            "commit and the update of latest, or latest set back by hand); loading %r as latest "
            "says: pass tag=%r to load the newer one",
            state.tag, newer[0].tag, save_dir, state.tag, newer[0].tag,
        )


__all__ = [
    "LATEST_NAME",
    "LATEST_UNIVERSAL_NAME",
    "LatestPointer",
    "TagState",
    "find_complete_checkpoints",
    "inspect_latest",
    "is_engine_file",
    "is_engine_tag",
    "newest_first",
    "newest_intact_checkpoint",
    "read_latest",
    "resolve_load_state",
    "resolve_load_tag",
    "tag_folders",
    "tag_state",
    "why_not_failed_save",
    "write_latest",
]
