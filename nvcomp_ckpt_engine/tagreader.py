"""The files of one committed tag folder, read with the checks every load makes.

A tag is read only if its manifest says it is complete: present, intact, every file it lists
present with its recorded size. Each file is then checked against its record before its bytes
are used: the whole-file CRC-32 that its index implies must be the manifest's (a file swapped in
from another save is refused), and every chunk's CRC is checked as the chunk is decoded. The
commands that rewrite a checkpoint (`nvcomp-ckpt decompress`, `nvcomp-ckpt to-universal`) read
every file of a tag here: whole (`TagReader.load`, a derived module rebuilt from the files
beside it), or a tensor at a time (`TagReader.open_lazy`).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from pathlib import Path
from typing import Any

from . import api, container, manifest, storage
from .errors import CorruptCheckpointError, IncompleteCheckpointError
from .lazy import LazyShard


class TagReader:
    """A complete tag folder, opened for reading (IncompleteCheckpointError if it is not).

    `trusted` lets the files create any class (skipping the allowlist); `verify` checks CRCs.
    """

    def __init__(self, tag_dir: str | os.PathLike, *, trusted: bool = False, verify: bool = True) -> None:
        self.tag_dir = Path(tag_dir)
        self.trusted = trusted
        self.verify = verify
        self.manifest = manifest.read_manifest(self.tag_dir)
        manifest.verify_files(self.tag_dir, self.manifest, check_crc=False,
                              local_only=self.manifest.node_local_storage)
        self._records: dict[str, manifest.ShardRecord] = {}
        for record in self.manifest.files:  # with node-local storage, one per path is enough
            self._records.setdefault(record.path, record)

    @property
    def paths(self) -> list[str]:
        """The files of the checkpoint, relative to the tag folder, in name order."""
        return sorted(self._records)

    def path(self, relative: str) -> Path:
        """The file holding `relative`'s bytes (see `record_file`)."""
        return record_file(self.tag_dir, self.manifest, self._record(relative))

    def load(self, relative: str, map_location: Any = "cpu") -> Any:
        """One file of the checkpoint, as `nvcomp_ckpt_engine.load` returns it, after its checks.

        A file whose storages are derived from other files of the tag (a DeepSpeed ZeRO-1/2
        module, rebuilt from the optimizer shards' fp32 partitions) comes back whole: its sources
        are the tag's files beside it, each checked as this one is."""
        path = self._checked(relative)
        folder = Path(relative).parent
        siblings = {Path(rel).name: rel for rel in self._records if Path(rel).parent == folder}
        names = container.read_index(path).derived_files if api.is_shard_file(path) else ()
        sources = {}
        for name in names:
            if name not in siblings:
                raise IncompleteCheckpointError(
                    f"{path}: its module is derived from {name}, which the manifest of "
                    f"{self.tag_dir} does not list")
            sources[name] = self._checked(siblings[name])
        return api.load(path, map_location, trusted=self.trusted, verify=self.verify,
                        sources=sources)

    def open_lazy(self, relative: str, *, pool: cf.Executor | None = None) -> LazyShard:
        """One file of the checkpoint, after its checks, for reading its tensors in parts
        (decoded in `pool`, see `LazyShard`)."""
        return LazyShard(self._checked(relative), trusted=self.trusted, verify=self.verify,
                         pool=pool)

    def _record(self, relative: str) -> manifest.ShardRecord:
        try:
            return self._records[relative]
        except KeyError:
            raise ValueError(f"{self.tag_dir}: the manifest lists no file {relative!r}") from None

    def _checked(self, relative: str) -> Path:
        path = self.path(relative)
        if not storage.is_inside(path, self.tag_dir):
            raise CorruptCheckpointError(f"{path}: resolves to {os.path.realpath(path)}, outside "
                                         f"the tag folder {self.tag_dir}; refused unread")
        if self.verify:
            check_index_crc(path, self._record(relative))
        return path


def record_file(tag_dir: Path, found: manifest.Manifest, record: manifest.ShardRecord) -> Path:
    """The file holding a record's bytes: its staged name while a re-save's rename is pending
    (see `manifest`), else its own."""
    staged = manifest.staged_path(tag_dir, found, record)
    return staged if staged is not None and staged.exists() else tag_dir / record.path


def index_crc(path: str | os.PathLike) -> int | None:
    """A shard's whole-file CRC-32 as its index describes it (read from its header, index and
    trailer only); None for a plain torch file, which has no index."""
    return container.read_index(path).crc32 if api.is_shard_file(path) else None


def check_index_crc(path: str | os.PathLike, record: manifest.ShardRecord) -> None:
    """Refuse a shard whose index does not describe the file the manifest committed.

    The CRC-32 its index implies equals the file's real CRC once every chunk matches its own
    CRC, which every read checks before decoding a chunk: the same guarantee as reading the whole
    file twice, for the price of its index. Plain (non-shard) files are compared by size only.
    """
    actual = index_crc(path)
    if actual is not None and actual != record.crc32:
        raise CorruptCheckpointError(
            f"{path}: CRC-32 {actual:#010x} differs from the manifest's {record.crc32:#010x}: "
            "the file is not the one this checkpoint committed"
        )
