"""Whether a factory builds the caller's model: :func:`model_difference` compares two models' structure and static
configuration (their module trees, classes and every attribute that is not an array), arrays by shape only and
dtypes not at all, so that the float64 copy a factory builds may differ from the caller's model in its dtypes
alone. Imports neither torch nor JAX: a torch module, an NNX or Linen module, an Equinox module or a function are
walked as plain Python objects."""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import numpy as np

_TORCH_TREE = ("_modules", "_parameters", "_buffers")  # compared by name, as the module's own attributes
_UNSAVED = "_non_persistent_buffers_set"
# torch.nn.Module's own bookkeeping: hooks, modes and flags that say nothing of what the module computes (its
# parameters, buffers and submodules are compared: they are the module tree)
_TORCH_BOOKKEEPING = frozenset(
    {
        "training",
        "_backward_pre_hooks",
        "_backward_hooks",
        "_is_full_backward_hook",
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_compiled_call_impl",
        _UNSAVED,
    }
)
_NNX_BOOKKEEPING = ("_pytree__", "_object__")  # an NNX module's trace state and the like
_PLAIN = (str, bytes, int, float, complex, bool, type(None), range, slice)
_MAX_DEPTH = 64  # deeper than any module tree: a structure that nests further is compared no deeper


def _is_array(x: Any) -> bool:
    """An array of any framework (NumPy, JAX, torch, ``jax.ShapeDtypeStruct``): its values and dtype are data."""
    return not isinstance(x, type) and hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.dtype)


def _is_dtype(x: Any) -> bool:
    """A dtype of any framework (``np.float32``, ``jnp.float32``, ``torch.float64``, a ``np.dtype``)."""
    if isinstance(x, np.dtype) or (type(x).__name__ == "dtype" and type(x).__module__ == "torch"):
        return True
    if isinstance(x, type):
        try:
            return np.dtype(x).kind in "biufc" and x not in (bool, int, float, complex)
        except TypeError:
            return False
    return False


def _describe(x: Any) -> str:
    if isinstance(x, _PLAIN):
        return repr(x)[:80]
    if isinstance(x, (types.FunctionType, types.BuiltinFunctionType)):
        return f"the function {getattr(x, '__qualname__', x)!r}"
    return f"a {type(x).__name__}"


