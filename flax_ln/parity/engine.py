"""Cross-framework parity: run a torch module and its NNX twin on the same weights and compare.

:func:`compare_modules` copies the torch weights through the strict converter
(:func:`flax_ln.convert.load_torch_state_dict`), runs both modules in eval mode, and
compares every output and the gradient of a scalar loss with respect to every floating
input and every parameter (keyed by torch name), each against the one tolerance policy
:data:`TOLERANCES`. When anything is out of tolerance it replays the forward pass with
every submodule's inputs and outputs recorded on both sides (:mod:`.capture`) and names
the first submodule, in execution order, whose output diverges. :func:`assert_parity`
is the same for pytest. The book's cases and ``flax-ln parity`` run on the same function.

The torch side of a run is a :class:`TorchSide` (every array the comparison needs), made
live by :func:`run_torch_side` or read from a reference file; :func:`compare_side` puts
the flax side against it. Options: forward mode (``mode="jvp"``: ``torch.func.jvp``
against ``jax.jvp``), attribution against float64 truth (``attribute=True``), LM
metrics (``lm_logits``) and, on failure, isolated localisation (:func:`isolate`).

torch is imported lazily: importing this module does not import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln.convert import load_torch_state_dict, rules, to_torch_state_dict
from flax_ln.parity.capture import (
    WHOLE_MODEL,
    Calls,
    Records,
    Unsupported,
    capture_flax,
    capture_torch,
    floating_leaves,
)
from flax_ln.parity.report import FirstDivergence, Isolation, ParityReport, TensorResult

# ---------------------------------------------------------------------------------------
# metrics and the tolerance policy


def relative_error(actual, expected) -> float:
    """Relative Frobenius error ``||actual - expected|| / ||expected||`` in float64.

    NaN or Inf anywhere in either array gives ``inf`` unless both arrays have them at
    the same positions with the same values (NaN matching NaN), in which case the error
    of the finite entries is returned. ``expected == 0`` falls back to the absolute norm.
    """
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: actual {a.shape} vs expected {b.shape}")
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    if not np.array_equal(finite_a, finite_b):
        return float("inf")
    nonfinite = ~finite_a
    if nonfinite.any() and not np.array_equal(a[nonfinite], b[nonfinite], equal_nan=True):
        return float("inf")
    diff = np.linalg.norm(a[finite_a] - b[finite_b])
    scale = np.linalg.norm(b[finite_b])
    return float(diff / scale) if scale > 0 else float(diff)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """When a tensor passes: any one of

    * its relative Frobenius error is at most ``rtol``;
    * its largest absolute error is at most ``atol`` (0 in the policy: off unless asked for);
    * for gradients, its error norm is at most ``gtol`` times the norm of the whole
      gradient (every parameter together). A parameter whose exact gradient is zero,
      such as the encoder-decoder's key-projection bias (adding a constant to a row of
      scores does not change its softmax), holds only rounding noise on both sides;
      measured against the whole gradient that noise is at the dtype's rounding level.
    """

    rtol: float
    atol: float = 0.0
    gtol: float = 0.0


# The one policy, for the CLI and every test: per dtype and kind, the tightest bound any
# test or the CLI used before the tables were merged (DESIGN.md §5).
# float64: both frameworks evaluate the same math; only op-order rounding (~1e-16 per op,
#   amplified by depth and two passes) remains. Measured worst: 3e-16 outputs, 4e-15 grads.
# float32: XLA and torch reduce in different orders; ~1e-7 per op, measured worst ~2e-6.
# gtol sits a few orders above each dtype's unit roundoff (1.1e-16, 6e-8).
# bfloat16 (flax computes in bfloat16 with float32 parameters; torch in float32 is the
#   reference): 8 significant bits, u = 2^-8 ~ 3.9e-3 per rounding; norm statistics,
#   softmax and losses stay float32. GPT (test_gpt), measured: logits 6.3e-3 (1.6 u), all
#   gradients as one vector ("grads") 8e-3, single tensors up to 1.3e-2; bounds ~3x that.
#   gtol: the encoder-decoder's zero-gradient bound (test_mixed_precision, which keeps
#   its own looser bound for single tensors, stated there).
# float16: 11 significant bits; the bfloat16 bounds scaled by the ratio of unit roundoffs
#   (1/8). GPT, measured: logits 8.1e-4, "grads" 1.1e-3, single tensors up to 1.8e-3.
TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "float64": {"output": Tolerance(1e-12), "grad": Tolerance(1e-10, gtol=1e-13)},
    "float32": {"output": Tolerance(1e-5), "grad": Tolerance(1e-4, gtol=1e-5)},
    "bfloat16": {"output": Tolerance(2e-2), "grad": Tolerance(4e-2, gtol=1e-3), "grads": Tolerance(3e-2)},
    "float16": {"output": Tolerance(2.5e-3), "grad": Tolerance(5e-3, gtol=1.25e-4), "grads": Tolerance(3.75e-3)},
}
HALF_PRECISION = ("bfloat16", "float16")  # compared against a float32 torch reference


def compare_tensors(
    name: str,
    kind: str,
    actual,
    expected,
    tolerance: Tolerance,
    *,
    gradient_norm: float = 0.0,
    dtype: str | None = None,
) -> TensorResult:
    """Compare ``actual`` (flax) with ``expected`` (torch). NaN/Inf are flagged and fail.

    Args:
      name, kind: how the tensor is reported.
      actual, expected: arrays of the same shape (a different shape fails).
      tolerance: the criteria of :class:`Tolerance`.
      gradient_norm: the norm of the whole gradient this tensor belongs to, for ``tolerance.gtol``.
      dtype: the dtype ``actual`` must have, if any (a different dtype fails).
    """

    def unusable(problem: str) -> TensorResult:
        return TensorResult(
            name, kind, tuple(np.shape(expected)), math.inf, None, math.inf, tolerance, None, False, problem=problem
        )

    if actual is None:
        return unusable("missing on the flax side")
    if dtype is not None and np.dtype(np.asarray(actual).dtype) != np.dtype(dtype):
        return unusable(f"dtype: flax {np.asarray(actual).dtype}, expected {dtype}")
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        return unusable(f"shape: flax {a.shape}, torch {b.shape}")
    counts = {label: (int(np.isnan(x).sum()), int(np.isinf(x).sum())) for label, x in (("flax", a), ("torch", b))}
    nonfinite = None
    if any(n or i for n, i in counts.values()):
        nonfinite = ", ".join(
            f"{what} in {label}: {c[k]}" for k, what in enumerate(("NaN", "Inf")) for label, c in counts.items()
        )
    finite = np.isfinite(a) & np.isfinite(b)
    diff = np.abs(np.where(finite, a, 0.0) - np.where(finite, b, 0.0))
    if diff.size and finite.any():
        flat = int(np.argmax(diff))
        index = tuple(int(i) for i in np.unravel_index(flat, diff.shape))
        max_abs = float(diff.reshape(-1)[flat])
    else:
        index, max_abs = None, 0.0
    rel = relative_error(a, b)
    criteria = {
        "rtol": rel <= tolerance.rtol,
        "atol": max_abs <= tolerance.atol,
        "gtol": float(np.linalg.norm(diff)) <= tolerance.gtol * gradient_norm,
    }
    passed_by = next((c for c, held in criteria.items() if held), None) if nonfinite is None else None
    return TensorResult(
        name, kind, tuple(b.shape), max_abs, index, rel, tolerance, nonfinite, passed_by is not None, passed_by
    )


def _global_norm(arrays) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(a, np.float64))) for a in arrays)))


def zero_gradient_names(grads: Mapping[str, Any], tolerance: Tolerance) -> set[str]:
    """Names of the gradients that are zero up to rounding: norm at most ``tolerance.gtol``
    times the norm of all of ``grads`` together (the rule by which such tensors pass)."""
    norm = _global_norm(grads.values())
    return {name for name, g in grads.items() if np.linalg.norm(np.asarray(g, np.float64)) <= tolerance.gtol * norm}


@contextlib.contextmanager
def numerics(dtype: str) -> Iterator[None]:
    """The settings parity runs under, for this scope only: matmul precision ``highest``, x64 for float64."""
    x64 = jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()
    with x64, jax.default_matmul_precision("highest"):
        yield


# ---------------------------------------------------------------------------------------
# running one side


def _torch():
    import torch

    return torch


def named_outputs(tree: Any, name: str | None = None) -> list[tuple[str, Any]]:
    """Array leaves of a forward's result with names: ``output`` for one array, ``output[i]``
    for a tuple's items, the keys of a dict (nested: ``key.sub``, ``key[i]``); ``None`` leaves are dropped."""
    if tree is None:
        return []
    if isinstance(tree, Mapping):
        return [leaf for k, v in tree.items() for leaf in named_outputs(v, str(k) if name is None else f"{name}.{k}")]
    if isinstance(tree, (tuple, list)):
        base = "output" if name is None else name
        return [leaf for i, v in enumerate(tree) for leaf in named_outputs(v, f"{base}[{i}]")]
    return [("output" if name is None else name, tree)]


