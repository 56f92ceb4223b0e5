"""A nested state dict ⇄ a skeleton (everything but the tensors) plus a list of tensors.

The skeleton is a pickle in which every tensor is replaced by a persistent reference, so the
tensors travel through the codecs and the skeleton stays small. Loading a pickle can run any
code the file names, so the skeleton is read by `RestrictedUnpickler`, which resolves only the
classes on an allowlist: the containers and scalars of Python, torch's dtype/device/Size, NumPy
arrays (random-number states), and what framework adapters register for the non-tensor objects
their checkpoints hold (`register_safe_globals`: the DeepSpeed adapter's loss scalers, fragment
addresses, enums), so this module names no framework. It also sets state only on objects the
load itself created, keeps what the file builds within `MAX_EXPANSION` times its size and its
nesting within `MAX_NESTING` levels, and lets a tensor reference set only attributes that
`torch.Tensor` does not define. Users extend the list with `add_safe_classes`, or pass
``trusted=True`` for files they trust.
"""

from __future__ import annotations

import collections
import enum
import functools
import importlib
import io
import itertools
import math
import pickle
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from .errors import CheckpointError, CorruptCheckpointError, UnsafeObjectError
from .formats import MAX_EXPANSION

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
    }
)

_extra_safe: set[str] = set()
#: What adapters registered (`register_safe_globals`), kept apart from users' `add_safe_classes`.
_registered_safe: set[str] = set()
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


def register_safe_globals(names: Iterable[str]) -> None:
    """Allow, in every load, the "module.QualName" globals a framework adapter vouches for.

    Adapters call this when they are imported, with plain names, so the objects of their
    framework's checkpoints load without this module knowing the framework, and without the
    framework itself being imported to name them.
    """
    checked = [_qualified_name(name) for name in names]
    with _extra_lock:
        _registered_safe.update(checked)


def safe_globals(extra: Iterable[type | Callable[..., Any] | str] = ()) -> frozenset[str]:
    """The allowlist in force: defaults, adapters' registrations, `add_safe_classes` entries
    and `extra`."""
    with _extra_lock:
        return (DEFAULT_SAFE_GLOBALS | _registered_safe | _extra_safe
                | {_qualified_name(c) for c in extra})


@dataclass(frozen=True)
class Flattened:
    """A state split for storage: the skeleton pickle and the tensors it refers to, in order."""

    skeleton: bytes
    tensors: list[torch.Tensor]
    keys: list[str]
    #: Whether a tensor reference carries Python attributes (format version 3: `version_for`).
    tensor_attributes: bool = False


def tensor_keys(obj: Any) -> dict[str, torch.Tensor]:
    """The tensors inside plain containers of `obj`, by the key path `flatten` records for them
    (a file's `TensorEntry.key`): what another file may name to refer to one."""
    return {path: tensor for path, tensor in _key_paths(obj, torch.Tensor).values()}


def _key_paths(obj: Any, leaf: type | tuple[type, ...]) -> dict[int, tuple[str, Any]]:
    """Readable key paths ("optimizer/state/0/exp_avg") of `leaf` objects (tensors) inside
    plain containers, by object id (the first path found, for one reachable by several)."""
    paths: dict[int, tuple[str, Any]] = {}
    stack: list[tuple[Any, str]] = [(obj, "")]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if isinstance(node, leaf):
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


#: How deep containers and objects may hold one another in a state (``{"a": [x]}`` is 2 levels).
#: Real checkpoints nest a dozen levels; every recursive walk of a state -- pickle's writer when
#: a tool saves what it loaded, ``copy.deepcopy``, and the hashing of nested tuples, a C
#: recursion without a limit that crashes the process -- stays well inside Python's recursion
#: limit at this depth. `flatten` refuses a deeper state and readers a deeper skeleton, so what
#: is saved loads.
MAX_NESTING = 200


#: Types that hold nothing a walk of a state visits (the common leaves, looked up first).
_LEAF_TYPES = frozenset({str, bytes, bytearray, int, float, complex, bool, type(None),
                         torch.dtype, torch.device, torch.Size})


