"""Resume a ZeRO checkpoint at another data-parallel size: the plain load against both universal routes.

A job saved at DP=4 comes back on 2 ranks. For each ZeRO stage asked for, this launches 4 ranks
(torchrun, gloo, DeepSpeed's CPU accelerator) that train the MLP blocks of bench_ranks.py a few
steps (bf16 where the CPU accelerator has it, else fp32) and save the same step twice: with the
engine (ds_config's ``"nvcomp_checkpoint"``) and with DeepSpeed's own checkpoint engine. Then,
per repetition, it resumes at DP=2 three ways, each in fresh rank processes, the page cache of
the files read dropped before each conversion and each load:

  reshard    the engine on, ``engine.load_checkpoint(CKPT)``: resharded at load;
  ours       ``nvcomp-ckpt to-universal CKPT UNIVERSAL``, then the engine on with
             ``"checkpoint": {"load_universal": true}`` and ``load_checkpoint(UNIVERSAL)``;
  deepspeed  from DeepSpeed's plain checkpoint of the same step:
             ``python -m deepspeed.checkpoint.ds_to_universal --input_folder PLAIN/TAG
             --output_folder UNIVERSAL/TAG --inject_missing_state`` (its default workers), then
             DeepSpeed's own engine with ``load_universal`` and ``load_checkpoint(UNIVERSAL)``.

For each route it reports the conversion's seconds and peak memory (the sum of the proportional
set sizes of its processes, bench_universal's measure), the load's seconds (the slowest rank's
`load_checkpoint`), their sum (the resume), and per rank the peak resident memory during the
load (sampled, absolute and above the rank's memory before it) and the process's lifetime peak
(`ru_maxrss`, which would show an engine setup that peaked above the load). On the first repetition every
route's resumed state (each parameter's full fp32 master, both Adam moments, the 16-bit module,
the step counts and learning rate) is compared byte for byte with the others and with the state
saved at DP=4.

    python benchmarks/bench_reshard.py --stages 2,1 --width 1024 --layers 8 --reps 2 \\
        --scratch /tmp/br --out results/           # the table in docs/BENCHMARKS.md
    python benchmarks/bench_reshard.py --stages 2 --width 32 --layers 1 --steps 1 --reps 1 \\
        --save-size 2 --resume-size 1 --scratch /tmp/br --out /tmp/out   # a smoke run

Writes OUT/bench_reshard_cpu.json (and OUT/bench_reshard_cpu.partial.json after every resume).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
TAG = "bench"
ROUTES = ("reshard", "ours", "deepspeed")
BATCH = 8


def _config(stage: int, bf16: bool, route: str | None) -> dict[str, Any]:
    """bench_deepspeed's ds_config at this ZeRO stage; the engine on except for DeepSpeed's
    route, ``load_universal`` for both universal routes."""
    from bench_deepspeed import ds_config

    config = ds_config(BATCH, bf16=bf16)
    config["zero_optimization"]["stage"] = stage
    config["nvcomp_checkpoint"] = {"enabled": route != "deepspeed"}
    if route in ("ours", "deepspeed"):
        config["checkpoint"] = {"load_universal": True}
    return config


def _engine(args: argparse.Namespace, route: str | None, seed: int) -> tuple[Any, bool]:
    import deepspeed

    from bench_ranks import Blocks

    torch.manual_seed(seed)
    model = Blocks(args.width, args.layers)
    bf16 = deepspeed.get_accelerator().is_bf16_supported()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(args.stage, bf16, route))
    return engine, bf16


def _full_state(engine: Any) -> dict[str, Any]:
    """Every parameter's full fp32 master, Adam moments and 16-bit weights (a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    state: dict[str, Any] = {"global_steps": engine.global_steps, "lr": engine.get_lr()}
    for name, param in engine.module.named_parameters():
        state[name] = {
            "module": param.detach().cpu().clone(),
            "fp32": safe_get_full_fp32_param(param).detach().cpu().clone(),
            **{key: safe_get_full_optimizer_state(param, key).detach().cpu().clone()
               for key in ("exp_avg", "exp_avg_sq")},
        }
    return state


def _save(args: argparse.Namespace) -> None:
    """DP=4: train, save with the engine and with DeepSpeed's; rank 0 writes the saved state."""
    import torch.distributed as dist
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    engine, bf16 = _engine(args, None, seed=0)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        x = torch.randn(BATCH, args.width, generator=gen)
        loss = engine(x.bfloat16() if bf16 else x, torch.randn(BATCH, args.width, generator=gen))
        engine.backward(loss)
        engine.step()
    work = Path(args.work)
    engine.save_checkpoint(str(work / "checkpoints"), tag=TAG)
    engine.checkpoint_engine = TorchCheckpointEngine(None)
    engine.save_checkpoint(str(work / "plain_checkpoints"), tag=TAG)
    state = _full_state(engine)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in engine.module.parameters())
        torch.save(state, work / "saved.pt")
        (work / "saved.json").write_text(json.dumps({"params": params, "dtype": "bf16" if bf16 else "fp32"}))
    engine.destroy()


