"""Localisation: the first submodule whose output diverges, and isolated mode. Imports no torch."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln.convert import KeyPlan, LinenTree, rules
from flax_ln.convert.keymap import ArrayLayout, _parse_layout
from flax_ln.parity.call import is_float, run_forward
from flax_ln.parity.capture import (
    WHOLE_MODEL,
    Calls,
    Records,
    Unsupported,
    capture_flax,
    capture_linen,
    floating_leaves,
    scope_path,
)
from flax_ln.parity.policy import Tolerance, compare_tensors
from flax_ln.parity.report import FirstDivergence, Isolation, TensorResult


@dataclasses.dataclass
class Pairs:
    """Torch submodules paired with flax submodules, for localisation and isolated mode.

    ``modules``: torch path -> flax module (NNX; for Linen, its dotted scope path); ``flax_paths``: torch
    path -> dotted flax path (the root is :data:`WHOLE_MODEL` on both sides); ``layouts``: torch path -> the pair's own
    activation layout (torch -> flax), from ``modules=``; ``skipped``: torch path -> why a pair's
    activations could not be compared; ``key_map``: the pairs were found through a key map.
    """

    modules: dict[str, Any]
    flax_paths: dict[str, str]
    layouts: dict[str, ArrayLayout] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    key_map: bool = False
    orders: list[tuple[int, ...]] = dataclasses.field(default_factory=list)  # the inputs' torch -> flax axis orders


def _canonical_variables(root: nnx.Module) -> dict[int, str]:
    """id(variable) -> its canonical dotted path (the first path that reaches it, as ``nnx.state`` names it)."""
    names: dict[int, str] = {}
    for path, node in nnx.iter_graph(root):
        if isinstance(node, nnx.Variable):
            names.setdefault(id(node), ".".join(map(str, path)))
    return names


def _whole(names: frozenset, sizes: Mapping[str, int]) -> frozenset:
    """Flax variable names with every slice ``path[i]`` of a stacked variable collapsed into ``path`` when all
    its slices are there (a fused kernel filled from several torch keys); a part of a stack stays sliced."""
    slices: dict[str, set[str]] = {}
    for name in names:
        if name.endswith("]") and "[" in name:
            base, index = name[:-1].rsplit("[", 1)
            slices.setdefault(base, set()).add(index)
    out = set(names)
    for base, indices in slices.items():
        if len(indices) == sizes.get(base, -1):
            out -= {f"{base}[{i}]" for i in indices}
            out.add(base)
    return frozenset(out)


def _filled_and_sizes(plan: KeyPlan) -> tuple[set[str], dict[str, int]]:
    """The flax variables the plan fills, and the number of slices of each stacked one."""
    filled = {t.path for ts in plan.targets.values() for t in ts}
    sizes: dict[str, int] = {}
    for targets in plan.targets.values():
        for target in targets:
            if target.index is not None:
                sizes[target.path] = max(sizes.get(target.path, 0), target.index + 1)
    return filled, sizes


def _nnx_groups(root: nnx.Module, filled: set[str]) -> dict[frozenset, list[tuple[str, ...]]]:
    """The filled variables of each NNX submodule -> the submodules' paths."""
    canonical = _canonical_variables(root)
    flax_groups: dict[frozenset, list[tuple[str, ...]]] = {}
    for path, module in nnx.iter_modules(root):
        own = frozenset(
            canonical[id(node)]
            for _, node in nnx.iter_graph(module)
            if isinstance(node, nnx.Variable) and canonical.get(id(node)) in filled
        )
        if own:
            flax_groups.setdefault(own, []).append(tuple(map(str, path)))
    return flax_groups


def _by_parameters(
    flax_groups: Mapping[frozenset, list[tuple[str, ...]]],
    plan: KeyPlan,
    torch_keys: Sequence[str],
    removed: set[str],
    sizes: Mapping[str, int],
) -> dict[str, str]:
    """torch path -> flax path of the submodules whose parameters map exactly onto each other's (see
    :func:`pair_modules`); ``flax_groups``: each flax module's filled variables -> the modules' paths."""
    prefixes = {".".join(key.split(".")[:i]) for key in torch_keys for i in range(1, key.count(".") + 1)}
    torch_groups: dict[frozenset, list[str]] = {}
    for prefix in sorted(prefixes - removed):
        names = _whole(plan.flax_names(k for k in torch_keys if k.startswith(prefix + ".")), sizes)
        if names:
            torch_groups.setdefault(names, []).append(prefix)
    found: dict[str, str] = {}
    for names, torch_paths in torch_groups.items():
        flax_paths = sorted(flax_groups.get(names, []), key=len, reverse=True)  # innermost first
        for t, f in zip(sorted(torch_paths, key=lambda p: p.count("."), reverse=True), flax_paths):
            found[t] = ".".join(f) if f else WHOLE_MODEL
    return found


