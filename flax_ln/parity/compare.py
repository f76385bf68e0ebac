"""The comparison: :func:`compare_modules` (the one public entry point), :func:`assert_parity`, and
:func:`compare_side`, the flax side against a :class:`~flax_ln.parity.torch_side.TorchSide` (torch-free: a
reference file's torch side needs no torch)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from flax_ln.convert import KeyMap
from flax_ln.parity.call import Call, as_inputs, merge_dropped
from flax_ln.parity.flax_side import FlaxSide, Function, Linen
from flax_ln.parity.function_side import FunctionSide
from flax_ln.parity.linen_side import LinenSide
from flax_ln.parity.localize import localize
from flax_ln.parity.nnx_side import NNXSide
from flax_ln.parity.policy import (
    HALF_PRECISION,
    TOLERANCES,
    Tolerance,
    compare_tensors,
    lm_metrics,
    numerics,
    relative_error,
    whole_norm,
)
from flax_ln.parity.report import ParityReport
from flax_ln.parity.torch_side import TorchSide, record_torch_side, resolve_dtype, run_torch_side

# The kinds of flax side: a user's flax side is of the first that takes it (NNX takes any other object).
KINDS: tuple[type[FlaxSide], ...] = (LinenSide, FunctionSide, NNXSide)


def flax_side_kind(flax_module: Any) -> type[FlaxSide]:
    """The kind of flax side ``flax_module`` is: the first of :data:`KINDS` that takes it."""
    return next(kind for kind in KINDS if kind.takes(flax_module))


_TOLERANCE_OF = {  # a tangent is a derivative: the gradients' rounding budget
    "output": "output",
    "loss": "output",
    "input grad": "grad",
    "param grad": "grad",
    "tangent": "grad",
}


def _judge(
    side: TorchSide, flax: FlaxSide, call: Call, tolerances: Mapping[str, Tolerance], mesh
) -> tuple[ParityReport, dict[str, np.ndarray]]:
    """Every tensor of ``side.expected`` against the flax side's value: the report, not yet localised,
    and the flax side's values."""
    dtype = side.dtype
    actual, dropped, sharding = flax.values(side, call, mesh)
    exact = dtype not in HALF_PRECISION  # half precision: flax outputs may be in the compute dtype
    norm = whole_norm(side.expected[k] for k in side.param_names if side.kinds.get(k) == "param grad")
    results = []
    for k, v in side.expected.items():
        kind = side.kinds[k]
        # gradients come back in the parameter dtype; outputs and tangents in the compute dtype, which is
        # torch's except in half precision; a loss is a scalar of either
        in_compute_dtype = kind in ("output", "tangent")
        check_dtype = (
            str(v.dtype)
            if np.issubdtype(v.dtype, np.floating) and kind != "loss" and (exact or not in_compute_dtype)
            else None
        )
        results.append(
            compare_tensors(
                k,
                kind,
                actual.get(k),
                v,
                tolerances[_TOLERANCE_OF[kind]],
                dtype=check_dtype,
                gradient_norm=norm if kind == "param grad" else 0.0,
            )
        )
    param_grads = [k for k in side.param_names if side.kinds.get(k) == "param grad"]
    if "grads" in tolerances and param_grads and all(k in actual for k in param_grads):
        flat_flax, flat_torch = (np.concatenate([np.ravel(g[k]) for k in param_grads]) for g in (actual, side.expected))
        results.append(compare_tensors("all parameter gradients", "grads", flat_flax, flat_torch, tolerances["grads"]))
    report = ParityReport(side.name, dtype, results, mode=side.mode, sharding=sharding)
    report.frozen = list(side.frozen)
    report.dropped_outputs = merge_dropped(side.dropped_outputs, dropped)
    return report, actual


def _lm_metrics(report: ParityReport, side: TorchSide, actual: Mapping[str, np.ndarray], lm_logits: str) -> None:
    if lm_logits not in side.expected or actual.get(lm_logits) is None:
        raise ValueError(
            f"lm_logits={lm_logits!r} names no output; outputs: "
            f"{[k for k, kind in side.kinds.items() if kind == 'output']}"
        )
    report.lm_metrics = lm_metrics(actual[lm_logits], side.expected[lm_logits], lm_logits)


