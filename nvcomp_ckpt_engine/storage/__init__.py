"""Where checkpoint bytes live: one interface (`base.py`) and the backends behind it."""

from .base import Capabilities, ObjectInfo, PreconditionFailed, Reader, Sink, Storage, StorageError, check_key, join

__all__ = ["Capabilities", "ObjectInfo", "PreconditionFailed", "Reader", "Sink", "Storage", "StorageError",
           "check_key", "join"]
