"""`nvcomp-ckpt to-universal`: DeepSpeed's universal checkpoint written straight from the engine's
shards, compressed (the conversion itself is deepspeed/universal.py)."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import sys
from pathlib import Path
from typing import Any, Iterable, TypeVar

from tqdm import tqdm

from ..fileio import staged_directory
from ..storage import locations
from . import transfer
from .common import (
    Conversion,
    SubParsers,
    UsageError,
    check_output_dir,
    resolve_target,
    size_text,
)
from .compress import add_codec_options

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: glibc's `mallopt` parameter: the size from which malloc gives a buffer a mapping of its own.
_M_MMAP_THRESHOLD = -3


def _map_large_buffers() -> None:
    """Give every buffer of 1 MiB or more its own mapping, returned to the OS when freed.

    glibc raises this threshold (up to 32 MiB) whenever such a buffer is freed, and from then on
    chunk-sized buffers come from per-thread heaps that keep what is freed: a conversion's
    resident memory grew to 3.4 times what it held at once (16 MiB chunks, measured). A fixed
    threshold keeps it at what is live. Where glibc is not the allocator, nothing changes.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        logger.debug("no glibc mallopt here: the allocator keeps its own policy")


def run(args: argparse.Namespace) -> int:
    # Imported here: DeepSpeed takes seconds to import and most commands do not need it.
    from ..deepspeed import universal

    _map_large_buffers()
    with transfer.local_tag_conversion(args.ckpt_dir, args.out_dir, args.tag) as (src, out):
        done = _convert(universal, Path(src), Path(out), args)
    shown = locations.location(args.out_dir)
    found = done.manifest
    ratio = found.raw_bytes / found.file_bytes if found.file_bytes else 1.0
    print(f"wrote the universal checkpoint {shown / found.tag} (ZeRO-{done.zero_stage}, saved at "
          f"data-parallel size {done.dp_size}; {done.parameters} parameters, {len(found.files)} "
          f"files, raw {size_text(found.raw_bytes)} -> {size_text(found.file_bytes)}, {ratio:.3f}x) and "
          f"{shown / universal.LATEST_UNIVERSAL}")
    print('resume at any data-parallel size with "checkpoint": {"load_universal": true} in '
          f"ds_config and engine.load_checkpoint({str(shown)!r})")
    return 0


def _convert(universal: Any, src: Path, out: Path, args: argparse.Namespace) -> Any:
    """The conversion of the local folder `src` into `out` (`universal.convert`'s result)."""
    target = resolve_target(src, args.tag)
    if target.is_file:
        raise UsageError(f"{src} is a file; give a save directory or a tag folder")
    check_output_dir(src, out, Conversion((target.path,), (), target.tag, every_tag=False))
    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")

    def progress(items: Iterable[T], total: int) -> Iterable[T]:
        if args.quiet:
            return items
        return tqdm(items, total=total, desc=f"to-universal {target.path.name}", unit="param",
                    file=sys.stderr, leave=False)

    with staged_directory(out) as staging:
        return universal.convert(target.path, staging, trusted=args.trusted,
                                 workers=args.workers, algorithm=args.algorithm,
                                 portable=args.portable, chunk_mb=args.chunk_mb, progress=progress)


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("to-universal", help="write DeepSpeed's universal checkpoint, compressed",
                       description="Write the DeepSpeed universal checkpoint of a ZeRO checkpoint "
                       "(what deepspeed.checkpoint.ds_to_universal writes, file for file) straight "
                       "from the engine's shards, itself compressed and with a manifest, so a job "
                       'can resume at another data-parallel size with "checkpoint": '
                       '{"load_universal": true}. No decompressed copy is written; memory stays '
                       "bounded by a few parameters and the model-states file.")
    p.add_argument("ckpt_dir", help="a save directory (its 'latest', or --tag) or one tag "
                   "folder; a path or an s3:// URL")
    p.add_argument("out_dir", help="a new or empty directory outside CKPT_DIR (or an s3:// prefix "
                   "that holds no object): gets OUT_DIR/<tag>/ and OUT_DIR/latest_universal")
    p.add_argument("--tag", help="in a save directory: the tag to convert (default: 'latest')")
    p.add_argument("--workers", type=int, default=4,
                   help="parameters converted at once (default 4; each holds up to twice its "
                   "fp32 size in memory)")
    add_codec_options(p)
    p.add_argument("--trusted", action="store_true",
                   help="let the files create any class (skip the allowlist); only for files "
                   "you trust")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
