"""DeepSpeed's default checkpoint engine and nvcomp_ckpt_engine, side by side, in one run.

One process, one model, one training state. For each variant it measures:
  blocked_s   how long `save_checkpoint` blocks the training loop;
  durable_s   time until the data is durable (the default engine: + os.sync(); our sync saves
              fsync before returning; async: until the manifest is committed);
  load_s      `load_checkpoint` with the checkpoint's pages dropped from the page cache;
  bytes       on disk, per file and per rank's files; peak extra GPU memory, and host memory
              during the save and during the load (`common.HostMemory`: pinned memory in use
              and held by torch's allocator, resident memory, pinned pages; and the engine's
              own count of its staging buffers, `staging.METER`), and the pinned
              arena async saves keep (pinned in the background when the engine is installed:
              `prepin_wait_s` is how long the run then waited for it before saving);
and, in the same run, the raw bandwidths that bound them: write+fsync and read of the same
byte count, and the pinned device-to-host copy. After every load the state is compared
bit for bit with a snapshot taken at save time. For the async variant it also measures the
median training-step time while the background write is in flight against as many steps right
after it, and the same for two writes of the same bytes in a thread without the engine (a
plain write+fsync, and the engine's writer alone: `CONTROL_WRITES`), which is what a
background write costs training on the machine; for each of these windows, where the training
thread's time went (`common.thread_times`: blocked, i.e. waiting for the GIL or the GPU, and
waiting for a core). With --timeline each run also records the seconds spent in DeepSpeed's
and the engine's steps of the save and the load (`Timeline`), and for the save the garbage
collector's passes and the training thread's sampled stacks (`StallSamples`); every run counts
the `cudaMalloc` segments made during the save's stall. With --offload the optimizer
state lives in host memory (ZeRO-Offload).

    python benchmarks/bench_deepspeed.py --size 1.3b --reps 2 --out results/   # the H200 figures
    python benchmarks/bench_deepspeed.py --size tiny --out results/   # a CPU smoke run

Writes OUT/bench_deepspeed.json (plot it with benchmarks/plot_deepspeed.py).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# benchmarks/ is on sys.path when run as a script
from common import (HostMemory, drop_page_cache, folder_bytes, plain_write, steps_during, thread_times,
                    writer_io)
from nvcomp_ckpt_engine import manifest, pipeline, staging

SIZES = {  # d_model, layers, heads, seq, micro-batch
    "tiny": (64, 2, 4, 32, 2),
    "125m": (768, 12, 12, 512, 4),
    "350m": (1024, 24, 16, 512, 4),
    "1.3b": (2048, 24, 16, 512, 4),
}
VOCAB = 50257
#: ALGORITHM[-MODE]: "direct" writes with O_DIRECT, "async" saves in the background (where the
#: GPU memory the job's peak leaves spare holds a raw copy of the state, it is copied there and
#: encoded beside the next steps: ``async_gpu_snapshot``; else the compressed payloads leave the
#: GPU beside them), "asyncencode" too without the copy (encoded before the save returns, the
#: payloads leaving the GPU beside the next steps), "asynccopied" returns only once they are in
#: host memory (``async_gpu_memory_gb: 0``), "hostload" decodes the ZeRO shard into host memory
#: as DeepSpeed asks (the others: onto the GPU), "gds" is a sync save whose GPU payloads are
#: written from GPU memory through the GPUDirect Storage sink (``io_path: "gds"``, kvikio: run
#: only where it is installed; the others take ``"auto"``, `options.AUTO_IO_PATH`). Each run
#: records the way the manifest says its files were written (`io`).
VARIANTS = ("default", "ans", "zstd", "auto", "auto-direct", "auto-async", "auto-asyncencode",
            "auto-asynccopied", "auto-hostload", "auto-gds")

logger = logging.getLogger("bench_deepspeed")


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2 style: learned positions, pre-LN blocks, tied input/output embedding."""

    def __init__(self, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tok.weight.t()
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), idx[:, 1:].reshape(-1))