def _attributes(x: Any) -> dict[str, Any] | None:
    """What an object holds, by name, for the comparison: a dataclass's fields (a Linen module's but its
    ``parent``, an Equinox module's), else its instance attributes (torch's bookkeeping left out); ``None`` for an
    object without attributes."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: getattr(x, f.name, None) for f in dataclasses.fields(x) if f.name != "parent"}
    held = getattr(x, "__dict__", None)
    if held is None:
        return None
    out = {k: v for k, v in held.items() if not k.startswith(_NNX_BOOKKEEPING)}
    if any(c.__module__.startswith("keras.") for c in type(x).__mro__):
        # a Keras object: its public attributes and its layers (Keras's private trackers hold ids and auto names)
        out = {k: v for k, v in out.items() if not k.startswith("_")}
        if isinstance(getattr(type(x), "layers", None), property):
            out["layers"] = list(x.layers)
    if hasattr(x, "_modules") and hasattr(x, "_parameters"):  # a torch module: its tree under plain names
        out = {k: v for k, v in out.items() if k not in _TORCH_BOOKKEEPING and k not in _TORCH_TREE}
        for table in _TORCH_TREE:
            out.update({name: value for name, value in (held.get(table) or {}).items()})
        out["(persistent buffers)"] = sorted(set(held.get("_buffers") or {}) - set(held.get(_UNSAVED) or ()))
    return out


def model_difference(given: Any, built: Any) -> str | None:
    """The first way in which ``built`` (a factory's model) is not ``given`` (the caller's), in words naming where
    (``lin.approximate: 'none' in the given model, 'tanh' in the factory's``); ``None`` when they have the same
    structure and static configuration.

    Compared: types; sequences, mappings and sets item by item; functions by their code, defaults and closed-over
    values (a closure built again is the same function); ``functools.partial`` by function and arguments; bound
    methods by function; other objects (torch, NNX, Linen and Equinox modules, their variables, configs) by their
    attributes, recursively. Arrays are compared by shape only and dtypes not at all, nor any setting named for a
    dtype (``dtype``, ``param_dtype``, a Keras layer's dtype policy): only dtypes may differ. Names (``name``: Keras
    numbers the layers of each build) are labels, and initialisers and seeds (``kernel_init``, ``kernel_initializer``,
    ``seed``) only make the weights that loading replaces: neither is configuration. A
    private attribute (``_name``) that one model has and the other lacks, or that is ``None`` in the factory's
    model while the given one holds a value, is bookkeeping or a cache a call filled (a rotary table's length),
    not configuration, and is passed over."""
    return _difference(given, built, "", _Walk(), 0)


class _Walk:
    """What a comparison has seen: the pairs compared (each once: cycles end), and which object of one model stands
    for which of the other (an array or an object with attributes), so that one shared in one model (a tied
    weight, a submodule used twice) and two apart in the other is a difference."""

    def __init__(self) -> None:
        self.pairs: set[tuple[int, int]] = set()
        self.twins: tuple[dict[int, str], dict[int, str]] = ({}, {})  # id -> where first met, in each model
        self.partner: tuple[dict[int, int], dict[int, int]] = ({}, {})

    def sharing(self, a: Any, b: Any, at: str) -> str | None:
        """Where ``a`` (given) and ``b`` (built) are not shared alike, in words; ``None`` when they are."""
        for side, (x, y) in enumerate(((a, b), (b, a))):
            partner = self.partner[side].setdefault(id(x), id(y))
            if partner != id(y):
                first = self.twins[side][id(x)]
                model = ("the given model", "the factory's")[side]
                return f"{at}: one object in {model} (also at {first}), two in the other"
            self.twins[side].setdefault(id(x), at)
        return None


def _difference(a: Any, b: Any, where: str, seen: _Walk, depth: int) -> str | None:
    at = where or "(the model itself)"
    if depth > _MAX_DEPTH or (_is_dtype(a) and _is_dtype(b)):
        return None
    if _is_array(a) or _is_array(b):
        if not (_is_array(a) and _is_array(b)):
            return f"{at}: {_describe(a)} in the given model, {_describe(b)} in the factory's"
        shapes = tuple(a.shape), tuple(b.shape)
        if shapes[0] != shapes[1]:
            return f"{at}: shape {shapes[0]} in the given model, {shapes[1]} in the factory's"
        return seen.sharing(a, b, at)
    if a is b:
        return None
    if not _same_class(type(a), type(b)):
        return f"{at}: {_describe(a)} in the given model, {_describe(b)} in the factory's"
    if isinstance(a, _PLAIN):
        same = a == b or (isinstance(a, float) and a != a and b != b)  # NaN is NaN here
        return None if same else f"{at}: {_describe(a)} in the given model, {_describe(b)} in the factory's"
    if (id(a), id(b)) in seen.pairs:
        return None
    seen.pairs.add((id(a), id(b)))
    deeper = functools.partial(_deeper, seen=seen, depth=depth + 1)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{at}: {len(a)} items in the given model, {len(b)} in the factory's"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := deeper(x, y, f"{where}[{i}]"))), None)
    if isinstance(a, dict):
        return _mapping_difference(a, b, where, deeper)
    if isinstance(a, (set, frozenset)):
        return None if a == b else f"{at}: {sorted(map(str, a ^ b))[:3]} in one model only"
    if isinstance(a, functools.partial):
        return deeper((a.func, a.args, a.keywords), (b.func, b.args, b.keywords), where)
    if isinstance(a, types.MethodType):
        return deeper(a.__func__, b.__func__, where)
    if isinstance(a, types.FunctionType):
        return _function_difference(a, b, at, deeper)
    if isinstance(a, types.CellType):
        try:
            return deeper(a.cell_contents, b.cell_contents, where)
        except ValueError:  # an empty cell
            return None
    held_a, held_b = _attributes(a), _attributes(b)
    if held_a is not None and held_b is not None and (shared := seen.sharing(a, b, at)):
        return shared
    if held_a is None or held_b is None:
        try:
            same = bool(a == b)
        except Exception:  # noqa: BLE001 - an object that cannot say whether it equals another: its type is compared
            same = True
        return None if same else f"{at}: {_describe(a)} {a!r:.60} in the given model, {b!r:.60} in the factory's"
    return _mapping_difference(held_a, held_b, where, deeper, attributes=True)


def _same_class(a: type, b: type) -> bool:
    """The same class, or one class statement run twice (a class defined in the function that builds the model):
    the same module, qualified name, bases and code of every method."""
    if a is b:
        return True
    if (a.__module__, a.__qualname__, a.__bases__) != (b.__module__, b.__qualname__, b.__bases__):
        return False
    code = {k: getattr(v, "__code__", None) for k, v in vars(a).items()}
    return code == {k: getattr(v, "__code__", None) for k, v in vars(b).items()}


def _deeper(a: Any, b: Any, where: str, *, seen: _Walk, depth: int) -> str | None:
    return _difference(a, b, where, seen, depth)


def _mapping_difference(a: dict, b: dict, where: str, deeper, attributes: bool = False) -> str | None:
    def named(k: Any) -> str:
        return (f"{where}.{k}" if where else str(k)) if attributes or isinstance(k, str) else f"{where}[{k!r}]"

    def private(k: Any) -> bool:
        return attributes and isinstance(k, str) and k.startswith("_")

    def dtype_setting(k: Any) -> bool:  # dtype, param_dtype, a Keras layer's dtype policy or its config's "dtype"
        return isinstance(k, str) and "dtype" in k.lower()

    def label(k: Any) -> bool:  # a layer's name ("input_layer_3" in a second build): the strict load checks paths
        return k in ("name", "_name")

    def initialisation(k: Any) -> bool:  # kernel_init, kernel_initializer, a seed: the loaded weights replace them
        return isinstance(k, str) and (k.endswith("_init") or "initializer" in k or "seed" in k)

    for k in a:
        if dtype_setting(k) or label(k) or initialisation(k):
            continue  # only dtypes may differ (a float64 rebuild says so in its settings); names are labels
        if k not in b:
            if private(k):
                continue  # bookkeeping a call or a loader added (a cache, an initialised flag)
            return f"{named(k)}: in the given model only"
        if private(k) and b[k] is None and a[k] is not None:
            continue  # a cache the given model's calls filled
        if d := deeper(a[k], b[k], named(k)):
            return d
    extra = [k for k in b if k not in a and not private(k) and not (dtype_setting(k) or label(k) or initialisation(k))]
    return f"{named(extra[0])}: in the factory's model only" if extra else None


def _function_difference(a: types.FunctionType, b: types.FunctionType, at: str, deeper) -> str | None:
    if a.__code__ != b.__code__:
        return f"{at}: {_describe(a)} in the given model, {_describe(b)} in the factory's (other code)"
    if d := deeper((a.__defaults__, a.__kwdefaults__), (b.__defaults__, b.__kwdefaults__), f"{at} (defaults)"):
        return d
    names = a.__code__.co_freevars
    cells_a, cells_b = a.__closure__ or (), b.__closure__ or ()
    for name, x, y in zip(names, cells_a, cells_b):
        if d := deeper(x, y, f"{at} (closed-over {name})"):
            return d
    return None
