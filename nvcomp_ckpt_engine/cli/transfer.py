"""A conversion command's checkpoint on an object store: its input fetched into a temporary
local folder before the command reads it, its output put under the URL once written.

The conversion commands (`compress`, `decompress`, `to-universal`, `zero-to-fp32`) walk a folder
tree, follow the links that stay inside it, and publish their output folder with one rename
(`common.plan_conversion`, `fileio.staged_directory`); `zero-to-fp32` runs DeepSpeed's own
converter, which opens files by path. For a URL they run on a local copy instead:

- an input URL (SRC) is copied object by object into a temporary folder: with a tag named, only
  that tag's objects and the objects beside the tags (``latest``, ...); the command then reads the
  copy with every check it makes of a folder (the manifest, sizes, CRCs, the allowlist);
- an output URL (OUT) must hold no object yet (checked before any work); the command writes a
  temporary folder, and its files are then put under the URL: first the files, then each
  folder's commit point (our manifest, DCP's ``.metadata``), then ``latest`` and
  ``latest_universal``, so the output reads complete only once everything it names is there, as
  a save commits. A command that fails leaves nothing under OUT but what it had put there when
  it failed: no commit point while a file is missing.

The temporary folders are made under ``$TMPDIR`` and removed at the end, whatever happens; that
disk needs room for the checkpoint (compressed, for an input; as written, for an output).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator

from .. import discovery, manifest
from ..errors import CheckpointError
from ..storage import locations, open_storage
from .common import UsageError

#: Objects put after every other file of the output: each folder's commit point (in one folder,
#: DCP's `.metadata` before our manifest, which records it: they sort so) ...
_COMMIT_POINTS = (".metadata", manifest.MANIFEST_NAME)
#: ... and after those, the save folder's pointers to its tags.
_POINTERS = (discovery.LATEST_NAME, discovery.LATEST_UNIVERSAL_NAME)


def _keys_under(where: str) -> list[str]:
    """Every object under `where` (a URL or a folder), recursively, as keys relative to it."""
    storage, found, prefixes = open_storage(where), [], [""]
    while prefixes:
        for entry in storage.list(prefixes.pop()):
            if entry.is_prefix:
                prefixes.append(entry.key)
            elif not (entry.is_link or entry.special):
                found.append(entry.key)
    return sorted(found)


def fetch(url: str, dest: str, *, tag: str | None = None) -> int:
    """Copy the objects under `url` (with `tag`, only the tag's and the top-level ones) into
    the folder `dest`; returns how many. A URL that holds nothing is a `UsageError` naming it."""
    keys = [key for key in _keys_under(url)
            if tag is None or "/" not in key or key.startswith(f"{tag}/")]
    if not keys:
        raise UsageError(f"{url} does not exist (no object under it)")
    local = open_storage(dest)
    for key in keys:
        folder = key.rpartition("/")[0]
        local.ensure_prefix(folder)
        locations.copy(f"{url}/{key}", os.path.join(dest, *key.split("/")), durable=False)
    return len(keys)


def _put_order(key: str) -> tuple[int, str]:
    """Files first, then commit points, then the save folder's pointers."""
    name = key.rpartition("/")[2]
    if "/" not in key and name in _POINTERS:
        return 2, key
    return (1 if name in _COMMIT_POINTS else 0), key


def upload(folder: str, url: str) -> int:
    """Put every file under `folder` at the same key under `url`, commit points and pointers
    last (`_put_order`); returns how many."""
    keys = sorted(_keys_under(folder), key=_put_order)
    for key in keys:
        locations.copy(os.path.join(folder, *key.split("/")), f"{url}/{key}")
    return len(keys)


def _renamed(exc: CheckpointError | UsageError, local: str, url: str) -> CheckpointError | UsageError:
    """`exc` with the temporary folder's path in its message replaced by the URL it stands for."""
    text = str(exc)
    if local not in text:
        return exc
    return type(exc)(text.replace(local, url))


def check_apart(src: str, out: str) -> None:
    """Refuse an output URL inside the input URL or around it (the local checks compare the
    temporary copies, which never overlap)."""
    if locations.is_url(src) and locations.is_url(out) and (
            locations.is_inside(out, src) or locations.is_inside(src, out)):
        raise UsageError(f"refusing to write {out} into or around the checkpoint {src}; "
                         "choose an output prefix outside it")


@contextlib.contextmanager
def _naming(local: str, url: str) -> Iterator[None]:
    """Within the block, a `CheckpointError` or `UsageError` naming the temporary folder `local`
    names `url` instead."""
    try:
        yield
    except (CheckpointError, UsageError) as exc:
        renamed = _renamed(exc, local, url)
        if renamed is exc:
            raise
        raise renamed from exc


def _folder_name(url: str) -> str:
    """The name a URL's temporary folder gets: its last segment, as a command names an output
    after its input's folder (a tag folder's name is its tag); a bare bucket's, "checkpoint"."""
    return locations.location(url).name or "checkpoint"


@contextlib.contextmanager
def local_input(src: str, *, tag: str | None = None) -> Iterator[str]:
    """`src` as a local folder: itself for a path; for a URL, a temporary copy (`fetch`),
    removed at the end. An error naming the copy names the URL instead."""
    if not locations.is_url(src):
        yield src
        return
    with tempfile.TemporaryDirectory(prefix="nvcomp-ckpt-in-") as tmp:
        local = os.path.join(tmp, _folder_name(src))
        fetch(src, local, tag=tag)
        with _naming(local, src):
            yield local


@contextlib.contextmanager
def local_output(out: str) -> Iterator[str]:
    """`out` as a local folder to write: itself for a path; for a URL that holds no object, a
    temporary folder whose files are put under the URL when the block ends without an error
    (`upload`)."""
    if not locations.is_url(out):
        yield out
        return
    if next(iter(open_storage(out).list()), None) is not None:
        raise UsageError(f"{out} already holds objects; choose a new, empty prefix")
    with tempfile.TemporaryDirectory(prefix="nvcomp-ckpt-out-") as tmp:
        local = os.path.join(tmp, _folder_name(out))
        with _naming(local, out):
            yield local
        upload(local, out)


@contextlib.contextmanager
def local_tag_conversion(src: str, out: str, tag: str | None) -> Iterator[tuple[str, str]]:
    """A conversion of one tag of a save folder (`to-universal`, `zero-to-fp32`) on local
    folders: `check_apart`, then `local_output` and `local_input` of only the tag it converts
    (`tag`, or for a URL the one ``latest`` names, fetched alone); yields (input, output)."""
    check_apart(src, out)
    if tag is None and locations.is_url(src):
        tag = discovery.inspect_latest(src).tag
    with local_output(out) as local_out, local_input(src, tag=tag) as local_in:
        yield local_in, local_out