def _resume(args: argparse.Namespace) -> None:
    """DP=2: load by `args.route`, timed, memory sampled; rank 0 writes every rank's figures
    (and with `--check` the resumed state)."""
    import torch.distributed as dist

    from common import HostMemory

    work = Path(args.work)
    load_dir = work / {"reshard": "checkpoints", "ours": "universal_ours",
                       "deepspeed": "universal_deepspeed"}[args.route]
    engine, _ = _engine(args, args.route, seed=1)
    dist.barrier()
    with HostMemory() as memory:
        t0 = time.perf_counter()
        load_path, _ = engine.load_checkpoint(str(load_dir))
        seconds = time.perf_counter() - t0
    if load_path is None:
        raise RuntimeError(f"load_checkpoint found nothing in {load_dir}")
    figures = {"load_s": seconds, "peak_rss_gib": memory.report()["rss_total_gib"],
               "peak_rss_above_start_gib": memory.report()["rss_gib"],
               "ru_maxrss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, figures)
    state = _full_state(engine) if args.check else None
    if dist.get_rank() == 0:
        if state is not None:
            torch.save(state, work / f"resumed_{args.route}.pt")
        Path(args.result).write_text(json.dumps(every))
    engine.destroy()


def worker(args: argparse.Namespace) -> None:
    import nvcomp_ckpt_engine.deepspeed

    nvcomp_ckpt_engine.deepspeed.enable()
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    try:
        if args.route == "save":
            _save(args)
        else:
            _resume(args)
    finally:
        dist.destroy_process_group()


def _launch(nproc: int, args: argparse.Namespace, work: Path, route: str, check: bool = False) -> list[Any]:
    """`nproc` ranks of `worker` for `route`; the per-rank figures they report (resumes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = work / "result.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(port), str(Path(__file__).resolve()),
               "--worker", "--route", route, "--work", str(work), "--result", str(result),
               "--stage", str(args.stage), "--width", str(args.width), "--layers", str(args.layers),
               "--steps", str(args.steps), *(["--check"] if check else [])]
    done = subprocess.run(command, env=_env(), capture_output=not args.verbose, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{route} at DP={nproc} failed ({done.returncode}):\n"
                           f"{((done.stdout or '') + (done.stderr or ''))[-4000:]}")
    return json.loads(result.read_text()) if route != "save" else []


def _env() -> dict[str, str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if sys.prefix != sys.base_prefix:  # one JIT-op cache per environment (a shared one is rebuilt)
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    return env


def _convert(route: str, work: Path) -> dict[str, Any] | None:
    """The route's conversion, timed and its memory watched (bench_universal's measure)."""
    from bench_universal import run_command

    cpu = torch.device("cpu")
    if route == "ours":
        out = work / "universal_ours"
        return run_command([sys.executable, "-m", "nvcomp_ckpt_engine", "to-universal", "-q", "--tag", TAG,
                            str(work / "checkpoints"), str(out)], [out], cpu, _env())
    if route == "deepspeed":
        out = work / "universal_deepspeed"
        return run_command([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                            str(work / "plain_checkpoints" / TAG), "--output_folder", str(out / TAG),
                            "--inject_missing_state"], [out], cpu, _env())
    return None


def _source(route: str, work: Path) -> Path:
    """The folder a route's conversion (or the plain load) reads."""
    return work / ("plain_checkpoints" if route == "deepspeed" else "checkpoints")


def resume(route: str, args: argparse.Namespace, work: Path, check: bool) -> dict[str, Any]:
    """One resume at `args.resume_size` by `route`: its conversion, then its load."""
    from common import drop_page_cache

    drop_page_cache(_source(route, work))
    convert = _convert(route, work)
    universal = work / f"universal_{route}"
    if universal.exists():
        drop_page_cache(universal)
    ranks = _launch(args.resume_size, args, work, route, check)
    shutil.rmtree(universal, ignore_errors=True)
    load_s = max(r["load_s"] for r in ranks)
    convert_s = convert["seconds"] if convert else 0.0
    return {"route": route, "convert_s": convert_s,
            "convert_peak_memory_gib": convert["peak_memory_gib"] if convert else None,
            "load_s": load_s, "resume_s": convert_s + load_s,
            "peak_rss_gib": max(r["peak_rss_gib"] for r in ranks),
            "peak_rss_above_start_gib": max(r["peak_rss_above_start_gib"] for r in ranks),
            "ru_maxrss_gib": max(r["ru_maxrss_gib"] for r in ranks), "ranks": ranks}


