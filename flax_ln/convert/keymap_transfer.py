"""Loading and exporting through a :class:`~flax_ln.convert.KeyMap`.

:func:`fill_tree` fills any :class:`~flax_ln.convert.trees.VariableTree` (an ``nnx.Module``
too) and returns the :class:`~flax_ln.convert.KeyPlan` it filled by, or fills by a plan
given; :func:`load_with_key_map` and :func:`export_with_key_map` are
:func:`~flax_ln.convert.load_torch_state_dict` and :func:`~flax_ln.convert.to_torch_state_dict`
with ``weights=``. Without ``like=``, export writes torch's keys from each rule's regex
(a literal with groups): the inversion below.
"""

from __future__ import annotations

import itertools
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from flax_ln.convert.assign import ModuleT, as_numpy, dtype_problem
from flax_ln.convert.errors import ConversionError
from flax_ln.convert.keymap import (
    KeyMap,
    KeyPlan,
    Target,
    array_specs,
    assemble,
    key_map_error,
    match_targets,
    target_labels,
)
from flax_ln.convert.keymap_syntax import Region, parse_region, region_index, region_name, split_template, whole_region
from flax_ln.convert.layouts import NeedsTorchShape, Shape
from flax_ln.convert.ties import find_ties
from flax_ln.convert.trees import (
    EquinoxTree,
    NNXTree,
    VariableTree,
    as_variable_tree,
    is_equinox_module,
    require_module,
)

_EXPORT = "the model does not export through its key map"


def _double_fills(plan: KeyPlan, ties: Mapping[str, Sequence[str]], value: Callable[[Target], np.ndarray]) -> list:
    """Variables (or slices) filled more than once with values that differ: by keys that are not aliases of one
    tensor, or by aliases (one key's tuple template too) through different layouts. Aliases through one layout
    are the same value and are not compared."""
    alias_group = {k: name for name, keys in ties.items() for k in keys}
    fills: dict[tuple[str, Region], list[Target]] = {}
    for ts in plan.targets.values():
        for t in ts:
            fills.setdefault(t.at, []).append(t)
    problems = []
    for filled in fills.values():
        aliases = len({alias_group.get(t.key, t.key) for t in filled}) == 1
        if len(filled) < 2 or (aliases and len({(t.layout, t.affine) for t in filled}) == 1):
            continue
        first = value(filled[0])
        if not all(np.array_equal(first, value(t)) for t in filled[1:]):
            why = (
                "aliases of one torch tensor through different layouts or affine changes ("
                + ", ".join(f"{t.layout} {t.affine}" for t in filled)
                + "), whose values differ after them; give every alias the same layout and affine"
                if aliases
                else "which are not aliases of one torch tensor and differ in value"
            )
            problems.append(
                (filled[0].name, f"filled by {target_labels(filled)}, {why}; map only one of them to this variable")
            )
    return problems


def load_with_key_map(
    model: ModuleT, state_dict: Mapping[str, Any], key_map: KeyMap, *, strict: bool = True
) -> ModuleT:
    """:func:`~flax_ln.convert.load_torch_state_dict` with ``weights=key_map``: check all, then write."""
    if not isinstance(key_map, KeyMap):
        raise TypeError(f"weights= takes a KeyMap, got {type(key_map).__name__}")
    tree = EquinoxTree(model) if is_equinox_module(model) else getattr(model, "variable_tree", lambda: None)()
    if isinstance(tree, EquinoxTree):  # an Equinox module (or flax_ln.parity.Equinox) is immutable: a filled copy
        fill_tree(tree, state_dict, key_map, strict=strict)
        return tree.tree()
    fill_tree(NNXTree(require_module(model, "load_torch_state_dict")), state_dict, key_map, strict=strict)
    return model