def _members(obj: Any) -> Iterable[Any] | None:
    """What pickle's writer visits inside `obj`: a container's items, an object's attributes
    (a tensor's, a dict subclass's too); None for a leaf or an empty object."""
    if isinstance(obj, (str, bytes, bytearray, int, float, complex, type(None), type,
                        types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
        return None
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        return obj.flat if obj.dtype.hasobject else None
    parts: list[Iterable[Any]] = []
    if isinstance(obj, dict) and obj:
        parts.append(itertools.chain.from_iterable(obj.items()))
    elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)) and obj:
        parts.append(obj)
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict) and attributes:
        parts.append(attributes.values())
    return itertools.chain(*parts) if parts else None


def nesting_depth(obj: Any, *, limit: int = MAX_NESTING) -> int:
    """The longest chain of non-empty containers and objects holding one another from `obj`
    down (0: a leaf; a reference back into the chain, a cycle, ends it), counted without
    recursion, each object once; ``limit + 1`` as soon as the chain is longer than `limit`."""
    root = _members(obj)
    if root is None:
        return 0
    heights: dict[int, int] = {}  # finished objects (alive in `obj`, so their ids are stable)
    path = {id(obj)}
    stack: list[tuple[Any, Iterator[Any], int]] = [(obj, iter(root), 0)]
    while stack:
        node, members, tallest = stack[-1]
        for member in members:
            if type(member) in _LEAF_TYPES:
                continue
            known = heights.get(id(member))
            if known is not None:
                tallest = max(tallest, known)
                continue
            inner = _members(member) if id(member) not in path else None
            if inner is None:
                continue
            if len(stack) >= limit:
                return limit + 1
            stack[-1] = (node, members, tallest)
            path.add(id(member))
            stack.append((member, iter(inner), 0))
            break
        else:
            stack.pop()
            path.discard(id(node))
            heights[id(node)] = tallest + 1
            if stack:
                parent, left, parent_tallest = stack[-1]
                stack[-1] = (parent, left, max(parent_tallest, tallest + 1))
    return heights[id(obj)]


class _SkeletonPickler(pickle.Pickler):
    """Pickles an object with a persistent reference in place of each `leaf` (tensor).

    A module-level class on purpose: a class defined inside `flatten` would close over the
    tensors and, being a reference cycle itself, keep them alive until the garbage collector
    runs, long after the save that needed them.
    """

    def __init__(self, file: io.BytesIO, leaf: type | tuple[type, ...],
                 paths: dict[int, tuple[str, Any]]) -> None:
        super().__init__(file, protocol=4)
        self.leaf, self.paths = leaf, paths
        self.tensors: list[Any] = []
        self.keys: list[str] = []
        self.index_of: dict[int, int] = {}
        self.tensor_attributes = False

    def persistent_id(self, o: Any) -> Any:
        if isinstance(o, self.leaf):
            if id(o) not in self.index_of:
                self.index_of[id(o)] = len(self.tensors)
                self.tensors.append(o)
                self.keys.append(self.paths[id(o)][0] if id(o) in self.paths
                                 else f"<tensor {len(self.keys)} inside {type(o).__name__}>")
            attributes = tensor_attributes(o)
            if attributes:  # pickled with the skeleton, so read back through the allowlist
                self.tensor_attributes = True
                return ("tensor", self.index_of[id(o)], dict(attributes))
            return ("tensor", self.index_of[id(o)])
        if isinstance(o, torch.Tensor):
            raise TypeError(f"this skeleton refers to tensors as {self.leaf}; found a tensor")
        if isinstance(o, (torch.UntypedStorage, torch.TypedStorage)):
            raise TypeError(
                "nvcomp_ckpt_engine.save stores tensors, not bare storages; wrap the storage "
                "in a tensor (torch.tensor([], dtype=torch.uint8).set_(storage))"
            )
        return None


