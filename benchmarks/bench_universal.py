"""`nvcomp-ckpt to-universal` against DeepSpeed's route to a universal checkpoint, side by side.

One process trains the GPT of bench_deepspeed.py a few steps and saves a checkpoint with the
engine (ZeRO-1; bf16 on a GPU). Then, per repetition, from that checkpoint, the commands a user
runs, each in a fresh process, with the page cache dropped before each route:

  ours       nvcomp-ckpt to-universal CKPT OUT
  deepspeed  nvcomp-ckpt decompress CKPT PLAIN --tag TAG, then
             python -m deepspeed.checkpoint.ds_to_universal --input_folder PLAIN/TAG
                 --output_folder UNIVERSAL/TAG --inject_missing_state   (its default workers)

For each command and route it reports the seconds; the peak memory of the command's processes
(the sum of their proportional set sizes, `Pss`, sampled every 50 ms: forked workers that share
pages are not counted twice; resident sizes where the kernel gives no Pss); on a GPU the peak
device memory in use above what the benchmark itself holds; the bytes of the universal
checkpoint; and the peak bytes on disk of the route's folders while it ran (DeepSpeed's: the
plain copy, its fragments and the result). The checkpoint is saved again before each repetition
and deleted before ds_to_universal runs, so a 1.3B run fits a 64 GiB disk. Both universal
checkpoints must list the same files; `--compare` of them, chosen evenly, are compared tensor for
tensor (the tests compare all of them, on smaller models).

    python benchmarks/bench_universal.py --size 1.3b --reps 1 --scratch /tmp/bu --out results/
    python benchmarks/bench_universal.py --size tiny --scratch /tmp/bu --out results/   # CPU smoke

Writes OUT/bench_universal.json (and OUT/bench_universal.partial.json after every route).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

# benchmarks/ is on sys.path when run as a script
from bench_deepspeed import SIZES, Trainer, use_engine
from common import drop_page_cache, folder_bytes

import nvcomp_ckpt_engine as nce

logger = logging.getLogger("bench_universal")

TAG = "bench"
SAMPLE_S = 0.05


def _memory_kib(pid: int) -> int:
    """The proportional set size of one process (its resident size where the kernel has none)."""
    for name, key in (("smaps_rollup", "Pss:"), ("status", "VmRSS:")):
        try:
            with open(f"/proc/{pid}/{name}") as f:
                for line in f:
                    if line.startswith(key):
                        return int(line.split()[1])
        except OSError:
            continue
    return 0


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc/PID/task/*/children."""
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo.extend(int(child) for child in f.read().split())
            except OSError:
                continue
    return pids


class Watch:
    """Peak memory of a process tree, device memory and bytes under folders, while it runs."""

    def __init__(self, pid: int, folders: list[Path], device: torch.device) -> None:
        self.pid, self.folders, self.device = pid, folders, device
        self.memory_kib = self.disk_bytes = 0
        self.gpu_bytes: int | None = None
        self._gpu_base = self._gpu_used() if device.type == "cuda" else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watch", daemon=True)
        self._thread.start()

    def _gpu_used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _disk(self) -> int:
        total = 0
        for folder in self.folders:
            for root, _, files in os.walk(folder):
                for name in files:
                    try:
                        total += os.stat(os.path.join(root, name)).st_size
                    except OSError:
                        continue
        return total

    def _run(self) -> None:
        disk_every, tick = max(1, int(0.5 / SAMPLE_S)), 0
        while not self._stop.wait(SAMPLE_S):
            self.memory_kib = max(self.memory_kib, sum(_memory_kib(p) for p in _tree(self.pid)))
            if self._gpu_base is not None:
                self.gpu_bytes = max(self.gpu_bytes or 0, self._gpu_used() - self._gpu_base)
            tick += 1
            if tick % disk_every == 0:
                self.disk_bytes = max(self.disk_bytes, self._disk())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.disk_bytes = max(self.disk_bytes, self._disk())


def run_command(command: list[str], folders: list[Path], device: torch.device,
                env: dict[str, str]) -> dict[str, Any]:
    """Run one command; its seconds, peak memory, peak device memory and peak disk bytes."""
    t0 = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    watch = Watch(process.pid, folders, device)
    output, _ = process.communicate()
    seconds = time.perf_counter() - t0
    watch.stop()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}):\n{output[-4000:]}")
    return {"seconds": seconds, "peak_memory_gib": watch.memory_kib / 2**20,
            "peak_gpu_gib": None if watch.gpu_bytes is None else watch.gpu_bytes / 2**30,
            "peak_disk_bytes": watch.disk_bytes}


def route_ours(ckpt: Path, scratch: Path, device: torch.device, env: dict[str, str]) -> dict[str, Any]:
    out = scratch / "universal_ours"
    step = run_command([sys.executable, "-m", "nvcomp_ckpt_engine", "to-universal", "-q", "--tag",
                        TAG, str(ckpt), str(out)], [out], device, env)
    return {"seconds": step["seconds"], "peak_memory_gib": step["peak_memory_gib"],
            "peak_gpu_gib": step["peak_gpu_gib"], "peak_disk_bytes": step["peak_disk_bytes"],
            "bytes": folder_bytes(out), "steps": {"to_universal": step}}


