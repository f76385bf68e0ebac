"""How a comparison judges the flax side's values against the torch side's: every tensor within its tolerance
(:func:`judge`), a gradient passing as zero only on float64's word; and what is added beside the verdict: LM
metrics (:func:`add_lm_metrics`) and each tensor's error against float64 truth (:func:`attribute_errors`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from flax_ln.convert import KeyPlan
from flax_ln.parity.core.call import merge_dropped
from flax_ln.parity.core.policy import (
    HALF_PRECISION,
    Tolerance,
    compare_tensors,
    lm_metrics,
    relative_error,
    whole_norm,
    zero_by_norms,
    zero_gradient_names,
)
from flax_ln.parity.core.tensor_stats import PairStats, many_pair_stats
from flax_ln.parity.report.data import ParityReport
from flax_ln.parity.sides.flax import FlaxSide
from flax_ln.parity.sides.torch import TorchSide

DROPPED_BUT_USED = (
    "dropped by the key map, but float64 shows its gradient is not zero: the output depends on it, so the port "
    "must hold it"
)
TOLERANCE_OF = {  # a tangent is a derivative: the gradients' rounding budget
    "output": "output",
    "loss": "output",
    "input grad": "grad",
    "param grad": "grad",
    "tangent": "grad",
}


def judge(
    side: TorchSide,
    values: tuple[dict[str, np.ndarray], dict[str, str], Any],
    tolerances: Mapping[str, Tolerance],
    zero_evidence: Callable[[], set[str]],
    want_zero: bool = False,
) -> tuple[ParityReport, dict[str, np.ndarray], set[str]]:
    """Every tensor of ``side.expected`` against the flax side's ``values`` (:meth:`FlaxSide.values`): the report,
    not yet localised, the flax side's values, and the gradients float64 shows are zero in the mathematics (when
    some gradient needed them, or, in float64, ``want_zero``; else the empty set).

    A gradient passes as zero only on float64's word: in a float64 comparison both sides' gradients (islands
    lifted) say so; otherwise ``zero_evidence()`` does. Either is asked only when some gradient needs it, and so
    is the whole gradient's norm: a comparison that passes reads each gradient once."""
    dtype = side.dtype
    actual, dropped, sharding = values
    exact = dtype not in HALF_PRECISION  # half precision: flax outputs may be in the compute dtype
    param_grads = [k for k in side.param_names if side.kinds.get(k) == "param grad"]
    norm = functools.cache(lambda: whole_norm(side.expected[k] for k in param_grads))
    both_in_float64 = dtype == "float64" and all(k in actual for k in param_grads)
    zero: set[str] | None = None
    stats = many_pair_stats(
        {k: (actual[k], v) for k, v in side.expected.items() if k in actual and np.shape(actual[k]) == np.shape(v)}
    )

    def zero_now() -> set[str]:  # float64's word, asked for once
        nonlocal zero
        if zero is None:
            if not both_in_float64:
                zero = zero_evidence()
            elif all(_finite_float64(stats.get(k), actual[k], side.expected[k]) for k in param_grads):
                # each side's gradient norms, read already with the errors: zero_gradient_names without a second pass
                flax_norms = {k: stats[k].actual_norm for k in param_grads}  # type: ignore[union-attr]
                torch_norms = {k: stats[k].expected_norm for k in param_grads}  # type: ignore[union-attr]
                zero = zero_by_norms(torch_norms) & zero_by_norms(flax_norms)
            else:
                zero = zero_gradient_names(
                    {k: side.expected[k] for k in param_grads}, {k: actual[k] for k in param_grads}
                )
        return zero

    results = []
    for k, v in side.expected.items():
        kind = side.kinds[k]
        # gradients come back in the parameter dtype; outputs and tangents in the compute dtype, which is
        # torch's except in half precision; a loss is a scalar of either
        in_compute_dtype = kind in ("output", "tangent")
        check_dtype = (
            str(v.dtype)
            if np.issubdtype(v.dtype, np.inexact) and kind != "loss" and (exact or not in_compute_dtype)
            else None
        )
        judged = functools.partial(
            compare_tensors,
            k,
            kind,
            actual.get(k),
            v,
            tolerances[TOLERANCE_OF[kind]],
            dtype=check_dtype,
            stats=stats.get(k),
        )
        result = judged()
        if kind == "param grad" and not result.passed and judged(gradient_norm=norm(), zero_in_float64=True).passed:
            result = judged(gradient_norm=norm(), zero_in_float64=k in zero_now())
        results.append(result)
    if want_zero and both_in_float64:
        zero_now()
    if "grads" in tolerances and param_grads and all(k in actual for k in param_grads):
        flat_flax, flat_torch = (np.concatenate([np.ravel(g[k]) for k in param_grads]) for g in (actual, side.expected))
        results.append(compare_tensors("all parameter gradients", "grads", flat_flax, flat_torch, tolerances["grads"]))
    report = ParityReport(side.name, dtype, results, mode=side.mode, sharding=sharding)
    report.frozen = list(side.frozen)
    report.dropped_outputs = merge_dropped(side.dropped_outputs, dropped)
    return report, actual, set() if zero is None else zero


