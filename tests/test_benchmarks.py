"""Every benchmark runs its CPU smoke command to the end.

Benchmarks measure, they do not assert; but one that no longer runs (a renamed function, a
changed result key) is found here, not in the middle of a timed run on a GPU machine. The
figures these runs print mean nothing on a shared 2-core CPU.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from test_launchers import launch_env

ROOT = Path(__file__).resolve().parents[1]

#: (name, arguments after the interpreter, what the run writes under OUT); the smoke commands
#: each benchmark's docstring gives, with OUT and scratch folders in the test's directory.
SMOKE_RUNS = [
    ("deepspeed", ["benchmarks/bench_deepspeed.py", "--size", "tiny", "--reps", "1", "--timeline",
                   "--save-dir", "{tmp}/ckpt", "--out", "{tmp}/out"], "bench_deepspeed.json"),
    ("deepspeed-offload", ["benchmarks/bench_deepspeed.py", "--size", "tiny", "--reps", "1",
                           "--offload", "--variants", "default,none,auto", "--save-dir", "{tmp}/ckpt",
                           "--out", "{tmp}/out"], "bench_deepspeed.json"),
    ("codecs", ["-m", "benchmarks.bench_codecs", "--device", "cpu", "--size", "tiny", "--steps", "30",
                "--out", "{tmp}/out"], None),
    ("dcp", ["benchmarks/bench_dcp.py", "--device", "cpu", "--size", "tiny", "--reps", "1",
             "--scratch", "{tmp}/scratch", "--out", "{tmp}/out"], "bench_dcp.json"),
    ("load", ["benchmarks/bench_load.py", "--params", "2e7", "--width", "256", "--scratch", "{tmp}/scratch",
              "--out", "{tmp}/out"], None),
    ("async-steps", ["benchmarks/bench_async_steps.py", "--gb", "0.02", "--reps", "1",
                     "--scratch", "{tmp}/scratch", "--out", "{tmp}/out"], "bench_async_steps.json"),
    ("storage", ["benchmarks/bench_storage.py", "--gb", "0.05", "--scratch", "{tmp}/scratch",
                 "--out", "{tmp}/out"], None),
    ("storage-s3", ["benchmarks/bench_storage.py", "--backend", "s3", "--gb", "0.03", "--scratch", "{tmp}/scratch",
                    "--out", "{tmp}/out"], "bench_storage_s3.json"),
    ("universal", ["benchmarks/bench_universal.py", "--size", "tiny", "--reps", "1",
                   "--scratch", "{tmp}/scratch", "--out", "{tmp}/out"], "bench_universal.json"),
    ("ranks", ["benchmarks/bench_ranks.py", "--sizes", "2", "--layers", "1", "--width", "64", "--steps", "1",
               "--out", "{tmp}/out"], "bench_ranks.json"),
    ("tier", ["benchmarks/bench_tier.py", "--params", "4e6", "--scratch", "{tmp}/scratch",
              "--out", "{tmp}/out"], "bench_tier_cpu.json"),
    ("crc", ["benchmarks/bench_crc.py", "--gb", "0.05", "--reps", "1", "--threads", "2",
             "--scratch", "{tmp}/scratch", "--out", "{tmp}/out"], "bench_crc.json"),
    ("tier-stall", ["benchmarks/bench_tier_stall.py", "--width", "64", "--layers", "1", "--saves", "1",
                    "--gap", "2", "--scratch", "{tmp}/scratch", "--out", "{tmp}/out"], "bench_tier_stall_cpu.json"),
    # Saved at 2 ranks, resumed on 1 (4 -> 2 in the real run): fewer processes to start.
    ("reshard", ["benchmarks/bench_reshard.py", "--stages", "2", "--width", "32", "--layers", "1",
                 "--steps", "1", "--reps", "1", "--save-size", "2", "--resume-size", "1",
                 "--scratch", "{tmp}/scratch", "--out", "{tmp}/out"], "bench_reshard_cpu.json"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args, writes", [(a, w) for _, a, w in SMOKE_RUNS], ids=[n for n, _, _ in SMOKE_RUNS])
def test_benchmark_smoke_run(tmp_path: Path, args: list[str], writes: str | None) -> None:
    command = [sys.executable, *(a.format(tmp=tmp_path) for a in args)]
    env = launch_env(CUDA_VISIBLE_DEVICES="")  # the CPU smoke run, on GPU machines too
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    out = tmp_path / "out"
    assert any(out.iterdir()), f"{' '.join(command)} wrote nothing under {out}"
    if writes:
        assert (out / writes).is_file()
    if writes == "bench_dcp.json":
        _check_dcp_report(out / writes, tmp_path / "scratch")
    if writes == "bench_reshard_cpu.json":
        _check_reshard_report(out / writes, tmp_path / "scratch")


def _check_reshard_report(report: Path, scratch: Path) -> None:
    """Every route resumed, each resumed state equal to the saved one and to the plain load's,
    and the conversions were timed for both universal routes only; no checkpoint is left."""
    (stage,) = json.loads(report.read_text())["stages"]
    assert set(stage["bit_exact"]) == {"reshard_equals_saved", "ours_equals_saved", "deepspeed_equals_saved",
                                       "ours_equals_reshard", "deepspeed_equals_reshard"}
    assert all(stage["bit_exact"].values()), stage["bit_exact"]
    summary = stage["summary"]
    assert summary["reshard"]["convert_s"] == 0 and summary["reshard"]["convert_peak_memory_gib"] is None
    assert all(summary[route]["convert_s"] > 0 for route in ("ours", "deepspeed"))
    assert all(row["peak_rss_gib"] > 0 and len(row["ranks"]) == 1 for row in stage["runs"])
    assert not any(scratch.iterdir())


def test_the_reshard_benchmark_compares_bytes_not_values() -> None:
    """Its agreement check tells apart what `torch.equal` takes as equal (-0.0 and 0.0), and a
    dtype or a step count that differs."""
    same_bytes = _benchmark("bench_reshard").same_bytes
    zeros = torch.zeros(3, dtype=torch.bfloat16)
    state = {"global_steps": 2, "w": {"fp32": torch.zeros(3)}}
    assert same_bytes(state, {"global_steps": 2, "w": {"fp32": torch.zeros(3)}})
    assert torch.equal(zeros, -zeros) and not same_bytes(zeros, -zeros)
    assert not same_bytes(zeros, zeros.float())
    assert not same_bytes(state, {"global_steps": 3, "w": {"fp32": torch.zeros(3)}})


def _check_dcp_report(report: Path, scratch: Path) -> None:
    """Every variant ran to the end, bit-exact; DCP's async save and the engine's were timed
    side by side (stall until `async_save` returned, then until durable); no checkpoint is left."""
    summary = {row["variant"]: row for row in json.loads(report.read_text())["summary"]}
    assert {"dcp", "nvcomp", "nvcomp-portable", "dcp-async", "nvcomp-async"} <= set(summary)
    assert all(row["bit_exact"] for row in summary.values()), summary
    for variant in ("dcp-async", "nvcomp-async"):
        assert 0 < summary[variant]["blocked_s"] <= summary[variant]["save_s"], summary[variant]
    assert all(row["read_s"] > 0 and row["read_gbps"] > 0 and row["load_vs_read"] > 0
               for row in summary.values()), summary
    assert not any(scratch.iterdir())


def test_thread_times_tell_waiting_for_a_lock_from_working() -> None:
    """The async benchmarks' measure of GIL waits: a thread blocked on a lock (the GIL is one)
    counts as blocked, a thread that computes does not."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from common import thread_times
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    lock = threading.Lock()
    lock.acquire()
    releaser = threading.Timer(0.3, lock.release)
    releaser.start()
    with thread_times() as waited:
        lock.acquire()
    with thread_times() as busy:
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:
            pass
    releaser.join()
    if waited.running_s is None:
        pytest.skip("this kernel gives no per-thread scheduler statistics")
    assert waited.blocked_s > 0.2 and waited.running_s < 0.1, waited
    assert busy.blocked_s < 0.05 and busy.running_s + busy.runnable_s > 0.15, busy
    assert waited.shares()["blocked"] > 0.7 and busy.shares()["blocked"] < 0.25


