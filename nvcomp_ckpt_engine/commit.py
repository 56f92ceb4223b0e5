"""The distributed commit: every rank's shard records become one manifest, then `latest`.

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
2. `save(state, path)`: write through `storage.ShardFileWriter(plan.write_path(path))`, then keep
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
4. Rank 0: `write_latest(save_dir, tag)` (atomic and durable); DeepSpeed then rewrites `latest`
   with the same text without fsync, which `read_latest` survives (see below). Optionally
   `apply_retention(save_dir, keep_last, protect={tag})`.
On load, every rank calls `resolve_load_tag(save_dir, tag)` before reading files.

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
  and the end of "finalize" leaves some renames undone; `resolve_load_tag` (and
  `finish_pending_renames`) completes them before anything is loaded, idempotently, so several
  ranks may do it at once.
Cost: during a re-save both versions are on disk (twice the tag's size). Files the old
checkpoint had and the new one does not (a changed world size) stay in the folder, unlisted.

`latest`
--------
`latest` is DeepSpeed's pointer and we honour it when it names a complete checkpoint, even if a
newer complete one exists (that happens after a crash between a commit and the update of
`latest`, and when someone points `latest` back by hand to roll back; we log it, and the newer
one is one `tag=` away). It is not trusted beyond that: empty (DeepSpeed truncates the file
before writing it), garbage, or naming a missing or incomplete folder, it is unusable, and
`resolve_load_tag` either raises `IncompleteCheckpointError` naming `fallback_to_complete`, or,
with it, loads the newest complete checkpoint (by the manifest's creation time) with a warning.

Retention
---------
`apply_retention` keeps the newest `keep_last` complete checkpoints, never deletes the tag
`latest` names or a protected one (the one just committed, one being written), and deletes only
folders holding a valid manifest of ours, renaming each to a hidden trash name first so a crash
mid-deletion leaves nothing that looks like a checkpoint. Leftovers of failed saves (temp files,
unreferenced staged files, folders without a manifest that are older than the newest complete
checkpoint) are logged and removed when they are provably ours; anything else is left alone and
reported. A folder whose manifest cannot be read (damaged, or written by another version) is
never provably a failed save, so it is left alone too. Call it on one rank per storage (rank 0; each node's leader with node-local storage),
after the commit, and never while another save writes into an unprotected tag.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from . import storage
from .errors import CheckpointError, CommitError, IncompleteCheckpointError
from .manifest import (
    MANIFEST_NAME,
    RESERVED_MARK,
    STAGE_SUFFIX_RE,
    TAG_MARKER_NAME,
    Manifest,
    ShardRecord,
    build_manifest,
    read_manifest,
    validate_relative_path,
    validate_tag,
    verify_files,
    write_manifest,
)

logger = logging.getLogger(__name__)

#: DeepSpeed's pointer file in save_dir.
LATEST_NAME = "latest"
#: Suffix of a tag folder being deleted by `apply_retention`.
TRASH_SUFFIX = ".nvckpt-deleting"
#: Longest `latest` file we read; anything longer is garbage.
_MAX_LATEST_BYTES = 4096
#: Longest error text one rank sends (tracebacks can be huge).
_MAX_ERROR_CHARS = 2000
#: How many failing ranks a CommitError message lists by name.
_MAX_RANKS_SHOWN = 16
_MARKER_BYTES = b'{"format": "nvcomp_ckpt_engine.tag", "version": 1}\n'


# ---------------------------------------------------------------------------------------------
# Collectives.


@runtime_checkable
class Collective(Protocol):
    """What the commit needs from the job's ranks: gather small objects, and a barrier.

    Every rank calls the same methods in the same order (they are collectives). `step` names
    the step in error messages and keeps independent sequences apart. An implementation must
    return or raise `CommitError` within `timeout_s`, naming the ranks that did not arrive where
    it can tell; it must never wait forever. Objects are small JSON-able values.
    """

    rank: int
    world_size: int

    def all_gather_object(
        self, obj: Any, *, step: str = "gather", timeout_s: float | None = None
    ) -> list[Any]:
        """Every rank's `obj`, indexed by rank."""
        ...

    def barrier(self, *, step: str = "barrier", timeout_s: float | None = None) -> None:
        """Return once every rank has arrived."""
        ...

    def all_true(self, flag: bool, *, step: str = "all-true", timeout_s: float | None = None) -> bool:
        """Whether every rank's `flag` is true: the cheapest agreement, for polls at every
        training step (an async save asking whether every rank's files are written)."""
        ...


