"""Opening a committed checkpoint for a load: the manifest read once, each shard's index once.

Every load of a checkpoint folder of ours goes through here, whatever the framework: the
DeepSpeed engine (`deepspeed/engine.py` only translates DeepSpeed's calls into this step),
`TagReader` (``nvcomp-ckpt decompress``, ``to-universal``) and DCP's reader and tools
(`dcp.integrity.open_dcp_checkpoint`: a DCP folder is opened as a tag folder as it is). Opening
a checkpoint

- resolves the tag (`discovery.resolve_load_state`, which also finishes an interrupted
  re-save's renames) or, for a read-only tool, takes a tag folder as it is (`open_tag_dir`);
- reads its manifest once and checks it complete: every listed file present with its size;
- gives each listed file's real path, refusing one that resolves outside the tag folder
  (a link out of it) before anything is read from it;
- reads each shard's index once (`container.read_index`: header, index and trailer, the index's
  own CRC and its bounds checked) and, with `verify`, compares the whole-file CRC-32 the index
  implies with the manifest's record (a file swapped in from another save is refused);

and hands those indexes to the readers (`api.load_shard`, `SiblingSources`, `LazyShard`), which
check every chunk's CRC as they decode it. So a load reads the manifest once and each index once.

Nothing here imports torch until a file is decoded (`OpenedCheckpoint.load`, `open_lazy`):
``nvcomp-ckpt verify`` reads a tag's indexes through the same `ShardIndexes` where torch is not
installed.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from . import container, discovery, manifest, manifest_files
from .container import ShardIndex
from .errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from .siblings import SiblingSources
from .storage import is_file, locations
from .storage.locations import Location

if TYPE_CHECKING:
    from .lazy import LazyShard


class OpenedCheckpoint:
    """A complete tag folder, its manifest read and checked; its files' indexes read on first use.

    `verify`: compare each shard's index CRC with the manifest's record before its bytes are used.
    """

    def __init__(self, tag_dir: str | os.PathLike, found: manifest.Manifest, *, verify: bool,
                 indexes: ShardIndexes | None = None) -> None:
        self.tag_dir = locations.location(tag_dir)
        self.manifest = found
        self.verify = verify
        self.indexes = indexes or ShardIndexes()
        self._records: dict[str, tuple[manifest.ShardRecord, ...]] = {}
        for record in found.files:  # with node-local storage, one per node
            self._records[record.path] = self._records.get(record.path, ()) + (record,)
        self._checked: set[str] = set()

    @property
    def paths(self) -> list[str]:
        """The files of the checkpoint, relative to the tag folder, in name order."""
        return sorted(self._records)

    def records(self, relative: str) -> tuple[manifest.ShardRecord, ...]:
        """The manifest's records of `relative` (empty: not part of the checkpoint)."""
        return self._records.get(relative, ())

    def path(self, relative: str) -> Location:
        """The file holding `relative`'s bytes (see `manifest_files.record_file`)."""
        return manifest_files.record_file(self.tag_dir, self.manifest, self._record(relative))

    def real_path(self, relative: str) -> Location:
        """The real path of listed file `relative` (its URL on an object store), refused
        (CorruptCheckpointError) unless it lies inside the tag folder: a link out of it is never
        read."""
        path = self.path(relative)
        real = locations.real(path)
        if not locations.is_inside(real, self.tag_dir):
            raise CorruptCheckpointError(f"{path}: resolves to {real}, outside the tag folder "
                                         f"{self.tag_dir}; refused unread")
        return real

    def checked(self, relative: str) -> Location:
        """The real path of listed file `relative` (`real_path`), checked on first use: its size
        (and CRC, with `verify`) against the manifest."""
        real = self.real_path(relative)
        if relative not in self._checked:
            self.check(self.records(relative))
        return real

    def check(self, records: Iterable[manifest.ShardRecord]) -> None:
        """Check listed files against their records once each: present with their sizes (the
        ones this node holds, with node-local storage) and, with `verify`, the CRC each index
        implies."""
        records = tuple(r for r in records if r.path not in self._checked)
        if not records:
            return
        present = manifest_files.verify_files(
            self.tag_dir, dataclasses.replace(self.manifest, files=records), check_crc=False,
            local_only=self.manifest.node_local_storage,
        )
        if self.verify:
            for record in present:
                self.indexes.check_crc(manifest_files.record_file(self.tag_dir, self.manifest, record),
                                       record)
        self._checked.update(r.path for r in records)

    def index(self, relative: str) -> ShardIndex | None:
        """The index of listed file `relative` (None: a plain torch file), after its checks."""
        return self.indexes.get(self.checked(relative))

    def sources(self, index: ShardIndex, *, folder: str | None = None
                ) -> tuple[dict[str, Location], dict[str, ShardIndex]]:
        """The files a shard's derived storages come from (beside it, listed by the manifest),
        checked as the shard is (real path inside the tag folder, size, CRC), and their
        indexes: what `SiblingSources` reads them through. A source refused names the shard
        derived from it too. `folder`: where the shard lies in the tag folder, relative to it
        (default: where ``index.path`` lies; a copy of the shard outside the tag folder names
        the folder it was copied from, `load_lone_shard`)."""
        if folder is None:
            folder = locations.relative_to(locations.location(index.path).parent, self.tag_dir)
        files, indexes = {}, {}
        for name in index.derived_files:
            relative = name if folder == "." else f"{folder}/{name}"
            if not self.records(relative):
                raise IncompleteCheckpointError(
                    f"{index.path}: its module is derived from {name}, which the manifest of "
                    f"{self.tag_dir} does not list")
            try:
                files[name] = self.checked(relative)
            except CorruptCheckpointError as exc:
                raise CorruptCheckpointError(f"{index.path}: its module is derived from {name}, "
                                             f"which is refused: {exc}") from exc
            source = self.indexes.get(files[name])
            if source is not None:
                indexes[name] = source
        return files, indexes

    def load(self, relative: str, map_location: Any = "cpu", *, trusted: bool = False) -> Any:
        """One file of the checkpoint, as `nvcomp_ckpt_engine.load` returns it, after its checks.

        A file whose storages are derived from other files of the tag (a DeepSpeed ZeRO-1/2
        module, rebuilt from the optimizer shards' fp32 partitions) comes back whole: its sources
        are the tag's files beside it, each checked as this one is. `trusted` lets the file
        create any class (skipping the allowlist)."""
        from . import api

        path = self.checked(relative)
        index = self.indexes.get(path)
        if index is None:  # not a shard: `load` says so
            return api.load(path, map_location, trusted=trusted, verify=self.verify)
        files, indexes = self.sources(index)
        siblings = SiblingSources(path.parent, files=files, indexes=indexes, verify=self.verify,
                                  within=self.tag_dir)
        if index.derived_files:  # the derived ranges' sizes, bounded by their sources first
            siblings.check_for_load(index)
        return api.load_shard(index, map_location, trusted=trusted, verify=self.verify,
                              fill_derived=siblings.fill)

    def open_lazy(self, relative: str, *, trusted: bool = False, pool: cf.Executor | None = None,
                  safe_classes: Iterable[Any] = ()) -> LazyShard:
        """One file of the checkpoint, after its checks, for reading its tensors in parts
        (decoded in `pool`; `safe_classes` beside the allowlist: see `LazyShard`)."""
        from .lazy import LazyShard

        path = self.checked(relative)
        return LazyShard(path, trusted=trusted, verify=self.verify, pool=pool,
                         safe_classes=safe_classes, index=self.indexes.get(path))

    def _record(self, relative: str) -> manifest.ShardRecord:
        try:
            return self._records[relative][0]
        except KeyError:
            raise ValueError(f"{self.tag_dir}: the manifest lists no file {relative!r}") from None


