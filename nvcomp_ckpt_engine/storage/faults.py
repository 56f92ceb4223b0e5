"""A storage that fails on purpose: the place crash-consistency tests plug their faults in.

`FaultyStorage(inner, Fault("finish", nth=2))` behaves as `inner` until the second `finish` of a
sink, which then fails. A fault either raises an error the engine must handle (`error`, an
OSError by default: a full disk, a lost mount) or simulates a crash (`crash=True`): it raises
`SimulatedCrash`, a BaseException no `except Exception` handler catches, and from then on the
storage is dead: every later call raises `SimulatedCrash` again and `abort`/`close` do nothing,
so no clean-up runs, as when a process is killed. `after=True` places the fault just after the
operation took effect (a crash between a shard's rename and its return, a manifest published
but not acknowledged); `tear=True` on an append lets half of its bytes land first (a torn
write); `action` runs a callable instead (a real kill, a stall). Faults name an operation and,
optionally, a key pattern (`fnmatch`).

Several storages share one `FaultPlan` (its counters, its log, its crash): a job whose modules
each open their own storage is faulted as one process by `wrap_storages(plan.wrap)`.

Operations: the `Storage` methods by name (``"open_sink"``, ``"publish"``, ``"rename"``,
``"sync_prefix"`` (the fsync of a folder), ``"delete"``, ``"delete_prefix"``, ``"read_small"``,
``"open_reader"``, ``"stat"``, ``"list"``, ``"ensure_prefix"``), a sink's ``"append"``,
``"finish"`` and a reader's ``"read_into"``. A rename is logged and matched by its destination.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Iterator

from .base import ObjectInfo, Reader, Sink, Storage


class SimulatedCrash(BaseException):
    """The process 'died' here (a `FaultyStorage` crash fault)."""


@dataclasses.dataclass
class Fault:
    """Fail the `nth` call (1-based, counting only calls that match) of `op` (or of any of a
    tuple of ops) on keys matching `key`. `crash`: raise `SimulatedCrash` and kill the storage; `action`: call it (and go on
    with the operation if it returns); else raise `error` (an OSError naming the key if None).
    `after`: let the operation take effect first. `tear` (appends): half the bytes land first
    (for a crash, an error or a kill: an `action` that returns would let the whole append follow)."""

    op: str | tuple[str, ...]
    nth: int = 1
    key: str = "*"
    crash: bool = False
    after: bool = False
    tear: bool = False
    error: BaseException | None = None
    action: Callable[[], None] | None = None
    seen: int = dataclasses.field(default=0, init=False)
    fired: bool = dataclasses.field(default=False, init=False)


class FaultPlan:
    """Faults, their counters, the log of every (operation, key) in order, and whether the
    simulated process has crashed: shared by every storage it wraps."""

    def __init__(self, *faults: Fault) -> None:
        self.faults = list(faults)
        self.calls: list[tuple[str, str]] = []
        self.dead = False

    def wrap(self, inner: Storage) -> "FaultyStorage":
        return FaultyStorage(inner, plan=self)

    def due(self, op: str, key: str) -> Fault | None:
        if self.dead:
            raise SimulatedCrash(f"{op} {key!r} after the simulated crash")
        self.calls.append((op, key))
        for fault in self.faults:
            ops = (fault.op,) if isinstance(fault.op, str) else fault.op
            if op in ops and not fault.fired and fnmatch.fnmatchcase(key, fault.key):
                fault.seen += 1
                if fault.seen == fault.nth:
                    fault.fired = True
                    return fault
        return None

    def fire(self, fault: Fault, op: str, where: str) -> None:
        if fault.action is not None:
            fault.action()
            return
        if fault.crash:
            self.dead = True
            raise SimulatedCrash(f"simulated crash {'after' if fault.after else 'at'} {op} of {where}")
        raise fault.error if fault.error is not None else OSError(f"{where}: injected failure of {op}")


class FaultyStorage(Storage):
    """`inner` with `faults` injected (or a shared `plan`'s); `calls` logs every (operation,
    key) in order."""

    def __init__(self, inner: Storage, *faults: Fault, plan: FaultPlan | None = None) -> None:
        self.inner = inner
        self.plan = plan if plan is not None else FaultPlan(*faults)
        self.url, self.capabilities = inner.url, inner.capabilities

    @property
    def calls(self) -> list[tuple[str, str]]:
        return self.plan.calls

    @property
    def dead(self) -> bool:
        return self.plan.dead

    def describe(self, key: str = "") -> str:
        return self.inner.describe(key)

    def local_path(self, key: str = "") -> str:
        return self.inner.local_path(key)

    def prefetch(self, keys: list[str], limit_bytes: int) -> None:
        self.inner.prefetch(keys, limit_bytes)

    # ------------------------------------------------------------------------- the faults

    def _run(self, op: str, key: str, call: Callable[[], Any], before: Callable[[], Any] | None = None) -> Any:
        fault = self.plan.due(op, key)
        if fault is not None and not fault.after:
            if fault.tear and before is not None:
                before()
            self.plan.fire(fault, op, self.describe(key))
        result = call()
        if fault is not None and fault.after:
            self.plan.fire(fault, op, self.describe(key))
        return result

    # --------------------------------------------------------------------- the interface

    def check(self) -> None:
        """The wrapped storage's own check (an object store's endpoint, credentials, bucket), so a
        job under a fault plan fails at start as it would without one; a fault on "check" fires."""
        self._run("check", "", self.inner.check)

    def open_sink(self, key: str, *, durable: bool = True, direct: bool = False) -> Sink:
        return _FaultySink(self, key, self._run("open_sink", key, lambda: self.inner.open_sink(
            key, durable=durable, direct=direct)))

    def open_reader(self, key: str) -> Reader:
        return _FaultyReader(self, key, self._run("open_reader", key, lambda: self.inner.open_reader(key)))

    def read_small(self, key: str, limit: int, *, what: str = "this object") -> bytes:
        return self._run("read_small", key, lambda: self.inner.read_small(key, limit, what=what))

    def publish(self, key: str, data: bytes, *, durable: bool = True, if_absent: bool = False) -> None:
        self._run("publish", key, lambda: self.inner.publish(key, data, durable=durable, if_absent=if_absent))

    def stat(self, key: str) -> ObjectInfo:
        return self._run("stat", key, lambda: self.inner.stat(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return iter(self._run("list", prefix, lambda: list(self.inner.list(prefix))))

    def delete(self, key: str) -> None:
        self._run("delete", key, lambda: self.inner.delete(key))

    def delete_prefix(self, prefix: str) -> None:
        self._run("delete_prefix", prefix, lambda: self.inner.delete_prefix(prefix))

    def ensure_prefix(self, prefix: str) -> None:
        self._run("ensure_prefix", prefix, lambda: self.inner.ensure_prefix(prefix))

    def sync_prefix(self, prefix: str = "") -> None:
        self._run("sync_prefix", prefix, lambda: self.inner.sync_prefix(prefix))

    def rename(self, src: str, dst: str) -> None:
        self._run("rename", dst, lambda: self.inner.rename(src, dst))  # known by where it lands


class _FaultySink(Sink):
    def __init__(self, storage: FaultyStorage, key: str, inner: Sink) -> None:
        self.storage, self.key, self.inner = storage, key, inner

    def __getattr__(self, name: str) -> Any:  # a backend's extras (PosixSink.direct)
        return getattr(self.inner, name)

    def append(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        return self.storage._run("append", self.key, lambda: self.inner.append(view),
                                 before=lambda: self.inner.append(view[: len(view) // 2]))

    def finish(self) -> int:
        return self.storage._run("finish", self.key, self.inner.finish)

    def abort(self) -> None:
        if not self.storage.dead:  # a dead process cleans nothing up
            self.inner.abort()


class _FaultyReader(Reader):
    def __init__(self, storage: FaultyStorage, key: str, inner: Reader) -> None:
        self.storage, self.key, self.inner, self.size = storage, key, inner, inner.size

    def read_into(self, offset: int, buffer: memoryview) -> None:
        self.storage._run("read_into", self.key, lambda: self.inner.read_into(offset, buffer))

    def advise_sequential(self) -> None:
        self.inner.advise_sequential()

    def close(self) -> None:
        self.inner.close()
