"""Old public names kept importable for one release, each with a ``DeprecationWarning``."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def module_getattr(module: str, renamed: Mapping[str, str], namespace: Mapping[str, Any]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` that serves each old name in ``renamed`` as its new name, with a warning.

    Args:
      module: the module's ``__name__``, for the messages.
      renamed: old name -> new name (see CHANGELOG.md): a name in ``namespace``, or the dotted
        path of a name that moved to another module (``"flax_ln.models.remat.remat_in_backward"``),
        imported on first use, so that module may import this one.
      namespace: the module's ``globals()``, where the new names without a module live.
    """

    def __getattr__(name: str) -> Any:
        if name in renamed:
            new = renamed[name]
            where, _, attribute = new.rpartition(".")
            warnings.warn(
                f"{module}.{name} is deprecated and will be removed in the next release: "
                f"use {new if where else module + '.' + new}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(where), attribute) if where else namespace[new]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
