"""Strict, bidirectional conversion between torch state dicts and flax_ln NNX modules.

Everything is driven by :data:`RULES`, one table keyed by NNX module type. Each entry
lists the module's leaves: a :class:`Leaf` pairs a flax attribute with a torch
state-dict name (and says whether the array is transposed), a :class:`DerivedBuffer`
names a persistent torch buffer that the flax module recomputes from its own
configuration instead of storing. A torch key is the module's path in the NNX tree,
joined with dots, followed by the leaf's torch name, so the converter works for any
model built from modules in the table.

A module whose instance attribute ``num_stacked_layers`` is an int holds layers
stacked along a leading axis (``scan_layers``); its torch keys are
``<path>.<i>.<rest>``, one set per layer, as torch's ``nn.ModuleList`` writes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln.models.encoder_decoder import PositionalEncoding
from flax_ln.models.gpt import CausalSelfAttention, causal_mask_buffer
from flax_ln.models.layernorm import LayerNorm, TorchLayerNorm


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A flax attribute ``flax`` stored under torch name ``torch``; ``transpose`` swaps the last two axes."""

    flax: str
    torch: str
    transpose: bool = False


@dataclasses.dataclass(frozen=True)
class DerivedBuffer:
    """A persistent torch buffer that the flax module computes from its config, ``make(module)``."""

    torch: str
    make: Callable[[nnx.Module], np.ndarray]


Rule = Leaf | DerivedBuffer

# The one rule table. torch nn.Linear stores weight as (out, in); flax kernel is (in, out).
RULES: dict[type, tuple[Rule, ...]] = {
    nnx.Linear: (Leaf("kernel", "weight", transpose=True), Leaf("bias", "bias")),
    nnx.Embed: (Leaf("embedding", "weight"),),
    LayerNorm: (Leaf("a_2", "a_2"), Leaf("b_2", "b_2")),
    TorchLayerNorm: (Leaf("scale", "weight"), Leaf("bias", "bias")),
    # The sinusoidal table is a stored Buffer, not a DerivedBuffer: torch checkpoints carry
    # tables whose last bits depend on the sin/cos kernel that wrote them.
    PositionalEncoding: (Leaf("pe", "pe"),),
    # torch's persistent causal mask (1, 1, block, block); flax builds the mask from iotas.
    CausalSelfAttention: (DerivedBuffer("bias", lambda m: causal_mask_buffer(m.block_size)),),
}


class ConversionError(ValueError):
    """A state dict does not fit the model. Lists every offending key; the model is unchanged."""

    def __init__(self, missing=(), unexpected=(), mismatched=()):
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = sorted(mismatched)
        lines = [f"missing key {k!r}" for k in self.missing]
        lines += [f"unexpected key {k!r}" for k in self.unexpected]
        lines += [f"{k!r}: {why}" for k, why in self.mismatched]
        super().__init__(
            f"state dict does not fit the model ({len(lines)} problem(s)); nothing was loaded:\n  "
            + "\n  ".join(lines)
        )


@dataclasses.dataclass(frozen=True)
class _Entry:
    key: str
    module: nnx.Module
    rule: Rule
    layer: int | None  # index along the stacked leading axis, or None


def _rules_for(module: nnx.Module) -> tuple[Rule, ...] | None:
    for cls in type(module).__mro__:
        if cls in RULES:
            return RULES[cls]
    return None


def _torch_path(path: tuple, stacked: dict[tuple, int], layer: int | None) -> list[str]:
    """Dotted torch path of an NNX module path, inserting the layer index after a stacked prefix."""
    parts = [str(p) for p in path]
    for prefix in stacked:
        if path[: len(prefix)] == prefix:
            parts.insert(len(prefix), str(layer))
            break
    return parts


def _entries(model: nnx.Module) -> list[_Entry]:
    modules = list(nnx.iter_modules(model))
    stacked = {
        tuple(path): m.num_stacked_layers
        for path, m in modules
        if isinstance(getattr(m, "num_stacked_layers", None), int)
    }
    entries, covered = [], set()
    for path, module in modules:
        rules = _rules_for(module)
        if rules is None:
            continue
        num_layers = next((n for p, n in stacked.items() if tuple(path[: len(p)]) == p), None)
        for layer in range(num_layers) if num_layers is not None else [None]:
            prefix = ".".join(_torch_path(tuple(path), stacked, layer))
            for rule in rules:
                if isinstance(rule, Leaf):
                    var = getattr(module, rule.flax, None)
                    if var is None:  # e.g. nnx.Linear(use_bias=False)
                        continue
                    covered.add(id(var))
                key = f"{prefix}.{rule.torch}" if prefix else rule.torch
                entries.append(_Entry(key, module, rule, layer))
    uncovered = [
        ".".join(map(str, path))
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Param) and id(node) not in covered
    ]
    if uncovered:
        raise NotImplementedError(
            f"no conversion rule covers parameter(s) {uncovered}; add the owning module type to "
            "flax_ln.convert.RULES"
        )
    return entries


