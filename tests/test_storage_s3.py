"""What only an object store can get wrong, against a real S3 API server on 127.0.0.1
(tests/s3_server.py): an unreachable endpoint, refused credentials, a missing bucket (each a
clear error naming the URL, from `check` before any work); throttling (503 SlowDown from a
proxy in front of the server) retried with backoff, then a clear error; an object replaced
under a reader; an upload abandoned by a killed writer; two writers racing to commit one tag;
URLs and keys that would leave the bucket and prefix."""

from __future__ import annotations

import concurrent.futures as cf
import os
import socket

import pytest

from nvcomp_ckpt_engine.storage import PreconditionFailed, StorageError
from nvcomp_ckpt_engine.storage.s3 import MIN_PART_SIZE, RetryPolicy, S3Storage, parse_s3_url
from s3_server import BUCKET, ThrottlingProxy

FAST_RETRY = RetryPolicy(attempts=4, base_s=0.01, cap_s=0.05)


def _storage(endpoint: str, url: str = f"s3://{BUCKET}/errors", **options) -> S3Storage:
    return S3Storage(url, endpoint_url=endpoint, retry=FAST_RETRY, part_size=MIN_PART_SIZE, **options)


@pytest.fixture
def proxy(s3_server):
    throttling = ThrottlingProxy(s3_server.port)
    yield throttling
    throttling.stop()


# -- a store that cannot be used: said at `check`, naming the URL -----------------------------------

def test_unreachable_endpoint(s3_server):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    storage = _storage(endpoint)
    with pytest.raises(StorageError, match=f"s3://{BUCKET}/errors: cannot reach {endpoint} .* after 3 tries"):
        storage.check()


def test_wrong_credentials(s3_server, monkeypatch):
    s3_server.authenticate(True)
    try:
        _storage(s3_server.url).check()  # the right keys (the server user's, in the environment) pass
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        with pytest.raises(StorageError, match=f"s3://{BUCKET}/errors: .* refused the credentials "
                                               r"\(SignatureDoesNotMatch"):
            _storage(s3_server.url).check()
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000")
        with pytest.raises(StorageError, match=r"refused the credentials \(InvalidAccessKeyId"):
            _storage(s3_server.url).check()
    finally:
        s3_server.authenticate(False)


def test_missing_bucket(s3_server):
    storage = _storage(s3_server.url, "s3://no-such-bucket/run1")
    with pytest.raises(StorageError, match="s3://no-such-bucket/run1: the bucket 'no-such-bucket' does not exist"):
        storage.check()


def test_endpoint_and_profile_from_the_aws_configuration(s3_server, tmp_path, monkeypatch):
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[ckpt]\naws_access_key_id = {s3_server.access_key}\n"
                           f"aws_secret_access_key = {s3_server.secret_key}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    s3_server.authenticate(True)
    try:
        storage = S3Storage(f"s3://{BUCKET}/from-config", profile="ckpt")
        assert storage.endpoint_url == s3_server.url
        storage.check()
        storage.publish("latest", b"tag")
        assert storage.read_small("latest", 10) == b"tag"
    finally:
        s3_server.authenticate(False)


# -- throttling -------------------------------------------------------------------------------------

def test_throttling_is_retried_with_backoff(proxy, s3_session):
    storage = _storage(proxy.url, session=s3_session)
    proxy.fail_next(3)  # three 503 SlowDown, then the server's answer: within 4 tries
    storage.publish("latest", b"global_step1")
    assert proxy.requests == 4
    proxy.fail_next(2)
    assert storage.read_small("latest", 100) == b"global_step1"


def test_throttled_multipart_upload_still_completes(proxy, s3_session):
    storage = _storage(proxy.url, session=s3_session)
    data = os.urandom(2 * MIN_PART_SIZE + 5)
    sink = storage.open_sink("shard")
    sink.append(data[:MIN_PART_SIZE + 1])  # the upload starts, its first part is sent
    proxy.fail_next(3)
    sink.append(data[MIN_PART_SIZE + 1:])
    sink.finish()
    with storage.open_reader("shard") as reader:
        assert reader.read(0, len(data)) == data


