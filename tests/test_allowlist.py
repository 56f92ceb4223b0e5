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

    import nvcomp_ckpt_engine.deepspeed  # noqa: F401  (the adapter registers DeepSpeed's objects)

    state = {"scaler": loss_scaler.DynamicLossScaler(init_scale=2**16, scale_window=10, min_scale=1, delayed_shift=2, consecutive_hysteresis=False),
             "frag": fragment_address(numel=4, start=0), "dtype": torch.float32}
    nce.save(state, tmp_path / "s.pt")
    out = nce.load(tmp_path / "s.pt")
    assert out["scaler"].cur_scale == 2**16 and out["frag"].numel == 4


def test_the_core_allowlist_names_no_framework():
    assert not {n for n in state_mod.DEFAULT_SAFE_GLOBALS if n.split(".")[0] in ("deepspeed", "megatron")}


def test_the_deepspeed_adapter_registers_its_objects_without_importing_deepspeed():
    """The CLI reads DeepSpeed tags where DeepSpeed is absent: registering must not import it."""
    import subprocess
    import sys

    child = (
        "import sys\n"
        "from nvcomp_ckpt_engine import state\n"
        "assert 'deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler' not in state.safe_globals()\n"
        "import nvcomp_ckpt_engine.deepspeed\n"
        "import nvcomp_ckpt_engine.compat, nvcomp_ckpt_engine.cli.decompress\n"
        "from nvcomp_ckpt_engine.deepspeed.allowlist import DEEPSPEED_SAFE_GLOBALS\n"
        "assert DEEPSPEED_SAFE_GLOBALS <= state.safe_globals()\n"
        "assert 'deepspeed' not in sys.modules, 'registering imported DeepSpeed'\n"
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_register_safe_globals_takes_plain_names_only():
    with pytest.raises(ValueError):
        state_mod.register_safe_globals(["NoModule"])
    state_mod.register_safe_globals(["test_allowlist.Registered"])
    try:
        assert "test_allowlist.Registered" in state_mod.safe_globals()
    finally:
        state_mod._registered_safe.discard("test_allowlist.Registered")


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


# --------------------------------------------------------------- what a skeleton may build
#
# Hand-made skeletons (protocol-2 pickles), stored in real shard files through the library's own
# writer, so the load reaches the unpickler rather than a checksum.

import collections
import enum
import struct
import tracemalloc

from nvcomp_ckpt_engine import pipeline


class Victim:
    """An allowlisted class (through safe_classes) that a file must not be able to alter."""

    def method(self):
        return "original"


class VictimEnum(enum.Enum):
    ONE = 1


class TaggedDict(collections.OrderedDict):
    """A dict subclass with an attribute: pickled with BUILD on the new instance."""


SAFE = ["test_allowlist.Victim", "test_allowlist.VictimEnum", "test_allowlist.TaggedDict"]


def _g(qualified: str) -> bytes:
    module, _, name = qualified.rpartition(".")
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _s(text: str) -> bytes:
    return b"X" + struct.pack("<I", len(text)) + text.encode()


def _i(value: int) -> bytes:
    return b"J" + struct.pack("<i", value) if -2**31 <= value < 2**31 else b"L%dL\n" % value


def _p(body: bytes) -> bytes:
    return b"\x80\x02" + body + b"."


def forged_shard(tmp_path, skeleton: bytes):
    """A valid shard file (every CRC right) whose skeleton is `skeleton`."""
    path = tmp_path / "forged.pt"
    prepared = pipeline.prepare_shard(skeleton, [], [], algorithm="zstd", portable=False,
                                      chunk_bytes=1 << 20, writer_info={})
    pipeline.write_prepared(prepared, path, durable=False)
    return path


#: BUILD aimed at objects that exist outside the file: the class itself (setattr through the
#: slot state), an enum member (twice: by value and by name), a function, a tensor of the file,
#: a shared numpy dtype, torch's dtype object.
BUILD_TARGETS = {
    "class-slotstate": _g("test_allowlist.Victim") + b"N}" + _s("method") + _g("builtins.int")
    + b"s\x86b",
    "class-dict": _g("test_allowlist.Victim") + b"}" + _s("method") + _g("builtins.int") + b"sb",
    "enum-by-value": _g("test_allowlist.VictimEnum") + _i(1) + b"\x85R}" + _s("x") + _i(1)
    + b"sb",
    "enum-by-name": _g("builtins.getattr") + _g("test_allowlist.VictimEnum") + _s("ONE")
    + b"\x86R}" + _s("x") + _i(1) + b"sb",
    "enum-newobj": _g("test_allowlist.VictimEnum") + _i(1) + b"\x85\x81}" + _s("x") + _i(1)
    + b"sb",
    "function": _g("numpy._core.multiarray._reconstruct") + b"}" + _s("x") + _i(1) + b"sb",
    "numpy-shared-dtype": _g("numpy.dtype") + _s("f8") + b"\x85R" + b"(" + _i(3) + _s(">")
    + b"NNN" + _i(-1) + _i(-1) + _i(0) + b"tb",
    "torch-dtype": _g("torch.float32") + b"N}" + _s("is_floating_point") + _g("builtins.int")
    + b"s\x86b",
}


@pytest.mark.parametrize("name", sorted(BUILD_TARGETS))
def test_build_reaches_only_objects_the_load_created(tmp_path, name):
    import numpy as np

    before = (Victim.__dict__.get("method"), dict(VictimEnum.ONE.__dict__),
              np.dtype("f8").str, dict(getattr(np._core.multiarray._reconstruct, "__dict__", {})))
    path = forged_shard(tmp_path, _p(BUILD_TARGETS[name]))
    try:
        with pytest.raises(nce.CheckpointError) as info:
            nce.load(path, safe_classes=SAFE)
        assert str(path) in str(info.value)
        after = (Victim.__dict__.get("method"), dict(VictimEnum.ONE.__dict__),
                 np.dtype("f8").str, dict(getattr(np._core.multiarray._reconstruct, "__dict__", {})))
        assert after == before
    finally:  # today's main lets some of these through: leave the process as it was
        Victim.method = before[0]
        VictimEnum.ONE.__dict__.pop("x", None)
        getattr(np._core.multiarray._reconstruct, "__dict__", {}).pop("x", None)


def test_build_of_objects_the_load_created_still_works(tmp_path):
    import numpy as np

    tagged = TaggedDict(a=1)
    tagged.note = "kept"
    state = {"tagged": tagged, "victim": Victim(), "ns": argparse.Namespace(lr=0.1),
             "array": np.arange(6, dtype=np.float32).reshape(2, 3), "dtype": np.dtype(">i4"),
             "rng": np.random.RandomState(5).get_state()}
    state["victim"].field = [1, 2]
    nce.save(state, tmp_path / "s.pt")
    out = nce.load(tmp_path / "s.pt", safe_classes=SAFE)
    assert out["tagged"] == {"a": 1} and out["tagged"].note == "kept"
    assert out["victim"].field == [1, 2] and out["victim"].method() == "original"
    assert out["ns"].lr == 0.1 and out["dtype"] == np.dtype(">i4")
    assert (out["array"] == state["array"]).all() and (out["rng"][1] == state["rng"][1]).all()


def _nest(depth: int, leaf: bytes, *, lists: bool = False) -> bytes:
    """A tuple (or list) built `depth` times from two memo references to the previous one; it
    is left alone on the stack (each level is memoized, then popped)."""
    body = leaf + b"q\x000"
    for level in range(depth):
        twice = (b"h" + bytes([level % 2])) * 2
        body += (b"](" + twice + b"e" if lists else twice + b"\x86") + b"q" + bytes([(level + 1) % 2]) + b"0"
    return body + b"h" + bytes([depth % 2])


#: Skeletons of a few hundred bytes whose objects would be megabytes to gigabytes, or whose
#: hashing would walk millions of elements: each within reach of today's allowlist. Sizes are
#: kept small enough that an unguarded reader survives them (for the check against old code).
ALLOCATIONS = {
    "bytearray-of-int": _g("builtins.bytearray") + _i(512 << 20) + b"\x85R",
    "list-of-range": _g("builtins.list") + _g("builtins.range") + _i(1 << 21) + b"\x85R\x85R",
    "tuple-of-range": _g("builtins.tuple") + _g("builtins.range") + _i(1 << 21) + b"\x85R\x85R",
    "set-of-range": _g("builtins.set") + _g("builtins.range") + _i(1 << 20) + b"\x85R\x85R",
    "frozenset-of-range": _g("builtins.frozenset") + _g("builtins.range") + _i(1 << 20)
    + b"\x85R\x85R",
    "deque-of-range": _g("collections.deque") + _g("builtins.range") + _i(1 << 21)
    + b"\x85R\x85R",
    "size-of-range": _g("torch.Size") + _g("builtins.range") + _i(1 << 21) + b"\x85R\x85R",
    "numpy-reconstruct": _g("numpy._core.multiarray._reconstruct") + _g("numpy.ndarray")
    + _i(1 << 25) + b"\x85" + b"C\x01b" + b"\x87R",
    "numpy-ndarray": _g("numpy.ndarray") + _i(1 << 22) + b"\x85" + _s("f8") + b"\x86R",
    "numpy-object-array-state": _g("numpy._core.multiarray._reconstruct") + _g("numpy.ndarray")
    + _i(0) + b"\x85C\x01b\x87R" + b"(" + _i(1) + _i(1 << 22) + b"\x85" + _g("numpy.dtype")
    + _s("O8") + b"\x89\x88\x87R" + b"\x89]t" + b"b",
    "str-of-shared-lists": _g("builtins.str") + _nest(22, b"]", lists=True) + b"\x85R",
    "hashed-shared-tuples": b"}" + _nest(22, b")") + b"Ns",
    "frozenset-of-shared-tuples": b"(" + _nest(22, b")") + b"\x91",
    "slice-assignment-growth": b"]" + _g("builtins.slice") + _i(0) + _i(0) + b"\x86R"
    + _g("builtins.range") + _i(1 << 21) + b"\x85Rs",
    "appends-to-a-bytearray": _g("builtins.bytearray") + b")R(" + _i(1) * 4 + b"e",
}


@pytest.mark.parametrize("name", sorted(ALLOCATIONS))
def test_no_skeleton_builds_more_than_the_expansion_bound(tmp_path, name):
    skeleton = _p(ALLOCATIONS[name])
    path = forged_shard(tmp_path, skeleton)
    tracemalloc.start()
    try:
        with pytest.raises(nce.CorruptCheckpointError) as info:
            nce.load(path, safe_classes=SAFE)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(path) in str(info.value)
    assert peak < 8 << 20, f"{peak} bytes allocated for a {len(skeleton)}-byte skeleton"


def test_objects_within_the_bound_still_load(tmp_path):
    import numpy as np

    state = {"big": np.zeros(1 << 20, dtype=np.uint8), "ranges": list(range(1000)),
             "shared": [("a", "b")] * 5000, "blob": bytearray(b"x" * 100_000)}
    nce.save(state, tmp_path / "s.pt")
    out = nce.load(tmp_path / "s.pt")
    assert (out["big"] == 0).all() and out["ranges"] == state["ranges"]
    assert out["shared"] == state["shared"] and out["blob"] == state["blob"]


@pytest.mark.parametrize("skeleton", [
    _g("datetime.timedelta") + _i(10 ** 9) + _i(10 ** 9) + b"\x86R",  # OverflowError
    _g("builtins.int") + _s("x") + b"\x85R",  # ValueError
    _g("builtins.complex") + b"}\x85R",  # TypeError
    _g("torch.device") + _s("nowhere") + b"\x85R",  # RuntimeError
    _g("builtins.slice") + b"(" + _i(1) * 4 + b"tR",  # too many arguments
    b"(" + _i(1) + b"\x86",  # TUPLE2 with one item above the mark
    _i(1) + b"a",  # APPEND to an int
])
def test_every_failure_of_a_skeleton_is_a_checkpoint_error_naming_the_file(tmp_path, skeleton):
    path = forged_shard(tmp_path, _p(skeleton))
    with pytest.raises(nce.CorruptCheckpointError, match="does not decode|asks for") as info:
        nce.load(path)
    assert str(path) in str(info.value)


class _ForgedReference(pickle.Pickler):
    """Pickles a skeleton whose tensor reference is `pid`, as a forger's writer would."""

    def __init__(self, file, pid):
        super().__init__(file, protocol=4)
        self.pid = pid

    def persistent_id(self, obj):
        return self.pid if isinstance(obj, torch.Tensor) else None


@pytest.mark.parametrize("attributes", [
    [("note", 1)],                       # not a dict
    {},                                  # empty: a writer never records it
    {"__class__": 1},                    # a dunder: not a plain attribute
    {"not an identifier": 1},
    {1: "x"},
], ids=["list", "empty", "dunder", "not-identifier", "int-key"])
@pytest.mark.parametrize("trusted", [False, True], ids=["allowlist", "trusted"])
def test_a_tensor_reference_with_hostile_attributes_is_corruption(attributes, trusted):
    """Attributes in a tensor reference are a dict of plain attribute names, or the skeleton
    is corrupt, naming its source; nothing is set on the tensor."""
    import io

    data = io.BytesIO()
    _ForgedReference(data, ("tensor", 0, attributes)).dump({"t": torch.zeros(1)})
    tensor = torch.zeros(1)
    with pytest.raises(nce.CorruptCheckpointError, match="forged.pt"):
        state_mod.unflatten(data.getvalue(), [tensor], trusted=trusted, source="forged.pt",
                            tensor_attributes=True)
    assert vars(tensor) == {}


# ------------------------------------------------------------------- nesting, bounded


def _nested_lists(depth: int) -> bytes:
    """``[[...[1]...]]`` `depth` deep: each level memoized, popped, then appended to a new list
    (a pickle the library's writer, recursive, could not write this deep)."""
    return b"]K\x01a" + b"q\x000]h\x00a" * (depth - 1)


def _nested_dicts(depth: int) -> bytes:
    """``{"k": {"k": ...}}`` `depth` deep, built the same way."""
    return b"}" + (b"q\x000}" + _s("k") + b"h\x00s") * (depth - 1)


#: Skeletons of nests deeper than `state.MAX_NESTING`: each loaded, then walked by a recursive
#: function (pickle's writer, as `decompress` and `to-universal` re-save what they read), died
#: with RecursionError; a deep enough nest of tuples used as a key crashed the process.
DEEP = {
    "lists": _nested_lists(100_000),
    "dicts": _nested_dicts(50_000),
    "lists-just-past-the-bound": _nested_lists(state_mod.MAX_NESTING + 1),
    "tuples": b"\x85".join([b")"] + [b""] * 50_000) + b"\x85",
}


@pytest.mark.parametrize("name", sorted(DEEP))
def test_a_skeleton_nested_deeper_than_the_bound_is_refused_naming_the_file(tmp_path, name):
    path = forged_shard(tmp_path, _p(DEEP[name]))
    with pytest.raises(nce.CorruptCheckpointError, match=rf"{state_mod.MAX_NESTING}") as info:
        nce.load(path)
    assert str(path) in str(info.value)


def test_a_nest_at_the_bound_saves_loads_and_one_past_it_is_not_saved(tmp_path):
    """What the writer writes, the reader reads: the bound is the same on both sides."""
    nested: list = [1]
    for _ in range(state_mod.MAX_NESTING - 1):
        nested = [nested]
    nce.save(nested, tmp_path / "s.pt")
    assert nce.load(tmp_path / "s.pt") == nested
    with pytest.raises(ValueError, match=rf"more than {state_mod.MAX_NESTING} levels"):
        nce.save({"deeper": nested}, tmp_path / "t.pt")
    assert not (tmp_path / "t.pt").exists()


def test_hashing_a_deep_nest_of_tuples_is_refused_before_it_crashes_the_process(tmp_path):
    """A dict keyed by tuples nested 300,000 deep (a 300 KB skeleton): CPython hashes the key
    by a C recursion without a limit, which crashed the process. Run in a child, so that an
    unguarded reader fails this test rather than the test run."""
    import subprocess
    import sys

    key = b"\x85".join([b")"] + [b""] * 300_000) + b"\x85"
    path = forged_shard(tmp_path, _p(b"}" + key + b"Ns"))
    child = ("import sys, nvcomp_ckpt_engine as nce\n"
             "try:\n    nce.load(sys.argv[1])\n"
             "except nce.CorruptCheckpointError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", child, str(path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert str(path) in done.stdout and f"nested more than {state_mod.MAX_NESTING}" in done.stdout
