"""`nvcomp-ckpt` on torch.distributed.checkpoint folders written by our DCP writer."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from nvcomp_ckpt_engine import cli
from nvcomp_ckpt_engine.dcp import NvcompFileSystemWriter

from conftest import assert_same_tensor


def _save(path) -> dict:
    torch.manual_seed(0)
    state = {"w": torch.randn(256, 64), "b": torch.randn(64).bfloat16(), "step": torch.tensor(3)}
    dcp.save(state, storage_writer=NvcompFileSystemWriter(path))
    return state


def test_inspect_verify_and_decompress_a_dcp_checkpoint(tmp_path, capsys):
    src = tmp_path / "dcp"
    state = _save(src)
    assert cli.main(["inspect", str(src), "--json"]) == 0
    assert '"kind": "dcp"' in capsys.readouterr().out
    assert cli.main(["verify", str(src)]) == 0
    out = tmp_path / "plain"
    assert cli.main(["decompress", str(src), str(out)]) == 0
    loaded = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=str(out))  # stock reader
    for key in state:
        assert_same_tensor(state[key], loaded[key], key)


def test_verify_names_a_damaged_dcp_file(tmp_path, capsys):
    src = tmp_path / "dcp"
    _save(src)
    (shard,) = [p for p in src.iterdir() if p.name.endswith(".distcp")]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert cli.main(["verify", str(src)]) == 1
    assert shard.name in capsys.readouterr().out


def test_a_dcp_checkpoint_on_an_object_store_is_inspected_verified_and_decompressed(
        s3_server, s3_storage, monkeypatch, tmp_path, capsys):
    """A DCP folder given as a URL is recognised as DCP (its .metadata read through the
    allowlist, the coverage of its items checked), not read as a plain tag folder."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    src = f"{s3_storage.url}/dcp"
    state = _save(src)
    assert cli.main(["inspect", src, "--json"]) == 0
    assert '"kind": "dcp"' in capsys.readouterr().out
    assert cli.main(["verify", src]) == 0
    out = tmp_path / "plain"
    assert cli.main(["decompress", src, str(out)]) == 0
    loaded = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=str(out))  # stock reader
    for key in state:
        assert_same_tensor(state[key], loaded[key], key)
    s3_storage.publish("dcp/.metadata", b"not a pickle of DCP's metadata")
    assert cli.main(["verify", src]) == 1
    assert ".metadata" in capsys.readouterr().out