class ShardIndexes:
    """Shard indexes by real path, each read once (None: a plain torch file, with no index).

    An index comes back under the name the caller gives its file (`ShardIndex.path`; two names
    of one file share one reading), so that errors, and the reads that follow, name the file as
    the caller does: an opened checkpoint by its real path, ``nvcomp-ckpt verify`` as the user
    named the tag folder.
    """

    def __init__(self) -> None:
        self._indexes: dict[str, ShardIndex | None] = {}

    def get(self, path: str | os.PathLike) -> ShardIndex | None:
        """The index of shard `path`, read on first use (None: not a shard file)."""
        real = os.fspath(locations.real(path))
        if real not in self._indexes:
            self._indexes[real] = (container.read_index(path) if container.is_shard_file(path)
                                   else None)
        index = self._indexes[real]
        if index is not None and index.path != os.fspath(path):
            index = dataclasses.replace(index, path=os.fspath(path))
        return index

    def crc(self, path: str | os.PathLike) -> int:
        """A file's whole-file CRC-32: a shard's as its index describes it, any other file's
        read whole (the engine lists none but DCP's small ``.metadata``: a plain file in a
        manifest is one swapped in, which its CRC tells). (`discovery`'s ``crc_of``.)"""
        index = self.get(path)
        return manifest_files.file_crc32(path) if index is None else index.crc32

    def check_crc(self, path: str | os.PathLike, record: manifest.ShardRecord) -> None:
        """Refuse a file that is not the one the manifest committed, before anything reads it.

        The CRC-32 a shard's index implies equals the file's real CRC once every chunk matches
        its own CRC, which every read checks before decoding a chunk: the same guarantee as
        reading the whole file twice, for the price of its index. Any other file is read whole.
        """
        actual = self.crc(path)
        if actual != record.crc32:
            raise CorruptCheckpointError(
                f"{path}: CRC-32 {actual:#010x} differs from the manifest's {record.crc32:#010x}: "
                "the file is not the one this checkpoint committed"
            )


