"""The flax side as a key map sees it: dotted paths to variables, their shapes, reads and writes.

:class:`VariableTree` is the protocol; :class:`NNXTree` implements it for an ``nnx.Module``,
:class:`PytreeTree` for a pytree of arrays, :class:`LinenTree` for a Linen module's variables,
:class:`EquinoxTree` for an ``equinox.Module`` and :class:`KerasTree` for a Keras model (keras is imported only
for a model that is one).
A new kind of flax side needs one more class here, if it holds its variables another way.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln.convert.assign import SAVED_KINDS, assign, is_floating
from flax_ln.convert.layouts import Shape


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

    required_noun = "nnx.Param and nnx.BatchStat"  # how an error names the variables loading must fill

    def __init__(self, model: nnx.Module):
        self.model = model
        self._vars: dict[str, nnx.Variable] = {}
        self._canonical: dict[int, str] = {}
        for path, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Variable) and id(node) not in self._canonical:
                name = ".".join(map(str, path))
                self._vars[name] = node
                self._canonical[id(node)] = name

    def variable_items(self) -> list[tuple[str, nnx.Variable]]:
        """``(canonical path, variable)`` of every variable, each once."""
        return list(self._vars.items())

    def variables(self) -> dict[str, tuple[Shape, np.dtype, bool]]:
        """See :meth:`VariableTree.variables`."""
        return {
            p: (tuple(v.shape), value_dtype(v), isinstance(v, SAVED_KINDS))
            for p, v in self._vars.items()
            if hasattr(v, "shape")
        }

    def lookup(self, path: str) -> str:
        """See :meth:`VariableTree.lookup`. An attribute whose name holds dots (``setattr(self, "blocks.0", b)``)
        is one step: a canonical path resolves as written, and a step that is missing is tried joined with the
        steps after it (``blocks`` + ``0``), shortest first."""
        if path in self._vars:
            return path
        node: Any = self.model
        walked: list[str] = []
        steps = path.split(".")
        while steps:
            if isinstance(node, nnx.Variable):
                raise KeyError(f"{'.'.join(walked)!r} is already a variable; the path cannot go on")
            found = next(
                (
                    (k, child)
                    for k in range(1, len(steps) + 1)
                    if (child := _child(node, ".".join(steps[:k]))) is not _MISSING
                ),
                None,
            )
            if found is None:
                where = ".".join(walked) or "the model"
                close = [c for c in difflib.get_close_matches(path, list(self._vars), n=2) if c != path]
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise KeyError(f"{where} ({type(node).__name__}) has no {steps[0]!r}{hint}")
            k, node = found
            walked.append(".".join(steps[:k]))
            steps = steps[k:]
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
            assign(self._vars[path], value)


def is_python_number(leaf: Any) -> bool:
    """Whether a pytree leaf is a Python number (``bool``, ``int``, ``float``, ``complex``): a hyper-parameter
    beside the arrays of a parameter pytree, never a parameter, never cast."""
    return isinstance(leaf, (bool, int, float, complex))


def value_dtype(variable: nnx.Variable) -> np.dtype:
    """The dtype of the array ``variable`` holds (or of its ``jax.ShapeDtypeStruct``), never its ``dtype`` metadata:
    ``nnx.Param(x, dtype=jnp.float32)`` keeps saying float32 after its value is cast."""
    return variable.get_value().dtype  # a NumPy dtype, or JAX's own (a PRNG key's) as it is


def path_step(key: Any) -> str:
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

    required_noun = "floating leaf of the pytree"  # how an error names the variables loading must fill

    def __init__(self, tree: Any):
        flat, self._treedef = jax.tree_util.tree_flatten_with_path(tree)
        self._steps = [tuple(path_step(k) for k in path) for path, _ in flat]
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
        return is_floating(dtype)

    def variables(self) -> dict[str, tuple[Shape, np.dtype, bool]]:
        """See :meth:`VariableTree.variables`."""
        out = {}
        for steps, name in zip(self._steps, self._names):
            if is_python_number(self._leaves[name]):  # a hyper-parameter (a Python int, float or bool): not a variable
                continue
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

    def like(self, tree: Any) -> PytreeTree:
        """The same kind of tree over ``tree`` (a copy of this one's pytree, or its float64 cast)."""
        return type(self)(tree)

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

    required_noun = "variable of the params and batch_stats collections"

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


def is_equinox_module(model: Any) -> bool:
    """Whether ``model`` is an ``equinox.Module`` (without importing equinox: if it is not imported, it is not)."""
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(model, eqx.Module)


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _inexact(leaf: Any) -> bool:
    """``eqx.is_inexact_array``, abstract leaves (``eqx.filter_eval_shape``) included."""
    return _is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)


