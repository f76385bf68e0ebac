r"""A port's own map from torch state-dict keys to its variables: :class:`KeyMap`.

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

The same rules may be given as a mapping ``{regex: (template, layout)}``.

**Templates.** ``re.Match.expand`` fills a template from the key's groups (``\1``,
``\g<name>``), giving a dotted path of attributes and sequence indices from the model
(``blocks.0.attn.q.kernel``). ``None`` ignores the key. A template ending in ``[i]``
(``r"layers.attn.kernel[\1]"``) fills slice ``i`` of a variable stacked along its leading
axis, as a port that scans over layers keeps them. A tuple of templates copies one tensor
into several variables (a checkpoint that stores a tied weight once).

**Layouts**, from torch's layout to flax's:

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
one variable may be filled twice only by aliases of one torch tensor (a tie) or by equal
values. Every problem is listed in one :class:`~flax_ln.convert.rules.ConversionError`
and nothing is loaded. A rule that matches no key only warns, so the map that loads a
full state dict also loads a checkpoint saved without an alias.

**For comparisons.** :meth:`KeyMap.resolve` gives a :class:`KeyPlan`: for every torch key
its :class:`Target` variables (canonical dotted path, slice, layout), both directions of
each layout, the ties (:class:`Tie`, from :func:`find_ties`) and the torch-named sum of
flax gradients (:meth:`KeyPlan.torch_gradients`). Paths are resolved through a
:class:`VariableTree`: :class:`NNXTree` for an ``nnx.Module``, :class:`LinenTree` for a Linen
module's variables and :class:`PytreeTree` for a pytree of arrays.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import einops
import jax
import jax.numpy as jnp
import numpy as np
from einops.parsing import ParsedExpression
from flax import nnx

from flax_ln.convert.rules import _M, _SAVED_KINDS, ConversionError, _as_numpy, _assign, _dtype_problem

Shape = tuple[int, ...]

_FIX = (
    "each torch key must match exactly one rule: add (regex, template, layout) for an unexpected key, or "
    "(regex, None, None) to ignore it; each nnx.Param and nnx.BatchStat must be named by a rule's template"
)


_EXPORT = "the model does not export through its key map"


class NeedsTorchShape(ValueError):
    """A layout cannot be inverted from the flax shape alone; torch's shape (``like=``) fixes it."""


