"""Localisation: the first submodule whose output diverges, and isolated mode. Imports no torch."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln.convert import rules
from flax_ln.parity.call import call as call_forward
from flax_ln.parity.call import is_float
from flax_ln.parity.capture import WHOLE_MODEL, Calls, Records, Unsupported, capture_flax, floating_leaves
from flax_ln.parity.policy import Tolerance, compare_tensors
from flax_ln.parity.report import FirstDivergence, Isolation, TensorResult


def pair_modules(flax_module: nnx.Module) -> dict[str, nnx.Module]:
    """Each flax submodule under the torch path of its twin (the root under :data:`WHOLE_MODEL`).

    The one place where torch paths and flax paths are paired: a flax path is mapped
    through the converter's registered renames (:func:`flax_ln.convert.rules.torch_module_paths`),
    else kept as it is (the module trees mirror each other).
    """
    torch_paths = rules.torch_module_paths(flax_module)  # flax path -> torch path
    found = {
        torch_paths.get(path, path): m
        for path, m in ((".".join(map(str, p)), m) for p, m in nnx.iter_modules(flax_module))
    }
    found[WHOLE_MODEL] = flax_module
    return found


def _within_tolerance(r: TensorResult) -> bool:
    """Whether a module's own error is within its tolerance, NaN or Inf at the same places on both sides
    allowed (an input that holds NaN gives NaN on both sides: that is not the module's own error)."""
    if r.problem is not None or not math.isfinite(r.relative_error):
        return False
    return r.relative_error <= r.tolerance.rtol or r.max_abs_error <= r.tolerance.atol


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

    Submodules are paired by :func:`pair_modules`. A flax activation
    is put into torch's layout first (the converter's layout rule, e.g.
    channels-last Conv output to channels-first). The first divergence also reports the
    errors of that submodule's inputs, so a broken module can be told from one fed
    broken data. Errors compound down the stack; :func:`isolate` does not let them.
    """
    f_args = [jnp.asarray(x) for x in flax_inputs]
    f_kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    records = capture_flax(flax_module, lambda: call_forward(forward, flax_module, f_args, f_kwargs))
    modules = pair_modules(flax_module)
    torch_path_of = {id(m): path for path, m in modules.items()}
    by_flax_path = {".".join(map(str, p)) or WHOLE_MODEL: m for p, m in nnx.iter_modules(flax_module)}
    flax_records = {torch_path_of[id(by_flax_path[path])]: record for path, record in records.items()}

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
    failing modules none of whose own submodules fails; a module whose own error is within
    tolerance (NaN at the same places on both sides allowed) is never one.
    """
    modules = pair_modules(flax_module)

    def to_flax(module, value):
        if isinstance(value, np.ndarray):
            return jnp.asarray(rules.flax_activation(module, value) if is_float(value) else value)
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
    failing = [r.name for r in results if not _within_tolerance(r)]

    def inside(child: str, parent: str) -> bool:
        return parent == WHOLE_MODEL and child != WHOLE_MODEL or child.startswith(parent + ".")

    culprits = [p for p in failing if not any(inside(q, p) for q in failing if q != p)]
    return Isolation(results, skipped, culprits)
