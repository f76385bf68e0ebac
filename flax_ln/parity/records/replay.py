"""Isolation replays the port's own call of a module: its recorded calls (:class:`PortCall`, named by
:func:`call_names`), the arguments that call is made again with (:func:`replay_arguments`: the one rule for every
kind of flax side) and rematerialisation made transparent while recording (:func:`transparent_remat`). Imports no
torch.

The rule for a recorded port call's arguments, leaf by leaf (containers opened):

- a floating array that is not an activation (its values do not depend on the port's floating inputs or parameters:
  a mask or a position table built from constants or integer inputs, an empty cache; told by
  :func:`constant_arguments` from a second run with those nudged) keeps the port's own value, named in
  :attr:`Replayed.kept`;
- every other floating array takes the value of one of the torch twin's *own* recorded arguments, through the
  pair's layout, never another module's output. Which one: for an array that is exactly the port output of a pair
  recorded before the call began (or an axis permutation or reshape of it), the twin's argument holding that pair's
  torch output (*provenance* picks the slot: a cross-attention's keys and values take torch's encoder output,
  whatever name or slot they come in); otherwise the one it corresponds to (*correspondence*): the one of the same
  keyword name, else the next one in order, positional and keyword, among those no provenance explained, when its
  shape fits;
- an earlier pair's port output for which the twin recorded no argument skips the module, with the reason;
- a floating array found by neither that no pair made (a mask built from ids, a rotary table) keeps the port's own
  value, and the isolated result names it (:attr:`Replayed.kept`);
- integer arrays take torch's integer arguments of the twin's call, in order, where the two calls have as many of
  them, each of one shape (:attr:`Pairs.integers`: ids computed wrongly upstream are not this module's error);
- everything else (boolean arrays, numbers, bools, strings, ``None``, caches and other objects, integers that do
  not pair) is passed exactly as recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax_ln.convert.assign import placed_like
from flax_ln.parity.core.call import is_float
from flax_ln.parity.records.capture import WHOLE_MODEL, Calls, Records, array_node, is_array
from flax_ln.parity.records.pairing import Pairs, exact_permutation, fingerprint


@dataclasses.dataclass
class PortCall:
    """One recorded call of a port module, kept whole so that isolation can make it again.

    ``method``: the method called (``"__call__"``, ``"attend"``); ``args``/``kwargs``: the arguments as the port
    passed them; ``positional``: the names of the positional parameters (for naming a kept argument); ``start``,
    ``end``: the call's place among the recorded calls' entries and returns (one counter), so that only pairs
    finished before it began can explain its arguments; ``state``: ``(module, args, kwargs)`` as they were just
    before the call (an NNX clone taken at entry: the module's caches, counters and RNG counts, and a cache passed
    to it, as the call found them), ``None`` where the kind of side replays its state otherwise (Linen: one new
    ``apply`` from the recorded variables).
    """

    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    positional: tuple[str, ...] = ()
    start: int = 0
    end: int = 0
    state: Any = None


class Replayed(list):
    """A module's floating outputs when run alone, with ``kept``: the floating arguments that kept the port's own
    value (not activations, or neither provenance nor correspondence found torch's)."""

    def __init__(self, outputs: Sequence[np.ndarray], kept: Sequence[str] = ()):
        super().__init__(outputs)
        self.kept = list(kept)


def call_names(calls: Sequence[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """The name of each recorded ``(module path, method)`` (in first-call order): ``__call__`` by the module's
    path; a module called through other methods only, its first by the path; every other method by the path and
    the method (``embed_tokens.weight.attend``), so that each call of a tied head is a call of its own."""
    by_module: dict[str, list[str]] = {}
    for path, method in calls:
        by_module.setdefault(path, []).append(method)
    names = {}
    for path, methods in by_module.items():
        plain = "__call__" if "__call__" in methods else methods[0]
        for method in methods:
            names[(path, method)] = path if method == plain else f"{path}.{method}"
    return names


_METHOD_NAMES: dict[tuple[type, Any], str] = {}  # (class, code) -> method_name's answer, found once


def method_name(cls: type, code: Any) -> str:
    """The name under which ``cls`` (or a base) holds the method whose code object is ``code``: ``__call__`` where it
    does (a ``__call__ = _norm_call`` alias is the module's call, whatever its function is named), else the first
    name that holds it, else the function's own name. So a recorded call is made again through the method the port
    called."""
    if (cls, code) not in _METHOD_NAMES:
        names = []
        for owner in cls.__mro__:
            for name, attr in vars(owner).items():
                function = inspect.unwrap(attr) if callable(attr) else None
                if getattr(function, "__code__", None) is code:
                    names.append(name)
        _METHOD_NAMES[(cls, code)] = "__call__" if "__call__" in names else names[0] if names else code.co_name
    return _METHOD_NAMES[(cls, code)]


def function_code(function: Any) -> Any:
    """The code object of ``function`` (a method, a ``functools.partial`` of one or a wrapper of one); ``None`` for a
    callable without one."""
    while isinstance(function, functools.partial):
        function = function.func
    function = inspect.unwrap(getattr(function, "__func__", function))
    return getattr(function, "__code__", None)


def _is_floating_array(leaf) -> bool:
    return is_array(leaf) and is_float(leaf)


def _is_integer_array(leaf) -> bool:
    if not (hasattr(leaf, "dtype") and hasattr(leaf, "shape")):
        return False
    try:
        return np.dtype(leaf.dtype).kind in "iu"
    except TypeError:  # a typed PRNG key (key<fry>): no NumPy dtype, and no id
        return False


def integer_leaves(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """The integer array leaves of a call's ``(args, kwargs)`` (containers opened), in call order."""
    leaves, _, _ = named_leaves(args, kwargs)
    return [leaf for leaf in leaves if _is_integer_array(leaf)]


def _is_leaf(x) -> bool:
    """Containers and pytree nodes of arrays (:func:`~flax_ln.parity.records.capture.array_node`) are opened."""
    return x is None or not (isinstance(x, (tuple, list, dict)) or array_node(x))


def _step(key) -> str:
    return str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))


def named_leaves(args: Sequence[Any], kwargs: Mapping[str, Any], positional: Sequence[str] = ()):
    """The leaves of a call's ``(args, kwargs)`` (tuples, lists and dicts opened), each leaf's name (the parameter
    name, or ``input i`` for a positional argument without one, then ``[k]`` steps into a container), and the
    tree to rebuild the call from."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path((list(args), dict(kwargs)), is_leaf=_is_leaf)
    names = []
    for path, _ in with_paths:
        where, at = _step(path[0]), _step(path[1])
        base = (positional[int(at)] if int(at) < len(positional) else f"input {at}") if where == "0" else at
        names.append(base + "".join(f"[{_step(k)}]" for k in path[2:]))
    return [leaf for _, leaf in with_paths], names, treedef


def torch_floats(torch_call: tuple[list[Any], dict[str, Any]] | None, inputs: Sequence[np.ndarray]):
    """torch's floating inputs of one call, named, positional then keyword: from its whole recorded call when there
    is one (``hidden_states=`` included), else its record's ``inputs``."""
    if torch_call is None:
        return [(f"input {i}", x) for i, x in enumerate(inputs)]
    leaves, names, _ = named_leaves(*torch_call)
    return [(n, x) for n, x in zip(names, leaves) if _is_floating_array(x)]


@dataclasses.dataclass
class Sources:
    """The port outputs of the recorded pairs, for provenance: ``by_print`` maps the fingerprint of a pair's port
    output to ``(end, torch path, port output, torch output)`` of each pair that returned it."""

    by_print: dict[bytes, list[tuple[int, str, np.ndarray, np.ndarray]]]

    @classmethod
    def of(cls, pairs: Pairs, torch_records: Records, flax_records: Records, ends: Mapping[str, int]) -> Sources:
        """From each pair's records (``flax_records`` by torch path) and ``ends``: torch path -> when its port
        call returned."""
        found: dict[bytes, list[tuple[int, str, np.ndarray, np.ndarray]]] = {}
        for path, (_, f_outs) in flax_records.items():
            if path not in pairs.modules or path not in torch_records or path not in ends:
                continue
            for f, t in zip(f_outs, torch_records[path][1]):
                found.setdefault(fingerprint(f), []).append((ends[path], path, np.asarray(f), t))
        return cls(found)

    def before(self, start: int, leaf) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """The pairs (latest first) whose port output, returned before ``start``, holds ``leaf``'s values."""
        found = [s for s in self.by_print.get(fingerprint(leaf), []) if s[0] < start]
        return [s[1:] for s in sorted(found, key=lambda s: s[0], reverse=True)]


def _from_source(pairs: Pairs, source: tuple[str, np.ndarray, np.ndarray], leaf) -> np.ndarray | None:
    """The source pair's torch output in the layout ``leaf`` has (``leaf`` is exactly the pair's port output, an
    axis permutation or a reshape of it); ``None`` where it is none of those or torch's does not fit."""
    path, f_out, t_out = source
    moved = pairs.to_flax(path, t_out, f_out.shape, "output")
    if isinstance(moved, str) or np.shape(moved) != f_out.shape:
        return None
    leaf = np.asarray(leaf)
    if leaf.shape == f_out.shape and np.array_equal(leaf, f_out):
        return moved
    if (perm := exact_permutation(f_out, leaf)) is not None:
        return np.transpose(moved, perm)
    if leaf.size == f_out.size and np.array_equal(leaf.reshape(-1), f_out.reshape(-1)):
        return np.reshape(moved, leaf.shape)  # the port reshaped the pair's output: the same values, its shape
    return None


def _twins_argument(pairs: Pairs, path: str, source, argument: np.ndarray, leaf) -> np.ndarray | None:
    """The twin's own recorded torch ``argument`` (it holds the values of ``source``'s torch output) in the layout of
    the port's ``leaf`` (which holds ``source``'s port output): through the pair's own input layout, else through
    the source pair's layout and the port's own rearrangement of its output; ``None`` where neither fits."""
    taken = pairs.to_flax(path, argument, np.shape(leaf))
    if not isinstance(taken, str) and np.shape(taken) == np.shape(leaf):
        return np.asarray(taken)
    _, _, t_out = source
    t_out = np.asarray(t_out)
    if argument.shape == t_out.shape and np.array_equal(argument, t_out):
        as_output = argument
    elif (perm := exact_permutation(argument, t_out)) is not None:
        as_output = np.transpose(argument, perm)
    elif argument.size == t_out.size and np.array_equal(argument.reshape(-1), t_out.reshape(-1)):
        as_output = argument.reshape(t_out.shape)
    else:
        return None
    return _from_source(pairs, (source[0], source[1], as_output), leaf)


@dataclasses.dataclass
class Replay:
    """A recorded port call with torch's values in it: what to call the module with, and the floating arguments
    that kept the port's own value."""

    args: list[Any]
    kwargs: dict[str, Any]
    kept: list[str]


def _with_torch_integers(leaves: list[Any], integers: Sequence[tuple[Any, np.ndarray]]) -> list[Any]:
    """``leaves`` with their integer arrays replaced by torch's (``integers``: the pair's, flax's and torch's in call
    order; :attr:`Pairs.integers`), each in the port's dtype: a module run alone is given torch's ids."""
    at = [i for i, leaf in enumerate(leaves) if _is_integer_array(leaf)]
    if not integers or len(at) != len(integers):
        return leaves
    out = list(leaves)
    for i, (_, torch_ids) in zip(at, integers):
        out[i] = jnp.asarray(torch_ids, leaves[i].dtype)
    return out


def replay_arguments(
    pairs: Pairs,
    path: str,
    call: PortCall,
    torch_inputs: Sequence[tuple[str, np.ndarray]],
    sources: Sources | None,
    constants: Collection[str] = (),
) -> Replay | str:
    """The port's recorded ``call`` of the module paired at torch ``path`` with its floating arrays replaced by
    torch's values (see the module docstring for the rule; ``torch_inputs`` from :func:`torch_floats`;
    ``constants``: the names of the call's floating arguments that are not activations, kept); each
    replaced value keeps the port's dtype unless that is narrower than torch's (a port's cast to bfloat16 before
    the call is its caller's code). Or why the call cannot isolate the module: torch recorded floating inputs the
    port's call has no floating argument for, or none of the call's floating arguments could take torch's."""
    leaves, names, treedef = named_leaves(call.args, call.kwargs, call.positional)
    leaves = _with_torch_integers(leaves, pairs.integers.get(path, []))
    floating = [i for i, leaf in enumerate(leaves) if _is_floating_array(leaf)]
    constant = [names[i] for i in floating if names[i] in constants]
    floats = [i for i in floating if names[i] not in constants]
    if not floats:
        if torch_inputs and not constant:
            return "the flax call has no floating argument to put torch's inputs in"
        f_args, f_kwargs = jax.tree_util.tree_unflatten(treedef, leaves)  # torch's integers in it, where they pair
        return Replay(list(f_args), dict(f_kwargs), constant)
    out, kept, explained, pending = list(leaves), list(constant), set(), []
    own = {fingerprint(x): x for _, x in torch_inputs}  # the twin's own recorded torch arguments, by their values
    made_by: dict[int, str] = {}  # the leaves that are an earlier pair's port output: that pair
    for i in floats:
        found = sources.before(call.start, leaves[i]) if sources is not None else []
        if found:
            made_by[i] = found[0][0]
        for source in found:
            twins = own.get(fingerprint(source[2]))  # the twin's argument that stands for that pair's output
            moved = None if twins is None else _twins_argument(pairs, path, source, twins, leaves[i])
            if moved is not None:
                out[i] = moved
                explained.add(fingerprint(source[2]))
                break
        else:
            pending.append(i)
    remaining = [(n, x) for n, x in torch_inputs if fingerprint(x) not in explained]
    why = None
    for i in pending:
        named = [k for k, (n, _) in enumerate(remaining) if n == names[i]]
        for k in named or range(min(1, len(remaining))):  # the same keyword's, else the next in order
            taken = pairs.to_flax(path, remaining[k][1], np.shape(leaves[i]))
            if not isinstance(taken, str) and np.shape(taken) == np.shape(leaves[i]):
                out[i] = taken
                remaining.pop(k)
                break
            fit = taken if isinstance(taken, str) else f"torch's {np.shape(taken)} is not {np.shape(leaves[i])}"
            why = why or fit
        else:
            if i in made_by:  # an activation torch's twin has no argument for: nothing of torch's to run it on
                return (
                    f"{names[i]}: the port passes {made_by[i]}'s output there, and torch's call recorded no argument "
                    "for it (torch's twin takes it in another form or not at all), so the module is not run alone"
                )
            kept.append(names[i])
    if len(kept) == len(floats) + len(constant):
        if not torch_inputs:
            return "torch's call recorded no floating input to put in the flax call's place"
        return f"input 0: {why}" if why else "no floating argument of the flax call takes torch's inputs"
    for i in floats:
        if out[i] is not leaves[i]:
            moved = np.asarray(out[i])
            out[i] = jnp.asarray(moved, np.promote_types(leaves[i].dtype, moved.dtype))
    f_args, f_kwargs = jax.tree_util.tree_unflatten(treedef, out)
    return Replay(list(f_args), dict(f_kwargs), kept)


def replays(
    pairs: Pairs,
    torch_records: Records,
    torch_calls: Calls | None,
    flax_records: Records,
    port_calls: Mapping[str, PortCall],
) -> Callable[[str, PortCall], Replay | str]:
    """:func:`replay_arguments` prepared for every pair: ``prepare(torch path, its port call)``. ``port_calls``
    are the port's recorded calls by flax name (for when each returned); provenance reads the pairs' records."""
    ends = {t: port_calls[f].end for t, f in pairs.flax_paths.items() if f in port_calls}
    sources = Sources.of(pairs, torch_records, flax_records, ends)

    def prepare(path: str, call: PortCall) -> Replay | str:
        inputs = torch_floats((torch_calls or {}).get(path), torch_records.get(path, ([], []))[0])
        constants = pairs.constants.get(pairs.flax_paths.get(path, ""), set())
        return replay_arguments(pairs, path, call, inputs, None if path == WHOLE_MODEL else sources, constants)

    return prepare


def nudged(tree: Any) -> Any:
    """``tree`` with every floating array leaf ``x`` moved to ``x + (|x| + 1) / 64``, the rest as it is: the second run
    of :func:`constant_arguments`. No finite value stays (an affine nudge would keep its fixed point). Computed in
    NumPy and put back where the leaf was: no XLA compile for each shape of parameter."""

    def move(x):
        if not _is_floating_array(x):
            return x
        if isinstance(x, jax.core.Tracer) or not isinstance(x, (np.ndarray, jax.Array)):
            return x + (abs(x) + 1) * 2**-6
        values = np.asarray(x)
        with np.errstate(over="ignore"):  # a value near its dtype's largest moves to inf: it moved
            moved = np.abs(values)  # one new array, then in place: a large model's parameters are not copied again
            moved += 1
            moved *= 2**-6
            moved += values
        if not isinstance(x, jax.Array):
            return moved
        return placed_like(moved, x)

    return jax.tree.map(move, tree)


def constant_arguments(calls: Mapping[str, PortCall], again: Mapping[str, PortCall]) -> dict[str, set[str]]:
    """By call name, the floating arguments of each recorded port call (``calls``) whose values are the same, bit for
    bit, in ``again``: the same calls recorded in a second run with the port's floating inputs and parameters
    :func:`nudged`. Those do not depend on them (a mask built from ids, a table from constants, an empty cache):
    they are not activations, and isolation keeps the port's own value. Decided from the computation; the values
    under test decide nothing (both runs are the port's)."""
    found: dict[str, set[str]] = {}
    for name, call in calls.items():
        other = again.get(name)
        if other is None or other.method != call.method:
            continue
        leaves, names, _ = named_leaves(call.args, call.kwargs, call.positional)
        others, other_names, _ = named_leaves(other.args, other.kwargs, other.positional)
        if names != other_names:
            continue
        same = {
            n
            for n, a, b in zip(names, leaves, others)
            if _is_floating_array(a) and np.shape(a) == np.shape(b) and np.array_equal(np.asarray(a), np.asarray(b))
        }
        if same:
            found[name] = same
    return found


def call_signature(calls: Mapping[str, PortCall]) -> dict[str, tuple]:
    """By call name, each recorded call's method and its floating arguments' names and shapes: two
    runs of a port (in float64 and in float32) with the same signature made the same calls, so the arguments
    :func:`constant_arguments` found constant in one are the constant ones of the other."""
    found = {}
    for name, call in calls.items():
        leaves, names, _ = named_leaves(call.args, call.kwargs, call.positional)
        floating = tuple((n, np.shape(x)) for n, x in zip(names, leaves) if _is_floating_array(x))
        found[name] = (call.method, floating)
    return found


# ---- rematerialisation, transparent while recording

TRACED = (
    "called inside a traced transform (a scan, vmap or jit: nn.scan, nnx.scan, vmap over stacked layers): its "
    "values are not concrete, so it is not recorded"
)

_on = threading.local()
_lock = threading.Lock()
_saved: dict[str, Any] = {}


def _transparent(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def checkpoint(fun: Any = None, *args: Any, **kwargs: Any) -> Any:
        if getattr(_on, "depth", 0) and callable(fun):
            return fun  # rematerialisation changes no value: the function itself, eagerly, its submodules recorded
        return original(fun, *args, **kwargs)

    return checkpoint


@contextlib.contextmanager
def transparent_remat() -> Iterator[None]:
    """While active on this thread, ``jax.checkpoint``/``jax.remat`` wrap nothing (Linen's ``nn.remat`` asks for
    them at each call), so that the calls inside a rematerialised block run eagerly and are recorded;
    rematerialisation changes when values are computed, never what they are. Other threads see JAX unchanged."""
    with _lock:
        if not _saved:
            for name in ("checkpoint", "remat"):
                _saved[name] = getattr(jax, name)
                setattr(jax, name, _transparent(_saved[name]))
        _saved["users"] = _saved.get("users", 0) + 1
    _on.depth = getattr(_on, "depth", 0) + 1
    try:
        yield
    finally:
        _on.depth -= 1
        with _lock:
            _saved["users"] -= 1
            if not _saved["users"]:
                for name in ("checkpoint", "remat"):
                    setattr(jax, name, _saved[name])
                _saved.clear()