def _dummy(shape: Shape) -> np.ndarray:
    """A zero-stride array of ``shape``: layouts run on it to find shapes without touching data."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), shape, (0,) * len(shape))


def _single_axis_sizes(expression: ParsedExpression, shape: Shape) -> dict[str, int]:
    """``{axis: size}`` for every group of ``expression`` that is one named axis, read from ``shape``."""
    groups = expression.composition
    n_ellipsis = len(shape) - (len(groups) - expression.has_ellipsis)
    sizes, at = {}, 0
    for group in groups:
        if isinstance(group, str):  # the ellipsis
            at += max(n_ellipsis, 0)
            continue
        names = [a for a in group if isinstance(a, str)]
        if len(group) == 1 and len(names) == 1 and at < len(shape):
            sizes[names[0]] = int(shape[at])
        at += 1
    return sizes


@dataclasses.dataclass(frozen=True)
class ArrayLayout:
    """One array's layout change from torch to flax, normalised from a rule's layout.

    ``pattern`` is an einops rearrange pattern, or ``permutation`` / ``reshape`` /
    ``reshape_first`` the parts of a triple; all empty is the identity.
    """

    pattern: str | None = None
    permutation: tuple[int, ...] | None = None
    reshape: tuple[int, ...] | None = None
    reshape_first: bool = False

    def __str__(self) -> str:
        if self.pattern is not None:
            return repr(self.pattern)
        if self.permutation is None and self.reshape is None:
            return "identity"
        return repr((self.permutation, self.reshape, self.reshape_first))

    @property
    def needs_torch_shape(self) -> bool:
        """Whether :meth:`to_torch` needs torch's shape: a reshape, or axes merged on the flax side."""
        if self.pattern is not None:
            flax_side = ParsedExpression(self.pattern.split("->")[1])
            return any(len([a for a in g if isinstance(a, str)]) > 1 for g in flax_side.composition if g != "…")
        return self.reshape is not None

    def to_flax(self, array, flax_shape: Shape):
        """``array`` (torch layout) in flax layout; ``flax_shape`` gives the sizes a pattern leaves open.

        Raises ``ValueError`` when the sizes do not fit. Works on NumPy and JAX arrays.
        """
        if self.pattern is not None:
            try:
                rhs = ParsedExpression(self.pattern.split("->")[1])
                out = einops.rearrange(array, self.pattern, **_single_axis_sizes(rhs, flax_shape))
            except einops.EinopsError as error:
                raise ValueError(f"layout {self.pattern!r} does not fit: {_einops_reason(error)}") from None
        else:
            out = array
            if self.reshape_first and self.reshape is not None:
                out = out.reshape(self.reshape)
            if self.permutation is not None:
                if len(self.permutation) != out.ndim:
                    raise ValueError(
                        f"permutation {self.permutation} is for {len(self.permutation)} axes, got {out.ndim}"
                    )
                out = out.transpose(self.permutation)
            if not self.reshape_first and self.reshape is not None:
                out = out.reshape(self.reshape)
        if tuple(out.shape) != tuple(flax_shape):
            raise ValueError(f"layout {self} turns torch shape {tuple(array.shape)} into {tuple(out.shape)}")
        return out

    def to_torch(self, array, torch_shape: Shape | None = None):
        """The inverse of :meth:`to_flax`: ``array`` (flax layout) in torch layout.

        ``torch_shape`` is needed only where :attr:`needs_torch_shape`; without it those
        raise :class:`NeedsTorchShape`.
        """
        if self.needs_torch_shape and torch_shape is None:
            raise NeedsTorchShape(f"layout {self} cannot be inverted from the flax shape alone")
        if self.pattern is not None:
            lhs, rhs = self.pattern.split("->")
            sizes = _single_axis_sizes(ParsedExpression(lhs), torch_shape) if torch_shape is not None else {}
            try:
                out = einops.rearrange(array, f"{rhs} -> {lhs}", **sizes)
            except einops.EinopsError as error:
                raise ValueError(f"layout {self.pattern!r} does not invert: {_einops_reason(error)}") from None
        elif self.reshape is None:
            out = array if self.permutation is None else array.transpose(np.argsort(self.permutation))
        else:
            assert torch_shape is not None
            if self.reshape_first:  # flax = transpose(reshape(torch)): undo the transpose, then the reshape
                mid = _dummy(torch_shape).reshape(self.reshape).shape
                if self.permutation is not None:
                    mid = tuple(mid[p] for p in self.permutation)
                out = array.reshape(mid)
                if self.permutation is not None:
                    out = out.transpose(np.argsort(self.permutation))
                out = out.reshape(torch_shape)
            else:  # flax = reshape(transpose(torch)): undo the reshape, then the transpose
                mid = torch_shape if self.permutation is None else tuple(torch_shape[p] for p in self.permutation)
                out = array.reshape(mid)
                if self.permutation is not None:
                    out = out.transpose(np.argsort(self.permutation))
        if torch_shape is not None and tuple(out.shape) != tuple(torch_shape):
            raise ValueError(f"layout {self} turns flax shape {tuple(array.shape)} into {tuple(out.shape)}")
        return out

    def torch_shape(self, flax_shape: Shape) -> Shape:
        """The torch shape of a flax array of ``flax_shape`` (raises :class:`NeedsTorchShape` where unknown)."""
        return tuple(self.to_torch(_dummy(flax_shape)).shape)


IDENTITY = ArrayLayout()


def _einops_reason(error: Exception) -> str:
    return " ".join(str(error).split())


def _parse_layout(layout: Any) -> ArrayLayout:
    """A rule's layout (None, einops pattern, triple, Enum member) as an :class:`ArrayLayout`; ``ValueError`` if bad."""
    if isinstance(layout, enum.Enum):
        if isinstance(layout.value, enum.Enum):
            raise ValueError(f"the Enum member {layout!r} has an Enum value; its value must be a layout")
        return _parse_layout(layout.value)
    if layout is None:
        return IDENTITY
    if isinstance(layout, str):
        if layout.count("->") != 1:
            raise ValueError(f"layout {layout!r} must be an einops rearrange pattern 'torch axes -> flax axes'")
        lhs, rhs = (ParsedExpression(side) for side in layout.split("->"))
        if lhs.identifiers != rhs.identifiers:
            raise ValueError(f"layout {layout!r} must name the same axes on both sides")
        return ArrayLayout(pattern=layout.strip())
    if isinstance(layout, (tuple, list)) and len(layout) == 3:
        permutation, reshape, reshape_first = layout
        if permutation is not None:
            permutation = tuple(int(p) for p in permutation)
            if sorted(permutation) != list(range(len(permutation))):
                raise ValueError(f"permutation {permutation} in layout {layout!r} is not a permutation of 0..n-1")
        if reshape is not None:
            reshape = tuple(int(s) for s in reshape)
        if reshape_first not in (True, False):  # bool, 0/1 or numpy's bool
            raise ValueError(f"reshape_first in layout {layout!r} must be a bool, got {reshape_first!r}")
        return ArrayLayout(permutation=permutation, reshape=reshape, reshape_first=bool(reshape_first))
    raise ValueError(
        f"layout {layout!r} is not a layout: expected None, an einops pattern such as '(n h) d -> d n h', "
        "a (permutation, reshape, reshape_first) triple, or an Enum member whose value is one"
    )


