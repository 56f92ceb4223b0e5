"""The node-local tier against the persistent one, side by side in one run.

Each rank holds a ZeRO-1-like optimizer shard (bench_load.py's fp32 master and Adam moments,
`--params` split over the ranks). For each `--local-tier` folder the ranks save through the
node-local tier (`tiers.tiered.LocalTier`: the shard written locally, its compressed bytes sent
to the replica ranks, the local commit; then the drain to `--persistent`), and each also saves
the same shard straight to the persistent folder, the baseline. Then the last node's local
folder is deleted (a lost node; with one node, nothing is lost) and the ranks resume: through
the tier (restore from local copies and replicas, then load the shard from the local folder)
against a load straight from the persistent copy, page caches dropped first
(`common.drop_page_cache`). Every load is compared bit for bit with the saved state.

Reported per rank: raw and compressed bytes, bytes sent to replicas (the compressed bytes, once
per replica), seconds until the local copy is durable (write, replicas, local commit) against
the persistent save, the drain's seconds, the resume's seconds from the tier against from the
persistent copy, and the bytes the tier's resume read from the persistent folder.

Simulated nodes are threads of this process (ranks agree through a key-value store, bytes go
through in-process queues): the CPU figures say what the tier costs and saves in bytes and
time relative to the persistent path, not what a network would do. On a GPU: one rank, one node
(no replicas), the local tier on the local disk and on /dev/shm:

    python benchmarks/bench_tier.py --device cuda --params 1.3e9 --nodes 1 --ranks-per-node 1 \
        --local-tier /local/nvme/tier --local-tier /dev/shm/tier --persistent /shared/ckpt --out results/
    python benchmarks/bench_tier.py --params 2e7 --scratch /tmp/bt --out results/   # CPU, 2 nodes x 2
"""

from __future__ import annotations

import argparse
import json
import queue
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import collectives
from nvcomp_ckpt_engine.manifest import ShardRecord
from nvcomp_ckpt_engine.tiers.tiered import LocalTier, LocalTierOptions

from bench_load import same_bytes, tensors_of, zero1_state  # benchmarks/ is on sys.path
from common import drop_page_cache

TAG = "global_step1"