def _call(forward: Callable | None, module, args, kwargs):
    return module(*args, **kwargs) if forward is None else forward(module, *args, **kwargs)


def _is_float(x) -> bool:
    return np.issubdtype(np.asarray(x).dtype, np.floating)


def _cotangents(outputs: list[tuple[str, np.ndarray]], seed: int = 0) -> dict[str, np.ndarray]:
    """Fixed random cotangents for the floating outputs, shared by both sides."""
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in outputs if _is_float(v)}


@contextlib.contextmanager
def _torch_eval_untouched(module) -> Iterator[None]:
    """``module`` in eval mode with fresh gradients for this scope; its modes and ``.grad`` are restored after."""
    modes = [(m, m.training) for m in module.modules()]
    grads = [(p, p.grad) for p in module.parameters()]
    module.eval()
    module.zero_grad(set_to_none=True)
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
        for p, grad in grads:
            p.grad = grad


def _torch_tensors(inputs, kwargs, *, grad: bool = False, double: bool = False):
    """The inputs and kwargs as torch tensors; ``double`` casts floating ones to float64, ``grad`` tracks them."""
    torch = _torch()

    def tensor(x, track):
        x = np.array(x)
        if double and _is_float(x):
            x = x.astype(np.float64)
        return torch.from_numpy(x).requires_grad_(track and _is_float(x))

    return (
        [tensor(x, grad) for x in inputs],
        {k: tensor(v, False) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()},
    )


def _run_torch(module, inputs, input_names, kwargs, forward, loss, cotangents=None, *, double=False):
    """Outputs, cotangents, loss and gradients (inputs by ``grad <name>``, parameters by name) of the torch side.

    ``cotangents`` (default: drawn by :func:`_cotangents`) weight the outputs in the
    differentiated scalar; ``double`` runs in float64 (the module must be float64 then).
    """
    torch = _torch()
    tensors, t_kwargs = _torch_tensors(inputs, kwargs, grad=True, double=double)
    with _torch_eval_untouched(module):
        outputs = _call(forward, module, tensors, t_kwargs)
        named = [(k, v.detach().numpy()) for k, v in named_outputs(outputs)]
        if loss is None:
            if cotangents is None:
                cotangents = _cotangents(named)
            value = sum(
                (v * torch.from_numpy(cotangents[k]).to(v.dtype)).sum()
                for k, v in named_outputs(outputs)
                if k in cotangents
            )
        else:
            cotangents = {}
            value = loss[0](outputs)
        value.backward()
        grads = {f"grad {n}": t.grad.numpy() for n, t in zip(input_names, tensors) if t.requires_grad}
        for name, p in module.named_parameters():  # a parameter the forward does not use has gradient zero
            grads[name] = np.zeros(p.shape, p.detach().numpy().dtype) if p.grad is None else p.grad.numpy()
    return dict(named), cotangents, value.detach().numpy(), grads


def _tangents(
    inputs, input_names, params: Mapping[str, np.ndarray], with_params: bool, seed: int = 1
) -> dict[str, np.ndarray]:
    """Fixed random tangents shared by both sides: ``tangent <input>`` for floating inputs, and
    every parameter by torch name when ``with_params`` (or when no input is floating)."""
    rng = np.random.default_rng(seed)
    tangents = {
        f"tangent {n}": rng.standard_normal(x.shape).astype(x.dtype)
        for n, x in zip(input_names, inputs)
        if _is_float(x)
    }
    if with_params or not tangents:
        tangents.update({k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in params.items()})
    return tangents


def _run_torch_jvp(module, inputs, input_names, kwargs, forward, tangents, *, double=False):
    """Outputs and output tangents (``tangent <output>``) of the torch side by ``torch.func.jvp``.

    The forward runs through ``torch.func.functional_call`` over the parameters named in
    ``tangents`` (the others and the buffers stay as they are), so the parameters are
    primal inputs of the function that is differentiated.
    """
    torch = _torch()
    from torch.func import functional_call, jvp

    tensors, t_kwargs = _torch_tensors(inputs, kwargs, double=double)
    float_positions = [i for i, n in enumerate(input_names) if f"tangent {n}" in tangents]
    params = {n: p.detach() for n, p in module.named_parameters() if n in tangents}

    class Forward(torch.nn.Module):  # functional_call replaces parameters only in a module's own call
        def __init__(self):
            super().__init__()
            self.model = module

        def forward(self, *args):
            return _call(forward, self.model, args, t_kwargs)

    wrapper = Forward()

    def run(param_values, *floats):
        args = list(tensors)
        for i, x in zip(float_positions, floats):
            args[i] = x
        return functional_call(wrapper, {f"model.{n}": v for n, v in param_values.items()}, tuple(args))

    def tangent(key, like):
        return torch.from_numpy(np.array(tangents[key])).to(like.dtype)

    primal_in = (params, *(tensors[i] for i in float_positions))
    tangent_in = (
        {n: tangent(n, p) for n, p in params.items()},
        *(tangent(f"tangent {input_names[i]}", tensors[i]) for i in float_positions),
    )
    with _torch_eval_untouched(module), torch.no_grad():
        outputs, output_tangents = jvp(run, primal_in, tangent_in)
    named = {k: v.detach().numpy() for k, v in named_outputs(outputs)}
    named.update({f"tangent {k}": v.detach().numpy() for k, v in named_outputs(output_tangents) if _is_float(named[k])})
    return named


