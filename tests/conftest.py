"""Shared test setup: markers, hypothesis profiles, and small helpers for bit-exact checks."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests where there is no CUDA device, saying so."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as uint8 (row-major), for bit-exact comparison."""
    # A fresh 1-D copy: `.contiguous()` keeps odd strides of size-1 dimensions, which `view`
    # to another element size refuses.
    flat = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor, where: str = "") -> None:
    """Same dtype, shape, strides and bytes: equality of bits, never allclose."""
    assert a.dtype == b.dtype, where
    assert a.shape == b.shape, where
    assert a.stride() == b.stride(), where
    assert torch.equal(raw_bytes(a.cpu()), raw_bytes(b.cpu())), where
