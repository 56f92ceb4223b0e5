"""GPU payloads written from GPU memory (`io_path`, the GPUDirect Storage sink on kvikio).

On the CPU (CI): the option's validation, the choice of the way (``"gds"`` without kvikio is an
error naming the option, ``"auto"`` is pinned), the GDS sink's file guarantees against a fake
kvikio (temporary name, atomic publish, abort, links out, the handle kvikio opened), and the
record a save leaves in the manifest and ``inspect``. On a GPU with kvikio (`gpu` marker): a
save through the real sink is bit-exact and says ``gds`` or ``gds-compat``.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import types
import warnings
import zlib
from pathlib import Path

import pytest
import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import cli, collectives, commit, manifest, options
from nvcomp_ckpt_engine.config import NvcompConfig
from nvcomp_ckpt_engine.pipeline import io_path
from nvcomp_ckpt_engine.storage import OutsideRootError, StorageError, gds
from nvcomp_ckpt_engine.storage.posix import PosixStorage

from conftest import assert_same_tensor


def _state(device: str = "cpu") -> dict:
    torch.manual_seed(0)
    w = torch.randn(300_000, device=device)
    return {"master": w, "exp_avg": torch.randn(300_000, device=device) * 1e-3,
            "half": w[:5000].bfloat16(), "step": torch.tensor(7, device=device), "meta": {"lr": 0.1}}


def _check(a: dict, b: dict) -> None:
    for key in ("master", "exp_avg", "half", "step"):
        assert_same_tensor(a[key], b[key], key)
    assert a["meta"] == b["meta"]


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------------------------------------
# The option and the choice of the way.


@pytest.mark.parametrize("bad", ["fast", "GDS", "", None, True, 1])
def test_io_path_is_validated_where_it_is_given(bad, tmp_path: Path) -> None:
    assert NvcompConfig().io_path == "auto" and NvcompConfig(io_path="gds").io_path == "gds"
    expected = r"is not valid; expected one of \"auto\", \"pinned\", \"gds\""
    with pytest.raises(ValueError, match=rf"^nvcomp_checkpoint: 'io_path' = {bad!r} {expected}"):
        NvcompConfig.from_mapping({"enabled": True, "io_path": bad})
    with pytest.raises(ValueError, match=rf"^'io_path' = {bad!r} {expected}"):
        nce.save({"w": torch.ones(4)}, tmp_path / "x.nvckpt", io_path=bad)
    assert _left(tmp_path) == []


def test_gds_without_kvikio_names_the_option_and_auto_is_pinned(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(gds, "kvikio_available", lambda: False)
    with pytest.raises(ValueError, match=r"^'io_path' = \"gds\" cannot write .*x.nvckpt: it needs "
                       r"kvikio, .*\[gds-cu12\] or \[gds-cu13\]\); set io_path to \"auto\" or \"pinned\""):
        nce.save(_state(), tmp_path / "x.nvckpt", io_path="gds")
    with pytest.raises(ValueError, match=r"^'io_path' = \"gds\" cannot write .*y.nvckpt: it needs kvikio"):
        nce.save_async(_state(), tmp_path / "y.nvckpt", io_path="gds", host_budget_bytes=1 << 30)
    assert _left(tmp_path) == []
    with pytest.raises(ValueError, match="writes local files only"):
        io_path.resolve("gds", "s3://bucket/run/x.nvckpt")
    assert io_path.resolve("auto", tmp_path / "x") == io_path.resolve("pinned", tmp_path / "x") == "pinned"
    # The one constant that makes "auto" the GDS sink: where it cannot be had, still pinned.
    monkeypatch.setattr(io_path, "AUTO_IO_PATH", "gds")
    assert io_path.resolve("auto", tmp_path / "x") == "pinned"
    monkeypatch.setattr(gds, "kvikio_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert io_path.resolve("auto", tmp_path / "x") == "gds"
    assert io_path.resolve("auto", "s3://bucket/run/x") == "pinned"
    assert options.AUTO_IO_PATH == "pinned"  # until a GPU measurement says otherwise


def test_the_dcp_writer_checks_io_path_when_it_is_made(tmp_path: Path, monkeypatch) -> None:
    from nvcomp_ckpt_engine.dcp import NvcompFileSystemWriter

    monkeypatch.setattr(gds, "kvikio_available", lambda: False)
    with pytest.raises(ValueError, match=r"^'io_path' = 'fast' is not valid"):
        NvcompFileSystemWriter(tmp_path / "dcp", io_path="fast")
    with pytest.raises(ValueError, match=r"^'io_path' = \"gds\" cannot be used here: it needs kvikio"):
        NvcompFileSystemWriter(tmp_path / "dcp", io_path="gds")
    assert NvcompFileSystemWriter(tmp_path / "dcp", io_path="pinned").io_path == "pinned"


# ---------------------------------------------------------------------------------------------
# The GDS sink against a fake kvikio: its file guarantees are the POSIX sink's.


class _Future:
    def __init__(self, written: int) -> None:
        self.written, self.waited = written, False

    def get(self) -> int:
        self.waited = True
        return self.written


class _FakeCuFile:
    """kvikio's CuFile as the sink uses it: opens an existing file ("r+": no create, no
    truncation) and writes a buffer at an offset, returning a future."""

    short_by = 0
    futures: list[_Future] = []

    def __init__(self, path: str, flags: str) -> None:
        assert flags == "r+"
        self.fd, self.closed = os.open(path, os.O_RDWR), False

    def fileno(self) -> int:
        return self.fd

    def pwrite(self, buf, size: int, file_offset: int) -> _Future:
        os.pwrite(self.fd, memoryview(buf).cast("B")[:size - self.short_by], file_offset)
        self.futures.append(_Future(size - self.short_by))
        return self.futures[-1]

    def close(self) -> None:
        os.close(self.fd)
        self.closed = True


@pytest.fixture
def fake_kvikio(monkeypatch) -> dict:
    """A kvikio module in compatibility mode; returns the settings the sink made."""
    settings: dict = {}
    module = types.ModuleType("kvikio")
    module.__spec__ = importlib.machinery.ModuleSpec("kvikio", None)
    module.CuFile = _FakeCuFile
    # Like kvikio's: `kvikio.defaults` is a submodule its package does not import.
    defaults = types.ModuleType("kvikio.defaults")
    defaults.is_compat_mode_preferred = lambda: True
    defaults.set = settings.__setitem__
    monkeypatch.setitem(sys.modules, "kvikio", module)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    monkeypatch.setattr(gds, "_io_mode", None)
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    monkeypatch.setattr(_FakeCuFile, "futures", [])
    return settings


def test_gds_sink_writes_host_and_device_bytes_then_publishes(tmp_path: Path, fake_kvikio) -> None:
    with pytest.warns(RuntimeWarning, match="kvikio writes GPU payloads in its compatibility mode"):
        storage = gds.GdsStorage(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process
        assert gds.GdsStorage(tmp_path).io == storage.io == "gds-compat"
    assert fake_kvikio == {"num_threads": gds.KVIKIO_THREADS}
    assert storage.capabilities.device_buffers and storage.capabilities.atomic_rename
    device = bytearray(os.urandom(5000))
    with storage.open_sink("x.bin") as sink:
        assert sink.append(b"head") == 0
        assert sink.append_device(device, len(device)) == 4
        assert sink.append(b"tail") == 5004
        (partial,) = _left(tmp_path)
        assert partial.startswith(".x.bin.") and partial.endswith(".nvckpt-partial")
        assert sink.finish() == 5008
    assert (tmp_path / "x.bin").read_bytes() == b"head" + device + b"tail"
    assert _left(tmp_path) == ["x.bin"] and all(f.waited for f in _FakeCuFile.futures)


def test_gds_sink_abort_waits_for_device_writes_and_leaves_nothing(tmp_path: Path, fake_kvikio) -> None:
    (tmp_path / "x.bin").write_bytes(b"old")
    with pytest.warns(RuntimeWarning):
        storage = gds.GdsStorage(tmp_path)
    with pytest.raises(RuntimeError, match="encoder failed"):
        with storage.open_sink("x.bin") as sink:
            sink.append_device(bytearray(100), 100)
            raise RuntimeError("encoder failed")
    assert _FakeCuFile.futures[0].waited
    assert _left(tmp_path) == ["x.bin"] and (tmp_path / "x.bin").read_bytes() == b"old"
    _FakeCuFile.short_by = 10
    try:
        sink = storage.open_sink("y.bin")
        sink.append_device(bytearray(100), 100)
        with pytest.raises(StorageError, match=r"y.bin: kvikio wrote 90 of 100 bytes at offset 0 \(gds-compat\)"):
            sink.finish()
    finally:
        _FakeCuFile.short_by = 0
    assert _left(tmp_path) == ["x.bin"]


def test_gds_sink_refuses_links_out_and_a_file_kvikio_did_not_open(tmp_path: Path, fake_kvikio,
                                                                   monkeypatch) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "out").symlink_to(outside)
    with pytest.warns(RuntimeWarning):
        storage = gds.GdsStorage(root)
    with pytest.raises(OutsideRootError, match="outside"):
        storage.open_sink("out/x.bin")
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"")

    def open_decoy(self, path: str, flags: str) -> None:  # a temporary name swapped meanwhile
        self.fd, self.closed = os.open(decoy, os.O_RDWR), False

    monkeypatch.setattr(_FakeCuFile, "__init__", open_decoy)
    with pytest.raises(StorageError, match="was replaced before kvikio opened it; nothing was written"):
        storage.open_sink("x.bin")
    assert _left(root) == ["out"] and _left(outside) == [] and decoy.read_bytes() == b""


def test_a_sink_without_device_buffers_refuses_them(tmp_path: Path) -> None:
    storage = PosixStorage(tmp_path)
    assert not storage.capabilities.device_buffers
    sink = storage.open_sink("x.bin")
    with pytest.raises(NotImplementedError, match="PosixSink takes host memory only"):
        sink.append_device(bytearray(4), 4)
    sink.abort()
    assert _left(tmp_path) == []


def test_a_save_through_the_gds_sink_loads_bit_exact(tmp_path: Path, fake_kvikio, monkeypatch) -> None:
    """The whole save through the GDS sink (on the CPU its payloads are host bytes: "host")."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what resolve asks only
    opened = []
    monkeypatch.setattr(_FakeCuFile, "fileno", lambda self: opened.append(self) or self.fd)
    state = _state()
    with pytest.warns(RuntimeWarning):
        info = nce.save(state, tmp_path / "x.nvckpt", io_path="gds", chunk_mb=1 / 4)
    monkeypatch.undo()
    assert opened and info.io == "host"
    assert zlib.crc32((tmp_path / "x.nvckpt").read_bytes()) == info.crc32
    _check(state, nce.load(tmp_path / "x.nvckpt"))