def route_deepspeed(ckpt: Path, scratch: Path, device: torch.device,
                    env: dict[str, str]) -> dict[str, Any]:
    plain, out = scratch / "plain", scratch / "universal_deepspeed"
    decompress = run_command([sys.executable, "-m", "nvcomp_ckpt_engine", "decompress", "-q",
                              "--tag", TAG, str(ckpt), str(plain)], [plain], device, env)
    plain_bytes = folder_bytes(plain)
    shutil.rmtree(ckpt)  # room on the disk: only the plain copy is needed from here on
    convert = run_command([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                           "--input_folder", str(plain / TAG), "--output_folder", str(out / TAG),
                           "--inject_missing_state"], [plain, out], device, env)
    steps = {"decompress": decompress, "ds_to_universal": convert}
    return {"seconds": sum(s["seconds"] for s in steps.values()),
            "peak_memory_gib": max(s["peak_memory_gib"] for s in steps.values()),
            "peak_gpu_gib": max((s["peak_gpu_gib"] for s in steps.values()
                                 if s["peak_gpu_gib"] is not None), default=None),
            "peak_disk_bytes": max(decompress["peak_disk_bytes"], convert["peak_disk_bytes"]),
            "bytes": folder_bytes(out), "plain_copy_bytes": plain_bytes, "steps": steps}


def universal_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.pt"))


def tensors_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return True  # non-tensor values: the tests compare them; here, the bytes that matter


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("seconds", "peak_memory_gib", "peak_gpu_gib", "peak_disk_bytes", "bytes")
    return {key: statistics.median(r[key] for r in runs) if runs[0][key] is not None else None
            for key in keys}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--steps", type=int, default=3, help="training steps before the save")
    parser.add_argument("--reps", type=int, default=2, help="conversions per route (medians)")
    parser.add_argument("--compare", type=int, default=8,
                        help="universal files compared tensor for tensor per repetition")
    parser.add_argument("--scratch", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29562"}.items():
        os.environ.setdefault(key, value)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    env = {**os.environ}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the commands are single processes of their own
    scratch = args.scratch / "bench_universal"  # emptied before each repetition
    args.out.mkdir(parents=True, exist_ok=True)

    trainer = Trainer(args.size, device)
    trainer.timed_steps(args.steps)
    use_engine(trainer, "auto")
    ckpt = scratch / "checkpoints"
    runs: list[dict[str, Any]] = []
    for rep in range(args.reps):
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        trainer.engine.save_checkpoint(str(ckpt), tag=TAG)
        checkpoint_bytes = folder_bytes(ckpt / TAG)
        run: dict[str, Any] = {"rep": rep, "checkpoint_bytes": checkpoint_bytes}
        drop_page_cache(ckpt)
        run["ours"] = route_ours(ckpt, scratch, device, env)
        ours_dir = scratch / "universal_ours"
        files = universal_files(ours_dir)
        picked = files[:: max(1, len(files) // max(1, args.compare))][: args.compare]
        samples = {name: nce.load(ours_dir / name, map_location="cpu") for name in picked}
        shutil.rmtree(ours_dir)
        (args.out / "bench_universal.partial.json").write_text(json.dumps(runs + [run], indent=2))
        drop_page_cache(ckpt)
        run["deepspeed"] = route_deepspeed(ckpt, scratch, device, env)
        theirs = scratch / "universal_deepspeed"
        run["same_files"] = universal_files(theirs) == files
        run["compared"] = len(samples)
        run["bit_exact"] = all(
            tensors_equal(torch.load(theirs / name, map_location="cpu", weights_only=False), obj)
            for name, obj in samples.items())
        runs.append(run)
        (args.out / "bench_universal.partial.json").write_text(json.dumps(runs, indent=2))
        logger.info("rep %d: %s", rep, json.dumps(run))
    ours, theirs = summarize([r["ours"] for r in runs]), summarize([r["deepspeed"] for r in runs])
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "size": args.size, "params": trainer.params,
        "checkpoint_bytes": runs[0]["checkpoint_bytes"], "ours": ours, "deepspeed": theirs,
        "ratios": {
            "time_deepspeed_over_ours": theirs["seconds"] / ours["seconds"],
            "peak_memory_deepspeed_over_ours": theirs["peak_memory_gib"] / ours["peak_memory_gib"],
            "bytes_ours_over_deepspeed": ours["bytes"] / theirs["bytes"],
            "peak_disk_deepspeed_over_ours": theirs["peak_disk_bytes"] / ours["peak_disk_bytes"],
        },
        "same_files": all(r["same_files"] for r in runs),
        "bit_exact": all(r["bit_exact"] for r in runs),
        "runs": runs,
    }
    (args.out / "bench_universal.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    shutil.rmtree(scratch)
    trainer.engine.destroy()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0 if report["same_files"] and report["bit_exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
