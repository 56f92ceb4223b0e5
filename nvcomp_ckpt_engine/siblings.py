"""The other files of a checkpoint folder, read as the sources of a file's derived storages.

A shard of format version 2 may leave spans of its storages to other files of its checkpoint
(`container.DerivedRange`: a DeepSpeed ZeRO-1/2 module, whose 16-bit weights are the fp32
master partitions of the optimizer shards beside it, rounded). `SiblingSources` finds those
files — in the shard's own folder, or where a caller maps their names (a re-save's staged names)
— reads only the source tensors the ranges need (`pipeline.read_storage`, checksums verified)
and writes the cast elements into the span (`derived.copy_range`). It is what `api.load` uses,
so every reader outside a live DeepSpeed job — ``nvcomp-ckpt decompress``, ``zero-to-fp32``,
the wrapped ``zero_to_fp32.py``, a plain ``nvcomp_ckpt_engine.load`` — rebuilds such a file the
same way. Its index side (`index`, `check`) imports no torch, so ``nvcomp-ckpt verify`` checks
derived ranges where torch is not installed; decoding (`check_for_load`, `tensor`, `fill`,
`check_digests`) imports the pipeline.

A source is identified, not assumed: its real path must lie in the folder it is found in (and
in the tag folder a caller names: no link out of it is followed); it must hold the bytes it
lends (a source that is itself derived is refused from its index); and the bytes rebuilt from
it must have the digest the writer recorded (format version 4, `derived.check_digest`), so a
file of another save in its place is refused, naming both files.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from . import container
from .container import DerivedRange, ShardIndex, TensorEntry
from .errors import CorruptCheckpointError, IncompleteCheckpointError
from .formats import FLOAT_DTYPES
from .storage import is_file, locations

if TYPE_CHECKING:
    import torch


class SiblingSources:
    """Sources of derived ranges, by file name: `files` maps a name to the path that holds it
    (default: the name in `folder`). Each source index is read once (none that `indexes`, by
    name, holds already: an opened checkpoint's); each source tensor is decoded when a storage
    needs it and dropped after (one at a time in memory).

    A source found in `folder` by its name must resolve inside `folder`, and with `within` (the
    tag folder of a checkpoint) every source must resolve inside `within`: a link out of the
    checkpoint is refused before it is opened. A path the caller maps a name to is the caller's
    word otherwise (a re-save's staged name, a copy elsewhere)."""

    def __init__(self, folder: str | os.PathLike, *, files: Mapping[str, str | os.PathLike] | None = None,
                 indexes: Mapping[str, ShardIndex] | None = None, verify: bool = True,
                 workers: int | None = None, within: str | os.PathLike | None = None) -> None:
        self.folder = locations.location(folder)
        self.files = {name: locations.location(path) for name, path in (files or {}).items()}
        self.verify = verify
        self.workers = workers
        self.within = None if within is None else locations.location(within)
        self._indexes: dict[str, ShardIndex] = dict(indexes or {})
        self._located: set[str] = set()

    def path(self, name: str) -> locations.Location:
        return self.files.get(name, self.folder / name)

    def _locate(self, name: str, *, needed_by: str) -> locations.Location:
        """Source `name`'s path, refused (CorruptCheckpointError naming `needed_by` and the
        source) if its real path leaves `folder` (found there by name) or `within`."""
        path = self.path(name)
        if name in self._located:
            return path
        real = locations.real(path)
        bounds = ([] if name in self.files else [self.folder]) + ([self.within] if self.within else [])
        for bound in bounds:
            if not locations.is_inside(real, bound):
                raise CorruptCheckpointError(
                    f"{needed_by}: its tensors are partly derived from {name}, but {path} resolves "
                    f"to {real}, outside the checkpoint folder {bound}; refused unread")
        self._located.add(name)
        return path

    def index(self, name: str, *, needed_by: str) -> ShardIndex:
        """The index of source file `name`; `needed_by` names the reader in errors."""
        path = self._locate(name, needed_by=needed_by)
        if name not in self._indexes:
            if not is_file(*locations.resolve(path)):
                raise IncompleteCheckpointError(
                    f"{needed_by}: its tensors are partly stored as derived from {name}, which is "
                    f"not at {path}. Keep the checkpoint's files together (the whole tag folder), "
                    "or convert it where it is complete with `nvcomp-ckpt decompress`")
            self._indexes[name] = container.read_index(path)
        return self._indexes[name]

    def _entry(self, name: str, key: str, *, needed_by: str) -> tuple[ShardIndex, TensorEntry]:
        index = self.index(name, needed_by=needed_by)
        entry = next((t for t in index.tensors if t.key == key), None)
        if entry is None:
            raise CorruptCheckpointError(f"{needed_by}: derived from tensor {key!r} of {name}, which "
                                         f"{index.path} does not hold")
        return index, entry

    def check(self, index: ShardIndex) -> None:
        """Check, from the indexes alone, that every source a file's derived ranges name is
        there, inside the checkpoint, holds the elements asked for and holds them itself (not
        derived in turn): what ``nvcomp-ckpt verify`` checks, and every load first."""
        for i, storage in enumerate(index.storages):
            for r in storage.derived:
                source, entry = self._entry(r.file, r.tensor, needed_by=index.path)
                numel = math.prod(entry.shape)
                where = f"{index.path}: {container.storage_name(index, i)})"
                if r.start + r.count > numel or entry.dtype not in FLOAT_DTYPES:
                    raise CorruptCheckpointError(
                        f"{where} is derived from elements [{r.start}, {r.start + r.count}) of "
                        f"{r.tensor!r} in {source.path}, a {entry.dtype} tensor of {numel} elements")
                if source.storages[entry.storage].derived:
                    raise CorruptCheckpointError(
                        f"{where} is derived from {r.tensor!r} in {source.path}, which is itself "
                        "derived from other files: a source must hold the bytes it lends")

    def check_for_load(self, index: ShardIndex) -> None:
        """`check`, then, before a load allocates `index`'s derived ranges on the word of their
        sources' indexes: each source storage that declares more than its stored bytes plausibly
        hold (`formats.plausible_raw`) proven by decoding its chunks into dropped scratch
        (`pipeline.prove_storage`), so that a forged pair of files cannot make the load ask for
        what the source's bytes do not decode to."""
        import torch

        from . import pipeline

        self.check(index)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        proven: set[tuple[str, int]] = set()
        for storage in index.storages:
            for r in storage.derived:
                source, entry = self._entry(r.file, r.tensor, needed_by=index.path)
                if (r.file, entry.storage) in proven:
                    continue
                proven.add((r.file, entry.storage))
                with locations.open_reader(source.path) as reader, cf.ThreadPoolExecutor(
                        self.workers or pipeline.default_workers(), thread_name_prefix="nvckpt-source") as pool:
                    pipeline.prove_storage(reader, source, entry.storage, device, verify=self.verify,
                                           pool=pool)

    def tensor(self, name: str, key: str, device: torch.device, *, needed_by: str) -> torch.Tensor:
        """Tensor `key` of source file `name`, decoded on `device`, flattened."""
        from . import pipeline

        index, entry = self._entry(name, key, needed_by=needed_by)
        with locations.open_reader(index.path) as reader, cf.ThreadPoolExecutor(
                self.workers or pipeline.default_workers(), thread_name_prefix="nvckpt-source") as pool:
            buf = pipeline.read_storage(reader, index, entry.storage, device, verify=self.verify, pool=pool)
        return pipeline.view_tensor(buf, entry, index.path).reshape(-1)

    def fill(self, index: ShardIndex, outs: dict[int, torch.Tensor]) -> None:
        """Write the derived ranges of each storage `i` of `index` into its span ``outs[i]``
        (a `pipeline.DerivedFiller`); each source tensor is decoded once, on the device of the
        first span that needs it."""
        from . import derived

        by_source: dict[tuple[str, str], list[tuple[int, DerivedRange]]] = collections.defaultdict(list)
        for i in outs:
            for r in index.storages[i].derived:
                by_source[(r.file, r.tensor)].append((i, r))
        for (name, key), ranges in by_source.items():
            source = self.tensor(name, key, outs[ranges[0][0]].device, needed_by=index.path)
            for i, r in ranges:
                derived.copy_range(r, source, outs[i], where=f"{index.path}: {container.storage_name(index, i)})",
                                   source_path=self._indexes[name].path)
            del source

    def check_digests(self, index: ShardIndex) -> None:
        """After `check`: that each derived range rebuilt from its source has the digest its
        writer recorded (format version 4; older files recorded none), without building
        `index`'s storages: each source tensor decoded once, in host memory, each range cast on
        its own: what ``nvcomp-ckpt verify`` adds to `check` where torch is installed (a load
        checks the digests as it fills the ranges, `fill`)."""
        import torch

        from . import derived

        by_source: dict[tuple[str, str], list[tuple[int, DerivedRange]]] = collections.defaultdict(list)
        for i, storage in enumerate(index.storages):
            for r in storage.derived:
                if r.digest is not None:
                    by_source[(r.file, r.tensor)].append((i, r))
        for (name, key), ranges in by_source.items():
            source = self.tensor(name, key, torch.device("cpu"), needed_by=index.path)
            for i, r in ranges:
                piece = source[r.start : r.start + r.count].to(container.DTYPES[r.dtype])
                derived.check_digest(r, piece.view(torch.uint8),
                                     where=f"{index.path}: {container.storage_name(index, i)})",
                                     source=self._indexes[name].path)
            del source


__all__ = ["SiblingSources"]
