"""Raw write and read strategies on one file system, to choose the pipeline's I/O pattern.

Write (each timed until durable, fsync included): buffered with one fsync at the end; buffered
with writeback started every 64 MiB (`os.posix_fadvise(DONTNEED)` on the range just written,
which starts its writeback on Linux); `O_DIRECT` with 16 MiB and 64 MiB aligned writes.
Read (each with the page cache dropped first): sequential 64 MiB reads on one thread;
positional reads of 16/64/256 MiB with 1/4/8 in flight; `O_DIRECT` reads.

    python benchmarks/bench_storage.py --gb 8 --scratch /tmp/bs --out results/
    python benchmarks/bench_storage.py --gb 0.05 --scratch /tmp/bs   # a smoke run

`--backend s3` instead puts the storage backends side by side in one run, through the same
pattern a shard save and load use (16 MiB appends to a sink until `finish`; 16 MiB ranged reads,
4 in flight): `PosixStorage` on the scratch folder, `S3Storage` (boto3) and obstore's client on
the same S3 server (`--endpoint-url`, else a local moto server started for the run, as the tests
start it); then a checkpoint's `nce.save` and `nce.load` (zstd on the CPU) to a POSIX path and
to an s3:// URL of that server. Each line gives MB/s of the state and the client process's CPU
seconds per GB (the server's are not counted: it runs in its own process).

    python benchmarks/bench_storage.py --backend s3 --gb 1 --scratch /tmp/bs --out results/
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import mmap
import os
import resource
import sys
import time
from pathlib import Path
from typing import Callable

from common import drop_page_cache  # benchmarks/ is on sys.path when run as a script

MiB = 1 << 20


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned memory, as O_DIRECT needs; filled with incompressible bytes."""
    buf = mmap.mmap(-1, nbytes)
    buf[:] = os.urandom(nbytes)
    return buf


def write_buffered(path: Path, nbytes: int, block: mmap.mmap, *, kick: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < nbytes:
            n = os.pwrite(fd, memoryview(block)[: min(len(block), nbytes - done)], done)
            if kick:
                os.posix_fadvise(fd, done, n, os.POSIX_FADV_DONTNEED)
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)


