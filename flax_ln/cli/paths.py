"""Checks of the command lines' output paths, made before anything slow runs (``flax-ln parity``, ``flax-ln plan``)."""

from __future__ import annotations

import os


def output_file_problem(option: str, path: str) -> str | None:
    """Why ``path`` (given to ``option``) cannot be written, naming the option: a folder, a missing folder, no
    permission; ``None`` when it can. Checked before the run, so that a bad path fails at once, not after it."""
    if os.path.isdir(path):
        return f"{option} {path!r} is a directory; give a file name inside it"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{option} {path!r}: the folder {folder!r} does not exist; create it first"
    try:
        if os.path.exists(path):
            open(path, "a").close()  # opening to append changes nothing
        else:
            open(path, "x").close()
            os.remove(path)
    except OSError as err:
        return f"{option} {path!r} cannot be written: {err.strerror or err}"
    return None


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file: ``os.path.samefile`` where both exist (symbolic and hard links alike),
    resolved paths otherwise."""
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)
