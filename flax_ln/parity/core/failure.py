"""An exception raised inside a comparison, said where it came from: :func:`note_failure` marks it with the stage
(kept on the exception as a PEP 678 note, shown under its traceback), :func:`describe_failure` puts it in one line
for a report (``report.float64_check.error``). Imports neither torch nor JAX."""

from __future__ import annotations

# JAX's note on a traceback it filtered: about the traceback a report does not show, so left out of its line
_INTERNAL_FRAMES = "removed its internal frames"
MESSAGE_CHARS = 600  # a report's line holds the start of a long message (a jaxpr, a shape dump)


def note_failure(err: BaseException, where: str) -> None:
    """Add ``where`` (the stage the comparison was in) to ``err``'s notes, once."""
    notes = getattr(err, "__notes__", None)
    if notes is None or where not in notes:
        if hasattr(err, "add_note"):
            err.add_note(where)
        else:  # Python 3.10: the same list, which 3.11 and later print under the traceback
            err.__notes__ = [*(notes or []), where]  # PEP 678: what 3.11 and later keep and print


def describe_failure(err: BaseException) -> str:
    """``"TypeError: <message> (<notes>)"``: the exception's type, the start of its message and its notes (but JAX's
    note that it removed its internal frames from the traceback, which a report does not show)."""
    message = " ".join(str(err).split())
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS] + " ..."
    notes = "; ".join(note for note in getattr(err, "__notes__", None) or [] if _INTERNAL_FRAMES not in note)
    return f"{type(err).__name__}: {message}" + (f" ({notes})" if notes else "")