def pair_modules(
    flax_module: nnx.Module,
    *,
    plan: KeyPlan | None = None,
    torch_keys: Sequence[str] = (),
    modules: Mapping[str, Any] | None = None,
    orders: Sequence[tuple[int, ...]] = (),
) -> Pairs:
    """Each flax submodule under the torch path of its twin (the roots under :data:`WHOLE_MODEL`).

    The one place where torch paths and flax paths are paired.

    Without ``plan``: a flax path is mapped through the converter's registered renames
    (:func:`flax_ln.convert.rules.torch_module_paths`), else kept as it is (the module trees
    mirror each other).

    With ``plan`` (a :class:`~flax_ln.convert.KeyPlan` of the port's key map) and the torch
    state dict's ``torch_keys``: a torch submodule pairs with a flax submodule when the flax
    variables its keys fill are exactly the flax module's variables, at any depth. Where
    several modules on one side hold the same parameters (a wrapper and its only child),
    they pair innermost with innermost, then outwards.

    ``modules``: ``{torch_path: flax_path | (flax_path, layout) | None}`` adds a pair
    (a parameter-free module), gives a pair's activation layout (an einops pattern or a
    permutation triple, torch -> flax), or removes a pair (``None``; with a key map the torch
    module then takes no part in pairing, so that its wrapper pairs instead). ``orders``: the axis
    order of each compared input from torch's to flax's (``flax_inputs=``); where two axis
    permutations fit an activation's shapes (square images), the one the inputs use decides.
    """
    by_flax_path = {".".join(map(str, p)) or WHOLE_MODEL: m for p, m in nnx.iter_modules(flax_module)}
    if plan is None:
        torch_paths = rules.torch_module_paths(flax_module)  # flax path -> torch path
        flax_paths = {}
        for p, _ in nnx.iter_modules(flax_module):
            path = ".".join(map(str, p))
            flax_paths[torch_paths.get(path, path) or WHOLE_MODEL] = path or WHOLE_MODEL
    else:
        removed = {t for t, given in (modules or {}).items() if given is None}
        filled, sizes = _filled_and_sizes(plan)
        flax_paths = _by_parameters(_nnx_groups(flax_module, filled), plan, torch_keys, removed, sizes)
    return _given_pairs(flax_paths, by_flax_path, modules, orders, plan is not None, "as nnx.iter_modules")


def _given_pairs(
    flax_paths: dict[str, str],
    by_flax_path: Mapping[str, Any],
    modules: Mapping[str, Any] | None,
    orders: Sequence[tuple[int, ...]],
    key_map: bool,
    named: str,
) -> Pairs:
    """The automatic pairs ``flax_paths`` (torch path -> flax path), the roots and ``modules=`` added."""
    flax_paths[WHOLE_MODEL] = WHOLE_MODEL
    layouts: dict[str, ArrayLayout] = {}
    for torch_path, given in (modules or {}).items():
        if given is None:
            flax_paths.pop(torch_path, None)
            continue
        path, layout = given if isinstance(given, tuple) else (given, None)
        if path not in by_flax_path:
            raise ValueError(
                f"modules={{{torch_path!r}: {path!r}}}: the flax model has no module at {path!r}; its modules: "
                f"{sorted(p for p in by_flax_path if p != WHOLE_MODEL)[:12]} ... (dotted paths, {named})"
            )
        flax_paths[torch_path] = path
        if layout is not None:
            layouts[torch_path] = _parse_layout(layout)
    paired = {t: by_flax_path[f] for t, f in flax_paths.items() if f in by_flax_path}
    hints = [tuple(o) for o in orders if tuple(o) != tuple(range(len(o)))]
    return Pairs(paired, flax_paths, layouts, {}, key_map, hints)


