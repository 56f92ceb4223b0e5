"""A derived range's source is identified, not assumed, by every reader.

A ZeRO-1/2 module saved as derived (shard format 4) names, for each span of its bytes, a tensor
of another file of its checkpoint, and records the digest of the span's bytes. These tests forge
the three ways a source can be wrong — another save's shard copied over it, a link out of the
tag folder (to a byte-identical copy, so only the path check can find it), a source that is
itself derived — and require each reader to refuse it with a `CorruptCheckpointError` naming
the derived file and the source: `nvcomp_ckpt_engine.load` (what the wrapped
``zero_to_fp32.py`` reads through), the tag reader (``decompress``, ``to-universal``), the
DeepSpeed engine's load and its all-gather rebuild, and ``nvcomp-ckpt verify``. All in one
process, without DeepSpeed running.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import types
import zlib
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import cli, compat, container, derived, manifest
from nvcomp_ckpt_engine.formats import DIGEST_PRIME
from nvcomp_ckpt_engine.tagreader import TagReader

from conftest import assert_same_tensor

KEY = "optimizer_state_dict/single_partition_of_fp32_groups/0"
MODULE = "mp_rank_00_model_states.pt"
SHARDS = [f"zero_pp_rank_{k}_mp_rank_00_optim_states.pt" for k in range(2)]
#: Elements of the module; each of the two shards holds half of its fp32 master.
NUMEL = 4096


def _reference_digest(data: bytes) -> int:
    """docs/FORMAT.md's definition, word by word."""
    data += bytes(-len(data) % 4)
    words = [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)]
    a = sum(words) % DIGEST_PRIME
    b = sum((j + 1) * w for j, w in enumerate(words)) % DIGEST_PRIME
    return a * 2**31 + b