@dataclasses.dataclass(frozen=True)
class Rule:
    """One parsed rule of a :class:`KeyMap`: ``pattern`` (matched in full) to ``templates`` with ``layouts``.

    ``templates`` is empty for a rule that ignores its keys. ``index`` is the rule's position in the map.
    """

    index: int
    pattern: str
    templates: tuple[str, ...]
    layouts: tuple[ArrayLayout, ...]

    @property
    def regex(self) -> re.Pattern:
        """The compiled ``pattern``."""
        return re.compile(self.pattern)

    @property
    def label(self) -> str:
        """How errors name the rule: ``rule 3 r'model\\.norm\\.weight'``."""
        return f"rule {self.index} r'{self.pattern}'"


_STACKED = re.compile(r"(.*)\[(\w+)\]")


class KeyMap:
    """A port's ordered table from torch state-dict keys (regexes, matched in full) to its variables.

    See the module docstring for the rule format. Rules are checked when the map is built:
    every problem (a regex that does not compile, a template or layout of the wrong kind)
    is listed in one ``ValueError``.

    Args:
      rules: ``[(regex, template, layout), ...]`` or ``{regex: (template, layout)}``;
        ``template`` is a dotted path template, ``None`` (the key is ignored) or a tuple
        of templates; ``layout`` as in the module docstring.
    """

    def __init__(self, rules: Iterable[tuple[str, Any, Any]] | Mapping[str, tuple[Any, Any]]):
        if isinstance(rules, Mapping):
            items = [(k, *v) if isinstance(v, tuple) and len(v) == 2 else (k, v) for k, v in rules.items()]
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
                parsed.append(_parse_rule(index, item))
            except ValueError as error:
                problems.append(f"rule {index} {item!r}: {error}")
        if problems:
            raise ValueError(f"KeyMap: {len(problems)} bad rule(s):\n  " + "\n  ".join(problems))
        self.rules: tuple[Rule, ...] = tuple(parsed)
        self._compiled = [(rule, rule.regex) for rule in self.rules]

    def __len__(self) -> int:
        return len(self.rules)

    def __repr__(self) -> str:
        return f"KeyMap({len(self.rules)} rules)"

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
        arrays = {k: _as_numpy(v) for k, v in tensors.items()}
        plan, problems = _plan(self, tree, _specs(arrays), find_ties(arrays) if ties is None else ties, stacklevel=3)
        if problems:
            raise _error(problems)
        return plan


def _parse_rule(index: int, item: Any) -> Rule:
    if not (isinstance(item, tuple) and len(item) == 3):
        raise ValueError("a rule is a (regex, template, layout) triple")
    pattern, template, layout = item
    if not isinstance(pattern, str):
        raise ValueError(f"the regex must be a str, got {type(pattern).__name__}")
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"the regex does not compile: {error}") from None
    if template is None:
        if layout is not None:
            raise ValueError("an ignored key (template None) takes no layout; write (regex, None, None)")
        return Rule(index, pattern, (), ())
    templates: tuple[str, ...]
    layouts: tuple[ArrayLayout, ...]
    if isinstance(template, str):
        templates, layouts = (template,), (_parse_layout(layout),)
    elif isinstance(template, tuple) and template and all(isinstance(t, str) for t in template):
        templates = template
        if layout is None:
            layouts = (IDENTITY,) * len(templates)
        elif isinstance(layout, tuple) and len(layout) == len(templates):
            layouts = tuple(_parse_layout(one) for one in layout)
        else:
            raise ValueError(
                f"a tuple of {len(templates)} templates takes None or a tuple of {len(templates)} layouts, "
                f"got {layout!r}"
            )
    else:
        raise ValueError(f"the template must be a str, None or a non-empty tuple of str, got {template!r}")
    for t in templates:
        if not t or t.startswith(".") or t.endswith("."):
            raise ValueError(f"template {t!r} is not a dotted path")
    return Rule(index, pattern, tuple(templates), layouts)


# ---------------------------------------------------------------------------------------------
# The flax side: dotted paths to variables. An NNX module, a Linen variables dict and a pytree
# of arrays implement the same small protocol.


