r"""A port's own map from torch state-dict keys to its variables: :class:`KeyMap`, and its :class:`KeyPlan`.

The rule table of :mod:`flax_ln.convert.rules` serves models written as twins of their
torch modules. A port written on its own terms (its own names and nesting, fused
attention kernels, channels-last convolutions, tied embeddings kept as two copies) is
described instead by a table of its own, one rule per family of torch keys::

    key_map = KeyMap([
        # (torch key, a regex matched in full;  flax variable path template;  layout torch -> flax)
        (r"model\.embed_tokens\.weight", "embed.embedding", None),
        (r"lm_head\.weight", "head.kernel", "v d -> d v"),
        (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", r"blocks.\1.attn.q.kernel", "(n h) d -> d n h"),
        (r"model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.weight", r"blocks.\1.mlp.\2.kernel", "o i -> i o"),
        (r"model\.rotary\.inv_freq", None, None),  # a torch buffer the port recomputes: ignored
    ])
    load_torch_state_dict(port, hf_model.state_dict(), weights=key_map)
    state = to_torch_state_dict(port, weights=key_map, like=hf_model.state_dict())

The same rules may be given as a mapping ``{regex: (template, layout)}``. A rule may take a
fourth element, ``(regex, template, layout, affine)`` (``{regex: (template, layout, affine)}``).

**Templates.** ``re.Match.expand`` fills a template from the key's groups (``\1``,
``\g<name>``), giving a dotted path of attributes and sequence indices from the model
(``blocks.0.attn.q.kernel``). ``None`` ignores the key. A template ending in an index suffix
``[item, ...]`` fills a region of the variable: each item is ``:`` (the whole axis),
``start:stop`` or an integer, literal or a group reference, which selects one position and drops
that axis; missing trailing items mean ``:``. ``r"blocks.\1.qkv.kernel[:, 0:768]"`` is a fused
kernel's first columns, ``r"layers.kernel[\1]"`` slice ``i`` of a variable stacked along its
leading axis (a port that scans over layers), ``r"layers.kernel[:, \1]"`` one stacked on axis 1.
The torch tensor, after its layout, has the region's shape. A tuple of templates copies one
tensor into several variables (a checkpoint that stores a tied weight once).

**Affine changes** (:class:`~flax_ln.convert.keymap_syntax.Affine`): ``None`` or
``{"scale": s, "offset": o}`` (defaults 1 and 0; the scale nonzero, both finite), meaning
``flax = scale * layout(torch) + offset`` (a port storing ``1 + w``: ``{"offset": 1.0}``);
computed in float64, then cast. Export inverts it; gradients under torch's names and tangents
only scale. For a tuple of templates: ``None``, one dict for all, or a tuple of one per template.

**Constants.** ``KeyMap(rules, constants={flax path regex: value})`` fills the variables whose
canonical dotted path a regex matches in full with ``value`` (a number, broadcast, or an array of
the variable's shape): flax-only variables no torch key fills, no rule may fill, and no gradient is
compared for. :meth:`KeyMap.to_source` writes a map back as Python source.

**Layouts** (:mod:`flax_ln.convert.layouts`), from torch's layout to flax's:

* ``None``: the same array;
* an einops rearrange pattern, ``"(n h) d -> d n h"``: axes permuted, split or merged; the
  sizes the pattern does not fix come from the flax variable's shape;
* a ``(permutation, reshape, reshape_first)`` triple: reshape first if ``reshape_first``,
  then transpose by ``permutation``, then reshape if not ``reshape_first``; either part may
  be ``None``;
* an :class:`enum.Enum` member whose ``.value`` is one of the above;
* for a tuple of templates, ``None`` or a tuple of layouts of the same length.

**Strict.** Every torch key matches exactly one rule; every ``nnx.Param`` and
``nnx.BatchStat`` is filled exactly once (other variables only where a rule names them);
one region may be filled twice only by aliases of one torch tensor (a tie) through one
layout and affine change, or by values equal after them (aliases through different layouts
included); the regions filling one variable must tile it (no gap, no overlap).
Every problem is listed in one :class:`~flax_ln.convert.ConversionError` and nothing is loaded.
A rule that matches no key only warns, so the map that loads a full state dict also loads a
checkpoint saved without an alias.

**For comparisons.** :meth:`KeyMap.resolve` gives a :class:`KeyPlan`: for every torch key
its :class:`Target` variables (canonical dotted path, region, layout, affine), both directions of
each layout, the ties (:class:`~flax_ln.convert.Tie`, from :func:`~flax_ln.convert.find_ties`)
and the torch-named sum of flax gradients (:meth:`KeyPlan.torch_gradients`). Paths are
resolved through a :class:`~flax_ln.convert.trees.VariableTree`. Loading and exporting
through a map live in :mod:`flax_ln.convert.keymap_transfer`.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from flax_ln.convert.assign import as_numpy, dtype_problem
from flax_ln.convert.errors import ConversionError
from flax_ln.convert.keymap_syntax import (
    Region,
    Rule,
    constant_value,
    key_map_source,
    parse_region,
    parse_rule,
    region_name,
    slab_items,
    split_template,
    tiling_problems,
    whole_region,
)
from flax_ln.convert.keymap_target import Target, assemble
from flax_ln.convert.layouts import Shape, shape_only
from flax_ln.convert.ties import Tie, find_ties
from flax_ln.convert.trees import NNXTree, VariableTree


def _fix(tree: VariableTree | None) -> str:
    required = getattr(tree, "required_noun", NNXTree.required_noun)  # what this kind of tree must have filled
    return (
        "each torch key must match exactly one rule: add (regex, template, layout) for an unexpected key, or "
        f"(regex, None, None) to ignore it; each {required} must be named by a rule's template"
    )


class KeyMap:
    """A port's ordered table from torch state-dict keys (regexes, matched in full) to its variables.

    See the module docstring for the rule format. Rules are checked when the map is built:
    every problem (a regex that does not compile, a template or layout of the wrong kind)
    is listed in one ``ValueError``.

    Args:
      rules: ``[(regex, template, layout), ...]`` (or ``(regex, template, layout, affine)``) or
        ``{regex: (template, layout)}`` (or ``(template, layout, affine)``); ``template`` is a dotted path
        template (with an optional ``[items]`` region), ``None`` (the key is ignored) or a tuple of templates;
        ``layout`` and ``affine`` as in the module docstring.
      constants: ``{flax path regex: value}``: flax-only variables (matched in full against each variable's
        canonical dotted path) filled with ``value`` (a number, broadcast, or an array of the variable's shape)
        rather than from a torch key.

    Attributes:
      discovery: ``None`` for a hand-written map; a map measured from a port's loader carries the object that
        describes how (``str()`` of it is shown in a comparison's report).
    """

    def __init__(
        self,
        rules: Iterable[tuple] | Mapping[str, tuple],
        constants: Mapping[str, Any] | None = None,
    ):
        if isinstance(rules, Mapping):
            items = [(k, *v) if isinstance(v, tuple) and len(v) in (2, 3) else (k, v) for k, v in rules.items()]
        elif isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
            raise TypeError(
                f"KeyMap takes a list of (regex, template, layout) or a {{regex: (template, layout)}} "
                f"mapping, got {type(rules).__name__}"
            )
        else:
            items = list(rules)
        parsed, problems = [], []
        for index, item in enumerate(items):
            try:
                parsed.append(parse_rule(index, item))
            except ValueError as error:
                problems.append(f"rule {index} {item!r}: {error}")
        if constants is not None and not isinstance(constants, Mapping):
            problems.append(f"constants= takes a {{flax path regex: value}} dict, got {type(constants).__name__}")
        for regex, value in dict(constants or {}).items():
            try:
                re.compile(regex)
                np.asarray(value, np.float64)
            except (re.error, TypeError, ValueError) as error:
                problems.append(f"constant {regex!r}: {error}; give a regex and a number or array")
        if problems:
            raise ValueError(f"KeyMap: {len(problems)} bad rule(s):\n  " + "\n  ".join(problems))
        self.rules: tuple[Rule, ...] = tuple(parsed)
        self.constants: dict[str, Any] = dict(constants or {})
        self.discovery: Any = None
        self._compiled = [(rule, rule.regex) for rule in self.rules]

    def to_source(self, comments: Mapping[int, str] | None = None) -> str:
        """Python source that rebuilds this map: ``KeyMap([...], constants={...})``, one rule a line.

        Evaluated with ``from flax_ln.convert import KeyMap`` and ``import numpy as np`` in scope, it
        loads exactly as this map does. ``comments``: ``{rule index: text}``, written as a comment line
        above that rule. ``discovery`` is not part of the source.
        """
        return key_map_source(self.rules, self.constants, comments)

    def __len__(self) -> int:
        return len(self.rules)

    def __repr__(self) -> str:
        return f"KeyMap({len(self.rules)} rules)"

    def __str__(self) -> str:
        return repr(self) if self.discovery is None else f"{self!r}, {self.discovery}"

    @classmethod
    def discover(
        cls,
        loader,
        like,
        *,
        takes: str = "state_dict",
        kind: str | None = None,
        allow_unfilled: Iterable[str] = (),
        allow_dropped: Iterable[str] = (),
    ) -> KeyMap:
        """The key map that ``loader``, a port's own weight loader, implements: measured by running it on probes.

        ``loader`` takes a torch-keyed dict of NumPy arrays (``takes="state_dict"``) or a folder holding
        ``model.safetensors`` (``takes="folder"``) and returns an ``nnx.Module``, or a dict ``kind`` names
        (``"linen"`` or ``"function"``); ``like`` is the torch module. ``allow_unfilled`` (flax paths, left at init:
        constants) and ``allow_dropped`` (torch keys never read) are regexes matched in full. The map's
        :attr:`discovery` says what was dropped, left at init, offset and tied. See :mod:`flax_ln.convert.discover`.

        A map found by probing assumes a loader whose layout depends on the keys and shapes alone, not on the
        values: a loader that branches on its inputs (it transposes only when the mean is large) would be described
        by the branch the probes take. The probes are repeated at the scale of real weights to catch that, which a
        variable that lands elsewhere fails; a branch no probe takes stays unseen.
        """
        from flax_ln.convert.discover import measure

        measured = measure(
            loader, like, takes=takes, kind=kind, allow_unfilled=allow_unfilled, allow_dropped=allow_dropped
        )
        key_map = cls(measured.rules, constants=measured.constants)
        key_map.discovery = measured.discovery
        return key_map

    def matches(self, key: str) -> list[tuple[Rule, re.Match]]:
        """Every rule whose regex matches ``key`` in full, with its match (strictness wants exactly one)."""
        return [(rule, m) for rule, regex in self._compiled if (m := regex.fullmatch(key)) is not None]

    def resolve(self, model: nnx.Module | VariableTree, tensors: Mapping[str, Any], *, ties=None) -> KeyPlan:
        """The :class:`KeyPlan` of this map between ``model`` and the torch ``tensors`` (a state dict).

        Checks structure, shapes and dtypes as strictly as loading does (values are not
        compared) and raises one :class:`ConversionError` listing every problem.

        Args:
          model: an ``nnx.Module`` (or any :class:`VariableTree`).
          tensors: torch key -> tensor or array (a ``state_dict()``); only shapes and dtypes are read,
            and data pointers to find ties.
          ties: ``{canonical: (canonical, *aliases)}``; by default :func:`find_ties` of ``tensors``.
        """
        tree = NNXTree(model) if isinstance(model, nnx.Module) else model
        arrays = {k: as_numpy(v) for k, v in tensors.items()}
        plan, problems = match_targets(
            self, tree, array_specs(arrays), find_ties(arrays) if ties is None else ties, stacklevel=3
        )
        if problems:
            raise key_map_error(problems, tree=tree)
        return plan


@dataclasses.dataclass(frozen=True)
class KeyPlan:
    """A :class:`KeyMap` resolved against one flax model and one torch state dict.

    Args:
      targets: torch key -> the :class:`Target` s it fills, in the state dict's order;
        ``()`` for an ignored key.
      ties: canonical torch name -> :class:`Tie`, for keys that share one torch tensor and
        for keys copied into several flax variables; ``{}`` when there are none.
      unmatched_rules: the rules that matched no key.
      constants: canonical flax path -> the value of a flax-only constant (the variable's shape and dtype).
      dropped_slabs: torch key -> the slabs of it no variable reads (a split rule's ``{slab: None}``), each as
        ``(name, region)``: ``("pos.weight[0:2]", ((0, 2), (0, 64)))``; compared as dropped parameters.
    """

    targets: Mapping[str, tuple[Target, ...]]
    ties: Mapping[str, Tie]
    unmatched_rules: tuple[Rule, ...] = ()
    constants: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    dropped_slabs: Mapping[str, tuple[tuple[str, Region], ...]] = dataclasses.field(default_factory=dict)

    @property
    def ignored(self) -> tuple[str, ...]:
        """Torch keys the map ignores."""
        return tuple(k for k, t in self.targets.items() if not t)

    def canonical(self, key: str) -> str:
        """The name a torch key is compared under: its tie's canonical name, else itself."""
        for name, tie in self.ties.items():
            if key in tie.torch_aliases:
                return name
        return key

    def flax_names(self, keys: Iterable[str]) -> frozenset[str]:
        """The flax variables (``Target.name``: ``path`` or ``path[i]``) that torch ``keys`` fill.

        For pairing modules: a torch module pairs with a flax module when the names its
        parameters' keys fill are exactly the flax module's variables.
        """
        return frozenset(t.name for k in keys for t in self.targets.get(k, ()))

    def to_flax(self, key: str, array) -> tuple:
        """``array`` (torch ``key``'s tensor) in each of its targets' flax layouts."""
        return tuple(t.to_flax(array) for t in self.targets[key])

    def to_torch(self, key: str, flax_values: Mapping[str, Any]):
        """Torch ``key``'s array from the flax values (canonical path -> whole variable), via its first target (a
        split key's from every slab)."""
        targets = self.targets[key]
        if targets[0].slab is None:
            return targets[0].to_torch(targets[0].take(flax_values[targets[0].path]))
        return assemble(targets, lambda t: t.to_torch(t.take(flax_values[t.path])))

    def shared(self) -> dict[str, Tie]:
        """Distinct torch tensors (equal in value: loading checks it) that fill one flax variable or slice.

        ``{first key: Tie((first key, *others), flax names they fill)}``, each key under its canonical name,
        in the state dict's order; keys linked through a chain of shared variables form one group. The
        flax variable takes one value, one tangent and one gradient for all of them: the gradient is
        compared, under the first key, against the sum of torch's gradients (:meth:`carry`); ``{}`` when
        none.
        """
        fills: dict[tuple[str, Region], list[str]] = {}
        for key, targets in self.targets.items():
            for t in targets:
                keys = fills.setdefault(t.at, [])
                if self.canonical(key) not in keys:
                    keys.append(self.canonical(key))
        group: dict[str, list[str]] = {}
        for keys in fills.values():
            merged = list(dict.fromkeys(k for key in keys for k in group.get(key, [key])))
            for k in merged if len(merged) > 1 else ():
                group[k] = merged
        order = {self.canonical(k): i for i, k in reversed(list(enumerate(self.targets)))}
        out = {}
        for keys in {id(g): g for g in group.values()}.values():
            keys = sorted(keys, key=order.__getitem__)
            names = (t.name for key, ts in self.targets.items() if self.canonical(key) in keys for t in ts)
            out[keys[0]] = Tie(tuple(keys), tuple(dict.fromkeys(names)))
        return out

    def carry(self, source: str, dest: str, array, kind: str = "value"):
        """Torch key ``source``'s ``array`` in torch key ``dest``'s layout, through a flax variable (or region) both
        fill: ``source``'s layout into flax, then ``dest``'s back to torch. ``kind``: ``"value"``, ``"tangent"``
        or ``"gradient"``, which an affine change maps differently (see :class:`Target`). A ``dest`` a split rule
        cuts into slabs gets its whole tensor, slab by slab, each through the variable ``source`` fills there too
        (zero in a slab whose variable ``source`` does not fill)."""
        into = {t.at: t for t in self.targets[dest]}
        sources = {t.at: t for t in self.targets[source] if t.at in into}
        if not sources:
            raise ValueError(f"torch keys {source!r} and {dest!r} fill no flax variable in common")

        def through(back: Target) -> Any:
            via = sources.get(back.at)
            if via is None:  # a slab of dest that source does not fill
                return np.zeros(back.slab_shape, np.asarray(array).dtype)
            if kind == "tangent":
                return back.tangent_to_torch(via.tangent_to_flax(array))
            if kind == "gradient":
                return back.gradient_to_torch(via.gradient_to_flax(array))
            return back.to_torch(via.to_flax(array))

        if self.targets[dest][0].slab is not None:
            return assemble(self.targets[dest], through)
        return through(into[next(iter(sources))])

    def split(self) -> dict[str, tuple[Target, ...]]:
        """The torch keys a split rule sends to several variables, slab by slab: ``{key: its targets}``."""
        return {k: ts for k, ts in self.targets.items() if ts and ts[0].slab is not None}

    def torch_gradients(self, flax_grads: Mapping[str, Any]) -> dict[str, Any]:
        """Flax gradients (canonical path -> array) under torch's names, tied copies summed; a split key's
        slab by slab, under ``key[slab]`` (``in_proj_weight[0:64]``).

        One entry per torch tensor, under its canonical name (``named_parameters()``'s):
        the sum, over every distinct flax variable (or slice) that any of its aliases
        fills, of that variable's gradient mapped back through its inverse layout. A
        variable that two aliases share counts once. Distinct torch tensors that fill one
        variable (:meth:`shared`) have one entry, under the first one's name, in its layout
        where it fills the variable. Ignored keys, and keys whose variables have no entry in
        ``flax_grads`` (running statistics), are left out.
        """
        first = {k: name for name, tie in self.shared().items() for k in tie.torch_aliases}
        out: dict[str, Any] = {}
        seen: dict[str, set[tuple[str, Region]]] = {}
        for key, targets in self.targets.items():
            name = first.get(self.canonical(key), self.canonical(key))
            for t in targets:
                done = seen.setdefault(name, set())
                if t.path not in flax_grads or t.at in done:
                    continue
                done.add(t.at)
                g = t.gradient_to_torch(t.take(flax_grads[t.path]))
                if t.slab is not None:  # a split key: compared slab by slab, each under its own name
                    out[region_name(name, t.slab, t.torch_shape)] = g
                    continue
                if name != self.canonical(key):  # a variable the first of the shared keys does not fill
                    g = self.carry(key, name, g, "gradient")
                out[name] = g if name not in out else out[name] + g
        return out


def array_specs(arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[Shape, np.dtype]]:
    """``{torch key: (shape, dtype)}`` of a state dict's arrays: all that matching reads of them."""
    return {k: (tuple(a.shape), a.dtype) for k, a in arrays.items()}


def match_targets(
    key_map: KeyMap,
    tree: VariableTree,
    specs: Mapping[str, tuple[Shape, np.dtype]],
    ties: Mapping[str, Sequence[str]],
    *,
    strict: bool = True,
    warn_unmatched: bool = True,
    stacklevel: int = 4,
) -> tuple[KeyPlan, dict[str, list]]:
    """Match every key to its rule and its :class:`Target` s in the tree: the :class:`KeyPlan`, and the
    problems found, in :class:`ConversionError`'s fields (``{}`` when none).

    ``specs`` are the torch keys' shapes and dtypes (:func:`array_specs`), ``ties`` as
    :func:`~flax_ln.convert.find_ties` gives them. ``stacklevel`` points the warning about
    rules (and constants) that matched nothing at the user's call.
    """
    unexpected: list[str] = []
    mismatched: list[tuple[str, str]] = []
    variables = tree.variables()
    constants, unfilled = _constants(key_map, variables, warn_unmatched, stacklevel + 1)
    used: set[int] = set()
    attempted: set[str] = set()  # variables a key tried to fill: reported once, under that key
    targets: dict[str, tuple[Target, ...]] = {}
    dropped_slabs: dict[str, tuple[tuple[str, Region], ...]] = {}
    for key, (torch_shape, torch_dtype) in specs.items():
        found = key_map.matches(key)
        if not found:
            if strict:
                unexpected.append(key)
            continue
        if len(found) > 1:
            labels = " and ".join(rule.label for rule, _ in found)
            mismatched.append((key, f"matches {labels}; exactly one rule may match: make their regexes disjoint"))
            continue
        rule, match = found[0]
        used.add(rule.index)
        resolved = []
        for template, layout, affine, slab_text in zip(rule.templates, rule.layouts, rule.affines, rule.slabs):
            written = match.expand(template)
            where = f"{rule.label} -> {written!r}"
            slab: Region | None = None
            slab_shape = tuple(torch_shape)
            if slab_text is not None:
                written_slab = match.expand(slab_text)
                where = f"{rule.label} {written_slab} -> {written!r}"
                try:
                    slab, slab_shape = parse_region(slab_items(written_slab), tuple(torch_shape))
                except ValueError as error:
                    mismatched.append((key, f"{where}: the torch slab does not fit the tensor: {error}"))
                    continue
            dotted, items = split_template(written)
            try:
                path = tree.lookup(dotted)
            except KeyError as error:
                mismatched.append((key, f"{where}: the model has no such variable: {error.args[0]}"))
                continue
            variable_shape, dtype, _ = variables[path]
            attempted.add(path)
            if path in constants:
                mismatched.append((key, f"{where}: {path!r} is a constant of the key map (constants=); drop one"))
                continue
            region, shape = whole_region(variable_shape), variable_shape
            if items is not None:
                try:
                    region, shape = parse_region(items, variable_shape)
                except ValueError as error:
                    mismatched.append((key, f"{where}: {error}"))
                    continue
            try:
                layout.to_flax(shape_only(slab_shape), shape)
            except ValueError as error:
                mismatched.append((key, f"{where} (flax shape {shape}): {error}"))
                continue
            problem = dtype_problem(torch_dtype, dtype)
            if problem:
                mismatched.append((key, f"{where}: {problem}"))
                continue
            resolved.append(
                Target(key, rule, path, region, layout, tuple(torch_shape), tuple(shape), affine, variable_shape, slab)
            )
        unread: list[tuple[str, Region]] = []
        for slab_text in rule.dropped:
            written_slab = match.expand(slab_text)
            try:
                region_read, _ = parse_region(slab_items(written_slab), tuple(torch_shape))
            except ValueError as error:
                mismatched.append(
                    (key, f"{rule.label} {written_slab} -> None: the slab does not fit the tensor: {error}")
                )
                continue
            unread.append((region_name(key, region_read, tuple(torch_shape)), region_read))
        if unread:
            dropped_slabs[key] = tuple(unread)
        if rule.splits and len(resolved) == len(rule.templates):
            by_slab = {t.slab: target_labels([t]) for t in resolved if t.slab is not None}
            by_slab.update({region: "dropped (None)" for _, region in unread})
            gaps = tiling_problems(key, tuple(torch_shape), by_slab, strict)
            mismatched.extend((key, f"{rule.label}'s torch slabs: {why}") for why in gaps)
        targets[key] = tuple(resolved)
    if warn_unmatched:
        unmatched = [r for r in key_map.rules if r.index not in used]
        if unmatched:
            warnings.warn(
                "key map: these rules matched no torch key (fine for an alias the checkpoint does not store; "
                "otherwise check the regex): " + ", ".join(r.label for r in unmatched),
                stacklevel=stacklevel,
            )
    unmatched_rules = tuple(r for r in key_map.rules if r.index not in used)

    alias_group = {k: name for name, keys in ties.items() for k in keys}
    fills: dict[str, dict[Region, list[Target]]] = {}
    for ts in targets.values():
        for t in ts:
            fills.setdefault(t.path, {}).setdefault(t.region, []).append(t)
    for path, (shape, _, required) in variables.items():
        regions = fills.get(path, {})
        if regions and (len(regions) > 1 or strict) and list(regions) != [whole_region(shape)]:
            by_region = {region: target_labels(ts) for region, ts in regions.items()}
            unfilled.extend((path, why) for why in tiling_problems(path, shape, by_region, strict))
        elif not regions and required and strict and path not in attempted and path not in constants:
            unfilled.append((path, f"no rule fills this variable (shape {shape}); name it in a rule's template"))
    ties_out: dict[str, Tie] = {}
    for name, keys in ties.items():
        present = [k for k in keys if k in specs]
        if len(present) > 1:
            paths = [t.name for k in present for t in targets.get(k, ())]
            ties_out[present[0] if name not in present else name] = Tie(tuple(present), tuple(dict.fromkeys(paths)))
    for key, ts in targets.items():
        names = tuple(dict.fromkeys(t.name for t in ts))
        if len(names) > 1 and key not in alias_group and ts[0].slab is None:  # a split key is no tie
            ties_out[key] = Tie((key,), names)
    problems: dict[str, list] = {"unexpected": unexpected, "mismatched": mismatched, "unfilled": unfilled}
    plan = KeyPlan(targets, ties_out, unmatched_rules, constants, dropped_slabs)
    return plan, {k: v for k, v in problems.items() if v}


def _constants(
    key_map: KeyMap, variables: Mapping[str, tuple[Shape, np.dtype, bool]], warn: bool, stacklevel: int
) -> tuple[dict[str, np.ndarray], list[tuple[str, str]]]:
    """The values of the map's constants for these variables (canonical path -> array), and the problems."""
    values: dict[str, np.ndarray] = {}
    problems: list[tuple[str, str]] = []
    unused = []
    for regex, value in key_map.constants.items():
        hits = [path for path in variables if re.fullmatch(regex, path)]
        if not hits:
            unused.append(repr(regex))
        for path in hits:
            shape, dtype, _ = variables[path]
            try:
                values[path] = constant_value(value, shape, dtype)
            except ValueError as error:
                problems.append((path, f"constant {regex!r}: {error}"))
    if unused and warn:
        warnings.warn(
            "key map: these constants matched no flax variable (check the regex against the variables' dotted "
            "paths): " + ", ".join(unused),
            stacklevel=stacklevel,
        )
    return values, problems


def key_map_error(
    problems: Mapping[str, list], header: str | None = None, tree: VariableTree | None = None
) -> ConversionError:
    """One :class:`ConversionError` for every problem :func:`match_targets` (and the value checks) found; its advice
    names ``tree``'s own kind of variable (an NNX module's by default)."""
    return ConversionError(
        unexpected=problems.get("unexpected", ()),
        mismatched=problems.get("mismatched", ()),
        unfilled=problems.get("unfilled", ()),
        hint=_fix(tree),
        header=header,
    )


def target_labels(targets: Iterable[Target]) -> str:
    """How errors name the keys that fill a variable: ``'a.weight' (rule 0 r'a\\.weight'), ...``."""
    return ", ".join(f"{t.key!r} ({t.rule.label})" for t in targets)