def _on_mesh(mesh, params, rest, arrays):
    """The flax side placed on a ``(data, fsdp)`` mesh, as training places it (:mod:`flax_ln.sharding`).

    Parameters and the other state (buffers, RNG state) by the FSDP rule
    (:func:`flax_ln.sharding.state_shardings`); every other array (inputs, masks) split
    along its first axis over ``data`` when that axis divides evenly (the batch), else
    replicated (a mask broadcast over the batch, a scalar).

    Returns:
      ``(params, rest, arrays)`` placed, and the ``sharding`` record of the report:
      the mesh's axis sizes and each parameter's ``PartitionSpec`` (flax path -> str).
    """
    from flax_ln.sharding import DATA, batch_sharding, replicated, state_shardings

    params = jax.device_put(params, state_shardings(params, mesh))
    rest = jax.device_put(rest, state_shardings(rest, mesh))

    def place(x):
        split = x is not None and np.ndim(x) > 0 and np.shape(x)[0] % mesh.shape[DATA] == 0
        return None if x is None else jax.device_put(x, batch_sharding(mesh, (DATA,)) if split else replicated(mesh))

    specs = {".".join(map(str, path)): str(var.get_value().sharding.spec) for path, var in nnx.to_flat_state(params)}
    record = {"mesh": dict(mesh.shape), "params": specs}
    return params, rest, jax.tree.map(place, arrays, is_leaf=lambda x: x is None), record


