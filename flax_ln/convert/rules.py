"""The rule table: strict, bidirectional conversion for NNX models that mirror their torch twins.

Everything is driven by :data:`RULES`, one table keyed by NNX module type. Each
:class:`ModuleRule` lists the module's leaves and declares its layouts:

* a :class:`Leaf` pairs a flax attribute with a torch state-dict name, and its
  :class:`Permute` (if any) declares how the array's axes are ordered in each
  framework (``nn.Linear.weight`` is ``(out, in)``, ``nnx.Linear.kernel`` is ``(in, out)``);
* a :class:`DerivedBuffer` names a persistent torch buffer that the flax module
  recomputes from its configuration, or keeps no state for, instead of storing it;
* ``activation_layout`` declares where a layer's activations are laid out differently
  (``nnx.Conv`` works on ``(N, *spatial, C)``, ``torch.nn.Conv2d`` on ``(N, C, *spatial)``),
  which :func:`torch_activation` applies;
* ``renames`` maps child attribute names that differ between the two models;
* ``stacked`` names descendants that hold layers stacked along a leading axis
  (``nnx.vmap``-built layers run with ``scan``); each maps to torch's per-layer keys
  ``<path>.<i>.<rest>``, as ``nn.ModuleList`` writes them.

A torch key is the module's path in the NNX tree (each step renamed by its parent's
rule), joined with dots, followed by the leaf's torch name, so the converter works for
any model built from modules in the table. Users extend the table with
:func:`register_rule` and :func:`register_rename`. :func:`load_with_rules` and
:func:`export_with_rules` are what :func:`~flax_ln.convert.load_torch_state_dict` and
:func:`~flax_ln.convert.to_torch_state_dict` do without a key map.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from flax import nnx

from flax_ln.convert.assign import (
    SAVED_KINDS,
    ModuleT,
    as_numpy,
    assign,
    copy_into,
    dtype_problem,
    host_buffer,
    owned_copy,
)
from flax_ln.convert.errors import ConversionError, MissingRuleError
from flax_ln.convert.layouts import Permute
from flax_ln.convert.ties import Tie, find_ties
from flax_ln.convert.trees import NNXTree, require_module
from flax_ln.models.encoder_decoder import PositionalEncoding
from flax_ln.models.gpt import GPT, CausalSelfAttention, causal_mask_buffer
from flax_ln.models.layernorm import LayerNorm, TorchLayerNorm


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A flax attribute ``flax`` stored under torch name ``torch``, its axes ordered as ``layout`` says.

    An attribute that is ``None`` on an instance (``nnx.Linear(use_bias=False).bias``) is
    skipped; torch's twin then has no such key either.
    """

    flax: str
    torch: str
    layout: Permute | None = None


@dataclasses.dataclass(frozen=True)
class DerivedBuffer:
    """A persistent torch buffer that the flax module does not store; ``make(module)`` gives its value.

    With ``exact=True`` a loaded value must equal ``make(module)`` (a buffer flax
    recomputes from its config). With ``exact=False`` any value of the right shape and
    dtype kind is accepted and dropped, and export writes ``make(module)`` (torch state
    that no flax computation reads).
    """

    torch: str
    make: Callable[[Any], np.ndarray]  # Any: the module type the rule is registered for
    exact: bool = True


LeafRule = Leaf | DerivedBuffer
# Any: each rule's function takes the module type it is registered for (a Callable is contravariant in it)
ActivationLayout = Permute | Callable[[Any], Permute | None] | None
StackedLayers = Callable[[Any], Mapping[str, int]] | None


@dataclasses.dataclass(frozen=True)
class ModuleRule:
    """Everything the converter and the parity engine know about one NNX module type.

    Args:
      leaves: the module's own arrays (:class:`Leaf`, :class:`DerivedBuffer`).
      activation_layout: how the module's input and output activations are laid out in
        torch against flax; ``None`` when they agree. A :class:`Permute`, or a function
        of the instance that returns one (or ``None``).
      renames: ``{flax child attribute: torch child name}`` where the models name a child differently.
      stacked: a function of the instance giving ``{dotted flax path below it: number of
        layers}`` for each descendant whose variables carry a leading layer axis.
    """

    leaves: tuple[LeafRule, ...] = ()
    activation_layout: ActivationLayout = None
    renames: Mapping[str, str] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    stacked: StackedLayers = None


