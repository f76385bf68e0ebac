"""The comparison: :func:`compare_modules` (the one public entry point), :func:`assert_parity`, and
:func:`compare_side`, the flax side against a :class:`~flax_ln.parity.torch_side.TorchSide`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from flax_ln.convert import load_torch_state_dict
from flax_ln.parity.call import _as_tuple, _is_float
from flax_ln.parity.flax_side import _axis_order, _check_flax_params, _flax_results, _float64, _float64_twin
from flax_ln.parity.localize import isolate, localize
from flax_ln.parity.policy import (
    HALF_PRECISION,
    TOLERANCES,
    Tolerance,
    _global_norm,
    compare_tensors,
    lm_metrics,
    numerics,
    relative_error,
)
from flax_ln.parity.report import ParityReport
from flax_ln.parity.torch_side import TorchSide, _resolve_dtype, record_torch_side, run_torch_side


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
