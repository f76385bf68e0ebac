"""Float32 islands: the places where a float64 comparison would compute in float32, as plain data.

Both sides describe what they found in a float64 run with the same record, :class:`Island`; this
module imports neither torch nor JAX, so either side (and the report) can use it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Island:
    """One float32 island: a kind of cast or float32 computation, found in one module.

    ``side`` is ``"torch"`` or ``"flax"``; ``module`` the module path where it happens (``None``
    outside any module, or when no modules were followed); ``what`` the op or cast in words
    (``"softmax with dtype=float32"``, ``"float32 input to aten.mm"``,
    ``"buffer inv_freq rebuilt in float64"``); ``lifted`` whether the float64 run computes it
    in float64 (``False``: it still holds or computes float32 values, and ``what`` says why).
    An island is one entry per module and kind, however many op calls it covers.
    """

    side: str
    module: str | None
    what: str
    lifted: bool
