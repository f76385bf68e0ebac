"""The tolerance policy and the metrics: how a tensor of flax is judged against torch's.

:func:`relative_error`, :class:`Tolerance`, the one policy :data:`TOLERANCES`,
:func:`compare_tensors` (one :class:`TensorResult`), :func:`zero_gradient_names`, the
:func:`numerics` settings parity runs under, and :func:`lm_metrics`. Imports no torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from flax_ln.parity.core.tensor_stats import PairStats, pair_stats, sum_of_squares
from flax_ln.parity.core.tensor_stats import norm as tensor_norm


def relative_error(actual, expected) -> float:
    """Relative Frobenius error ``||actual - expected|| / ||expected||`` in float64 (complex128 for complex arrays).

    NaN or Inf anywhere in either array gives ``inf`` unless both arrays have them at
    the same positions with the same values (NaN matching NaN), in which case the error
    of the finite entries is returned. ``expected == 0`` falls back to the absolute norm.
    """
    a, b = np.asarray(actual), np.asarray(expected)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: actual {a.shape} vs expected {b.shape}")
    return pair_stats(a, b).relative


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """When a tensor passes: any one of

    * its relative Frobenius error is at most ``rtol``;
    * its largest absolute error is at most ``atol`` (0 in the policy: off unless asked for);
    * for a gradient that float64 shows is zero in the mathematics (see
      :data:`ZERO_IN_FLOAT64`), its error norm is at most ``gtol`` times the norm of the
      whole gradient (every parameter together). Such a parameter, like the
      encoder-decoder's key-projection bias (adding a constant to a row of scores does not
      change its softmax), holds only rounding noise on both sides; measured against the
      whole gradient that noise is at the dtype's rounding level. A gradient that is not
      zero in float64 is held to ``rtol``/``atol`` however small it is.
    """

    rtol: float
    atol: float = 0.0
    gtol: float = 0.0


# The one policy, for the CLI and every test: one bound per dtype and kind.
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
TOLERANCE_KINDS = ("output", "grad", "grads")  # the keys a tolerances dict may hold ("grads": all at once)


def tolerances_for(dtype: str, overrides: Mapping[str, Tolerance] | None = None) -> dict[str, Tolerance]:
    """The policy's tolerances for ``dtype`` (:data:`TOLERANCES`), with ``overrides`` in place of the kinds it
    names: a partial dict (``{"output": ...}`` alone) keeps the policy's bound for every kind it leaves out."""
    unknown = sorted(set(overrides or {}) - set(TOLERANCE_KINDS))
    if unknown:
        raise ValueError(
            f"tolerances= has unknown keys {unknown}; it takes {list(TOLERANCE_KINDS)} (each a Tolerance), and "
            f"the policy's bound for {dtype} fills every key left out"
        )
    return {**TOLERANCES[dtype], **(overrides or {})}


# A float64 gradient whose norm is at most this fraction of the whole float64 gradient's norm is zero in the
# mathematics: float64 rounds each op at 1.1e-16, so a structurally zero gradient holds noise a few orders
# below this (measured: an attention key bias at 8e-18 of the whole, parity_tests/test_verdict.py), while
# small real gradients sit far above it (measured there: a LayerScale block's fc1 at gamma = 1e-6, 2e-6 to
# 1e-5 of the whole). Only gradients below this may pass as "zero".
ZERO_IN_FLOAT64 = 1e-12


def parameter_dtype(dtype: str) -> str:
    """The dtype both sides' parameters must have in a comparison at ``dtype``: float32 for half precision
    (the flax side computes in half precision with float32 parameters, against a float32 torch module),
    else ``dtype`` itself."""
    return "float32" if dtype in HALF_PRECISION else dtype


@dataclasses.dataclass
class TensorResult:
    """The comparison of one tensor: flax (actual) against torch (expected)."""

    name: str
    kind: str  # "output", "input grad", "param grad", "loss", "param", "module output", ...
    shape: tuple[int, ...]
    max_abs_error: float
    max_error_index: tuple[int, ...] | None
    relative_error: float
    tolerance: Tolerance
    nonfinite: str | None  # e.g. "NaN in flax: 3, in torch: 0"
    passed: bool
    passed_by: str | None = None  # which criterion held: "rtol", "atol" or "zero" (zero in float64, by gtol)
    problem: str | None = None  # why the values could not be compared: shape, dtype, missing
    torch_vs_float64: float | None = None  # with attribution: torch's relative error against float64 truth
    flax_vs_float64: float | None = None  # with attribution: flax's relative error against float64 truth

    @property
    def excess(self) -> float:
        """How far past its tolerance the tensor is (> 1 fails), for ranking."""
        if self.problem or self.nonfinite or not math.isfinite(self.relative_error):
            return math.inf
        if self.passed_by == "zero":
            return 0.0  # a zero gradient's rounding noise: within tolerance by the gtol criterion

        def ratio(error: float, tol: float) -> float:
            return error / tol if tol > 0 else (math.inf if error > 0 else 0.0)

        return min(ratio(self.relative_error, self.tolerance.rtol), ratio(self.max_abs_error, self.tolerance.atol))

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tolerance"] = dataclasses.asdict(self.tolerance)
        d["shape"] = list(self.shape)
        d["max_error_index"] = None if self.max_error_index is None else list(self.max_error_index)
        return {k: json_number(v) for k, v in d.items()}


