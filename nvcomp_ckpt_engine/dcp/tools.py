"""What the CLI calls on a DCP checkpoint folder: inspect, verify, decompress.

These open the checkpoint as any tag folder of ours is opened (`integrity.open_dcp_checkpoint`:
the manifest read once, each listed file's real path inside the folder, each rank file's index
read once), read ``.metadata`` through the engine's allowlist (`metadata.unpickle_metadata`),
never with a plain unpickle, and every rank file through `reader.RankFile` with its checks, so
looking at or converting an untrusted checkpoint runs no code from it. Bytes items (``torch.save``
bytes of values that are not tensors) are read through the allowlist too (`torchsave`): `verify`
reports one naming a class off the allowlist, and `decompress` refuses to pass it on to stock
DCP, whose planner would unpickle it without restriction.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from .. import container, manifest, manifest_files, megatron_files, opened, torchsave
from ..describe import describe_index
from ..errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ..storage import OutsideRootError, is_file, locations, open_storage
from ._torch_internals import stock_storage_record
from .layout import (
    METADATA_FILE,
    SHARD_SUFFIX,
    STOCK_SUFFIX,
    ItemLocation,
    shard_paths,
    split_key,
)
from .integrity import checked_metadata_bytes, checked_rank_file, open_dcp_checkpoint
from .metadata import check_coverage, locations_by_file, unpickle_metadata
from .reader import RankFile, check_item, read_kinds

logger = logging.getLogger(__name__)


def _describe_file(path: locations.Location) -> dict[str, Any]:
    """One rank file from its index and skeleton alone (shaped like the CLI's shard rows)."""
    index = container.read_index(path)
    with locations.open_reader(path) as f:
        kinds = read_kinds(f, index, verify=True)
    doc = describe_index(index, path.name)
    for row in doc["tensors"]:
        fqn, offsets = split_key(row["key"], kinds[row["key"]])
        row.update(fqn=fqn, offsets=offsets, kind=kinds[row["key"]])
    return doc


def inspect_dcp(path: str | os.PathLike) -> list[dict[str, Any]]:
    """One dict per rank file of a DCP checkpoint, from indexes only (no decoding, no GPU).

    Each dict has the keys of the CLI's shard description (`describe.describe_index`); each
    tensor row adds the item's ``fqn``, chunk ``offsets`` and ``kind`` ("tensor" or "bytes").
    A file that cannot be read gives ``{"path": name, "error": message}`` instead.
    """
    rows = []
    for file in shard_paths(locations.location(path)):
        try:
            rows.append(_describe_file(file))
        except (CheckpointError, OSError) as exc:
            rows.append({"path": file.name, "error": str(exc)})
    return rows


def dcp_faults(path: str | os.PathLike, *, trusted: bool = False) -> list[CheckpointError]:
    """Every fault of a DCP checkpoint found without decoding it, one per damaged file.

    The manifest must be intact (`integrity`; a folder an older version saved has a checksum
    file instead), ``.metadata`` must match its record, unpickle through the allowlist
    (`read_metadata`) and record a location for every item it declares; if not, that is the one
    fault (nothing else can be checked). Then every rank file it names must be listed in the
    manifest, exist with its recorded size and CRC, pass every checksum and hold each item with
    the kind, dtype and shape ``.metadata`` gives it, and each bytes item must read through the
    allowlist (`torchsave.load_bytes`, unless `trusted`); a file that does not is one fault, and
    the others are still checked, as are the manifest's other files. Each fault is
    `IncompleteCheckpointError` (no manifest or ``.metadata``, a missing file) or
    `CorruptCheckpointError`, naming the file and item.
    """
    directory = locations.location(path)
    try:
        checkpoint = open_dcp_checkpoint(directory)
        data = checked_metadata_bytes(directory, checkpoint=checkpoint)
        metadata = unpickle_metadata(directory, data, trusted=trusted)
        check_coverage(directory, metadata)
    except CheckpointError as exc:
        return [exc]
    problems: dict[str, manifest_files.FileProblem] = {}
    if checkpoint is not None:
        problems = {p.record.path: p for p in manifest_files.check_files(
            directory, checkpoint.manifest, check_crc=False)[1]}
    faults: list[CheckpointError] = []
    for relative_path, items in sorted(locations_by_file(metadata).items()):
        file = directory / relative_path
        try:
            problem = problems.pop(relative_path, None)
            if problem is not None:
                raise _problem_error(problem)
            rank_path, rank_index = checked_rank_file(checkpoint, directory, relative_path)
            if not is_file(*locations.resolve(rank_path)):
                raise IncompleteCheckpointError(
                    f"{file}: missing; .metadata places {len(items)} item(s) in it, e.g. "
                    f"{items[0][1].key!r}")
            rank_index = container.verify_file(rank_path, rank_index)
            with RankFile(rank_path, index=rank_index) as rank_file:
                for index, location in rank_file.in_span_order(items, lambda il: il[1].key):
                    check_item(rank_file, metadata, index, location)
                    if not trusted and _is_bytes_item(metadata, index):
                        torchsave.load_bytes(rank_file.bytes(location.key),
                                             source=f"{rank_file.path}: item {location.key!r}")
        except CheckpointError as exc:
            faults.append(exc)
        except OSError as exc:
            faults.append(CorruptCheckpointError(f"{file}: cannot be read ({exc})"))
    faults.extend(_problem_error(problem) for _, problem in sorted(problems.items()))
    for index, record in metadata.storage_data.items():
        if not isinstance(record, ItemLocation) and not is_file(*locations.resolve(
                directory / record.relative_path)):
            faults.append(IncompleteCheckpointError(
                f"{directory / record.relative_path}: missing; .metadata places item "
                f"{index.fqn!r} in it"))
    return faults


def _problem_error(problem: manifest_files.FileProblem) -> CheckpointError:
    """A file's disagreement with the manifest as the error a load would raise."""
    if problem.kind == "missing":
        return IncompleteCheckpointError(problem.message)
    return CorruptCheckpointError(problem.message)


def verify_dcp(path: str | os.PathLike, *, trusted: bool = False) -> None:
    """Check a DCP checkpoint without decoding it; raises the first of `dcp_faults`."""
    faults = dcp_faults(path, trusted=trusted)
    if faults:
        raise faults[0]


def _is_bytes_item(metadata: Metadata, index: MetadataIndex) -> bool:
    return isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)