class EquinoxTree(PytreeTree):
    """:class:`VariableTree` of an ``equinox.Module``: paths are its attribute names and sequence indices, dotted
    (``layers.0.attn.query_proj.weight``), as a user reads them.

    Its variables are its array leaves (callables, Python numbers and static fields are not variables); the
    required ones are the parameters: its inexact arrays, or those ``params`` chooses (an Equinox filter, as
    ``eqx.partition`` takes it: a callable on leaves or a pytree of bools). Writes go into a copy (an Equinox
    module is immutable): :meth:`tree` is the filled module.
    """

    def __init__(self, module: Any, params: Any = None):
        super().__init__(module)
        if params is None:
            chosen = {n for n, leaf in self._leaves.items() if _inexact(leaf)}
        else:
            import equinox as eqx  # only for a module that is one

            selected, _ = eqx.partition(module, params)
            chosen = set(PytreeTree(selected)._names)  # unselected leaves are None: not leaves
        self.params = params
        self.chosen = chosen

    def required(self, steps: tuple[str, ...], dtype: np.dtype) -> bool:
        """The parameters (see the class docstring) must be filled."""
        return self.name_of(steps) in getattr(self, "chosen", ())

    def variables(self) -> dict[str, tuple[Shape, np.dtype, bool]]:
        """See :meth:`VariableTree.variables`: the array leaves."""
        out = {}
        for name in self._names:
            leaf = self._leaves[name]
            if _is_array(leaf):
                out[name] = (tuple(leaf.shape), np.dtype(leaf.dtype), name in self.chosen)
        return out

    def lookup(self, path: str) -> str:
        """See :meth:`VariableTree.lookup`: an array leaf."""
        found = super().lookup(path)
        if not _is_array(self._leaves[found]):
            raise KeyError(f"{path!r} is a {type(self._leaves[found]).__name__}, not an array")
        return found

    def like(self, module: Any) -> EquinoxTree:
        """The tree of ``module`` (this one's, another copy) with the same ``params`` filter."""
        return EquinoxTree(module, self.params)


def is_keras_layer(model: Any) -> bool:
    """Whether ``model`` is a ``keras.Layer`` (a ``keras.Model`` too), without importing keras: if it is not
    imported, it is not one."""
    keras = sys.modules.get("keras")
    layer = getattr(getattr(keras, "layers", None), "Layer", None)
    return layer is not None and isinstance(model, layer)