def _permutation(source: tuple, target: tuple, hints: Sequence[tuple[int, ...]] = ()) -> tuple[int, ...] | str:
    """The unique ``p`` with ``source[p] == target``, else the reason there is none.

    Among several (repeated sizes), the one of ``hints`` (the inputs' own axis orders) if exactly one
    is there, else the identity if the shapes are equal and no hint has this many axes.
    """
    source, target = tuple(source), tuple(target)
    found = {p for p in itertools.permutations(range(len(source))) if tuple(source[i] for i in p) == target}
    hinted = found & set(hints)
    if len(found) == 1 or len(hinted) == 1:
        return (found if len(found) == 1 else hinted).pop()
    if source == target and not any(len(h) == len(source) for h in hints):
        return tuple(range(len(source)))
    if not found:
        return f"shapes {source} and {target} are not one axis permutation apart"
    return (
        f"shapes {source} and {target} are {len(found)} axis permutations apart (ambiguous); "
        "give the pair's layout in modules={torch_path: (flax_path, 'einops pattern')}"
    )


def _to_torch(pairs: Pairs, path: str, module, array, torch_shape) -> np.ndarray | str:
    """A flax activation of the pair at ``path`` in torch's layout, or why it cannot be put there."""
    layout = pairs.layouts.get(path)
    try:
        if layout is not None:
            return np.asarray(layout.to_torch(np.asarray(array), tuple(torch_shape)))
    except ValueError as err:
        return str(err)
    if not pairs.key_map or rules._activation_layout(module) is not None:
        return np.asarray(rules.torch_activation(module, array))
    inverse = [tuple(int(i) for i in np.argsort(o)) for o in pairs.orders]  # flax -> torch
    perm = _permutation(np.shape(array), torch_shape, inverse)
    return perm if isinstance(perm, str) else np.transpose(np.asarray(array), perm)


def _to_flax(pairs: Pairs, path: str, module, array: np.ndarray, flax_shape) -> np.ndarray | str:
    """A torch activation of the pair at ``path`` in the flax module's layout, or why it cannot be put there."""
    layout = pairs.layouts.get(path)
    try:
        if layout is not None:
            return np.asarray(layout.to_flax(array, tuple(flax_shape)))
    except ValueError as err:
        return str(err)
    if flax_shape is None or rules._activation_layout(module) is not None:
        return np.asarray(rules.flax_activation(module, array))
    perm = _permutation(array.shape, flax_shape, pairs.orders)
    return perm if isinstance(perm, str) else np.transpose(array, perm)


def _within_tolerance(r: TensorResult) -> bool:
    """Whether a module's own error is within its tolerance, NaN or Inf at the same places on both sides
    allowed (an input that holds NaN gives NaN on both sides: that is not the module's own error)."""
    if r.problem is not None or not math.isfinite(r.relative_error):
        return False
    return r.relative_error <= r.tolerance.rtol or r.max_abs_error <= r.tolerance.atol


def _compare_activations(
    label: str, module, flax_arrays: list, torch_arrays: list, tolerance: Tolerance, pairs: Pairs, path: str
) -> list[TensorResult]:
    """Flax activations (put into torch's layout) against torch's, pairwise; pairs of different shapes are
    skipped (with a key map, the reason is kept in ``pairs.skipped``)."""
    results = []
    for i, (f, t) in enumerate(zip(flax_arrays, torch_arrays)):
        moved = _to_torch(pairs, path, module, f, t.shape)
        if isinstance(moved, str):
            pairs.skipped.setdefault(path, f"{label} {i}: {moved}")
        elif moved.shape == t.shape:
            results.append(compare_tensors(f"{label} {i}", f"module {label}", moved, t, tolerance))
    return results


def localize(
    torch_records: Records, flax_module: nnx.Module, flax_inputs, kwargs, forward, tolerance: Tolerance, *, pairs: Pairs
) -> tuple[list[TensorResult], FirstDivergence | None, Records]:
    """Every submodule's output error, in torch execution order, and the first that diverges.

    Submodules are paired by :func:`pair_modules` (``pairs``). A flax activation is put into
    torch's layout first: the pair's own layout, else the converter's layout rule for the
    module type (channels-last Conv output to channels-first), else, with a key map, the
    unique axis permutation from one shape to the other (an ambiguous pair is skipped, the
    reason in ``pairs.skipped``). The first divergence also reports the errors of that
    submodule's inputs, so a broken module can be told from one fed broken data. Errors
    compound down the stack; :func:`isolate` does not let them.

    Returns:
      the errors, the first divergence, and the flax records by torch path (for :func:`isolate`).
    """
    f_args = [jnp.asarray(x) for x in flax_inputs]
    f_kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    records = capture_flax(flax_module, lambda: run_forward(forward, flax_module, f_args, f_kwargs))
    flax_records = {t: records[f] for t, f in pairs.flax_paths.items() if f in records}
    return (*_first_divergence(torch_records, flax_records, tolerance, pairs), flax_records)


