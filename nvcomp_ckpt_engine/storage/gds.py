"""GPUDirect Storage: a local folder whose shard sinks also take GPU memory (kvikio).

`GdsStorage` is the POSIX backend (`posix.py`) with one more promise,
`capabilities.device_buffers`: its sinks write a buffer that is still in GPU memory straight to
the file (`Sink.append_device`), through kvikio's `CuFile`, so compressed payloads need not be
copied into pinned host memory by the engine first. Where the system has GPUDirect Storage
(cuFile and the nvidia-fs driver) the bytes go from the GPU to the disk by DMA; elsewhere kvikio
runs in its compatibility mode (POSIX writes from its own host bounce buffers, on its thread
pool), which the first sink of the process says in a warning. `io` names which: ``"gds"`` or
``"gds-compat"``, what the manifest records for the files written so.

A sink keeps the POSIX sink's guarantees, because it is one: `fileio.ShardFileWriter` makes the
hidden temporary file, writes the host bytes (header, index, trailer, chunks coded on the CPU),
fsyncs, renames and fsyncs the folder, or removes the temporary file on `abort`. kvikio opens
that temporary file a second time (without creating or truncating it), and the sink checks that
both handles are the same file before a byte goes through kvikio; device writes land at offsets
the writer leaves to them (`ShardFileWriter.reserve`). `finish` and `abort` first wait for every
device write in flight. Keys are checked, and a key whose folder leads out of the root is
refused, as in `PosixStorage`.

kvikio is imported on first use (the ``gds-cu12`` / ``gds-cu13`` extra), never at import time;
this module imports neither torch nor nvCOMP: a device buffer is any object kvikio accepts
(``__cuda_array_interface__``).
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any

from .. import fileio
from .base import Capabilities, Sink, StorageError
from .posix import PosixStorage

logger = logging.getLogger("nvcomp_ckpt_engine")

#: kvikio's I/O threads when the environment does not set ``KVIKIO_NTHREADS`` (kvikio's own
#: default is 1): a sink splits each payload into kvikio tasks that these threads write at once.
KVIKIO_THREADS = 8
#: Bytes of device writes a sink lets kvikio have in flight before `append_device` waits for
#: the oldest: enough for its threads to keep the disk busy, little GPU memory held.
INFLIGHT_BYTES = 256 << 20

_setup_lock = threading.Lock()
_io_mode: str | None = None


def kvikio_available() -> bool:
    """Whether kvikio can be imported here (without importing it)."""
    return importlib.util.find_spec("kvikio") is not None


def _kvikio(module: str = "kvikio") -> Any:
    """kvikio, or one of its submodules (`kvikio.defaults` is not imported by kvikio itself)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"GPUDirect Storage needs kvikio ({exc}): install the extra matching "
                          "the CUDA of this machine, nvcomp_ckpt_engine[gds-cu12] or [gds-cu13]") from exc


def io_mode() -> str:
    """``"gds"`` where kvikio writes through cuFile, ``"gds-compat"`` where it falls back to
    POSIX writes (no nvidia-fs, no cuFile library, ``KVIKIO_COMPAT_MODE=ON``). The first call
    of a process sets kvikio's threads up and says which, a warning for the fallback."""
    global _io_mode
    with _setup_lock:
        if _io_mode is None:
            defaults = _kvikio("kvikio.defaults")
            _io_mode = "gds-compat" if _compat_mode_preferred(defaults) else "gds"
            if "KVIKIO_NTHREADS" not in os.environ:
                _set_threads(defaults, KVIKIO_THREADS)
            if _io_mode == "gds-compat":
                warnings.warn("GPUDirect Storage is not available here (no cuFile/nvidia-fs, or "
                              "KVIKIO_COMPAT_MODE=ON): kvikio writes GPU payloads in its "
                              "compatibility mode, POSIX writes through host bounce buffers",
                              RuntimeWarning, stacklevel=2)
            else:
                logger.info("GPUDirect Storage: kvikio writes GPU payloads through cuFile")
        return _io_mode