def _serialized(rank_file: RankFile, location: ItemLocation, index: MetadataIndex,
                metadata: Metadata, *, trusted: bool) -> bytes:
    """An item as DCP's stock writer stores it: the bytes themselves, or torch.save of the
    tensor with storage of its own size. Bytes items are read through the allowlist first
    (unless `trusted`): stock DCP's planner will unpickle them without restriction."""
    if _is_bytes_item(metadata, index):
        data = rank_file.bytes(location.key)
        if not trusted:
            torchsave.load_bytes(data, source=f"{rank_file.path}: item {location.key!r}")
        return data
    buffer = io.BytesIO()
    torch.save(rank_file.tensor(location.key, torch.device("cpu")).clone(), buffer)
    return buffer.getvalue()


def _decompress_file(src_dir: locations.Location, relative_path: str, dst_dir: locations.Location,
                     items: list[tuple[MetadataIndex, ItemLocation]], metadata: Metadata,
                     checkpoint: opened.OpenedCheckpoint | None, *,
                     trusted: bool) -> dict[MetadataIndex, Any]:
    """Write one rank file's items as a stock DCP data file; returns their new records."""
    src, rank_index = checked_rank_file(checkpoint, src_dir, relative_path)
    name = Path(relative_path).name[: -len(SHARD_SUFFIX)] + STOCK_SUFFIX
    records = {}
    writer = open_storage(dst_dir).open_sink(name)
    try:
        with RankFile(src, index=rank_index) as rank_file:
            for index, location in rank_file.in_span_order(items, lambda il: il[1].key):
                check_item(rank_file, metadata, index, location)
                data = _serialized(rank_file, location, index, metadata, trusted=trusted)
                records[index] = stock_storage_record(name, writer.append(data), len(data))
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return records


def decompress_dcp(src_dir: str | os.PathLike, dst_dir: str | os.PathLike, *,
                   trusted: bool = False) -> None:
    """Write a plain DCP checkpoint, which stock `dcp.load` reads, from one of ours.

    Each rank file becomes DCP's ``__{rank}_0.distcp`` (items as DCP's FileSystemWriter writes
    them), ``.metadata`` is rewritten to point at them (written last, so an interrupted run
    leaves no loadable half), and other files are copied (a Megatron-Core ``metadata.json``
    then names the stock ``torch_dist`` backend: `megatron_files`). Every chunk's checksum is
    checked on the way, and the files against the manifest. `dst_dir` must not exist or be
    empty. ``trusted`` as in `read_metadata`; without it, a bytes item that does not read
    through the allowlist is refused (`UnsafeObjectError` naming the file and item).
    """
    src, dst = locations.location(src_dir), locations.location(dst_dir)
    checkpoint = open_dcp_checkpoint(src)
    metadata = unpickle_metadata(src, checked_metadata_bytes(src, checkpoint=checkpoint),
                                 trusted=trusted)
    check_coverage(src, metadata)
    if checkpoint is not None:
        manifest_files.verify_files(src, checkpoint.manifest, check_crc=False)
    out = open_storage(dst)
    if any(True for _ in out.list()):
        raise ValueError(f"{dst} is not empty; decompress_dcp writes into a new directory")
    out.ensure_prefix("")
    records = dict(metadata.storage_data)
    ours = locations_by_file(metadata)
    for relative_path, items in sorted(ours.items()):
        records.update(_decompress_file(src, relative_path, dst, items, metadata, checkpoint,
                                        trusted=trusted))
        logger.info("decompressed %s (%d items)", relative_path, len(items))
    source = open_storage(src)
    for entry in source.list():
        name = entry.key
        if (name.startswith(METADATA_FILE) or name.endswith(SHARD_SUFFIX)
                or name == manifest.MANIFEST_NAME):
            continue  # .metadata is rewritten; the manifest (or an older checksum file) of ours
            # describes the compressed files
        if entry.is_prefix or entry.special:
            continue
        try:
            source.open_reader(name).close()
        except FileNotFoundError:  # a dangling link, or removed meanwhile
            continue
        except OutsideRootError:  # a link out of the checkpoint
            logger.warning("%s: a link to %s, outside the checkpoint; not copied", src / name,
                           os.path.realpath(src / name))
            continue
        megatron_files.copy_as_stock(src / name, dst / name)
    plain = dataclasses.replace(metadata, storage_data=records)
    out.publish(METADATA_FILE, pickle.dumps(plain))
    out.sync_prefix()