def _benchmark(name: str):  # noqa: ANN202 - a benchmark script, imported as a module
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_save_timeline_times_methods_of_classes_and_puts_them_back() -> None:
    """``owner.Class.method`` spans (the capture's) are timed inside the block only."""
    bench = _benchmark("bench_deepspeed")

    class Capture:
        def start(self) -> int:
            time.sleep(0.01)
            return 7

    owner = type("Module", (), {"Capture": Capture})
    original = Capture.start
    timeline = bench.Timeline()
    with timeline.watch(("encode.Capture.start", "encode.Missing.start"), {"encode": owner}):
        assert Capture().start() == 7
    assert Capture.start is original
    summary = timeline.summary()
    assert list(summary) == ["encode.Capture.start"] and summary["encode.Capture.start"]["calls"] == 1
    assert summary["encode.Capture.start"]["seconds"] >= 0.01


def test_stall_samples_record_the_collectors_passes_and_the_threads_stacks() -> None:
    """A full collection inside the block is counted with its generation and time, and the
    sampler sees the function the thread was in."""
    bench = _benchmark("bench_deepspeed")
    samples = bench.StallSamples()

    def waiting_in_a_known_function() -> None:
        time.sleep(0.05)

    with samples.watch():
        gc.collect()
        waiting_in_a_known_function()
    summary = samples.summary()
    assert summary["gc_passes"].get("2", 0) >= 1 and summary["gc_s"]["2"] > 0
    assert any("waiting_in_a_known_function" in stack for stack in summary["top_stacks"])
    assert samples._on_gc not in gc.callbacks