def ds_config(micro_batch: int, bf16: bool, offload: bool = False) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 1}
    if offload:  # ZeRO-Offload: fp32 master and Adam moments live in pinned host memory
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
    }


def gib(n: float) -> float:
    return round(n / 2**30, 3)


#: Background writes of the checkpoint's bytes that `steps_during` compares the engine's async
#: write with: the write+fsync of the bandwidth figure, and the engine's own file I/O alone.
CONTROL_WRITES = {"plain_write": plain_write, "writer_io": writer_io}


def raw_bandwidths(scratch: Path, nbytes: int, device: torch.device) -> dict[str, float]:
    """Sequential write+fsync and cold read of `nbytes`, and the pinned device-to-host copy."""
    path = scratch / "bandwidth.bin"
    write = nbytes / plain_write(path, nbytes)
    drop_page_cache(scratch)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    read = nbytes / (time.perf_counter() - t0)
    path.unlink()
    result = {"write_fsync_gbps": write / 1e9, "read_cold_gbps": read / 1e9}
    if device.type == "cuda":
        src = torch.empty(4 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        result["pinned_d2h_gbps"] = src.numel() / statistics.median(times) / 1e9
        del src, dst
    return result


class Timeline:
    """Wall-clock time spent in named calls during one save or load (the calls are wrapped only
    inside `watch`). Unlike a profiler it costs nothing measurable and sees the calling thread's
    real waits, which is what tells DeepSpeed's own work from the checkpoint engine's."""

    SAVE = ("engine.makedirs", "engine._checkpoint_tag_validation", "engine._save_checkpoint",
            "engine.module_state_dict", "engine._save_zero_checkpoint", "engine._copy_recovery_script",
            "ckpt.create", "ckpt.save", "dist.barrier", "api._prepare", "pipeline.stage",
            "ckpt.wait", "derived_module.plan_module", "derived_module._check_own_partition",
            "collective.all_gather_object", "commit.prepare_tag_dir", "fileio.atomic_write_bytes",
            "fileio.fsync_dir", "memory.host_budget_bytes", "memory.gpu_cap_bytes",
            "memory.gpu_budget_bytes", "state.flatten", "plan.group_storages", "plan._mark_derived",
            "plan._choose_plans", "selection.choose", "pipeline.prepare_shard", "api.writer_info",
            "api.save_async", "module_plan.check_shard", "module_plan.pieces_for",
            "encode._gpu_payloads", "encode._Capture.start", "encode._Capture.flush",
            "encode._Capture.wait", "transforms.to_planes", "nvcodec.NvcompCodec._encode_group",
            "nvcodec.NvcompCodec._nvcomp_codec", "nvcodec.NvcompCodec._capacities")
    LOAD = ("engine._load_checkpoint", "sdloader.check_ckpt_list", "engine.load_module_state_dict",
            "engine._get_all_zero_checkpoint_state_dicts", "engine._load_zero_checkpoint",
            "optimizer.load_state_dict", "ckpt.load", "pipeline.read_shard", "state.unflatten",
            "dist.barrier")

    def __init__(self) -> None:
        self.spans: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def watch(self, names: tuple[str, ...], owners: dict[str, Any]) -> Iterator[None]:
        """Time each ``owner.attr`` (or ``owner.Class.attr``) of `names` (`owners` maps the owner
        names to objects) inside the block; owners or attributes that do not exist are skipped.
        Everything is put back."""
        restore = []
        for name in names:
            owner_name, *path, attr = name.split(".")
            owner = owners.get(owner_name)
            for part in path:
                owner = getattr(owner, part, None)
            if owner is None or not hasattr(owner, attr):
                continue
            own = attr in vars(owner)  # else a class method, shadowed on the instance for now
            original = getattr(owner, attr)
            setattr(owner, attr, self._timed(name, original))
            restore.append((owner, attr, original if own else None))
        try:
            yield
        finally:
            for owner, attr, original in reversed(restore):
                if original is None:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, original)

    def _timed(self, name: str, function: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.spans.setdefault(name, []).append(time.perf_counter() - t0)
        return timed

    def summary(self) -> dict[str, dict[str, float]]:
        return {name: {"calls": len(s), "seconds": round(sum(s), 4)} for name, s in self.spans.items()}


class StallSamples:
    """What the calling thread did during a block, for the time no `Timeline` span explains: the
    Python garbage collector's passes (seconds and count per generation, `gc.callbacks`) and the
    thread's innermost frames sampled every `PERIOD_S` by a background thread (the most frequent
    stacks, each as its frames' ``file:function`` innermost first)."""

    PERIOD_S = 0.001
    DEPTH = 6

    def __init__(self) -> None:
        self.gc_s: dict[int, float] = {}
        self.gc_passes: dict[int, int] = {}
        self.stacks: collections.Counter[str] = collections.Counter()
        self._gc_started = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        generation = info["generation"]
        self.gc_s[generation] = self.gc_s.get(generation, 0.0) + time.perf_counter() - self._gc_started
        self.gc_passes[generation] = self.gc_passes.get(generation, 0) + 1

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        target, done = threading.get_ident(), threading.Event()

        def sample() -> None:
            while not done.wait(self.PERIOD_S):
                frame = sys._current_frames().get(target)
                names = []
                while frame is not None and len(names) < self.DEPTH:
                    names.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")
                    frame = frame.f_back
                self.stacks[" < ".join(names)] += 1

        sampler = threading.Thread(target=sample, daemon=True)
        gc.callbacks.append(self._on_gc)
        sampler.start()
        try:
            yield
        finally:
            done.set()
            sampler.join()
            gc.callbacks.remove(self._on_gc)

    def summary(self, top: int = 15) -> dict[str, Any]:
        return {"gc_s": {str(g): round(t, 4) for g, t in sorted(self.gc_s.items())},
                "gc_passes": {str(g): n for g, n in sorted(self.gc_passes.items())},
                "samples": sum(self.stacks.values()),
                "top_stacks": dict(self.stacks.most_common(top))}


def timeline_owners(engine: Any) -> dict[str, Any]:
    """The objects whose calls `Timeline.SAVE` and `Timeline.LOAD` name, for `engine`."""
    import deepspeed.comm
    from deepspeed.runtime.state_dict_factory import SDLoaderBase

    from nvcomp_ckpt_engine import api, commit, fileio, pipeline, selection, state, transforms
    from nvcomp_ckpt_engine.codecs import nvcomp_gpu
    from nvcomp_ckpt_engine.deepspeed import derived_module
    from nvcomp_ckpt_engine.pipeline import encode, plan

    ckpt = engine.checkpoint_engine
    return {"engine": engine, "ckpt": ckpt, "optimizer": engine.optimizer,
            "dist": deepspeed.comm, "sdloader": SDLoaderBase, "api": api, "pipeline": pipeline,
            "state": state, "derived_module": derived_module, "commit": commit, "fileio": fileio,
            "plan": plan, "selection": selection, "collective": getattr(ckpt, "_collective", None),
            "memory": getattr(ckpt, "memory", None), "module_plan": derived_module.ModulePlan,
            "encode": encode, "transforms": transforms, "nvcodec": nvcomp_gpu}


def state_snapshot(engine: Any) -> dict[str, torch.Tensor]:
    """Every tensor of the model and the full optimizer state, copied to the CPU."""
    snap = {f"param/{n}": p.detach().to("cpu", copy=True) for n, p in engine.module.named_parameters()}
    opt = engine.optimizer
    for i, t in enumerate(getattr(opt, "single_partition_of_fp32_groups", [])):
        snap[f"master/{i}"] = t.detach().to("cpu", copy=True)
    for i, s in enumerate(opt.optimizer.state.values()):
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                snap[f"adam/{i}/{k}"] = v.detach().to("cpu", copy=True)
    return snap


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


class Trainer:
    def __init__(self, size: str, device: torch.device, seed: int = 0, offload: bool = False) -> None:
        import deepspeed

        d, layers, heads, self.seq, self.micro = SIZES[size]
        torch.manual_seed(seed)
        model = GPT(d, layers, heads, self.seq)
        self.params = sum(p.numel() for p in model.parameters())
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(),
            config=ds_config(self.micro, bf16=device.type == "cuda", offload=offload))
        self.device = device
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> float:
        idx = torch.randint(0, VOCAB, (self.micro, self.seq), generator=self.gen).to(self.engine.device)
        loss = self.engine(idx)
        self.engine.backward(loss)
        self.engine.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return float(loss)

    def timed_steps(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t0)
        return times


