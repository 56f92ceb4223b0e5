"""A node's local tier: its folder, the local manifest of a tag, what the node holds, retention.

The local folder is the ``local_tier.path`` of the config with ``{node}`` replaced by the node's
index (several simulated nodes share one machine that way). Each tag in it is a tag folder as in
``save_dir``: the tag marker, the files this node holds (its own ranks' and the replicas it
received) and, once every rank's files and replicas are written, the tag's manifest (listing
every file of the tag, on whichever node) and the local manifest (``nvcomp_local.json``: this
node's index and the files it holds by placement). A copy on a node is usable only when its
manifest exists; each file it holds counts only with the size and CRC-32 the manifest records
(`inventory` reads every byte, or, at a restore, the node's ranks each read a share of the
chosen tag's files, `check_shares`: a damaged copy must be replaced, not loaded).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextvars
import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from .. import commit, discovery, manifest_files
from ..errors import CheckpointError, CorruptCheckpointError
from ..manifest import (
    Manifest, ShardRecord, parse_manifest, read_manifest, serialize_manifest, validate_relative_path,
    validate_tag,
)
from ..storage import locations, open_storage
from ..storage.locations import Location

logger = logging.getLogger(__name__)

LOCAL_MANIFEST_NAME = "nvcomp_local.json"
_LOCAL_FORMAT = "nvcomp_ckpt_engine.local"
_MAX_LOCAL_MANIFEST_BYTES = 16 << 20


def node_root(path: str, node: int) -> Location:
    """The local tier folder of node `node`: `path` with ``{node}`` replaced by its index."""
    return locations.location(path.replace("{node}", str(node)))


@dataclasses.dataclass(frozen=True)
class LocalManifest:
    """Which files of a tag node `node` holds by placement (its ranks' own and its replicas)."""

    tag: str
    node: int
    held: tuple[str, ...]

    def to_bytes(self) -> bytes:
        return (json.dumps({"format": _LOCAL_FORMAT, "version": 1, "tag": self.tag,
                            "node": self.node, "held": sorted(self.held)}, sort_keys=True)
                + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str) -> LocalManifest:
        try:
            obj = json.loads(data)
            if obj.get("format") != _LOCAL_FORMAT or obj.get("version") != 1:
                raise ValueError(f"not a local manifest of version 1: {obj.get('format')!r} "
                                 f"{obj.get('version')!r}")
            node = obj["node"]
            if not isinstance(node, int) or isinstance(node, bool) or node < 0:
                raise ValueError(f"node must be an index >= 0, got {node!r}")
            held = tuple(validate_relative_path(p, field="held") for p in obj["held"])
            return cls(tag=validate_tag(obj["tag"]), node=node, held=held)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{source}: {exc}") from None


def write_local_manifest(tag_dir: Location, local: LocalManifest, *, durable: bool = True) -> None:
    locations.publish(tag_dir / LOCAL_MANIFEST_NAME, local.to_bytes(), durable=durable)


def read_local_manifest(tag_dir: Location) -> LocalManifest | None:
    """The local manifest of `tag_dir` (None: there is none); CorruptCheckpointError if damaged."""
    where = tag_dir / LOCAL_MANIFEST_NAME
    try:
        data = locations.read_small(where, _MAX_LOCAL_MANIFEST_BYTES, what="a local manifest")
    except FileNotFoundError:
        return None
    return LocalManifest.from_bytes(data, source=str(where))


@dataclasses.dataclass(frozen=True)
class NodeCopy:
    """What one node holds of one tag: its manifest, the files intact (size and CRC-32 as the
    manifest records), and the damaged ones with why (a missing file is neither)."""

    tag: str
    manifest: Manifest
    intact: frozenset[str]
    damaged: dict[str, str]


def copy_to_json(copy: NodeCopy) -> dict[str, Any]:
    """`copy` as JSON, for the all-gather of a restore's inventory (collectives send JSON)."""
    return {"tag": copy.tag, "manifest": serialize_manifest(copy.manifest).decode(),
            "intact": sorted(copy.intact), "damaged": dict(copy.damaged)}


def copy_from_json(obj: Mapping[str, Any]) -> NodeCopy:
    """`copy_to_json`'s inverse; the manifest validated again."""
    found = parse_manifest(obj["manifest"].encode(), source=f"the local copy of {obj['tag']!r}")
    return NodeCopy(tag=obj["tag"], manifest=found, intact=frozenset(obj["intact"]),
                    damaged=dict(obj["damaged"]))


def manifest_identity(manifest: Manifest) -> tuple:
    """What tells two copies of a tag's manifest apart: its files, their sizes and CRC-32s (a
    re-save of a tag with other bytes is another checkpoint; the drain's persistent manifest,
    committed later, is the same one)."""
    return (manifest.tag, manifest.world_size,
            tuple(sorted((r.path, r.rank, r.file_bytes, r.crc32) for r in manifest.files)))


def inventory(root: Location, *, check_crc: bool = True,
              finish_renames: bool = True) -> dict[str, NodeCopy]:
    """Every committed tag in the local folder `root`, by tag, with the files held intact:
    their sizes as the manifest records and, with `check_crc`, their CRC-32s (every byte read;
    without, a restore's ranks read those of one tag later: `check_shares`).

    A tag folder without a readable manifest is not a copy (a save in progress or debris); an
    interrupted re-save's renames are finished first (`finish_renames`), as before any load.
    """
    found: dict[str, NodeCopy] = {}
    for tag, path in discovery.tag_folders(root):
        try:
            manifest = read_manifest(path)
            if manifest.pending and finish_renames:
                commit.finish_pending_renames(path, manifest)
        except (CheckpointError, OSError) as exc:
            logger.debug("%s: no local copy: %s", path, exc)
            continue
        found[tag] = _checked(path, tag, manifest, manifest.files, check_crc=check_crc)
    return found


def check_shares(copy: NodeCopy, ranks: int) -> list[tuple[str, ...]]:
    """The files of `copy` (from `inventory` without CRCs) each of its node's `ranks` local
    ranks reads for the CRC check of a restore, by local rank: balanced by bytes, the largest
    file first, each to the rank with the fewest bytes so far (the lower local rank on a tie).
    Every rank computes the same split from the same all-gathered inventory, so each file is
    read once, by one rank, and no rank waits for a file nobody reads."""
    shares: list[list[str]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    held = sorted((r for r in copy.manifest.files if r.path in copy.intact),
                  key=lambda r: (-r.file_bytes, r.path))
    for record in held:
        lightest = min(range(ranks), key=lambda i: (loads[i], i))
        shares[lightest].append(record.path)
        loads[lightest] += record.file_bytes
    return [tuple(share) for share in shares]


@dataclasses.dataclass(frozen=True)
class CheckedShare:
    """What one rank's CRC check of its share of a node's copy found: the files intact (size
    and CRC-32 as the manifest records) and the damaged ones with why (a file gone since the
    inventory is neither: absent)."""

    intact: frozenset[str]
    damaged: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"intact": sorted(self.intact), "damaged": dict(self.damaged)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CheckedShare:
        return cls(intact=frozenset(obj["intact"]), damaged=dict(obj["damaged"]))


def check_share(root: Location, copy: NodeCopy, paths: Iterable[str], *,
                threads: int = 1) -> CheckedShare:
    """The CRC-32 of each of `paths` (this rank's share of `copy`, `check_shares`) read, on up
    to `threads` threads (file reads and zlib's CRC release the GIL). The threads are one pool
    of segments (`manifest_files.CrcPool`) that every file's reads share: several files at
    once, and a file larger than a segment on several threads, so a rank with fewer files than
    threads gives the spare ones to its large files' segments. Each check runs in a copy of the
    caller's context (`contextvars`), as if the rank read the file itself. An unexpected error
    is a CheckpointError naming the file."""
    wanted = set(paths)
    records = [r for r in copy.manifest.files if r.path in wanted]
    tag_dir = root / copy.tag

    def one(record: ShardRecord, crc_pool: manifest_files.CrcPool) -> NodeCopy:
        try:
            return _checked(tag_dir, copy.tag, copy.manifest, [record], check_crc=True,
                            crc_pool=crc_pool)
        except Exception as exc:
            raise CheckpointError(f"{tag_dir / record.path}: checking it against the manifest: "
                                  f"{type(exc).__name__}: {exc}") from exc

    if not records:
        return CheckedShare(intact=frozenset(), damaged={})
    # The files' threads only open them and wait for their segments: the CRC work of them all
    # runs on the pool's `threads`.
    with manifest_files.CrcPool(max(1, threads)) as crc_pool, \
            cf.ThreadPoolExecutor(max(1, min(threads, len(records))),
                                  thread_name_prefix="nvckpt-crc") as files:
        # Each context copied here, in the caller's thread (a context runs in one thread at once).
        futures = [files.submit(contextvars.copy_context().run, one, r, crc_pool) for r in records]
        found = [future.result() for future in futures]
    return CheckedShare(intact=frozenset().union(*(f.intact for f in found)),
                        damaged={name: why for f in found for name, why in f.damaged.items()})


def merge_checks(copy: NodeCopy, shares: Iterable[CheckedShare]) -> NodeCopy:
    """`copy` (from `inventory` without CRCs) as its node's ranks found it, each checking its
    share (`check_shares`): a file counts as intact only if the rank that read it found it
    so; one damaged or gone counts as absent, as a damaged copy does."""
    shares = list(shares)
    return dataclasses.replace(
        copy, intact=frozenset().union(*(s.intact for s in shares)),
        damaged={**copy.damaged, **{name: why for s in shares for name, why in s.damaged.items()}})


def _checked(path: Location, tag: str, manifest: Manifest, records: Iterable[Any], *,
             check_crc: bool, crc_pool: manifest_files.CrcPool | None = None) -> NodeCopy:
    records = tuple(records)
    subset = dataclasses.replace(manifest, files=records)
    _, problems = manifest_files.check_files(path, subset, check_crc=check_crc, crc_pool=crc_pool)
    bad = {p.record.path: p for p in problems}
    damaged = {name: f"{p.kind}: {p.message}" for name, p in bad.items() if p.kind != "missing"}
    for name, why in damaged.items():
        logger.warning("%s: the local copy of %s is damaged (%s); it is replaced at the next "
                       "load from a replica or the persistent copy", path, name, why)
    intact = frozenset(r.path for r in records if r.path not in bad)
    return NodeCopy(tag=tag, manifest=manifest, intact=intact, damaged=damaged)


def apply_local_retention(root: Location, keep_last: int, *, protect: Iterable[str] = ()) -> list[str]:
    """Keep the newest `keep_last` committed tags of this node's folder (and `protect`: the
    save just made, a drain in progress); delete older ones and the debris of failed saves
    (marked tag folders without a manifest). Returns the tags deleted. Run by one rank per
    node, between saves."""
    keep = set(protect)
    states = [discovery.tag_state(tag, path, local_only=True, check_crc=False)
              for tag, path in discovery.tag_folders(root)]
    committed = discovery.newest_first(s for s in states if s.manifest is not None)
    keep.update(s.tag for s in committed[:keep_last])
    deleted = []
    storage = open_storage(root)
    for state in states:
        if state.tag in keep or not discovery.is_engine_tag(state.path, read_files=False):
            continue
        why = "older than the newest keep_last" if state.manifest is not None else "a failed save"
        logger.info("local tier %s: deleting %s (%s)", root, state.tag, why)
        storage.delete_prefix(state.tag)
        deleted.append(state.tag)
    return deleted




#: A scan of ``{node}`` folders stops after this many absent indexes in a row.
_ABSENT_NODES_IN_A_ROW = 16


def node_folders(path: str) -> list[tuple[int, Location]]:
    """The local tier folders that exist for `path` (``local_tier.path``), with their node
    index: ``{node}`` filled with 0, 1, ... (a node lost leaves a gap; the scan ends after
    `_ABSENT_NODES_IN_A_ROW` absent ones), or `path` itself, node 0, without a placeholder."""
    if "{node}" not in path:
        return [(0, node_root(path, 0))]
    found, node, absent = [], 0, 0
    while absent < _ABSENT_NODES_IN_A_ROW:
        root = node_root(path, node)
        if discovery.tag_folders(root) or _exists(root):
            found.append((node, root))
            absent = 0
        else:
            absent += 1
        node += 1
    return found


def _exists(root: Location) -> bool:
    try:
        open_storage(root.parent).stat(root.name)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def tier_copies(path: str, tag: str) -> list[dict[str, Any]]:
    """What each node's local tier holds of `tag` (for ``nvcomp-ckpt inspect/verify
    --local-tier``): whether it is committed there, the files it holds by placement (its local
    manifest), how many are intact, and the missing and damaged ones; no torch."""
    report = []
    for node, root in node_folders(path):
        entry: dict[str, Any] = {"node": node, "folder": str(root), "committed": False, "files": 0,
                                 "intact": 0, "held": None, "missing": [], "damaged": {}}
        copy = inventory(root, finish_renames=False).get(tag)
        if copy is not None:
            try:
                held = read_local_manifest(root / tag)
            except CheckpointError as exc:
                entry["damaged"][LOCAL_MANIFEST_NAME] = str(exc)
                held = None
            should_hold = set(held.held) if held is not None else {r.path for r in copy.manifest.files}
            entry.update(committed=True, files=len(copy.manifest.files), intact=len(copy.intact),
                         held=None if held is None else sorted(held.held),
                         missing=sorted(should_hold - copy.intact - set(copy.damaged)))
            entry["damaged"].update(copy.damaged)
        report.append(entry)
    return report


def tier_faults(report: list[dict[str, Any]], tag: str) -> list[str]:
    """The faults of `tier_copies`' report: damaged copies, and files a node's local manifest
    says it holds but it lacks."""
    faults = []
    for entry in report:
        where = f"{entry['folder']}/{tag} (node {entry['node']})"
        faults += [f"{where}: {name}: damaged: {why}" for name, why in sorted(entry["damaged"].items())]
        faults += [f"{where}: {name}: missing (its local manifest says the node holds it)"
                   for name in entry["missing"]]
    return faults


__all__ = [
    "LOCAL_MANIFEST_NAME", "CheckedShare", "LocalManifest", "NodeCopy",
    "apply_local_retention", "check_share", "check_shares", "copy_from_json", "copy_to_json",
    "inventory", "manifest_identity", "merge_checks", "node_folders", "node_root",
    "read_local_manifest", "tier_copies", "tier_faults", "write_local_manifest",
]