# ---------------------------------------------------------------------------------------------
# The record: in the manifest, and what inspect shows.


def _commit_one(tag_dir: Path, names: list[str], **save_options) -> manifest.Manifest:
    """One rank's save of `names` as the DeepSpeed engine records it, committed."""
    from nvcomp_ckpt_engine.deepspeed.saves import shard_record

    plan = commit.prepare_tag_dir(tag_dir.parent, tag_dir.name, rank=0)
    records = [shard_record(name, 0, nce.save(_state(), plan.write_path(tag_dir / name), **save_options))
               for name in names]
    result = commit.commit_checkpoint(plan.tag_dir, records, collective=collectives.LocalCollective(),
                                      layout=manifest.layout_record("torch"), timeout_s=10, plan=plan)
    return result.manifest


def test_the_manifest_records_the_io_path_and_inspect_shows_it(tmp_path: Path, capsys) -> None:
    tag = tmp_path / "ckpt" / "global_step1"
    found = _commit_one(tag, ["a.pt", "b.pt"], io_path="pinned")
    capsys.readouterr()  # what importing DeepSpeed printed
    assert [r.io for r in found.files] == ["host", "host"]  # nothing was coded on a GPU
    assert json.loads(manifest.manifest_path(tag).read_text())["version"] == 3
    assert cli.main(["inspect", "--json", str(tag)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(f["path"], f["io"]) for f in doc["files"]] == [("a.pt", "host"), ("b.pt", "host")]
    assert cli.main(["inspect", str(tag)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  a.pt: ")]
    assert len(lines) == 1 and lines[0].endswith(", written host")
    assert cli.main(["inspect", "--json", str(tag / "a.pt")]) == 0  # a file alone: no manifest
    assert json.loads(capsys.readouterr().out)["files"][0]["io"] is None


# ---------------------------------------------------------------------------------------------
# On a GPU with kvikio.


needs_kvikio = pytest.mark.skipif(not gds.kvikio_available(), reason="kvikio is not installed")


@pytest.mark.gpu
@needs_kvikio
@pytest.mark.parametrize("algorithm", ["auto", "zstd"])
def test_gpu_save_through_gds_is_bit_exact_and_says_so(tmp_path: Path, algorithm: str) -> None:
    state = _state("cuda")
    state["noise"] = torch.randint(0, 256, (300_000,), dtype=torch.uint8, device="cuda")  # stored raw
    state["offload"] = torch.randn(100_000)  # host memory, streamed through the GPU's codecs
    info = nce.save(state, tmp_path / "x.nvckpt", io_path="gds", algorithm=algorithm,
                    chunk_mb=1 / 4, gpu_batch_mb=1)
    assert info.io == gds.io_mode() and info.io in ("gds", "gds-compat")
    assert zlib.crc32((tmp_path / "x.nvckpt").read_bytes()) == info.crc32
    for out in (nce.load(tmp_path / "x.nvckpt"), nce.load(tmp_path / "x.nvckpt", map_location="cpu")):
        _check(state, out)
        assert_same_tensor(state["noise"], out["noise"], "noise")
        assert_same_tensor(state["offload"], out["offload"], "offload")
    pinned = nce.save(state, tmp_path / "p.nvckpt", io_path="pinned", algorithm=algorithm,
                      chunk_mb=1 / 4, gpu_batch_mb=1)
    assert pinned.io == "pinned"
    # An async save that snapshots on the GPU writes its copy through the sink, on its own stream.
    pending = nce.save_async(state, tmp_path / "s.nvckpt", host_budget_bytes=1 << 30,
                             gpu_budget_bytes=1 << 30, gpu_snapshot=True, io_path="gds",
                             algorithm=algorithm, chunk_mb=1 / 4, gpu_batch_mb=1)
    assert pending.snapshot_bytes > 0 and pending.result().io == info.io
    _check(state, nce.load(tmp_path / "s.nvckpt"))
    assert _left(tmp_path) == ["p.nvckpt", "s.nvckpt", "x.nvckpt"]


@pytest.mark.gpu
@needs_kvikio
def test_gpu_gds_manifest_record_and_abort(tmp_path: Path) -> None:
    tag = tmp_path / "ckpt" / "global_step1"
    plan = commit.prepare_tag_dir(tag.parent, tag.name, rank=0)
    info = nce.save(_state("cuda"), plan.write_path(tag / "a.pt"), io_path="gds")
    records = [manifest.ShardRecord(path="a.pt", rank=0, raw_bytes=info.raw_bytes, file_bytes=info.file_bytes,
                                    crc32=info.crc32, codecs=info.codecs, io=info.io)]
    found = commit.commit_checkpoint(plan.tag_dir, records, collective=collectives.LocalCollective(),
                                     layout=manifest.layout_record("torch"), timeout_s=10, plan=plan).manifest
    assert [r.io for r in found.files] == [gds.io_mode()]
    # A sink aborted with device writes in flight leaves nothing behind.
    before = _left(tag)
    payload = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device="cuda")
    sink = gds.GdsStorage(tag).open_sink("b.pt")
    sink.append(b"header")
    for _ in range(8):
        sink.append_device(payload, payload.numel())
    sink.abort()
    assert _left(tag) == before