def use_engine(trainer: Trainer, variant: str) -> Any:
    """Give the DeepSpeed engine the checkpoint engine this variant measures."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    import nvcomp_ckpt_engine.deepspeed as ours

    if variant == "default":
        trainer.engine.checkpoint_engine = TorchCheckpointEngine(None)
        return trainer.engine.checkpoint_engine
    algorithm, _, mode = variant.partition("-")
    # The automatic GPU budget as the job measures it before its first save: from its peak,
    # training steps included (run_variant resets the peak right after this).
    gpu_budget_gb = 0.0 if mode == "asynccopied" else pipeline.gpu_headroom_bytes() / 2**30
    return ours.install(trainer.engine, algorithm=algorithm, async_save=mode.startswith("async"),
                        async_gpu_memory_gb=gpu_budget_gb,
                        async_gpu_snapshot=mode != "asyncencode",
                        o_direct=mode == "direct", async_host_memory_gb=64,
                        load_to_gpu="auto" if mode != "hostload" else False,
                        io_path="gds" if mode == "gds" else "auto")


def peak_memory_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def pinning_s(device: torch.device) -> float:
    """Seconds spent so far in cudaHostAlloc by torch's pinned-memory allocator."""
    if device.type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return 0.0
    return torch.cuda.host_memory_stats().get("host_alloc_time.total", 0) / 1e6