def _save_step(tag_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """A tag folder of one save: two "optimizer shards" holding halves of an fp32 master, a bf16
    module derived from them, and the manifest. Returns the module."""
    tag_dir.mkdir(parents=True)
    master = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
    half = NUMEL // 2
    for k, name in enumerate(SHARDS):
        partition = master[k * half : (k + 1) * half].clone()
        nce.save({"optimizer_state_dict": {"single_partition_of_fp32_groups": [partition]}}, tag_dir / name,
                 algorithm="zstd")
    flat = master.bfloat16()
    module = {"w": flat[:3000], "b": flat[3000:]}

    def derive(t: torch.Tensor) -> list[derived.Piece]:
        """The pieces of `t` (a view of `flat`) in each shard's partition."""
        lo, pieces = t.storage_offset(), []
        for k in range(2):
            a, b = max(lo, k * half), min(lo + t.numel(), (k + 1) * half)
            if a < b:
                pieces.append(derived.Piece(a - lo, b - a, SHARDS[k], KEY, a - k * half))
        return pieces

    nce.save({"module": module}, tag_dir / MODULE, derive=derive, algorithm="zstd")
    _write_manifest(tag_dir)
    return module


def _write_manifest(tag_dir: Path) -> None:
    """The manifest of the tag's shard files as they are now (a consistent forgery, for the
    cases the manifest cannot tell apart)."""
    records = []
    for p in sorted(tag_dir.iterdir()):
        if nce.is_shard_file(p):
            index = container.read_index(p)
            records.append(manifest.ShardRecord(path=p.name, rank=0, raw_bytes=index.raw_bytes,
                                                file_bytes=p.stat().st_size, crc32=index.crc32,
                                                codecs=index.codecs))
    manifest.write_manifest(tag_dir, manifest.build_manifest(
        tag=tag_dir.name, world_size=1, files=records, layout={"framework": "torch"}, versions={},
        step=None, created_unix_ns=0))


def _swap(step1: Path, tmp_path: Path) -> None:
    """Step 2's shard of rank 1 copied over step 1's (the manifest then disagrees)."""
    _save_step(tmp_path / "other" / "global_step2", seed=2)
    shutil.copy(tmp_path / "other" / "global_step2" / SHARDS[1], step1 / SHARDS[1])


def _swap_resealed(step1: Path, tmp_path: Path) -> None:
    """`_swap`, the manifest rewritten to match: only the module's digests can tell."""
    _swap(step1, tmp_path)
    _write_manifest(step1)


def _link_out(step1: Path, tmp_path: Path) -> None:
    """Step 1's shard of rank 1 moved out of the tag folder and linked to from it: the bytes
    are the right ones, only the path is wrong."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (step1 / SHARDS[1]).rename(outside / SHARDS[1])
    os.symlink(outside / SHARDS[1], step1 / SHARDS[1])


def _derived_source(step1: Path, tmp_path: Path) -> None:
    """Step 1's shard of rank 1 rewritten as derived in turn (from a copy of it beside it),
    the manifest rewritten to match: only the rule that a source holds its bytes refuses it."""
    held = nce.load(step1 / SHARDS[1])
    nce.save(held, step1 / "copy_states.pt", algorithm="zstd")
    nce.save(held, step1 / SHARDS[1], algorithm="zstd",
             derive=lambda t: [derived.Piece(0, t.numel(), "copy_states.pt", KEY, 0)])
    assert container.read_index(step1 / SHARDS[1]).derived_files == ("copy_states.pt",)
    _write_manifest(step1)


FORGERIES = {"swapped": _swap, "swapped-resealed": _swap_resealed, "linked-out": _link_out,
             "derived": _derived_source}
#: The forgeries a reader of the tag refuses when it opens the tag, from the manifest's check of
#: every listed file (size, CRC, a link out), before the module is read: the error names the
#: forged file. The others reach the module's own checks, which name both files.
REFUSED_AT_OPEN = ("swapped", "linked-out")


@pytest.fixture(params=list(FORGERIES))
def forged(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    """(forgery, tag folder of step 1 with its rank-1 shard forged)."""
    step1 = tmp_path / "ckpt" / "global_step1"
    _save_step(step1, seed=1)
    FORGERIES[request.param](step1, tmp_path)
    return request.param, step1


#: What a refusal by the module's checks names: the module file, then the forged source.
NAMES_BOTH = rf"{MODULE}.*{SHARDS[1]}"


def _refusal(forgery: str) -> tuple[type[Exception], str]:
    """What a reader of the tag raises for `forgery`, and what its message names."""
    if forgery in REFUSED_AT_OPEN:
        return nce.CheckpointError, SHARDS[1]
    return nce.CorruptCheckpointError, NAMES_BOTH


# ------------------------------------------------------------------------------ the digest


@pytest.mark.parametrize("length", [1, 3, 4, 8, 1001, 8192, 40_005])
@pytest.mark.parametrize("offset", [0, 2, 4, 5])
def test_the_range_digest_is_the_formats_definition(length: int, offset: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Any length, any alignment in memory; in one slice and in several (the last one short),
    with the words of the highest values too."""
    data = torch.randint(0, 256, (offset + length,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(length))[offset:]
    data[: length // 3] = 255
    expected = _reference_digest(bytes(data.tolist()))
    assert int(derived.range_digest(data)) == expected
    monkeypatch.setattr(derived, "_DIGEST_STEP_CPU", 8 * derived._DIGEST_ROW)
    assert int(derived.range_digest(data)) == expected


def test_the_digest_of_known_bytes_is_pinned() -> None:
    """A change of the definition must be deliberate (it is part of shard format 4)."""
    data = torch.tensor(list(b"nvcomp_ckpt_engine"), dtype=torch.uint8)
    assert int(derived.range_digest(data)) == _reference_digest(b"nvcomp_ckpt_engine") == 995178481838939466


def test_every_range_records_the_digest_of_its_bytes_as_saved(tmp_path: Path) -> None:
    module = _save_step(tmp_path / "global_step1", seed=1)
    index = container.read_index(tmp_path / "global_step1" / MODULE)
    (storage,) = [s for s in index.storages if s.derived]
    flat = torch.cat([module["w"], module["b"]]).view(torch.uint8)
    assert [r.digest for r in storage.derived] == [
        _reference_digest(bytes(flat[r.at : r.at + r.nbytes].tolist())) for r in storage.derived]
    assert index.format_version == container.DERIVED_DIGEST_VERSION


def test_an_intact_tag_loads_through_every_reader(tmp_path: Path) -> None:
    step1 = tmp_path / "global_step1"
    module = _save_step(step1, seed=1)
    for loaded in (nce.load(step1 / MODULE), TagReader(step1).load(MODULE)):
        for key, tensor in module.items():
            assert_same_tensor(tensor, loaded["module"][key], key)
    assert cli.main(["verify", "-q", str(step1)]) == 0
    assert cli.main(["verify", "-q", str(step1 / MODULE)]) == 0


def _reseal_module(path: Path, edit: Callable[[dict], None]) -> None:
    """Apply `edit` to each derived range of a shard's JSON index; rewrite the trailer."""
    data = path.read_bytes()
    offset, length, _, version, end = struct.unpack("<QQII8s", data[-32:])
    index = json.loads(data[offset : offset + length])
    for storage in index["storages"]:
        for r in storage.get("derived", []):
            edit(r)
    body = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
    path.write_bytes(data[:offset] + body + struct.pack("<QQII8s", offset, len(body), zlib.crc32(body),
                                                        version, end))


@pytest.mark.parametrize("edit, error, message", [
    (lambda r: r.pop("digest"), nce.CorruptCheckpointError, "keys"),
    (lambda r: r.update(digest=-1), nce.CorruptCheckpointError, "digest = -1 is not an integer"),
    (lambda r: r.update(digest=1 << 62), nce.CorruptCheckpointError, "digest"),
    (lambda r: r.update(digest="0x1"), nce.CorruptCheckpointError, "digest"),
    (lambda r: r.update(digest=r["digest"] ^ 1), nce.CorruptCheckpointError,
     rf"{MODULE}.*{SHARDS[0]}.*digest .*recorded"),
])
def test_a_forged_digest_is_refused(tmp_path: Path, edit: Callable[[dict], None], error: type,
                                    message: str) -> None:
    step1 = tmp_path / "global_step1"
    _save_step(step1, seed=1)
    _reseal_module(step1 / MODULE, edit)
    with pytest.raises(error, match=message):
        nce.load(step1 / MODULE)


def test_a_writer_cannot_mix_ranges_with_and_without_digests(tmp_path: Path) -> None:
    with_digest = container.DerivedRange(0, 2, "bfloat16", "f", "k", 0, digest=7)
    without = container.DerivedRange(4, 2, "bfloat16", "f", "k", 2)
    for version, ranges in [(4, (with_digest, without)), (2, (with_digest,)), (4, (without,))]:
        writer = container.ShardWriter(tmp_path / f"v{version}.pt", version=version)
        try:
            with pytest.raises(ValueError, match="digests exactly in shard format version 4"):
                writer.begin_storage(nbytes=8, dtype="bfloat16", device="cpu", codec={"name": "none", "version": 1},
                                     transform={"name": "none", "version": 1}, derived=ranges)
        finally:
            writer.abort()


# ------------------------------------------------------------------------------ the readers


def test_load_refuses_the_forged_source(forged: tuple[str, Path]) -> None:
    """`nvcomp_ckpt_engine.load`, and `torch.load` patched as the wrapped ``zero_to_fp32.py``
    and ``nvcomp-ckpt zero-to-fp32`` read the module (through its tag's manifest, as the tag
    reader does)."""
    forgery, step1 = forged
    with pytest.raises(nce.CorruptCheckpointError, match=NAMES_BOTH):
        nce.load(step1 / MODULE)
    error, names = _refusal(forgery)
    with compat.patch_torch_load(), pytest.raises(error, match=names):
        torch.load(step1 / MODULE)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_the_tag_reader_refuses_the_forged_source(forged: tuple[str, Path], verify: bool) -> None:
    """Without ``verify`` the manifest's CRCs are not compared: the digest still finds another
    save's shard."""
    forgery, step1 = forged
    error, names = _refusal(forgery)
    with pytest.raises(error, match=names):
        TagReader(step1, verify=verify).load(MODULE)


def test_decompress_refuses_the_forged_source(forged: tuple[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    forgery, step1 = forged
    assert cli.main(["decompress", "-q", str(step1), str(tmp_path / "plain")]) != 0
    _, names = _refusal(forgery)
    assert re.search(names, capsys.readouterr().err)
    assert not (tmp_path / "plain").exists()


@pytest.mark.parametrize("target", ["tag", "file"])
def test_verify_reports_the_forged_source_against_the_module(forged: tuple[str, Path], target: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """One FAULT line naming the module and its source, whether the tag is verified (the
    manifest vouches for the files beside the module) or the module file alone (its digests
    are rebuilt from the files beside it)."""
    _, step1 = forged
    capsys.readouterr()
    assert cli.main(["verify", "-q", str(step1 if target == "tag" else step1 / MODULE)]) == 1
    faults = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAULT:")]
    assert any(MODULE in line and SHARDS[1] in line for line in faults), faults


def test_verify_reports_a_damaged_source_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A flipped byte in a source's chunk is the source's fault, on its own line: the module's
    digests are not rebuilt from a source found damaged."""
    step1 = tmp_path / "global_step1"
    _save_step(step1, seed=1)
    source = step1 / SHARDS[1]
    chunk = next(c for s in container.read_index(source).storages for c in s.chunks)
    data = bytearray(source.read_bytes())
    data[chunk.offset + 5] ^= 0x08
    source.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli.main(["verify", "-q", str(step1)]) == 1
    faults = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAULT:")]
    assert len(faults) == 1 and SHARDS[1] in faults[0] and "checksum mismatch" in faults[0], faults


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """Our DeepSpeed checkpoint engine driven by hand in this process, one rank."""
    pytest.importorskip("deepspeed")
    from nvcomp_ckpt_engine.config import NvcompConfig
    from nvcomp_ckpt_engine.deepspeed import _compat
    from nvcomp_ckpt_engine.deepspeed.engine import NvcompCheckpointEngine

    monkeypatch.setattr(_compat, "local_rank", lambda: 0)
    monkeypatch.setattr(_compat, "parallel_layout", lambda stage: {"framework": "deepspeed", "dp": 1})
    return lambda config_params=None, **options: NvcompCheckpointEngine(
        config_params, options=NvcompConfig(enabled=True, algorithm="zstd", **options), zero_stage=1)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_the_engines_load_refuses_the_forged_source(forged: tuple[str, Path], verify: bool,
                                                    engine: Callable[..., Any]) -> None:
    forgery, step1 = forged
    error, names = _refusal(forgery)
    with pytest.raises(error, match=names):
        engine(verify=verify).load(str(step1 / MODULE), map_location="cpu")


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Any:
    """A one-rank gloo process group in this process (the all-gather rebuild's group)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_the_all_gather_rebuild_refuses_another_saves_partition(tmp_path: Path, one_rank_group: Any) -> None:
    """Inside DeepSpeed's ``load_checkpoint`` each rank casts the partitions it owns and checks
    their digests before the group gathers them: a partition of step 2 is refused on the rank
    that decoded it (and, through the status exchange, on every rank)."""
    from nvcomp_ckpt_engine.deepspeed.derived_module import ModuleGather

    step1, step2 = tmp_path / "global_step1", tmp_path / "global_step2"
    module = _save_step(step1, seed=1)
    _save_step(step2, seed=2)
    index = container.read_index(step1 / MODULE)

    def source_from(folder: Path) -> Callable[[str, str], torch.Tensor]:
        return lambda name, key: nce.load(folder / name)["optimizer_state_dict"][
            "single_partition_of_fp32_groups"][0]

    outs = {i: torch.zeros(s.nbytes, dtype=torch.uint8) for i, s in enumerate(index.storages) if s.derived}
    ModuleGather(one_rank_group, dict.fromkeys(SHARDS, 0), source_from(step1)).fill(index, outs)
    (flat,) = outs.values()
    assert torch.equal(flat, torch.cat([module["w"], module["b"]]).view(torch.uint8))

    def mixed(name: str, key: str) -> torch.Tensor:
        return source_from(step2 if name == SHARDS[1] else step1)(name, key)

    with pytest.raises(nce.CorruptCheckpointError, match=rf"{MODULE}.*{SHARDS[1]}.*not the file saved beside it"):
        ModuleGather(one_rank_group, dict.fromkeys(SHARDS, 0), mixed).fill(index, outs)


# ------------------------------------------------------------------------------ a module copied out


def _copy_out(step1: Path, folder: Path) -> Path:
    """Step 1's module copied byte for byte into `folder`, beside a ``zero/`` folder and without
    the shards it is derived from: what DeepSpeed's ``ds_to_universal`` leaves in its output."""
    (folder / "zero").mkdir(parents=True)
    shutil.copy2(step1 / MODULE, folder / MODULE)
    return folder / MODULE


def _read_copy(reader: str, copy: Path, engine: Callable[..., Any]) -> Any:
    """The copied module as `reader` reads it: the engine's universal load (DeepSpeed asks for
    the model states of the folder it is given), ``torch.load`` in a process where DeepSpeed is
    imported (the import hook's wrapper), or patched by `compat.patch_torch_load`."""
    if reader == "engine":
        universal_load = types.SimpleNamespace(load_universal_checkpoint=True)
        return engine(universal_load).load(str(copy), map_location="cpu")
    if reader == "hook":
        return compat.load_with_shards(torch.load, copy)
    with compat.patch_torch_load():
        return torch.load(copy)


READERS = ["engine", "hook", "patched"]


@pytest.mark.parametrize("reader", READERS)
def test_a_module_copied_beside_its_checkpoint_is_rebuilt_from_it(tmp_path: Path, reader: str,
                                                                  engine: Callable[..., Any]) -> None:
    """``ds_to_universal CKPT/TAG CKPT/TAG_universal`` (DeepSpeed's own layout) copies the module
    but not the optimizer shards: the checkpoint it came from is found beside the copy by the
    file's name, size and CRC-32 (another save's tag, listed first, holds a module of the same
    name), and the module comes back whole."""
    _save_step(tmp_path / "ckpt" / "global_step0", seed=0)
    module = _save_step(tmp_path / "ckpt" / "global_step1", seed=1)
    copy = _copy_out(tmp_path / "ckpt" / "global_step1", tmp_path / "ckpt" / "global_step1_universal")
    loaded = _read_copy(reader, copy, engine)
    for key, tensor in module.items():
        assert_same_tensor(tensor, loaded["module"][key], key)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("where", ["elsewhere", "beside-another-save"])
def test_a_copied_module_without_its_checkpoint_is_refused_naming_the_source(
        tmp_path: Path, reader: str, where: str, engine: Callable[..., Any]) -> None:
    step1 = tmp_path / "ckpt" / "global_step1"
    _save_step(step1, seed=1)
    if where == "elsewhere":
        copy = _copy_out(step1, tmp_path / "elsewhere" / "global_step1_universal")
    else:  # the copy's own checkpoint gone, another save's left: its module is not the copy
        _save_step(tmp_path / "ckpt" / "global_step2", seed=2)
        copy = _copy_out(step1, tmp_path / "ckpt" / "global_step1_universal")
        shutil.rmtree(step1)
    with pytest.raises(nce.IncompleteCheckpointError,
                       match=rf"{MODULE}.*derived from {SHARDS[0]}.*no checkpoint in .*ds_to_universal"):
        _read_copy(reader, copy, engine)


@pytest.mark.parametrize("reader", READERS)
def test_a_copied_module_refuses_a_forged_source_of_its_checkpoint(forged: tuple[str, Path], reader: str,
                                                                   engine: Callable[..., Any]) -> None:
    """The checkpoint found beside the copy is read as its own load reads it: each source listed,
    inside its tag folder, with its size and CRC-32, and each derived range's digest checked."""
    forgery, step1 = forged
    copy = _copy_out(step1, step1.parent / f"{step1.name}_universal")
    error, names = _refusal(forgery)
    with pytest.raises(error, match=names):
        _read_copy(reader, copy, engine)


# ------------------------------------------------------------------------------ older files


def test_a_version_2_module_still_loads_and_is_checked_for_links_and_derived_sources(tmp_path: Path) -> None:
    """Files written before version 4 record no digest: another save's shard in its source's
    place cannot be told apart there (docs/FORMAT.md); a link out and a derived source are
    still refused."""
    golden = Path(__file__).parent / "golden" / "v2_derived"
    folder = tmp_path / "v2"
    shutil.copytree(golden, folder)
    nce.load(folder / "model_states.nvckpt")
    outside = tmp_path / "outside"
    outside.mkdir()
    (folder / "optim_states.nvckpt").rename(outside / "optim_states.nvckpt")
    os.symlink(outside / "optim_states.nvckpt", folder / "optim_states.nvckpt")
    with pytest.raises(nce.CorruptCheckpointError, match=r"model_states.nvckpt.*optim_states.nvckpt.*outside"):
        nce.load(folder / "model_states.nvckpt")