def open_checkpoint(
    save_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    latest: discovery.LatestPointer | None = None,
    fresh_start_ok: bool = False,
    verify: bool = True,
    fallback_to_complete: bool = False,
    local_only: bool = False,
    check_crc: bool = False,
    check_indexes: bool = False,
) -> OpenedCheckpoint | None:
    """Resolve the tag to load (`discovery.resolve_load_state`: `tag`, else the one `latest`
    names, else with `fallback_to_complete` the newest intact one) and open it.

    `fresh_start_ok`, for a job that resumes if it can: None when there is nothing to resume
    (`latest`: the pointer as the caller read it already). Whether there is anything and which
    checkpoint it is come from one reading of the manifests, and the one opened carries its
    manifest and the indexes read to judge it, so the load reads neither again.
    `check_indexes`: judge candidates by every shard's index CRC too (the indexes read are
    the ones the load then uses); `check_crc`: by every byte."""
    indexes = ShardIndexes()
    crc_of: Callable[[Location], int | None] | None = indexes.crc if check_indexes else None
    state = discovery.resolve_load_state(
        save_dir, tag, latest=latest, fresh_start_ok=fresh_start_ok,
        fallback_to_complete=fallback_to_complete, local_only=local_only, check_crc=check_crc,
        crc_of=crc_of,
    )
    return None if state is None else OpenedCheckpoint(
        state.path, state.manifest, verify=verify, indexes=indexes)


