"""Checkpoints in an S3-compatible object store: ``s3://bucket/prefix`` behind the `Storage` interface.

How the interface maps onto the S3 API:

- a sink is a multipart upload: parts of `part_size` bytes are uploaded from a small thread pool
  while the caller appends the next ones (at most `max_inflight` parts held in memory at once),
  `finish` is CompleteMultipartUpload and `abort` AbortMultipartUpload. An object smaller than
  one part is sent as one PUT at `finish`. Nothing is visible under the key before `finish`;
  an upload left by a killed writer is invisible too, and `delete_prefix` aborts it.
- a reader is ranged GETs, each with ``If-Match`` on the ETag seen when the reader was opened,
  so an object replaced while it is being read is reported, not mixed.
- `publish` is a PUT (an object store replaces an object in one step); with ``if_absent`` the
  PUT carries ``If-None-Match: *`` where the server enforces it (`conditional_put`), so two
  writers cannot both commit one tag.
- `list` is ListObjectsV2 with ``Delimiter='/'``; `delete_prefix` is batched DeleteObjects plus
  AbortMultipartUpload for the incomplete uploads under the prefix.

There is no rename and no fsync: a checkpoint becomes complete when its manifest is published,
last, which is the engine's commit rule anyway (docs/STORAGE.md).

Client: boto3 (docs/STORAGE.md, "Choosing the client", says why). Endpoint, region and
credentials come from the standard AWS variables and config files (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``~/.aws/config``, ...), and `endpoint_url`, `region` and
`profile` override them. Throttling (HTTP 503 SlowDown) and transient network errors are
retried here with exponential backoff and jitter (`RetryPolicy`), then reported naming the URL.
This module imports neither torch nor nvCOMP; boto3 is imported when a storage is made.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import errno
import functools
import os
import random
import re
import time
from typing import Any, Callable, Iterator, TypeVar

from .base import (Capabilities, ObjectInfo, PreconditionFailed, Reader, ShortReadError, Sink, Storage, StorageError,
                   TooLargeError, check_key, join)

MiB = 1 << 20
#: S3's floor on every part but the last, and its cap on the number of parts of one upload.
MIN_PART_SIZE = 5 * MiB
MAX_PARTS = 10_000
#: Parts uploaded at one size before the size doubles, so that 10,000 parts reach past 1 TB
#: with 16 MiB parts (2,000 × 16 MiB × (1 + 2 + 4 + 8 + 16)) while small shards keep small parts.
PARTS_PER_SIZE = 2_000
#: DeleteObjects takes at most this many keys per request.
DELETE_BATCH = 1000

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
#: Error codes that mean "try again later" whatever the HTTP status says.
_RETRYABLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                              "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable",
                              "RequestLimitExceeded", "TooManyRequests"})
_CREDENTIAL_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                               "ExpiredToken", "InvalidToken", "AllAccessDisabled", "403"})
_T = TypeVar("_T")


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` → (bucket, prefix); ValueError naming the URL for anything else,
    including a prefix with an empty, '.' or '..' segment."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ValueError(f"{url!r} is not an s3://bucket/prefix URL")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ValueError(f"{url!r}: {bucket!r} is not a valid S3 bucket name "
                         "(3-63 characters: lower-case letters, digits, '.', '-')")
    prefix = prefix.rstrip("/")
    if prefix:
        try:
            check_key(prefix)
        except ValueError as exc:
            raise ValueError(f"{url!r}: the prefix is not a plain '/'-separated path ({exc})") from None
    return bucket, prefix


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a request that was throttled (HTTP 503 SlowDown, 500s) or
    lost on the network is tried again: up to `attempts` tries in all, waiting a random time up
    to ``min(cap_s, base_s * 2**n)`` before try n + 1 ("full jitter", so that many ranks
    throttled at once do not retry in step)."""

    attempts: int = 8
    base_s: float = 0.25
    cap_s: float = 20.0

    def delay(self, retry: int) -> float:
        return random.uniform(0, min(self.cap_s, self.base_s * 2 ** retry))


