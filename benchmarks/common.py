"""Helpers the benchmark scripts share: cold-cache loads and on-disk sizes."""

from __future__ import annotations

import os
from pathlib import Path


def drop_page_cache(folder: Path) -> str:
    """Evict the checkpoint's pages so a load reads from storage (best effort; says how)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for path in folder.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "posix_fadvise"


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under `folder`."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
