"""Where checkpoint bytes live: one interface (`base.py`) and the backends behind it.

A user's location (a DeepSpeed ``save_dir``, a DCP folder, a file ``nce.save`` writes, a PATH
of ``nvcomp-ckpt``) is either a path or a URL. `open_storage` gives the storage rooted at a
location (a folder or a bucket prefix); `storage_for` the storage of the folder that holds a
location together with the location's key in it (a single file). A path gets `PosixStorage`;
``s3://bucket/prefix`` gets `S3Storage(url)` from `.s3`, imported only then; any other scheme is
refused by name.
"""

from __future__ import annotations

import os
import re
from typing import Callable

from .base import (Capabilities, NotAnObjectError, ObjectInfo, OutsideRootError, PreconditionFailed, Reader,
                   ReaderIO, ShortReadError, Sink, SinkIO, Storage, StorageError, TooLargeError, check_key,
                   join)

#: A URL's scheme, as `open_storage` tells a URL from a path.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: The schemes there is a backend for.
SCHEMES = ("s3",)


def url_scheme(location: str | os.PathLike) -> str | None:
    """The scheme of a URL location (``"s3"``), None for a path."""
    text = location if isinstance(location, str) else os.fspath(location)
    match = _SCHEME.match(text) if isinstance(text, str) else None
    return match.group(1).lower() if match else None


#: Applied to every storage `open_storage` returns, when set (`wrap_storages`).
_wrap: Callable[[Storage], Storage] | None = None


def wrap_storages(wrap: Callable[[Storage], Storage] | None) -> Callable[[Storage], Storage] | None:
    """Have `open_storage` (and so every module) return ``wrap(storage)`` instead of `storage`
    from now on, in this process; None stops it. Returns the wrapper it replaces. The place a
    test plugs a `faults.FaultPlan` into a whole job: ``wrap_storages(plan.wrap)``."""
    global _wrap
    previous, _wrap = _wrap, wrap
    return previous


def open_storage(location: str | os.PathLike) -> Storage:
    """The storage rooted at `location`: a folder path → `PosixStorage(path)`, ``s3://bucket[/prefix]``
    → `S3Storage(url)`. ValueError names an unknown scheme."""
    storage = _backend(location)
    return storage if _wrap is None else _wrap(storage)


def _backend(location: str | os.PathLike) -> Storage:
    scheme = url_scheme(location)
    if scheme is None:
        from .posix import PosixStorage

        return PosixStorage(location)
    if scheme == "s3":
        from .s3 import S3Storage

        return S3Storage(os.fspath(location))
    raise ValueError(f"{location}: no storage for the scheme {scheme!r}:// (known: "
                     + ", ".join(f"{s}://" for s in SCHEMES) + ", or a path)")


def is_file(storage: Storage, key: str) -> bool:
    """Whether `key` is an object with bytes (a regular file, or a link to one), as
    ``Path.is_file`` says: False for a missing key, a prefix, a FIFO or a device."""
    try:
        info = storage.stat(key)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return not (info.is_prefix or info.special)


def storage_for(location: str | os.PathLike) -> tuple[Storage, str]:
    """(the storage rooted where `location`'s last segment lives, that segment as a key): the
    form for one file (``/ckpt/model.nvc`` → the storage of ``/ckpt`` and ``"model.nvc"``;
    ``s3://b/run/model.nvc`` → the storage of ``s3://b/run`` and ``"model.nvc"``). ValueError
    for a location with no last segment (``/``, ``s3://bucket``)."""
    text = os.fspath(location)
    if url_scheme(text) is None:
        path = os.path.abspath(text)
        parent, name = os.path.split(path)
        if not name:
            raise ValueError(f"{location}: names no file inside a folder")
        return open_storage(parent), name
    head, _, name = text.rstrip("/").rpartition("/")
    if not name or head.endswith(":/") or head.endswith("://"):
        raise ValueError(f"{location}: names no object under a bucket")
    return open_storage(head), check_key(name)


__all__ = ["Capabilities", "NotAnObjectError", "ObjectInfo", "OutsideRootError", "PreconditionFailed", "Reader", "ReaderIO", "SCHEMES", "ShortReadError", "Sink", "SinkIO",
           "Storage", "StorageError", "TooLargeError", "check_key", "is_file", "join", "open_storage", "storage_for", "url_scheme",
           "wrap_storages"]
