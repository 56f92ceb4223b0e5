"""Where loaded storages go, by torch.load's `map_location` rules, and the tensors rebuilt as
views of them.

A device is used only if this process can allocate on it; otherwise the error says how to load
elsewhere, rather than leaving torch's own error.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..container import DTYPES, TensorEntry
from ..errors import CorruptCheckpointError, UnsupportedCheckpointError

#: What `map_location` may be, as for torch.load: None, a str, a torch.device, a dict of
#: location strings, or a callable (storage, location) -> storage or None.
MapLocation = Any


def destination(location: str, map_location: MapLocation) -> torch.device | None:
    """Where a storage saved on `location` goes, as torch.load would put it (None: a callable
    map_location decides after decoding)."""
    if map_location is None:
        return _restorable(location)
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        return _restorable(map_location.get(location, location))
    if callable(map_location):
        return None
    raise TypeError(f"map_location must be None, a str, a torch.device, a dict or a callable, "
                    f"not {type(map_location).__name__}")


def _restorable(where: str | torch.device) -> torch.device:
    """The device `where` names if this process can allocate on it (a device the file names, or
    that a dict map_location maps it to); `UnsupportedCheckpointError` naming the way out
    otherwise."""
    try:
        device = torch.device(where)
    except RuntimeError as exc:  # a device type this torch does not know (npu without plugin)
        raise UnsupportedCheckpointError(
            f"the file holds tensors saved on {where!r}, a device this torch does not know "
            f"({exc}); load with map_location='cpu' (or another device)") from exc
    if device.type not in ("cpu", "cuda"):
        # xpu, mps, ...: torch's module for the type says; hpu and npu exist only with their
        # plugins (which add the module).
        available = getattr(getattr(torch, device.type, None), "is_available", None)
        if not callable(available) or not available():
            raise UnsupportedCheckpointError(
                f"the file holds tensors saved on {device}, and this process has no "
                f"{device.type} device; load with map_location='cpu' (or another device)"
            )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedCheckpointError(
                f"the file holds tensors saved on {device}, but CUDA is not available here; "
                "load with map_location='cpu' (or torch.device('cpu'))"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UnsupportedCheckpointError(
                f"the file holds tensors saved on {device}, but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s); pass map_location")
    return device


def apply_callable(map_location: Callable[..., Any], buf: torch.Tensor, location: str,
                    path: str) -> torch.Tensor:
    result = map_location(buf.untyped_storage(), location)
    if result is None:
        try:
            return buf.to(_restorable(location))
        except UnsupportedCheckpointError as exc:
            raise UnsupportedCheckpointError(f"{path}: {exc}") from exc
    return torch.empty(0, dtype=torch.uint8, device=result.device).set_(result)


def view_tensor(buf: torch.Tensor, entry: TensorEntry, path: str) -> torch.Tensor:
    """The tensor `entry` describes, as a view of `buf` (its decoded storage, or the part of it
    that starts at the tensor's first element when `entry.offset` is 0). The index was
    validated; whatever torch still refuses is named as a fault of the file `path`, not left as
    torch's error."""
    try:
        t = torch.empty(0, dtype=DTYPES[entry.dtype], device=buf.device)
        t.set_(buf.untyped_storage(), entry.offset, entry.shape, entry.stride)
        if entry.parameter:
            return torch.nn.Parameter(t, requires_grad=entry.requires_grad)
        return t.requires_grad_(entry.requires_grad) if entry.requires_grad else t
    except RuntimeError as exc:
        raise CorruptCheckpointError(f"{path}: tensor {entry.key!r} cannot be rebuilt as the "
                                     f"index describes it: {exc}") from exc