def _first_divergence(
    torch_records: Records, flax_records: Records, tolerance: Tolerance, pairs: Pairs
) -> tuple[list[TensorResult], FirstDivergence | None]:
    """Every paired submodule's output error (``flax_records`` by torch path), and the first that diverges."""
    errors, divergence = [], None
    for path, (t_ins, t_outs) in torch_records.items():
        if path not in flax_records or path not in pairs.modules:
            continue
        module = pairs.modules[path]
        f_ins, f_outs = flax_records[path]
        outputs = _compare_activations("output", module, f_outs, t_outs, tolerance, pairs, path)
        if not outputs:
            continue
        worst = max(outputs, key=lambda r: r.excess)
        errors.append(dataclasses.replace(worst, name=path))
        if divergence is None and not worst.passed:
            inputs = _compare_activations("input", module, f_ins, t_ins, tolerance, pairs, path)
            divergence = FirstDivergence(path, inputs, outputs, pairs.flax_paths[path], pairs.key_map)
    return errors, divergence


def _positional_count(module) -> int | None:
    """How many positional arrays ``module``'s call needs (its positional parameters without defaults);
    ``None`` when it takes any number."""
    try:
        params = inspect.signature(module.__call__).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is p.empty for p in params)


def _key_map_call(pairs: Pairs, path: str, module, args, kwargs, flax_record) -> tuple[list, dict] | str:
    """The arguments for the port's module from torch's recorded call, or why there are none.

    torch's recorded arrays (positional ones; keyword ones, in call order, when it passed none
    positionally), as many as the module's signature needs; floating ones in its layout (the
    pair's own, the module type's, or the unique permutation onto the shape the port's module
    took in the full run). Torch's keyword arguments are torch's names and are not passed.
    """
    arrays = [a for a in args if isinstance(a, np.ndarray)] or [v for v in kwargs.values() if isinstance(v, np.ndarray)]
    need = _positional_count(module)
    need = len(arrays) if need is None else need
    if len(arrays) < need:
        return f"its call takes {need} positional arrays; torch's call has {len(arrays)}"
    flax_shapes = [np.shape(x) for x in (flax_record[0] if flax_record is not None else [])]
    out, j = [], 0
    for a in arrays[:need]:
        if is_float(a):
            moved = _to_flax(pairs, path, module, a, flax_shapes[j] if j < len(flax_shapes) else None)
            if isinstance(moved, str):
                return f"input {j}: {moved}"
            out.append(jnp.asarray(moved))
            j += 1
        else:
            out.append(jnp.asarray(a))
    return out, {}


