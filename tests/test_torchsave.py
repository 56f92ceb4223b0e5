"""`torchsave`: torch.save's bytes read through the allowlist, never by torch.load's unpickler.

Hostile archives built from real torch.save output with one part changed: each is a
`CheckpointError` naming the source, and nothing it names runs.
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
import torch

from nvcomp_ckpt_engine import torchsave
from nvcomp_ckpt_engine.errors import CorruptCheckpointError, UnsafeObjectError

SOURCE = "ckpt/__0_0.nvcomp.distcp: item 'x'"


def saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def rewritten(data: bytes, change) -> bytes:
    """The archive with `change(name, bytes) -> (bytes, compress_type)` applied to each entry."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            body, compression = change(info.filename, src.read(info))
            dst.writestr(info.filename, body, compress_type=compression)
    return out.getvalue()


class _Calls:
    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def test_values_and_tensors_come_back_as_saved() -> None:
    base = torch.arange(12, dtype=torch.int16)
    obj = {"step": 3, "b": b"\x00\xff", "s": {1, 2}, "ba": bytearray(b"ab"), "t": base.view(3, 4).t(), "head": base[:2],
           "bf": torch.ones(3, dtype=torch.bfloat16), "g": torch.zeros(2, requires_grad=True)}
    got = torchsave.load_bytes(saved(obj), source=SOURCE)
    assert (got["step"], got["b"], got["s"], got["ba"]) == (3, b"\x00\xff", {1, 2}, bytearray(b"ab"))
    for key in ("t", "head", "bf", "g"):
        assert got[key].dtype == obj[key].dtype and torch.equal(got[key], obj[key]), key
        assert got[key].stride() == obj[key].stride(), key
    assert got["g"].requires_grad
    assert got["t"].untyped_storage().data_ptr() == got["head"].untyped_storage().data_ptr()


@pytest.mark.parametrize("global_", [os.system, open, eval])
def test_a_global_off_the_allowlist_runs_nothing(tmp_path: Path, global_) -> None:
    marker = tmp_path / "ran"
    args = {os.system: (f"touch {marker}",), open: (str(marker), "w"), eval: ("1",)}[global_]
    with pytest.raises(UnsafeObjectError, match=rf"^{SOURCE}: the file's skeleton names"):
        torchsave.load_bytes(saved({"x": _Calls(global_, *args)}), source=SOURCE)
    assert not marker.exists()


def test_hostile_archives_are_corruption_naming_the_source() -> None:
    data = saved({"t": torch.arange(4.0)})
    short = rewritten(data, lambda name, body: (body[:8] if name.endswith("data/0") else body,
                                                 zipfile.ZIP_STORED))
    deflated = rewritten(data, lambda name, body: (body, zipfile.ZIP_DEFLATED))
    no_pickle = rewritten(data, lambda name, body: (body, zipfile.ZIP_STORED) if not name.endswith(
        "data.pkl") else (b"", zipfile.ZIP_STORED))
    big = saved({"x": _Calls(bytearray, 1 << 30)})
    cases = {"a tensor beyond its storage": (short, "reaching element 3 of a storage of 8 bytes"),
             "a compressed entry": (deflated, "is compressed"),
             "an empty data.pkl": (no_pickle, "do not decode"),
             "not a zip": (b"\x80\x02}q\x00.", "not a torch.save archive"),
             "a gigabyte from a few bytes": (big, "would build more than")}
    for case, (archive, says) in cases.items():
        with pytest.raises(CorruptCheckpointError) as info:
            torchsave.load_bytes(archive, source=SOURCE)
        assert str(info.value).startswith(SOURCE) and says in str(info.value), (case, info.value)


def test_trusted_reads_as_torch_load_does() -> None:
    data = saved({"x": _Calls(eval, "7")})
    with pytest.raises(UnsafeObjectError):
        torchsave.safe_bytes(data, source=SOURCE)
    assert torchsave.safe_bytes(data, source=SOURCE, trusted=True) == data
    assert torchsave.load_bytes(data, source=SOURCE, trusted=True) == {"x": 7}
