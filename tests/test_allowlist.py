"""Loading never runs code from a file unless the caller says the file is trusted."""

from __future__ import annotations

import argparse
import os
import pickle

import pytest
import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import state as state_mod


class Custom:
    def __init__(self, value):
        self.value = value


def test_unknown_class_is_refused_with_both_ways_out(tmp_path):
    nce.save({"obj": Custom(3)}, tmp_path / "s.pt")
    with pytest.raises(nce.UnsafeObjectError) as info:
        nce.load(tmp_path / "s.pt")
    text = str(info.value)
    assert "test_allowlist.Custom" in text and "trusted=True" in text and "add_safe_classes" in text
    assert nce.load(tmp_path / "s.pt", trusted=True)["obj"].value == 3
    assert nce.load(tmp_path / "s.pt", safe_classes=[Custom])["obj"].value == 3
    assert nce.load(tmp_path / "s.pt", safe_classes=["test_allowlist.Custom"])["obj"].value == 3


def test_add_safe_classes_extends_the_allowlist(tmp_path):
    class Local:
        pass

    nce.save({"ns": argparse.Namespace(lr=0.1)}, tmp_path / "s.pt")
    assert nce.load(tmp_path / "s.pt")["ns"].lr == 0.1  # Megatron's args are allowed by default
    try:
        nce.add_safe_classes("test_allowlist.Custom")
        nce.save({"obj": Custom(5)}, tmp_path / "c.pt")
        assert nce.load(tmp_path / "c.pt")["obj"].value == 5
    finally:
        state_mod._extra_safe.discard("test_allowlist.Custom")
    with pytest.raises(TypeError):
        nce.add_safe_classes(3)


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_skeleton_that_would_run_code_is_refused(tmp_path):
    nce.save({"x": Exploit()}, tmp_path / "s.pt")
    with pytest.raises(nce.UnsafeObjectError, match="system"):
        nce.load(tmp_path / "s.pt")


def test_deepspeed_objects_are_allowed(tmp_path):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {"scaler": loss_scaler.DynamicLossScaler(init_scale=2**16, scale_window=10, min_scale=1, delayed_shift=2, consecutive_hysteresis=False),
             "frag": fragment_address(numel=4, start=0), "dtype": torch.float32}
    nce.save(state, tmp_path / "s.pt")
    out = nce.load(tmp_path / "s.pt")
    assert out["scaler"].cur_scale == 2**16 and out["frag"].numel == 4


def test_numpy_rng_state_is_allowed(tmp_path):
    import numpy as np

    rng_state = np.random.RandomState(0).get_state()
    nce.save({"rng": rng_state, "arr": np.arange(5, dtype=np.float32)}, tmp_path / "s.pt")
    out = nce.load(tmp_path / "s.pt")
    assert (out["rng"][1] == rng_state[1]).all() and out["rng"][0] == "MT19937"
    assert out["arr"].dtype == np.float32 and (out["arr"] == np.arange(5)).all()


def test_pickle_of_protocol_tricks_is_contained():
    skeleton = pickle.dumps(("tensor", 5), protocol=4)
    with pytest.raises(Exception):
        state_mod.unflatten(pickle.dumps(Custom(1)), [], source="x")
    assert state_mod.unflatten(skeleton, []) == ("tensor", 5)


def test_enum_members_pickled_by_name_are_allowed_and_nothing_else(tmp_path):
    """Some Pythons pickle an enum member as getattr(EnumClass, "NAME")."""
    import io

    from nvcomp_ckpt_engine.state import unflatten

    def by_name(module: str, cls: str, name: str) -> bytes:
        out = io.BytesIO()
        out.write(b"\x80\x04cbuiltins\ngetattr\nc" + f"{module}\n{cls}\n".encode())
        out.write(b"X" + len(name).to_bytes(4, "little") + name.encode() + b"\x86R.")
        return out.getvalue()

    member = unflatten(by_name("test_roundtrip", "Stage", "ONE"), [], safe_classes=["test_roundtrip.Stage"])
    from test_roundtrip import Stage

    assert member is Stage.ONE
    with pytest.raises(nce.UnsafeObjectError, match="enum members"):
        unflatten(by_name("argparse", "Namespace", "__init__"), [])