def test_throttling_that_does_not_end_is_a_clear_error(proxy, s3_session):
    storage = _storage(proxy.url, session=s3_session)
    proxy.fail_next(100)
    with pytest.raises(StorageError, match=rf"s3://{BUCKET}/errors/latest: a put still throttled or failing "
                                           r"after 4 tries with backoff \(SlowDown"):
        storage.publish("latest", b"x")
    assert proxy.requests == 4


# -- objects that change, uploads left behind, writers that race ------------------------------------

def test_object_replaced_under_a_reader_is_detected(s3_storage):
    s3_storage.publish("shard", b"a" * 100)
    before = s3_storage.stat("shard")
    with s3_storage.open_reader("shard") as reader:
        assert reader.read(0, 10) == b"a" * 10
        s3_storage.publish("shard", b"b" * 100)  # same size, other bytes
        with pytest.raises(StorageError, match="shard: the object changed while it was being read"):
            reader.read(10, 10)
    after = s3_storage.stat("shard")
    assert (after.size, before.size) == (100, 100)
    assert before.etag and after.etag and before.etag != after.etag


#: A writer that dies (SIGKILL) once its shard's multipart upload has begun: nothing cleans up.
KILLED_WRITER = """
import os, signal, sys
from nvcomp_ckpt_engine.storage.s3 import MIN_PART_SIZE, S3Storage
sink = S3Storage(sys.argv[1], endpoint_url=sys.argv[2], part_size=MIN_PART_SIZE).open_sink("tag/shard")
sink.append(os.urandom(MIN_PART_SIZE + 1))  # the upload is created and its first part sent
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_upload_of_a_killed_writer_stays_invisible_and_is_aborted_by_delete_prefix(s3_storage, s3_server):
    import subprocess
    import sys

    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, s3_storage.url, s3_server.url],
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode == -9, killed.stderr
    client = s3_server.client()
    uploads = client.list_multipart_uploads(Bucket=BUCKET, Prefix=s3_storage.prefix + "/tag/").get("Uploads", [])
    assert len(uploads) == 1
    assert not s3_storage.exists("tag/shard")
    assert list(s3_storage.list("tag")) == []
    s3_storage.delete_prefix("tag")
    assert client.list_multipart_uploads(Bucket=BUCKET, Prefix=s3_storage.prefix + "/").get("Uploads", []) == []


def test_abort_aborts_the_multipart_upload(s3_storage, s3_server):
    sink = s3_storage.open_sink("tag/shard")
    sink.append(os.urandom(2 * MIN_PART_SIZE))
    sink.abort()
    uploads = s3_server.client().list_multipart_uploads(Bucket=BUCKET, Prefix=s3_storage.prefix + "/")
    assert uploads.get("Uploads", []) == []


def test_two_writers_cannot_both_commit_one_tag(s3_storage):
    assert s3_storage.capabilities.conditional_publish

    def commit(writer: int) -> int | None:
        try:
            s3_storage.publish("tag/manifest.json", f"writer {writer}".encode(), if_absent=True)
        except PreconditionFailed:
            return None
        return writer

    with cf.ThreadPoolExecutor(8) as pool:
        winners = [w for w in pool.map(commit, range(8)) if w is not None]
    assert len(winners) == 1
    assert s3_storage.read_small("tag/manifest.json", 100) == f"writer {winners[0]}".encode()


def test_without_conditional_put_if_absent_checks_first(s3_server, s3_session):
    storage = _storage(s3_server.url, f"s3://{BUCKET}/no-conditional", conditional_put=False, session=s3_session)
    assert not storage.capabilities.conditional_publish
    storage.publish("tag/manifest.json", b"first", if_absent=True)
    with pytest.raises(PreconditionFailed, match="does not enforce conditional puts"):
        storage.publish("tag/manifest.json", b"second", if_absent=True)


def test_conditional_put_can_be_declared_off_in_the_environment(s3_server, monkeypatch):
    from nvcomp_ckpt_engine.storage import open_storage

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    monkeypatch.setenv("NVCOMP_S3_CONDITIONAL_PUT", "0")
    assert not open_storage(f"s3://{BUCKET}/x").capabilities.conditional_publish
    monkeypatch.setenv("NVCOMP_S3_CONDITIONAL_PUT", "maybe")
    with pytest.raises(ValueError, match="NVCOMP_S3_CONDITIONAL_PUT='maybe'"):
        open_storage(f"s3://{BUCKET}/x")


def test_capabilities(s3_storage):
    caps = s3_storage.capabilities
    assert (caps.atomic_rename, caps.local, caps.device_buffers) == (False, False, False)


# -- URLs and keys that would leave the bucket and prefix ------------------------------------------

@pytest.mark.parametrize("url", ["s3://bucket/../other", "s3://bucket/a/./b", "s3://Bad_Bucket/x", "s3://b/x",
                                 "s3:/bucket/x", "/local/path", "s3://bucket//x"])
def test_urls_that_escape_or_are_malformed_are_refused(url):
    with pytest.raises(ValueError, match="s3://bucket|is not|valid S3 bucket"):
        parse_s3_url(url)


def test_url_parts():
    assert parse_s3_url("s3://my-bucket") == ("my-bucket", "")
    assert parse_s3_url("s3://my-bucket/runs/gpt/") == ("my-bucket", "runs/gpt")


def test_keys_stay_under_the_prefix(s3_storage, s3_server):
    s3_storage.publish("a/b", b"x")
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=BUCKET, Prefix=s3_storage.prefix)["Contents"]]
    assert keys == [f"{s3_storage.prefix}/a/b"]
    assert s3_storage.describe("a/b") == f"s3://{BUCKET}/{s3_storage.prefix}/a/b"


def test_open_storage_takes_the_endpoint_from_the_environment(s3_server, monkeypatch):
    from nvcomp_ckpt_engine.storage import open_storage, storage_for

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    storage = open_storage(f"s3://{BUCKET}/from-env")
    assert isinstance(storage, S3Storage) and storage.endpoint_url == s3_server.url
    storage.check()
    parent, key = storage_for(f"s3://{BUCKET}/from-env/model.nvc")
    parent.publish(key, b"bytes")
    assert storage.read_small("model.nvc", 10) == b"bytes"


# -- the engine's own files on a store ---------------------------------------------------------------

def test_save_and_load_a_file_on_the_store_bit_exact(s3_server, s3_storage, monkeypatch):
    import torch

    import nvcomp_ckpt_engine as nce
    from conftest import assert_same_tensor

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    state = {"w": torch.randn(300, 301), "h": torch.randn(4097).to(torch.bfloat16), "meta": {"step": 3}}
    nce.save(state, s3_storage.describe("model.nvc"))
    back = nce.load(s3_storage.describe("model.nvc"))
    assert back["meta"] == {"step": 3}
    for name in ("w", "h"):
        assert_same_tensor(back[name], state[name], name)


def test_a_file_cut_short_on_the_store_is_corrupt_naming_its_url(s3_server, s3_storage, monkeypatch):
    import torch

    import nvcomp_ckpt_engine as nce
    from nvcomp_ckpt_engine.errors import CorruptCheckpointError

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    url = s3_storage.describe("model.nvc")
    nce.save({"w": torch.randn(1000)}, url)
    with s3_storage.open_reader("model.nvc") as reader:
        whole = reader.read(0, reader.size)
    s3_storage.publish("model.nvc", whole[: len(whole) // 2])  # replaced by a shorter object
    with pytest.raises(CorruptCheckpointError, match=url):
        nce.load(url)


def test_a_sink_holds_a_bounded_number_of_parts(s3_server, s3_session):
    import tracemalloc

    storage = _storage(s3_server.url, f"s3://{BUCKET}/bounded", session=s3_session, max_workers=1, max_inflight=2)
    block = os.urandom(1 << 20)
    sink = storage.open_sink("shard")
    tracemalloc.start()
    try:
        for _ in range(12 * MIN_PART_SIZE // len(block)):  # 12 parts
            sink.append(block)
        sink.finish()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    bound = (storage.max_inflight + 1) * MIN_PART_SIZE
    assert peak < bound + 4 * (1 << 20), f"{peak / 2**20:.1f} MiB held for a bound of {bound / 2**20:.0f} MiB"
    assert storage.stat("shard").size == 12 * MIN_PART_SIZE
