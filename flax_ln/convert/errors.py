"""The converter's two errors: a state dict that does not fit, and parameters no rule covers."""

from __future__ import annotations


class ConversionError(ValueError):
    """A state dict does not fit the model. Lists every offending key; the model is unchanged.

    Args:
      missing: torch keys the model needs that the state dict lacks.
      unexpected: torch keys the model has no place for.
      mismatched: ``(torch key, why)`` pairs: a wrong shape or dtype, a layout that does not fit, ...
      unfilled: ``(flax variable path, why)`` pairs, from a :class:`~flax_ln.convert.KeyMap`:
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
    """The model holds parameters (or running statistics) that no rule in :data:`~flax_ln.convert.RULES` covers."""
