"""DCP's file-system interface over a URL location's storage, for ``s3://`` checkpoint folders.

torch's `FileSystemWriter` / `FileSystemReader` (which ours extend) reach their folder through
`self.fs`, a `FileSystemBase`: streams, joins, mkdir, exists, rm, rename. For a URL their own
`FileSystem` would make ``Path("s3://b/x")``, the local path ``s3:/b/x``; `StorageFileSystem`
answers the same calls through `storage/` instead. An object store has no rename and no fsync:
a stream becomes its object whole when it is closed after a clean write (nothing on an error),
and `rename` is a copy then a delete, used by DCP only for ``.metadata``'s temporary name,
before the manifest, the commit point, records ``.metadata``'s size and CRC.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Generator

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase

from ..storage import ReaderIO, SinkIO, locations, storage_for
from ..storage.locations import UrlLocation


class StorageFileSystem(FileSystemBase):
    """`FileSystemBase` for URL locations (`locations.UrlLocation`), each call one storage
    operation on the object the location names."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode == "wb":
            storage, key = storage_for(path)
            with storage.open_sink(key) as sink:
                stream = io.BufferedWriter(SinkIO(sink))
                yield stream
                stream.flush()
                sink.finish()
        elif mode == "rb":
            with locations.open_reader(path) as reader:
                yield io.BufferedReader(ReaderIO(reader))
        else:
            raise ValueError(f"{path}: mode {mode!r} (an object is written whole, 'wb', or read, 'rb')")

    def concat_path(self, path: str | os.PathLike, suffix: str) -> UrlLocation:
        return locations.location(path) / suffix

    def init_path(self, path: str | os.PathLike) -> str:
        """The URL as a string: DCP pickles it into ``.metadata`` (`StorageMeta.checkpoint_id`),
        whose reader's allowlist takes a string, not a class of ours."""
        return os.fspath(locations.location(path))

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        locations.copy(path, new_path)
        self.rm_file(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        """Nothing: a prefix exists by being named."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return locations.is_url(checkpoint_id)

    def exists(self, path: str | os.PathLike) -> bool:
        storage, key = storage_for(path)
        return storage.exists(key)

    def rm_file(self, path: str | os.PathLike) -> None:
        storage, key = storage_for(path)
        storage.delete(key)


def file_system_for(where: str | os.PathLike) -> FileSystemBase:
    """The file system DCP's writer and reader use for `where`: `StorageFileSystem` for a URL,
    torch's own `FileSystem` for a path."""
    return StorageFileSystem() if locations.is_url(where) else FileSystem()


__all__ = ["StorageFileSystem", "file_system_for"]


class OnStorage:
    """What DCP's `FileSystemWriter` and `FileSystemReader` need to take a URL as well as a path:
    the file system of the location (`file_system_for`), at construction and at each `reset`,
    and a URL accepted as a checkpoint id. Mixed in before DCP's class."""

    def _locate(self, path: str | os.PathLike) -> None:
        self.fs = file_system_for(path)  # an object store for a URL (docs/STORAGE.md)
        self.path = self.fs.init_path(path)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """DCP's reset, with the file system of a new `checkpoint_id` (a path or a URL)."""
        if checkpoint_id:
            self.fs = file_system_for(checkpoint_id)
        super().reset(checkpoint_id)  # type: ignore[misc]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return (locations.is_url(checkpoint_id)
                or super().validate_checkpoint_id(checkpoint_id))  # type: ignore[misc]
