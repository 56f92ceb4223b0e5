"""File bytes between ranks, in bounded chunks, on a fixed schedule.

Every rank runs the same list of `Transfer`s (built alike on every rank from all-gathered
facts) in the same order, taking part only in those that name it. Every pair of ranks meets
their transfers in the same order, so the earliest transfer not yet done always has both of its
ranks ready for it: no cycle of waits, no hang. A transfer is a one-word status from the sender
(it could open the file with its recorded size, or not), then the file in chunks of at most
`chunk_bytes` (the memory a rank holds for it), received into a sink of the receiver's local
tier and checked against the CRC-32 the manifest records before the sink is finished. A file
that fails (unreadable, wrong CRC, the receiving disk full) is an error of that file, recorded,
and the schedule goes on, so the others are not left waiting; a peer that dies or stalls makes
the wait fail after `timeout_s`, an error naming it, never a hang.

The bytes travel over a `Channel`: torch.distributed point-to-point on a gloo group
(`TorchChannel`) in a job, a stand-in in tests.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..errors import CheckpointError
from ..storage import locations
from ..storage.locations import Location

logger = logging.getLogger(__name__)

#: Default size of one message of a file: what each side holds in memory for a transfer.
CHUNK_BYTES = 16 << 20
_OK, _FAILED = 0, 1


class Channel(Protocol):
    """Point-to-point messages of known sizes between ranks."""

    def send(self, buffer: memoryview, to: int, timeout_s: float) -> None: ...

    def recv(self, buffer: memoryview, source: int, timeout_s: float) -> None: ...


class TorchChannel:
    """A `Channel` over torch.distributed's send/recv on `group` (a gloo group: CPU buffers)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def _wait(self, work: Any, what: str, peer: int, timeout_s: float) -> None:
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # gloo: the peer closed the connection, or a timeout
            raise TimeoutError(f"{what} rank {peer} failed: {exc}") from exc
        if done is False:
            raise TimeoutError(f"{what} rank {peer} did not finish within {timeout_s:.0f} s")

    def send(self, buffer: memoryview, to: int, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        work = dist.isend(torch.frombuffer(buffer, dtype=torch.uint8), dst=to, group=self.group)
        self._wait(work, "sending to", to, timeout_s)

    def recv(self, buffer: memoryview, source: int, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        work = dist.irecv(torch.frombuffer(buffer, dtype=torch.uint8), src=source, group=self.group)
        self._wait(work, "receiving from", source, timeout_s)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """File `path` of a tag (`size` bytes, CRC-32 `crc32`) from rank `sender` to rank `receiver`."""

    path: str
    size: int
    crc32: int
    sender: int
    receiver: int


@dataclasses.dataclass
class TransferReport:
    """What this rank sent and received, and the files that failed (path: why)."""

    sent_bytes: int = 0
    received_bytes: int = 0
    received: list[str] = dataclasses.field(default_factory=list)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)


def run_transfers(transfers: Sequence[Transfer], *, rank: int, channel: Channel,
                  source: Callable[[str], Location], target: Callable[[str], Location],
                  timeout_s: float, chunk_bytes: int = CHUNK_BYTES,
                  durable: bool = True) -> TransferReport:
    """This rank's part of `transfers` (the same list, in the same order, on every rank):
    sending reads `source(path)`, receiving writes `target(path)`.

    Raises CheckpointError naming the peer when a message does not arrive within `timeout_s`
    (the peer died or stalls: the schedule cannot go on); a file that fails otherwise is in
    the report's `errors`.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    report = TransferReport()
    buffer = memoryview(bytearray(max(8, chunk_bytes)))
    for transfer in transfers:
        if transfer.sender == transfer.receiver:
            raise ValueError(f"{transfer.path}: rank {rank} would send a file to itself")
        try:
            if transfer.sender == rank:
                _send(transfer, channel, source(transfer.path), buffer, timeout_s, report)
            elif transfer.receiver == rank:
                _receive(transfer, channel, target(transfer.path), buffer, timeout_s, durable, report)
        except TimeoutError as exc:
            raise CheckpointError(f"copying {transfer.path} from rank {transfer.sender} to rank "
                                  f"{transfer.receiver}: {exc}") from exc
    return report


def _chunks(size: int, chunk: int) -> list[tuple[int, int]]:
    return [(offset, min(chunk, size - offset)) for offset in range(0, size, chunk)]


def _send(transfer: Transfer, channel: Channel, where: Location, buffer: memoryview,
          timeout_s: float, report: TransferReport) -> None:
    status = memoryview(bytearray(8))
    try:
        reader = locations.open_reader(where)
    except OSError as exc:
        reader, problem = None, f"{type(exc).__name__}: {exc}"
    else:
        problem = None if reader.size == transfer.size else (
            f"{where} has {reader.size} bytes, its record {transfer.size}")
    try:
        status[0] = _FAILED if problem else _OK
        channel.send(status, transfer.receiver, timeout_s)
        if problem:
            report.errors[transfer.path] = f"could not send {where}: {problem}"
            return
        for offset, length in _chunks(transfer.size, len(buffer)):
            piece = buffer[:length]
            reader.read_into(offset, piece)
            channel.send(piece, transfer.receiver, timeout_s)
        report.sent_bytes += transfer.size
    finally:
        if reader is not None:
            reader.close()


def _receive(transfer: Transfer, channel: Channel, where: Location, buffer: memoryview,
             timeout_s: float, durable: bool, report: TransferReport) -> None:
    status = memoryview(bytearray(8))
    channel.recv(status, transfer.sender, timeout_s)
    if status[0] != _OK:
        report.errors[transfer.path] = f"rank {transfer.sender} could not send it (see its error)"
        return
    sink, problem, crc = None, None, 0
    try:
        sink = locations.open_sink(where, durable=durable)
    except OSError as exc:
        problem = f"opening {where}: {type(exc).__name__}: {exc}"
    for offset, length in _chunks(transfer.size, len(buffer)):
        piece = buffer[:length]
        channel.recv(piece, transfer.sender, timeout_s)  # always: the sender sends them all
        if problem is None:
            crc = zlib.crc32(piece, crc)
            try:
                sink.append(piece)
            except OSError as exc:
                problem = f"writing {where}: {type(exc).__name__}: {exc}"
    if problem is None and crc != transfer.crc32:
        problem = (f"the copy from rank {transfer.sender} arrived with CRC-32 {crc:08x}, its "
                   f"record says {transfer.crc32:08x}")
    if problem is None:
        try:
            sink.finish()
        except OSError as exc:
            problem = f"finishing {where}: {type(exc).__name__}: {exc}"
    if problem is not None:
        if sink is not None:
            sink.abort()
        report.errors[transfer.path] = problem
        logger.error("rank %d: %s: %s", transfer.receiver, transfer.path, problem)
        return
    report.received_bytes += transfer.size
    report.received.append(transfer.path)


__all__ = ["CHUNK_BYTES", "Channel", "TorchChannel", "Transfer", "TransferReport", "run_transfers"]
