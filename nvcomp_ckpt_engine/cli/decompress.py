"""`nvcomp-ckpt decompress`: an engine checkpoint written back as plain torch.save files, which
DeepSpeed's own tools (``zero_to_fp32``, ``ds_to_universal``) read."""

from __future__ import annotations

import argparse
import io
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from .. import discovery
from ..container import is_shard_file
from ..deepspeed import allowlist as _ds_allowlist  # noqa: F401  (registers DeepSpeed's objects)
from ..errors import IncompleteCheckpointError
from ..fileio import staged_directory
from ..storage import SinkIO, locations
from ..tagreader import TagReader
from . import transfer
from .common import (
    Conversion,
    SubParsers,
    check_empty_output,
    check_output_dir,
    copy_file,
    dcp_folder,
    other_files,
    plan_conversion,
    progress_bar,
)

logger = logging.getLogger(__name__)


def _torch_save_atomically(obj: Any, dest: Path) -> None:
    """torch.save into a storage sink (a temporary name, fsync, rename on POSIX): a crash
    never leaves a torn file."""
    storage, key = locations.resolve(dest, write=True)  # the storage of dest's folder
    storage.ensure_prefix("")
    with storage.open_sink(key) as sink:
        with io.BufferedWriter(SinkIO(sink), 16 << 20) as f:
            torch.save(obj, f)
        sink.finish()


def decompress_tag(tag_dir: Path, out_tag: Path, *, trusted: bool, progress: bool) -> int:
    """Write every shard of a complete tag as a torch.save file; copy the other files.

    The manifest decides what the checkpoint is: all its files must be present with the right
    sizes before anything is written (each chunk's checksum is then checked as it is loaded).
    A shard file the manifest does not list is left out, with a warning. Returns the number of
    shard files converted.
    """
    reader = TagReader(tag_dir, trusted=trusted)
    shards = {rel: reader.path(rel) for rel in reader.paths}
    for rel in progress_bar(reader.paths, progress, f"decompressing {tag_dir.name}"):
        _torch_save_atomically(reader.load(rel), out_tag / rel)

    def listed_or_stray_shard(path: Path) -> bool:
        if path.relative_to(tag_dir).as_posix() in shards:
            return True
        if is_shard_file(path):
            logger.warning("%s: a shard the manifest does not list (from another save?); "
                           "left out", path)
            return True
        return False

    for path in other_files(tag_dir, listed_or_stray_shard):
        copy_file(path, out_tag / path.relative_to(tag_dir))
    return len(shards)


def run(args: argparse.Namespace) -> int:
    transfer.check_apart(args.ckpt_dir, args.out_dir)
    with transfer.local_output(args.out_dir) as out, \
            transfer.local_input(args.ckpt_dir, tag=args.tag) as src:
        message = _convert(Path(src), Path(out), args)
    print(message.format(out=args.out_dir))
    return 0


def _convert(src: Path, out: Path, args: argparse.Namespace) -> str:
    """Decompress the local folder `src` into `out`; returns what was written, ``{out}`` to be
    filled in with the name the user gave."""
    if dcp_folder(src) is not None:
        from .. import dcp

        check_empty_output(out)
        with staged_directory(out) as staging:
            dcp.decompress_dcp(src, staging, trusted=args.trusted)
        return "wrote a plain torch.distributed.checkpoint to {out}"
    plan = plan_conversion(src, args.tag, discovery.is_engine_tag)
    check_output_dir(src, out, plan)
    with staged_directory(out) as staging:
        converted, written = _decompress_plan(plan, staging, args)
    return f"wrote {converted} torch.save files in {len(written)} tag(s) to {{out}}"


def _decompress_plan(plan: Conversion, out: Path,
                     args: argparse.Namespace) -> tuple[int, list[str]]:
    """Write the plan's tags, top-level files and `latest` into `out`; returns the number of
    files converted and the tags written."""
    written, converted = [], 0
    for tag_dir in plan.tags:
        try:
            converted += decompress_tag(tag_dir, out / tag_dir.name, trusted=args.trusted,
                                        progress=not args.quiet)
        except IncompleteCheckpointError as exc:
            if not plan.every_tag:
                raise
            print(f"warning: skipping incomplete tag {tag_dir.name}: {exc}", file=sys.stderr)
            continue
        written.append(tag_dir.name)
    for path in plan.top_files:
        copy_file(path, out / path.name)
    if plan.latest in written:
        discovery.write_latest(out, plan.latest)
    return converted, written


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("decompress", help="write a plain DeepSpeed (torch.save) checkpoint",
                       description="Convert an engine checkpoint to plain torch.save files at the "
                       "same relative paths (plus 'latest', without the manifest), which "
                       "DeepSpeed's zero_to_fp32 and ds_to_universal read. A tag folder is "
                       "written to OUT_DIR/<tag>/. Incomplete tags of a save directory are "
                       "skipped with a warning.")
    p.add_argument("ckpt_dir", help="a save directory (all tags, or --tag) or one tag folder; "
                   "a path or an s3:// URL")
    p.add_argument("out_dir", help="a new or empty directory outside CKPT_DIR (or an s3:// "
                   "prefix that holds no object)")
    p.add_argument("--tag", help="in a save directory: convert only this tag")
    p.add_argument("--trusted", action="store_true",
                   help="let the files create any class (skip the allowlist); only for files "
                   "you trust")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