# torch keeps a linear weight as (out, in) and a conv weight as (out, in / groups, *kernel);
# flax keeps (in, out) and (*kernel, in / groups, out).
LINEAR_KERNEL = Permute("out in", "in out")
CONV_KERNEL = Permute("out in ...", "... in out")
# torch convolves and batch-normalises (N, C, *spatial); flax (N, *spatial, C).
CHANNELS_LAST = Permute("n c ...", "n ... c")


def _batchnorm_layout(module: nnx.BatchNorm) -> Permute | None:
    """flax's BatchNorm normalises over ``axis`` (default -1, channels last); torch's over axis 1."""
    return CHANNELS_LAST if module.axis == -1 else None


def _gpt_stacked_blocks(gpt: GPT) -> dict[str, int]:
    """``GPT(scan_layers=True)`` stacks its blocks in ``transformer.h``; torch lists ``transformer.h.{i}``."""
    return {"transformer.h": gpt.config.n_layer} if gpt.scan_layers else {}


def _untracked_batch_count(module: nnx.Module) -> np.ndarray:
    """torch's ``num_batches_tracked``: flax keeps no count, so export writes 0 (an int64 scalar)."""
    return np.zeros((), np.int64)


_AFFINE = (Leaf("scale", "weight"), Leaf("bias", "bias"))

# The one rule table.
RULES: dict[type, ModuleRule] = {
    # standard torch.nn layers and their flax.nnx twins
    nnx.Linear: ModuleRule((Leaf("kernel", "weight", LINEAR_KERNEL), Leaf("bias", "bias"))),
    nnx.Embed: ModuleRule((Leaf("embedding", "weight"),)),
    nnx.LayerNorm: ModuleRule(_AFFINE),
    nnx.RMSNorm: ModuleRule((Leaf("scale", "weight"),)),
    nnx.Conv: ModuleRule((Leaf("kernel", "weight", CONV_KERNEL), Leaf("bias", "bias")), CHANNELS_LAST),
    # flax's BatchNorm updates its statistics with a fixed momentum and keeps no batch count;
    # torch reads num_batches_tracked only when momentum=None (a cumulative average flax does
    # not offer). Loading accepts any integer count and drops it; export writes 0 so that the
    # state dict loads strict=True into torch.
    nnx.BatchNorm: ModuleRule(
        _AFFINE
        + (
            Leaf("mean", "running_mean"),
            Leaf("var", "running_var"),
            DerivedBuffer("num_batches_tracked", _untracked_batch_count, exact=False),
        ),
        _batchnorm_layout,
    ),
    # the book's modules
    LayerNorm: ModuleRule((Leaf("a_2", "a_2"), Leaf("b_2", "b_2"))),
    TorchLayerNorm: ModuleRule(_AFFINE),
    # The sinusoidal table is a stored Buffer, not a DerivedBuffer: torch checkpoints carry
    # tables whose last bits depend on the sin/cos kernel that wrote them.
    PositionalEncoding: ModuleRule((Leaf("pe", "pe"),)),
    # torch's persistent causal mask (1, 1, block, block); flax builds the mask from iotas.
    CausalSelfAttention: ModuleRule((DerivedBuffer("bias", lambda m: causal_mask_buffer(m.block_size)),)),
    GPT: ModuleRule(stacked=_gpt_stacked_blocks),
}


def rule_for(module_type: type) -> ModuleRule | None:
    """The rule of ``module_type`` or of its nearest base class in :data:`RULES`, else ``None``."""
    for cls in module_type.__mro__:
        if cls in RULES:
            return RULES[cls]
    return None


def _check_module_type(nnx_type: Any, caller: str) -> None:
    if not (isinstance(nnx_type, type) and issubclass(nnx_type, nnx.Module)):
        raise TypeError(f"{caller}: nnx_type must be an nnx.Module subclass, got {nnx_type!r}")


