"""Strict, bidirectional conversion between torch state dicts and NNX modules.

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
:func:`register_rule` and :func:`register_rename`.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln.models.encoder_decoder import PositionalEncoding
from flax_ln.models.gpt import GPT, CausalSelfAttention, causal_mask_buffer
from flax_ln.models.layernorm import LayerNorm, TorchLayerNorm

if TYPE_CHECKING:
    from flax_ln.convert.keymap import KeyMap

_M = TypeVar("_M", bound=nnx.Module)
_SPATIAL = "..."


@dataclasses.dataclass(frozen=True)
class Permute:
    """How one array's axes are ordered in torch and in flax, as space-separated axis names.

    ``...`` stands for any number of axes kept in their order (a conv kernel's spatial
    axes, an activation's length/height/width), so one entry covers every rank:
    ``Permute("out in ...", "... in out")`` is the kernel of Conv1d, Conv2d and Conv3d alike.
    With ``perm = p.to_flax(ndim)``, ``flax_array = torch_array.transpose(perm)``.

    Args:
      torch: the axis names in torch's order, e.g. ``"out in"``.
      flax: the same names in flax's order, e.g. ``"in out"``.
    """

    torch: str
    flax: str

    def __post_init__(self):
        t, f = self.torch.split(), self.flax.split()
        if sorted(t) != sorted(f) or len(set(t)) != len(t) or t.count(_SPATIAL) > 1:
            raise ValueError(
                f"Permute({self.torch!r}, {self.flax!r}): both sides must list the same distinct axis "
                f"names, with at most one {_SPATIAL!r}; e.g. Permute('out in ...', '... in out')"
            )

    def _names(self, spec: str, ndim: int) -> list[str]:
        names = spec.split()
        fixed = len(names) - (_SPATIAL in names)
        if ndim < fixed or (_SPATIAL not in names and ndim != fixed):
            raise ValueError(
                f"Permute({self.torch!r}, {self.flax!r}) describes arrays of "
                f"{'at least ' if _SPATIAL in names else ''}{fixed} axes, got an array of {ndim}"
            )
        if _SPATIAL in names:
            at = names.index(_SPATIAL)
            names[at : at + 1] = [f"{_SPATIAL}{i}" for i in range(ndim - fixed)]
        return names

    def to_flax(self, ndim: int) -> tuple[int, ...]:
        """The permutation that takes a torch-layout array of ``ndim`` axes to flax layout."""
        t = self._names(self.torch, ndim)
        return tuple(t.index(name) for name in self._names(self.flax, ndim))

    def to_torch(self, ndim: int) -> tuple[int, ...]:
        """The permutation that takes a flax-layout array of ``ndim`` axes to torch layout."""
        f = self._names(self.flax, ndim)
        return tuple(f.index(name) for name in self._names(self.torch, ndim))


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

# Variable kinds that torch saves (parameters and running statistics): each must be covered by a rule.
_SAVED_KINDS = (nnx.Param, nnx.BatchStat)


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
    layout = _activation_layout(module)
    return array if layout is None else array.transpose(layout.to_torch(np.ndim(array)))


def flax_activation(module: nnx.Module, array):
    """The inverse of :func:`torch_activation`: a torch activation of ``module``'s twin in ``module``'s layout."""
    layout = _activation_layout(module)
    return array if layout is None else array.transpose(layout.to_flax(np.ndim(array)))


def _activation_layout(module: nnx.Module) -> Permute | None:
    rule = rule_for(type(module))
    layout = None if rule is None else rule.activation_layout
    if layout is not None and not isinstance(layout, Permute):
        layout = layout(module)
    return layout


class ConversionError(ValueError):
    """A state dict does not fit the model. Lists every offending key; the model is unchanged.

    Args:
      missing: torch keys the model needs that the state dict lacks.
      unexpected: torch keys the model has no place for.
      mismatched: ``(torch key, why)`` pairs: a wrong shape or dtype, a layout that does not fit, ...
      unfilled: ``(flax variable path, why)`` pairs, from a :class:`~flax_ln.convert.keymap.KeyMap`:
        a variable no rule fills, or one filled twice with different values.
      hint: how to fix it, printed after the list.
      header: what failed, in place of "state dict does not fit the model".
    """

    def __init__(
        self,
        missing=(),
        unexpected=(),
        mismatched=(),
        *,
        unfilled=(),
        hint: str | None = None,
        header: str | None = None,
    ):
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = sorted(mismatched)
        self.unfilled = sorted(unfilled)
        lines = [f"missing key {k!r}" for k in self.missing]
        lines += [f"unexpected key {k!r}" for k in self.unexpected]
        lines += [f"{k!r}: {why}" for k, why in self.mismatched]
        lines += [f"flax variable {p!r}: {why}" for p, why in self.unfilled]
        super().__init__(
            (
                f"{header} ({len(lines)} problem(s)):\n  "
                if header
                else f"state dict does not fit the model ({len(lines)} problem(s)); nothing was loaded:\n  "
            )
            + "\n  ".join(lines)
            + (f"\n{hint}" if hint else "")
        )


class MissingRuleError(NotImplementedError):
    """The model holds parameters (or running statistics) that no rule in :data:`RULES` covers."""


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
        if isinstance(node, _SAVED_KINDS) and id(node) not in covered:
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


def _torch_layout(entry: _Entry, host_values: dict[int, np.ndarray]) -> np.ndarray:
    """The torch-layout array this entry contributes to a state dict (an owned copy)."""
    if isinstance(entry.leaf, DerivedBuffer):
        return np.array(entry.leaf.make(entry.module))
    var = getattr(entry.module, entry.leaf.flax)
    if id(var) not in host_values:  # one device-to-host copy per variable, not per layer
        host_values[id(var)] = np.asarray(var[...])
    value = host_values[id(var)]
    if entry.layer is not None:
        value = value[entry.layer]
    if entry.leaf.layout is not None:
        value = value.transpose(entry.leaf.layout.to_torch(value.ndim))
    return np.array(value)


def _as_numpy(value: Any) -> np.ndarray:
    """A NumPy view of a torch tensor or array-like, without importing torch unless given one."""
    if hasattr(value, "detach"):  # a torch.Tensor
        import torch

        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            import ml_dtypes

            return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()
    return np.asarray(value)


def _dtype_problem(got: np.dtype, want: np.dtype) -> str | None:
    """Why a ``got`` value cannot replace a ``want`` variable: floats stay floating, integers stay integer."""
    if jnp.issubdtype(want, jnp.floating) and not jnp.issubdtype(got, jnp.floating):
        return (
            f"dtype {got} is not floating, but the parameter is {want}; pass floating-point weights "
            "(e.g. tensor.float()), an integer or bool tensor here is usually the wrong key"
        )
    if jnp.issubdtype(want, jnp.integer) and not jnp.issubdtype(got, jnp.integer):
        return f"dtype {got} is not an integer dtype, but the buffer is {want}; pass an integer tensor"
    return None


def load_torch_state_dict(
    model: _M, state_dict: Mapping[str, Any], *, strict: bool = True, weights: KeyMap | None = None
) -> _M:
    """Load a torch-style state dict into ``model`` in place and return it.

    Values may be ``torch.Tensor`` or NumPy arrays; each is cast to the dtype of the
    variable it replaces (floating parameters take only floating values, integer
    buffers only integer ones). Every key is validated before anything is written:
    missing and unexpected keys (only when ``strict``), wrong shapes and incompatible
    dtypes are all listed in one :class:`ConversionError`, and a failed load leaves the
    model as it was. Persistent buffers that flax recomputes (:class:`DerivedBuffer`)
    must equal the recomputed value. A parameter that no rule covers raises
    :class:`MissingRuleError` naming its module. Each value is placed with its variable's
    sharding: a sharded model keeps its placement, and
    ``flax_ln.sharding.abstract_model(make, mesh)`` gives a model to load onto a mesh
    with training's FSDP shardings, never initialised.

    With ``weights=`` a :class:`~flax_ln.convert.keymap.KeyMap` (the port's own table)
    places the keys instead of the rule table, as strictly: every key matches one rule,
    every ``nnx.Param`` and ``nnx.BatchStat`` is filled once, all problems in one error,
    nothing loaded on error. ``strict=False`` then allows keys no rule matches and
    variables no key fills.

    Args:
      model: the NNX model; its variables fix the expected shapes and dtypes.
      state_dict: torch key -> tensor or array, in torch layout.
      strict: require exactly the model's keys.
      weights: the port's key map; ``None``: the rule table.
    """
    if weights is not None:
        from flax_ln.convert.keymap import load_with_key_map

        return load_with_key_map(model, state_dict, weights, strict=strict)
    entries = _entries(model)
    expected = {e.key for e in entries}
    missing = expected - state_dict.keys() if strict else set()
    unexpected = state_dict.keys() - expected if strict else set()
    mismatched: list[tuple[str, str]] = []
    per_variable: dict[int, tuple[nnx.Variable, dict[int | None, np.ndarray]]] = {}
    for entry in entries:
        if entry.key not in state_dict:
            continue
        got = _as_numpy(state_dict[entry.key])
        want_shape, want_dtype = _expected_spec(entry)
        if got.shape != want_shape:
            mismatched.append((entry.key, f"expected shape {want_shape}, got {got.shape}"))
            continue
        problem = _dtype_problem(got.dtype, want_dtype)
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
    if missing or unexpected or mismatched:
        raise ConversionError(missing, unexpected, mismatched)

    for var, layers in per_variable.values():
        if None in layers:
            new = layers[None]
        elif len(layers) == var.shape[0]:
            new = np.stack([layers[i] for i in range(len(layers))])  # (n_layer, ...)
        else:  # strict=False with some layers absent: fill in from the current value
            new = np.array(var[...])
            for i, arr in layers.items():
                new[i] = arr
        _assign(var, new)
    return model


def _assign(var: nnx.Variable, new: np.ndarray) -> None:
    """Set ``var`` to an owned copy of ``new`` in its own dtype, placed with its sharding."""
    old = var.get_value()  # also a ShapeDtypeStruct, for a model made by nnx.eval_shape
    # An owned copy: torch's state_dict() shares memory with its parameters, and JAX
    # on the CPU may alias a NumPy buffer, so a later in-place torch update (an
    # optimizer step) would otherwise change the flax model behind its back.
    # Placed with the variable's sharding: kept by a sharded model, named by an abstract
    # one from flax_ln.sharding.abstract_model(make, mesh); None is the default device.
    value = jax.device_put(np.array(new, dtype=old.dtype, copy=True), getattr(old, "sharding", None))
    var.set_value(value)


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


def to_torch_state_dict(
    model: nnx.Module, *, weights: KeyMap | None = None, like: Mapping[str, Any] | None = None
) -> dict[str, np.ndarray]:
    """The model's weights as a dict of NumPy arrays with torch names and layouts.

    Includes the persistent buffers torch saves (running statistics, ``num_batches_tracked``,
    derived masks), so the result loads with ``strict=True`` into the torch twin (wrap
    values with ``torch.from_numpy``). Stacked layers come out as per-layer keys.

    With ``weights=`` a :class:`~flax_ln.convert.keymap.KeyMap` names the keys, each layout
    inverted. ``like=`` (the torch model's ``state_dict()``) fixes the key set, order and
    dtypes, gives the keys the map ignores, and the torch shapes that a layout with a
    reshape needs to invert. Without it, keys are written from each rule's regex (a
    literal with groups), ignored keys are left out with a warning, and a rule that needs
    torch's shapes is an error naming it. A tie (torch keys sharing one tensor) whose
    port copies differ raises :class:`ConversionError` naming it.

    Args:
      model: the NNX model.
      weights: the port's key map; ``None``: the rule table.
      like: a torch state dict to match; only with ``weights=``.
    """
    if weights is not None:
        from flax_ln.convert.keymap import export_with_key_map

        return export_with_key_map(model, weights, like)
    if like is not None:
        raise TypeError("to_torch_state_dict: like= goes with weights=KeyMap(...); the rule table fixes the keys")
    host_values: dict[int, np.ndarray] = {}
    return {entry.key: _torch_layout(entry, host_values) for entry in _entries(model)}