class KerasTree(PytreeTree):
    """:class:`VariableTree` of a Keras 3 model (or layer): paths are its variables' Keras paths
    (``transformer_layer_0/self_attention/query/kernel``), as ``variable.path`` gives them.

    Its trainable variables come first, then its non-trainable ones (BatchNorm moving statistics, seed
    generators' states), each list in the order ``stateless_call`` takes it (:attr:`trainable`,
    :attr:`non_trainable`). Every floating variable is required, trainable or not; the others (seeds) are filled
    only where a rule names them. Writes go into a copy: the caller's model and its variables are never changed;
    :meth:`tree` is ``{path: value}``.
    """

    required_noun = "floating variable of the Keras model"

    def __init__(self, model: Any, values: Mapping[str, Any] | None = None, named_like: Any = None):
        self.model, self.named_like = model, named_like
        self.trainable = _keras_paths(_paired(model, named_like, "trainable_variables"))
        self.non_trainable = _keras_paths(_paired(model, named_like, "non_trainable_variables"))
        own = dict(zip(self.trainable, model.trainable_variables))
        own.update(zip(self.non_trainable, model.non_trainable_variables))
        if len(own) != len(self.trainable) + len(self.non_trainable):
            twice = sorted(p for p in self.trainable if p in self.non_trainable)
            raise ValueError(f"two variables of the Keras model have one path: {twice[:4]}; give their layers names")
        super().__init__({p: v.value for p, v in own.items()} if values is None else dict(values))

    def like(self, tree: Any) -> KerasTree:
        """The tree of the same model with the values ``tree`` (``{path: value}``: a copy, or its float64 cast)."""
        return KerasTree(self.model, tree, self.named_like)

    def ordered(self, tree: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
        """``tree``'s values (``{path: value}``) as ``stateless_call`` takes them: (trainable, non-trainable)."""
        return [tree[p] for p in self.trainable], [tree[p] for p in self.non_trainable]


def _paired(model: Any, named_like: Any, which: str) -> Any:
    """``model``'s variables (``which``: ``"trainable_variables"``, ``"non_trainable_variables"``), or, where it is
    built again from ``named_like``, ``named_like``'s, whose paths name them one for one in the layer tree's order
    (Keras lists a layer's own variables, then each sublayer's, in the order the layer holds them, whatever order
    they were built in); ``ValueError`` where the two do not pair by count and shape."""
    variables = getattr(model, which)
    if named_like is None:
        return variables
    named = getattr(named_like, which)
    shapes = [tuple(v.shape) for v in variables], [tuple(v.shape) for v in named]
    if shapes[0] != shapes[1]:
        raise ValueError(
            f"the rebuilt Keras model's variables do not pair with the given model's in order: shapes "
            f"{shapes[0][:6]} against {shapes[1][:6]}; the factory must build the same layers in the same order"
        )
    return named


def _keras_paths(variables: Any) -> list[str]:
    """The Keras paths of ``variables``, in order; ``ValueError`` for two with one path."""
    paths = [v.path for v in variables]
    if len(set(paths)) != len(paths):
        twice = sorted({p for p in paths if paths.count(p) > 1})
        raise ValueError(f"two variables of the Keras model have one path: {twice[:4]}; give their layers names")
    return paths


def read_values(tree: VariableTree, path: str) -> np.ndarray | None:
    """The values of the variable at ``path``; ``None`` for an abstract one (a ``jax.ShapeDtypeStruct``, or a
    Variable holding one: what ``nnx.eval_shape`` builds and a loader that misses a key leaves behind)."""
    try:
        value = tree.read(path)
    except (TypeError, AttributeError):  # an nnx.Variable holding a ShapeDtypeStruct cannot be indexed
        return None
    return None if value.dtype == object else value


_KINDS = (
    "an nnx.Module, an equinox.Module, a Keras model, a VariableTree (flax_ln.convert.LinenTree(variables) for a "
    "Linen module's variables, flax_ln.convert.PytreeTree(params) for a parameter pytree), or a "
    "flax_ln.parity.Linen, Function, Equinox or Keras"
)


def as_variable_tree(model: Any, caller: str) -> VariableTree:
    """The :class:`VariableTree` of ``model``: an ``nnx.Module``'s :class:`NNXTree`, a tree itself, or what the
    model's ``variable_tree()`` gives (``flax_ln.parity.Linen`` and ``Function``); a ``TypeError`` naming
    ``caller`` and the kinds it takes for anything else (a bare pytree does not say how its paths are named)."""
    if isinstance(model, nnx.Module):
        return NNXTree(model)
    if is_equinox_module(model):
        return EquinoxTree(model)
    if is_keras_layer(model):
        return KerasTree(model)
    if isinstance(model, VariableTree):
        return model
    make = getattr(model, "variable_tree", None)
    if callable(make):
        tree = make()
        if isinstance(tree, VariableTree):
            return tree
    raise TypeError(
        f"{caller} takes {_KINDS}; got {type(model).__name__}"
        + (
            ": wrap a pytree in LinenTree(...) or PytreeTree(...) to say how its variables are named"
            if isinstance(model, (Mapping, list, tuple))
            else ""
        )
    )


def require_module(model: Any, caller: str, fix: str = "") -> nnx.Module:
    """``model`` when it is an ``nnx.Module``, else a ``TypeError`` naming ``caller``, what came in and ``fix``."""
    if isinstance(model, nnx.Module):
        return model
    fix = fix or (
        "fill a copy of a Linen module's variables or a parameter pytree with flax_ln.convert.fill_tree("
        "LinenTree(variables) or PytreeTree(params), state_dict, key_map) and take the tree's .tree()"
    )
    raise TypeError(f"{caller} takes an nnx.Module, got {type(model).__name__}; {fix}")


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


def loaded_tree(loaded: Any, kind: str | None) -> VariableTree:
    """What a port's loader returned (``KeyMap.discover``'s ``kind``) as a variable tree."""
    if isinstance(loaded, nnx.Module):
        return NNXTree(loaded)
    if is_equinox_module(loaded):  # kind="equinox", or recognised by type
        return EquinoxTree(loaded)
    if is_keras_layer(loaded):  # kind="keras", or recognised by type
        return KerasTree(loaded)
    if kind == "keras":
        raise TypeError(
            f"KeyMap.discover(kind='keras'): the loader must return a Keras model (a keras.Layer), got "
            f"{type(loaded).__name__}, e.g. lambda folder: keras_hub.models.Backbone.from_preset(folder) with "
            "takes='folder'"
        )
    if kind == "function":  # any JAX pytree, named as flax_ln.parity.Function names its params
        return PytreeTree(loaded)
    if isinstance(loaded, Mapping):
        if kind == "linen":
            return LinenTree(dict(loaded))
        raise TypeError(
            f"KeyMap.discover: the loader returned a dict but kind={kind!r}; pass kind='linen' for Linen variables "
            "(collections at the top: {'params': ...}) or kind='function' for a parameter pytree"
        )
    raise TypeError(
        "KeyMap.discover: the loader must return an nnx.Module, an equinox.Module, a Keras model, a dict (with "
        f"kind='linen') or a pytree (with kind='function'), got {type(loaded).__name__}"
    )
