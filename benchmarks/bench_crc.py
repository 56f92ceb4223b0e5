"""A large file's CRC-32 check against its manifest record, on one thread and in segments on
several, side by side in one run.

One file of `--gb` bytes in `--scratch`, a manifest that records its size and CRC-32, and
`manifest_files.check_files` timed with a pool of one thread (the file read front to back in
16 MiB blocks, one after the other: the check as it was before files were split into segments)
and with pools of each of `--threads` (64 MiB segments, their CRC-32s combined in order), and
without a pool (`default_crc_threads()`: what `verify_files` and a load's
``"fallback_to_complete": "verify"`` use). Each with the page cache warm (the file read once
first) and, unless `--warm-only`, cold (the file's pages dropped before each run, `evict`: the
file's own only, so other processes' caches stay; a tmpfs folder such as /dev/shm has no other
copy to drop them to, so use `--warm-only` there). Medians of `--reps` runs, runs of each pool taking turns.

    python benchmarks/bench_crc.py --gb 2 --scratch /tmp/bc --out results/
    python benchmarks/bench_crc.py --gb 2 --scratch /dev/shm/bc --warm-only --out results/
    python benchmarks/bench_crc.py --gb 0.05 --reps 1 --scratch /tmp/bc   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
import zlib
from pathlib import Path

from nvcomp_ckpt_engine import manifest_files
from nvcomp_ckpt_engine.manifest import ShardRecord, build_manifest

MiB = 1 << 20
NAME = "big.pt"


def write_file(path: Path, nbytes: int) -> int:
    """`nbytes` of random 16 MiB blocks (each one different), written; their CRC-32."""
    crc = 0
    with open(path, "wb") as out:
        done = 0
        while done < nbytes:
            block = os.urandom(min(16 * MiB, nbytes - done))
            out.write(block)
            crc = zlib.crc32(block, crc)
            done += len(block)
    return crc


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache (clean since its write was synced), so the
    next read comes from the disk; `common.drop_page_cache` would drop every process's."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed_check(folder: Path, manifest, threads: int | None) -> float:
    """Seconds of one `check_files` with a pool of `threads` (None: no pool); it must pass."""
    start = time.perf_counter()
    if threads is None:
        _, problems = manifest_files.check_files(folder, manifest)
    else:
        with manifest_files.CrcPool(threads) as pool:
            _, problems = manifest_files.check_files(folder, manifest, crc_pool=pool)
    seconds = time.perf_counter() - start
    if problems:
        raise SystemExit(f"the check found problems: {problems}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0, help="file size in GB")
    parser.add_argument("--threads", default="2,4,8", help="pool sizes besides 1, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warm-only", action="store_true", help="no cold runs (a tmpfs scratch folder)")
    parser.add_argument("--scratch", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None, help="where bench_crc.json goes")
    args = parser.parse_args(argv)

    folder = args.scratch / "global_step1"
    shutil.rmtree(args.scratch, ignore_errors=True)
    folder.mkdir(parents=True)
    nbytes = int(args.gb * 1e9)
    crc = write_file(folder / NAME, nbytes)
    record = ShardRecord(path=NAME, rank=0, raw_bytes=nbytes, file_bytes=nbytes, crc32=crc,
                         codecs=("none",))
    manifest = build_manifest(tag="global_step1", world_size=1, files=[record], layout={},
                              created_unix_ns=time.time_ns())
    pools: list[int | None] = [1] + [int(t) for t in args.threads.split(",") if t] + [None]
    label = {p: ("default (%d)" % manifest_files.default_crc_threads() if p is None else str(p))
             for p in pools}
    report: dict = {"file_bytes": nbytes, "scratch": str(args.scratch), "reps": args.reps,
                    "cpus": len(os.sched_getaffinity(0)), "seconds": {}, "gb_per_s": {}}
    caches = ["warm"] + ([] if args.warm_only else ["cold"])
    for cache in caches:
        runs: dict[str, list[float]] = {label[p]: [] for p in pools}
        timed_check(folder, manifest, None)  # (warms the cache; a cold run drops it anyway)
        for _ in range(args.reps):
            for pool in pools:
                if cache == "cold":
                    evict(folder / NAME)
                runs[label[pool]].append(timed_check(folder, manifest, pool))
        report["seconds"][cache] = {k: round(statistics.median(v), 3) for k, v in runs.items()}
        report["gb_per_s"][cache] = {k: round(nbytes / 1e9 / statistics.median(v), 2) for k, v in runs.items()}
        report.setdefault("all_seconds", {})[cache] = {k: [round(s, 3) for s in v] for k, v in runs.items()}
    shutil.rmtree(args.scratch, ignore_errors=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_crc.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
