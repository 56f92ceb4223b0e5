"""Collectives for the commit: how the job's ranks gather small objects and agree, with timeouts.

The commit (`commit.py`) needs every rank to exchange a report and learn every other rank's
outcome, and it must never wait forever for a rank that died. `Collective` is that contract;
`LocalCollective` is a job of one rank, `TorchDistributedCollective` runs over torch.distributed
(a dedicated gloo group, with the job's rendezvous store naming absent ranks), and
`StoreCollective` runs over any key-value store (`MemoryStore` for fake ranks in one process).
Every failure is a `CommitError` that names the ranks at fault where the transport can tell.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from .errors import CommitError

logger = logging.getLogger(__name__)

#: How many ranks an error message lists by name.
MAX_RANKS_SHOWN = 16

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
    arrival at every step in the job's rendezvous store (the default process group's), and a
    failed step names the ranks whose arrival is missing. Without an
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

    def for_background(self, prefix: str) -> Collective:
        """A collective of the same ranks for a background thread: over the job's store
        (`StoreCollective`, keys under `prefix`, unique per use), which a thread may use while
        the training thread runs collectives on the process groups."""
        if self.world_size == 1:
            return LocalCollective()
        if self._store is None:
            raise CommitError("no store of the job's process group to agree on from a background "
                              "thread")
        return StoreCollective(self._store, rank=self.rank, world_size=self.world_size,
                               prefix=prefix, timeout_s=self._timeout(None))

    def gloo_group(self) -> Any:
        """The gloo group the collectives use (made at the first collective, on every rank):
        for point-to-point transfers of CPU buffers beside them (`tiers.transfer`)."""
        return self._gloo_group(self._timeout(None))

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
    """The store the job's default process group was initialized with, or None.

    It is the job's rendezvous (the launcher's TCPStore, or the FileStore of a ``file://``
    init_method), reached without a new connection. Connecting to MASTER_ADDR:MASTER_PORT
    instead would wait for a server that a ``file://`` job never starts (torch's client retries
    for its whole timeout), or reach another job's store on that port."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError) as exc:  # torch's private accessor
        logger.info("no store for naming absent ranks: %s", exc)
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
            f"collective step {step!r}: rank(s) {ranks_text(missing)} did not arrive within "
            f"{timeout_s:g} s (crashed, hung or still saving)"
        ) from error

    def _forget_previous(self, current: str) -> None:
        if self._previous_key is not None:
            try:
                self._store.delete_key(self._previous_key)
            except Exception:  # best effort: a leftover key costs a few bytes in the store
                logger.debug("could not delete store key %s", self._previous_key, exc_info=True)
        self._previous_key = current


def ranks_text(ranks: Sequence[int]) -> str:
    """`ranks` for an error message: the first `MAX_RANKS_SHOWN`, then how many more."""
    shown = ", ".join(str(r) for r in ranks[:MAX_RANKS_SHOWN])
    more = len(ranks) - MAX_RANKS_SHOWN
    return f"[{shown}{f', and {more} more' if more > 0 else ''}]"


__all__ = [
    "Collective",
    "LocalCollective",
    "MAX_RANKS_SHOWN",
    "MemoryStore",
    "StoreCollective",
    "TorchDistributedCollective",
    "ranks_text",
]