class LocalCollective:
    """The collective of a job with one rank: nothing to wait for."""

    rank = 0
    world_size = 1

    def all_gather_object(
        self, obj: Any, *, step: str = "gather", timeout_s: float | None = None
    ) -> list[Any]:
        return [obj]

    def barrier(self, *, step: str = "barrier", timeout_s: float | None = None) -> None:
        return None

    def all_true(self, flag: bool, *, step: str = "all-true", timeout_s: float | None = None) -> bool:
        return bool(flag)


class TorchDistributedCollective:
    """Collectives over torch.distributed, on a dedicated gloo group with a timeout.

    gloo whatever the training backend: object collectives on NCCL need GPU memory, and NCCL's
    timeouts abort the process rather than raise. Creating the group is itself a collective:
    the constructor does it when the process group is initialized (construct it on every rank
    at the same point, e.g. when the checkpoint engine is built), otherwise the first collective
    call does. Its timeout is `timeout_s` (default 1800 s), which bounds the gathers; barriers
    use each call's own timeout. Pass `group` to use an existing gloo group. Each gather is
    preceded by gloo's `monitored_barrier`, which names the ranks that did not arrive when it
    times out (on rank 0; the others learn that rank 0 gave up). A rank that dies closes its
    sockets first, and gloo then reports only a closed connection: so each rank also records its
    arrival at every step in the job's rendezvous store (MASTER_ADDR:MASTER_PORT, where one is
    reachable), and a failed step names the ranks whose arrival is missing. Without an
    initialized process group it behaves as `LocalCollective`.
    """

    def __init__(self, *, timeout_s: float | None = None, group: Any = None) -> None:
        import torch.distributed as dist  # lazily: nothing else in this module needs torch

        self._dist = dist
        self._timeout_s = None if timeout_s is None else float(timeout_s)
        self._group = group
        self._arrivals = 0
        self._previous_arrival: str | None = None
        self._store: Any = None
        if self.world_size > 1:
            self._gloo_group(self._timeout(None))
            self._store = _job_store(dist)

    @property
    def _initialized(self) -> bool:
        return self._dist.is_available() and self._dist.is_initialized()

    @property
    def rank(self) -> int:
        return self._dist.get_rank(self._group) if self._initialized else 0

    @property
    def world_size(self) -> int:
        return self._dist.get_world_size(self._group) if self._initialized else 1

    def _gloo_group(self, timeout_s: float) -> Any:
        if self._group is None:
            self._timeout_s = timeout_s if self._timeout_s is None else self._timeout_s
            try:
                self._group = self._dist.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=self._timeout_s)
                )
            except RuntimeError as exc:
                raise CommitError(
                    f"creating the gloo group for the commit failed (every rank must create "
                    f"it at the same point): {exc}"
                ) from exc
        return self._group

    def _timeout(self, timeout_s: float | None) -> float:
        if timeout_s is not None:
            return float(timeout_s)
        return 1800.0 if self._timeout_s is None else self._timeout_s

    def barrier(self, *, step: str = "barrier", timeout_s: float | None = None) -> None:
        if self.world_size == 1:
            return
        timeout = self._timeout(timeout_s)
        group = self._gloo_group(timeout)
        arrival = self._arrive(step)
        try:
            self._dist.monitored_barrier(
                group=group, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True
            )
        except RuntimeError as exc:
            raise CommitError(_torch_failure(step, timeout, exc, self._absent(arrival))) from exc
        self._forget_arrival(arrival)

    def all_true(self, flag: bool, *, step: str = "all-true", timeout_s: float | None = None) -> bool:
        """One all-reduce (MIN) of one integer on the gloo group: no barrier and no store keys,
        so a poll at every step costs one small round of messages. A rank that does not arrive
        fails it after the group's timeout (gloo names the peer it lost)."""
        if self.world_size == 1:
            return bool(flag)
        import torch

        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        try:
            self._dist.all_reduce(value, op=self._dist.ReduceOp.MIN,
                                  group=self._gloo_group(self._timeout(timeout_s)))
        except RuntimeError as exc:
            raise CommitError(_torch_failure(step, self._timeout(None), exc)) from exc
        return bool(value.item())

    def _forget_arrival(self, current: str) -> None:
        """Delete this rank's arrival key of the previous step: every rank has passed it (this
        step's barrier says so), so nobody needs it to name the absent any more. Without this a
        long job would leave world size × steps keys in the rendezvous store."""
        previous, self._previous_arrival = self._previous_arrival, current
        if previous is not None and self._store is not None:
            try:
                self._store.delete_key(f"{previous}/{self.rank}")
            except RuntimeError:  # best effort: a leftover key costs a few bytes in the store
                logger.debug("could not delete store key %s/%d", previous, self.rank, exc_info=True)

    def _arrive(self, step: str) -> str:
        """Record this rank's arrival at the next collective step in the job's store.

        gloo names the ranks missing from a barrier only when it times out; a rank that died
        closes its sockets first, and gloo then reports just a closed connection. The arrival
        keys let every rank name who never came. Best effort: without a reachable store the
        message says what gloo says.
        """
        self._arrivals += 1
        key = f"nvckpt-arrival/{self._arrivals}/{step}"
        if self._store is not None:
            try:
                self._store.set(f"{key}/{self.rank}", "1")
            except RuntimeError:
                self._store = None
        return key

    def _absent(self, key: str) -> list[int] | None:
        """Ranks whose arrival at `key` is not recorded (None: the store cannot say)."""
        if self._store is None:
            return None
        try:
            return [r for r in range(self.world_size) if not self._store.check([f"{key}/{r}"])]
        except RuntimeError:
            return None

    def all_gather_object(
        self, obj: Any, *, step: str = "gather", timeout_s: float | None = None
    ) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        self.barrier(step=step, timeout_s=timeout_s)
        out: list[Any] = [None] * self.world_size
        try:
            self._dist.all_gather_object(out, obj, group=self._group)
        except RuntimeError as exc:
            raise CommitError(_torch_failure(step, self._timeout(None), exc)) from exc
        return out