def _expected_spec(entry: _Entry) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype, in torch layout, that a state-dict value for this entry must have."""
    if isinstance(entry.rule, DerivedBuffer):
        buffer = np.asarray(entry.rule.make(entry.module))
        return buffer.shape, buffer.dtype
    var = getattr(entry.module, entry.rule.flax)
    shape = tuple(var.shape[1:] if entry.layer is not None else var.shape)
    if entry.rule.transpose:
        shape = shape[:-2] + shape[-2:][::-1]
    return shape, np.dtype(var.dtype)


def _torch_layout(entry: _Entry, host_values: dict[int, np.ndarray]) -> np.ndarray:
    """The torch-layout array this entry contributes to a state dict (an owned copy)."""
    if isinstance(entry.rule, DerivedBuffer):
        return np.array(entry.rule.make(entry.module))
    var = getattr(entry.module, entry.rule.flax)
    if id(var) not in host_values:  # one device-to-host copy per variable, not per layer
        host_values[id(var)] = np.asarray(var[...])
    value = host_values[id(var)]
    if entry.layer is not None:
        value = value[entry.layer]
    if entry.rule.transpose:
        value = np.swapaxes(value, -1, -2)
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
    if jnp.issubdtype(want, jnp.floating) and not jnp.issubdtype(got, jnp.floating):
        return f"dtype {got} cannot be cast to the parameter's floating dtype {want}"
    if jnp.issubdtype(want, jnp.integer) and not jnp.issubdtype(got, jnp.integer):
        return f"dtype {got} cannot be cast to the parameter's integer dtype {want}"
    return None


def load_torch_state_dict(
    model: nnx.Module, state_dict: Mapping[str, Any], *, strict: bool = True
) -> nnx.Module:
    """Load a torch-style state dict into ``model`` in place and return it.

    Values may be ``torch.Tensor`` or NumPy arrays; each is cast to the dtype of the
    parameter it replaces. Every key is validated before anything is written: missing
    and unexpected keys (only when ``strict``), wrong shapes and incompatible dtypes are
    all listed in one :class:`ConversionError`, and a failed load leaves the model as
    it was. Persistent buffers that flax recomputes (:class:`DerivedBuffer`) must equal
    the recomputed value. Each value is placed with its variable's sharding: a sharded
    model keeps its placement, and ``flax_ln.sharding.abstract_model(make, mesh)`` gives
    a model to load onto a mesh with training's FSDP shardings, never initialised.
    """
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
        if isinstance(entry.rule, DerivedBuffer):
            want = np.asarray(entry.rule.make(entry.module), dtype=np.float64)
            if not np.array_equal(got.astype(np.float64), want):
                mismatched.append(
                    (entry.key, "buffer differs from the value this module computes from its config")
                )
            continue
        if entry.rule.transpose:
            got = np.swapaxes(got, -1, -2)
        var = getattr(entry.module, entry.rule.flax)
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
        old = var.get_value()  # also a ShapeDtypeStruct, for a model made by nnx.eval_shape
        # An owned copy: torch's state_dict() shares memory with its parameters, and JAX
        # on the CPU may alias a NumPy buffer, so a later in-place torch update (an
        # optimizer step) would otherwise change the flax model behind its back.
        # Placed with the variable's sharding: kept by a sharded model, named by an abstract
        # one from flax_ln.sharding.abstract_model(make, mesh); None is the default device.
        value = jax.device_put(np.array(new, dtype=old.dtype, copy=True), getattr(old, "sharding", None))
        var.set_value(value)
    return model


def torch_leaves(model: nnx.Module) -> dict[str, tuple[nnx.Variable, int | None, bool]]:
    """``{torch key: (variable, layer, transpose)}`` for every key ``model`` stores (derived buffers left out).

    ``layer`` indexes the variable's stacked leading axis (``None`` if not stacked);
    ``transpose``: the torch array is the variable's (slice's) last two axes swapped.
    Reads only shapes, so it works on an abstract model (``nnx.eval_shape``).
    """
    return {e.key: (getattr(e.module, e.rule.flax), e.layer, e.rule.transpose)
            for e in _entries(model) if isinstance(e.rule, Leaf)}


def to_torch_state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's weights as a dict of NumPy arrays with torch names and layouts.

    Includes the persistent buffers torch saves, so the result loads with
    ``strict=True`` into the matching ``torch_ref`` module (wrap values with
    ``torch.from_numpy``). Stacked layers come out as per-layer keys.
    """
    host_values: dict[int, np.ndarray] = {}
    return {entry.key: _torch_layout(entry, host_values) for entry in _entries(model)}