def fill_tree(
    tree: nnx.Module | VariableTree,
    state_dict: Mapping[str, Any],
    key_map: KeyMap,
    *,
    strict: bool = True,
    ties: Mapping[str, Sequence[str]] | None = None,
    plan: KeyPlan | None = None,
) -> KeyPlan:
    """Fill ``tree``'s variables from a torch state dict through ``key_map``: check all, then write.

    Every problem (as :meth:`KeyMap.resolve` finds them, and double fills that are neither
    aliases of one tensor nor equal in value) is listed in one ``ConversionError`` and
    nothing is written. Returns the plan it filled by: the one :meth:`KeyMap.resolve`
    gives for the same ``ties``, so a caller that keeps it needs no second resolution.

    Args:
      tree: a :class:`~flax_ln.convert.trees.VariableTree`, or an ``nnx.Module`` (filled in place).
      state_dict: torch key -> tensor or array, in torch layout.
      key_map: the port's key map.
      strict: require every key matched and every required variable filled.
      ties: ``{canonical: (canonical, *aliases)}``; by default :func:`~flax_ln.convert.find_ties`
        of ``state_dict``.
      plan: a plan ``key_map`` resolved for this tree's variables (or a copy's) and a state dict
        of the same keys, shapes and dtypes (e.g. the weights whose tangents ``state_dict``
        holds): filled by, not resolved again, and returned. The state dict is checked against
        it (keys, shapes, dtype kinds), all problems in one ``ConversionError``.
    """
    tree = NNXTree(tree) if isinstance(tree, nnx.Module) else tree
    arrays = {k: as_numpy(v) for k, v in state_dict.items()}
    ties = find_ties(arrays) if ties is None else ties
    if plan is None:
        plan, problems = match_targets(key_map, tree, array_specs(arrays), ties, strict=strict, stacklevel=5)
    else:
        _check_fits(plan, tree, arrays, strict=strict)
        problems = {}
    converted: dict[tuple, np.ndarray] = {}

    def value(t: Target) -> np.ndarray:
        at = (t.key, t.at, t.layout, t.affine)  # one key may fill one variable through two layouts
        if at not in converted:
            converted[at] = np.asarray(t.to_flax(arrays[t.key]))
        return converted[at]

    doubles = _double_fills(plan, ties, value)
    if doubles:
        problems["unfilled"] = problems.get("unfilled", []) + doubles
    if problems:
        raise key_map_error(problems, tree=tree)
    write_by_plan(plan, tree, value, lambda path: plan.constants[path])
    return plan


def write_by_plan(
    plan: KeyPlan,
    tree: VariableTree,
    value: Callable[[Target], np.ndarray],
    constant: Callable[[str], np.ndarray] | None = None,
) -> None:
    """Write ``value(target)`` (in the target's flax layout) into every variable ``plan`` fills, with no checks,
    and ``constant(path)`` into each of its constants (``None``: constants are left as they are).

    The write step of :func:`fill_tree`, for values the plan already fits: the weights it checked, or
    the tangents of those weights (torch-named, the same keys, shapes and dtypes). A variable filled by
    regions is written whole from them; with regions absent (a plan of ``strict=False``) the rest keep
    their values.
    """
    variables = tree.variables()
    new: dict[str, dict[Region, np.ndarray]] = {}
    for ts in plan.targets.values():
        for t in ts:
            new.setdefault(t.path, {})[t.region] = value(t)
    values = {}
    for path, regions in new.items():
        shape = variables[path][0]
        if list(regions) == [whole_region(shape)]:
            values[path] = regions[whole_region(shape)]
            continue
        parts = [np.asarray(v) for v in regions.values()]
        if sum(p.size for p in parts) == int(np.prod(shape, dtype=np.int64)):  # they tile it (checked: no overlap)
            whole = np.empty(shape, np.result_type(*parts))
        else:  # strict=False with regions absent: the rest keep their values
            whole = np.array(tree.read(path))
        for region, part in zip(regions, parts):
            whole[region_index(region)] = part
        values[path] = whole
    if constant is not None:
        values.update({path: constant(path) for path in plan.constants})
    tree.write(values)


def _check_fits(plan: KeyPlan, tree: VariableTree, arrays: Mapping[str, np.ndarray], *, strict: bool) -> None:
    """Raise a ``ConversionError`` unless ``arrays`` hold the keys, shapes and dtype kinds ``plan`` was resolved for."""
    variables = tree.variables()
    missing = plan.targets.keys() - arrays.keys()
    unexpected = arrays.keys() - plan.targets.keys() if strict else set()
    mismatched: list[tuple[str, str]] = []
    unfilled: list[tuple[str, str]] = []
    for key, targets in plan.targets.items():
        for t in targets if key in arrays else ():
            if t.path not in variables:
                unfilled.append((t.path, "is not a variable of this tree; the plan was resolved for another model"))
                continue
            got = arrays[key]
            problem = (
                f"expected shape {t.torch_shape}, got {tuple(got.shape)}"
                if tuple(got.shape) != t.torch_shape
                else dtype_problem(got.dtype, variables[t.path][1])
            )
            if problem:
                mismatched.append((key, problem))
    if missing or unexpected or mismatched or unfilled:
        raise ConversionError(
            missing,
            unexpected,
            list(dict.fromkeys(mismatched)),
            unfilled=unfilled,
            header="the state dict does not fit the key plan it is filled by; nothing was loaded",
        )