def write_direct(path: Path, nbytes: int, block: mmap.mmap, *, inflight: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    size = len(block)
    try:
        with cf.ThreadPoolExecutor(inflight) as pool:
            list(pool.map(lambda off: os.pwrite(fd, block, off), range(0, nbytes, size)))
        os.fsync(fd)
    finally:
        os.close(fd)


def read_positional(path: Path, block: int, inflight: int, *, direct: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    size = os.fstat(fd).st_size
    buffers = [mmap.mmap(-1, block) for _ in range(inflight)]
    try:
        def one(k: int) -> int:
            return os.preadv(fd, [buffers[k % inflight]], k * block)
        with cf.ThreadPoolExecutor(inflight) as pool:
            # Consecutive blocks, `inflight` at a time (a buffer is reused once its read is done).
            for first in range(0, -(-size // block), inflight):
                list(pool.map(one, range(first, min(first + inflight, -(-size // block)))))
    finally:
        os.close(fd)


def read_sequential(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(64 * MiB)
        while f.readinto(buf):
            pass


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_seconds() -> float:
    """CPU time of this process (all its threads), user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measured(fn: Callable[[], None], nbytes: int) -> dict[str, float]:
    start_cpu, seconds = cpu_seconds(), timed(fn)
    return {"mb_per_s": round(nbytes / seconds / 1e6, 1),
            "client_cpu_s_per_gb": round((cpu_seconds() - start_cpu) / (nbytes / 1e9), 2)}


def sink_write(storage, key: str, nbytes: int, block: memoryview) -> None:
    """A shard's save: `block`-sized appends to one sink, then `finish`."""
    with storage.open_sink(key) as sink:
        for offset in range(0, nbytes, len(block)):
            sink.append(block[: min(len(block), nbytes - offset)])
        sink.finish()


def ranged_read(storage, key: str, block: int, inflight: int) -> None:
    """A shard's load: `block`-sized ranged reads, `inflight` at a time, into reused buffers."""
    with storage.open_reader(key) as reader:
        buffers = [bytearray(block) for _ in range(inflight)]

        def one(k: int) -> None:
            length = min(block, reader.size - k * block)
            reader.read_into(k * block, memoryview(buffers[k % inflight])[:length])

        count = -(-reader.size // block)
        with cf.ThreadPoolExecutor(inflight) as pool:
            for first in range(0, count, inflight):
                list(pool.map(one, range(first, min(first + inflight, count))))


def obstore_runs(endpoint: str, bucket: str, key: str, nbytes: int, block: memoryview,
                 part_size: int, inflight: int) -> dict[str, Callable[[], None]]:
    """obstore's client on the same server and pattern: a multipart `put` of `block`-sized
    chunks, `inflight` parts at once; `get_range` reads, `inflight` in flight."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=endpoint, client_options={"allow_http": True},
                    region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))

    def write() -> None:
        chunks = (bytes(block[: min(len(block), nbytes - o)]) for o in range(0, nbytes, len(block)))
        obstore.put(store, key, chunks, chunk_size=part_size, max_concurrency=inflight)

    def read() -> None:
        count = -(-nbytes // len(block))

        def one(k: int) -> int:
            return len(obstore.get_range(store, key, start=k * len(block), end=min(nbytes, (k + 1) * len(block))))

        with cf.ThreadPoolExecutor(inflight) as pool:
            if sum(pool.map(one, range(count))) != nbytes:
                raise RuntimeError(f"obstore read of {key} came back short")

    return {"write": write, "read": read}


def engine_runs(location: str, nbytes: int) -> dict[str, Callable[[], None]]:
    """A checkpoint's save and load through the engine (`nce.save`, `nce.load`) at `location`
    (a path or an s3:// URL): float32 tensors of 64 MiB, random (compressing little, as
    optimizer state does), `nbytes` in all; the load is checked bit for bit."""
    import torch

    import nvcomp_ckpt_engine as nce

    generator = torch.Generator().manual_seed(0)
    count = max(nbytes // (64 * MiB), 1)
    state = {f"t{i}": torch.randn(min(64 * MiB, nbytes) // 4, generator=generator) for i in range(count)}

    def load() -> None:
        back = nce.load(location)
        if any(not torch.equal(back[k].view(torch.int32), v.view(torch.int32)) for k, v in state.items()):
            raise RuntimeError(f"{location} did not load bit for bit")

    return {"write": lambda: nce.save(state, location), "read": load}


def compare_backends(args: argparse.Namespace) -> dict:
    """POSIX, S3 through `S3Storage` (boto3) and S3 through obstore, one after the other."""
    from nvcomp_ckpt_engine.storage.posix import PosixStorage
    from nvcomp_ckpt_engine.storage.s3 import S3Storage

    nbytes = max(int(args.gb * 1e9) // (16 * MiB), 1) * (16 * MiB)
    block = memoryview(aligned_buffer(16 * MiB))
    server = None
    endpoint = args.endpoint_url
    if endpoint is None:
        # The server the tests start: moto in a child process on a free port, with a bucket.
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from s3_server import BUCKET, MotoServer

        server = MotoServer()
        endpoint, bucket = server.url, BUCKET
        os.environ.update(AWS_ACCESS_KEY_ID=server.access_key, AWS_SECRET_ACCESS_KEY=server.secret_key,
                          AWS_DEFAULT_REGION="us-east-1")
    else:
        bucket = args.bucket
    os.environ["AWS_ENDPOINT_URL"] = endpoint  # for the engine's own storages (nce.save to s3://)
    report: dict = {"bytes": nbytes, "endpoint": endpoint, "pattern": "16 MiB appends; 16 MiB ranged reads, 4 in flight"}
    try:
        posix = PosixStorage(args.scratch)
        s3 = S3Storage(f"s3://{bucket}/bench", endpoint_url=endpoint, part_size=16 * MiB, max_workers=4)
        s3.check()
        runs = {
            "posix": {"write": lambda: sink_write(posix, "shard.bin", nbytes, block),
                      "read": lambda: ranged_read(posix, "shard.bin", 16 * MiB, 4)},
            "s3 boto3 (S3Storage)": {"write": lambda: sink_write(s3, "shard.bin", nbytes, block),
                                     "read": lambda: ranged_read(s3, "shard.bin", 16 * MiB, 4)},
        }
        try:
            runs["s3 obstore"] = obstore_runs(endpoint, bucket, "bench/obstore.bin", nbytes, block, 16 * MiB, 4)
        except ImportError:
            report["obstore"] = "not installed"
        runs["engine, posix"] = engine_runs(str(args.scratch / "model.nvc"), nbytes)
        runs["engine, s3"] = engine_runs(s3.describe("model.nvc"), nbytes)
        for _ in range(args.reps):
            for name, pair in runs.items():
                for phase in ("write", "read"):
                    if name in ("posix", "engine, posix") and phase == "read":
                        drop_page_cache(args.scratch)  # a cold read, as the raw strategies' are
                    figures = measured(pair[phase], nbytes)
                    report.setdefault(name, {}).setdefault(phase, []).append(figures)
                    print(f"{name:22s} {phase:5s} {figures['mb_per_s']:8.1f} MB/s  "
                          f"client CPU {figures['client_cpu_s_per_gb']:5.2f} s/GB", flush=True)
        for key in ("shard.bin", "model.nvc"):
            posix.delete(key)
            s3.delete(key)
        s3.delete("obstore.bin")  # what obstore wrote, under the same prefix
    finally:
        if server is not None:
            server.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="file size in GB")
    parser.add_argument("--scratch", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--backend", choices=("posix-raw", "s3"), default="posix-raw",
                        help="posix-raw: this file system's write and read strategies; s3: POSIX, S3 (boto3) "
                             "and S3 (obstore) through the storage interface, side by side")
    parser.add_argument("--endpoint-url", help="--backend s3: the S3 server (default: a local moto server)")
    parser.add_argument("--bucket", default="bench", help="--backend s3 with --endpoint-url: an existing bucket")
    parser.add_argument("--reps", type=int, default=1, help="--backend s3: rounds over the backends")
    args = parser.parse_args(argv)
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.backend == "s3":
        report = compare_backends(args)
        (args.out / "bench_storage_s3.json").write_text(json.dumps(report, indent=2))
        return 0
    nbytes = int(args.gb * 1e9) // (64 * MiB) * (64 * MiB)
    path = args.scratch / "storage.bin"
    block16, block64 = aligned_buffer(16 * MiB), aligned_buffer(64 * MiB)
    writes = {
        "buffered 64 MiB, fsync at end": lambda: write_buffered(path, nbytes, block64, kick=False),
        "buffered 64 MiB, writeback started per write": lambda: write_buffered(path, nbytes, block64, kick=True),
        "O_DIRECT 16 MiB": lambda: write_direct(path, nbytes, block16, inflight=1),
        "O_DIRECT 64 MiB, 4 in flight": lambda: write_direct(path, nbytes, block64, inflight=4),
    }
    reads = {
        "sequential 64 MiB, 1 thread": lambda: read_sequential(path),
        "pread 256 MiB, 4 in flight": lambda: read_positional(path, 256 * MiB, 4, direct=False),
        "pread 64 MiB, 4 in flight": lambda: read_positional(path, 64 * MiB, 4, direct=False),
        "pread 16 MiB, 8 in flight": lambda: read_positional(path, 16 * MiB, 8, direct=False),
        "O_DIRECT 64 MiB, 1 in flight": lambda: read_positional(path, 64 * MiB, 1, direct=True),
        "O_DIRECT 64 MiB, 4 in flight": lambda: read_positional(path, 64 * MiB, 4, direct=True),
        "O_DIRECT 16 MiB, 8 in flight": lambda: read_positional(path, 16 * MiB, 8, direct=True),
    }
    report: dict[str, dict[str, float | str]] = {"bytes": {"file": nbytes}, "write_gbps": {}, "read_cold_gbps": {}}
    for name, fn in writes.items():
        drop_page_cache(args.scratch)
        try:
            report["write_gbps"][name] = nbytes / timed(fn) / 1e9
        except OSError as exc:
            report["write_gbps"][name] = f"failed: {exc}"
        print(name, report["write_gbps"][name], flush=True)
    write_buffered(path, nbytes, block64, kick=False)
    for name, fn in reads.items():
        how = drop_page_cache(args.scratch)
        try:
            report["read_cold_gbps"][name] = nbytes / timed(fn) / 1e9
        except OSError as exc:
            report["read_cold_gbps"][name] = f"failed: {exc}"
        print(name, report["read_cold_gbps"][name], how, flush=True)
    path.unlink()
    (args.out / "bench_storage.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