def register_rule(
    nnx_type: type,
    leaves: Iterable[LeafRule] = (),
    *,
    activation_layout: ActivationLayout = None,
    stacked: StackedLayers = None,
) -> ModuleRule:
    """Declare how a module type's own arrays map to torch; returns the rule now in :data:`RULES`.

    Example: a flax ``Gate`` holding ``w`` of shape (in, out) whose torch twin stores
    ``weight`` as (out, in)::

        register_rule(Gate, [Leaf("w", "weight", Permute("out in", "in out"))])

    Subclasses inherit the rule unless they register their own. Renames already
    registered for ``nnx_type`` are kept.

    Args:
      nnx_type: the NNX module class.
      leaves: one :class:`Leaf` per array attribute (including ``None``-able ones), and a
        :class:`DerivedBuffer` per torch buffer flax does not store.
      activation_layout: a :class:`Permute` (or a function of the instance returning one)
        when the module's activations are laid out differently from torch's; ``None`` when
        they agree.
      stacked: for a container, a function of the instance giving ``{dotted path below it:
        number of layers}`` for children built with ``nnx.vmap`` (a leading layer axis),
        e.g. ``lambda m: {"blocks": m.num_layers}``.
    """
    _check_module_type(nnx_type, "register_rule")
    leaves = tuple(leaves)
    for leaf in leaves:
        if not isinstance(leaf, (Leaf, DerivedBuffer)):
            raise TypeError(f"register_rule({nnx_type.__name__}): expected Leaf or DerivedBuffer entries, got {leaf!r}")
    if not (activation_layout is None or isinstance(activation_layout, Permute) or callable(activation_layout)):
        raise TypeError(
            f"register_rule({nnx_type.__name__}): activation_layout must be a Permute, a function of the "
            f"module returning one, or None; got {activation_layout!r}"
        )
    if not (stacked is None or callable(stacked)):
        raise TypeError(
            f"register_rule({nnx_type.__name__}): stacked must be a function of the module returning "
            f"{{dotted path: number of layers}}, or None; got {stacked!r}"
        )
    renames = RULES[nnx_type].renames if nnx_type in RULES else types.MappingProxyType({})
    RULES[nnx_type] = ModuleRule(leaves, activation_layout, renames, stacked)
    return RULES[nnx_type]


def register_rename(nnx_type: type, renames: Mapping[str, str]) -> ModuleRule:
    """Declare child attributes of ``nnx_type`` that the torch model names differently.

    ``register_rename(Tagger, {"blocks": "layers"})`` maps flax ``blocks.0.proj.kernel``
    to torch ``layers.0.proj.weight``. The module's leaves and activation layout (its
    own, or inherited from a base class) are kept; later renames add to earlier ones.

    Args:
      nnx_type: the parent NNX module class.
      renames: ``{flax attribute: torch name}``.
    """
    _check_module_type(nnx_type, "register_rename")
    bad = {k: v for k, v in dict(renames).items() if not (isinstance(k, str) and isinstance(v, str) and k and v)}
    if bad:
        raise TypeError(f"register_rename({nnx_type.__name__}): expected non-empty str -> str pairs, got {bad!r}")
    base = rule_for(nnx_type) or ModuleRule()
    RULES[nnx_type] = dataclasses.replace(base, renames=types.MappingProxyType({**base.renames, **renames}))
    return RULES[nnx_type]


def torch_activation(module: nnx.Module, array):
    """``array``, an input or output activation of flax ``module``, in the layout torch's twin uses.

    Identity when the module's rule declares no activation layout (or none for this
    instance); otherwise the declared :class:`Permute`, e.g. flax ``nnx.Conv`` output
    ``(N, L, C)`` becomes ``(N, C, L)``. Works on NumPy and JAX arrays alike.

    Args:
      module: the flax submodule that produced (or took) ``array``.
      array: a batched activation, ``(N, ...)``.
    """
    layout = activation_layout(module)
    return array if layout is None else array.transpose(layout.to_torch(np.ndim(array)))


def flax_activation(module: nnx.Module, array):
    """The inverse of :func:`torch_activation`: a torch activation of ``module``'s twin in ``module``'s layout."""
    layout = activation_layout(module)
    return array if layout is None else array.transpose(layout.to_flax(np.ndim(array)))


def activation_layout(module: nnx.Module) -> Permute | None:
    """How ``module``'s activations are laid out in torch against flax: its rule's :class:`Permute` (or the
    one its rule's function gives for this instance); ``None`` when they agree or no rule covers it."""
    rule = rule_for(type(module))
    layout = None if rule is None else rule.activation_layout
    if layout is not None and not isinstance(layout, Permute):
        layout = layout(module)
    return layout


@dataclasses.dataclass(frozen=True)
class _Entry:
    key: str
    module: nnx.Module
    leaf: LeafRule
    layer: int | None  # index along the stacked leading axis, or None


