"""`nvcomp-ckpt inspect`: codecs, sizes and ratios of a shard, tag or save directory, from the
shard indexes alone (no tensor is decoded)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .. import manifest
from ..container import read_index
from ..describe import describe_index
from ..errors import CheckpointError
from ..storage import locations
from ..tiers.local import tier_copies
from .common import (
    SubParsers,
    Target,
    add_local_tier_option,
    dcp_folder,
    no_shards_error,
    print_tier_copies,
    resolve_target,
    size_text,
    target_files,
)


def describe_shard(path: Path, name: str) -> dict[str, Any]:
    """One shard's metadata from its index alone: per-file, per-storage and per-tensor figures."""
    return describe_index(read_index(path), name)


def _totals(files: list[dict[str, Any]]) -> dict[str, Any]:
    files = [f for f in files if "error" not in f]
    raw = sum(f["raw_bytes"] for f in files)
    on_disk = sum(f["file_bytes"] for f in files)
    return {
        "files": len(files),
        "tensors": sum(len(f["tensors"]) for f in files),
        "raw_bytes": raw,
        "tensor_raw_bytes": sum(f["tensor_raw_bytes"] for f in files),
        "stored_bytes": sum(f["stored_bytes"] for f in files),
        "overhead_bytes": sum(f["overhead_bytes"] for f in files),
        "file_bytes": on_disk,
        "ratio": raw / on_disk if on_disk else 1.0,
    }


def _describe_or_error(name: str, path: Path) -> dict[str, Any]:
    try:
        return describe_shard(path, name)
    except (CheckpointError, OSError) as exc:
        return {"path": name, "error": str(exc)}


def _manifest_summary(found: manifest.Manifest) -> dict[str, Any]:
    return {"tag": found.tag, "step": found.step, "world_size": found.world_size,
            "layout": dict(found.layout), "versions": dict(found.versions),
            "files": len(found.files), "raw_bytes": found.raw_bytes,
            "file_bytes": found.file_bytes}


def _io_of(found: manifest.Manifest | None, name: str) -> str | None:
    """How the manifest says the file's GPU payloads were written (``"gds"``, ``"gds-compat"``,
    ``"pinned"``, ``"host"``); None without a manifest or where its record does not say."""
    ways = {r.io for r in (found.files if found is not None else ()) if r.path == name}
    return ways.pop() if len(ways) == 1 else None


def inspect_target(target: Target) -> dict[str, Any]:
    """The JSON document `inspect --json` prints; a file that cannot be read gets an "error"."""
    found = target_files(target)
    files = [{**_describe_or_error(name, path), "io": _io_of(found.manifest, name)}
             for name, path in found.files]
    return {
        "path": str(target.path),
        "tag": target.tag,
        "manifest": None if found.manifest is None else _manifest_summary(found.manifest),
        "manifest_error": found.manifest_error,
        "files": files,
        "totals": _totals(files),
    }


def _codec_name(descriptor: dict[str, Any]) -> str:
    options = descriptor.get("options") or {}
    mode = options.get("data_type")
    return f"{descriptor['name']}/{descriptor.get('version', '?')}" + (f"({mode})" if mode else "")


def _layout_summary(layout: dict[str, Any]) -> dict[str, Any]:
    """The layout for a line of text: the reshard record (a parameter list) as its counts;
    ``--json`` gives it whole."""
    groups = layout.get("zero_partitions")
    if groups is None:
        return layout
    counted = f"{len(groups)} param groups, {sum(len(g['params']) for g in groups)} parameters"
    return {**layout, "zero_partitions": counted}


def _print_inspection(doc: dict[str, Any], *, tensors: bool) -> None:
    print(doc["path"] + (f"  (tag {doc['tag']})" if doc["tag"] else ""))
    if doc["manifest"] is not None:
        m = doc["manifest"]
        print(f"  manifest: {m['files']} files, world size {m['world_size']}, "
              f"layout {json.dumps(_layout_summary(m['layout']), sort_keys=True)}")
    elif doc["manifest_error"] is not None:
        print(f"  manifest: NONE USABLE: {doc['manifest_error']}")
    for f in doc["files"]:
        if "error" in f:
            print(f"  {f['path']}: ERROR: {f['error']}")
            continue
        derived = (f", {size_text(f['derived_bytes'])} derived from {len(f['derived_from'])} other "
                   "file(s)" if f["derived_bytes"] else "")
        io = f", written {f['io']}" if f["io"] else ""
        print(f"  {f['path']}: {len(f['tensors'])} tensors, raw {size_text(f['raw_bytes'])}, "
              f"file {size_text(f['file_bytes'])}, ratio {f['ratio']:.3f}x, "
              f"codecs {','.join(f['codecs']) or '-'}, format v{f['format_version']}{derived}{io}")
        _print_overhead_note(f, "    ", "file")
        if tensors:
            _print_tensor_rows(f)
    t = doc["totals"]
    print(f"total: {t['files']} files, {t['tensors']} tensors, raw {size_text(t['raw_bytes'])}, "
          f"on disk {size_text(t['file_bytes'])}, ratio {t['ratio']:.3f}x")
    _print_overhead_note(t, "  ", "checkpoint")