def json_number(v):
    """``v`` as JSON holds it: a non-finite float as the string ``"inf"``/``"-inf"``/``"nan"``, else as it is."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf; "inf"/"nan" stay explicit
    return v


def compare_tensors(
    name: str,
    kind: str,
    actual,
    expected,
    tolerance: Tolerance,
    *,
    gradient_norm: float = 0.0,
    zero_in_float64: bool = False,
    dtype: str | None = None,
    stats: PairStats | None = None,
) -> TensorResult:
    """Compare ``actual`` (flax) with ``expected`` (torch). NaN/Inf are flagged and fail.

    Args:
      name: the tensor's name in the report.
      kind: its kind in the report (``"output"``, ``"input grad"``, ``"param grad"``, ...).
      actual: the flax array.
      expected: the torch array, of the same shape (a different shape fails, and so does an empty one).
      tolerance: the criteria of :class:`Tolerance`.
      gradient_norm: the norm of the whole gradient this tensor belongs to, for ``tolerance.gtol``.
      zero_in_float64: float64 shows this gradient is zero in the mathematics
        (:func:`zero_gradient_names`); only then may it pass by ``tolerance.gtol`` (``passed_by="zero"``).
      dtype: the dtype ``actual`` must have, if any (a different dtype fails).
      stats: ``pair_stats(actual, expected)`` when the caller has it already (it is read once either way).
    """

    def unusable(problem: str) -> TensorResult:
        return TensorResult(
            name, kind, tuple(np.shape(expected)), math.inf, None, math.inf, tolerance, None, False, problem=problem
        )

    if actual is None:
        return unusable("missing on the flax side")
    if dtype is not None and np.dtype(np.asarray(actual).dtype) != np.dtype(dtype):
        return unusable(f"dtype: flax {np.asarray(actual).dtype}, expected {dtype}")
    a, b = np.asarray(actual), np.asarray(expected)  # complex compares as complex: |a - b| over both parts
    if a.shape != b.shape:
        return unusable(f"shape: flax {a.shape}, torch {b.shape}")
    if b.size == 0:
        return unusable(f"no elements to compare (shape {b.shape}): nothing compared is not a pass")
    stats = stats or pair_stats(a, b)  # float64, block by block: no float64 copy of the whole tensor
    nonfinite = None
    if any(stats.nan.values()) or any(stats.inf.values()):
        nonfinite = ", ".join(
            f"{what} in {label}: {counts[label]}"
            for what, counts in (("NaN", stats.nan), ("Inf", stats.inf))
            for label in counts
        )
    max_abs, index, rel = stats.max_abs, stats.index, stats.relative
    criteria = {
        "rtol": rel <= tolerance.rtol,
        "atol": max_abs <= tolerance.atol,
        "zero": passes_as_zero(stats.diff_norm, tolerance, gradient_norm, zero_in_float64),
    }
    passed_by = next((c for c, held in criteria.items() if held), None) if nonfinite is None else None
    return TensorResult(
        name, kind, tuple(b.shape), max_abs, index, rel, tolerance, nonfinite, passed_by is not None, passed_by
    )


def whole_norm(arrays) -> float:
    """The norm of ``arrays`` taken together as one vector (a whole gradient, every parameter), in float64."""
    return math.sqrt(sum(sum_of_squares(a) for a in arrays))


def zero_gradient_names(*float64_grads: Mapping[str, Any]) -> set[str]:
    """Names of the gradients that are zero in the mathematics: in every one of ``float64_grads`` (each a float64
    gradient by name, e.g. torch's and flax's), a norm at most :data:`ZERO_IN_FLOAT64` times the norm of that
    gradient taken whole. Only these may pass as zero (``passed_by="zero"``)."""
    names: set[str] | None = None
    for grads in float64_grads:
        narrow = sorted(n for n, g in grads.items() if np.asarray(g).dtype != np.float64)
        if narrow:
            raise ValueError(
                f"zero_gradient_names needs float64 gradients (zero in the mathematics is a float64 fact); "
                f"{narrow[:3]} are {np.asarray(grads[narrow[0]]).dtype}: take them from a float64 run"
            )
        zero = zero_by_norms({n: tensor_norm(g) for n, g in grads.items()})
        names = zero if names is None else names & zero
    return names or set()


def zero_by_norms(norms: Mapping[str, float]) -> set[str]:
    """The names whose norm (one side's float64 gradient, by name) is at most :data:`ZERO_IN_FLOAT64` times the
    norm of all of them taken together: :func:`zero_gradient_names` from norms alone (a streamed comparison
    never holds the whole gradient)."""
    whole = math.sqrt(sum(n * n for n in norms.values()))
    return {name for name, n in norms.items() if n <= ZERO_IN_FLOAT64 * whole}


def passes_as_zero(diff_norm: float, tolerance: Tolerance, gradient_norm: float, zero_in_float64: bool) -> bool:
    """A gradient float64 shows is zero passes when its error norm is at most ``gtol`` times the whole gradient's."""
    return zero_in_float64 and diff_norm <= tolerance.gtol * gradient_norm


@contextlib.contextmanager
def numerics(dtype: str) -> Iterator[None]:
    """The settings parity runs under, for this scope only: matmul precision ``highest``, x64 for float64."""
    x64 = jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()
    with x64, jax.default_matmul_precision("highest"):
        yield


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