@runtime_checkable
class VariableTree(Protocol):
    """The flax side as the key map sees it: dotted variable paths, their shapes, reads and writes."""

    def variables(self) -> dict[str, tuple[Shape, np.dtype, bool]]:
        """``{canonical dotted path: (shape, dtype, required)}``; required ones must be filled by loading."""
        ...

    def lookup(self, path: str) -> str:
        """The canonical path of the variable at dotted ``path``; ``KeyError`` (with the reason) if none."""
        ...

    def read(self, path: str) -> np.ndarray:
        """The value of the variable at canonical ``path``, on the host."""
        ...

    def write(self, values: Mapping[str, np.ndarray]) -> None:
        """Set each canonical path's variable to its value (cast to the variable's dtype)."""
        ...


class NNXTree:
    """:class:`VariableTree` of an ``nnx.Module``: paths are attribute names and sequence indices, dotted.

    A variable shared at several paths is one variable; its canonical path is the one
    ``nnx.state`` uses. ``nnx.Param`` and ``nnx.BatchStat`` are required; other variables
    (RNG state, caches) are filled only where a rule names them.
    """

    def __init__(self, model: nnx.Module):
        self.model = model
        self._vars: dict[str, nnx.Variable] = {}
        self._canonical: dict[int, str] = {}
        for path, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Variable) and id(node) not in self._canonical:
                name = ".".join(map(str, path))
                self._vars[name] = node
                self._canonical[id(node)] = name

    def variables(self) -> dict[str, tuple[Shape, np.dtype, bool]]:
        """See :meth:`VariableTree.variables`."""
        return {
            p: (tuple(v.shape), v.dtype, isinstance(v, _SAVED_KINDS))
            for p, v in self._vars.items()
            if hasattr(v, "shape")
        }

    def lookup(self, path: str) -> str:
        """See :meth:`VariableTree.lookup`."""
        node: Any = self.model
        walked: list[str] = []
        for step in path.split("."):
            if isinstance(node, nnx.Variable):
                raise KeyError(f"{'.'.join(walked)!r} is already a variable; the path cannot go on")
            child = _child(node, step)
            if child is _MISSING:
                where = ".".join(walked) or "the model"
                close = difflib.get_close_matches(path, list(self._vars), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise KeyError(f"{where} ({type(node).__name__}) has no {step!r}{hint}")
            node = child
            walked.append(step)
        if not isinstance(node, nnx.Variable):
            raise KeyError(f"it names a {type(node).__name__}, not a variable")
        if id(node) not in self._canonical:
            raise KeyError("the variable there is not part of the model's graph")
        return self._canonical[id(node)]

    def read(self, path: str) -> np.ndarray:
        """See :meth:`VariableTree.read`."""
        return np.asarray(self._vars[path][...])

    def write(self, values: Mapping[str, np.ndarray]) -> None:
        """See :meth:`VariableTree.write`."""
        for path, value in values.items():
            _assign(self._vars[path], value)


def _step(key: Any) -> str:
    """One entry of a JAX key path as a dotted path's step: a dict key, a sequence index, an attribute name."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


class PytreeTree:
    """:class:`VariableTree` of a pytree of arrays (a ``Function``'s ``params``): paths are its dict keys,
    sequence indices and attribute names, dotted (``layers.0.w``).

    Writes go into a copy: the caller's pytree (its containers and arrays) is never modified, and
    :meth:`tree` rebuilds the pytree with the written values. Every floating leaf is required
    (a parameter); other leaves are filled only where a rule names them. Leaves may be
    ``jax.ShapeDtypeStruct`` (``jax.eval_shape``): only their shapes and dtypes are read
    until they are written.
    """

    def __init__(self, tree: Any):
        flat, self._treedef = jax.tree_util.tree_flatten_with_path(tree)
        self._steps = [tuple(_step(k) for k in path) for path, _ in flat]
        self._names = [self.name_of(steps) for steps in self._steps]
        if len(set(self._names)) != len(self._names):
            twice = sorted({n for n in self._names if self._names.count(n) > 1})
            raise ValueError(f"two leaves of the pytree have one dotted path: {twice[:4]}; rename their keys")
        self._leaves: dict[str, Any] = dict(zip(self._names, (leaf for _, leaf in flat)))

    def name_of(self, steps: tuple[str, ...]) -> str:
        """The dotted path of the leaf at key path ``steps``."""
        return ".".join(steps)

    def required(self, steps: tuple[str, ...], dtype: np.dtype) -> bool:
        """Whether the leaf at ``steps`` must be filled by loading: every floating leaf."""
        return bool(np.issubdtype(dtype, np.floating))

    def variables(self) -> dict[str, tuple[Shape, np.dtype, bool]]:
        """See :meth:`VariableTree.variables`."""
        out = {}
        for steps, name in zip(self._steps, self._names):
            shape, dtype = _shape_dtype(self._leaves[name])
            out[name] = (shape, dtype, self.required(steps, dtype))
        return out

    def lookup(self, path: str) -> str:
        """See :meth:`VariableTree.lookup`."""
        if path in self._leaves:
            return path
        if any(name.startswith(path + ".") for name in self._names):
            raise KeyError(f"{path!r} names a subtree, not an array")
        close = difflib.get_close_matches(path, self._names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"the pytree has no leaf {path!r}{hint}")

    def read(self, path: str) -> np.ndarray:
        """See :meth:`VariableTree.read`."""
        return np.asarray(self._leaves[path])

    def write(self, values: Mapping[str, np.ndarray]) -> None:
        """See :meth:`VariableTree.write`: an owned copy in the leaf's dtype (the caller's leaf is not touched)."""
        for path, value in values.items():
            _, dtype = _shape_dtype(self._leaves[path])
            self._leaves[path] = jnp.asarray(np.array(value, dtype=dtype, copy=True))

    def tree(self) -> Any:
        """The pytree with every written value (a new pytree; the unwritten leaves are the caller's)."""
        return jax.tree_util.tree_unflatten(self._treedef, [self._leaves[n] for n in self._names])

    def names(self, tree: Any) -> dict[str, Any]:
        """``{dotted path: leaf}`` of a pytree with this tree's structure (its gradients, its tangents)."""
        return dict(zip(self._names, jax.tree_util.tree_leaves(tree)))


class LinenTree(PytreeTree):
    """:class:`VariableTree` of a Linen module's variables (``{"params": ..., "batch_stats": ...}``).

    A ``params`` variable is named by its keys below the collection, dotted
    (``encoder.layer_0.attention.query.kernel``); a variable of another collection by the
    collection first (``batch_stats.stages.0.bn.mean``). ``params`` and ``batch_stats`` are
    required; other collections are filled only where a rule names them. Writes go into a copy.
    """

    def name_of(self, steps: tuple[str, ...]) -> str:
        """See :meth:`PytreeTree.name_of`."""
        return ".".join(steps[1:] if steps[:1] == ("params",) else steps)

    def required(self, steps: tuple[str, ...], dtype: np.dtype) -> bool:
        """``params`` and ``batch_stats`` variables must be filled."""
        return steps[:1] in (("params",), ("batch_stats",))

    def scope(self, name: str) -> tuple[str, ...]:
        """The scope path (module path) of the variable ``name``: its keys below the collection, less the last."""
        return self._steps[self._names.index(name)][1:-1]

    def collection(self, name: str) -> str:
        """The collection of the variable ``name``."""
        return self._steps[self._names.index(name)][0]


def _shape_dtype(leaf: Any) -> tuple[Shape, np.dtype]:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return tuple(leaf.shape), np.dtype(leaf.dtype)
    array = np.asarray(leaf)
    return tuple(array.shape), array.dtype


_MISSING = object()


def _child(node: Any, step: str) -> Any:
    """``node``'s child ``step``: an attribute, a mapping key or (for a digit string) a sequence index."""
    if step.isdigit() and not isinstance(node, Mapping):
        try:
            return node[int(step)]
        except (TypeError, IndexError, KeyError):
            pass
    if isinstance(node, Mapping):
        return node.get(step, _MISSING)
    try:
        return getattr(node, step)
    except AttributeError:
        return _MISSING


# ---------------------------------------------------------------------------------------------
# The torch side: ties.


def find_ties(tensors: Any) -> dict[str, tuple[str, ...]]:
    """Torch keys that hold one tensor: ``{canonical: (canonical, *aliases)}``, ``{}`` when none.

    ``tensors`` is a ``torch.nn.Module`` (its ``state_dict(keep_vars=True)``; the
    canonical name is the one ``named_parameters()`` / ``named_buffers()`` lists) or a
    state dict of tensors or arrays (keys sharing memory: the same data pointer, shape,
    strides and dtype; the canonical name is the first key, as ``state_dict()`` orders
    them, which is ``named_parameters()``'s choice).
    """
    named: set[str] = set()
    if hasattr(tensors, "state_dict") and hasattr(tensors, "named_parameters"):
        named = {n for n, _ in tensors.named_parameters()} | {n for n, _ in tensors.named_buffers()}
        tensors = tensors.state_dict(keep_vars=True)
    groups: dict[tuple, list[str]] = {}
    for key, value in tensors.items():
        array = _as_numpy(value)
        if array.size == 0:
            continue
        address = (array.__array_interface__["data"][0], array.shape, array.strides, array.dtype.str)
        groups.setdefault(address, []).append(key)
    ties = {}
    for keys in groups.values():
        if len(keys) > 1:
            canonical = next((k for k in keys if k in named), keys[0])
            ties[canonical] = (canonical, *[k for k in keys if k != canonical])
    return ties


# ---------------------------------------------------------------------------------------------
# The plan.


@dataclasses.dataclass(frozen=True)
class Tie:
    """Torch keys that hold one tensor, and the flax variables that hold its copies.

    Args:
      torch_aliases: the torch keys, the canonical one (``named_parameters()``'s) first.
      flax_paths: the dotted flax paths of every copy (``path[i]`` for a slice of a stacked variable).
    """

    torch_aliases: tuple[str, ...]
    flax_paths: tuple[str, ...]

    def to_json(self) -> dict[str, list[str]]:
        """``{"torch_aliases": [...], "flax_paths": [...]}``."""
        return {"torch_aliases": list(self.torch_aliases), "flax_paths": list(self.flax_paths)}


@dataclasses.dataclass(frozen=True)
class Target:
    """One flax variable (or slice of one) that a torch key fills.

    Args:
      key: the torch key.
      rule: the rule that matched it.
      path: the variable's canonical dotted path (as ``nnx.state`` names it).
      index: the slice along a stacked variable's leading axis, or ``None``.
      layout: torch -> flax.
      torch_shape: the torch tensor's shape.
      flax_shape: the shape of what it fills (the slice's, for a stacked variable).
    """

    key: str
    rule: Rule
    path: str
    index: int | None
    layout: ArrayLayout
    torch_shape: Shape
    flax_shape: Shape

    @property
    def name(self) -> str:
        """``path``, or ``path[index]`` for a slice."""
        return self.path if self.index is None else f"{self.path}[{self.index}]"

    def to_flax(self, array):
        """A torch-layout array of this key in this target's flax layout."""
        return self.layout.to_flax(array, self.flax_shape)

    def to_torch(self, array):
        """A flax-layout array of this target (the slice, if stacked) in torch's layout."""
        return self.layout.to_torch(array, self.torch_shape)

    def take(self, value):
        """This target's part of the whole variable's ``value``: the slice, if stacked."""
        return value if self.index is None else value[self.index]


@dataclasses.dataclass(frozen=True)
class KeyPlan:
    """A :class:`KeyMap` resolved against one flax model and one torch state dict.

    Args:
      targets: torch key -> the :class:`Target` s it fills, in the state dict's order;
        ``()`` for an ignored key.
      ties: canonical torch name -> :class:`Tie`, for keys that share one torch tensor and
        for keys copied into several flax variables; ``{}`` when there are none.
      unmatched_rules: the rules that matched no key.
    """

    targets: Mapping[str, tuple[Target, ...]]
    ties: Mapping[str, Tie]
    unmatched_rules: tuple[Rule, ...] = ()

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
        """Torch ``key``'s array from the flax values (canonical path -> whole variable), via its first target."""
        target = self.targets[key][0]
        return target.to_torch(target.take(flax_values[target.path]))

    def torch_gradients(self, flax_grads: Mapping[str, Any]) -> dict[str, Any]:
        """Flax gradients (canonical path -> array) under torch's names, tied copies summed.

        One entry per torch tensor, under its canonical name (``named_parameters()``'s):
        the sum, over every distinct flax variable (or slice) that any of its aliases
        fills, of that variable's gradient mapped back through its inverse layout. A
        variable that two aliases share counts once. Ignored keys, and keys whose
        variables have no entry in ``flax_grads`` (running statistics), are left out.
        """
        out: dict[str, Any] = {}
        seen: dict[str, set[tuple[str, int | None]]] = {}
        for key, targets in self.targets.items():
            name = self.canonical(key)
            for t in targets:
                done = seen.setdefault(name, set())
                if t.path not in flax_grads or (t.path, t.index) in done:
                    continue
                done.add((t.path, t.index))
                g = t.to_torch(t.take(flax_grads[t.path]))
                out[name] = g if name not in out else out[name] + g
        return out


def _specs(arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[Shape, np.dtype]]:
    return {k: (tuple(a.shape), a.dtype) for k, a in arrays.items()}


def _plan(
    key_map: KeyMap,
    tree: VariableTree,
    specs: Mapping[str, tuple[Shape, np.dtype]],
    ties: Mapping[str, Sequence[str]],
    *,
    strict: bool = True,
    warn_unmatched: bool = True,
    stacklevel: int = 4,
) -> tuple[KeyPlan, dict[str, list]]:
    """Resolve every key against the map and the tree; the problems come back, in ConversionError's fields."""
    unexpected: list[str] = []
    mismatched: list[tuple[str, str]] = []
    unfilled: list[tuple[str, str]] = []
    variables = tree.variables()
    used: set[int] = set()
    attempted: set[str] = set()  # variables a key tried to fill: reported once, under that key
    targets: dict[str, tuple[Target, ...]] = {}
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
        for template, layout in zip(rule.templates, rule.layouts):
            written = match.expand(template)
            where = f"{rule.label} -> {written!r}"
            stacked = _STACKED.fullmatch(written)
            try:
                path = tree.lookup(stacked.group(1) if stacked else written)
            except KeyError as error:
                mismatched.append((key, f"{where}: the model has no such variable: {error.args[0]}"))
                continue
            shape, dtype, _ = variables[path]
            attempted.add(path)
            index = None
            if stacked:
                if not stacked.group(2).isdigit() or not shape or int(stacked.group(2)) >= shape[0]:
                    mismatched.append(
                        (
                            key,
                            f"{where}: slice {stacked.group(2)!r} is not an index of the stacked variable's "
                            f"leading axis (shape {shape})",
                        )
                    )
                    continue
                index, shape = int(stacked.group(2)), shape[1:]
            try:
                layout.to_flax(_dummy(torch_shape), shape)
            except ValueError as error:
                mismatched.append((key, f"{where} (flax shape {shape}): {error}"))
                continue
            problem = _dtype_problem(torch_dtype, dtype)
            if problem:
                mismatched.append((key, f"{where}: {problem}"))
                continue
            resolved.append(Target(key, rule, path, index, layout, tuple(torch_shape), tuple(shape)))
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
    fills: dict[str, dict[int | None, list[Target]]] = {}
    for ts in targets.values():
        for t in ts:
            fills.setdefault(t.path, {}).setdefault(t.index, []).append(t)
    for path, (shape, _, required) in variables.items():
        slices = fills.get(path, {})
        if None in slices and len(slices) > 1:
            unfilled.append(
                (
                    path,
                    "filled whole by "
                    + _who(slices[None])
                    + " and by slices from "
                    + _who([t for i, ts in slices.items() if i is not None for t in ts]),
                )
            )
        elif slices and None not in slices:
            missing = sorted(set(range(shape[0])) - set(slices))
            if missing and strict:
                unfilled.append(
                    (path, f"slices {missing} of this stacked variable (shape {shape}) are filled by no rule")
                )
        elif not slices and required and strict and path not in attempted:
            unfilled.append((path, f"no rule fills this variable (shape {shape}); name it in a rule's template"))
    ties_out: dict[str, Tie] = {}
    for name, keys in ties.items():
        present = [k for k in keys if k in specs]
        if len(present) > 1:
            paths = [t.name for k in present for t in targets.get(k, ())]
            ties_out[present[0] if name not in present else name] = Tie(tuple(present), tuple(dict.fromkeys(paths)))
    for key, ts in targets.items():
        names = tuple(dict.fromkeys(t.name for t in ts))
        if len(names) > 1 and key not in alias_group:
            ties_out[key] = Tie((key,), names)
    problems: dict[str, list] = {"unexpected": unexpected, "mismatched": mismatched, "unfilled": unfilled}
    return KeyPlan(targets, ties_out, unmatched_rules), {k: v for k, v in problems.items() if v}


def _error(problems: Mapping[str, list], header: str | None = None) -> ConversionError:
    """One :class:`ConversionError` for every problem :func:`_plan` (and the value checks) found."""
    return ConversionError(
        unexpected=problems.get("unexpected", ()),
        mismatched=problems.get("mismatched", ()),
        unfilled=problems.get("unfilled", ()),
        hint=_FIX,
        header=header,
    )


def _who(targets: Iterable[Target]) -> str:
    return ", ".join(f"{t.key!r} ({t.rule.label})" for t in targets)


def _double_fills(plan: KeyPlan, ties: Mapping[str, Sequence[str]], value: Callable[[Target], np.ndarray]) -> list:
    """Variables (or slices) filled by several keys that are neither aliases of one tensor nor equal in value."""
    alias_group = {k: name for name, keys in ties.items() for k in keys}
    fills: dict[tuple[str, int | None], list[Target]] = {}
    for ts in plan.targets.values():
        for t in ts:
            fills.setdefault((t.path, t.index), []).append(t)
    problems = []
    for filled in fills.values():
        keys = {t.key for t in filled}
        if len(filled) < 2 or len({alias_group.get(k, k) for k in keys}) == 1:
            continue
        first = value(filled[0])
        if not all(np.array_equal(first, value(t)) for t in filled[1:]):
            problems.append(
                (
                    filled[0].name,
                    f"filled by {_who(filled)}, which are not aliases of one torch tensor and differ in value; "
                    "map only one of them to this variable (or None the other)",
                )
            )
    return problems


def load_with_key_map(model: _M, state_dict: Mapping[str, Any], key_map: KeyMap, *, strict: bool = True) -> _M:
    """:func:`~flax_ln.convert.rules.load_torch_state_dict` with ``weights=key_map``: check all, then write."""
    if not isinstance(key_map, KeyMap):
        raise TypeError(f"weights= takes a KeyMap, got {type(key_map).__name__}")
    fill_tree(NNXTree(model), state_dict, key_map, strict=strict)
    return model


def fill_tree(tree: VariableTree, state_dict: Mapping[str, Any], key_map: KeyMap, *, strict: bool = True) -> KeyPlan:
    """Fill ``tree``'s variables from a torch state dict through ``key_map``: check all, then write.

    Every problem (as :meth:`KeyMap.resolve` finds them, and double fills that are neither
    aliases of one tensor nor equal in value) is listed in one ``ConversionError`` and
    nothing is written. Returns the plan.
    """
    arrays = {k: _as_numpy(v) for k, v in state_dict.items()}
    ties = find_ties(arrays)
    plan, problems = _plan(key_map, tree, _specs(arrays), ties, strict=strict, stacklevel=5)
    converted: dict[tuple[str, str, int | None], np.ndarray] = {}

    def value(t: Target) -> np.ndarray:
        if (t.key, t.path, t.index) not in converted:
            converted[(t.key, t.path, t.index)] = np.asarray(t.to_flax(arrays[t.key]))
        return converted[(t.key, t.path, t.index)]

    doubles = _double_fills(plan, ties, value)
    if doubles:
        problems["unfilled"] = problems.get("unfilled", []) + doubles
    if problems:
        raise _error(problems)
    variables = tree.variables()
    new: dict[str, dict[int | None, np.ndarray]] = {}
    for ts in plan.targets.values():
        for t in ts:
            new.setdefault(t.path, {})[t.index] = value(t)
    values = {}
    for path, slices in new.items():
        if None in slices:
            values[path] = slices[None]
        else:
            shape = variables[path][0]
            if len(slices) == shape[0]:
                values[path] = np.stack([slices[i] for i in range(shape[0])])  # (layers, ...)
            else:  # strict=False with slices absent: the rest keep their values
                whole = np.array(tree.read(path))
                for i, arr in slices.items():
                    whole[i] = arr
                values[path] = whole
    tree.write(values)
    return plan


def export_with_key_map(model: nnx.Module, key_map: KeyMap, like: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    """:func:`~flax_ln.convert.rules.to_torch_state_dict` with ``weights=key_map`` (and ``like=``)."""
    if not isinstance(key_map, KeyMap):
        raise TypeError(f"weights= takes a KeyMap, got {type(key_map).__name__}")
    tree = NNXTree(model)
    if like is not None:
        like_arrays = {k: _as_numpy(v) for k, v in like.items()}
        ties = find_ties(like_arrays)
        plan, problems = _plan(key_map, tree, _specs(like_arrays), ties)
        dtypes = {k: a.dtype for k, a in like_arrays.items()}
    else:
        like_arrays, ties = {}, {}
        specs, problems = _invert(key_map, tree)
        if not problems:
            plan, problems = _plan(key_map, tree, specs, ties, warn_unmatched=False)
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
        raise _error(problems, _EXPORT)
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
        for template, layout in zip(rule.templates, rule.layouts):
            stacked = template.endswith("]")
            regex = _template_regex(template)
            for path, (shape, dtype, _) in variables.items():
                names = (
                    [(f"{path}[{i}]", shape[1:]) for i in range(shape[0] if shape else 0)]
                    if stacked
                    else [(path, shape)]
                )
                for name, flax_shape in names:
                    m = regex.fullmatch(name)
                    if m is None:
                        continue
                    key = _literal_key(rule.pattern, {g[2:]: v for g, v in m.groupdict().items()})
                    if key is None:  # a regex that is not a literal with groups: its keys cannot be written
                        unwritable.setdefault(name, []).append(rule.label)
                        continue
                    check = rule.regex.fullmatch(key)
                    if not check or check.expand(template) != name:
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
