"""One verdict on a load, on every rank: a load that fails on some ranks fails on all of them.

A distributed load reads different files on different ranks (each rank its own ZeRO shard), so
a damaged or missing file, a refused layout or a codec missing on one node fails the load on
some ranks only. A rank that raises then never reaches the collectives the others wait in next
(or they return and train on alone). So the ranks agree at points every rank reaches, failed or
not: each brings what went wrong on it (a `Fault`: its rank, the error's type and message, the
file it was reading), `agree` gathers them (`collectives`, with timeouts that name absent
ranks), and every rank raises the same error: the type of the fault of the lowest failing rank
(one of `errors`' types; `CheckpointError` for any other, unless every rank raised that same
error: then each raises its own, as it would alone), naming that rank and its file. An
error raised by a verdict carries its fault (`fault`), so a later agreement, or a rank that
learnt of the failure from another exchange, reports the original fault, not itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from . import errors
from .collectives import MAX_RANKS_SHOWN, Collective, ranks_text
from .errors import CheckpointError, CommitError

#: How much of one rank's error message travels to the others.
MAX_MESSAGE_CHARS = 4000

#: Faults of these types say that a checkpoint's bytes are damaged, missing or undecodable:
#: another checkpoint may load (`"fallback_to_complete"`). The others (a layout, a kind or a class
#: refused, a codec this node lacks) are about the job, and an older checkpoint is no fix.
DAMAGE_KINDS = frozenset({"CorruptCheckpointError", "IncompleteCheckpointError", "CodecError"})


@dataclasses.dataclass(frozen=True)
class Fault:
    """What went wrong on one rank: the error's type name and message, and the file it read."""

    rank: int
    kind: str
    message: str
    path: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: Any, sender: int) -> Fault:
        """A fault as another rank sent it; anything malformed is that rank's fault too."""
        if (isinstance(doc, dict) and isinstance(doc.get("rank"), int)
                and isinstance(doc.get("kind"), str) and isinstance(doc.get("message"), str)
                and isinstance(doc.get("path"), (str, type(None)))):
            return cls(doc["rank"], doc["kind"], doc["message"], doc["path"])
        return cls(sender, "CheckpointError", f"sent {type(doc).__name__}, not a load outcome")

    @property
    def damage(self) -> bool:
        """Whether the fault is the checkpoint's bytes (see `DAMAGE_KINDS`)."""
        return self.kind in DAMAGE_KINDS

    def describe(self) -> str:
        where = f" reading {self.path}" if self.path else ""
        return f"rank {self.rank}{where}: {self.kind}: {self.message}"


def fault_of(error: BaseException, rank: int, path: str | None = None) -> Fault:
    """The fault `error` reports: the one it carries if a verdict raised it, else this rank's."""
    carried = getattr(error, "fault", None)
    if isinstance(carried, Fault):
        return carried
    return Fault(rank, type(error).__name__, str(error)[:MAX_MESSAGE_CHARS], path)


def error_type(kind: str) -> type[CheckpointError]:
    """The engine's error type named `kind`; `CheckpointError` for any other type."""
    found = getattr(errors, kind, None) if kind in errors.__all__ else None
    return found if isinstance(found, type) and issubclass(found, CheckpointError) else CheckpointError


def verdict(faults: Sequence[Fault | None], *, what: str) -> CheckpointError | None:
    """The error every rank raises for these outcomes (one per rank; None: it succeeded), or
    None when no rank failed. The lowest failing rank's fault decides the type and leads the
    message; the ranks that failed alike are named, the others' own faults follow."""
    distinct: list[Fault] = []
    for fault in faults:
        if fault is not None and fault not in distinct:
            distinct.append(fault)
    if not distinct:
        return None
    distinct.sort(key=lambda f: f.rank)
    first = distinct[0]
    alike = [f.rank for f in distinct[1:] if (f.kind, f.message) == (first.kind, first.message)]
    others = [f for f in distinct[1:] if (f.kind, f.message) != (first.kind, first.message)]
    text = f"{what} failed on rank {first.rank}: {first.kind}: {first.message}"
    if first.path and first.path not in first.message:
        text = f"{what} failed on rank {first.rank} reading {first.path}: {first.kind}: {first.message}"
    if alike:
        text += f" (the same on rank(s) {ranks_text(alike)})"
    if others:
        shown = "; ".join(f.describe() for f in others[:MAX_RANKS_SHOWN])
        more = len(others) - MAX_RANKS_SHOWN
        text += f" (it failed on {len(others)} more rank(s) too: {shown}{f'; and {more} more' if more > 0 else ''})"
    error = error_type(first.kind)(text)
    error.fault = first  # type: ignore[attr-defined]
    return error


def agree(
    collective: Collective,
    error: BaseException | None,
    *,
    what: str,
    step: str,
    timeout_s: float,
    path: str | None = None,
) -> None:
    """Every rank calls it at the same point with its outcome (`error`: None if it succeeded;
    `path`: the file it was reading). Returns on every rank if no rank failed; else raises on
    every rank the `verdict`, chained to this rank's own error where it has one (an error a
    verdict raised already is raised again as it is). Within `timeout_s`: a rank that never
    arrives is named (`CommitError`)."""
    mine = None if error is None else fault_of(error, collective.rank, path)
    try:
        sent = collective.all_gather_object(None if mine is None else mine.to_json(),
                                            step=step, timeout_s=timeout_s)
    except CommitError as exc:
        raise CommitError(f"{what}: the ranks could not agree on its outcome: {exc}") from (error or exc)
    faults = [None if doc is None else Fault.from_json(doc, sender) for sender, doc in enumerate(sent)]
    found = verdict(faults, what=what)
    if found is None:
        return
    if error is not None and getattr(error, "fault", None) == found.fault:  # type: ignore[attr-defined]
        raise error
    if mine is not None and error_type(mine.kind) is CheckpointError and all(
            f is not None and (f.kind, f.message) == (mine.kind, mine.message) for f in faults):
        raise error  # another library's error, the same on every rank: raised as it is
    raise found from error


__all__ = ["DAMAGE_KINDS", "Fault", "agree", "error_type", "fault_of", "verdict"]