def isolate(
    torch_records: Records,
    torch_calls: Calls,
    flax_module: nnx.Module,
    tolerance: Tolerance,
    *,
    pairs: Pairs,
    flax_records: Records | None = None,
) -> Isolation:
    """Each flax submodule run on its torch twin's recorded inputs, alone: which module's own computation differs.

    For every recorded torch call, the flax module paired with it (:func:`pair_modules`) is
    called eagerly on the same arguments (floating arrays put into the flax layout by
    :func:`flax_ln.convert.rules.flax_activation`; integer and boolean arrays and plain
    values as they are) and its output is compared with torch's recorded output. With a key
    map, the port's module gets torch's arrays only (see :func:`_key_map_call`), in its
    layout. An error here cannot come from upstream, so a deep run names the module that
    differs. A call with an argument that is not data (a callable, a module), or one the
    flax module does not accept, is skipped with the reason. ``culprits`` are the
    failing modules none of whose own submodules fails; a module whose own error is within
    tolerance (NaN at the same places on both sides allowed) is never one. ``flax_culprits``
    are their flax paths.
    """

    def to_flax(module, value):
        if isinstance(value, np.ndarray):
            return jnp.asarray(rules.flax_activation(module, value) if is_float(value) else value)
        if isinstance(value, (tuple, list)):
            return type(value)(to_flax(module, v) for v in value)
        return value

    results, skipped = [], {}
    for path, (args, kwargs) in torch_calls.items():
        module = pairs.modules.get(path)
        t_outs = torch_records.get(path, ([], []))[1]
        unsupported = [v for v in [*args, *kwargs.values()] if isinstance(v, Unsupported)]
        if module is None:
            skipped[path] = "no flax twin at this path" if not pairs.key_map else "no flax module holds its parameters"
            continue
        if pairs.key_map:
            prepared = _key_map_call(pairs, path, module, args, kwargs, (flax_records or {}).get(path))
            if isinstance(prepared, str):
                skipped[path] = prepared
                continue
            f_args, f_kwargs = prepared
        elif unsupported:
            skipped[path] = f"takes a {unsupported[0]} argument, which a record cannot hold"
            continue
        else:
            f_args = [to_flax(module, a) for a in args]
            f_kwargs = {k: to_flax(module, v) for k, v in kwargs.items()}
        if t_outs:
            try:
                out = module(*f_args, **f_kwargs)
            except Exception as err:  # noqa: BLE001 - any failure to call is reported as the reason it was skipped
                skipped[path] = f"the flax call on torch's arguments raised {type(err).__name__}: {str(err)[:120]}"
                continue
            compared = _compare_activations("output", module, floating_leaves(out), t_outs, tolerance, pairs, path)
            if compared:
                results.append(dataclasses.replace(max(compared, key=lambda r: r.excess), name=path))
            else:
                skipped[path] = pairs.skipped.get(path, "its outputs do not match torch's in number or shape")
    return _isolation(results, skipped, pairs)


def _isolation(results: list[TensorResult], skipped: dict[str, str], pairs: Pairs) -> Isolation:
    """The culprits: the failing modules none of whose own submodules fails (see :func:`isolate`)."""
    failing = [r.name for r in results if not _within_tolerance(r)]

    def inside(child: str, parent: str) -> bool:
        return parent == WHOLE_MODEL and child != WHOLE_MODEL or child.startswith(parent + ".")

    culprits = [p for p in failing if not any(inside(q, p) for q in failing if q != p)]
    return Isolation(results, skipped, culprits, [pairs.flax_paths[p] for p in culprits])


# ---------------------------------------------------------------------------------------------
# Linen: submodules by scope path, recorded (and run on torch's inputs) during one apply


def _linen_groups(tree: LinenTree, filled: set[str], recorded: Iterable[str]) -> dict[frozenset, list[tuple[str, ...]]]:
    """The filled variables under each Linen scope path -> the scope paths (every prefix of a variable's
    scope, and every module that ran)."""
    scopes = {name: tree.scope(name) for name in filled}
    paths = {scope[:i] for scope in scopes.values() for i in range(len(scope) + 1)}
    paths |= {tuple(p.split(".")) if p != WHOLE_MODEL else () for p in recorded}
    groups: dict[frozenset, list[tuple[str, ...]]] = {}
    for path in sorted(paths):
        own = frozenset(name for name, scope in scopes.items() if scope[: len(path)] == path)
        if own:
            groups.setdefault(own, []).append(path)
    return groups


def localize_linen(
    torch_records: Records,
    forward: Callable[[], Any],
    tree: LinenTree,
    plan: KeyPlan,
    torch_keys: Sequence[str],
    tolerance: Tolerance,
    modules: Mapping[str, Any] | None = None,
    orders: Sequence[tuple[int, ...]] = (),
) -> tuple[list[TensorResult], FirstDivergence | None, Pairs]:
    """:func:`localize` for a Linen module: ``forward()`` runs one ``apply`` eagerly, during which every
    submodule's inputs and outputs are recorded by dotted scope path (:func:`capture_linen`); submodules pair
    with torch's by their parameters, as with a key map (:func:`pair_modules`), ``modules=`` naming scope paths.

    Returns:
      the errors, the first divergence, and the pairs (for :func:`isolate_linen`).
    """
    records = capture_linen(forward)
    filled, sizes = _filled_and_sizes(plan)
    removed = {t for t, given in (modules or {}).items() if given is None}
    groups = _linen_groups(tree, filled, records)
    flax_paths = _by_parameters(groups, plan, torch_keys, removed, sizes)
    known = {".".join(p) or WHOLE_MODEL for ps in groups.values() for p in ps} | set(records)
    pairs = _given_pairs(flax_paths, {p: p for p in known}, modules, orders, True, "Linen scope paths")
    flax_records = {t: records[f] for t, f in pairs.flax_paths.items() if f in records}
    return (*_first_divergence(torch_records, flax_records, tolerance, pairs), pairs)