def _finite_float64(stats: PairStats | None, actual: np.ndarray, expected: np.ndarray) -> bool:
    """Whether ``stats`` hold both sides' whole norms: every element finite, both float64 (else
    :func:`zero_gradient_names` reads them again, and says what is wrong)."""
    return (
        stats is not None
        and not any(stats.nan.values())
        and not any(stats.inf.values())
        and np.asarray(actual).dtype == np.float64
        and np.asarray(expected).dtype == np.float64
    )


def add_lm_metrics(report: ParityReport, side: TorchSide, actual: Mapping[str, np.ndarray], lm_logits: str) -> None:
    """``report.lm_metrics`` of the output ``lm_logits`` (``ValueError`` when it names no output)."""
    if lm_logits not in side.expected or actual.get(lm_logits) is None:
        raise ValueError(
            f"lm_logits={lm_logits!r} names no output; outputs: "
            f"{[k for k, kind in side.kinds.items() if kind == 'output']}"
        )
    report.lm_metrics = lm_metrics(actual[lm_logits], side.expected[lm_logits], lm_logits)


def attribute_errors(
    report: ParityReport, side: TorchSide, actual: Mapping[str, np.ndarray], flax: FlaxSide, call
) -> None:
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


def without_dropped(
    side: TorchSide, plan: KeyPlan | None, zero_evidence: Callable[[], set[str]]
) -> tuple[TorchSide, dict[str, bool]]:
    """``side`` without the gradients of the trainable torch parameters that the key map drops (an ignore rule
    ``(regex, None, None)``, a split rule's slab ``{slab: None}`` (compared as ``key[slab]``), or ``allow_dropped=``
    of :meth:`~flax_ln.convert.KeyMap.discover`) and that float64
    shows are zero: the output does not depend on them, so nothing of them is compared; and each dropped parameter
    -> whether its gradient is not zero (``True``: it stays, and fails as missing on the flax side: a port that
    leaves out a parameter torch uses does not pass). float64's word: in a float64 run, torch's own gradients;
    else ``zero_evidence()``, asked only when some parameter is dropped."""
    ignored = plan.ignored if plan is not None else ()
    unread = [name for slabs in plan.dropped_slabs.values() for name, _ in slabs] if plan is not None else []
    dropped = [k for k in (*ignored, *unread) if side.kinds.get(k) == "param grad"]  # whole tensors, and slabs
    if not dropped:
        return side, {}
    if side.dtype == "float64":
        zero = zero_gradient_names({k: side.expected[k] for k in side.param_names if side.kinds.get(k) == "param grad"})
    else:
        zero = zero_evidence()
    gone = {k for k in dropped if k in zero}
    side = dataclasses.replace(
        side,
        expected={k: v for k, v in side.expected.items() if k not in gone},
        kinds={k: v for k, v in side.kinds.items() if k not in gone},
        param_names=[k for k in side.param_names if k not in gone],
    )
    return side, {k: k not in gone for k in dropped}