def _compat_mode_preferred(defaults: Any) -> bool:
    """kvikio's own answer: `defaults.is_compat_mode_preferred()` (kvikio 25.02 and later), or
    the older `defaults.compat_mode()` (a bool, or a CompatMode whose ON is compat)."""
    if hasattr(defaults, "is_compat_mode_preferred"):
        return bool(defaults.is_compat_mode_preferred())
    mode = defaults.compat_mode()
    return mode is True or getattr(mode, "name", "") == "ON"


def _set_threads(defaults: Any, threads: int) -> None:
    if hasattr(defaults, "set"):
        defaults.set("num_threads", threads)
    else:
        defaults.num_threads_reset(threads)


class GdsStorage(PosixStorage):
    """A folder whose sinks take GPU memory (kvikio); everything else is `PosixStorage`'s."""

    capabilities = Capabilities(atomic_rename=True, local=True, device_buffers=True,
                                conditional_publish=True)

    def __init__(self, root: str | os.PathLike) -> None:
        super().__init__(root)
        self.io = io_mode()

    def __repr__(self) -> str:
        return f"GdsStorage({str(self.root)!r})"

    def open_sink(self, key: str, *, durable: bool = True, direct: bool = False) -> Sink:
        """`direct` is kvikio's to choose (it opens the file with and without ``O_DIRECT``)."""
        return GdsSink(self._path(key, resolve=False), durable=durable, io=self.io)


class GdsSink(Sink):
    """A shard file whose host bytes `ShardFileWriter` writes and whose device bytes kvikio
    writes into the same temporary file (see the module docstring)."""

    def __init__(self, path: Path, *, durable: bool, io: str) -> None:
        self.path, self.io = path, io
        self._writer = fileio.ShardFileWriter(path, durable=durable, direct=False, checksum=False)
        #: Device writes in flight: (kvikio future, the buffer it reads, bytes, file offset).
        self._pending: collections.deque[tuple[Any, object, int, int]] = collections.deque()
        self._inflight = 0
        try:
            self._file = _kvikio().CuFile(self._writer.temp_path, "r+")
            try:
                ours, theirs = os.fstat(self._writer.fileno()), os.fstat(self._file.fileno())
                if (ours.st_dev, ours.st_ino) != (theirs.st_dev, theirs.st_ino):
                    raise StorageError(f"{path}: its temporary file {self._writer.temp_path} was "
                                       "replaced before kvikio opened it; nothing was written")
            except BaseException:
                self._file.close()
                raise
        except BaseException:
            self._writer.abort()
            raise

    def append(self, data: bytes | bytearray | memoryview) -> int:
        return self._writer.append(data)

    def append_device(self, buffer: object, nbytes: int) -> int:
        offset = self._writer.reserve(nbytes)
        if nbytes:
            future = self._file.pwrite(buffer, nbytes, offset)
            self._pending.append((future, buffer, nbytes, offset))
            self._inflight += nbytes
            while self._inflight > INFLIGHT_BYTES:
                self._wait_oldest()
        return offset

    def _wait_oldest(self) -> None:
        future, _buffer, nbytes, offset = self._pending.popleft()
        self._inflight -= nbytes
        try:
            written = future.get()
        except Exception as exc:  # kvikio raises its own types; name the file and the range
            raise StorageError(f"{self.path}: kvikio could not write {nbytes} bytes at offset "
                               f"{offset} ({self.io}): {exc}") from exc
        if written != nbytes:
            raise StorageError(f"{self.path}: kvikio wrote {written} of {nbytes} bytes at offset "
                               f"{offset} ({self.io})")

    def finish(self) -> int:
        try:
            while self._pending:
                self._wait_oldest()
            self._file.close()
        except BaseException:
            self.abort()
            raise
        return self._writer.finish()

    def abort(self) -> None:
        """Wait for the device writes in flight (kvikio's threads still read their buffers and
        write the file), then close both handles and remove the temporary file."""
        while self._pending:
            try:
                self._wait_oldest()
            except Exception:  # the file is dropped anyway; the first error was raised already
                pass
        try:
            if not self._file.closed:
                self._file.close()
        finally:
            self._writer.abort()


__all__ = ["GdsSink", "GdsStorage", "INFLIGHT_BYTES", "KVIKIO_THREADS", "io_mode", "kvikio_available"]