class QueueChannel:
    """Bytes between the ranks' threads: one queue per (sender, receiver)."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int], queue.Queue] = {}
        self.lock = threading.Lock()

    def _queue(self, pair: tuple[int, int]) -> queue.Queue:
        with self.lock:
            return self.queues.setdefault(pair, queue.Queue(maxsize=4))

    def of(self, rank: int) -> Any:
        hub = self

        class Rank:
            def send(self, buffer: memoryview, to: int, timeout_s: float) -> None:
                hub._queue((rank, to)).put(bytes(buffer), timeout=timeout_s)

            def recv(self, buffer: memoryview, source: int, timeout_s: float) -> None:
                buffer[:] = hub._queue((source, rank)).get(timeout=timeout_s)

        return Rank()


def on_ranks(world: int, fn: Callable[[int, Any], Any], timeout_s: float = 3600.0) -> list[Any]:
    """fn(rank, collective) on `world` threads; the results by rank (an exception re-raised)."""
    store = collectives.MemoryStore(timeout_s=timeout_s)
    results: list[Any] = [None] * world

    def body(rank: int) -> None:
        collective = collectives.StoreCollective(store, rank=rank, world_size=world, timeout_s=timeout_s)
        try:
            results[rank] = fn(rank, collective)
        except BaseException as exc:  # re-raised below, in the main thread
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def run_tier(args: argparse.Namespace, local_path: str, states: list[dict], device: torch.device) -> dict:
    world = args.nodes * args.ranks_per_node
    persistent = Path(args.persistent) / Path(local_path).name
    shutil.rmtree(persistent, ignore_errors=True)
    for node in range(args.nodes):
        shutil.rmtree(local_path.replace("{node}", str(node)), ignore_errors=True)
    options = LocalTierOptions(path=local_path, replicas=min(args.replicas, args.nodes - 1),
                               keep_last=2, persist_every=1)
    hub = QueueChannel()
    name = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"

    def tier_of(rank: int, collective: Any) -> LocalTier:
        return LocalTier(options, collective, local_world_size=args.ranks_per_node,
                         channel=hub.of(rank), timeout_s=3600.0)

    def save(rank: int, collective: Any) -> dict:
        tier = tier_of(rank, collective)
        started = time.perf_counter()
        plan = tier.prepare(TAG)
        info = nce.save(states[rank], plan.tag_dir / name.format(rank))
        record = ShardRecord(path=name.format(rank), rank=rank, raw_bytes=info.raw_bytes,
                             file_bytes=info.file_bytes, crc32=info.crc32, codecs=info.codecs)
        result = tier.commit(TAG, plan, [record], error=None, layout={}, step=1, versions={})
        local_s = time.perf_counter() - started
        tier.after_commit(result, str(persistent))
        drain_s, _ = timed(tier.finish_drain, device)
        tier.close()
        baseline = persistent.parent / (persistent.name + "_baseline") / name.format(rank)
        baseline.parent.mkdir(parents=True, exist_ok=True)
        persistent_s, _ = timed(lambda: nce.save(states[rank], baseline), device)
        return {"raw_bytes": info.raw_bytes, "compressed_bytes": info.file_bytes,
                "replica_bytes_sent": tier.replica_bytes_sent, "local_durable_s": local_s,
                "drain_s": drain_s, "persistent_save_s": persistent_s}

    saves = on_ranks(world, save)
    if args.nodes > 1:
        shutil.rmtree(local_path.replace("{node}", str(args.nodes - 1)))
    for node in range(args.nodes - (args.nodes > 1)):
        drop_page_cache(Path(local_path.replace("{node}", str(node))))
    drop_page_cache(persistent)

    def resume(rank: int, collective: Any) -> dict:
        tier = tier_of(rank, collective)
        where = "cpu" if device.type == "cpu" else device
        restore_s, restored = timed(lambda: tier.restore(str(persistent), None), device)
        load_s, loaded = timed(lambda: nce.load(restored.root / TAG / name.format(rank), where), device)
        exact = same_bytes({k: v.cpu() for k, v in tensors_of(states[rank]).items()}, tensors_of(loaded))
        del loaded
        baseline = persistent.parent / (persistent.name + "_baseline") / name.format(rank)
        if rank == 0:
            drop_page_cache(baseline.parent)
        collective.barrier()
        persistent_s, loaded = timed(lambda: nce.load(baseline, where), device)
        exact &= same_bytes({k: v.cpu() for k, v in tensors_of(states[rank]).items()}, tensors_of(loaded))
        return {"resume_tier_s": restore_s + load_s, "restore_s": restore_s,
                "resume_persistent_s": persistent_s, "tier_read_persistent_bytes": tier.persistent_bytes_read,
                "bit_exact": exact}

    resumes = on_ranks(world, resume)
    ranks = [{**s, **r} for s, r in zip(saves, resumes)]
    medians = {key: statistics.median(r[key] for r in ranks) for key in ranks[0] if key != "bit_exact"}
    return {"local_tier": local_path, "lost_node": args.nodes - 1 if args.nodes > 1 else None,
            "ranks": ranks, "median": medians}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (simulated nodes) or cuda (one rank)")
    parser.add_argument("--params", type=float, default=2e7, help="parameters of the whole model")
    parser.add_argument("--width", type=int, default=64, help="model width (2048: the 1.3B case)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--scratch", type=Path, default=None, help="default folder of the tiers")
    parser.add_argument("--local-tier", action="append", default=None,
                        help='local tier folder ("{node}" is added for several nodes); repeat to compare')
    parser.add_argument("--persistent", default=None, help="the persistent folder (save_dir)")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and args.nodes * args.ranks_per_node != 1:
        parser.error("--device cuda runs one rank: --nodes 1 --ranks-per-node 1")
    if args.scratch is None and (args.local_tier is None or args.persistent is None):
        parser.error("give --scratch, or both --local-tier and --persistent")
    locals_ = args.local_tier or [str(args.scratch / "local")]
    if args.nodes > 1:
        locals_ = [p if "{node}" in p else p + "-{node}" for p in locals_]
    args.persistent = args.persistent or str(args.scratch / "persistent")
    world = args.nodes * args.ranks_per_node
    states = [zero1_state(args.params / world, args.width, device, seed=rank)[1] for rank in range(world)]
    report: dict[str, Any] = {"device": str(device), "params": args.params, "nodes": args.nodes,
                              "ranks_per_node": args.ranks_per_node, "replicas": args.replicas, "runs": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for path in locals_:  # the report is rewritten after each run: a run cut short keeps the earlier ones
        report["runs"].append(run_tier(args, path, states, device))
        (args.out / f"bench_tier_{device.type}.json").write_text(json.dumps(report, indent=2))
        print(json.dumps({"local_tier": path, **report["runs"][-1]["median"]}, indent=2), flush=True)
    return 0 if all(rank["bit_exact"] for run in report["runs"] for rank in run["ranks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