def _flax_split(model, inputs, kwargs):
    """``(graphdef, params, rest)``, the floating input positions and values, the other inputs,
    and the kwargs split into arrays and static values."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    float_positions = [i for i, x in enumerate(inputs) if _is_float(x)]
    array_kwargs = {k: jnp.asarray(v) for k, v in kwargs.items() if isinstance(v, (np.ndarray, jax.Array))}
    static_kwargs = {k: v for k, v in kwargs.items() if k not in array_kwargs}
    float_inputs = [jnp.asarray(inputs[i]) for i in float_positions]
    other_inputs = [None if i in float_positions else jnp.asarray(x) for i, x in enumerate(inputs)]
    return graphdef, params, rest, float_positions, float_inputs, other_inputs, array_kwargs, static_kwargs


def _run_flax(model, inputs, input_names, kwargs, forward, loss, cotangents, param_names, mesh=None):
    """Outputs, loss and gradients (same keys as :func:`_run_torch`) of the flax side, jitted; on ``mesh``
    (see :func:`_on_mesh`) when given. Also returns the sharding record (``None`` without a mesh)."""
    graphdef, params, rest, float_positions, float_inputs, other_inputs, array_kwargs, static_kwargs = _flax_split(
        model, inputs, kwargs
    )

    def objective(params, rest, float_inputs, other_inputs, array_kwargs):
        args = list(other_inputs)
        for i, x in zip(float_positions, float_inputs):
            args[i] = x
        outputs = _call(forward, nnx.merge(graphdef, params, rest), args, {**array_kwargs, **static_kwargs})
        if loss is not None:
            return loss[1](outputs), outputs
        value = sum(
            jnp.sum(v * jnp.asarray(cotangents[k], v.dtype)) for k, v in named_outputs(outputs) if k in cotangents
        )
        return value, outputs

    sharding = None
    if mesh is not None:
        params, rest, (float_inputs, other_inputs, array_kwargs), sharding = _on_mesh(
            mesh, params, rest, (float_inputs, other_inputs, array_kwargs)
        )
    grad_fn = jax.jit(jax.value_and_grad(objective, argnums=(0, 2), has_aux=True))
    (value, outputs), (param_grads, input_grads) = grad_fn(params, rest, float_inputs, other_inputs, array_kwargs)
    grads = {f"grad {input_names[i]}": np.asarray(g) for i, g in zip(float_positions, input_grads)}
    named = to_torch_state_dict(nnx.merge(graphdef, param_grads, rest))
    grads.update({k: v for k, v in named.items() if k in param_names})  # buffers are not trained
    return {k: np.asarray(v) for k, v in named_outputs(outputs)}, np.asarray(value), grads, sharding


def _run_flax_jvp(model, inputs, input_names, kwargs, forward, tangents, state_dict, param_names, mesh=None):
    """Outputs and output tangents (``tangent <output>``, as :func:`_run_torch_jvp`) of the flax side:
    ``jax.jvp``, jitted; on ``mesh`` (see :func:`_on_mesh`) when given, each tangent placed like its
    primal. Also returns the sharding record (``None`` without a mesh).

    The parameter tangents, keyed by torch name, go through the converter like weights
    (into a copy of the model), so they land in the flax layout; parameters without
    one get a zero tangent.
    """
    graphdef, params, rest, float_positions, float_inputs, other_inputs, array_kwargs, static_kwargs = _flax_split(
        model, inputs, kwargs
    )
    holder = nnx.clone(model)
    load_torch_state_dict(
        holder,
        {
            k: tangents[k] if k in tangents else np.zeros_like(v) if k in param_names else v
            for k, v in state_dict.items()
        },
    )
    param_tangents = nnx.split(holder, nnx.Param, ...)[1]
    input_tangents = [
        jnp.asarray(tangents[f"tangent {input_names[i]}"], float_inputs[k].dtype) for k, i in enumerate(float_positions)
    ]

    sharding = None
    if mesh is not None:
        params, rest, (float_inputs, other_inputs, array_kwargs), sharding = _on_mesh(
            mesh, params, rest, (float_inputs, other_inputs, array_kwargs)
        )
        param_tangents, input_tangents = jax.device_put(
            (param_tangents, input_tangents), jax.tree.map(lambda x: x.sharding, (params, float_inputs))
        )

    @jax.jit
    def primal_and_tangent(params, rest, float_inputs, param_tangents, input_tangents, other_inputs, array_kwargs):
        def run(params, float_inputs):
            args = list(other_inputs)
            for i, x in zip(float_positions, float_inputs):
                args[i] = x
            return _call(forward, nnx.merge(graphdef, params, rest), args, {**array_kwargs, **static_kwargs})

        return jax.jvp(run, (params, float_inputs), (param_tangents, input_tangents))

    outputs, output_tangents = primal_and_tangent(
        params, rest, float_inputs, param_tangents, input_tangents, other_inputs, array_kwargs
    )
    named = {k: np.asarray(v) for k, v in named_outputs(outputs)}
    named.update({f"tangent {k}": np.asarray(v) for k, v in named_outputs(output_tangents) if _is_float(named[k])})
    return named, sharding


def _resolve_dtype(torch_module, dtype: str | None) -> str:
    found = sorted({str(p.dtype).removeprefix("torch.") for p in torch_module.parameters() if p.is_floating_point()})
    if dtype is None:
        if len(found) > 1:
            raise ValueError(f"compare_modules: the torch module mixes parameter dtypes {found}; pass dtype=")
        dtype = found[0] if found else "float32"
    if dtype not in TOLERANCES:
        raise ValueError(f"compare_modules: dtype must be one of {list(TOLERANCES)}, got {dtype!r}")
    want = "float32" if dtype in HALF_PRECISION else dtype
    if found and found != [want]:
        raise ValueError(
            f"compare_modules(dtype={dtype!r}) needs torch parameters in {want}, found {found}: "
            f"call torch_module.to(torch.{want})"
            + (" (half precision compares against a float32 torch reference)" if dtype in HALF_PRECISION else "")
        )
    return dtype


def _check_flax_params(model: nnx.Module, dtype: str) -> None:
    want = np.dtype("float32" if dtype in HALF_PRECISION else dtype)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and jnp.issubdtype(node.dtype, jnp.floating) and np.dtype(node.dtype) != want:
            hint = " under jax.enable_x64(True)" if want == np.float64 else ""
            raise ValueError(
                f"compare_modules(dtype={dtype!r}): flax parameter {'.'.join(map(str, path))!r} is {node.dtype}, "
                f"expected {want}: build the flax module with param_dtype=jnp.{want}{hint}"
            )


def _axis_order(torch_input: np.ndarray, flax_input: np.ndarray, index: int) -> tuple[int, ...]:
    """The permutation ``p`` with ``flax_input == torch_input.transpose(p)``; identity when shapes agree."""
    if torch_input.shape == flax_input.shape and np.array_equal(torch_input, flax_input, equal_nan=True):
        return tuple(range(torch_input.ndim))
    for perm in itertools.permutations(range(torch_input.ndim)):
        moved = np.transpose(torch_input, perm)
        if moved.shape == flax_input.shape and np.array_equal(moved, flax_input, equal_nan=True):
            return perm
    raise ValueError(
        f"flax_inputs[{index}] (shape {flax_input.shape}) must hold the values of inputs[{index}] (shape "
        f"{torch_input.shape}) in some axis order, e.g. np.moveaxis(inputs[{index}], 1, -1) for NCL -> NLC"
    )


def _as_tuple(inputs) -> tuple[np.ndarray, ...]:
    items = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    return tuple(np.asarray(x) for x in items)


# ---------------------------------------------------------------------------------------
# the torch side, live or from a reference file


@dataclasses.dataclass
class TorchSide:
    """Everything a comparison takes from torch, from a live run (:func:`run_torch_side`) or a
    reference file (:mod:`flax_ln.parity.reference`). Arrays are NumPy; parameters go by torch name.

    ``expected`` holds, by report name, what flax must reproduce (outputs, then ``loss``,
    gradients, or output tangents) and ``kinds`` their kinds; ``truth`` the same from a
    float64 run (``attribute``); ``records``/``calls`` every submodule's first call (for
    the first divergence and isolated mode), captured on demand.
    """

    name: str
    dtype: str
    mode: str  # "grad": outputs and reverse-mode gradients; "jvp": outputs and forward-mode tangents
    inputs: list[np.ndarray]
    input_names: list[str]
    kwargs: dict[str, Any]
    state_dict: dict[str, np.ndarray]
    param_names: list[str]
    expected: dict[str, np.ndarray]
    kinds: dict[str, str]
    cotangents: dict[str, np.ndarray]
    tangents: dict[str, np.ndarray]
    truth: dict[str, np.ndarray] | None = None
    records: Records | None = None
    calls: Calls | None = None


MODES = ("grad", "jvp")


def _torch_results(module, inputs, input_names, kwargs, forward, loss, mode, cotangents, tangents, *, double=False):
    """``(expected, kinds, cotangents)`` of one torch run (see :class:`TorchSide`)."""
    param_names = [n for n, _ in module.named_parameters()]
    if mode == "jvp":
        expected = _run_torch_jvp(module, inputs, input_names, kwargs, forward, tangents, double=double)
        return expected, {k: "tangent" if k.startswith("tangent ") else "output" for k in expected}, {}
    outputs, cotangents, value, grads = _run_torch(
        module, inputs, input_names, kwargs, forward, loss, cotangents, double=double
    )
    expected, kinds = dict(outputs), dict.fromkeys(outputs, "output")
    if loss is not None:
        expected["loss"], kinds["loss"] = value, "loss"
    for k, g in grads.items():
        expected[k], kinds[k] = g, "param grad" if k in param_names else "input grad"
    return expected, kinds, cotangents


def run_torch_side(
    torch_module,
    inputs,
    *,
    input_names,
    kwargs,
    forward,
    loss,
    dtype: str,
    mode: str = "grad",
    tangent_params: bool = True,
    attribute: bool = False,
    record: bool = False,
    name: str | None = None,
) -> TorchSide:
    """Run the torch side once (and, with ``attribute``, once more on a float64 copy, the same
    cotangents or tangents in float64). ``record`` captures every submodule's call too."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    state_dict = {k: v.detach().numpy().copy() for k, v in torch_module.state_dict().items()}
    param_names = [n for n, _ in torch_module.named_parameters()]
    tangents = (
        _tangents(inputs, input_names, {k: state_dict[k] for k in param_names}, tangent_params) if mode == "jvp" else {}
    )
    expected, kinds, cotangents = _torch_results(
        torch_module, inputs, input_names, kwargs, forward, loss, mode, None, tangents
    )
    side = TorchSide(
        name or type(torch_module).__name__,
        dtype,
        mode,
        list(inputs),
        list(input_names),
        dict(kwargs),
        state_dict,
        param_names,
        expected,
        kinds,
        cotangents,
        tangents,
    )
    if attribute:
        with _torch_in_float64(torch_module):
            side.truth = _torch_results(
                torch_module, inputs, input_names, kwargs, forward, loss, mode, cotangents, tangents, double=True
            )[0]
    if record:
        record_torch_side(side, torch_module, forward)
    return side


@contextlib.contextmanager
def _torch_in_float64(module) -> Iterator[None]:
    """``module`` in float64 for this scope, then back in its dtype: float32/16 -> float64 -> back is exact.
    (A deep copy is not always possible: torch refuses to copy non-leaf tensors held as attributes.)"""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    grads = [(p, p.grad) for p in module.parameters()]
    for p, _ in grads:
        p.grad = None
    module.double()
    try:
        yield
    finally:
        if dtype is not None:
            module.to(dtype)
        for p, grad in grads:
            p.grad = grad


def record_torch_side(side: TorchSide, torch_module, forward) -> None:
    """Fill ``side.records`` and ``side.calls``: every torch submodule's first call, on the side's inputs."""
    tensors, t_kwargs = _torch_tensors(side.inputs, side.kwargs)
    side.calls = {}
    with _torch_eval_untouched(torch_module):
        side.records = capture_torch(torch_module, lambda: _call(forward, torch_module, tensors, t_kwargs), side.calls)


