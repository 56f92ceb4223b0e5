"""A nested state dict ⇄ a skeleton (everything but the tensors) plus a list of tensors.

The skeleton is a pickle in which every tensor is replaced by a persistent reference, so the
tensors travel through the codecs and the skeleton stays small. Loading a pickle can run any
code the file names, so the skeleton is read by `RestrictedUnpickler`, which resolves only the
classes on an allowlist: the containers and scalars of Python, torch's dtype/device/Size, NumPy
arrays (random-number states), and the non-tensor objects real DeepSpeed checkpoints hold (loss
scalers, fragment addresses, enums). Users extend the list with `add_safe_classes`, or pass
``trusted=True`` for files they trust.
"""

from __future__ import annotations

import enum
import importlib
import io
import pickle
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from .errors import UnsafeObjectError

#: Classes and functions a skeleton may name without ``trusted=True`` ("module.qualname").
DEFAULT_SAFE_GLOBALS: frozenset[str] = frozenset(
    {
        # Python containers and scalars that pickle through a global.
        "builtins.set", "builtins.frozenset", "builtins.complex", "builtins.slice",
        "builtins.range", "builtins.bytearray", "collections.OrderedDict",
        "collections.defaultdict", "collections.deque", "builtins.list", "builtins.dict",
        "builtins.tuple", "builtins.int", "builtins.float", "builtins.str", "builtins.bool",
        "argparse.Namespace", "datetime.datetime", "datetime.timedelta", "datetime.date",
        "pathlib.PosixPath", "pathlib.PurePosixPath",
        # torch metadata objects (tensors themselves never go through the pickle).
        "torch.Size", "torch.device", "torch.dtype", "torch.layout", "torch.memory_format",
        "torch.strided", "torch.contiguous_format", "torch.channels_last", "torch.preserve_format",
        *(f"torch.{name}" for name in (
            "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
            "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
            "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "half",
            "float", "double", "long", "int", "short", "cfloat", "cdouble",
        )),
        # NumPy arrays and scalars (NumPy 1 and 2 module paths): RNG states in client state.
        "numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct", "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
        *(f"numpy.dtypes.{name}DType" for name in (
            "Bool", "Int8", "UInt8", "Int16", "UInt16", "Int32", "UInt32", "Int64", "UInt64",
            "Float16", "Float32", "Float64", "Complex64", "Complex128", "Object", "Str", "Bytes",
        )),
        # DeepSpeed's non-tensor checkpoint objects (0.19.x).
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus",
        "deepspeed.checkpoint.constants.ZeroStageEnum",
    }
)

_extra_safe: set[str] = set()
_extra_lock = threading.Lock()


def _qualified_name(obj: type | Callable[..., Any] | str) -> str:
    if isinstance(obj, str):
        if "." not in obj:
            raise ValueError(f"{obj!r} is not a 'module.QualName' string")
        return obj
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname:
        raise TypeError(f"{obj!r} is neither a class, a function nor a 'module.QualName' string")
    return f"{module}.{qualname}"


def add_safe_classes(*classes: type | Callable[..., Any] | str) -> None:
    """Allow skeletons to name these classes (or "module.QualName" strings) in every load.

    Example: ``nvcomp_ckpt_engine.add_safe_classes(argparse.Namespace)``. Each allowed class can
    be instantiated by a file with arguments of the file's choosing, so allow only plain data
    classes.
    """
    names = [_qualified_name(c) for c in classes]
    with _extra_lock:
        _extra_safe.update(names)


def safe_globals(extra: Iterable[type | Callable[..., Any] | str] = ()) -> frozenset[str]:
    """The allowlist in force: defaults, `add_safe_classes` entries and `extra`."""
    with _extra_lock:
        return DEFAULT_SAFE_GLOBALS | _extra_safe | {_qualified_name(c) for c in extra}


@dataclass(frozen=True)
class Flattened:
    """A state split for storage: the skeleton pickle and the tensors it refers to, in order."""

    skeleton: bytes
    tensors: list[torch.Tensor]
    keys: list[str]