def gpu_segments(device: torch.device) -> int:
    """Segments torch's GPU allocator has `cudaMalloc`-ed so far: a save's stall that allocates
    any paid for them."""
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_stats().get("segment.all.allocated", 0)


def gpu_extra_gib(device: torch.device, base: int) -> float | None:
    """Peak GPU memory allocated since the last reset, above `base`."""
    return gib(torch.cuda.max_memory_allocated() - base) if device.type == "cuda" else None


def run_variant(trainer: Trainer, variant: str, save_dir: Path, step_times: list[float],
                timeline: bool = False) -> dict[str, Any]:
    """One save and load of `variant`; with `timeline`, where their time went (`Timeline`)."""
    ckpt = use_engine(trainer, variant)
    # A job's first save comes long after initialize, where the engine starts pinning the async
    # arena in the background: wait for it as the job would have, and say how long it took.
    prepinning, prepin_s = getattr(ckpt, "prepinning", None), None
    if prepinning is not None:
        t0 = time.perf_counter()
        prepinning.join()
        prepin_s = time.perf_counter() - t0
    memory = getattr(ckpt, "memory", None)
    if memory is not None and "-async" in variant:
        # ... and runs training steps before it: after a whole one the engine caches the first
        # save's GPU budget and warms the codecs (`AsyncMemory.before_first_save`).
        trainer.timed_steps(memory.CACHE_AHEAD_AT_BOUNDARY)
        if memory.caching is not None:
            memory.caching.join()
    snapshot = state_snapshot(trainer.engine)  # what the save must hold, compared after the load
    device = trainer.device
    tag = f"bench_{variant}"
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    peak_memory_reset(device)
    pinned_before = pinning_s(device)
    segments_before = gpu_segments(device)
    saving, loading, stall = Timeline(), Timeline(), StallSamples()
    owners = timeline_owners(trainer.engine) if timeline else {}
    t0 = time.perf_counter()
    with (saving.watch(Timeline.SAVE, owners), HostMemory() as host, staging.METER.watch() as staged,
          stall.watch() if timeline else contextlib.nullcontext()):
        trainer.engine.save_checkpoint(str(save_dir), tag=tag)
    blocked = time.perf_counter() - t0
    pending = getattr(ckpt, "_pending", None)  # an async save in flight: what it copied on the GPU
    result: dict[str, Any] = {"variant": variant, "blocked_s": blocked,
                              "gpu_snapshot_gib": gib(pending.gpu_snapshot_bytes) if pending else None,
                              "pinning_s": pinning_s(device) - pinned_before,
                              "gpu_segments_in_stall": gpu_segments(device) - segments_before,
                              # Measured before any training step runs (steps during an async
                              # write use activations).
                              "gpu_extra_gib": gpu_extra_gib(device, base),
                              **host.report(),
                              "staging_peak_gib": gib(staged.peak_bytes),
                              "arena_gib": gib(staging.ARENA.pinned_bytes),
                              "prepin_wait_s": prepin_s}
    if variant == "default":
        os.sync()
        result["durable_s"] = time.perf_counter() - t0
    elif "-async" in variant:
        during = []
        with thread_times() as during_times:
            while not ckpt.committed(tag):
                during.append(trainer.timed_steps(1)[0])
        result["durable_s"] = time.perf_counter() - t0
        result["steps_during_write"] = len(during)
        if during:
            # Compared with as many steps right after the write, in the same process state (an
            # earlier load re-allocates the optimizer state); the steps before the first save are
            # reported too, and so are the slowdowns two plain writes of the same bytes cause.
            with thread_times() as after_times:
                after = trainer.timed_steps(max(len(during), len(step_times)))
            result["step_s_during_write_median"] = statistics.median(during)
            result["step_s_after_write_median"] = statistics.median(after)
            result["step_s_baseline_median"] = statistics.median(step_times)
            result["step_slowdown"] = statistics.median(during) / statistics.median(after) - 1
            result["step_s_during_write"] = [round(t, 4) for t in during]
            result["step_s_after_write"] = [round(t, 4) for t in after]
            # Where the training thread's time went (waits for the GIL count as "blocked", and
            # so do its waits for the GPU: compare the two windows).
            result["loop_thread_during_write"] = during_times.shares()
            result["loop_thread_after_write"] = after_times.shares()
            for name, write in CONTROL_WRITES.items():
                series = steps_during(lambda: trainer.timed_steps(1)[0], write,
                                      save_dir / f"{name}.bin", folder_bytes(save_dir / tag))
                result[f"{name}_step_slowdown"] = (statistics.median(series.during)
                                                   / statistics.median(series.after) - 1)
                result[f"steps_during_{name}"] = len(series.during)
                result[f"loop_thread_during_{name}"] = series.during_times.shares()
                result[f"loop_thread_after_{name}"] = series.after_times.shares()
    else:
        result["durable_s"] = blocked
    result["bytes"] = folder_bytes(save_dir / tag)
    if variant != "default":
        found = manifest.read_manifest(save_dir / tag)
        result["io"] = sorted({record.io for record in found.files if record.io is not None})
    result["file_bytes"] = {p.name: p.stat().st_size for p in sorted((save_dir / tag).glob("*.pt"))}
    result["rank_bytes"] = rank_bytes(result["file_bytes"])
    how = drop_page_cache(save_dir / tag)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    peak_memory_reset(device)
    # Steps taken during an async write changed the state: reload before comparing.
    t0 = time.perf_counter()
    with loading.watch(Timeline.LOAD, owners), HostMemory() as host, staging.METER.watch() as staged:
        trainer.engine.load_checkpoint(str(save_dir), tag=tag)
        if device.type == "cuda":
            torch.cuda.synchronize()
    result["load_s"] = time.perf_counter() - t0
    result["load_gpu_extra_gib"] = gpu_extra_gib(device, base)
    result.update(host.report("load_"))
    result["load_staging_peak_gib"] = gib(staged.peak_bytes)
    result["cache_drop"] = how
    result["bit_exact"] = same_state(snapshot, state_snapshot(trainer.engine))
    if timeline:
        result["timeline"] = {"save": saving.summary(), "load": loading.summary(),
                              "save_stall": stall.summary()}
    shutil.rmtree(save_dir / tag)
    gc.collect()
    return result