def same_bytes(a: Any, b: Any) -> bool:
    """Equal tensors byte for byte (dtype and shape too), other values by ==, recursively."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_bytes(a[k], b[k]) for k in a)
    return a == b


def agreement(work: Path) -> dict[str, bool]:
    """Each route's resumed state against the state saved at DP=4 and against the plain load's.
    The saved 16-bit module and step counts are those before the save, as a resume's must be."""
    saved = torch.load(work / "saved.pt", weights_only=True)
    resumed = {route: torch.load(work / f"resumed_{route}.pt", weights_only=True) for route in ROUTES}
    out = {f"{route}_equals_saved": same_bytes(state, saved) for route, state in resumed.items()}
    out.update({f"{route}_equals_reshard": same_bytes(resumed[route], resumed["reshard"])
                for route in ROUTES if route != "reshard"})
    return out


SUMMARY_KEYS = ("convert_s", "load_s", "resume_s", "convert_peak_memory_gib", "peak_rss_gib",
                "peak_rss_above_start_gib", "ru_maxrss_gib")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repetitions of one route."""
    return {key: None if rows[0][key] is None else statistics.median(r[key] for r in rows)
            for key in SUMMARY_KEYS}


def run_stage(args: argparse.Namespace) -> dict[str, Any]:
    work = args.scratch / f"zero{args.stage}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    _launch(args.save_size, args, work, "save")
    saved = json.loads((work / "saved.json").read_text())
    save_s = time.perf_counter() - t0
    from common import folder_bytes

    stage = {"stage": args.stage, **saved, "train_and_save_s": save_s,
             "checkpoint_bytes": folder_bytes(work / "checkpoints" / TAG),
             "plain_checkpoint_bytes": folder_bytes(work / "plain_checkpoints" / TAG), "runs": []}
    for rep in range(args.reps):
        for route in ROUTES:
            row = resume(route, args, work, check=rep == 0)
            stage["runs"].append({"rep": rep, **row})
            args.partial.write_text(json.dumps({"stages": [*args.done, stage]}, indent=2))
            print(f"ZeRO-{args.stage} rep {rep} {route}: resume {row['resume_s']:.1f} s "
                  f"(convert {row['convert_s']:.1f} s, load {row['load_s']:.1f} s), "
                  f"peak RSS/rank {row['peak_rss_gib']:.2f} GiB", flush=True)
        if rep == 0:
            stage["bit_exact"] = agreement(work)
    stage["summary"] = {route: summarize([r for r in stage["runs"] if r["route"] == route])
                        for route in ROUTES}
    shutil.rmtree(work)
    return stage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="2,1", help="ZeRO stages, comma-separated (1, 2)")
    parser.add_argument("--width", type=int, default=1024, help="model width")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="training steps before the save")
    parser.add_argument("--reps", type=int, default=3, help="resumes per route (medians)")
    parser.add_argument("--save-size", type=int, default=4, help="data-parallel size of the save")
    parser.add_argument("--resume-size", type=int, default=2, help="data-parallel size of the resumes")
    parser.add_argument("--scratch", type=Path, help="where the checkpoints go (required)")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--route", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    if args.worker:
        worker(args)
        return 0
    if args.scratch is None:
        parser.error("--scratch is required")
    args.out.mkdir(parents=True, exist_ok=True)
    args.partial = args.out / "bench_reshard_cpu.partial.json"
    stages = args.done = []
    for stage in (int(s) for s in args.stages.split(",")):
        args.stage = stage
        stages.append(run_stage(args))
    report = {"cpu": _cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
              "save_size": args.save_size, "resume_size": args.resume_size, "width": args.width,
              "layers": args.layers, "reps": args.reps, "stages": stages}
    (args.out / "bench_reshard_cpu.json").write_text(json.dumps(report, indent=2))
    args.partial.unlink(missing_ok=True)
    print_table(report)
    return 0 if all(all(s["bit_exact"].values()) for s in stages) else 1


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def print_table(report: dict[str, Any]) -> None:
    print(f"DP {report['save_size']} -> {report['resume_size']}, {report['cpu']}, medians of {report['reps']}")
    print("| ZeRO | route | resume s | conversion s | load s | conversion peak GiB | "
          "peak RSS/rank GiB | above start GiB | bit-exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for stage in report["stages"]:
        for route, s in stage["summary"].items():
            exact = stage["bit_exact"][f"{route}_equals_saved"]
            conv_mem = "-" if s["convert_peak_memory_gib"] is None else f"{s['convert_peak_memory_gib']:.2f}"
            print(f"| {stage['stage']} | {route} | {s['resume_s']:.1f} | {s['convert_s']:.1f} | {s['load_s']:.1f} | "
                  f"{conv_mem} | {s['peak_rss_gib']:.2f} | {s['peak_rss_above_start_gib']:.2f} | {exact} |")


if __name__ == "__main__":
    raise SystemExit(main())