def _print_overhead_note(figures: dict[str, Any], indent: str, what: str) -> None:
    """Why a ratio is below 1: fixed per-file bytes dominate the file.

    Every shard carries a 4 KiB header, its index and a trailer; a file with little data (a
    ZeRO-3 model-states file holds no parameters) is mostly those, so its ratio drops below 1.
    """
    size = figures["file_bytes"]
    if figures["raw_bytes"] >= size or 2 * figures["overhead_bytes"] <= size:
        return
    tensors = figures["tensor_raw_bytes"]
    data = (f"its tensors alone: {size_text(tensors)} -> {size_text(figures['stored_bytes'])} "
            f"({tensors / figures['stored_bytes']:.3f}x)" if figures["stored_bytes"]
            else "it holds no tensor data")
    print(f"{indent}note: {size_text(figures['overhead_bytes'])} of this {size_text(size)} {what} is "
          "fixed per-file overhead (header, index, trailer), so the ratio reflects its small "
          f"size, not the codec; {data}")


def _print_tensor_rows(f: dict[str, Any]) -> None:
    """One row per tensor; a storage that several tensors view (ZeRO's flat buffers), or that
    one tensor views only part of, gets its own row once, its tensors indented below it."""
    storages, rows = f["storages"], {r["key"]: r for r in f["tensors"]}
    shown: set[int] = set()
    for r in f["tensors"]:
        s = storages[r["storage"]]
        if len(s["tensors"]) == 1 and r["nbytes"] == s["raw_bytes"]:
            print(f"    {_tensor_text(r)}  {_storage_text(s)}")
        elif r["storage"] not in shown:
            shown.add(r["storage"])
            print(f"    storage {r['storage']}, viewed by {len(s['tensors'])} tensor(s): "
                  f"{_storage_text(s)}")
            for key in s["tensors"]:
                print(f"      {_tensor_text(rows[key])}  {size_text(rows[key]['nbytes'])}")


def _tensor_text(row: dict[str, Any]) -> str:
    shape = "x".join(map(str, row["shape"])) or "scalar"
    return f"{row['key']}  {row['dtype']}[{shape}]"


def _storage_text(storage: dict[str, Any]) -> str:
    derived = (f", {size_text(storage['derived_bytes'])} derived from "
               f"{', '.join(storage['derived_from'])}" if storage["derived_bytes"] else "")
    return (f"{_codec_name(storage['codec'])}  {storage['transform'].get('name', '-')}  "
            f"{size_text(storage['raw_bytes'])} -> {size_text(storage['stored_bytes'])} "
            f"({storage['ratio']:.3f}x{derived})")


def run(args: argparse.Namespace) -> int:
    folder = dcp_folder(args.path)
    if folder is not None:
        from .. import dcp

        files = dcp.inspect_dcp(folder)
        doc = {"path": str(folder), "tag": None, "kind": "dcp", "manifest": None,
               "manifest_error": None, "files": files,
               "totals": _totals(files)}
    else:
        target = resolve_target(args.path, args.tag)
        doc = inspect_target(target)
        if not doc["files"]:
            raise no_shards_error(target.path, locations.location(args.path))
    tag = doc["tag"] or locations.location(doc["path"]).name
    if args.local_tier:
        doc["local_tier"] = tier_copies(args.local_tier, tag)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_inspection(doc, tensors=not args.files_only)
        if args.local_tier:
            print_tier_copies(doc["local_tier"], tag)
    damaged = any(entry["damaged"] for entry in doc.get("local_tier", ()))
    return 1 if damaged or any("error" in f for f in doc["files"]) else 0


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("inspect", help="codecs, sizes and ratios of a shard, tag or save dir",
                       description="Show per-file and per-tensor codec, transform, raw and "
                       "stored sizes from the shard indexes (no tensor is decoded).")
    p.add_argument("path", help="a shard file, a tag folder, or a save directory")
    p.add_argument("--tag", help="in a save directory: the tag to show (default: 'latest', or "
                   "'latest_universal' in a universal checkpoint's folder)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--files-only", action="store_true", help="leave out the per-tensor rows")
    add_local_tier_option(p)
    p.set_defaults(func=run)