# ---------------------------------------------------------------------------------------
# localisation: first divergence and isolated mode


def _modules_by_torch_path(flax_module: nnx.Module) -> dict[str, nnx.Module]:
    torch_paths = rules.torch_module_paths(flax_module)  # flax path -> torch path
    found = {
        torch_paths.get(path, path): m
        for path, m in ((".".join(map(str, p)), m) for p, m in nnx.iter_modules(flax_module))
    }
    found[WHOLE_MODEL] = flax_module
    return found


def _compare_activations(
    label: str, module, flax_arrays: list, torch_arrays: list, tolerance: Tolerance
) -> list[TensorResult]:
    """Flax activations (put into torch's layout) against torch's, pairwise; pairs of different shapes are skipped."""
    pairs = [(np.asarray(rules.torch_activation(module, f)), t) for f, t in zip(flax_arrays, torch_arrays)]
    return [
        compare_tensors(f"{label} {i}", f"module {label}", f, t, tolerance)
        for i, (f, t) in enumerate(pairs)
        if f.shape == t.shape
    ]


def localize(
    torch_records: Records, flax_module: nnx.Module, flax_inputs, kwargs, forward, tolerance: Tolerance
) -> tuple[list[TensorResult], FirstDivergence | None]:
    """Every submodule's output error, in torch execution order, and the first that diverges.

    Submodules are paired by torch path: a flax path is mapped through the converter's
    registered renames (:func:`flax_ln.convert.torch_module_paths`). A flax activation
    is put into torch's layout first (the converter's layout rule, e.g.
    channels-last Conv output to channels-first). The first divergence also reports the
    errors of that submodule's inputs, so a broken module can be told from one fed
    broken data. Errors compound down the stack; :func:`isolate` does not let them.
    """
    f_args = [jnp.asarray(x) for x in flax_inputs]
    f_kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    records = capture_flax(flax_module, lambda: _call(forward, flax_module, f_args, f_kwargs))
    torch_paths = rules.torch_module_paths(flax_module)
    flax_records = {torch_paths.get(path, path): record for path, record in records.items()}
    modules = _modules_by_torch_path(flax_module)

    errors, divergence = [], None
    for path, (t_ins, t_outs) in torch_records.items():
        if path not in flax_records:
            continue
        module = modules.get(path, flax_module)
        f_ins, f_outs = flax_records[path]
        outputs = _compare_activations("output", module, f_outs, t_outs, tolerance)
        if not outputs:
            continue
        worst = max(outputs, key=lambda r: r.excess)
        errors.append(dataclasses.replace(worst, name=path))
        if divergence is None and not worst.passed:
            divergence = FirstDivergence(path, _compare_activations("input", module, f_ins, t_ins, tolerance), outputs)
    return errors, divergence


def isolate(torch_records: Records, torch_calls: Calls, flax_module: nnx.Module, tolerance: Tolerance) -> Isolation:
    """Each flax submodule run on its torch twin's recorded inputs, alone: which module's own computation differs.

    For every recorded torch call, the flax module at the same path is called eagerly
    on the same arguments (floating arrays put into the flax layout by
    :func:`flax_ln.convert.rules.flax_activation`; integer and boolean arrays and plain
    values as they are) and its output is compared with torch's recorded output. An
    error here cannot come from upstream, so a deep run names the module that
    differs. A call with an argument that is not data (a callable, a module), or one the
    flax module does not accept, is skipped with the reason. ``culprits`` are the
    failing modules none of whose own submodules fails.
    """
    modules = _modules_by_torch_path(flax_module)

    def to_flax(module, value):
        if isinstance(value, np.ndarray):
            return jnp.asarray(rules.flax_activation(module, value) if _is_float(value) else value)
        if isinstance(value, (tuple, list)):
            return type(value)(to_flax(module, v) for v in value)
        return value

    results, skipped = [], {}
    for path, (args, kwargs) in torch_calls.items():
        module = modules.get(path)
        t_outs = torch_records.get(path, ([], []))[1]
        unsupported = [v for v in [*args, *kwargs.values()] if isinstance(v, Unsupported)]
        if module is None:
            skipped[path] = "no flax twin at this path"
        elif unsupported:
            skipped[path] = f"takes a {unsupported[0]} argument, which a record cannot hold"
        elif t_outs:
            try:
                out = module(*(to_flax(module, a) for a in args), **{k: to_flax(module, v) for k, v in kwargs.items()})
            except Exception as err:  # noqa: BLE001 - any failure to call is reported as the reason it was skipped
                skipped[path] = f"the flax call on torch's arguments raised {type(err).__name__}: {str(err)[:120]}"
                continue
            compared = _compare_activations("output", module, floating_leaves(out), t_outs, tolerance)
            if compared:
                results.append(dataclasses.replace(max(compared, key=lambda r: r.excess), name=path))
            else:
                skipped[path] = "its outputs do not match torch's in number or shape"
    failing = [r.name for r in results if not r.passed]

    def inside(child: str, parent: str) -> bool:
        return parent == WHOLE_MODEL and child != WHOLE_MODEL or child.startswith(parent + ".")

    culprits = [p for p in failing if not any(inside(q, p) for q in failing if q != p)]
    return Isolation(results, skipped, culprits)


# ---------------------------------------------------------------------------------------
# attribution and language-model metrics


def _float64_twin(model: nnx.Module) -> nnx.Module:
    """A copy of ``model`` with every floating parameter and buffer in float64 and every module's
    compute ``dtype`` set to float64 (call under x64)."""
    twin = nnx.clone(model)
    graphdef, state = nnx.split(twin)
    state = jax.tree.map(lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    twin = nnx.merge(graphdef, state)
    for _, module in nnx.iter_modules(twin):
        for attr in ("dtype", "param_dtype"):
            value = getattr(module, attr, None)
            if value is not None and jnp.issubdtype(value, jnp.floating):
                object.__setattr__(module, attr, jnp.float64)
    return twin


def _float64(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) if _is_float(v) else v for k, v in arrays.items()}


def lm_metrics(flax_logits, torch_logits, output: str, top_k: int = 5) -> dict[str, Any]:
    """How far apart the two sides' next-token distributions are, position by position (vocabulary last).

    ``p = softmax(torch)``, ``q = softmax(flax)`` in float64 (log-probabilities work as
    logits too); per position ``KL(p || q) = sum_v p_v (log p_v - log q_v)``. Top-1
    agreement is the fraction of positions whose argmax tokens agree, top-k the fraction
    whose sets of ``k`` most likely tokens agree. The worst position is the one with the
    largest KL, as an index into the leading axes.
    """

    def log_softmax(x):
        x = np.asarray(x, np.float64)
        shifted = x - x.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

    log_p, log_q = log_softmax(torch_logits), log_softmax(flax_logits)
    kl = np.maximum(np.sum(np.exp(log_p) * (log_p - log_q), -1), 0.0)  # (...,) one per position; >= 0 up to rounding
    k = min(top_k, log_p.shape[-1])

    def top(x):
        return np.sort(np.argsort(-x, axis=-1, kind="stable")[..., :k], -1)

    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(kl)), kl.shape))
    return {
        "output": output,
        "positions": int(kl.size),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "worst_position": list(worst),
        "top1_agreement": float(np.mean(log_p.argmax(-1) == log_q.argmax(-1))),
        f"top{k}_agreement": float(np.mean(np.all(top(log_p) == top(log_q), -1))),
        "kl_per_position": kl.reshape(-1).tolist(),
    }


