"""A comparison's progress on a terminal: :class:`Progress`, a tqdm bar over its phases.

The bar appears only on a terminal and only for a comparison that runs longer than :data:`DELAY_SECONDS`;
it is off (nothing made, nothing written) with ``quiet=True``, when ``sys.stderr`` is not a terminal (pytest's
capture, CI logs, pipes) or when the environment sets ``FLAX_LN_PROGRESS=0``. The one place library code
writes to the terminal; it imports no torch.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TextIO

from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no py.typed; types-tqdm is not in the dev extra

DELAY_SECONDS = 2.0  # a comparison shorter than this prints nothing
TICK_SECONDS = 1.0  # how often a shown bar redraws during a long phase (its elapsed time keeps counting)
ENVIRONMENT = "FLAX_LN_PROGRESS"  # "0" turns every bar off

_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"  # the postfix is the phase


def _terminal() -> TextIO | None:
    """``sys.stderr`` if it is a terminal, else ``None``."""
    stream = sys.stderr
    isatty = getattr(stream, "isatty", None)
    return stream if stream is not None and isatty is not None and isatty() else None


class Progress:
    """Progress of one comparison on the terminal: a bar over `total` steps with the current phase.

    ``label`` names the bar (the model); :meth:`phase` shows what runs now ("float64 check: torch forward and
    backward") after the bar, :meth:`advance` moves the bar past finished steps. Shown on ``sys.stderr`` after
    :data:`DELAY_SECONDS` (redrawn every :data:`TICK_SECONDS` so that a long phase shows its elapsed time) and
    cleared when closed. Off, every method doing nothing, with ``quiet=True``, when ``sys.stderr`` is not a
    terminal, or with the environment variable ``FLAX_LN_PROGRESS=0``. Use it as a context manager, which
    closes it also on an error.

    Args:
      total: the number of steps (phases) the bar counts.
      label: the bar's name, shown before it.
      quiet: no bar at all.
    """

    def __init__(self, total: int, *, label: str, quiet: bool = False) -> None:
        self._bar: tqdm | None = None
        stream = None if quiet or os.environ.get(ENVIRONMENT) == "0" else _terminal()
        if stream is None:
            return
        self._lock = threading.Lock()  # the ticker and the caller both update the bar
        self._stop = threading.Event()
        self._bar = tqdm(
            total=total,
            desc=label,
            file=stream,
            leave=False,
            delay=DELAY_SECONDS,
            mininterval=0,  # the phases and the ticker decide when it redraws
            miniters=0,  # every update(0) may redraw (a fixed miniters: tqdm does not raise it)
            bar_format=_FORMAT,
        )
        self._ticker = threading.Thread(target=self._tick, name="flax-ln-progress", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        """Redraw every :data:`TICK_SECONDS` until closed; tqdm draws nothing before its delay has passed."""
        while not self._stop.wait(TICK_SECONDS):
            with self._lock:
                if self._bar is not None:
                    self._bar.update(0)

    def phase(self, text: str) -> None:
        """Show ``text`` as what runs now (after the delay; before it, kept for the first redraw)."""
        if self._bar is None:
            return
        with self._lock:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(0)

    def advance(self, steps: int = 1) -> None:
        """Move the bar ``steps`` steps on."""
        if self._bar is None:
            return
        with self._lock:
            self._bar.update(steps)

    def close(self) -> None:
        """Stop redrawing and clear the bar from the terminal; closing again does nothing."""
        if self._bar is None:
            return
        self._stop.set()
        self._ticker.join()
        with self._lock:
            bar, self._bar = self._bar, None
            bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
