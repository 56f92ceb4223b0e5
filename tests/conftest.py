"""Shared test setup: markers, hypothesis profiles, simulated CPU capabilities, and small
helpers for bit-exact checks."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from capabilities import simulated_unsupported

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _simulate_unsupported_dtypes() -> None:
    """With NVCOMP_TEST_UNSUPPORTED_DTYPES set, this process and every process it starts see a
    DeepSpeed CPU accelerator without those dtypes (tests/capabilities.py says why)."""
    if not simulated_unsupported():
        return
    folder = Path(__file__).resolve().parent / "simulate"
    paths = [str(folder), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    spec = importlib.util.spec_from_file_location("_simulated_cpu", folder / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


_simulate_unsupported_dtypes()


#: Fixtures that start other processes, by test module: DeepSpeed in a child process
#: (test_cli), two spawned gloo ranks (test_dcp). A test that uses one, directly or through
#: another fixture, is a multi-process test: marked `slow` here, so a test added later cannot
#: forget the marker.
MULTI_PROCESS_FIXTURES = {"test_cli": {"plain_ckpt"}, "test_dcp": {"ckpt", "store_ckpt"}}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests on multi-process fixtures `slow`; skip `gpu` tests where there is no CUDA
    device, saying so."""
    for item in items:
        module = getattr(getattr(item, "module", None), "__name__", "")
        if MULTI_PROCESS_FIXTURES.get(module, set()) & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
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


def commit_single_rank_tag(folder: Path, tag: str) -> None:
    """Commit the shard files in `folder` as one rank's tag `tag`, as the engine would (a
    manifest listing each with its size and index CRC), and point `latest` at it."""
    from nvcomp_ckpt_engine import container, discovery, manifest

    records = []
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        index = container.read_index(path)
        records.append(manifest.ShardRecord(
            path=path.name, rank=0, raw_bytes=index.raw_bytes, file_bytes=path.stat().st_size,
            crc32=index.crc32, codecs=("zstd",)))
    manifest.write_manifest(folder, manifest.build_manifest(
        tag=tag, world_size=1, files=records, layout={"framework": "torch"}, versions={},
        step=1, created_unix_ns=1))
    discovery.write_latest(folder.parent, tag)


#: What the object-store tests' AWS configuration must not take from the developer's machine.
_AWS_SETTINGS = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                 "AWS_SESSION_TOKEN", "AWS_REGION")


@pytest.fixture(scope="session")
def s3_server():
    """One real S3 API server (moto's server mode) on 127.0.0.1 for the whole test run, with the
    bucket `s3_server.BUCKET`, and AWS variables naming its user's keys and nothing else (no
    profile, no config file of this machine). Started on first use, stopped at the end."""
    from s3_server import MotoServer

    server = MotoServer()
    try:
        with pytest.MonkeyPatch.context() as env:
            for name in _AWS_SETTINGS:
                env.delenv(name, raising=False)
            env.setenv("AWS_CONFIG_FILE", os.devnull)
            env.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
            env.setenv("AWS_DEFAULT_REGION", "us-east-1")
            env.setenv("AWS_ACCESS_KEY_ID", server.access_key)
            env.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
            yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_session(s3_server):
    """One boto3 session for the storages of the tests: its credentials are the server's user's
    (taken once, at its first client) and its service models load once, not once a test."""
    import boto3

    return boto3.session.Session()


@pytest.fixture
def s3_storage(s3_server, s3_session, request):
    """An `S3Storage` on a prefix of its own (the test's name) in the server's bucket, with
    short retry waits so that throttling tests take milliseconds."""
    import re

    from nvcomp_ckpt_engine.storage.s3 import MIN_PART_SIZE, RetryPolicy, S3Storage
    from s3_server import BUCKET

    prefix = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name).strip("-")
    return S3Storage(f"s3://{BUCKET}/{prefix}", endpoint_url=s3_server.url, part_size=MIN_PART_SIZE,
                     session=s3_session, retry=RetryPolicy(attempts=4, base_s=0.01, cap_s=0.05))


def join_ranks(body, world_size: int, timeout: float) -> None:
    """Run `body(rank)` for every rank, each in a thread of its own, and wait for them all, at
    most `timeout` + 10 s in all: a rank still running then fails the test, named (a hang)."""
    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout + 10
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"ranks {hung} hung"
