"""Float32 islands: the places where a float64 comparison would compute in float32, as plain data.

Both sides describe what they found in a float64 run with the same record, :class:`Island`; this
module imports neither torch nor JAX, so either side (and the report) can use it.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Island:
    """One float32 island: a kind of cast or float32 computation, found in one module.

    ``side`` is ``"torch"`` or ``"flax"``; ``module`` the module path where it happens (``None``
    outside any module, or when no modules were followed); ``what`` the op or cast in words
    (``"softmax with dtype=float32"``, ``"float32 input to aten.mm"``,
    ``"buffer inv_freq rebuilt in float64"``); ``lifted`` whether the float64 run computes it
    in float64 (``False``: it still holds or computes float32 values, and ``what`` says why).
    An island is one entry per module and kind, however many op calls it covers: ``count`` says how many the
    JAX side met while tracing (a dtype policy's cast in every layer is one entry, counted; not part of equality).
    """

    side: str
    module: str | None
    what: str
    lifted: bool
    count: int = dataclasses.field(default=1, compare=False)


def float32_rounded(values: np.ndarray) -> bool:
    """Whether the float64 ``values`` were rounded to float32 once: every value is float32-representable, and one
    at least is not an integer and needs more significant bits than float16 has.

    Integers, zeros, ones and short binary fractions (0.5, 0.75) are float32-representable by nature, not by
    rounding: only a long fraction that float32 holds exactly shows the rounding (a float64 value computed as such
    is float32-representable with odds of about 2**-29).
    """
    values = np.asarray(values)
    if values.dtype != np.float64 or values.size == 0:
        return False
    if not np.array_equal(values.astype(np.float32).astype(np.float64), values, equal_nan=True):
        return False
    finite = values[np.isfinite(values)]
    mantissa = np.frexp(finite)[0] * 2**11  # float16's 11 significant bits as an integer part
    return bool(((finite != np.round(finite)) & (mantissa != np.round(mantissa))).any())
