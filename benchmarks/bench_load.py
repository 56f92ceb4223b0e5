"""Where a load's time goes: this engine against `torch.load`, on the same ZeRO-1-like files.

Builds the two files a one-GPU ZeRO-1 bf16 job writes (model states: one bf16 tensor per
parameter of the 1.3B GPT of bench_deepspeed.py; optimizer states: the fp32 master partition
and both Adam moments as flat tensors, with trained-like value ranges), saves them with
`torch.save` and with `nvcomp_ckpt_engine.save`, then loads each as DeepSpeed does
(`map_location` callable for the model states, ``"cpu"`` for the optimizer states):
cold (page cache dropped) and warm, and with the engine also onto the GPU and without CRC
checks. Every load is compared byte for byte with the saved tensors. Per engine load it also
reports the wall time spent in each stage of the read path (summed over threads).

    python benchmarks/bench_load.py --device cuda --params 1.3e9 --scratch /tmp/bl --out results/
    python benchmarks/bench_load.py --params 2e7 --width 256 --scratch /tmp/bl   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine.pipeline import decode

from common import drop_page_cache  # benchmarks/ is on sys.path when run as a script


def zero1_state(params: float, d: int, device: torch.device, seed: int = 0) -> tuple[dict, dict]:
    """Model-states and optimizer-states dicts shaped like DeepSpeed ZeRO-1 bf16 files of a GPT
    of width `d` with about `params` parameters (at least the embedding and one layer)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    layer = [("ln1.weight", (d,)), ("ln1.bias", (d,)), ("qkv.weight", (3 * d, d)),
             ("qkv.bias", (3 * d,)), ("proj.weight", (d, d)), ("proj.bias", (d,)),
             ("ln2.weight", (d,)), ("ln2.bias", (d,)), ("fc.weight", (4 * d, d)),
             ("fc.bias", (4 * d,)), ("out.weight", (d, 4 * d)), ("out.bias", (d,))]
    per_layer = sum(torch.Size(s).numel() for _, s in layer)
    layers = max(1, round((params - 50257 * d) / per_layer))
    shapes = [("tok.weight", (50257, d)), ("pos.weight", (512, d))]
    shapes += [(f"blocks.{i}.{n}", s) for i in range(layers) for n, s in layer]
    total = sum(torch.Size(s).numel() for _, s in shapes)
    master = torch.randn(total, generator=gen, device=device).mul_(0.02)
    module, start = {}, 0
    for name, shape in shapes:
        n = torch.Size(shape).numel()
        module[name] = master[start : start + n].view(shape).to(torch.bfloat16)
        start += n
    exp_avg = torch.randn(total, generator=gen, device=device).mul_(1e-4)
    exp_avg_sq = torch.randn(total, generator=gen, device=device).square_().mul_(1e-8)
    model_states = {"module": module, "global_steps": 20, "dp_world_size": 1}
    optim_states = {
        "optimizer_state_dict": {
            "state": {0: {"step": torch.tensor(20.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}},
            "param_groups": [{"lr": 1e-4, "params": [0]}],
        },
        "single_partition_of_fp32_groups": [master],
    }
    return model_states, optim_states


def tensors_of(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(tensors_of(v, f"{prefix}/{k}"))
    return out


def same_bytes(ta: dict[str, torch.Tensor], tb: dict[str, torch.Tensor]) -> bool:
    return ta.keys() == tb.keys() and all(
        x.dtype == tb[k].dtype and x.shape == tb[k].shape
        and torch.equal(x.detach().cpu().reshape(-1).view(torch.uint8),
                        tb[k].detach().cpu().reshape(-1).view(torch.uint8))
        for k, x in ta.items())


class StageTimer:
    """Wall time spent inside chosen functions of the read path, summed over threads."""

    STAGES = {"read (pread)": (decode, "_read_range"), "crc32": (decode, "_check"),
              "h2d + decode": (decode._ShardReader, "_decode"),
              "into host memory": (decode, "_copy_to_host")}

    def __init__(self) -> None:
        self.totals: dict[str, float] = collections.defaultdict(float)
        self.lock = threading.Lock()
        self.saved: list[tuple[Any, str, Callable]] = []

    def __enter__(self) -> "StageTimer":
        for stage, (owner, name) in self.STAGES.items():
            if not hasattr(owner, name):
                continue
            original = getattr(owner, name)
            self.saved.append((owner, name, original))
            setattr(owner, name, self._timed(stage, original))
        return self

    def _timed(self, stage: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.totals[stage] += time.perf_counter() - t0
        return wrapper

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in self.saved:
            setattr(owner, name, original)


def keep_storage(storage: Any, location: str) -> Any:
    return storage


def timed_load(load: Callable[[str, Any], Any], files: dict[str, Path], scratch: Path, *,
               cold: bool, device: torch.device) -> tuple[float, dict[str, Any]]:
    if cold:
        drop_page_cache(scratch)
    t0 = time.perf_counter()
    out = {"model": load(str(files["model"]), keep_storage),
           "optim": load(str(files["optim"]), torch.device("cpu"))}
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params", type=float, default=2e7, help="model parameters (1.3e9: the H200 case)")
    parser.add_argument("--width", type=int, default=2048, help="model width (2048: the H200 case)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--scratch", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model_states, optim_states = zero1_state(args.params, args.width, device)
    expected = {"model": model_states, "optim": optim_states}
    files = {base: {k: args.scratch / f"{base}_{k}.pt" for k in expected} for base in ("torch", "ours")}
    report: dict[str, Any] = {"device": str(device), "params": args.params, "save_s": {}, "loads": []}
    for k, obj in expected.items():
        t0 = time.perf_counter()
        torch.save(obj, files["torch"][k])
        report["save_s"].setdefault("torch", 0.0)
        report["save_s"]["torch"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        nce.save(obj, files["ours"][k])
        report["save_s"].setdefault("ours", 0.0)
        report["save_s"]["ours"] += time.perf_counter() - t0
    report["bytes"] = {b: sum(p.stat().st_size for p in f.values()) for b, f in files.items()}
    expected_cpu = {k: {n: t.cpu() for n, t in tensors_of(v).items()} for k, v in expected.items()}

    def torch_load(path: str, loc: Any) -> Any:
        return torch.load(path, map_location=loc, weights_only=False)

    def ours(**kw: Any) -> Callable[[str, Any], Any]:
        return lambda path, loc: nce.load(path, kw.get("map_location", loc), verify=kw.get("verify", True))

    cases = [("torch.load", torch_load, True), ("engine", ours(), True),
             ("torch.load", torch_load, False), ("engine", ours(), False),
             ("engine, verify=False", ours(verify=False), False)]
    if device.type == "cuda":
        cases.append(("engine, onto the GPU", ours(map_location=device), False))
    for rep in range(args.reps):
        for name, load, cold in cases:
            base = "torch" if name == "torch.load" else "ours"
            with StageTimer() as timer:
                seconds, out = timed_load(load, files[base], args.scratch, cold=cold, device=device)
            exact = all(same_bytes(expected_cpu[k], tensors_of(out[k])) for k in expected_cpu)
            row = {"load": name, "cold": cold, "rep": rep, "seconds": seconds, "bit_exact": exact}
            if base == "ours":
                row["stages_s"] = dict(timer.totals)
            report["loads"].append(row)
            print(json.dumps(row), flush=True)
            del out
    summary = collections.defaultdict(list)
    for row in report["loads"]:
        summary[(row["load"], row["cold"])].append(row["seconds"])
    report["median_s"] = {f"{n} ({'cold' if c else 'warm'})": statistics.median(v) for (n, c), v in summary.items()}
    (args.out / "bench_load.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "loads"}, indent=2))
    return 0 if all(r["bit_exact"] for r in report["loads"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