def _torch_prefix(path: tuple, modules: Mapping[tuple, nnx.Module], stack: tuple | None, layer: int | None) -> str:
    """Dotted torch path of an NNX module path: steps renamed by their parent's rule, a layer index after a stack."""
    parts = []
    for i, step in enumerate(path):
        parent = modules.get(path[:i])
        rule = None if parent is None else rule_for(type(parent))
        parts.append(rule.renames.get(str(step), str(step)) if rule is not None else str(step))
        if stack is not None and i + 1 == len(stack):
            parts.append(str(layer))
    return ".".join(parts)


def _missing_rule_error(uncovered: Mapping[tuple, list[str]], modules: Mapping[tuple, nnx.Module]) -> MissingRuleError:
    lines = []
    for path, attrs in uncovered.items():
        module = modules[path]
        where = ".".join(map(str, path)) or "<root>"
        lines.append(f"module {where!r} ({type(module).__qualname__}): {', '.join(attrs)}")
    path, attrs = next(iter(uncovered.items()))
    example = ", ".join(f"Leaf({a!r}, <torch name>)" for a in attrs)
    return MissingRuleError(
        "no conversion rule covers these parameters:\n  " + "\n  ".join(lines) + "\n"
        f"Declare each module type's torch names, e.g. flax_ln.convert.register_rule("
        f"{type(modules[path]).__qualname__}, [{example}]), with Permute(...) as a Leaf's layout where "
        "torch orders the axes differently; or build the model from layers in flax_ln.convert.RULES"
    )


def _stacks(modules: Mapping[tuple, nnx.Module]) -> dict[tuple, int]:
    """Module path -> number of layers, for every stacked descendant a rule declares."""
    stacks = {}
    for path, module in modules.items():
        rule = rule_for(type(module))
        if rule is None or rule.stacked is None:
            continue
        for relative, num_layers in rule.stacked(module).items():
            target = next(
                (
                    p
                    for p in modules
                    if p[: len(path)] == path and tuple(map(str, p[len(path) :])) == tuple(relative.split("."))
                ),
                None,
            )
            if target is None:
                raise ValueError(
                    f"the conversion rule for {type(module).__qualname__} declares stacked layers at {relative!r}, "
                    f"which module {'.'.join(map(str, path)) or '<root>'!r} does not hold"
                )
            stacks[target] = num_layers
    return stacks


def torch_module_paths(model: nnx.Module) -> dict[str, str]:
    """Dotted flax path -> dotted torch path of every submodule, with registered renames applied.

    The parity engine pairs submodules through it. Modules inside stacked layers are left
    out: one flax module there stands for every torch layer. The root maps ``""`` to ``""``.
    """
    modules = {tuple(path): m for path, m in nnx.iter_modules(model)}
    stacks = _stacks(modules)
    return {
        ".".join(map(str, path)): _torch_prefix(path, modules, None, None)
        for path in modules
        if not any(path[: len(stack)] == stack for stack in stacks)
    }


def torch_layer_path(model: nnx.Module, flax_path: str, layer: int) -> str | None:
    """The dotted torch path of layer ``layer`` of the module at dotted ``flax_path`` inside stacked layers (a rule's
    ``stacked``: ``transformer.h.attn``, layer 3 -> ``transformer.h.3.attn``); ``None`` outside a stack."""
    modules = {tuple(path): m for path, m in nnx.iter_modules(model)}
    path = next((p for p in modules if ".".join(map(str, p)) == flax_path), None)
    stacks = _stacks(modules)
    stack = None if path is None else next((s for s in stacks if path[: len(s)] == s), None)
    return None if path is None or stack is None else _torch_prefix(path, modules, stack, layer)