def load_lone_shard(
    path: str | os.PathLike,
    map_location: Any = None,
    *,
    verify: bool = True,
    safe_classes: Iterable[Any] = (),
    gpu_batch_mb: float | None = None,
) -> Any:
    """A shard outside every tag folder of ours, as `nvcomp_ckpt_engine.load` reads it; one
    whose derived storages' sources are not beside it is rebuilt from the checkpoint it was
    copied out of (`copied_from`), or refused (IncompleteCheckpointError naming the absent
    source and the ways out).

    DeepSpeed's ``ds_to_universal``, run on a ZeRO-1/2 checkpoint of ours (its ``torch.load``
    reads our shards through the import hook), copies the model-states files into its output
    folder byte for byte, but not the optimizer shards their module is derived from: this is
    how the universal load of that folder, with the engine on or through the hook, gets the
    module whole. The sources are read as the checkpoint's own load reads them (listed by its
    manifest, inside its tag folder, size and CRC-32 checked), and every derived range's digest
    is checked as the range is rebuilt: another save's shard is refused, naming both files.
    `gpu_batch_mb`: as `nvcomp_ckpt_engine.load`'s (None: its default; this module imports no
    torch until a file is decoded, so not the options either).
    """
    from . import api

    index = container.read_index(path)
    folder = locations.location(index.path).parent
    absent = [name for name in index.derived_files if not is_file(*locations.resolve(folder / name))]
    if not absent:
        siblings = SiblingSources(folder, verify=verify)
    else:
        origin = copied_from(index, verify=verify)
        if origin is None:
            raise IncompleteCheckpointError(
                f"{index.path}: its tensors are partly stored as derived from {absent[0]}, which is "
                f"not beside it, and no checkpoint in {folder.parent} lists this file (by its name, "
                "size and CRC-32) to read it from. DeepSpeed's ds_to_universal copies this file "
                "without the optimizer shards it is derived from: keep its output folder beside the "
                "checkpoint it converted (DeepSpeed's TAG_universal next to TAG), or convert with "
                "`nvcomp-ckpt to-universal`, which writes the module whole")
        files, indexes = origin.sources(index, folder=".")
        siblings = SiblingSources(folder, files=files, indexes=indexes, verify=verify,
                                  within=origin.tag_dir)
    if index.derived_files:  # the derived ranges' sizes, bounded by their sources first
        siblings.check_for_load(index)
    batch = {} if gpu_batch_mb is None else {"gpu_batch_mb": gpu_batch_mb}
    return api.load_shard(index, map_location, trusted=False, verify=verify,
                          safe_classes=safe_classes, fill_derived=siblings.fill, **batch)


def copied_from(index: ShardIndex, *, verify: bool = True) -> OpenedCheckpoint | None:
    """The checkpoint of ours that shard `index` is a copy of a top-level file of, looked for
    beside the copy's folder (None: none there): a tag folder in the copy's folder's parent
    whose manifest lists a file of the copy's name with its size and whole-file CRC-32 (the one
    the copy's index implies, which equals its real CRC once each chunk passes its own, as every
    read checks). The files of the checkpoint found are checked as they are read
    (`OpenedCheckpoint.sources`)."""
    folder = locations.location(index.path).parent
    name = locations.location(index.path).name
    for _, candidate in discovery.tag_folders(folder.parent):
        if candidate == folder:
            continue
        try:
            found = manifest.read_manifest(candidate)
        except CheckpointError:  # no checkpoint of ours, or one that cannot be read
            continue
        if any(r.path == name and r.file_bytes == index.file_bytes and r.crc32 == index.crc32
               for r in found.files):
            return OpenedCheckpoint(candidate, found, verify=verify)
    return None


def open_tag_dir(tag_dir: str | os.PathLike, *, verify: bool = True) -> OpenedCheckpoint:
    """Open a tag folder as it is, for a read-only tool: IncompleteCheckpointError unless its
    manifest is valid and lists files that are all present with their sizes. An interrupted
    re-save's files are read under their staged names (`manifest_files.record_file`)."""
    found = manifest.read_manifest(tag_dir)
    manifest_files.verify_files(tag_dir, found, check_crc=False, local_only=found.node_local_storage)
    return OpenedCheckpoint(tag_dir, found, verify=verify)


__all__ = ["OpenedCheckpoint", "ShardIndexes", "copied_from", "load_lone_shard", "open_checkpoint",
           "open_tag_dir"]