def flatten(obj: Any, *, leaf: type | tuple[type, ...] = torch.Tensor) -> Flattened:
    """Split `obj` into a skeleton and its tensors (each distinct tensor object once).

    `leaf` is what stands for a tensor: another type (`lazy.TensorRef`, a tensor not read
    yet) builds a skeleton that refers to those objects instead; its `tensors` are then them.
    """
    if nesting_depth(obj) > MAX_NESTING:
        raise ValueError(
            f"the state nests containers and objects more than {MAX_NESTING} levels deep, "
            "more than nvcomp_ckpt_engine reads back (state.MAX_NESTING): flatten it")
    buffer = io.BytesIO()
    pickler = _SkeletonPickler(buffer, leaf, _key_paths(obj, leaf))
    pickler.dump(obj)
    return Flattened(buffer.getvalue(), pickler.tensors, pickler.keys, pickler.tensor_attributes)


#: What one element of a container is charged: a pointer and its share of a hash table.
_ELEMENT_BYTES = 64
#: Nested tuples and frozensets sharing their parts (through the memo) can be exponentially
#: larger than they look, and hashing one walks all of it: each may hold at most this many
#: elements, counted with repetition, per byte of the skeleton (plus a constant).
_WEIGHT_PER_BYTE = 64
_WEIGHT_CONSTANT = 1 << 16