# ---------------------------------------------------------------------------------------
# the comparison


def _flax_results(
    side: TorchSide, flax_eval: nnx.Module, flax_inputs, orders, forward, loss, mesh=None
) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """The flax side's values under the keys of ``side.expected`` (input gradients back in torch's axis order),
    and the sharding record when it ran on ``mesh``."""
    names, kwargs = side.input_names, side.kwargs
    if side.mode == "jvp":
        tangents = dict(side.tangents)
        for i, order in enumerate(orders):  # input tangents into the flax layout
            key = f"tangent {names[i]}"
            if key in tangents:
                tangents[key] = np.transpose(tangents[key], order)
        return _run_flax_jvp(
            flax_eval, flax_inputs, names, kwargs, forward, tangents, side.state_dict, set(side.param_names), mesh
        )
    outputs, value, grads, sharding = _run_flax(
        flax_eval, flax_inputs, names, kwargs, forward, loss, side.cotangents, set(side.param_names), mesh
    )
    for i, order in enumerate(orders):
        key = f"grad {names[i]}"
        if key in grads:
            grads[key] = np.transpose(grads[key], np.argsort(order))
    return {**outputs, **({"loss": value} if loss is not None else {}), **grads}, sharding


def compare_side(
    side: TorchSide,
    flax_module: nnx.Module,
    *,
    flax_inputs=None,
    forward: Callable | None = None,
    loss=None,
    tolerances: Mapping[str, Tolerance] | None = None,
    localize_failures: bool = True,
    capture_modules: bool = False,
    lm_logits: str | None = None,
    record: Callable[[], None] | None = None,
    mesh=None,
) -> ParityReport:
    """The flax side against a :class:`TorchSide`: the heart of :func:`compare_modules`, also used on reference files.

    ``record()`` fills ``side.records``/``side.calls`` when localisation needs them and
    they are missing (a live torch module); attribution runs when ``side.truth`` is set.
    ``mesh``: the flax side runs sharded (as in :func:`compare_modules`); localisation,
    isolated mode and the float64 twin of attribution run unsharded, eagerly or on one device.
    """
    start = time.perf_counter()
    dtype = side.dtype
    tolerances = TOLERANCES[dtype] if tolerances is None else tolerances
    inputs = side.inputs
    flax_inputs = inputs if flax_inputs is None else _as_tuple(flax_inputs)
    if len(flax_inputs) != len(inputs):
        raise ValueError(f"flax_inputs has {len(flax_inputs)} arrays, inputs {len(inputs)}: give one per input")
    orders = [_axis_order(t, f, i) for i, (t, f) in enumerate(zip(inputs, flax_inputs))]

    with numerics(dtype):
        _check_flax_params(flax_module, dtype)
        load_torch_state_dict(flax_module, side.state_dict)
        flax_eval = nnx.clone(flax_module)  # eval mode on a copy: the caller's module keeps its mode
        flax_eval.eval()
        actual, sharding = _flax_results(side, flax_eval, flax_inputs, orders, forward, loss, mesh)

        exact = dtype not in HALF_PRECISION  # half precision: flax outputs may be in the compute dtype
        tolerance_of = {
            "output": "output",
            "loss": "output",
            "input grad": "grad",
            "param grad": "grad",
            "tangent": "grad",
        }  # a tangent is a derivative: the gradients' rounding budget
        norm = _global_norm(side.expected[k] for k in side.param_names if side.kinds.get(k) == "param grad")
        results = []
        for k, v in side.expected.items():
            kind = side.kinds[k]
            # gradients come back in the parameter dtype; outputs and tangents in the compute dtype, which is
            # torch's except in half precision; a loss is a scalar of either
            values_in_compute_dtype = kind in ("output", "tangent")
            check_dtype = (
                str(v.dtype) if _is_float(v) and kind != "loss" and (exact or not values_in_compute_dtype) else None
            )
            results.append(
                compare_tensors(
                    k,
                    kind,
                    actual.get(k),
                    v,
                    tolerances[tolerance_of[kind]],
                    dtype=check_dtype,
                    gradient_norm=norm if kind == "param grad" else 0.0,
                )
            )
        param_grads = [k for k in side.param_names if side.kinds.get(k) == "param grad"]
        if "grads" in tolerances and param_grads and all(k in actual for k in param_grads):
            whole = [np.concatenate([np.ravel(g[k]) for k in param_grads]) for g in (actual, side.expected)]
            results.append(compare_tensors("all parameter gradients", "grads", *whole, tolerances["grads"]))
        report = ParityReport(side.name, dtype, results, mode=side.mode, sharding=sharding)
        if lm_logits is not None:
            if lm_logits not in side.expected or actual.get(lm_logits) is None:
                raise ValueError(
                    f"lm_logits={lm_logits!r} names no output; outputs: "
                    f"{[k for k, kind in side.kinds.items() if kind == 'output']}"
                )
            report.lm_metrics = lm_metrics(actual[lm_logits], side.expected[lm_logits], lm_logits)

        if side.truth is not None:
            _attribute(report, side, actual, flax_eval, flax_inputs, orders, forward, loss)

        if capture_modules or (localize_failures and not report.passed):
            if side.records is None and record is not None:
                record()
            if side.records is not None:
                report.module_errors, report.first_divergence = localize(
                    side.records, flax_eval, flax_inputs, side.kwargs, forward, tolerances["output"]
                )
            if side.calls is not None:
                report.isolation = isolate(side.records, side.calls, flax_eval, tolerances["output"])
    report.seconds = time.perf_counter() - start
    return report


def _attribute(
    report: ParityReport,
    side: TorchSide,
    actual: Mapping[str, np.ndarray],
    flax_eval: nnx.Module,
    flax_inputs,
    orders,
    forward,
    loss,
) -> None:
    """Each tensor's error against float64 truth (torch's float64 run), on both sides; and how far the
    flax float64 twin is from that truth (float64 rounding if the two compute the same math)."""
    with jax.enable_x64(True):
        twin = _float64_twin(flax_eval)
        twin_side = dataclasses.replace(
            side,
            cotangents=_float64(side.cotangents),
            tangents=_float64(side.tangents),
            state_dict=_float64(side.state_dict),
        )
        twin_values, _ = _flax_results(
            twin_side, twin, [x.astype(np.float64) if _is_float(x) else x for x in flax_inputs], orders, forward, loss
        )
    twin_errors = {k: relative_error(twin_values[k], t) for k, t in side.truth.items() if k in twin_values}
    worst = max(twin_errors, key=twin_errors.get, default=None)
    report.attribution = {
        "truth": "torch float64",
        "flax_float64_worst": worst,
        "flax_float64_rel": twin_errors.get(worst, 0.0),
    }
    for i, r in enumerate(report.results):
        truth = side.truth.get(r.name)
        if truth is None or r.problem:
            continue
        report.results[i] = dataclasses.replace(
            r,
            torch_vs_float64=relative_error(side.expected[r.name], truth),
            flax_vs_float64=relative_error(actual[r.name], truth),
        )


