"""`nvcomp-ckpt` on real checkpoints: a plain DeepSpeed ZeRO-2 bf16 save (fp32 on a CPU without
bf16; one CPU rank), the same checkpoint compressed by `nvcomp-ckpt compress`, and small shards
written with `save`.

What is checked is what a user relies on: exit statuses, messages naming the damaged file,
bit-exact conversions both ways, and DeepSpeed's own tools (`zero_to_fp32`, `ds_to_universal`)
accepting what `decompress` writes -- or, through `zero-to-fp32` and the wrapped recovery
script, the compressed checkpoint itself.
"""

from __future__ import annotations

import json
import logging
import os
import re
import runpy
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import cli, compat, container, discovery, manifest, manifest_files
from nvcomp_ckpt_engine.errors import CheckpointError
from nvcomp_ckpt_engine.container import read_index

from capabilities import unsupported_reason
from conftest import assert_same_tensor

REPO = Path(__file__).resolve().parents[1]
TAGS = ("global_step1", "global_step2")
#: The plain checkpoint's training dtype: bf16, or fp32 where this CPU's DeepSpeed has no bf16
#: (no command here depends on the dtype; the file names and sizes do).
DTYPE = "bf16" if unsupported_reason("bf16") is None else "fp32"
TORCH_DTYPE, ITEMSIZE = {"bf16": ("bfloat16", 2), "fp32": ("float32", 4)}[DTYPE]
OPTIM = ("bf16_" if DTYPE == "bf16" else "") + "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"

# A tiny DeepSpeed run that saves two plain checkpoints (the engine is not involved). The
# client state `universal_checkpoint_info` is what Megatron-DeepSpeed adds and what
# ds_to_universal requires.
DS_SAVE = textwrap.dedent(
    """
    import sys, torch, deepspeed, torch.distributed as dist
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    bf16 = sys.argv[2] == "bf16"
    config = {"train_batch_size": 2, "bf16": {"enabled": bf16},
              "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    for step in (1, 2):
        x = torch.randn(2, 8, dtype=torch.bfloat16 if bf16 else torch.float32)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(sys.argv[1], tag=f"global_step{step}",
                               client_state={"universal_checkpoint_info": {}})
    engine.destroy()
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    """The environment for a child Python: this checkout importable, DeepSpeed on the CPU."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu", **extra)
    return env


def _run_python(args: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
                timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env or _env(), timeout=timeout,
                          capture_output=True, text=True)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`nvcomp-ckpt ARGV` in this process: (exit status, stdout, stderr)."""
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def assert_same_object(a, b, path: str = "") -> None:
    """Equal structure, equal bits in every tensor, equal everything else (objects by their
    attributes: DeepSpeed's LossScaler has no __eq__)."""
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert_same_tensor(a, b, path)
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_same_object(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_object(x, y, f"{path}/{i}")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert_same_object(vars(a), vars(b), f"{path}.__dict__")
    else:
        assert a == b, path


def torch_load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=False)


# ---------------------------------------------------------------------------------------------
# Fixtures: one plain DeepSpeed checkpoint, compressed once, copied by tests that damage it.


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory) -> Path:
    save_dir = tmp_path_factory.mktemp("plain") / "ckpt"
    env = _env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    done = _run_python(["-c", DS_SAVE, str(save_dir), DTYPE], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (save_dir / "global_step2").iterdir()) == sorted([OPTIM, MODEL])
    return save_dir