class S3Storage(Storage):
    """A bucket and prefix of an S3-compatible object store (``s3://bucket/prefix``).

    `endpoint_url`: an S3-compatible server (MinIO, Ceph, a local test server), else what the
    AWS configuration says (``AWS_ENDPOINT_URL``) or AWS itself. `region`, `profile`: as in the
    AWS configuration. `conditional_put`: the server enforces ``If-None-Match: *`` on PUT (AWS S3
    since 2024 and moto do; docs/STORAGE.md); say False for one that ignores it, and
    `publish(if_absent=True)` falls back to a check before the PUT, which two writers can both
    pass. None (the default) takes it from ``NVCOMP_S3_CONDITIONAL_PUT`` (``0`` or ``1``; unset:
    True), the one way to say it for storages the engine makes from a URL. `part_size`: bytes per multipart part (at least 5 MiB). `max_workers`: parts uploaded
    at once per sink; `max_inflight`: parts a sink holds in memory, uploading or waiting (its
    memory is at most ``(max_inflight + 1) × part_size``, with the part being filled).
    `session`: a boto3 Session to make the client from (its credentials provider, resolved once)
    instead of a new one. Thread-safe: boto3 clients are.
    """

    def __init__(self, url: str, *, endpoint_url: str | None = None, region: str | None = None,
                 profile: str | None = None, conditional_put: bool | None = None, part_size: int = 16 * MiB,
                 max_workers: int = 4, max_inflight: int = 6, retry: RetryPolicy = RetryPolicy(),
                 connect_timeout_s: float = 10.0, read_timeout_s: float = 60.0, session: Any = None) -> None:
        import boto3
        import botocore.session
        from botocore.config import Config

        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"{self.url}: part_size {part_size} is below S3's minimum part of {MIN_PART_SIZE} bytes")
        if max_workers < 1 or max_inflight < max_workers:
            raise ValueError(f"{self.url}: need 1 <= max_workers <= max_inflight, got {max_workers}, {max_inflight}")
        self.part_size, self.max_workers, self.max_inflight = part_size, max_workers, max_inflight
        self.retry = retry
        if conditional_put is None:
            conditional_put = _conditional_put_from_environment()
        self.capabilities = Capabilities(atomic_rename=False, local=False, device_buffers=False,
                                         conditional_publish=conditional_put)
        if session is None:
            botocore_session = botocore.session.get_session()
            botocore_session.register_component("data_loader", _service_models())
            session = boto3.session.Session(profile_name=profile, botocore_session=botocore_session)
        elif profile is not None:
            raise ValueError(f"{url}: give a profile or a session, not both")
        # Retries are ours (RetryPolicy): botocore's would multiply with them and hide the count.
        # No SDK checksum of each part unless the server requires one: it cost 0.7-1.1 s of CPU
        # per GB (docs/STORAGE.md), and adds nothing to what already holds the bytes: TLS (or,
        # over plain HTTP, the SHA-256 of the payload that SigV4 signs) in transit, the shard's
        # own CRC-32s end to end.
        config = Config(retries={"total_max_attempts": 1}, max_pool_connections=max(16, 2 * max_workers + 4),
                        connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                        request_checksum_calculation="when_required", response_checksum_validation="when_required")
        self._client = session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
        self.endpoint_url = self._client.meta.endpoint_url

    # -- keys and errors -----------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return join(self.prefix, check_key(key))

    def _folder(self, prefix: str) -> str:
        """The S3 prefix of everything under `prefix` ('' is the root), ending in '/' unless empty."""
        full = join(self.prefix, check_key(prefix)) if prefix else self.prefix
        return full + "/" if full else ""

    def _relative(self, full: str) -> str:
        return full[len(self.prefix) + 1:] if self.prefix else full

    def _error(self, exc: Exception, key: str, action: str, tries: int) -> Exception:
        """`exc` from the client as the exception a caller acts on, naming the URL of `key`."""
        from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

        where = self.describe(key)
        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            detail = f"{code or 'HTTP ' + str(status)}: {error.get('Message') or 'no message'}"
            if code == "NoSuchBucket":
                return StorageError(f"{where}: the bucket {self.bucket!r} does not exist at {self.endpoint_url}")
            if code in ("NoSuchKey", "NotFound", "404") or status == 404:
                return FileNotFoundError(errno.ENOENT, f"{where}: no such object", where)
            if code in ("PreconditionFailed", "412") or status == 412:
                return PreconditionFailed(f"{where}: {action} refused, a precondition failed ({detail})")
            if code in _CREDENTIAL_CODES or status == 403:
                return StorageError(f"{where}: {self.endpoint_url} refused the credentials ({detail}); check "
                                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials")
            if _retryable(exc):
                return StorageError(f"{where}: {action} still throttled or failing after {tries} "
                                    f"tries with backoff ({detail}, HTTP {status})")
            return StorageError(f"{where}: {action} failed ({detail}, HTTP {status})")
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return StorageError(f"{where}: no usable AWS credentials ({exc}); set AWS_ACCESS_KEY_ID and "
                                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
        if _retryable(exc):
            return StorageError(f"{where}: cannot reach {self.endpoint_url} for {action} after "
                                f"{tries} tries ({exc})")
        return exc

    def _call(self, fn: Callable[[], _T], key: str, action: str, *, attempts: int | None = None) -> _T:
        """`fn()`, tried again on throttling and network errors, then raised as `_error` says."""
        tries = attempts or self.retry.attempts
        retry = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                if retry + 1 < tries and _retryable(exc):
                    time.sleep(self.retry.delay(retry))
                    retry += 1
                    continue
                mapped = self._error(exc, key, action, retry + 1)
                if mapped is exc:
                    raise
                raise mapped from exc

    # -- the interface -------------------------------------------------------------------------

    def check(self) -> None:
        """Reach the endpoint, and list the prefix with these credentials: raise StorageError
        naming the URL if the endpoint is unreachable, the credentials are refused or the bucket
        is missing, before any training time is spent."""
        self._call(lambda: self._client.list_objects_v2(Bucket=self.bucket, Prefix=self._folder(""), MaxKeys=1),
                   "", "listing the bucket", attempts=min(3, self.retry.attempts))

    def open_sink(self, key: str, *, durable: bool = True, direct: bool = False) -> Sink:
        # Every finished object is durable on a store; `direct` means nothing here.
        return _MultipartSink(self, check_key(key))

    def open_reader(self, key: str) -> Reader:
        info = self.stat(key)
        if info.is_prefix:
            raise StorageError(f"{self.describe(key)}: a prefix (folder), not an object")
        return _RangedReader(self, key, info)

    def read_small(self, key: str, limit: int, *, what: str = "this object") -> bytes:
        info = self.stat(key)
        where = self.describe(key)
        if info.is_prefix:
            raise ValueError(f"{where}: a prefix (folder), not an object")
        if info.size > limit:
            raise TooLargeError(f"{where}: {info.size} bytes, more than the {limit} {what} may have; "
                                "refused unread", size=info.size, limit=limit)
        if info.size == 0:
            return b""
        # At most limit + 1 bytes are asked for, so a replacement that grew cannot make us read more.
        data = self._call(lambda: self._client.get_object(Bucket=self.bucket, Key=self._key(key),
                                                          Range=f"bytes=0-{limit}")["Body"].read(),
                          key, "reading")
        if len(data) > limit:
            raise TooLargeError(f"{where}: grew past the {limit} bytes {what} may have while it was read",
                                size=len(data), limit=limit)
        return data

    def publish(self, key: str, data: bytes, *, durable: bool = True, if_absent: bool = False) -> None:
        full = self._key(key)
        if if_absent and not self.capabilities.conditional_publish and self.exists(key):
            raise PreconditionFailed(f"{self.describe(key)}: already exists (checked before the PUT: this "
                                     "server does not enforce conditional puts)")
        extra = {"IfNoneMatch": "*"} if if_absent and self.capabilities.conditional_publish else {}
        tried = []

        def put() -> None:
            tried.append(1)
            self._client.put_object(Bucket=self.bucket, Key=full, Body=bytes(data), **extra)

        try:
            self._call(put, key, "a conditional put" if extra else "a put")
        except PreconditionFailed:
            # A retried conditional PUT whose first try did land (its answer lost) finds its own
            # object: that is our commit, not another writer's.
            if len(tried) > 1 and self._same_object(key, data):
                return
            raise PreconditionFailed(f"{self.describe(key)}: already exists, written by another writer "
                                     "(the conditional put was refused)") from None

    def _same_object(self, key: str, data: bytes) -> bool:
        try:
            return self.read_small(key, len(data)) == bytes(data)
        except (FileNotFoundError, ValueError):
            return False

    def stat(self, key: str) -> ObjectInfo:
        full = self._key(key)
        try:
            head = self._call(lambda: self._client.head_object(Bucket=self.bucket, Key=full), key, "a HEAD")
        except FileNotFoundError:
            listed = self._call(lambda: self._client.list_objects_v2(Bucket=self.bucket, Prefix=full + "/", MaxKeys=1),
                                key, "listing")
            if listed.get("KeyCount", 0):
                return ObjectInfo(key=key, size=0, mtime=0.0, is_prefix=True)
            raise
        return ObjectInfo(key=key, size=int(head["ContentLength"]), mtime=head["LastModified"].timestamp(),
                          etag=head.get("ETag"))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        folder = self._folder(prefix)
        token: dict[str, Any] = {}
        while True:
            page = self._call(lambda: self._client.list_objects_v2(Bucket=self.bucket, Prefix=folder, Delimiter="/",
                                                                   **token), prefix, "listing")
            for common in page.get("CommonPrefixes", []):
                yield ObjectInfo(key=self._relative(common["Prefix"].rstrip("/")), size=0, mtime=0.0, is_prefix=True)
            for obj in page.get("Contents", []):
                if obj["Key"] != folder:  # a zero-byte "folder marker" some tools create
                    yield ObjectInfo(key=self._relative(obj["Key"]), size=int(obj["Size"]),
                                     mtime=obj["LastModified"].timestamp(), etag=obj.get("ETag"))
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def delete(self, key: str) -> None:
        full = self._key(key)
        self._call(lambda: self._client.delete_object(Bucket=self.bucket, Key=full), key, "deleting")

    def _is_object(self, key: str) -> bool:
        """Whether `key` names an object (a HEAD)."""
        try:
            self._call(lambda: self._client.head_object(Bucket=self.bucket, Key=self._key(key)), key, "a HEAD")
        except FileNotFoundError:
            return False
        return True

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under `prefix` (in batches of 1000) and abort the multipart uploads
        left under it by writers that never finished (they cost storage until aborted).
        NotADirectoryError, as on POSIX, when `prefix` holds nothing but is an object itself:
        a caller that meant a folder is told, and nothing is deleted."""
        check_key(prefix)
        folder = self._folder(prefix)
        token: dict[str, Any] = {}
        listed_any = False
        while True:
            page = self._call(lambda: self._client.list_objects_v2(Bucket=self.bucket, Prefix=folder, **token),
                              prefix, "listing")
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            listed_any = listed_any or bool(keys)
            for start in range(0, len(keys), DELETE_BATCH):
                batch = keys[start:start + DELETE_BATCH]
                done = self._call(lambda: self._client.delete_objects(Bucket=self.bucket,
                                                                      Delete={"Objects": batch, "Quiet": True}),
                                  prefix, "deleting")
                if done.get("Errors"):
                    first = done["Errors"][0]
                    raise StorageError(f"{self.describe(prefix)}: {len(done['Errors'])} objects not deleted, first "
                                       f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}")
            if not page.get("IsTruncated"):
                break
            token = {"ContinuationToken": page["NextContinuationToken"]}
        if not listed_any and self._is_object(prefix):
            raise NotADirectoryError(f"{self.describe(prefix)}: an object, not a prefix")
        for key, upload_id in self._incomplete_uploads(folder, prefix):
            self._abort_upload(key, upload_id, prefix)

    # -- multipart uploads ---------------------------------------------------------------------

    def _incomplete_uploads(self, folder: str, prefix: str) -> Iterator[tuple[str, str]]:
        marker: dict[str, str] = {}
        while True:
            page = self._call(lambda: self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=folder, **marker),
                              prefix, "listing incomplete uploads")
            for upload in page.get("Uploads", []):
                yield upload["Key"], upload["UploadId"]
            if not page.get("IsTruncated"):
                return
            marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def _abort_upload(self, full: str, upload_id: str, key: str) -> None:
        try:
            self._call(lambda: self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id),
                       key, "aborting an upload")
        except FileNotFoundError:
            pass  # NoSuchUpload: finished or aborted meanwhile


#: The environment variable that says whether the server enforces conditional puts.
CONDITIONAL_PUT_VARIABLE = "NVCOMP_S3_CONDITIONAL_PUT"


def _conditional_put_from_environment() -> bool:
    value = os.environ.get(CONDITIONAL_PUT_VARIABLE, "1").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{CONDITIONAL_PUT_VARIABLE}={value!r}: say 1 (the server enforces If-None-Match) or 0")


@functools.lru_cache(maxsize=1)
def _service_models() -> Any:
    """botocore's loader of the S3 API description, shared by every storage of the process.

    Storages are made per location (`storage_for`: a file saved, a manifest read), and a fresh
    boto3 session parses its JSON service models again: about 0.2 s, against 0.02 s with the
    models already loaded. They are immutable data; credentials, endpoint and region are still
    resolved afresh by each storage's own session."""
    import botocore.loaders

    return botocore.loaders.create_loader()


def _retryable(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return exc.response.get("Error", {}).get("Code") in _RETRYABLE_CODES or status in (429, 500, 502, 503, 504)
    return isinstance(exc, (BotoConnectionError, HTTPClientError, IncompleteReadError))


class _MultipartSink(Sink):
    """Appended bytes gathered into parts; each full part uploaded from a small pool while the
    next fills. The upload is created with the first full part, so an object smaller than a part
    is one PUT at `finish` and an aborted small sink never touched the store."""

    def __init__(self, storage: S3Storage, key: str) -> None:
        self._storage, self.key = storage, key
        self._full = storage._key(key)
        # The part being filled: allocated at its full size, handed to the pool as it is once full
        # (boto3 takes a bytearray), so each byte is copied once, from the caller's buffer.
        self._part = bytearray(storage.part_size)
        self._filled = 0
        self._size = 0
        self._upload_id: str | None = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pending: collections.deque[cf.Future] = collections.deque()
        self._parts: list[dict[str, Any]] = []
        self._closed = False

    def _part_size(self) -> int:
        number = len(self._parts) + len(self._pending)
        return self._storage.part_size << min(number // PARTS_PER_SIZE, 4)

    def append(self, data: bytes | bytearray | memoryview) -> int:
        if self._closed:
            raise StorageError(f"{self._storage.describe(self.key)}: append after finish or abort")
        offset = self._size
        view = memoryview(data).cast("B")
        self._size += len(view)
        try:
            while len(view):
                n = min(len(self._part) - self._filled, len(view))
                self._part[self._filled:self._filled + n] = view[:n]
                self._filled += n
                view = view[n:]
                if self._filled == len(self._part):
                    self._send(self._part)
                    self._part, self._filled = bytearray(self._part_size()), 0
        except BaseException:
            self.abort()
            raise
        return offset

    def _send(self, part: bytearray) -> None:
        """Queue `part` for upload, first waiting for the oldest parts while too many are held."""
        storage = self._storage
        if self._upload_id is None:
            self._upload_id = storage._call(
                lambda: storage._client.create_multipart_upload(Bucket=storage.bucket, Key=self._full)["UploadId"],
                self.key, "starting a multipart upload")
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(storage.max_workers, thread_name_prefix="s3-part")
        while len(self._pending) >= storage.max_inflight:
            self._parts.append(self._pending.popleft().result())
        if len(self._parts) + len(self._pending) >= MAX_PARTS:
            raise StorageError(f"{storage.describe(self.key)}: more than {MAX_PARTS} parts; raise part_size")
        number = len(self._parts) + len(self._pending) + 1
        self._pending.append(self._pool.submit(self._upload_part, number, part))

    def _upload_part(self, number: int, part: bytearray) -> dict[str, Any]:
        storage = self._storage
        answer = storage._call(lambda: storage._client.upload_part(Bucket=storage.bucket, Key=self._full,
                                                                   UploadId=self._upload_id, PartNumber=number,
                                                                   Body=part),
                               self.key, f"uploading part {number}")
        return {"PartNumber": number, "ETag": answer["ETag"]}

    def _tail(self) -> bytearray:
        """The part being filled, cut to what it holds (in place: no copy)."""
        part, self._part = self._part, bytearray()
        del part[self._filled:]
        self._filled = 0
        return part

    def finish(self) -> int:
        if self._closed:
            raise StorageError(f"{self._storage.describe(self.key)}: finish after finish or abort")
        storage = self._storage
        try:
            if self._upload_id is None:
                body = self._tail()
                storage._call(lambda: storage._client.put_object(Bucket=storage.bucket, Key=self._full, Body=body),
                              self.key, "a put")
            else:
                if self._filled:
                    self._send(self._tail())
                while self._pending:
                    self._parts.append(self._pending.popleft().result())
                parts = {"Parts": self._parts}
                storage._call(lambda: storage._client.complete_multipart_upload(
                    Bucket=storage.bucket, Key=self._full, UploadId=self._upload_id, MultipartUpload=parts),
                    self.key, "completing the multipart upload")
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._shutdown()
        return self._size

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        for future in self._pending:
            future.cancel()
        self._shutdown()
        self._part, self._filled = bytearray(), 0
        if self._upload_id is not None:
            self._storage._abort_upload(self._full, self._upload_id, self.key)

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()


class _RangedReader(Reader):
    """Ranged GETs of one object, each conditional on the ETag it had when opened: an object
    replaced meanwhile (another save of the same tag) raises StorageError instead of mixing
    bytes of two objects. Thread-safe: each read is its own request."""

    def __init__(self, storage: S3Storage, key: str, info: ObjectInfo) -> None:
        self._storage, self.key, self.size, self.etag = storage, key, info.size, info.etag
        self._full = storage._key(key)

    def read_into(self, offset: int, buffer: memoryview) -> None:
        length = len(buffer)
        storage = self._storage
        where = storage.describe(self.key)
        if offset < 0:
            raise ValueError(f"{where}: negative offset {offset}")
        if offset + length > self.size:
            raise ShortReadError(f"{where}: ends at byte {self.size}, before byte {offset + length} "
                                 f"(bytes [{offset}, {offset + length}) were asked for)", end=self.size)
        if length == 0:
            return
        condition = {"IfMatch": self.etag} if self.etag else {}

        def get() -> bytes:
            return storage._client.get_object(Bucket=storage.bucket, Key=self._full,
                                              Range=f"bytes={offset}-{offset + length - 1}", **condition)["Body"].read()

        try:
            data = storage._call(get, self.key, "a ranged read")
        except PreconditionFailed:
            raise StorageError(f"{where}: the object changed while it was being read (its ETag is no longer "
                               f"{self.etag})") from None
        if len(data) != length:
            raise StorageError(f"{where}: {len(data)} bytes came back for [{offset}, {offset + length})")
        buffer.cast("B")[:] = data

    def close(self) -> None:
        """Nothing to release: every read is its own request."""
