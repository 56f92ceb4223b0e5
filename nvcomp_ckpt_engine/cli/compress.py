"""`nvcomp-ckpt compress`: a plain torch.save checkpoint turned into engine shards with a manifest
per tag, so it loads through the engine."""

from __future__ import annotations

import argparse
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import commit, discovery, manifest
from .._version import __version__
from ..api import save
from ..options import DEFAULT_CHUNK_MB
from ..formats import ALGORITHMS
from ..compat import wrap_recovery_script
from ..container import is_torch_file
from ..deepspeed.names import layout_hints, rank_of
from ..errors import CheckpointError
from ..pipeline import ShardInfo
from ..fileio import is_inside, staged_directory
from . import transfer
from .common import (
    Conversion,
    SubParsers,
    check_output_dir,
    copy_file,
    other_files,
    plan_conversion,
    progress_bar,
    size_text,
)


def _is_plain_tag(directory: Path) -> bool:
    """Whether `directory` holds a torch file of its own (a link out of it is not opened)."""
    return any(p.is_file() and is_inside(p, directory) and is_torch_file(p)
               for p in directory.iterdir())


def _torch_load_input(path: Path, *, trusted: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        reason = next((line.strip() for line in str(exc).splitlines() if "Unsupported" in line),
                      str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise CheckpointError(
            f"{path}: torch.load(weights_only=True) refused it ({reason}). DeepSpeed's optimizer "
            "files hold such objects; if you trust the files, run again with --trusted."
        ) from exc


@dataclass(frozen=True)
class CompressedFile:
    """One torch file compressed into a shard: where it is in the tag, and what `save` wrote."""

    rel: str
    info: ShardInfo


def compress_tag(tag_dir: Path, out_tag: Path, *, options: dict[str, Any], trusted: bool,
                 progress: bool) -> tuple[list[CompressedFile], dict[str, Any]]:
    """Compress every torch file of a tag folder and copy the rest.

    Returns the shards written and the layout hints found in them.
    """
    found = other_files(tag_dir, skip=lambda p: False)  # links out left out, with a warning
    torch_files = [p for p in found if is_torch_file(p)]
    commit.prepare_tag_dir(out_tag.parent, out_tag.name, rank=0)  # the engine's tag marker
    written, hints = [], {}
    for path in progress_bar(torch_files, progress, f"compressing {tag_dir.name}"):
        obj = _torch_load_input(path, trusted=trusted)
        hints.update(layout_hints(obj))
        dest = out_tag / path.relative_to(tag_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        info = save(obj, dest, **options)
        written.append(CompressedFile(path.relative_to(tag_dir).as_posix(), info))
    for path in (p for p in found if p not in torch_files):
        copy_file(path, out_tag / path.relative_to(tag_dir))
    return written, hints


def build_tag_manifest(tag: str, files: list[CompressedFile],
                       hints: dict[str, Any]) -> manifest.Manifest:
    """The manifest a single-process save of these files would have had.

    With DeepSpeed's layout hints the layout is built as the DeepSpeed adapter builds its own
    (`manifest.layout_record`), so the engine checks the result's layout as it checks one it
    saved; without them, the files are attributed to rank 0 of a world of one.
    """
    tp = hints.get("tp", 1)
    records = [
        manifest.ShardRecord(path=f.rel, rank=rank_of(Path(f.rel).name, tp),
                             raw_bytes=f.info.raw_bytes, file_bytes=f.info.file_bytes,
                             crc32=f.info.crc32, codecs=tuple(f.info.codecs), io=f.info.io)
        for f in files
    ]
    versions = {"nvcomp_ckpt_engine": __version__, "torch": torch.__version__}
    layout, world_size = manifest.layout_record("torch"), 1
    if "dp" in hints:
        layout = manifest.layout_record("deepspeed", dp=hints["dp"], tp=hints["tp"],
                                        pp=hints["pp"], zero_stage=hints.get("zero_stage"))
        world_size = hints["dp"] * hints["tp"] * hints["pp"]
    if "deepspeed_version" in hints:
        versions["deepspeed"] = hints["deepspeed_version"]
    return manifest.build_manifest(
        tag=tag, world_size=max([world_size] + [r.rank + 1 for r in records]), files=records,
        layout=layout, versions=versions, step=hints.get("step"), created_unix_ns=time.time_ns(),
    )


def run(args: argparse.Namespace) -> int:
    transfer.check_apart(args.src, args.dst)
    with transfer.local_output(args.dst) as out, transfer.local_input(args.src, tag=args.tag) as src:
        tags, raw, on_disk = _convert(Path(src), Path(out), args)
    ratio = raw / on_disk if on_disk else 1.0
    print(f"wrote {tags} tag(s) to {args.dst}: raw {size_text(raw)} -> {size_text(on_disk)} "
          f"({ratio:.3f}x)")
    return 0


def _convert(src: Path, out: Path, args: argparse.Namespace) -> tuple[int, int, int]:
    """Compress the local folder `src` into `out`: the tags written, raw and on-disk bytes."""
    plan = plan_conversion(src, args.tag, _is_plain_tag)
    check_output_dir(src, out, plan)
    with staged_directory(out) as staging:
        raw, on_disk = _compress_plan(plan, staging, args)
    return len(plan.tags), raw, on_disk


def _compress_plan(plan: Conversion, out: Path, args: argparse.Namespace) -> tuple[int, int]:
    """Write the plan's tags (shards and manifests), top-level files and `latest` into `out`;
    returns the raw and on-disk bytes of the shards."""
    options = {"algorithm": args.algorithm, "portable": args.portable, "chunk_mb": args.chunk_mb}
    raw = on_disk = 0
    for tag_dir in plan.tags:
        files, hints = compress_tag(tag_dir, out / tag_dir.name, options=options,
                                    trusted=args.trusted, progress=not args.quiet)
        # Written last, once every shard is durable: the tag is complete from here on.
        manifest.write_manifest(out / tag_dir.name, build_tag_manifest(tag_dir.name, files, hints))
        raw += sum(f.info.raw_bytes for f in files)
        on_disk += sum(f.info.file_bytes for f in files)
    for path in plan.top_files:
        copy_file(path, out / path.name)
    wrap_recovery_script(out)
    if plan.latest is not None:
        discovery.write_latest(out, plan.latest)
    return raw, on_disk


def add_codec_options(p: argparse.ArgumentParser) -> None:
    """--algorithm, --portable and --chunk-mb: how a command that writes shards compresses them."""
    p.add_argument("--algorithm", default="auto", choices=ALGORITHMS,
                   help="codec of the written shards (default: auto, chosen per storage from a "
                   "sample)")
    p.add_argument("--portable", action="store_true",
                   help="only codecs a machine without a GPU can decode (zstd, deflate, none)")
    p.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_MB,
                   help=f"chunk size in MiB (default {DEFAULT_CHUNK_MB})")


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("compress", help="turn a plain torch.save checkpoint into engine shards",
                       description="Compress every torch.save file of a DeepSpeed checkpoint into "
                       "an engine shard at the same relative path and write each tag's manifest, "
                       "so the result loads through the engine. Other files are copied.")
    p.add_argument("src", help="a plain save directory (all tags, or --tag) or one tag folder; "
                   "a path or an s3:// URL")
    p.add_argument("dst", help="a new or empty directory outside SRC (or an s3:// prefix that "
                   "holds no object)")
    p.add_argument("--tag", help="in a save directory: convert only this tag")
    add_codec_options(p)
    p.add_argument("--trusted", action="store_true",
                   help="read inputs with torch.load(weights_only=False): only for files you "
                   "trust (DeepSpeed's optimizer files need it)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
