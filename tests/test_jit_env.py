"""The environment for DeepSpeed's JIT op builds (deepspeed/jit_env.py), without a GPU: the arch
list that Hopper images set (``9.0a``) is rewritten into what DeepSpeed 0.19's op builder parses,
checked against that builder's own parser."""

from __future__ import annotations

import os

import pytest

from nvcomp_ckpt_engine.deepspeed import jit_env


@pytest.mark.parametrize("value, expected", [
    ("9.0a", "9.0"),
    ("8.0;9.0a", "8.0;9.0"),
    ("8.0 8.6 9.0a+PTX", "8.0;8.6;9.0+PTX"),
    ("9.0;9.0a;10.0f;12.0", "9.0;10.0;12.0"),
    ("7.5;8.0+PTX", "7.5;8.0+PTX"),
    (" 9.0 ; ", "9.0"),
])
def test_arch_list_in_the_form_deepspeed_parses(value, expected):
    assert jit_env.deepspeed_arch_list(value) == expected


@pytest.mark.parametrize("value", ["Hopper", "9.0;sm_90", "9", ""])
def test_arch_list_without_that_form_is_left_to_the_gpus(value):
    assert jit_env.deepspeed_arch_list(value) is None


def test_jit_environment_changes_only_what_needs_it():
    venv, base = "/opt/venv", "/usr"
    assert jit_env.jit_environment({"TORCH_CUDA_ARCH_LIST": "9.0a"}, venv, base) == {
        "TORCH_CUDA_ARCH_LIST": "9.0", "TORCH_EXTENSIONS_DIR": "/opt/venv/torch_extensions"}
    assert jit_env.jit_environment({"TORCH_CUDA_ARCH_LIST": "Hopper"}, base, base) == {
        "TORCH_CUDA_ARCH_LIST": None}
    given = {"TORCH_CUDA_ARCH_LIST": "9.0", "TORCH_EXTENSIONS_DIR": "/cache"}
    assert jit_env.jit_environment(given, venv, base) == {}
    assert jit_env.jit_environment({}, base, base) == {}


def test_prepare_sets_and_unsets():
    environ = {"TORCH_CUDA_ARCH_LIST": "Hopper", "TORCH_EXTENSIONS_DIR": "/cache"}
    assert jit_env.prepare(environ) == {"TORCH_CUDA_ARCH_LIST": None}
    assert environ == {"TORCH_EXTENSIONS_DIR": "/cache"}
    environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
    jit_env.prepare(environ)
    assert environ["TORCH_CUDA_ARCH_LIST"] == "9.0"


def test_deepspeed_builder_parses_the_rewritten_list(monkeypatch):
    """DeepSpeed's FusedAdam builder, in the JIT mode it builds in on a GPU: it rejects 9.0a
    (the failure this module exists for) and takes the rewritten list."""
    fused_adam = pytest.importorskip("deepspeed.ops.op_builder.fused_adam")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")  # the builder rewrites it; restored after
    builder = fused_adam.FusedAdamBuilder()
    builder.jit_mode = True
    builder._jit_arch_list = "8.0;9.0a"
    with pytest.raises(ValueError, match="0a"):
        builder.compute_capability_args()
    builder._jit_arch_list = jit_env.deepspeed_arch_list("8.0;9.0a")
    assert builder.compute_capability_args() == []
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"
