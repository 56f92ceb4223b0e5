"""Megatron-Core's ``metadata.json`` as `nvcomp-ckpt decompress` copies it (no Megatron-Core,
no torch needed)."""

from __future__ import annotations

import json
import os
import tracemalloc

import pytest

from nvcomp_ckpt_engine import megatron_files


def test_our_backend_is_renamed_to_the_stock_one(tmp_path):
    src, dst = tmp_path / "metadata.json", tmp_path / "out.json"
    src.write_text(json.dumps({"sharded_backend": megatron_files.BACKEND, "version": 1}))
    megatron_files.copy_as_stock(src, dst)
    assert json.loads(dst.read_text()) == {"sharded_backend": "torch_dist", "version": 1}


@pytest.mark.parametrize("content", ["nested", "sparse"])
def test_a_hostile_config_is_copied_as_it_is_without_reading_it_whole(tmp_path, content):
    """JSON nested past Python's recursion limit (a RecursionError escaped `decompress`), or a
    sparse file of 64 MiB (read whole first): neither is Megatron's config, so each is copied
    byte for byte, and the large one is not read into memory to find out."""
    src, dst = tmp_path / "metadata.json", tmp_path / "out.json"
    if content == "nested":
        src.write_text("[" * 100_000 + "]" * 100_000)
    else:
        src.write_bytes(b"{}")
        os.truncate(src, 64 << 20)
    tracemalloc.start()
    try:
        megatron_files.copy_as_stock(src, dst)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert dst.stat().st_size == src.stat().st_size
    if content == "sparse":
        assert peak < 8 << 20, f"{peak} bytes allocated to copy it"
    else:
        assert dst.read_bytes() == src.read_bytes()