def _substitute(pairs: Pairs, path: str, args: Sequence[Any], torch_inputs: list[np.ndarray]) -> tuple | str:
    """The flax call's positional ``args`` with their floating arrays replaced, in order, by torch's recorded
    floating inputs put into the flax layout (each onto the shape flax's own had); or why they cannot be."""
    leaves, treedef = jax.tree_util.tree_flatten(list(args))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return "its call is traced (inside nn.scan, nn.remat or another transform): it cannot be run alone"
    floats = [i for i, x in enumerate(leaves) if isinstance(x, (np.ndarray, jax.Array)) and is_float(x)]
    if floats and not torch_inputs:
        return "torch's call has no floating positional input to put in place of flax's"
    for k, i in enumerate(floats[: len(torch_inputs)]):
        moved = _to_flax(pairs, path, pairs.modules[path], torch_inputs[k], np.shape(leaves[i]))
        if isinstance(moved, str):
            return f"input {k}: {moved}"
        leaves[i] = jnp.asarray(moved, leaves[i].dtype)
    return tuple(jax.tree_util.tree_unflatten(treedef, leaves))


def isolate_linen(
    torch_records: Records, forward: Callable[[], Any], tolerance: Tolerance, *, pairs: Pairs
) -> Isolation:
    """:func:`isolate` for a Linen module: the first call of each paired submodule is intercepted
    (``flax.linen.intercept_methods``) and made on torch's recorded inputs instead of its own (floating
    positional arrays, in order, in the flax layout; the other arguments as flax passed them), its own
    submodules running as usual; its output is recorded and passed on. One eager ``apply``
    (``forward()``) per nesting depth, so that no isolated module runs inside another. A submodule whose
    call is traced (an ``nn.scan`` body), or whose inputs do not fit, is skipped with the reason.
    """
    from flax import linen

    by_flax = {f: t for t, f in pairs.flax_paths.items() if t in pairs.modules and t in torch_records}
    outputs: dict[str, list[np.ndarray]] = {}
    skipped: dict[str, str] = {}

    def depth(path: str) -> int:
        return 0 if path == WHOLE_MODEL else path.count(".") + 1

    for level in sorted({depth(f) for f in by_flax}):
        done: set[str] = set()

        def interceptor(next_fun, args, kwargs, context, level=level, done=done):
            path = scope_path(context.module) if context.method_name != "setup" else ""
            torch_path = by_flax.get(path)
            if torch_path is None or path in done or depth(path) != level:
                return next_fun(*args, **kwargs)
            done.add(path)
            prepared = _substitute(pairs, torch_path, args, torch_records[torch_path][0])
            if isinstance(prepared, str):
                skipped[torch_path] = prepared
                return next_fun(*args, **kwargs)
            out = next_fun(*prepared, **kwargs)
            outputs[torch_path] = floating_leaves(out)
            return out

        try:
            with linen.intercept_methods(interceptor):
                forward()
        except Exception as err:  # noqa: BLE001 - any failure is reported as the reason these were not isolated
            reason = f"the flax apply on torch's inputs raised {type(err).__name__}: {str(err)[:120]}"
            skipped.update({t: reason for f, t in by_flax.items() if depth(f) == level and t not in outputs})
    results = []
    for torch_path, (_, t_outs) in torch_records.items():
        if torch_path not in by_flax.values() or torch_path in skipped:
            continue
        if torch_path not in outputs:
            skipped[torch_path] = "not called during the flax apply"
            continue
        module = pairs.modules[torch_path]
        compared = _compare_activations("output", module, outputs[torch_path], t_outs, tolerance, pairs, torch_path)
        if compared:
            results.append(dataclasses.replace(max(compared, key=lambda r: r.excess), name=torch_path))
        else:
            skipped[torch_path] = pairs.skipped.get(torch_path, "its outputs do not match torch's in number or shape")
    for torch_path in torch_records:
        if torch_path not in pairs.modules:
            skipped.setdefault(torch_path, "no flax module holds its parameters")
    return _isolation(results, skipped, pairs)