def export_with_key_map(model: Any, key_map: KeyMap, like: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    """:func:`~flax_ln.convert.to_torch_state_dict` with ``weights=key_map`` (and ``like=``), from any variable tree
    (:func:`~flax_ln.convert.trees.as_variable_tree`)."""
    if not isinstance(key_map, KeyMap):
        raise TypeError(f"weights= takes a KeyMap, got {type(key_map).__name__}")
    tree = as_variable_tree(model, "to_torch_state_dict(weights=KeyMap(...))")
    if like is not None:
        like_arrays = {k: as_numpy(v) for k, v in like.items()}
        ties = find_ties(like_arrays)
        plan, problems = match_targets(key_map, tree, array_specs(like_arrays), ties)
        dtypes = {k: a.dtype for k, a in like_arrays.items()}
    else:
        like_arrays, ties = {}, {}
        specs, problems = _invert(key_map, tree)
        if not problems:
            plan, problems = match_targets(key_map, tree, specs, ties, warn_unmatched=False)
        dtypes = {k: d for k, (_, d) in specs.items()}
        ignoring = [r.label for r in key_map.rules if not r.templates]
        if ignoring:
            warnings.warn(
                "to_torch_state_dict without like=: the torch keys these rules ignore are left out: "
                + ", ".join(ignoring)
                + "; pass like=torch_model.state_dict() to include them",
                stacklevel=3,
            )
    if problems:
        raise key_map_error(problems, _EXPORT, tree)
    host: dict[str, np.ndarray] = {}

    def torch_value(t: Target) -> np.ndarray:
        if t.path not in host:
            host[t.path] = tree.read(t.path)
        return np.asarray(t.to_torch(t.take(host[t.path])))

    out: dict[str, np.ndarray] = {}
    differ: list[tuple[str, str]] = []
    for key, ts in plan.targets.items():
        if not ts:
            continue
        if ts[0].slab is not None:  # a split key: the tensor reassembled from its slabs
            out[key] = assemble(ts, torch_value)
            for _, region in plan.dropped_slabs.get(key, ()):  # a slab the port does not hold: like='s values
                out[key][region_index(region)] = like_arrays[key][region_index(region)]
            continue
        copies = [torch_value(t) for t in ts]
        if not all(np.array_equal(copies[0], c) for c in copies[1:]):
            differ.append((key, f"is tied across {', '.join(t.name for t in ts)}, whose values differ"))
        out[key] = copies[0]
    for name, keys in ties.items():
        mapped = [k for k in keys if k in out]
        if not mapped:
            continue
        if not all(np.array_equal(out[mapped[0]], out[k]) for k in mapped[1:]):
            paths = ", ".join(t.name for k in mapped for t in plan.targets[k])
            differ.append(
                (
                    name,
                    f"torch ties {', '.join(map(repr, keys))} (one tensor), but the port's copies "
                    f"{paths} differ; make them equal before exporting",
                )
            )
        for k in keys:  # an alias the map ignores takes the tied value
            if k in plan.targets and k not in out:
                out[k] = out[mapped[0]]
    if differ:
        raise ConversionError(mismatched=differ, header=_EXPORT)
    order = list(like_arrays) if like is not None else list(out)
    return {
        k: np.array(out[k], dtype=dtypes[k], copy=True) if k in out else np.array(like_arrays[k], copy=True)
        for k in order
    }


def _template_regex(template: str) -> re.Pattern:
    """A regex that matches the flax names ``template`` expands to, its references as named groups."""
    parts, at, seen = [], 0, set()
    for ref in re.finditer(r"\\(\d+)|\\g<(\w+)>", template):
        parts.append(re.escape(template[at : ref.start()]))
        name = ref.group(1) or ref.group(2)
        group = f"g_{name}"
        parts.append(f"(?P={group})" if group in seen else f"(?P<{group}>.+?)")
        seen.add(group)
        at = ref.end()
    parts.append(re.escape(template[at:]))
    return re.compile("".join(parts))


def _literal_key(pattern: str, values: Mapping[str, str]) -> str | None:
    """The one key ``pattern`` matches when each capturing group takes ``values[number or name]``; else None.

    Outside groups the regex must be literal (escaped punctuation allowed, ``^`` and ``$``
    anchors dropped); a group whose value is not given must itself be literal.
    """
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1]
    out, i, number = [], 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if i + 1 >= len(pattern) or pattern[i + 1].isalnum():
                return None
            out.append(pattern[i + 1])
            i += 2
        elif c == "(":
            depth, j = 0, i
            while j < len(pattern):
                if pattern[j] == "\\":
                    j += 2
                    continue
                depth += {"(": 1, ")": -1}.get(pattern[j], 0)
                if depth == 0:
                    break
                j += 1
            body = pattern[i + 1 : j]
            name = None
            if body.startswith("?P<"):
                name, body = body[3:].split(">", 1)
            elif body.startswith("?"):
                return None
            number += 1
            inner = sum(1 for k, ch in enumerate(body) if ch == "(" and (k == 0 or body[k - 1] != "\\"))
            value = values.get(str(number), values.get(name or "", None))
            if value is None:
                value = _literal_key(body, {})
                if value is None:
                    return None
            out.append(value)
            number += inner
            i = j + 1
        elif c in ".^$*+?{}[]|)":
            return None
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _invert(key_map: KeyMap, tree: VariableTree) -> tuple[dict[str, tuple[Shape, np.dtype]], dict[str, list]]:
    """Torch keys, shapes and dtypes the map writes for ``tree``'s variables, found without ``like=``."""
    specs: dict[str, tuple[Shape, np.dtype]] = {}
    need_like: list[tuple[str, str]] = []
    unwritable: dict[str, list[str]] = {}
    produced: set[str] = set()
    variables = tree.variables()
    for rule in key_map.rules:
        if rule.splits:  # the torch tensor's shape is not the slabs': export reads it from like=
            need_like.append((rule.label, f"{rule.label} splits a torch tensor into slabs; pass like= to export it"))
            continue
        for template, layout in zip(rule.templates, rule.layouts):
            dotted, items = split_template(template)
            regex = _template_regex(dotted)
            for path, (shape, dtype, _) in variables.items():
                m = regex.fullmatch(path)
                if m is None:
                    continue
                for region, flax_shape, groups in _regions(items, shape, {g[2:]: v for g, v in m.groupdict().items()}):
                    name = region_name(path, region, shape)
                    key = _literal_key(rule.pattern, groups)
                    if key is None:  # a regex that is not a literal with groups: its keys cannot be written
                        unwritable.setdefault(name, []).append(rule.label)
                        continue
                    check = rule.regex.fullmatch(key)
                    if not check or _filled(check.expand(template), shape) != (path, region):
                        continue  # the template matches, but the regex does not: another rule's variable
                    produced.add(name)
                    try:
                        torch_shape = layout.torch_shape(flax_shape)
                    except NeedsTorchShape:
                        need_like.append(
                            (name, f"{rule.label}: layout {layout} needs torch's shapes to invert; pass like=")
                        )
                        continue
                    specs.setdefault(key, (torch_shape, dtype))
    for name, labels in unwritable.items():
        if name not in produced:
            for label in labels:
                need_like.append(
                    (name, f"{label} cannot write its torch key: the regex is not a literal with groups; pass like=")
                )
    need_like = list(dict.fromkeys(need_like))
    return specs, ({"unfilled": need_like} if need_like else {})