def _job_store(dist: Any) -> Any:
    """A client of the job's rendezvous store (MASTER_ADDR/MASTER_PORT), or None."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        return None
    try:
        return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=30))
    except (RuntimeError, ValueError) as exc:
        logger.info("no store for naming absent ranks (%s:%s): %s", host, port, exc)
        return None


def _torch_failure(
    step: str, timeout_s: float, exc: BaseException, absent: list[int] | None = None
) -> str:
    match = re.search(r"[Rr]anks? ([0-9][0-9, ]*) failed to pass monitoredBarrier", str(exc)) or \
        re.search(r"send/recv from rank ([0-9]+)", str(exc))
    if match:
        ranks = sorted({int(r) for r in re.findall(r"[0-9]+", match.group(1))})
        who = (
            f"rank(s) {ranks} did not arrive within {timeout_s:g} s (crashed, hung or still "
            "saving)"
        )
    elif absent:
        who = f"rank(s) {absent} never arrived (died, hung or still saving)"
    else:
        who = (
            f"a rank did not arrive or failed within {timeout_s:g} s (gloo does not say which "
            "here; rank 0's error names them)"
        )
    return f"collective step {step!r}: {who}: {exc}"


class MemoryStore:
    """A thread-safe in-memory key-value store with torch's `Store` methods that
    `StoreCollective` uses (set, get, check, wait, delete_key).

    For running many fake ranks as threads of one process (tests, single-process tools);
    across processes use torch.distributed's TCPStore or FileStore.
    """

    def __init__(self, *, timeout_s: float = 300.0) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._timeout_s = timeout_s

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        with self._cond:
            self._data[key] = data
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key], datetime.timedelta(seconds=self._timeout_s))
        with self._cond:
            return self._data[key]

    def check(self, keys: Sequence[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        limit = self._timeout_s if timeout is None else timeout.total_seconds()
        with self._cond:
            if not self._cond.wait_for(lambda: all(k in self._data for k in keys), limit):
                missing = [k for k in keys if k not in self._data]
                raise TimeoutError(f"keys {missing} not set within {limit:g} s")

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None


class StoreCollective:
    """Collectives over a key-value store (torch's TCPStore/FileStore/HashStore, or MemoryStore).

    Each rank sets one key per step and waits for the others' keys, so a rank that does not
    arrive is named exactly (the keys that are still missing), and no process group is needed:
    it also works from a background thread, where a collective on the training group could
    deadlock against the training step. Values are JSON, never pickles. Every rank deletes its
    own key of step k once step k+1 completes (by then every rank has read it).
    """

    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        world_size: int,
        prefix: str = "nvcomp_ckpt_engine/commit",
        timeout_s: float = 600.0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self._store = store
        self.rank = rank
        self.world_size = world_size
        self._prefix = prefix
        self._timeout_s = float(timeout_s)
        self._seq = 0
        self._previous_key: str | None = None

    def all_gather_object(
        self, obj: Any, *, step: str = "gather", timeout_s: float | None = None
    ) -> list[Any]:
        timeout = self._timeout_s if timeout_s is None else float(timeout_s)
        keys = [f"{self._prefix}/{self._seq}/{step}/{r}" for r in range(self.world_size)]
        self._seq += 1
        self._store.set(keys[self.rank], json.dumps(obj).encode())
        self._wait(keys, step, timeout)
        values = [json.loads(self._store.get(key)) for key in keys]
        self._forget_previous(keys[self.rank])
        return values

    def barrier(self, *, step: str = "barrier", timeout_s: float | None = None) -> None:
        self.all_gather_object(None, step=step, timeout_s=timeout_s)

    def all_true(self, flag: bool, *, step: str = "all-true", timeout_s: float | None = None) -> bool:
        return all(self.all_gather_object(bool(flag), step=step, timeout_s=timeout_s))

    def _wait(self, keys: list[str], step: str, timeout_s: float) -> None:
        try:
            self._store.wait(keys, datetime.timedelta(seconds=timeout_s))
            return
        except Exception as exc:  # stores raise different types on a timeout
            error = exc
        try:
            missing = [r for r, key in enumerate(keys) if not self._store.check([key])]
        except Exception as exc:
            raise CommitError(f"collective step {step!r}: the store failed: {exc}") from error
        if not missing:
            raise CommitError(f"collective step {step!r}: the store failed: {error}") from error
        raise CommitError(
            f"collective step {step!r}: rank(s) {_ranks_text(missing)} did not arrive within "
            f"{timeout_s:g} s (crashed, hung or still saving)"
        ) from error

    def _forget_previous(self, current: str) -> None:
        if self._previous_key is not None:
            try:
                self._store.delete_key(self._previous_key)
            except Exception:  # best effort: a leftover key costs a few bytes in the store
                logger.debug("could not delete store key %s", self._previous_key, exc_info=True)
        self._previous_key = current


def _ranks_text(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:_MAX_RANKS_SHOWN])
    more = len(ranks) - _MAX_RANKS_SHOWN
    return f"[{shown}{f', and {more} more' if more > 0 else ''}]"


# ---------------------------------------------------------------------------------------------
# Preparing a tag folder.


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """Where one rank writes its files for one save (from `prepare_tag_dir`).

    `staging_suffix` is None for a fresh tag: files go to their final names. For a re-save of a
    tag that has a manifest it is this rank's random suffix, and files go to `<path><suffix>`
    until the commit renames them (see the module docstring).
    """

    save_dir: Path
    tag: str
    tag_dir: Path
    rank: int
    staging_suffix: str | None

    def record_path(self, path: str | os.PathLike) -> str:
        """`path` (as DeepSpeed passes it, under the tag folder) relative to the tag folder."""
        relative = os.path.relpath(os.path.abspath(path), os.path.abspath(self.tag_dir))
        return validate_relative_path(Path(relative).as_posix())

    def write_path(self, path: str | os.PathLike) -> Path:
        """Where to write the file DeepSpeed asked for at `path` in this save."""
        final = self.tag_dir / self.record_path(path)
        if self.staging_suffix is None:
            return final
        return final.with_name(final.name + self.staging_suffix)


def prepare_tag_dir(
    save_dir: str | os.PathLike,
    tag: str,
    *,
    rank: int,
    leader: bool | None = None,
    durable: bool = True,
) -> SavePlan:
    """Create the tag folder if needed and decide how this rank writes into it.

    Every rank calls it in the engine's `create`. There is no barrier after it, so it never
    deletes anything (another rank may already be writing), and every rank makes sure the
    folder carries the marker that tells `apply_retention` the folder is the engine's before it
    writes anything there: whatever a crash leaves, no file of ours sits in an unmarked folder.
    (Usually one rank writes the marker and the others see it; a race writes it twice, the same
    bytes, atomically.) `leader` (default: rank 0; with node-local storage, each node's local
    rank 0) also makes the folder's own directory entry durable.
    """
    tag = validate_tag(tag)
    save_dir = Path(save_dir)
    tag_dir = save_dir / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    marker = tag_dir / TAG_MARKER_NAME
    if not marker.exists():
        storage.atomic_write_bytes(marker, _MARKER_BYTES, durable=durable)
    if rank == 0 if leader is None else leader:
        if durable:
            storage.fsync_dir(tag_dir.parent)
            if tag_dir.parent != save_dir:
                storage.fsync_dir(save_dir)
    suffix = None
    if os.path.lexists(tag_dir / MANIFEST_NAME):
        suffix = f".nvckpt-stage-r{rank}-{secrets.token_hex(6)}"
        logger.info(
            "%s already has a manifest: rank %d writes under staged names (suffix %s) so the "
            "existing checkpoint stays loadable until this save commits", tag_dir, rank, suffix,
        )
    return SavePlan(save_dir=save_dir, tag=tag, tag_dir=tag_dir, rank=rank, staging_suffix=suffix)


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
    plan: SavePlan | None = None,
    error: BaseException | str | None = None,
    step: int | None = None,
    versions: Mapping[str, str] | None = None,
    node_local_storage: bool = False,
    node: str | None = None,
) -> CommitResult:
    """Commit one checkpoint: called by every rank once its files are durable.

    `my_records` are this rank's files (their `rank` must be this rank); `error`, if given, is
    why this rank's save failed, and makes every rank raise. `plan` is this rank's
    `prepare_tag_dir` result (without it a re-save overwrites files in place). `layout` (dp/tp/pp
    sizes, ZeRO stage, ...; rank 0's is recorded) and `versions` go into the manifest. Each
    collective step waits at most `timeout_s`. With `node_local_storage`, the first rank of
    each node (by `node`, default this host's name) writes the manifest into its node's folder.

    Returns the committed manifest and its totals, the same on every rank (`staged`: this was a
    re-save, whose files were renamed into place). Raises CommitError on every rank if
    any rank failed, disagreed or did not arrive, or if the manifest could not be written; the
    message names the ranks and their errors.
    """
    tag_dir = Path(tag_dir)
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
    if rank in _manifest_writers(reports, node_local_storage):
        outcome = _write_global_manifest(tag_dir, manifest, durable)
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
    tag_dir: Path,
    tag: str,
    my_records: Iterable[ShardRecord],
    rank: int,
    world_size: int,
    plan: SavePlan | None,
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
    tag_dir: Path, records: list[ShardRecord], rank: int, suffix: str | None
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
            size = os.stat(path).st_size
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
    shown = "; ".join(f"rank {r}: {problems[r]}" for r in ranks[:_MAX_RANKS_SHOWN])
    more = len(ranks) - _MAX_RANKS_SHOWN
    return (
        f"commit of checkpoint {tag!r} failed on {len(ranks)} of {world_size} ranks "
        f"{_ranks_text(ranks)}: {shown}{f'; and {more} more' if more > 0 else ''}. "
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


def _write_global_manifest(tag_dir: Path, manifest: Manifest, durable: bool) -> str | None:
    """Write the manifest (the commit point); the error text, or None.

    Catches everything: an exception here must reach the other ranks through "publish", not
    leave them waiting for a rank that died in its own error handling.
    """
    try:
        write_manifest(tag_dir, manifest, durable=durable)
        if durable:
            storage.fsync_dir(tag_dir.parent)
    except Exception as exc:
        logger.error("writing the manifest of %s failed", tag_dir, exc_info=True)
        return _describe_error(exc)
    logger.info(
        "committed %s: %d files, %d bytes on disk for %d raw bytes",
        tag_dir, len(manifest.files), manifest.file_bytes, manifest.raw_bytes,
    )
    return None


def _finish_own_renames(
    tag_dir: Path, records: list[dict[str, Any]], suffix: str, durable: bool
) -> str | None:
    try:
        _rename_staged(tag_dir, [r["path"] for r in records], suffix, durable)
    except Exception as exc:
        logger.error("renaming staged files in %s failed", tag_dir, exc_info=True)
        return _describe_error(exc)
    return None


def _rename_staged(tag_dir: Path, paths: Iterable[str], suffix: str, durable: bool) -> int:
    """Rename `<path><suffix>` over `<path>` where it still exists; idempotent."""
    renamed, folders = 0, set()
    for path in paths:
        final = tag_dir / path
        try:
            os.replace(final.with_name(final.name + suffix), final)
        except FileNotFoundError:
            continue  # already renamed (by us earlier, or by another rank's recovery)
        renamed += 1
        folders.add(final.parent)
    if durable:
        for folder in sorted(folders):
            storage.fsync_dir(folder)
    return renamed


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
    tag_dir = Path(tag_dir)
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


# ---------------------------------------------------------------------------------------------
# latest.


@dataclasses.dataclass(frozen=True)
class LatestPointer:
    """What `save_dir/latest` says: a usable tag, or None and why not."""

    tag: str | None
    reason: str


def inspect_latest(save_dir: str | os.PathLike) -> LatestPointer:
    """Read `latest`; unusable when missing, empty, garbage or naming a missing folder.

    The file is not required to name a *complete* checkpoint here; `resolve_load_tag` checks.
    """
    path = Path(save_dir) / LATEST_NAME
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return LatestPointer(None, f"{path} does not exist")
    except OSError as exc:
        return LatestPointer(None, f"{path} cannot be read: {exc}")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return LatestPointer(None, f"{path} is not a regular file")
        data = os.read(fd, _MAX_LATEST_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_LATEST_BYTES:
        return LatestPointer(None, f"{path} is longer than {_MAX_LATEST_BYTES} bytes: not a tag")
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
    if not (Path(save_dir) / tag).is_dir():
        return LatestPointer(None, f"{path} names tag {tag!r}, but there is no such folder")
    return LatestPointer(tag, "")


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
    storage.atomic_write_bytes(
        Path(save_dir) / name, validate_tag(tag).encode("utf-8"), durable=durable
    )


# ---------------------------------------------------------------------------------------------
# Finding and resolving checkpoints.


@dataclasses.dataclass(frozen=True)
class _TagState:
    tag: str
    path: Path
    manifest: Manifest | None
    complete: bool
    problem: str


def _tag_folders(save_dir: Path) -> list[tuple[str, Path]]:
    """Top-level folders of save_dir that may be tags (not the engine's trash or temp names)."""
    try:
        entries = list(os.scandir(save_dir))
    except FileNotFoundError:
        return []
    return sorted(
        (entry.name, Path(entry.path))
        for entry in entries
        if RESERVED_MARK not in entry.name and entry.is_dir()
    )


def _tag_state(
    tag: str, path: Path, *, local_only: bool, check_crc: bool,
    crc_of: Callable[[Path], int | None] | None = None,
) -> _TagState:
    try:
        manifest = read_manifest(path)
    except CheckpointError as exc:
        return _TagState(tag, path, None, False, str(exc))
    try:
        verify_files(
            path, manifest, check_crc=check_crc, crc_of=crc_of, local_only=local_only,
            allow_pending=True,
        )
    except CheckpointError as exc:
        return _TagState(tag, path, manifest, False, str(exc))
    return _TagState(tag, path, manifest, True, "")


def _newest_first(states: Iterable[_TagState]) -> list[_TagState]:
    def key(state: _TagState) -> tuple[int, int, str]:
        manifest = state.manifest
        step = -1 if manifest.step is None else manifest.step
        return (manifest.created_unix_ns, step, state.tag)

    return sorted((s for s in states if s.manifest is not None), key=key, reverse=True)


def _complete_states(save_dir: Path, *, local_only: bool, check_crc: bool) -> list[_TagState]:
    states = [
        _tag_state(tag, path, local_only=local_only, check_crc=check_crc)
        for tag, path in _tag_folders(save_dir)
    ]
    return _newest_first(s for s in states if s.complete)


def find_complete_checkpoints(
    save_dir: str | os.PathLike, *, local_only: bool = False, check_crc: bool = False
) -> list[str]:
    """Tags of the complete checkpoints in save_dir, newest first (by the manifests' creation
    time, then step, then tag). Complete: a valid manifest whose files exist with the right
    sizes (and CRCs with `check_crc`). Only top-level folders are considered."""
    states = _complete_states(Path(save_dir), local_only=local_only, check_crc=check_crc)
    return [s.tag for s in states]


@dataclasses.dataclass(frozen=True)
class _Checks:
    """How far a candidate checkpoint's files are checked beyond their sizes (see
    `resolve_load_tag`)."""

    local_only: bool
    check_crc: bool
    crc_of: Callable[[Path], int | None] | None

    def state(self, tag: str, path: Path) -> _TagState:
        return _tag_state(tag, path, local_only=self.local_only, check_crc=self.check_crc,
                          crc_of=self.crc_of)

    def newest_intact(self, save_dir: Path, exclude: Iterable[str] = ()) -> _TagState | None:
        """The newest complete checkpoint whose files also pass these checks. Sizes are checked
        for every tag (a stat per file); CRCs newest first, only until one passes."""
        skip = set(exclude)
        for state in _complete_states(save_dir, local_only=self.local_only, check_crc=False):
            if state.tag in skip:
                continue
            if not (self.check_crc or self.crc_of):
                return state
            checked = self.state(state.tag, state.path)
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
    crc_of: Callable[[Path], int | None] | None = None,
) -> str | None:
    """The tag of the newest complete checkpoint in save_dir, other than `exclude`, whose files
    pass the checks `resolve_load_tag` describes; None if there is none."""
    state = _Checks(local_only, check_crc, crc_of).newest_intact(Path(save_dir), exclude)
    return None if state is None else state.tag


def resolve_load_tag(
    save_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    fallback_to_complete: bool = False,
    local_only: bool = False,
    check_crc: bool = False,
    crc_of: Callable[[Path], int | None] | None = None,
) -> str:
    """The tag to load, checked complete, with any interrupted re-save's renames completed.

    With `tag`, that tag or IncompleteCheckpointError (never a substitute: it was asked for by
    name). Without, the tag `latest` names if that checkpoint is complete; if `latest` is
    unusable or names an incomplete or damaged checkpoint, the newest intact checkpoint when
    `fallback_to_complete` is true (with a warning naming it), else IncompleteCheckpointError
    naming it and the option. Every rank may call it; it only reads, except to complete renames.

    A checkpoint is complete when its manifest is valid and its files have the recorded sizes;
    the checkpoint chosen is also checked further: every byte against the recorded CRC-32 with
    `check_crc`, else, with `crc_of`, each file's CRC-32 as `crc_of` gives it without reading
    the file (a shard's index records it: a damaged index, header or trailer is found so).
    """
    save_dir = Path(save_dir)
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
    pointer = inspect_latest(save_dir)
    if pointer.tag is not None:
        state = checks.state(pointer.tag, save_dir / pointer.tag)
        if state.complete:
            _note_newer(save_dir, state, local_only)
            return _ready(state)
        problem = f"latest names {pointer.tag!r}, which is not complete: {state.problem}"
    else:
        problem = pointer.reason
    intact = checks.newest_intact(save_dir, exclude=[pointer.tag] if pointer.tag else [])
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


def _ready(state: _TagState) -> str:
    finish_pending_renames(state.path, state.manifest)
    return state.tag


def _newest_hint(checks: _Checks, save_dir: Path, tag: str) -> str:
    intact = checks.newest_intact(save_dir, exclude=[tag])
    return f"; the newest complete checkpoint is {intact.tag!r}" if intact is not None else ""


def _note_newer(save_dir: Path, state: _TagState, local_only: bool) -> None:
    complete = _complete_states(save_dir, local_only=local_only, check_crc=False)
    if complete and complete[0].tag != state.tag and (
        complete[0].manifest.created_unix_ns > state.manifest.created_unix_ns
    ):
        logger.warning(
            "latest names %r, but %r in %s is a newer complete checkpoint (a crash between its "
            "commit and the update of latest, or latest set back by hand); loading %r as latest "
            "says: pass tag=%r to load the newer one",
            state.tag, complete[0].tag, save_dir, state.tag, complete[0].tag,
        )


# ---------------------------------------------------------------------------------------------
# Retention.


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
) -> RetentionReport:
    """Keep the newest `keep_last` complete checkpoints; delete older ones and provable debris.

    Never deletes: the tag `latest` names, tags in `protect` (pass the one just committed and
    any being written), folders without a valid manifest of ours unless they are provably
    failed saves of ours (no manifest file at all, our marker, only regular files, older than
    the newest complete checkpoint), symlinks, or anything when there are fewer than
    `keep_last` complete checkpoints. A folder is renamed to a hidden trash name before its contents are deleted, so
    a crash mid-way leaves nothing that looks like a checkpoint; the next call finishes it.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    save_dir = Path(save_dir)
    # Only compared with folder names, so a None or a garbage entry (say, from an unusable
    # latest file) protects nothing and harms nothing.
    protected = {t for t in protect if isinstance(t, str)}
    latest = read_latest(save_dir)
    if latest is not None:
        protected.add(latest)
    removed = _finish_trash(save_dir)
    states = [
        _tag_state(tag, path, local_only=local_only, check_crc=False)
        for tag, path in _tag_folders(save_dir)
    ]
    complete = _newest_first(s for s in states if s.complete)
    kept = complete[:keep_last]
    sweep = _Sweep(
        save_dir=save_dir,
        protected=frozenset(protected),
        kept=frozenset(s.tag for s in kept),
        # Tags older than the oldest kept go; with too few complete ones, none do.
        cutoff_ns=kept[-1].manifest.created_unix_ns if len(complete) >= keep_last else None,
        newest_ns=complete[0].manifest.created_unix_ns if complete else None,
    )
    deleted: list[str] = []
    left: list[str] = []
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

    save_dir: Path
    protected: frozenset[str]
    kept: frozenset[str]
    cutoff_ns: int | None
    newest_ns: int | None

    def apply(self, state: _TagState) -> tuple[list[str], list[str], list[str]]:
        """(tags deleted, leftover files removed, things left alone and why) for one folder."""
        if state.tag in self.protected:
            return [], [], _report_leftovers(state) if state.manifest is not None else []
        if state.path.is_symlink():  # never deleted, nor cleaned: it points somewhere else
            note = [] if state.tag in self.kept else [f"{state.tag}: a symlink, never deleted"]
            return [], [], note
        if state.tag in self.kept:
            return [], _remove_leftovers(state), []
        if state.manifest is not None:
            if self.cutoff_ns is not None and state.manifest.created_unix_ns < self.cutoff_ns:
                _remove_tag(self.save_dir, state.tag, "older than the ones kept")
                return [state.tag], [], []
            return [], _remove_leftovers(state), []
        if self.newest_ns is None or _mtime_ns(state.path) >= self.newest_ns:
            return [], [], []  # no manifest, but maybe a save in flight: not ours to judge
        why_not = _why_not_ours(state.path)
        if why_not is None:
            _remove_tag(self.save_dir, state.tag, "a failed save of ours: no valid manifest")
            return [state.tag], [], []
        logger.warning(
            "%s has no valid manifest (%s) but is left alone: %s",
            state.path, state.problem, why_not,
        )
        return [], [], [f"{state.tag}: no valid manifest, {why_not}"]


def _mtime_ns(path: Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def _why_not_ours(tag_dir: Path) -> str | None:
    """None if `tag_dir` holds only what one of our failed saves leaves behind.

    That is: no manifest (a save publishes it, atomically, only once it is complete: one that
    cannot be read, damaged or of another version, may still describe a whole checkpoint),
    only regular files, and either our marker (every rank writes it before any file) or
    nothing but our own temp and staged files (a crash before the marker was written).
    """
    if os.path.lexists(tag_dir / MANIFEST_NAME):
        return (
            f"it holds a {MANIFEST_NAME} that cannot be read, so it may be a complete "
            "checkpoint (a failed save never publishes one)"
        )
    entries = list(os.scandir(tag_dir))
    for entry in entries:
        if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            return f"it holds {entry.name!r}, which is not a regular file"
    if (tag_dir / TAG_MARKER_NAME).is_file():
        return None
    foreign = [e.name for e in entries if RESERVED_MARK not in e.name]
    if foreign:
        return (
            f"it has no {TAG_MARKER_NAME} marker and holds {foreign[0]!r}, so nvcomp_ckpt_engine "
            "did not create it"
        )
    return None


def _remove_tag(save_dir: Path, tag: str, why: str) -> None:
    tag_dir = save_dir / tag
    trash = tag_dir.with_name(f".{tag_dir.name}{TRASH_SUFFIX}")
    if os.path.lexists(trash):
        shutil.rmtree(trash)
    os.rename(tag_dir, trash)
    storage.fsync_dir(tag_dir.parent)
    logger.info("retention: deleting %s (%s)", tag_dir, why)
    shutil.rmtree(trash)


def _finish_trash(save_dir: Path) -> list[str]:
    removed = []
    for name in sorted(os.listdir(save_dir)) if save_dir.is_dir() else []:
        path = save_dir / name
        if name.endswith(TRASH_SUFFIX) and path.is_dir() and not path.is_symlink():
            logger.info("retention: finishing the deletion of %s", path)
            shutil.rmtree(path)
            removed.append(name)
    return removed


def _leftovers(state: _TagState) -> list[Path]:
    """Our temp files, and staged files the manifest does not need, anywhere in the folder."""
    wanted = set(state.manifest.pending.values()) if state.manifest else set()
    found = []
    for folder, dirnames, filenames in os.walk(state.path):
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(folder, d))]
        for name in filenames:
            stage = STAGE_SUFFIX_RE.search(name)
            if name.endswith(storage.PARTIAL_SUFFIX) or (
                stage is not None and stage.end() == len(name) and stage.group(0) not in wanted
            ):
                found.append(Path(folder) / name)
    return sorted(found)


def _report_leftovers(state: _TagState) -> list[str]:
    return [
        f"{path.relative_to(state.path.parent)}: leftover in protected tag {state.tag!r}"
        for path in _leftovers(state)
    ]


def _remove_leftovers(state: _TagState) -> list[str]:
    removed = []
    for path in _leftovers(state):
        logger.info("retention: removing leftover %s of an interrupted write", path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(str(path.relative_to(state.path.parent)))
    return removed


def _remove_save_dir_temps(save_dir: Path) -> list[str]:
    """Temp files of interrupted atomic writes of `latest` (or of anything else we write there)."""
    removed = []
    for name in sorted(os.listdir(save_dir)) if save_dir.is_dir() else []:
        path = save_dir / name
        if name.endswith(storage.PARTIAL_SUFFIX) and path.is_file() and not path.is_symlink():
            logger.info("retention: removing leftover %s of an interrupted write", path)
            os.unlink(path)
            removed.append(name)
    return removed


__all__ = [
    "Collective",
    "CommitResult",
    "LATEST_NAME",
    "LatestPointer",
    "LocalCollective",
    "MemoryStore",
    "RetentionReport",
    "SavePlan",
    "StoreCollective",
    "TorchDistributedCollective",
    "apply_retention",
    "commit_checkpoint",
    "find_complete_checkpoints",
    "finish_pending_renames",
    "inspect_latest",
    "newest_intact_checkpoint",
    "prepare_tag_dir",
    "read_latest",
    "resolve_load_tag",
    "write_latest",
]