def _entries(model: nnx.Module) -> list[_Entry]:
    modules = {tuple(path): m for path, m in nnx.iter_modules(model)}
    stacks = _stacks(modules)
    entries, covered = [], set()
    for path, module in modules.items():
        rule = rule_for(type(module))
        if rule is None or not rule.leaves:
            continue
        stack = next((p for p in stacks if path[: len(p)] == p), None)
        for layer in range(stacks[stack]) if stack is not None else [None]:
            prefix = _torch_prefix(path, modules, stack, layer)
            for leaf in rule.leaves:
                if isinstance(leaf, Leaf):
                    if not hasattr(module, leaf.flax):
                        raise AttributeError(
                            f"the conversion rule for {type(module).__qualname__} names attribute {leaf.flax!r}, "
                            f"which module {'.'.join(map(str, path)) or '<root>'!r} lacks; fix the rule's Leaf"
                        )
                    var = getattr(module, leaf.flax)
                    if var is None:  # e.g. nnx.Linear(use_bias=False)
                        continue
                    if not isinstance(var, nnx.Variable):
                        raise TypeError(
                            f"{type(module).__qualname__}.{leaf.flax} is a {type(var).__name__}; a conversion Leaf "
                            "must name an nnx.Variable (nnx.Param, nnx.BatchStat, ...)"
                        )
                    covered.add(id(var))
                entries.append(_Entry(f"{prefix}.{leaf.torch}" if prefix else leaf.torch, module, leaf, layer))
    uncovered: dict[tuple, list[str]] = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, SAVED_KINDS) and id(node) not in covered:
            owner = tuple(path[:-1])
            while owner not in modules:  # a Variable inside a plain container: name its module
                owner = owner[:-1]
            uncovered.setdefault(owner, []).append(".".join(map(str, path[len(owner) :])))
    if uncovered:
        raise _missing_rule_error(uncovered, modules)
    return entries


