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

from . import opened
from .lazy import LazyShard


class TagReader:
    """A complete tag folder, opened for reading (IncompleteCheckpointError if it is not).

    `trusted` lets the files create any class (skipping the allowlist); `verify` checks CRCs.
    The manifest is read once, and each file's index once however many times it is read
    (`opened.OpenedCheckpoint`).
    """

    def __init__(self, tag_dir: str | os.PathLike, *, trusted: bool = False, verify: bool = True) -> None:
        self.checkpoint = opened.open_tag_dir(tag_dir, verify=verify)
        self.tag_dir = self.checkpoint.tag_dir
        self.manifest = self.checkpoint.manifest
        self.trusted = trusted
        self.verify = verify

    @property
    def paths(self) -> list[str]:
        """The files of the checkpoint, relative to the tag folder, in name order."""
        return self.checkpoint.paths

    def path(self, relative: str) -> Path:
        """The file holding `relative`'s bytes (see `manifest_files.record_file`)."""
        return self.checkpoint.path(relative)

    def load(self, relative: str, map_location: Any = "cpu") -> Any:
        """One file of the checkpoint, after its checks (`OpenedCheckpoint.load`): a derived
        module comes back whole, rebuilt from the tag's files beside it."""
        return self.checkpoint.load(relative, map_location, trusted=self.trusted)

    def open_lazy(self, relative: str, *, pool: cf.Executor | None = None) -> LazyShard:
        """One file of the checkpoint, after its checks, for reading its tensors in parts
        (decoded in `pool`, see `LazyShard`)."""
        return self.checkpoint.open_lazy(relative, trusted=self.trusted, pool=pool)