def tensor_keys(obj: Any) -> dict[str, torch.Tensor]:
    """The tensors inside plain containers of `obj`, by the key path `flatten` records for them
    (a file's `TensorEntry.key`): what another file may name to refer to one."""
    return {path: tensor for path, tensor in _key_paths(obj).values()}


def _key_paths(obj: Any) -> dict[int, tuple[str, torch.Tensor]]:
    """Readable key paths ("optimizer/state/0/exp_avg") of tensors inside plain containers,
    by tensor id (the first path found, for a tensor reachable by several)."""
    paths: dict[int, tuple[str, torch.Tensor]] = {}
    stack: list[tuple[Any, str]] = [(obj, "")]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if isinstance(node, torch.Tensor):
            paths.setdefault(id(node), (path or "<root>", node))
            continue
        if id(node) in seen:
            continue
        if isinstance(node, dict):
            seen.add(id(node))
            stack.extend((v, f"{path}/{k}" if path else str(k)) for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            seen.add(id(node))
            stack.extend((v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(node))
    return paths


def flatten(obj: Any) -> Flattened:
    """Split `obj` into a skeleton and its tensors (each distinct tensor object once)."""
    paths = _key_paths(obj)
    tensors: list[torch.Tensor] = []
    keys: list[str] = []
    index_of: dict[int, int] = {}

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, torch.Tensor):
                if id(o) not in index_of:
                    index_of[id(o)] = len(tensors)
                    tensors.append(o)
                    keys.append(paths[id(o)][0] if id(o) in paths
                                else f"<tensor {len(keys)} inside {type(o).__name__}>")
                return ("tensor", index_of[id(o)])
            if isinstance(o, (torch.UntypedStorage, torch.TypedStorage)):
                raise TypeError(
                    "nvcomp_ckpt_engine.save stores tensors, not bare storages; wrap the storage "
                    "in a tensor (torch.tensor([], dtype=torch.uint8).set_(storage))"
                )
            return None

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=4).dump(obj)
    return Flattened(buffer.getvalue(), tensors, keys)


def _enum_member(cls: Any, name: Any) -> Any:
    """`getattr` restricted to members of an enum class (the class itself was allowlisted)."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) \
            and name in cls.__members__:
        return cls.__members__[name]
    raise UnsafeObjectError(
        f"the file's skeleton calls getattr({cls!r}, {name!r}); only enum members may be "
        "looked up by name. Load with trusted=True if you trust this file."
    )


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles a skeleton, resolving only allowlisted globals and our tensor references."""

    def __init__(
        self,
        data: bytes,
        tensors: list[Any],
        *,
        allowed: frozenset[str] | None,
        source: str,
    ) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors
        self._allowed = allowed
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified == "builtins.getattr" and self._allowed is not None:
            # Some Pythons pickle an enum member as getattr(EnumClass, "NAME"); allow exactly
            # that shape, for allowlisted enum classes, and nothing else getattr could reach.
            return _enum_member
        if self._allowed is not None and qualified not in self._allowed:
            raise UnsafeObjectError(
                f"{self._source}: the file's skeleton names {qualified!r}, which is not on the "
                "allowlist of classes a checkpoint may create. If you trust this file, load it "
                f"with trusted=True; or allow the class with "
                f"nvcomp_ckpt_engine.add_safe_classes({qualified!r})."
            )
        if self._allowed is None:
            return super().find_class(module, name)
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj

    def persistent_load(self, pid: Any) -> Any:
        if (
            not isinstance(pid, tuple)
            or len(pid) != 2
            or pid[0] != "tensor"
            or not isinstance(pid[1], int)
            or not 0 <= pid[1] < len(self._tensors)
        ):
            raise pickle.UnpicklingError(f"{self._source}: invalid tensor reference {pid!r}")
        return self._tensors[pid[1]]


def unflatten(
    skeleton: bytes,
    tensors: list[Any],
    *,
    trusted: bool = False,
    safe_classes: Iterable[type | Callable[..., Any] | str] = (),
    source: str = "<shard>",
) -> Any:
    """Rebuild the object from its skeleton; see `RestrictedUnpickler` for what is allowed."""
    allowed = None if trusted else safe_globals(safe_classes)
    return RestrictedUnpickler(skeleton, tensors, allowed=allowed, source=source).load()