def _expected_spec(entry: _Entry) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype, in torch layout, that a state-dict value for this entry must have."""
    if isinstance(entry.leaf, DerivedBuffer):
        buffer = np.asarray(entry.leaf.make(entry.module))
        return buffer.shape, buffer.dtype
    var = getattr(entry.module, entry.leaf.flax)
    shape = tuple(var.shape[1:] if entry.layer is not None else var.shape)
    if entry.leaf.layout is not None:
        shape = tuple(shape[i] for i in entry.leaf.layout.to_torch(len(shape)))
    return shape, np.dtype(var.dtype)


def _torch_layout(entry: _Entry, host_values: dict[int, np.ndarray], views: bool = False) -> np.ndarray:
    """The torch-layout array this entry contributes to a state dict (an owned copy; with ``views``, a read-only
    view of the variable's host buffer where one is possible: a layer of a stack, a transpose)."""
    if isinstance(entry.leaf, DerivedBuffer):
        return np.array(entry.leaf.make(entry.module))
    var = getattr(entry.module, entry.leaf.flax)
    if id(var) not in host_values:  # one device-to-host copy per variable, not per layer
        host_values[id(var)] = np.asarray(var.get_value())  # the buffer itself (var[...] would index: a copy)
    value = host_values[id(var)]
    if entry.layer is not None:
        value = value[entry.layer]
    if entry.leaf.layout is not None:
        value = value.transpose(entry.leaf.layout.to_torch(value.ndim))
    return value if views else owned_copy(value)


def _aliases(expected: Iterable[str], keys: Iterable[str], ties: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """``{torch key: the key of its tie the rule table fills}`` for ``keys`` that no rule names but that torch
    ties to one a rule names: a tie kept as one variable on the flax side (a head that reuses the embedding, a
    module shared under two names), which the rules reach under one of the names."""
    expected, keys = set(expected), set(keys)
    out = {}
    for group in ties.values():
        filled = next((k for k in group if k in expected and k in keys), None)
        if filled is not None:
            out.update({k: filled for k in group if k in keys and k not in expected})
    return out


def rule_ties(model: nnx.Module, ties: Mapping[str, Iterable[str]]) -> dict[str, Tie]:
    """The :class:`~flax_ln.convert.Tie` s of torch's ``ties`` (as :func:`~flax_ln.convert.find_ties` gives them)
    through the rule table, as a key map's plan lists them: each tie's torch keys, and the canonical paths of the
    flax variables (``path[i]`` for a layer of a stacked one) its keys fill."""
    canonical = {id(v): path for path, v in NNXTree(model).variable_items()}
    filled: dict[str, list[str]] = {}
    for e in _entries(model):
        if isinstance(e.leaf, Leaf):
            path = canonical[id(getattr(e.module, e.leaf.flax))]
            filled.setdefault(e.key, []).append(path if e.layer is None else f"{path}[{e.layer}]")
    out = {}
    for name, group in ties.items():
        keys = tuple(group)
        if len(keys) > 1 and any(k in filled for k in keys):
            out[name] = Tie(keys, tuple(dict.fromkeys(p for k in keys for p in filled.get(k, ()))))
    return out


def load_with_rules(
    model: ModuleT,
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    ties: Mapping[str, Iterable[str]] | None = None,
) -> ModuleT:
    """:func:`~flax_ln.convert.load_torch_state_dict` through the rule table: check all, then write.

    A key no rule names that torch ties to one a rule names (``ties``, by default
    :func:`~flax_ln.convert.find_ties` of ``state_dict``) is that key's alias: checked for its
    shape and dtype, and filled through the key the rules name.
    """
    entries = _entries(require_module(model, "load_torch_state_dict"))
    expected = {e.key for e in entries}
    extra = state_dict.keys() - expected  # ties are looked for only where a key needs one
    aliases = _aliases(expected, state_dict.keys(), find_ties(state_dict) if ties is None else ties) if extra else {}
    missing = expected - state_dict.keys() if strict else set()
    unexpected = state_dict.keys() - expected - aliases.keys() if strict else set()
    mismatched: list[tuple[str, str]] = []
    per_variable: dict[int, tuple[nnx.Variable, dict[int | None, np.ndarray]]] = {}
    for entry in entries:
        if entry.key not in state_dict:
            continue
        got = as_numpy(state_dict[entry.key])
        want_shape, want_dtype = _expected_spec(entry)
        if got.shape != want_shape:
            mismatched.append((entry.key, f"expected shape {want_shape}, got {got.shape}"))
            continue
        problem = dtype_problem(got.dtype, want_dtype)
        if problem:
            mismatched.append((entry.key, problem))
            continue
        if isinstance(entry.leaf, DerivedBuffer):
            want = np.asarray(entry.leaf.make(entry.module), dtype=np.float64)
            if entry.leaf.exact and not np.array_equal(got.astype(np.float64), want):
                mismatched.append((entry.key, "buffer differs from the value this module computes from its config"))
            continue
        if entry.leaf.layout is not None:
            got = got.transpose(entry.leaf.layout.to_flax(got.ndim))
        var = getattr(entry.module, entry.leaf.flax)
        per_variable.setdefault(id(var), (var, {}))[1][entry.layer] = got
    for alias, key in aliases.items():
        got, want = as_numpy(state_dict[alias]), as_numpy(state_dict[key])
        if got.shape != want.shape or got.dtype != want.dtype:
            mismatched.append(
                (
                    alias,
                    f"tied to {key!r}, which the rules fill, so its {want.shape} {want.dtype} was expected, "
                    f"got {got.shape} {got.dtype}",
                )
            )
    if missing or unexpected or mismatched:
        raise ConversionError(missing, unexpected, mismatched)

    for var, layers in per_variable.values():
        if None in layers:
            new = layers[None]
            assign(var, new)
            continue
        new = host_buffer(var.shape, var.dtype)  # (n_layer, ...): the layers written straight into the one copy
        if len(layers) < var.shape[0]:  # strict=False with some layers absent: fill in from the current value
            new[...] = np.asarray(var[...])
        for i, arr in layers.items():
            copy_into(new[i], arr)  # tile by tile where the layout transposes it
        assign(var, new, owned=True)
    return model


def torch_leaves(model: nnx.Module) -> dict[str, tuple[nnx.Variable, int | None, Permute | None]]:
    """``{torch key: (variable, layer, layout)}`` for every key ``model`` stores (derived buffers left out).

    ``layer`` indexes the variable's stacked leading axis (``None`` if not stacked);
    ``layout`` is the :class:`Leaf`'s (``None``: torch and flax agree). Reads only
    shapes, so it works on an abstract model (``nnx.eval_shape``).
    """
    return {
        e.key: (getattr(e.module, e.leaf.flax), e.layer, e.leaf.layout)
        for e in _entries(model)
        if isinstance(e.leaf, Leaf)
    }


def export_with_rules(model: nnx.Module, *, views: bool = False) -> dict[str, np.ndarray]:
    """:func:`~flax_ln.convert.to_torch_state_dict` through the rule table. ``views``: the arrays may be read-only
    views of the model's buffers (no copy of the weights; for reading them at once, e.g. gradients compared)."""
    fix = (
        "the rule table reads the modules of an NNX model that mirrors its torch twin; export a Linen module's "
        "variables or a parameter pytree with weights=KeyMap(...)"
    )
    entries = _entries(require_module(model, "to_torch_state_dict without weights=", fix))
    host_values: dict[int, np.ndarray] = {}
    return {entry.key: _torch_layout(entry, host_values, views) for entry in entries}
