"""Whether a factory builds the caller's model: :func:`model_difference` compares two models' structure and static
configuration (their module trees, classes and every attribute that is not an array), arrays by shape only and
dtypes not at all, so that the float64 copy a factory builds may differ from the caller's model in its dtypes
alone. Imports neither torch nor JAX: a torch module, an NNX or Linen module, an Equinox module or a function are
walked as plain Python objects."""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Collection
from typing import Any

import numpy as np

from flax_ln.parity.core.keras_structure import keras_attributes

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
    if isinstance(x, (type, np.dtype, types.ModuleType)):
        return False
    try:
        return hasattr(x, "dtype") and getattr(x, "shape", None) is not None  # Keras's InputSpec may have no shape
    except Exception:  # noqa: BLE001 - an object whose attributes raise (a lazily imported module) is no array
        return False


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
        out = keras_attributes(x, out)
    if hasattr(x, "_modules") and hasattr(x, "_parameters"):  # a torch module: its tree under plain names
        out = {k: v for k, v in out.items() if k not in _TORCH_BOOKKEEPING and k not in _TORCH_TREE}
        for table in _TORCH_TREE:
            out.update({name: value for name, value in (held.get(table) or {}).items()})
        out["(persistent buffers)"] = sorted(set(held.get("_buffers") or {}) - set(held.get(_UNSAVED) or ()))
    return out


def model_difference(given: Any, built: Any, filled: dict[int, frozenset[str]] | None = None) -> str | None:
    """The first way in which ``built`` (a factory's model) is not ``given`` (the caller's), in words naming where
    (``lin.approximate: 'none' in the given model, 'tanh' in the factory's``); ``None`` when they have the same
    structure and static configuration.

    Compared: types; sequences, mappings and sets item by item; functions by their code, defaults and closed-over
    values (a closure built again is the same function); ``functools.partial`` by function and arguments; bound
    methods by function; other objects (torch, NNX, Linen, Equinox and Keras modules, their variables, configs) by
    their attributes, private ones included, recursively (a Keras object's: less Keras's bookkeeping, with a
    functional model's operations and their arguments, :func:`~flax_ln.parity.core.keras_structure.keras_attributes`).
    Arrays are compared by shape only and dtypes not at all, nor any setting named for a dtype (``dtype``,
    ``param_dtype``, a Keras layer's dtype policy): only dtypes may differ. Names (``name``: Keras numbers the layers
    of each build) are labels, and initialisers and seeds (``kernel_init``, ``kernel_initializer``, ``seed``) only
    make the weights that loading replaces: neither is configuration. A private attribute (``_name``) that one
    model has and the other lacks is bookkeeping a call or a loader added, and is passed over.

    ``filled``: ``id(object) -> names`` of the attributes of ``built``'s objects that its own call filled (a cache:
    ``None`` or absent before the call, set after; :class:`Rebuild`), passed over whatever ``given`` holds there."""
    return _difference(given, built, "", _Walk(filled or {}), 0)


class Rebuild:
    """A factory's model (``built``) beside the caller's (``given``), taken before ``built`` is first called; after
    that call, :meth:`difference` is :func:`model_difference`, with a cache told apart by having been filled: an
    attribute of ``built``'s that was ``None`` or absent before the call and is set after it."""

    def __init__(self, given: Any, built: Any):
        self.given, self.built = given, built
        self.before = _unset(built)

    def difference(self) -> str | None:
        """:func:`model_difference` of the two models as they are now, what ``built``'s call filled passed over."""
        now = _unset(self.built)
        filled = {}
        for key, (owner, present, none) in self.before.items():
            if key in now and now[key][0] is owner:
                names = (now[key][1] - present) | (none - now[key][2])
                if names:
                    filled[key] = frozenset(names)
        return model_difference(self.given, self.built, filled)

    def confirm(self, factory: str, given: str) -> None:
        """``ValueError`` naming the first difference (:meth:`difference`) unless ``built`` is ``given`` built
        again; ``factory`` and ``given`` name the two arguments (``"torch_factory"``, ``"torch_module"``)."""
        difference = self.difference()
        if difference is not None:
            raise ValueError(
                f"{factory} builds another model than {given} ({difference}): the float64 check must run the model "
                "compared in float32, so the factory must build it with the same structure (module tree, classes) "
                "and configuration (every attribute, private ones included; only dtypes may differ)"
            )


def _unset(model: Any) -> dict[int, tuple[Any, frozenset[str], frozenset[str]]]:
    """``id(object) -> (object, names it holds, names it holds as None)`` for every object with attributes in
    ``model`` (walked as :func:`model_difference` walks it)."""
    found: dict[int, tuple[Any, frozenset[str], frozenset[str]]] = {}
    stack, seen = [(model, 0)], set()
    while stack:
        x, depth = stack.pop()
        if id(x) in seen or depth > _MAX_DEPTH or isinstance(x, (*_PLAIN, type, types.ModuleType)) or _is_array(x):
            continue
        seen.add(id(x))
        if isinstance(x, (list, tuple, set, frozenset)):
            stack.extend((y, depth + 1) for y in x)
            continue
        if isinstance(x, dict):
            stack.extend((y, depth + 1) for y in x.values())
            continue
        if isinstance(x, (types.FunctionType, types.MethodType, functools.partial)):
            continue  # code and closures: a call fills no cache there
        held = _attributes(x)
        if held is None:
            continue
        found[id(x)] = (x, frozenset(held), frozenset(k for k, v in held.items() if v is None))
        stack.extend((y, depth + 1) for y in held.values())
    return found


class _Walk:
    """What a comparison has seen: the pairs compared (each once: cycles end), and which object of one model stands
    for which of the other (an array or an object with attributes), so that one shared in one model (a tied
    weight, a submodule used twice) and two apart in the other is a difference."""

    def __init__(self, filled: dict[int, frozenset[str]]) -> None:
        self.filled = filled  # id(object in the built model) -> the names its call filled
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
    return _mapping_difference(held_a, held_b, where, deeper, attributes=True, filled=seen.filled.get(id(b), ()))


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


def _mapping_difference(
    a: dict, b: dict, where: str, deeper, attributes: bool = False, filled: Collection[str] = ()
) -> str | None:
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

    def passed_over(k: Any) -> bool:  # only dtypes may differ (a float64 rebuild says so); names are labels
        return dtype_setting(k) or label(k) or initialisation(k) or k in filled  # filled: a cache the call filled

    for k in a:
        if passed_over(k):
            continue
        if k not in b:
            if private(k):
                continue  # bookkeeping a call or a loader added (an initialised flag)
            return f"{named(k)}: in the given model only"
        if d := deeper(a[k], b[k], named(k)):
            return d
    extra = [k for k in b if k not in a and not private(k) and not passed_over(k)]
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