@pytest.fixture(scope="module")
def engine_ckpt(plain_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engine") / "ckpt"
    assert cli.main(["compress", "-q", "--trusted", str(plain_ckpt), str(out)]) == 0
    return out


@pytest.fixture
def engine_copy(engine_ckpt, tmp_path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(engine_ckpt, copy)
    return copy


@pytest.fixture
def small_shard(tmp_path) -> tuple[Path, dict]:
    state = {"w": torch.randn(64, 32), "h": torch.randn(100).to(torch.bfloat16),
             "step": torch.tensor(7), "meta": {"name": "small", "lr": 0.1}}
    path = tmp_path / "small.pt"
    nce.save(state, path, chunk_mb=1 / 1024)
    return path, state


# ---------------------------------------------------------------------------------------------
# compress


def test_compress_writes_engine_checkpoint_that_loads_back_identically(plain_ckpt, engine_ckpt):
    for tag in TAGS:
        for name in (OPTIM, MODEL):
            assert nce.is_shard_file(engine_ckpt / tag / name)
            assert_same_object(torch_load(plain_ckpt / tag / name),
                               nce.load(engine_ckpt / tag / name, map_location="cpu"))
        found = manifest.read_manifest(engine_ckpt / tag)
        manifest_files.verify_files(engine_ckpt / tag, found)
        assert {r.path for r in found.files} == {OPTIM, MODEL}
        assert dict(found.layout) == manifest.layout_record("deepspeed", dp=1, tp=1, pp=1,
                                                            zero_stage=2)
        assert found.step == int(tag[-1]) and found.world_size == 1
        assert (engine_ckpt / tag / manifest.TAG_MARKER_NAME).is_file()
    assert (engine_ckpt / "latest").read_text() == "global_step2"
    assert "nvcomp_ckpt_engine" in (engine_ckpt / "zero_to_fp32.py").read_text()
    assert os.access(engine_ckpt / "zero_to_fp32.py", os.X_OK)


def test_compress_refuses_objects_without_trusted(plain_ckpt, tmp_path, capsys):
    status, _, err = run_cli(capsys, "compress", "-q", str(plain_ckpt), str(tmp_path / "out"))
    assert status == 1
    assert OPTIM in err and "--trusted" in err and "LossScaler" in err


def test_compress_one_tag_folder(plain_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    status, stdout, _ = run_cli(capsys, "compress", "-q", "--trusted", "--algorithm", "deflate",
                                str(plain_ckpt / "global_step1"), str(out))
    assert status == 0 and "1 tag(s)" in stdout
    assert (out / "latest").read_text() == "global_step1"
    assert read_index(out / "global_step1" / MODEL).codecs == ("deflate",)


# ---------------------------------------------------------------------------------------------
# inspect


def test_inspect_save_dir_json(engine_ckpt, capsys):
    status, out, _ = run_cli(capsys, "inspect", "--json", str(engine_ckpt))
    assert status == 0
    doc = json.loads(out)
    assert doc["tag"] == "global_step2" and doc["manifest"]["world_size"] == 1
    found = manifest.read_manifest(engine_ckpt / "global_step2")
    assert doc["totals"]["raw_bytes"] == found.raw_bytes
    assert doc["totals"]["file_bytes"] == found.file_bytes
    assert doc["totals"]["ratio"] == pytest.approx(found.raw_bytes / found.file_bytes)
    files = {f["path"]: f for f in doc["files"]}
    assert set(files) == {OPTIM, MODEL}
    assert {r.io for r in found.files} == {f["io"] for f in doc["files"]} == {"host"}  # on the CPU
    tensors = {t["key"]: t for t in files[MODEL]["tensors"]}
    weight = tensors["module/0.weight"]
    assert weight["dtype"] == TORCH_DTYPE and weight["shape"] == [16, 8]
    storage = files[MODEL]["storages"][weight["storage"]]
    assert storage["codec"]["name"] and storage["transform"]["name"]
    assert storage["raw_bytes"] > 0 and storage["stored_bytes"] > 0


def test_inspect_shows_each_tensors_own_size_and_a_shared_storage_once(engine_ckpt, capsys):
    """ZeRO-2 keeps the bf16 parameters as views of one flat buffer: each parameter has its own
    size, the buffer's size is shown once, on the buffer."""
    status, out, _ = run_cli(capsys, "inspect", "--json", str(engine_ckpt))
    model = next(f for f in json.loads(out)["files"] if f["path"] == MODEL)
    sizes = {t["key"]: t["nbytes"] for t in model["tensors"]}
    assert sizes == {"module/0.weight": 16 * 8 * ITEMSIZE, "module/0.bias": 16 * ITEMSIZE,
                     "module/2.weight": 4 * 16 * ITEMSIZE, "module/2.bias": 4 * ITEMSIZE}
    (flat,) = {t["storage"] for t in model["tensors"]}
    assert model["storages"][flat]["tensors"] == list(sizes)
    assert model["storages"][flat]["raw_bytes"] == sum(sizes.values())
    status, out, _ = run_cli(capsys, "inspect", str(engine_ckpt))
    assert status == 0
    assert f"module/0.weight  {TORCH_DTYPE}[16x8]  {128 * ITEMSIZE} B" in out
    assert f"module/0.bias  {TORCH_DTYPE}[16]  {16 * ITEMSIZE} B" in out
    assert out.count(f"storage {flat}, viewed by 4 tensor(s): ") == 1
    assert f"{sum(sizes.values())} B -> " in out


def test_inspect_says_when_a_files_ratio_is_mostly_per_file_overhead(tmp_path, capsys):
    """A ZeRO-3 model-states file holds no parameters: header and index outweigh its data."""
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    nce.save({"module": {"w": torch.empty(0, dtype=torch.bfloat16)}, "ds_version": "0.19.8"}, path)
    status, out, _ = run_cli(capsys, "inspect", str(path))
    assert status == 0
    file_line, note = out.splitlines()[1:3]
    ratio = float(file_line.split("ratio ")[1].split("x")[0])
    assert ratio < 0.5
    assert note.strip().startswith("note: ") and "fixed per-file overhead" in note
    assert "holds no tensor data" in note
    doc = json.loads(run_cli(capsys, "inspect", "--json", str(path))[1])
    assert doc["files"][0]["overhead_bytes"] > doc["files"][0]["file_bytes"] / 2
    big = tmp_path / "big.pt"
    nce.save({"w": torch.randn(1 << 16)}, big)
    assert "note:" not in run_cli(capsys, "inspect", str(big))[1]


def test_inspect_of_a_plain_torch_checkpoint_says_it_holds_no_shards(plain_ckpt, tmp_path,
                                                                       capsys):
    for path in (plain_ckpt, plain_ckpt / "global_step1"):
        status, out, err = run_cli(capsys, "inspect", str(path))
        assert status == 1 and "total:" not in out
        assert "holds no nvcomp_ckpt_engine shard files" in err
        assert "plain torch.save file(s)" in err and MODEL in err
        assert f"nvcomp-ckpt compress --trusted {path} OUT_DIR" in err and "torch.load" in err
    # The command as printed converts the plain DeepSpeed checkpoint (it needs --trusted).
    printed = err.split("`nvcomp-ckpt ")[1].split("`")[0].replace("OUT_DIR", str(tmp_path / "c"))
    assert run_cli(capsys, *printed.split())[0] == 0
    status, out, err = run_cli(capsys, "inspect", str(plain_ckpt / "global_step1" / MODEL))
    assert status == 1 and "plain torch.save file" in out and "corrupt" not in out.lower()
    assert "nvcomp-ckpt compress" in out
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    (other / "sub" / "notes.txt").write_text("no checkpoint here")
    (other / "latest").write_text("sub")
    status, _, err = run_cli(capsys, "inspect", str(other))
    assert status == 1 and "holds no nvcomp_ckpt_engine shard files" in err
    assert "compress" not in err


def test_inspect_text_shows_files_tensors_and_totals(engine_ckpt, capsys):
    status, out, _ = run_cli(capsys, "inspect", str(engine_ckpt), "--tag", "global_step1")
    assert status == 0
    assert "global_step1" in out and OPTIM in out and MODEL in out
    assert f"module/0.weight  {TORCH_DTYPE}[16x8]" in out
    totals = [line for line in out.splitlines() if line.startswith("total: ")]
    assert len(totals) == 1 and totals[0].startswith("total: 2 files, ")


def test_inspect_single_shard(small_shard, capsys):
    path, _ = small_shard
    status, out, _ = run_cli(capsys, "inspect", "--json", str(path))
    assert status == 0
    doc = json.loads(out)
    assert doc["tag"] is None and doc["manifest"] is None
    keys = [t["key"] for t in doc["files"][0]["tensors"]]
    assert keys == ["w", "h", "step"]
    first = doc["files"][0]["tensors"][0]
    assert first["nbytes"] == 64 * 32 * 4
    assert doc["files"][0]["storages"][first["storage"]]["chunks"] == 8  # 1 KiB chunks


def test_inspect_names_an_unreadable_file(engine_copy, capsys):
    path = engine_copy / "global_step2" / MODEL
    path.write_bytes(path.read_bytes()[:-5])
    status, out, _ = run_cli(capsys, "inspect", "--files-only", str(engine_copy))
    assert status == 1
    assert f"{MODEL}: ERROR: " in out and "truncated" in out


# ---------------------------------------------------------------------------------------------
# verify


@pytest.mark.parametrize("where", ["save_dir", "tag_dir", "file"])
def test_verify_ok(engine_ckpt, capsys, where):
    target = {"save_dir": engine_ckpt, "tag_dir": engine_ckpt / "global_step1",
              "file": engine_ckpt / "global_step1" / OPTIM}[where]
    status, out, _ = run_cli(capsys, "verify", "-q", str(target))
    assert status == 0 and out.strip().endswith(": OK")


def _chunk_offset(path: Path) -> int:
    """The first byte of the first chunk of the file's largest storage."""
    index = read_index(path)
    storage = max(index.storages, key=lambda s: s.nbytes)
    return storage.chunks[0].offset


def test_verify_catches_a_flipped_byte_and_names_file_tensor_chunk(engine_copy, capsys):
    path = engine_copy / "global_step2" / OPTIM
    data = bytearray(path.read_bytes())
    data[_chunk_offset(path) + 3] ^= 0x10
    path.write_bytes(bytes(data))
    status, out, _ = run_cli(capsys, "verify", "-q", str(engine_copy))
    assert status == 1
    faults = [line for line in out.splitlines() if line.startswith("FAULT: ")]
    assert len(faults) == 1, faults  # one per damaged file: the chunk the manifest's CRC led to
    (chunk_fault,) = faults
    assert "checksum mismatch" in chunk_fault
    assert OPTIM in chunk_fault and "tensor" in chunk_fault and "chunk 0" in chunk_fault
    assert "1 fault(s) found" in out


def test_verify_reports_a_reader_failure_as_one_fault_and_goes_on(engine_copy, capsys, monkeypatch):
    """Whatever escapes the reader on a hostile file (here a bug stood in by a ZeroDivisionError
    on one file) is that file's one FAULT line; the other files are still verified."""
    from nvcomp_ckpt_engine.cli import verify as verify_cli

    real, verified = verify_cli.verify_file, []

    def failing(path, *args, **kwargs):
        verified.append(Path(path).name)
        if Path(path).name == MODEL:
            raise ZeroDivisionError("a reader bug")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(verify_cli, "verify_file", failing)
    status, out, _ = run_cli(capsys, "verify", "-q", str(engine_copy))
    faults = [line for line in out.splitlines() if line.startswith("FAULT: ")]
    assert status == 1 and len(faults) == 1, out
    assert MODEL in faults[0] and "ZeroDivisionError: a reader bug" in faults[0]
    assert sorted(verified) == sorted([MODEL, OPTIM]) and "1 fault(s) found" in out


def test_a_zip_with_a_name_that_is_not_utf8_is_not_a_torch_file(tmp_path):
    """A zip whose entry claims UTF-8 but is not: `is_torch_file` answers False (the zip reader
    raises UnicodeDecodeError), so `inspect` and `load` treat it as any other foreign file."""
    import zipfile

    path = tmp_path / "odd.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("ar\u00e9/data.pkl", b"x")  # non-ASCII: the UTF-8 flag is set
    path.write_bytes(path.read_bytes().replace("\u00e9".encode("utf-8"), b"\xff\xfe"))
    assert container.is_torch_file(path) is False
    with pytest.raises(CheckpointError):
        nce.load(path)


def test_verify_catches_truncation_without_a_manifest_too(engine_copy, capsys):
    path = engine_copy / "global_step2" / MODEL
    path.write_bytes(path.read_bytes()[:-100])
    status, out, _ = run_cli(capsys, "verify", "-q", str(path))
    assert status == 1 and MODEL in out and "truncated" in out
    status, out, _ = run_cli(capsys, "verify", "-q", str(engine_copy))
    assert status == 1 and "bytes, the manifest says" in out


def test_verify_reports_missing_files_and_missing_manifest(engine_copy, capsys):
    (engine_copy / "global_step2" / OPTIM).unlink()
    (engine_copy / "global_step1" / manifest.MANIFEST_NAME).unlink()
    status, out, _ = run_cli(capsys, "verify", "-q", str(engine_copy))
    assert status == 1 and OPTIM in out and "missing" in out
    status, out, _ = run_cli(capsys, "verify", "-q", str(engine_copy), "--tag", "global_step1")
    assert status == 1 and "did not finish" in out


def test_verify_with_node_local_storage_checks_this_hosts_files(engine_copy, capsys):
    tag_dir = engine_copy / "global_step2"
    found = manifest.read_manifest(tag_dir)
    elsewhere = manifest.ShardRecord(path="zero_pp_rank_1_mp_rank_00_optim_states.pt", rank=1,
                                     raw_bytes=1, file_bytes=1, crc32=0, node="another-host")
    manifest.write_manifest(tag_dir, manifest.build_manifest(
        tag=found.tag, world_size=2, files=[*found.files, elsewhere], layout=found.layout,
        step=found.step, created_unix_ns=found.created_unix_ns, node_local_storage=True))
    status, out, _ = run_cli(capsys, "verify", "-q", str(tag_dir))
    assert status == 0, out


def test_verify_reads_each_index_once_and_no_file_twice(tmp_path, capsys, monkeypatch):
    """A tag of a module derived from the optimizer shard beside it (the golden ZeRO-1/2 files):
    each shard's index is read once, serving the manifest's CRC, the chunk checksums and the
    derived sources' check, and no file's bytes are read for a whole-file CRC."""
    from conftest import commit_single_rank_tag

    folder = tmp_path / "ckpt" / "global_step1"
    shutil.copytree(Path(__file__).parent / "golden" / "v2_derived", folder)
    commit_single_rank_tag(folder, "global_step1")
    real, reads = container.read_index, []
    monkeypatch.setattr(container, "read_index", lambda path: reads.append(Path(path).name) or real(path))
    status, out, _ = run_cli(capsys, "verify", "-q", str(tmp_path / "ckpt"))
    assert status == 0, out
    assert sorted(reads) == ["model_states.nvckpt", "optim_states.nvckpt"]
    # The whole-file CRC is the one the index implies: damage a chunk, and the chunk is named.
    path = folder / "optim_states.nvckpt"
    data = bytearray(path.read_bytes())
    data[_chunk_offset(path) + 3] ^= 0x10
    path.write_bytes(bytes(data))
    status, out, _ = run_cli(capsys, "verify", "-q", str(tmp_path / "ckpt"))
    faults = [line for line in out.splitlines() if line.startswith("FAULT: ")]
    assert status == 1 and len(faults) == 1 and "checksum mismatch" in faults[0], out


def test_verify_works_with_tqdm_progress(engine_ckpt, capsys):
    status, out, _ = run_cli(capsys, "verify", str(engine_ckpt))
    assert status == 0 and out.strip().endswith(": OK")


def test_usage_errors_exit_2(engine_ckpt, tmp_path, capsys):
    status, _, err = run_cli(capsys, "verify", str(tmp_path / "nowhere"))
    assert status == 2 and "does not exist" in err
    status, _, err = run_cli(capsys, "inspect", str(engine_ckpt), "--tag", "global_step9")
    assert status == 2 and "global_step9" in err
    # A folder without any checkpoint is status 1 (tests/test_cli_output.py), not a usage error.


# ---------------------------------------------------------------------------------------------
# decompress


def test_decompress_is_bit_identical_to_the_original(plain_ckpt, engine_ckpt, tmp_path, capsys):
    out = tmp_path / "plain"
    status, stdout, _ = run_cli(capsys, "decompress", "-q", str(engine_ckpt), str(out))
    assert status == 0 and "wrote 4 torch.save files in 2 tag(s)" in stdout
    for tag in TAGS:
        assert sorted(p.name for p in (out / tag).iterdir()) == sorted([OPTIM, MODEL])
        for name in (OPTIM, MODEL):
            assert not nce.is_shard_file(out / tag / name)
            assert_same_object(torch_load(plain_ckpt / tag / name), torch_load(out / tag / name))
    assert (out / "latest").read_text() == "global_step2"
    assert (out / "zero_to_fp32.py").is_file()


def test_decompress_output_works_with_zero_to_fp32_and_ds_to_universal(
        plain_ckpt, engine_ckpt, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = tmp_path / "plain"
    assert cli.main(["decompress", "-q", str(engine_ckpt / "global_step2"), str(out)]) == 0
    assert_same_object(get_fp32_state_dict_from_zero_checkpoint(str(plain_ckpt)),
                       get_fp32_state_dict_from_zero_checkpoint(str(out)))
    for source, universal in ((out, tmp_path / "u_ours"), (plain_ckpt, tmp_path / "u_plain")):
        done = _run_python(["-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                            str(source / "global_step2"), "--output_folder", str(universal)])
        assert done.returncode == 0, done.stderr[-3000:]
    ours = sorted(p.relative_to(tmp_path / "u_ours") for p in (tmp_path / "u_ours").rglob("*.pt"))
    theirs = sorted(p.relative_to(tmp_path / "u_plain")
                    for p in (tmp_path / "u_plain").rglob("*.pt"))
    assert ours == theirs and ours
    for rel in ours:
        assert_same_object(torch_load(tmp_path / "u_plain" / rel),
                           torch_load(tmp_path / "u_ours" / rel))


def test_decompress_refuses_to_write_into_or_around_the_checkpoint(engine_ckpt, tmp_path, capsys):
    for out in (engine_ckpt, engine_ckpt / "sub", engine_ckpt.parent):
        status, _, err = run_cli(capsys, "decompress", str(engine_ckpt / "global_step1"), str(out))
        assert status == 2 and "refusing" in err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    status, _, err = run_cli(capsys, "decompress", str(engine_ckpt), str(busy))
    assert status == 2 and "not an empty directory" in err


def test_decompress_skips_an_incomplete_tag_of_a_save_dir(engine_copy, tmp_path, capsys):
    (engine_copy / "global_step2" / manifest.MANIFEST_NAME).unlink()
    out = tmp_path / "out"
    status, _, err = run_cli(capsys, "decompress", "-q", str(engine_copy), str(out))
    assert status == 0 and "skipping incomplete tag global_step2" in err
    assert not (out / "global_step2").exists() and (out / "global_step1" / MODEL).is_file()
    assert not (out / "latest").exists()  # it named the skipped tag
    status, _, err = run_cli(capsys, "decompress", "-q", "--tag", "global_step2",
                             str(engine_copy), str(tmp_path / "out2"))
    assert status == 1 and "did not finish" in err


def test_decompress_detects_a_damaged_chunk(engine_copy, tmp_path, capsys):
    _damage_a_chunk(engine_copy / "global_step1" / MODEL)
    status, _, err = run_cli(capsys, "decompress", "-q", str(engine_copy / "global_step1"),
                             str(tmp_path / "out"))
    assert status == 1 and MODEL in err and "checksum mismatch" in err


def _damage_a_chunk(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[_chunk_offset(path)] ^= 0x01
    path.write_bytes(bytes(data))


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_failed_decompress_leaves_nothing_behind(engine_copy, tmp_path, capsys):
    # The last file of the last tag is damaged: everything before it converts first.
    _damage_a_chunk(engine_copy / "global_step2" / MODEL)
    parent = tmp_path / "results"
    parent.mkdir()
    out = parent / "new" / "plain"
    status, _, err = run_cli(capsys, "decompress", "-q", str(engine_copy), str(out))
    assert status == 1 and "checksum mismatch" in err
    assert _leftovers(parent) == []  # no output, no temporary folder, no created parent
    existing = parent / "empty"
    existing.mkdir(mode=0o750)
    before = existing.stat()
    status, _, _ = run_cli(capsys, "decompress", "-q", str(engine_copy), str(existing))
    assert status == 1
    assert _leftovers(parent) == ["empty"] and _leftovers(existing) == []
    assert existing.stat().st_mode == before.st_mode and existing.stat().st_ino == before.st_ino


def test_decompress_into_an_existing_empty_folder_keeps_its_mode(engine_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir(mode=0o750)
    os.chmod(out, 0o750)
    status, _, _ = run_cli(capsys, "decompress", "-q", "--tag", "global_step1", str(engine_ckpt),
                           str(out))
    assert status == 0 and (out / "global_step1" / MODEL).is_file()
    assert out.stat().st_mode & 0o777 == 0o750
    assert _leftovers(tmp_path) == ["out"]


def test_a_failed_compress_leaves_nothing_behind(plain_ckpt, tmp_path, capsys):
    existing = tmp_path / "out"
    existing.mkdir()
    for out in (tmp_path / "new", existing):
        status, _, err = run_cli(capsys, "compress", "-q", str(plain_ckpt), str(out))
        assert status == 1 and "--trusted" in err  # the optimizer files need it
    assert _leftovers(tmp_path) == ["out"] and _leftovers(existing) == []


def test_decompress_of_one_tag_warns_about_nothing_else(engine_copy, tmp_path, capsys, caplog):
    (engine_copy / "notes").mkdir()
    status, _, err = run_cli(capsys, "decompress", "-q", "--tag", "global_step1",
                             str(engine_copy), str(tmp_path / "one"))
    assert status == 0 and err == ""
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    status, _, _ = run_cli(capsys, "decompress", "-q", str(engine_copy), str(tmp_path / "all"))
    assert status == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "notes: not a tag folder" in warnings[0]


def test_reads_say_nothing_about_compressing_with_the_cpu_codecs(engine_ckpt, tmp_path, capsys,
                                                                   caplog):
    from nvcomp_ckpt_engine import codecs

    codecs._announce_cpu_codecs.cache_clear()
    with caplog.at_level(logging.INFO):
        assert run_cli(capsys, "decompress", "-q", str(engine_ckpt), str(tmp_path / "a"))[0] == 0
        assert run_cli(capsys, "zero-to-fp32", str(engine_ckpt), str(tmp_path / "b"))[0] == 0
    assert not [r for r in caplog.records if "CPU codecs" in r.getMessage()]


# ---------------------------------------------------------------------------------------------
# zero_to_fp32 on the compressed checkpoint itself


def test_zero_to_fp32_command_matches_deepspeed_on_the_plain_checkpoint(
        plain_ckpt, engine_ckpt, tmp_path, capsys):
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    convert_zero_checkpoint_to_state_dict(str(plain_ckpt), str(tmp_path / "ref"),
                                          max_shard_size=None)
    status, _, _ = run_cli(capsys, "zero-to-fp32", str(engine_ckpt), str(tmp_path / "ours"))
    assert status == 0
    assert_same_object(torch_load(tmp_path / "ref" / "pytorch_model.bin"),
                       torch_load(tmp_path / "ours" / "pytorch_model.bin"))


def test_the_deepspeed_extra_installs_what_the_recovery_script_imports(monkeypatch):
    """`python zero_to_fp32.py . out/` with DeepSpeed's defaults splits its output with
    huggingface_hub; the deepspeed extra must bring it, or the first run fails."""
    import deepspeed.utils.zero_to_fp32 as script
    import setuptools

    source = Path(script.__file__).read_text()
    needed = set(re.findall(r"from (\w+) import split_torch_state_dict_into_shards", source))
    assert needed == {"huggingface_hub"}
    metadata = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: metadata.update(kwargs))
    monkeypatch.chdir(REPO)
    runpy.run_path(str(REPO / "setup.py"))
    for extra in ("deepspeed", "test"):
        names = {re.split(r"[<>=!~ ;\[]", r)[0] for r in metadata["extras_require"][extra]}
        assert needed <= names, extra


def test_the_wrapped_recovery_script_converts_the_compressed_checkpoint(
        plain_ckpt, engine_ckpt, tmp_path):
    for save_dir, out in ((plain_ckpt, tmp_path / "ref"), (engine_ckpt, tmp_path / "ours")):
        done = _run_python(["zero_to_fp32.py", ".", str(out)], cwd=save_dir)
        assert done.returncode == 0, done.stderr[-3000:]
    assert_same_object(torch_load(tmp_path / "ref" / "pytorch_model.bin"),
                       torch_load(tmp_path / "ours" / "pytorch_model.bin"))


def test_the_wrapped_script_without_the_package_prints_the_decompress_hint(engine_ckpt, tmp_path):
    # A package of the same name that cannot be imported hides the real one, installed or not.
    blocker = tmp_path / "blocker" / "nvcomp_ckpt_engine"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'nvcomp_ckpt_engine'\", "
        "name='nvcomp_ckpt_engine')\n")
    env = _env()
    env["PYTHONPATH"] = str(blocker.parent)
    done = _run_python(["zero_to_fp32.py", ".", str(tmp_path / "out"), "--max_shard_size", "1GB"],
                       cwd=engine_ckpt, env=env)
    assert done.returncode != 0
    assert "nvcomp-ckpt decompress CKPT_DIR OUT_DIR" in done.stderr


# ---------------------------------------------------------------------------------------------
# compat: the guard, patch_torch_load, wrap_recovery_script


def test_torch_load_of_a_shard_says_what_to_do(small_shard):
    """torch's own `load` (as a process without DeepSpeed's import hook has it) meets the guard."""
    path, _ = small_shard
    with pytest.raises(compat.TorchLoadOfShardError) as info:
        torch.serialization.load(path, weights_only=False)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, nce.CheckpointError)
    message = str(info.value)
    assert "nvcomp_ckpt_engine shard" in message
    assert "nvcomp-ckpt decompress CKPT_DIR OUT_DIR" in message
    assert "nvcomp_ckpt_engine.load" in message
    assert "nvcomp-ckpt decompress" in info.value.detail  # the file's own words, kept
    # torch's default weights_only=True refuses the guard itself, naming it.
    with pytest.raises(Exception, match="nvcomp_ckpt_engine.compat.refuse_torch_load"):
        torch.serialization.load(path)


def test_patch_torch_load_reads_shards_and_refuses_the_rest_unless_trusted(small_shard, tmp_path):
    path, state = small_shard
    plain = tmp_path / "plain.pt"
    torch.save({"x": torch.arange(3)}, plain)
    real_load = torch.load
    with compat.patch_torch_load():
        assert_same_object(state, torch.load(path, map_location="cpu", weights_only=False,
                                             mmap=True))
        with pytest.raises(nce.UnsafeObjectError, match=re.escape(f"{plain}: not a file of")):
            torch.load(plain, weights_only=False)
        with compat.patch_torch_load():  # nesting restores the outer patch
            pass
        assert torch.load is not real_load
    with compat.patch_torch_load(trusted=True):
        assert torch.equal(torch.load(plain)["x"], torch.arange(3))
    assert torch.load is real_load


class _TouchesWhenUnpickled:
    """A torch.save payload that creates `marker` when torch.load(weights_only=False) reads it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant_unlisted(ckpt: Path, marker: Path) -> Path:
    """A torch file planted in the newest tag folder, unlisted, that DeepSpeed's converter globs
    first (``*_model_states.pt``, sorted)."""
    planted = ckpt / TAGS[-1] / "a_model_states.pt"
    torch.save({"payload": _TouchesWhenUnpickled(marker)}, planted)
    return planted


def _link_a_listed_file_out(ckpt: Path, marker: Path) -> Path:
    """The model states replaced by a link to a torch file outside the save directory."""
    outside = ckpt.parent / "outside.pt"
    torch.save({"payload": _TouchesWhenUnpickled(marker)}, outside)
    listed = ckpt / TAGS[-1] / MODEL
    listed.unlink()
    listed.symlink_to(outside)
    return listed


def _latest_naming_elsewhere(ckpt: Path, marker: Path) -> Path:
    """`latest` naming ``../elsewhere/TAG``: a folder of torch files outside the checkpoint."""
    elsewhere = ckpt.parent / "elsewhere" / TAGS[-1]
    elsewhere.mkdir(parents=True)
    for name in (MODEL, OPTIM):
        torch.save({"payload": _TouchesWhenUnpickled(marker)}, elsewhere / name)
    (ckpt / "latest").write_text(f"../elsewhere/{TAGS[-1]}")
    return elsewhere / MODEL


@pytest.mark.parametrize("plant", [_plant_unlisted, _link_a_listed_file_out, _latest_naming_elsewhere])
def test_zero_to_fp32_refuses_files_no_manifest_lists(engine_copy, tmp_path, capsys, plant):
    """Every file DeepSpeed's converter globs or reaches through `latest` is read only if the
    manifest of its tag folder lists it, inside the folder; anything else would go to the real
    torch.load(weights_only=False): refused unread, naming the file, unless --trusted."""
    marker = tmp_path / "ran"
    refused = plant(engine_copy, marker)
    status, _, err = run_cli(capsys, "zero-to-fp32", str(engine_copy), str(tmp_path / "out"))
    assert status == 1 and refused.name in err, err
    assert "--trusted" in err or "outside the tag folder" in err, err
    assert not marker.exists()


def test_the_wrapped_script_refuses_a_planted_file(engine_copy, tmp_path):
    marker = tmp_path / "ran"
    planted = _plant_unlisted(engine_copy, marker)
    done = _run_python(["zero_to_fp32.py", ".", str(tmp_path / "out"), "--max_shard_size", "1GB"],
                       cwd=engine_copy)
    assert done.returncode != 0
    assert f"{planted.name}: not listed in the manifest" in done.stderr, done.stderr[-3000:]
    assert not marker.exists()


def test_wrap_recovery_script_is_idempotent_and_keeps_the_mode(plain_ckpt, tmp_path):
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    script = save_dir / "zero_to_fp32.py"
    shutil.copy2(plain_ckpt / "zero_to_fp32.py", script)
    original = script.read_text()
    mode = script.stat().st_mode
    assert compat.wrap_recovery_script(save_dir) == [script]
    once = script.read_text()
    assert once != original and once.startswith(original.splitlines()[0])  # shebang stays first
    assert compat.wrap_recovery_script(save_dir) == [script]
    assert script.read_text() == once and script.stat().st_mode == mode
    compile(once, str(script), "exec")
    assert compat.add_preamble(once) == once


def test_wrap_recovery_script_tolerates_missing_and_broken_scripts(tmp_path, caplog):
    assert compat.wrap_recovery_script(tmp_path) == []
    broken = tmp_path / "zero_to_fp32.py"
    broken.write_text("def broken(:\n")
    assert compat.wrap_recovery_script(tmp_path) == []
    assert broken.read_text() == "def broken(:\n"
    assert "nvcomp-ckpt decompress" in caplog.text


def test_add_preamble_goes_after_docstring_and_future_imports():
    source = '#!/usr/bin/env python\n"""Doc."""\nfrom __future__ import annotations\nimport os\n'
    wrapped = compat.add_preamble(source)
    compile(wrapped, "x", "exec")
    lines = wrapped.splitlines()
    assert lines[:3] == source.splitlines()[:3]
    assert lines[-1] == "import os"


# ---------------------------------------------------------------------------------------------
# cost


def test_cost_defaults_reproduce_the_write_up(capsys):
    status, out, _ = run_cli(capsys, "cost", "--ratio", "1")
    assert status == 0
    assert "156.4" in out and "62.6" in out and "2,202" in out


def test_cost_json_names_its_sources(capsys):
    status, out, _ = run_cli(capsys, "cost", "--json", "--ratio", "1.25", "--compress-gbps", "50",
                             "--keep", "3", "--storage-usd-per-gb-month", "0.1")
    doc = json.loads(out)
    assert status == 0 and doc["sources"]["ratio"] == "given"
    assert doc["sources"]["checkpoint_gb"] == "default"
    assert doc["baseline"]["wait_s"] == pytest.approx(156.4)
    assert doc["compressed"]["wait_s"] == pytest.approx(782 / 1.25 / 5)
    assert doc["compressed"]["storage_usd_month"] == pytest.approx(3 * 782 / 1.25 * 0.1)


def test_cost_prices_the_rank_0_straggler_before_and_after(capsys):
    args = ("cost", "--ratio", "1.25", "--gpus", "64", "--size-gb", "980", "--module-gb", "140",
            "--write-gbps", "100", "--rank-write-gbps", "1")
    status, out, _ = run_cli(capsys, *args)
    assert status == 0
    header = next(line for line in out.splitlines() if "plain" in line)
    assert header.split() == ["plain", "module", "rank", "0", "derived"]
    straggler = next(line for line in out.splitlines() if line.startswith("rank 0 / other ranks"))
    assert straggler.split()[-3:] == ["11.67", "11.67", "1.00"]
    status, out, _ = run_cli(capsys, *args, "--json")
    doc = json.loads(out)
    assert doc["compressed_module_on_rank0"]["wait_s"] == pytest.approx((840 / 64 + 140) / 1.25)
    assert doc["compressed"]["wait_s"] == pytest.approx(840 / 64 / 1.25)
    assert doc["compressed"]["straggler"] == 1.0


def test_cost_from_bench(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"ratio": 1.3, "compress_gbps": 120.0, "write_gbps": 4.0}))
    status, out, _ = run_cli(capsys, "cost", "--json", "--from-bench", str(bench))
    doc = json.loads(out)
    assert status == 0
    assert doc["inputs"]["ratio"] == 1.3 and doc["inputs"]["write_gbps"] == 4.0
    assert doc["sources"]["compress_gbps"] == f"from {bench}"
    status, out, _ = run_cli(capsys, "cost", "--json", "--from-bench", str(bench),
                             "--write-gbps", "10")
    assert json.loads(out)["inputs"]["write_gbps"] == 10.0  # given beats measured
    bench.write_text("{}")
    status, _, err = run_cli(capsys, "cost", "--from-bench", str(bench))
    assert status == 1 and "'ratio'" in err


def test_cost_from_a_checkpoint_uses_its_measured_size_and_ratio(engine_ckpt, capsys):
    status, out, _ = run_cli(capsys, "cost", "--json", "--from", str(engine_ckpt))
    doc = json.loads(out)
    found = manifest.read_manifest(engine_ckpt / "global_step2")
    assert status == 0
    assert doc["inputs"]["ratio"] == pytest.approx(found.raw_bytes / found.file_bytes)
    assert doc["sources"]["ratio"] == f"measured in {engine_ckpt}"
    # The size is every rank's raw bytes, as the manifest records them.
    assert doc["inputs"]["checkpoint_gb"] == pytest.approx(found.raw_bytes / 1e9)
    assert doc["sources"]["checkpoint_gb"] == (
        f"measured in {engine_ckpt}: raw bytes of the files of all {found.world_size} rank(s)")
    status, out, _ = run_cli(capsys, "cost", "--from", str(engine_ckpt), "--size-gb", "100")
    assert "checkpoint 100.0 GB [given]" in out and f"[measured in {engine_ckpt}]" in out
    shard = engine_ckpt / "global_step2" / MODEL
    doc = json.loads(run_cli(capsys, "cost", "--json", "--from", str(shard))[1])
    assert doc["inputs"]["checkpoint_gb"] == pytest.approx(read_index(shard).raw_bytes / 1e9)
    assert "1 shard file x 1 ranks (its manifest's)" in doc["sources"]["checkpoint_gb"]


def test_cost_from_one_shard_without_a_manifest_prices_the_whole_world(small_shard, capsys):
    """One rank's shard stands for every rank's: its raw bytes x --gpus."""
    path, _ = small_shard
    raw = read_index(path).raw_bytes
    doc = json.loads(run_cli(capsys, "cost", "--json", "--from", str(path), "--gpus", "16")[1])
    assert doc["inputs"]["checkpoint_gb"] == pytest.approx(raw * 16 / 1e9)
    assert "1 shard file x 16 ranks (--gpus)" in doc["sources"]["checkpoint_gb"]


def test_cost_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["cost", "--help"])
    options = capsys.readouterr().out.split("\noptions:\n")[1]
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=-)", options.strip("\n"))]
    assert len(entries) == 18 and entries[0].startswith("-h, --help")
    for entry in entries[1:]:
        assert "(default: " in entry, entry
    text = " ".join(entries)
    for shown in ("(default: 782,", "(default: 5,", "(default: 30)", "(default: 8)",
                  "(default: 4.40)", "(default: 1)", "(default: 1.22,", "(default: 100,"):
        assert shown in text


def test_cost_prints_bandwidths_with_one_decimal(capsys):
    status, out, _ = run_cli(capsys, "cost", "--write-gbps", "4.567", "--compress-gbps", "46.9916")
    assert status == 0
    assert "storage 4.6 GB/s [given]" in out and "47.0 GB/s per GPU [given]" in out


def test_python_dash_m_runs_the_cli():
    done = _run_python(["-m", "nvcomp_ckpt_engine", "cost", "--ratio", "1"])
    assert done.returncode == 0 and "156.4" in done.stdout
    done = _run_python(["-m", "nvcomp_ckpt_engine", "--help"])
    assert done.returncode == 0
    for command in ("inspect", "verify", "decompress", "compress", "zero-to-fp32", "cost"):
        assert command in done.stdout


# ---------------------------------------------------------------------------------------------
# Links out of the checkpoint: a conversion copies nothing a link names outside it


def _tiny_plain_checkpoint(root: Path) -> Path:
    """A plain save directory (torch.save files, `latest`): what `compress` takes."""
    save_dir = root / "plain"
    for step in (1, 2):
        tag_dir = save_dir / f"global_step{step}"
        tag_dir.mkdir(parents=True)
        torch.save({"module": {"w": torch.full((4,), float(step))}}, tag_dir / MODEL)
    (save_dir / "latest").write_text("global_step2")
    return save_dir


def _secret(root: Path) -> Path:
    """Files outside any checkpoint, which a link inside one will name."""
    outside = root / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("private")
    torch.save({"module": {"w": torch.full((4,), 42.0)}}, outside / "other_model_states.pt")
    return outside


def _link_out(folder: Path, outside: Path) -> None:
    for name, target in (("notes.txt", "secret.txt"), ("copied.pt", "other_model_states.pt")):
        (folder / name).symlink_to(outside / target)


def _assert_nothing_from(out: Path, outside: Path) -> None:
    secrets = {p.read_bytes() for p in outside.iterdir()}
    for path in out.rglob("*"):
        assert path.is_dir() or not path.is_symlink(), path
        assert not path.is_file() or path.read_bytes() not in secrets, path
        assert path.name not in ("notes.txt", "copied.pt"), path


def test_compress_follows_no_link_out_of_the_checkpoint(tmp_path, capsys, caplog):
    plain = _tiny_plain_checkpoint(tmp_path)
    outside = _secret(tmp_path)
    _link_out(plain, outside)
    _link_out(plain / "global_step2", outside)
    (plain / "global_step1" / "inside.txt").write_text("kept")
    (plain / "global_step1" / "inside_link.txt").symlink_to("inside.txt")
    status, _, _ = run_cli(capsys, "compress", "-q", str(plain), str(tmp_path / "out"))
    assert status == 0
    _assert_nothing_from(tmp_path / "out", outside)
    assert (tmp_path / "out" / "global_step1" / "inside_link.txt").read_text() == "kept"
    assert "outside" in caplog.text and "left out" in caplog.text
    loaded = nce.load(tmp_path / "out" / "global_step2" / MODEL)
    assert torch.equal(loaded["module"]["w"], torch.full((4,), 2.0))


def test_decompress_follows_no_link_out_of_the_checkpoint(tmp_path, capsys):
    plain = _tiny_plain_checkpoint(tmp_path)
    assert cli.main(["compress", "-q", str(plain), str(tmp_path / "engine")]) == 0
    engine = tmp_path / "engine"
    outside = _secret(tmp_path)
    _link_out(engine, outside)
    _link_out(engine / "global_step2", outside)
    status, _, _ = run_cli(capsys, "decompress", "-q", str(engine), str(tmp_path / "out"))
    assert status == 0
    _assert_nothing_from(tmp_path / "out", outside)
    loaded = torch_load(tmp_path / "out" / "global_step2" / MODEL)
    assert torch.equal(loaded["module"]["w"], torch.full((4,), 2.0))


def _outside_tag(root: Path, *, engine: bool) -> Path:
    """A tag folder outside the checkpoint (plain, or compressed by the engine) holding 42s."""
    plain = root / "outside_plain" / "global_step9"
    plain.mkdir(parents=True)
    torch.save({"module": {"w": torch.full((4,), 42.0)}}, plain / MODEL)
    if not engine:
        return plain
    assert cli.main(["compress", "-q", str(plain.parent), str(root / "outside_engine")]) == 0
    return root / "outside_engine" / "global_step9"


def _assert_no_42(out: Path) -> None:
    from nvcomp_ckpt_engine.container import is_shard_file

    for path in out.rglob("*.pt"):
        loaded = nce.load(path) if is_shard_file(path) else torch_load(path)
        assert not torch.equal(loaded["module"]["w"], torch.full((4,), 42.0)), path


def _link_tag_folders(save_dir: Path, outside_tag: Path) -> None:
    """A tag folder linked out, one linked to another tag inside, one linked to the folder."""
    (save_dir / "global_step3").symlink_to(outside_tag, target_is_directory=True)
    (save_dir / "global_step4").symlink_to("global_step1", target_is_directory=True)
    (save_dir / "loop").symlink_to(".", target_is_directory=True)
    (save_dir / "global_step1" / "copied.pt").symlink_to(outside_tag / MODEL)


@pytest.mark.parametrize("engine", [False, True], ids=["compress", "decompress"])
def test_no_conversion_follows_a_tag_folder_linked_out(tmp_path, capsys, caplog, engine):
    """Both commands take their tag folders and files through one check (`inside_source`): a
    link out (a tag folder, a file in a tag) is left out with a warning; a tag folder linked
    to another inside the checkpoint is converted under its own name; a link to the save
    directory itself is left out."""
    src = _tiny_plain_checkpoint(tmp_path)
    if engine:
        assert cli.main(["compress", "-q", str(src), str(tmp_path / "engine")]) == 0
        src = tmp_path / "engine"
    _link_tag_folders(src, _outside_tag(tmp_path, engine=engine))
    out = tmp_path / "out"
    status, _, _ = run_cli(capsys, "decompress" if engine else "compress", "-q", str(src), str(out))
    assert status == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "global_step1", "global_step2", "global_step4"]
    assert not (out / "global_step1" / "copied.pt").exists()
    _assert_no_42(out)
    assert "global_step3: a link to" in caplog.text and "loop: a link to" in caplog.text
    assert "copied.pt: a link to" in caplog.text
    for tag in ("global_step1", "global_step4"):
        path = out / tag / MODEL
        loaded = torch_load(path) if engine else nce.load(path)
        assert torch.equal(loaded["module"]["w"], torch.full((4,), 1.0)), tag


@pytest.mark.parametrize("command", ["compress", "decompress"])
def test_a_tag_folder_linked_out_cannot_be_asked_for_by_name(tmp_path, capsys, command):
    src = _tiny_plain_checkpoint(tmp_path)
    if command == "decompress":
        assert cli.main(["compress", "-q", str(src), str(tmp_path / "engine")]) == 0
        src = tmp_path / "engine"
    _link_tag_folders(src, _outside_tag(tmp_path, engine=command == "decompress"))
    status, _, err = run_cli(capsys, command, "-q", "--tag", "global_step3", str(src),
                             str(tmp_path / "out"))
    assert status != 0 and "no tag folder 'global_step3'" in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*"))


# ---------------------------------------------------------------------------------------------
# Every command on a checkpoint in an object store (the S3 test server)


@pytest.fixture
def store_prefix(s3_server, s3_storage, monkeypatch):
    """The test's own prefix on the S3 test server, found through the environment as a job's."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    yield s3_storage.url
    assert not (Path.cwd() / "s3:").exists(), "a URL was taken for a local path"


def small_plain_ckpt(folder: Path) -> dict[str, dict]:
    """A plain torch.save checkpoint in DeepSpeed's folder layout, without DeepSpeed: two tags
    and `latest`; returns each tag's state."""
    states = {}
    for step, tag in enumerate(TAGS, start=1):
        torch.manual_seed(step)
        states[tag] = {"module": {"w": torch.randn(64, 16), "b": torch.randn(16).bfloat16()},
                       "global_steps": step}
        (folder / tag).mkdir(parents=True)
        torch.save(states[tag], folder / tag / MODEL)
    (folder / "latest").write_text(TAGS[-1])
    return states


@pytest.fixture
def on_store(store_prefix, plain_ckpt, engine_ckpt) -> dict[str, str]:
    """The DeepSpeed run's plain and engine checkpoints put on the store; the URLs of both and
    of a prefix for outputs (which holds nothing)."""
    from nvcomp_ckpt_engine.cli import transfer

    urls = {name: f"{store_prefix}/{name}" for name in ("plain", "engine", "out")}
    transfer.upload(str(plain_ckpt), urls["plain"])
    transfer.upload(str(engine_ckpt), urls["engine"])
    return urls


def test_compress_reads_from_and_writes_to_the_store(store_prefix, tmp_path, capsys):
    from nvcomp_ckpt_engine.cli import transfer

    states = small_plain_ckpt(tmp_path / "plain")
    src, out = f"{store_prefix}/plain", f"{store_prefix}/engine"
    transfer.upload(str(tmp_path / "plain"), src)
    status, stdout, _ = run_cli(capsys, "compress", "-q", src, out)
    assert status == 0 and out in stdout
    for tag in TAGS:  # committed on the store: manifest, sizes and CRCs
        tag_url = f"{out}/{tag}"
        manifest_files.verify_files(tag_url, manifest.read_manifest(tag_url))
        assert_same_object(states[tag], nce.load(f"{tag_url}/{MODEL}", map_location="cpu"))
    assert discovery.inspect_latest(out).tag == TAGS[-1]
    status, _, err = run_cli(capsys, "compress", "-q", src, out)
    assert status == 2 and "already holds objects" in err  # never over an existing output
    status, _, err = run_cli(capsys, "compress", "-q", src, f"{src}/inside")
    assert status == 2 and "into or around the checkpoint" in err


def test_decompress_reads_from_the_store(store_prefix, tmp_path, capsys):
    from nvcomp_ckpt_engine.cli import transfer

    states = small_plain_ckpt(tmp_path / "plain")
    assert cli.main(["compress", "-q", str(tmp_path / "plain"), str(tmp_path / "engine")]) == 0
    transfer.upload(str(tmp_path / "engine"), f"{store_prefix}/engine")
    status, _, _ = run_cli(capsys, "decompress", "-q", "--tag", TAGS[-1], f"{store_prefix}/engine",
                           str(tmp_path / "out"))
    assert status == 0
    names = {p.name for p in tmp_path.joinpath("out").iterdir()}
    assert names == {TAGS[-1], "latest"}  # only the tag asked for was fetched and written
    assert_same_object(states[TAGS[-1]], torch_load(tmp_path / "out" / TAGS[-1] / MODEL))


def test_a_conversion_from_the_store_names_the_url_not_its_temporary_copy(store_prefix, tmp_path,
                                                                          capsys):
    from nvcomp_ckpt_engine.cli import transfer

    small_plain_ckpt(tmp_path / "plain")
    src = f"{store_prefix}/engine"
    assert cli.main(["compress", "-q", str(tmp_path / "plain"), str(tmp_path / "engine")]) == 0
    transfer.upload(str(tmp_path / "engine"), src)
    nce.storage.open_storage(src).delete(f"{TAGS[-1]}/{manifest.MANIFEST_NAME}")
    status, _, err = run_cli(capsys, "decompress", "-q", "--tag", TAGS[-1], src, str(tmp_path / "out"))
    assert status == 1 and f"{src}/{TAGS[-1]}" in err and "nvcomp-ckpt-in-" not in err, err
    assert not (tmp_path / "out").exists()
    status, _, err = run_cli(capsys, "decompress", "-q", f"{store_prefix}/nothing", str(tmp_path / "out"))
    assert status == 2 and f"{store_prefix}/nothing does not exist" in err


def test_cost_measures_a_checkpoint_on_the_store(store_prefix, tmp_path, capsys):
    small_plain_ckpt(tmp_path / "plain")
    from nvcomp_ckpt_engine.cli import transfer

    assert run_cli(capsys, "compress", "-q", str(tmp_path / "plain"), str(tmp_path / "engine"))[0] == 0
    transfer.upload(str(tmp_path / "engine"), f"{store_prefix}/engine")
    local = json.loads(run_cli(capsys, "cost", "--json", "--from", str(tmp_path / "engine"))[1])
    status, out, _ = run_cli(capsys, "cost", "--json", "--from", f"{store_prefix}/engine")
    assert status == 0
    assert json.loads(out)["inputs"] == local["inputs"]


def test_zero_to_fp32_reads_from_the_store(on_store, engine_ckpt, tmp_path, capsys):
    from nvcomp_ckpt_engine.cli import transfer

    assert run_cli(capsys, "zero-to-fp32", str(engine_ckpt), str(tmp_path / "local"))[0] == 0
    status, out, _ = run_cli(capsys, "zero-to-fp32", on_store["engine"], on_store["out"])
    assert status == 0 and on_store["out"] in out
    transfer.fetch(on_store["out"], str(tmp_path / "fetched"))  # DeepSpeed's plain torch file
    assert_same_object(torch_load(tmp_path / "local" / "pytorch_model.bin"),
                       torch_load(tmp_path / "fetched" / "pytorch_model.bin"))


def test_to_universal_reads_from_and_writes_to_the_store(on_store, capsys):
    status, out, _ = run_cli(capsys, "to-universal", "-q", on_store["engine"], on_store["out"])
    assert status == 0 and f"{on_store['out']}/global_step2" in out
    tag_url = f"{on_store['out']}/global_step2"
    manifest_files.verify_files(tag_url, manifest.read_manifest(tag_url))
    assert discovery.inspect_latest(on_store["out"], name="latest_universal").tag == "global_step2"