def rank_bytes(files: dict[str, int]) -> dict[int, int]:
    """Bytes each data-parallel rank wrote, from DeepSpeed's file names: every rank its ZeRO
    shard, rank 0 the model states (`deepspeed.names.rank_of`, one model-parallel rank here)."""
    from nvcomp_ckpt_engine.deepspeed.names import rank_of

    out: dict[int, int] = {}
    for name, size in files.items():
        out[rank_of(name, 1)] = out.get(rank_of(name, 1), 0) + size
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each timing over the repetitions; the runs themselves are kept too."""
    out = dict(runs[0])
    for key in ("blocked_s", "durable_s", "load_s", "step_slowdown", "plain_write_step_slowdown",
                "writer_io_step_slowdown",
                "step_s_during_write_median",
                "step_s_after_write_median"):
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    if len(runs) > 1:  # the first save of a process also pins its host buffers (cudaHostAlloc)
        out["blocked_s_first"] = runs[0]["blocked_s"]
        out["blocked_s_later"] = statistics.median(r["blocked_s"] for r in runs[1:])
    out["bit_exact"] = all(r["bit_exact"] for r in runs)
    out["runs"] = runs
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--steps", type=int, default=30, help="training steps before the saves")
    parser.add_argument("--variants", help=f"comma-separated, of {','.join(VARIANTS)} (default: all "
                        "of them; on a machine without CUDA those that need no GPU)")
    parser.add_argument("--reps", type=int, default=2, help="saves+loads per variant (medians)")
    parser.add_argument("--save-dir", type=Path, default=Path("bench_ckpt"))
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--offload", action="store_true",
                        help="ZeRO-Offload: optimizer state in host memory (the default engine vs ours)")
    parser.add_argument("--timeline", action="store_true",
                        help="record the time spent in DeepSpeed's and the engine's steps of each save and load")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29561"}.items():
        os.environ.setdefault(key, value)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    args.save_dir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)

    trainer = Trainer(args.size, device, offload=args.offload)
    trainer.timed_steps(args.steps)
    baseline_steps = trainer.timed_steps(10)
    results = []
    variants = args.variants.split(",") if args.variants else [
        v for v in VARIANTS if device.type == "cuda" or not (v.startswith("ans") or v.endswith("-gds"))]
    for variant in variants:
        runs = []
        for rep in range(args.reps):
            runs.append(run_variant(trainer, variant, args.save_dir, baseline_steps,
                                    timeline=args.timeline))
            logger.info("%s rep %d: %s", variant, rep, runs[-1])
        results.append(summarize(runs))
        (args.out / "bench_deepspeed.partial.json").write_text(json.dumps(results, indent=2))
    default = next((r for r in results if r["variant"] == "default"), None)
    for r in results:  # the whole-state ratio against DeepSpeed's default engine, in this run
        r["ratio_vs_default"] = default["bytes"] / r["bytes"] if default else None
    bandwidth = raw_bandwidths(args.save_dir, default["bytes"] if default else results[0]["bytes"], device)
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "size": args.size, "params": trainer.params,
        "offload": args.offload,
        "bandwidth": bandwidth, "results": results,
    }
    (args.out / "bench_deepspeed.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    trainer.engine.destroy()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0 if all(r["bit_exact"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
