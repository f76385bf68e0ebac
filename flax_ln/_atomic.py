"""Atomic file writes whose result has the permissions of a plain ``open``: ``0o666`` less the umask."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def current_umask() -> int:
    """The process's umask (read from ``/proc`` where it can be, else set and restored at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: str | os.PathLike, write: Callable[[str], Any]) -> Path:
    """Write ``path`` all or nothing: ``write(tmp)`` fills a temporary file beside it, which then replaces it.

    On any error the temporary file is removed and ``path`` is as it was. The new file's
    mode is ``0o666 & ~umask``, as ``open(path, "w")`` would give, whatever mode the writer
    used for the temporary file (safetensors creates its files 0600).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
