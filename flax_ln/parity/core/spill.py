"""Torch's gradients kept in files while a comparison runs, when memory is short.

A whole-model comparison holds four copies of the weights at once: torch's weights and gradients, flax's
weights and gradients. When the three the comparison adds to the torch weights already in memory would not fit
in the memory the system has available, torch's gradients are written to unlinked temporary files and read back
through memory maps: the page cache can drop them and read them again, so the comparison needs about three
copies in memory instead of four (GPT-2XL in float32 on a 24 GiB machine). The files are removed as soon as they
are mapped; their space is freed with the last array that uses them. Imports no torch.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import numpy as np

SMALL = 1 << 20  # arrays under 1 MiB stay in memory: a file each would cost more than it saves
MARGIN = 1 << 30  # activations, XLA's compile and buffers, the comparison's blocks


def available_bytes() -> int | None:
    """The memory the system can still give (``MemAvailable`` of ``/proc/meminfo``); ``None`` where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the line reads "MemAvailable:  123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None


def should_spill(parameter_bytes: int) -> bool:
    """Whether a comparison whose torch parameters take ``parameter_bytes`` (in the comparison's dtype) should keep
    torch's gradients in files: its torch gradients, flax weights and flax gradients (three times that) and a
    margin would not fit in the available memory."""
    available = available_bytes()
    return available is not None and 3 * parameter_bytes + MARGIN > available


def to_file(array: np.ndarray) -> np.ndarray:
    """``array`` copied into a read-only memory map of an unlinked temporary file (``TMPDIR`` chooses the folder);
    ``array`` itself when it is small, or when the file cannot be made (a warning says why: the comparison then
    needs the memory after all)."""
    if array.nbytes < SMALL:
        return array
    fd, path = tempfile.mkstemp(prefix="flax-ln-gradient-")
    try:
        reserve = getattr(os, "posix_fallocate", None)  # not on macOS, which has no MemAvailable: no spill there
        if reserve is not None:
            reserve(fd, 0, array.nbytes)  # reserve the space now: a full disk under a map is a SIGBUS later
        mapped = np.memmap(path, dtype=array.dtype, mode="r+", shape=array.shape)
    except OSError as err:
        warnings.warn(
            f"flax-ln: could not keep a {array.nbytes / 2**20:.0f} MiB gradient in {path} ({err}); it stays in memory",
            RuntimeWarning,
            stacklevel=2,
        )
        return array
    finally:
        os.close(fd)
        os.unlink(path)
    mapped[...] = array
    mapped.flags.writeable = False
    return mapped