def _attribute(report: ParityReport, side: TorchSide, actual: Mapping[str, np.ndarray], flax: FlaxSide, call) -> None:
    """Each tensor's error against float64 truth (torch's float64 run), on both sides; and how far the
    flax float64 twin is from that truth (float64 rounding if the two compute the same math)."""
    assert side.truth is not None
    with jax.enable_x64(True):
        twin_values = flax.float64_values(side, call)
    twin_errors = {k: relative_error(twin_values[k], t) for k, t in side.truth.items() if k in twin_values}
    worst = max(twin_errors, key=lambda k: twin_errors[k], default=None)
    report.attribution = {
        "truth": "torch float64",
        "flax_float64_worst": worst,
        "flax_float64_rel": twin_errors.get(worst, 0.0) if worst is not None else 0.0,
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


def _load_and_judge(
    kind: type[FlaxSide], side: TorchSide, flax_module, call: Call, flax_inputs, tolerances, lm_logits, mesh, weights
):
    """Load the flax side of ``kind`` with ``side``'s weights (through ``weights``, a key map, when given), run
    and compare it, add the ties, LM metrics and attribution."""
    flax = kind.load(flax_module, side, None if flax_inputs is None else as_inputs(flax_inputs), weights)
    report, actual = _judge(side, flax, call, tolerances, mesh)
    report.ties = {} if flax.plan is None else dict(flax.plan.ties)
    if lm_logits is not None:
        _lm_metrics(report, side, actual, lm_logits)
    if side.truth is not None:
        _attribute(report, side, actual, flax, call)
    return report, flax


def _stamp(report: ParityReport, started: float) -> ParityReport:
    """The one place a report is timed (from ``started``, a ``time.perf_counter()``)."""
    report.seconds = time.perf_counter() - started
    return report


def compare_side(
    side: TorchSide,
    flax_module: nnx.Module,
    *,
    flax_inputs=None,
    forward: Any = None,
    loss=None,
    tolerances: Mapping[str, Tolerance] | None = None,
    localize_failures: bool = True,
    capture_modules: bool = False,
    lm_logits: str | None = None,
    mesh=None,
) -> ParityReport:
    """The flax side against a stored :class:`TorchSide` (a reference file's, or one saved from a live run).

    The same comparison as :func:`compare_modules` (``forward``, ``loss``, ``flax_inputs``,
    ``tolerances``, ``lm_logits`` and ``mesh`` as there; only the flax function of a
    ``forward`` pair runs), with no torch: localisation uses the side's stored
    ``records``/``calls`` when it has them; attribution runs when ``side.truth`` is set.
    ``mesh``: localisation, isolated mode and the float64 twin of attribution run
    unsharded.
    """
    started = time.perf_counter()
    kind = flax_side_kind(flax_module)
    if kind.needs_key_map:
        raise TypeError(
            "compare_side (a stored reference file) takes an NNX module; Linen and Function flax sides are "
            "compared live, with compare_modules(..., weights=KeyMap(...))"
        )
    tolerances = TOLERANCES[side.dtype] if tolerances is None else tolerances
    call = side.call(forward, loss)
    with numerics(side.dtype):
        report, flax = _load_and_judge(kind, side, flax_module, call, flax_inputs, tolerances, lm_logits, mesh, None)
        if capture_modules or (localize_failures and not report.passed):
            localize(report, side, flax, call, tolerances["output"])
    return _stamp(report, started)


def compare_modules(
    torch_module,
    flax_module: nnx.Module | Linen | Function,
    inputs,
    *,
    flax_inputs=None,
    kwargs=None,
    forward: Any = None,
    loss=None,
    tolerances: Mapping[str, Tolerance] | None = None,
    dtype: str | None = None,
    mode: str = "grad",
    tangent_params: bool = True,
    attribute: bool = False,
    lm_logits: str | None = None,
    mesh=None,
    input_names: Sequence[str] | None = None,
    name: str | None = None,
    localize_failures: bool = True,
    capture_modules: bool = False,
    weights: KeyMap | None = None,
    modules: Mapping[str, Any] | None = None,
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
        in both) and parameters in ``dtype``; or a :class:`~flax_ln.parity.flax_side.Linen` module
        with its variables, or a :class:`~flax_ln.parity.flax_side.Function` over a parameter
        pytree: both need ``weights``, are filled on copies, and ``forward``'s flax function
        receives ``run`` (``run(*a, **k)`` applies the module or the function to the filled
        variables). A ``Function`` has no modules to localise (``report.localization_note``
        says so) and takes no ``mesh``.
      inputs: one NumPy array or a tuple of them, passed positionally to both forwards.
        Floating inputs are differentiated.
      flax_inputs: the flax side's inputs when their layout differs (NLC against NCL):
        the same values in another axis order. Default: ``inputs``.
      kwargs: keyword arguments for both forwards (masks and the like); NumPy arrays are
        converted for each side; they are not differentiated.
      forward: how each side is run and what it returns: one callable ``fn(module, *inputs,
        **kwargs)`` for both sides, or a pair ``(torch_fn, flax_fn)`` (``None`` in it: a
        plain call). Side-specific arguments (a port's cache, RNGs, ``deterministic=True``)
        go into that side's function. Default: calling each module. Outputs are named
        leaves: ``output``, ``output[i]``, dict keys, dataclass and ``ModelOutput`` fields;
        Python numbers compare as 0-d arrays; other leaves (``None``, strings, cache
        objects) are dropped and listed in ``report.dropped_outputs``. Both sides must give
        the same names with the same shapes, else ``ValueError`` (before the flax side's
        derivatives are taken).
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

      input_names: the inputs' names in the report (``grad <name>``); default ``input <i>``.
      name: the report's name (default: the torch module's class name).
      localize_failures: on failure, localise (first divergence and isolated mode).
      capture_modules: record every submodule's error even when everything passes.
      weights: the port's own :class:`~flax_ln.convert.KeyMap`, for a port whose tree does not
        mirror torch's: the weights load through it (strictly: every problem listed at once, the
        model unchanged on error), parameter gradients come back under ``named_parameters()``'s
        names through each layout's inverse (tied copies summed), ``jvp`` parameter tangents go
        into the flax layout through it, ``report.ties`` lists the ties, and localisation pairs
        modules by their parameters (:func:`~flax_ln.parity.localize.pair_modules`). ``None``:
        the converter's rules and mirrored trees.
      modules: with ``weights``, ``{torch_path: flax_path | (flax_path, layout) | None}``: add a
        pair (a parameter-free module), give a pair's activation layout (an einops pattern,
        torch -> flax), or remove an automatic pair (``None``).

    Frozen torch parameters (``requires_grad=False``) are loaded and compared through the
    outputs, but have no gradient: they are listed in ``report.frozen``. An input with
    an axis of size 0 is a ``ValueError``: nothing compared is not a pass.

    Returns:
      a :class:`ParityReport`: ``.passed``, ``.results`` (``report[name]``), ``.first_divergence``.
    """
    started = time.perf_counter()
    kind = flax_side_kind(flax_module)
    kind.check(flax_module, weights, mesh)
    dtype = resolve_dtype(torch_module, dtype)
    call = Call.make(inputs, input_names=input_names, kwargs=kwargs, forward=forward, loss=loss, mode=mode)
    tolerances = TOLERANCES[dtype] if tolerances is None else tolerances
    with numerics(dtype):
        side = run_torch_side(
            torch_module, call, dtype=dtype, mode=mode, tangent_params=tangent_params, attribute=attribute, name=name
        )
        report, flax = _load_and_judge(kind, side, flax_module, call, flax_inputs, tolerances, lm_logits, mesh, weights)
        if capture_modules or (localize_failures and not report.passed):
            if kind.localization_note is None:  # a kind without modules has none to pair the records with
                record_torch_side(side, torch_module, call.forward[0])
            localize(report, side, flax, call, tolerances["output"], modules)
    return _stamp(report, started)


def assert_parity(torch_module, flax_module: nnx.Module | Linen | Function, inputs, **options) -> ParityReport:
    """:func:`compare_modules` (same arguments, ``mesh`` included) for tests: raises ``AssertionError``
    with the readable report (the worst tensors and the localisation) unless everything is within
    tolerance. Returns the report when it passes."""
    report = compare_modules(torch_module, flax_module, inputs, **options)
    if not report.passed:
        raise AssertionError("parity failed:\n" + str(report))
    return report