def _filled(written: str, shape: Shape) -> tuple[str, Region] | None:
    """``(dotted path, region)`` an expanded template fills in a variable of ``shape``; ``None`` if out of range."""
    dotted, items = split_template(written)
    if items is None:
        return dotted, whole_region(shape)
    try:
        return dotted, parse_region(items, shape)[0]
    except ValueError:
        return None


def _regions(items: str | None, shape: Shape, groups: Mapping[str, str]) -> list[tuple[Region, Shape, dict]]:
    """Every region an unexpanded suffix ``items`` can name in a variable of ``shape``, with its shape and the group
    values (``groups``, from the path, and one per reference among the items, each index of its axis)."""
    if items is None:
        return [(whole_region(shape), shape, dict(groups))]
    texts = [t.strip() for t in items.split(",")]
    choices: list[list[tuple[str, str | None]]] = []
    for axis, text in enumerate(texts):
        ref = re.fullmatch(r"\\(\d+)|\\g<(\w+)>", text)
        if ref is None:
            choices.append([(text, None)])
        else:
            size = shape[axis] if axis < len(shape) else 0
            choices.append([(str(i), ref.group(1) or ref.group(2)) for i in range(size)])
    out = []
    for combo in itertools.product(*choices):
        values = dict(groups)
        if any(g is not None and values.setdefault(g, v) != v for v, g in combo):
            continue  # one group, two values
        try:
            region, region_shape = parse_region(", ".join(v for v, _ in combo), shape)
        except ValueError:
            continue
        out.append((region, region_shape, values))
    return out