def _compare(
    torch_module,
    flax_module: nnx.Module,
    inputs,
    *,
    flax_inputs=None,
    kwargs=None,
    loss=None,
    tolerances: Mapping[str, Tolerance] | None = None,
    dtype: str | None = None,
    forward: Callable | None = None,
    input_names: Sequence[str] | None = None,
    name: str | None = None,
    localize_failures: bool = True,
    capture_modules: bool = False,
    mode: str = "grad",
    tangent_params: bool = True,
    attribute: bool = False,
    lm_logits: str | None = None,
    mesh=None,
) -> ParityReport:
    """:func:`compare_modules`, plus what the book's cases need: one ``forward(module, *inputs, **kwargs)``
    used on both sides (default: calling the module), names for the inputs and the report."""
    start = time.perf_counter()
    dtype = _resolve_dtype(torch_module, dtype)
    inputs = _as_tuple(inputs)
    input_names = [f"input {i}" for i in range(len(inputs))] if input_names is None else list(input_names)
    if loss is not None and (not isinstance(loss, (tuple, list)) or len(loss) != 2):
        raise ValueError("loss must be a pair (torch_fn, flax_fn), each mapping that side's outputs to a scalar")
    if loss is not None and mode == "jvp":
        raise ValueError("loss is for mode='grad'; mode='jvp' compares every output and its tangent")
    with numerics(dtype):
        side = run_torch_side(
            torch_module,
            inputs,
            input_names=input_names,
            kwargs=dict(kwargs or {}),
            forward=forward,
            loss=loss,
            dtype=dtype,
            mode=mode,
            tangent_params=tangent_params,
            attribute=attribute,
            name=name,
        )
    report = compare_side(
        side,
        flax_module,
        flax_inputs=flax_inputs,
        forward=forward,
        loss=loss,
        tolerances=tolerances,
        localize_failures=localize_failures,
        capture_modules=capture_modules,
        lm_logits=lm_logits,
        record=lambda: record_torch_side(side, torch_module, forward),
        mesh=mesh,
    )
    report.seconds = time.perf_counter() - start
    return report


def compare_modules(
    torch_module,
    flax_module: nnx.Module,
    inputs,
    *,
    flax_inputs=None,
    kwargs=None,
    loss=None,
    tolerances: Mapping[str, Tolerance] | None = None,
    dtype: str | None = None,
    mode: str = "grad",
    tangent_params: bool = True,
    attribute: bool = False,
    lm_logits: str | None = None,
    mesh=None,
) -> ParityReport:
    """Compare a torch module with its NNX twin: every output, and the gradient of every floating input and parameter.

    The torch module's ``state_dict()`` is copied into ``flax_module`` through the strict
    converter (every key must match; the flax module is updated in place). Both run in
    eval mode (neither module's mode is changed), the torch side eagerly and the flax side
    under ``jax.jit``, with matmul precision ``highest`` and, for float64, x64 on, for this
    call only. The scalar that is differentiated is, by default,
    ``sum_i sum(output_i * c_i)`` over the floating outputs with fixed random cotangents
    ``c_i`` shared by both sides. Parameter gradients are keyed by torch name.

    On failure the first submodule whose output diverges is named
    (``report.first_divergence``), and every submodule is also run alone on its torch
    twin's recorded inputs (``report.isolation``, :func:`isolate`), which names the
    module whose own computation differs even when errors compound down the stack.

    Args:
      torch_module: a ``torch.nn.Module`` whose parameters are in ``dtype``.
      flax_module: its NNX twin, with the same module tree (a path names the same module
        in both) and parameters in ``dtype``.
      inputs: one NumPy array or a tuple of them, passed positionally to both forwards.
        Floating inputs are differentiated.
      flax_inputs: the flax side's inputs when their layout differs (NLC against NCL):
        the same values in another axis order. Default: ``inputs``.
      kwargs: keyword arguments for both forwards (masks and the like); NumPy arrays are
        converted for each side; they are not differentiated.
      loss: ``(torch_fn, flax_fn)``, each mapping that side's outputs to a scalar, instead
        of the random projection. The loss value is compared too.
      tolerances: ``{"output": Tolerance, "grad": Tolerance}`` to override the policy.
      dtype: ``"float32"`` or ``"float64"`` (default: the torch parameters' dtype), or
        ``"bfloat16"``/``"float16"`` for a flax module that computes in half precision
        with float32 parameters, against the float32 torch module.
      mode: ``"grad"`` (reverse mode, above) or ``"jvp"``: forward mode, the outputs and
        their tangents (``tangent <output>``, the ``"grad"`` tolerance) for fixed random
        tangents of the floating inputs and, with ``tangent_params``, of every parameter
        (always when no input is floating): ``torch.func.jvp`` over
        ``torch.func.functional_call`` against ``jax.jvp``.
      tangent_params: in ``"jvp"`` mode, also push tangents of the parameters.
      attribute: also run both models in float64 (a ``.double()`` copy of the torch
        module; a float64 copy of the flax module under x64, same weights) and give every
        tensor torch's and flax's relative error against torch's float64 values
        (``torch_vs_float64``, ``flax_vs_float64``): which side is wrong.
      lm_logits: the name of an output holding next-token logits (or log-probabilities),
        vocabulary last: adds ``report.lm_metrics`` (:func:`lm_metrics`).
      mesh: a ``(data, fsdp)`` mesh from :func:`flax_ln.sharding.make_mesh`: the flax side
        then runs sharded (in either mode), parameters by the training FSDP rule and inputs
        split over ``data`` along their first (batch) axis where it divides;
        ``report.sharding`` records each parameter's ``PartitionSpec``. The torch side is
        unchanged.

    Returns:
      a :class:`ParityReport`: ``.passed``, ``.results`` (``report[name]``), ``.first_divergence``.
    """
    return _compare(
        torch_module,
        flax_module,
        inputs,
        flax_inputs=flax_inputs,
        kwargs=kwargs,
        loss=loss,
        tolerances=tolerances,
        dtype=dtype,
        mode=mode,
        tangent_params=tangent_params,
        attribute=attribute,
        lm_logits=lm_logits,
        mesh=mesh,
    )