def _enum_member(cls: Any, name: Any, *, source: str) -> Any:
    """`getattr` restricted to members of an enum class (the class itself was allowlisted)."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) \
            and name in cls.__members__:
        return cls.__members__[name]
    raise UnsafeObjectError(
        f"{source}: the file's skeleton calls getattr({cls!r}, {name!r}); only enum members may "
        "be looked up by name. Load with trusted=True if you trust this file."
    )


#: `__new__` methods that always return a new object, never a cached or shared one.
_ALLOCATING_NEW = tuple(
    t.__new__ for t in (object, dict, list, set, bytearray, collections.OrderedDict,
                        collections.defaultdict, collections.deque)
)


def _new_each_call(cls: Any, *, called: bool) -> bool:
    """Whether `cls.__new__(cls, ...)` (or `cls(...)`, when `called`) always makes a new object.

    Not so for an enum class (its metaclass's call returns an existing member) or a type that
    caches instances (numpy's builtin dtypes, small ints): BUILD must not reach those.
    """
    if not isinstance(cls, type) or not any(cls.__new__ is new for new in _ALLOCATING_NEW):
        return False
    return not called or type(cls).__call__ is type.__call__


def _copy_requested(args: tuple, kwargs: dict) -> bool:
    return len(args) >= 3 and args[2] is True


#: Allowlisted functions (and classes with their own `__new__`) known to return a new object
#: for these arguments: numpy rebuilds an array with `_reconstruct`, and a dtype with
#: ``numpy.dtype(spec, align, copy=True)``, then sets their state with BUILD.
_FRESH_RESULTS: dict[str, Callable[[tuple, dict], bool]] = {
    "numpy.core.multiarray._reconstruct": lambda args, kwargs: True,
    "numpy._core.multiarray._reconstruct": lambda args, kwargs: True,
    "numpy.dtype": _copy_requested,
}


def _length(obj: Any) -> float:
    try:
        return len(obj)
    except (TypeError, OverflowError):  # unsized, or a range longer than an index can hold
        return 0 if not isinstance(obj, range) else float("inf")


def _footprint(obj: Any) -> float:
    """What handing `obj` to a constructor may make it allocate: one copy of its elements."""
    if isinstance(obj, (str, bytes, bytearray)):
        return len(obj)
    return _ELEMENT_BYTES * _length(obj)


def _numpy_itemsize(dtype: Any) -> int:
    import numpy

    try:
        return numpy.dtype(dtype).itemsize
    except Exception:  # the call itself will refuse such a dtype
        return 0


def _shape_elements(shape: Any) -> float:
    if isinstance(shape, int):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or not all(type(n) is int for n in shape):
        return 0  # not a shape: numpy refuses it before allocating
    return math.prod(max(n, 0) for n in shape)


def _array_bytes(args: tuple, kwargs: dict) -> float:
    """numpy's `_reconstruct(cls, shape, dtype)` and `ndarray(shape, dtype, ...)` allocate the
    array they describe."""
    if args and isinstance(args[0], type):
        args = args[1:]
    shape = args[0] if args else kwargs.get("shape", ())
    dtype = args[1] if len(args) > 1 else kwargs.get("dtype", "f8")
    return _shape_elements(shape) * max(_numpy_itemsize(dtype), 1)


def _scalar_bytes(args: tuple, kwargs: dict) -> float:
    return _numpy_itemsize(args[0]) if args else 0


def _bytearray_bytes(args: tuple, kwargs: dict) -> float:
    return args[0] if args and type(args[0]) is int else sum(map(_footprint, args))


def _scalar_arguments_only(args: tuple, kwargs: dict) -> float:
    """`str(x)` of a container is its repr, which grows with every shared reference inside it:
    exponentially, for a nest of memo references. Real skeletons convert only scalars."""
    for value in (*args, *kwargs.values()):
        if not isinstance(value, (str, bytes, bytearray, int, float, complex, type(None))):
            raise _Refused(f"builtins.str of a {type(value).__name__}")
    return sum(map(_footprint, (*args, *kwargs.values())))


#: What calling these may allocate beyond one copy of their arguments.
_CALL_BYTES: dict[str, Callable[[tuple, dict], float]] = {
    "builtins.bytearray": _bytearray_bytes,
    "builtins.str": _scalar_arguments_only,
    "numpy.core.multiarray._reconstruct": _array_bytes,
    "numpy._core.multiarray._reconstruct": _array_bytes,
    "numpy.ndarray": _array_bytes,
    "numpy.core.multiarray.scalar": _scalar_bytes,
    "numpy._core.multiarray.scalar": _scalar_bytes,
}


def _state_bytes(inst: Any, state: Any) -> float:
    """What BUILD with `state` may allocate: an array's data for numpy, else one copy."""
    import numpy

    if isinstance(inst, numpy.ndarray) and isinstance(state, tuple) and len(state) >= 4:
        return _shape_elements(state[1]) * max(_numpy_itemsize(state[2]), 1)
    parts = state if isinstance(state, tuple) else (state,)
    return sum(map(_footprint, parts))


class _Refused(Exception):
    """A construction the skeleton asks for that a real skeleton never does."""


class RestrictedUnpickler(pickle._Unpickler):
    """Unpickles a skeleton, resolving only allowlisted globals and our tensor references.

    Built on pickle's Python implementation, whose opcodes can be checked one by one (the C
    unpickler runs BUILD and friends out of reach):
    - BUILD sets state only on objects this load created (a class's `__new__` that always
      allocates, or a known constructor), never on a class, an enum member, a tensor or any
      other object that exists outside the file: an allowlisted class cannot be altered
      process-wide by a file;
    - APPEND(S), SETITEM(S) and ADDITEMS fill only lists, dicts and sets (pickle never asks
      for more), so no other method of an allowlisted object runs;
    - every call and every BUILD is charged, before it runs, what it may allocate; the total
      may not exceed `MAX_EXPANSION` times the skeleton's size;
    - a tuple or frozenset may not hold more than a bound of elements counted with
      repetition, so hashing one cannot hang the load.
    """

    dispatch = dict(pickle._Unpickler.dispatch)
    #: What calling a global may allocate beyond one copy of its arguments, by its name.
    call_bytes: dict[str, Callable[[tuple, dict], float]] = _CALL_BYTES

    def __init__(
        self,
        data: bytes,
        tensors: list[Any],
        *,
        allowed: frozenset[str],
        source: str,
        tensor_attributes: bool,
        keys: Sequence[str] | None = None,
    ) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors
        self._allowed = allowed
        self._source = source
        self._tensor_attributes = tensor_attributes
        self._keys = keys
        self._size = len(data)
        self._left = MAX_EXPANSION * len(data)
        self._max_weight = _WEIGHT_PER_BYTE * len(data) + _WEIGHT_CONSTANT
        self._names: dict[int, tuple[str, Any]] = {}
        # id -> (object, weight, depth); the object is held so that its id is not reused.
        self._weights: dict[int, tuple[Any, int, int]] = {}
        self._created: dict[int, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified == "builtins.getattr":
            # Some Pythons pickle an enum member as getattr(EnumClass, "NAME"); allow exactly
            # that shape, for allowlisted enum classes, and nothing else getattr could reach.
            return functools.partial(_enum_member, source=self._source)
        if qualified not in self._allowed:
            raise UnsafeObjectError(
                f"{self._source}: the file's skeleton names {qualified!r}, which is not on the "
                "allowlist of classes a checkpoint may create. If you trust this file, load it "
                f"with trusted=True; or allow the class with "
                f"nvcomp_ckpt_engine.add_safe_classes({qualified!r})."
            )
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        self._names[id(obj)] = (qualified, obj)
        return obj

    def persistent_load(self, pid: Any) -> Any:
        return _tensor_reference(pid, self._tensors, self._source, self._tensor_attributes,
                                 self._keys)

    # -------------------------------------------------------------- what a skeleton may do

    def _refuse(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self._source}: the file's skeleton asks for {what}, which no skeleton "
            "nvcomp_ckpt_engine writes does (a damaged or hostile file)"
        )

    def _charge(self, nbytes: float, what: str) -> None:
        self._left -= nbytes
        if self._left < 0:
            raise CorruptCheckpointError(
                f"{self._source}: the file's skeleton would build more than {MAX_EXPANSION}x "
                f"its own {self._size} bytes (at {what}); refused before allocating it"
            )

    def _name(self, obj: Any) -> str:
        known = self._names.get(id(obj))
        return known[0] if known is not None and known[1] is obj else type(obj).__qualname__

    def _call(self, func: Any, args: Any, kwargs: Any, *, new: bool) -> Any:
        """`func.__new__(func, *args, **kwargs)` when `new`, else `func(*args, **kwargs)`,
        after charging what it may allocate; records the result if it is a new object."""
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise self._refuse(f"a call with arguments {type(args).__name__}")
        name = self._name(func)
        try:
            cost = self.call_bytes.get(name, lambda a, k: sum(map(_footprint, (*a, *k.values()))))(
                args, kwargs)
        except _Refused as exc:
            raise self._refuse(str(exc)) from None
        self._charge(cost, f"a call of {name}")
        result = func.__new__(func, *args, **kwargs) if new else func(*args, **kwargs)
        fresh = _FRESH_RESULTS.get(name)
        if (fresh(args, kwargs) if fresh is not None else _new_each_call(func, called=not new)):
            self._created[id(result)] = result
        self._track(result)
        return result

    def _track(self, obj: Any) -> Any:
        """Record the weight of a tuple or frozenset (its elements, counted with repetition)
        and its depth, before anything hashes it: CPython hashes nested tuples by a C recursion
        without a limit, which a deep enough nest crashes."""
        if isinstance(obj, (tuple, frozenset)):
            weight, depth = 1, 1
            for item in obj:
                known = self._weights.get(id(item))
                if known is not None and known[0] is item:
                    weight, depth = weight + known[1], max(depth, known[2] + 1)
                else:
                    weight += 1
            if weight > self._max_weight:
                raise self._refuse(f"a {type(obj).__name__} of {weight} nested elements")
            if depth > MAX_NESTING:
                raise self._refuse(f"tuples nested more than {MAX_NESTING} deep")
            self._weights[id(obj)] = (obj, weight, depth)
        return obj

    def load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args, {}, new=False)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._call(cls, args, {}, new=True))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._call(cls, args, kwargs, new=True))

    def _instantiate(self, klass: Any, args: list[Any]) -> None:
        self.append(self._call(klass, tuple(args), {}, new=False))

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if self._created.get(id(inst)) is not inst:
            raise self._refuse(f"a BUILD of {self._name(inst)}, an object this load did not create")
        self._charge(_state_bytes(inst, state), f"a BUILD of {self._name(inst)}")
        self.stack.append(state)
        super().load_build()

    def _filled(self, kind: type) -> Any:
        target = self.stack[-1]
        if not isinstance(target, kind):
            raise self._refuse(f"items added to a {type(target).__name__}")
        return target

    def load_append(self) -> None:
        value = self.stack.pop()
        self._filled(list).append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._filled(list).extend(items)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._filled(dict)[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._filled(dict)
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def load_additems(self) -> None:
        items = self.pop_mark()
        self._filled(set).update(items)

    def _tuple_of(self, count: int) -> None:
        if len(self.stack) < count:
            raise pickle.UnpicklingError("a tuple of more items than the stack holds")
        items = tuple(self.stack[-count:])
        del self.stack[-count:]
        self.append(self._track(items))

    def load_tuple(self) -> None:
        items = tuple(self.pop_mark())  # before looking up `append`: pop_mark replaces the stack
        self.append(self._track(items))

    def load_tuple1(self) -> None:
        self._tuple_of(1)

    def load_tuple2(self) -> None:
        self._tuple_of(2)

    def load_tuple3(self) -> None:
        self._tuple_of(3)

    def load_frozenset(self) -> None:
        items = frozenset(self.pop_mark())
        self.append(self._track(items))


RestrictedUnpickler.dispatch.update({
    opcode[0]: getattr(RestrictedUnpickler, method) for opcode, method in (
        (pickle.REDUCE, "load_reduce"), (pickle.NEWOBJ, "load_newobj"),
        (pickle.NEWOBJ_EX, "load_newobj_ex"), (pickle.BUILD, "load_build"),
        (pickle.APPEND, "load_append"), (pickle.APPENDS, "load_appends"),
        (pickle.SETITEM, "load_setitem"), (pickle.SETITEMS, "load_setitems"),
        (pickle.ADDITEMS, "load_additems"), (pickle.TUPLE, "load_tuple"),
        (pickle.TUPLE1, "load_tuple1"), (pickle.TUPLE2, "load_tuple2"),
        (pickle.TUPLE3, "load_tuple3"), (pickle.FROZENSET, "load_frozenset"),
    )
})


class _TrustedUnpickler(pickle.Unpickler):
    """For files the caller trusts: any class, and the C unpickler's speed."""

    def __init__(self, data: bytes, tensors: list[Any], *, source: str, tensor_attributes: bool,
                 keys: Sequence[str] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors
        self._source = source
        self._tensor_attributes = tensor_attributes
        self._keys = keys

    def persistent_load(self, pid: Any) -> Any:
        return _tensor_reference(pid, self._tensors, self._source, self._tensor_attributes,
                                 self._keys)


def tensor_attributes(tensor: Any) -> dict[str, Any]:
    """The Python attributes a tensor carries (`t.ds_id = 3`), which torch.save keeps and so
    does the skeleton; a `lazy.TensorRef` keeps those of the tensor it stands for."""
    return vars(tensor) if isinstance(tensor, torch.Tensor) else getattr(tensor, "attributes", {})


def _tensor_reference(pid: Any, tensors: list[Any], source: str, with_attributes: bool,
                      keys: Sequence[str] | None) -> Any:
    """The tensor a persistent id names: ``("tensor", i)``, or ``("tensor", i, attributes)``
    for one carrying Python attributes, which are set on it (on a `TensorRef`, kept for the
    tensor it will be read as) where the file's format version has them (`with_attributes`):
    in an older version's file, such a reference is damage, not a newer writer. An attribute
    may not shadow what torch.Tensor defines (`shadows_tensor`); errors name the tensor by its
    key in `keys` (the index's `TensorEntry.key` s)."""
    if (
        not isinstance(pid, tuple)
        or len(pid) not in (2, 3)
        or pid[0] != "tensor"
        or type(pid[1]) is not int
        or not 0 <= pid[1] < len(tensors)
    ):
        raise pickle.UnpicklingError(f"{source}: invalid tensor reference {pid!r}")
    target = tensors[pid[1]]
    if len(pid) == 3 and not with_attributes:
        raise CorruptCheckpointError(
            f"{source}: tensor {pid[1]}'s reference carries Python attributes, which only shard "
            "format version 3 and later hold, but the file says it is older (a damaged file)")
    if len(pid) == 3:
        attributes = pid[2]
        if (type(attributes) is not dict or not attributes
                or not all(type(k) is str and k.isidentifier() and not k.startswith("__")
                           for k in attributes)):
            raise pickle.UnpicklingError(
                f"{source}: tensor {pid[1]}'s attributes are not a dict of attribute names")
        shadowing = sorted(name for name in attributes if shadows_tensor(name))
        if shadowing:
            key = keys[pid[1]] if keys is not None and pid[1] < len(keys) else f"#{pid[1]}"
            raise CorruptCheckpointError(
                f"{source}: tensor {key!r} carries the attribute {shadowing[0]!r}, which "
                "torch.Tensor defines: set on the tensor, it would replace that method or "
                "property (a damaged or hostile file)")
        tensor_attributes(target).update(attributes)
    return target


def shadows_tensor(name: str) -> bool:
    """Whether an attribute `name` set on a tensor would hide what torch.Tensor (or
    torch.nn.Parameter) defines: a method, a property (`numel`, `size`, `to`, `data`, ...).
    Such a name is never read from a file nor written to one."""
    return hasattr(torch.nn.Parameter, name)


def unpickle(
    data: bytes,
    *,
    allowed: frozenset[str] | None,
    source: str,
    what: str = "the skeleton",
    tensors: list[Any] | None = None,
    tensor_attributes: bool = False,
    keys: Sequence[str] | None = None,
) -> Any:
    """Unpickle `data` through `RestrictedUnpickler` (`allowed=None`: anything, for trusted
    files); its tensor references may carry attributes only with `tensor_attributes` (a shard
    of format version 3 or later: `ShardIndex.tensor_attributes`), and errors name a tensor by
    its key in `keys`. Whatever goes wrong is the file's doing, so it is a `CheckpointError` naming
    `source`: `UnsafeObjectError` for a class off the allowlist, `CorruptCheckpointError` for
    the rest (a damaged pickle, a constructor refusing its arguments, a bound exceeded, a
    nesting deeper than `MAX_NESTING`)."""
    tensors = [] if tensors is None else tensors
    unpickler = (_TrustedUnpickler(data, tensors, source=source, tensor_attributes=tensor_attributes,
                                   keys=keys)
                 if allowed is None else
                 RestrictedUnpickler(data, tensors, allowed=allowed, source=source,
                                     tensor_attributes=tensor_attributes, keys=keys))
    try:
        obj = unpickler.load()
    except CheckpointError:
        raise
    except Exception as exc:  # everything the unpickler does is driven by the file's bytes
        raise CorruptCheckpointError(
            f"{source}: {what} does not decode ({type(exc).__name__}: {exc})") from exc
    if nesting_depth(obj) > MAX_NESTING:
        raise CorruptCheckpointError(
            f"{source}: {what} nests containers and objects more than {MAX_NESTING} levels "
            "deep, deeper than nvcomp_ckpt_engine writes (a damaged or hostile file)")
    return obj


def unflatten(
    skeleton: bytes,
    tensors: list[Any],
    *,
    trusted: bool = False,
    safe_classes: Iterable[type | Callable[..., Any] | str] = (),
    source: str = "<shard>",
    tensor_attributes: bool = False,
    keys: Sequence[str] | None = None,
) -> Any:
    """Rebuild the object from its skeleton; see `RestrictedUnpickler` for what is allowed and
    `unpickle` for `tensor_attributes` and `keys`."""
    allowed = None if trusted else safe_globals(safe_classes)
    return unpickle(skeleton, allowed=allowed, source=source, tensors=tensors,
                    tensor_attributes=tensor_attributes, keys=keys)