class _StubDcpBench:
    """What `bench_dcp.run_round` asks of a `Bench`, with saves that write a small file (whatever
    `raw_bytes` claims) and note what the scratch folder held when they began."""

    rank = 0

    def __init__(self, scratch: Path, raw_bytes: int) -> None:
        self.scratch, self.raw_bytes = scratch, raw_bytes
        self.on_disk_at_each_save: list[list[str]] = []

    def barrier(self) -> None:
        pass

    def everywhere(self, ok: bool) -> bool:
        return ok

    def save(self, variant: str, writer: object) -> dict[str, float]:
        self.on_disk_at_each_save.append(sorted(p.name for p in self.scratch.iterdir()))
        (self.scratch / variant).mkdir()
        (self.scratch / variant / "__0_0.distcp").write_bytes(bytes(1000))
        return {"save_s": 1.0}

    def load(self, reader: object) -> tuple[float, bool]:
        return 1.0, True

    def slowest(self, seconds: float) -> float:
        return seconds

    def share(self) -> tuple[int, int]:
        return 0, 1


def test_the_dcp_benchmark_holds_one_checkpoint_at_a_time(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Each variant's checkpoint is gone before the next save starts, and the last one after
    the round: keeping them all filled the H200's disk in `dcp-async`, the fifth variant."""
    bench = _benchmark("bench_dcp")
    monkeypatch.setattr(bench, "drop_page_cache", lambda folder: "none")  # no os.sync per save
    stub = _StubDcpBench(tmp_path, 1000)
    rows = bench.run_round(stub, list(bench.VARIANTS), tmp_path, zstd=None)
    assert [row["variant"] for row in rows] == list(bench.VARIANTS)
    assert all(row["bytes"] == 1000 for row in rows)
    assert all(row["read_s"] > 0 and row["load_vs_read"] == 1.0 / row["read_s"] for row in rows)
    assert stub.on_disk_at_each_save == [[] for _ in bench.VARIANTS]
    assert not any(tmp_path.iterdir())


def test_the_dcp_benchmark_refuses_a_save_the_disk_cannot_hold(tmp_path: Path) -> None:
    """Refused before it starts, naming the folder, not failing midway behind torch's message."""
    bench = _benchmark("bench_dcp")
    room = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    stub = _StubDcpBench(tmp_path, 2 * room + (1 << 30))
    with pytest.raises(RuntimeError, match="dcp: not saved: .* GB free.*--scratch") as refused:
        bench.run_round(stub, ["dcp"], tmp_path, zstd=None)
    assert str(tmp_path) in str(refused.value) and stub.on_disk_at_each_save == []


class _FullDiskDcpBench(_StubDcpBench):
    """Saves with `torch.save` into a file that is always out of room, opened as DCP opens its
    files (buffered: the zip headers fit the buffer, the tensor's bytes fail)."""

    def save(self, variant: str, writer: object) -> dict[str, float]:
        full = open("/dev/full", "wb")
        try:
            torch.save(torch.zeros(1 << 16), full)
        finally:
            with contextlib.suppress(OSError):  # the headers still in the buffer
                full.close()
        return {"save_s": 1.0}


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_save_that_fills_the_disk_is_reported_by_its_first_error(tmp_path: Path) -> None:
    """torch.save's zip writer hides a full disk behind `unexpected pos 704 vs 598` (its close,
    after the failed write of the first tensor's bytes): the benchmark names the OSError."""
    bench = _benchmark("bench_dcp")
    with pytest.raises(RuntimeError, match=r"dcp: the save into .* failed: OSError\(28, 'No space") as failed:
        bench.run_round(_FullDiskDcpBench(tmp_path, 1000), ["dcp"], tmp_path, zstd=None)
    assert "unexpected pos 704 vs 598" in str(failed.value.__cause__)
    assert isinstance(bench.first_error(failed.value), OSError)


def test_the_cold_read_of_a_folder_by_several_ranks_reads_each_byte_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk bound `bench_dcp` divides a load by (`common.cold_read`): every file under the
    folder, in pieces; ranks reading together share the pieces out."""
    common = _benchmark("common")
    monkeypatch.setattr(common, "COLD_READ_PIECE", 1000)
    monkeypatch.setattr(common, "drop_page_cache", lambda folder: "none")
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(os.urandom(2500))
    (tmp_path / "sub" / "b.bin").write_bytes(os.urandom(999))
    whole, seconds = common.cold_read(tmp_path)
    assert whole == 3499 and seconds > 0
    assert sum(common.cold_read(tmp_path, (rank, 3))[0] for rank in range(3)) == 3499