def assert_parity(torch_module, flax_module: nnx.Module, inputs, **options) -> ParityReport:
    """:func:`compare_modules` (same arguments, ``mesh`` included) for tests: raises ``AssertionError``
    with the readable report (the worst tensors and the localisation) unless everything is within
    tolerance. Returns the report when it passes."""
    report = compare_modules(torch_module, flax_module, inputs, **options)
    if not report.passed:
        raise AssertionError("parity failed:\n" + str(report))
    return report


# ---------------------------------------------------------------------------------------
# the book's cases and training steps


@dataclasses.dataclass
class TrainSpec:
    """How to train a case for ``--train-steps``: the loss on both sides and the two optimizers.

    ``loss`` is ``(torch_fn, flax_fn)``, each mapping that side's forward outputs to a
    scalar, as in :func:`compare_modules`. ``torch_optimizer(model)`` returns
    ``(optimizer, scheduler_or_None)``; ``clip_norm`` applies
    ``torch.nn.utils.clip_grad_norm_`` before each torch step, and the optax side must
    contain the matching clip (:func:`flax_ln.train.clip_by_global_norm_like_torch`).
    """

    loss: tuple[Callable[[Any], Any], Callable[[Any], jax.Array]]
    torch_optimizer: Callable[[Any], tuple[Any, Any]]
    optax_optimizer: Any
    clip_norm: float | None = None


@dataclasses.dataclass
class Case:
    """A torch module, its flax twin and the inputs to run them on, for :func:`check_case`.

    ``forward(module, *inputs, **kwargs)`` runs either module (default: calling it);
    the module trees mirror each other, so one function serves both frameworks.
    """

    name: str
    torch_model: Any
    flax_model: nnx.Module
    inputs: Sequence[np.ndarray]
    input_names: Sequence[str]
    dtype: str = "float32"
    forward: Callable | None = None
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    train: TrainSpec | None = None
    lm_logits: str | None = None  # the output holding next-token logits, for the LM metrics
    spec: Mapping[str, Any] | None = None  # how to rebuild the flax side without torch (flax_ln.parity.reference)
    stored_dtype: str | None = None  # a checkpoint's dtype(s) on disk, named in the report


def check_case(
    case: Case,
    tolerances: Mapping[str, Tolerance] | None = None,
    *,
    localize_failures: bool = True,
    capture_modules: bool = False,
    mode: str = "grad",
    attribute: bool = False,
    mesh=None,
) -> ParityReport:
    """:func:`compare_modules` on a case (its LM metrics on ``case.lm_logits``). ``capture_modules`` records
    every submodule's error even when all pass; ``mode``, ``attribute`` and ``mesh`` as in
    :func:`compare_modules`."""
    report = _compare(
        case.torch_model,
        case.flax_model,
        case.inputs,
        kwargs=case.kwargs,
        tolerances=tolerances,
        dtype=case.dtype,
        forward=case.forward,
        input_names=case.input_names,
        name=case.name,
        localize_failures=localize_failures,
        capture_modules=capture_modules,
        mode=mode,
        attribute=attribute,
        lm_logits=case.lm_logits,
        mesh=mesh,
    )
    report.stored_dtype = case.stored_dtype
    return report


def torch_side_of_case(case: Case, *, mode: str = "grad", attribute: bool = False, record: bool = False) -> TorchSide:
    """The torch side of a case (for a reference file: ``record=True``), compared later by :func:`compare_side`."""
    dtype = _resolve_dtype(case.torch_model, case.dtype)
    with numerics(dtype):
        return run_torch_side(
            case.torch_model,
            _as_tuple(case.inputs),
            input_names=case.input_names,
            kwargs=dict(case.kwargs),
            forward=case.forward,
            loss=None,
            dtype=dtype,
            mode=mode,
            attribute=attribute,
            record=record,
            name=case.name,
        )


def check_training(case: Case, steps: int, tolerances: Mapping[str, Tolerance]) -> list[dict[str, Any]]:
    """Run ``steps`` optimizer steps on both sides from the same weights, dropout off.

    After every step, the loss and every parameter (torch names) are compared; each
    record holds the step's loss on both sides, their relative error and the worst
    parameter's relative error: the drift per step.

    Parameters whose torch gradient stays within ``gtol`` of the whole gradient's norm
    (exactly zero but for rounding) are listed as ``noise_only`` and not compared: Adam
    divides by the gradient's magnitude, so it moves them by about the learning rate in
    directions set by rounding noise, differently in each framework. They cannot
    affect the loss, which is compared.
    """
    if case.train is None:
        raise ValueError(f"model {case.name!r} has no training setup for --train-steps")
    import optax

    torch = _torch()
    spec = case.train
    torch_loss, flax_loss = spec.loss
    with numerics(case.dtype):
        load_torch_state_dict(case.flax_model, case.torch_model.state_dict())
        torch_model = case.torch_model.train(False)
        optimizer, scheduler = spec.torch_optimizer(torch_model)
        t_inputs = [torch.from_numpy(np.array(x)) for x in case.inputs]
        t_kwargs = {
            k: torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v for k, v in case.kwargs.items()
        }

        flax_model = case.flax_model
        flax_model.eval()
        graphdef, params, rest = nnx.split(flax_model, nnx.Param, ...)
        opt_state = spec.optax_optimizer.init(params)
        f_inputs = [jnp.asarray(x) for x in case.inputs]
        f_kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in case.kwargs.items()}

        @jax.jit
        def flax_step(params, opt_state, inputs):
            def loss_fn(p):
                return flax_loss(_call(case.forward, nnx.merge(graphdef, p, rest), inputs, f_kwargs))

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = spec.optax_optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        records = []
        noise_only: set[str] = set()
        for step in range(1, steps + 1):
            optimizer.zero_grad(set_to_none=True)
            t_loss = torch_loss(_call(case.forward, torch_model, t_inputs, t_kwargs))
            t_loss.backward()
            grads = {name: p.grad.numpy() for name, p in torch_model.named_parameters() if p.grad is not None}
            noise_only |= zero_gradient_names(grads, tolerances["grad"])
            if spec.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(torch_model.parameters(), spec.clip_norm)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            params, opt_state, f_loss = flax_step(params, opt_state, f_inputs)

            flax_params = to_torch_state_dict(nnx.merge(graphdef, params, rest))
            param_results = [
                compare_tensors(name, "param", flax_params[name], p.detach().numpy(), tolerances["grad"])
                for name, p in torch_model.named_parameters()
                if name not in noise_only
            ]
            worst = max(param_results, key=lambda r: r.excess)
            loss_result = compare_tensors(
                "loss", "loss", np.asarray(f_loss), t_loss.detach().numpy(), tolerances["output"]
            )
            records.append(
                {
                    "step": step,
                    "loss_flax": float(f_loss),
                    "loss_torch": float(t_loss.detach()),
                    "noise_only": sorted(noise_only),
                    "loss_rel_error": loss_result.relative_error,
                    "param_rel_error": worst.relative_error,
                    "worst_param": worst.name,
                    "passed": loss_result.passed and all(r.passed for r in param_results),
                }
            )
    return records
