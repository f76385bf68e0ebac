"""Old public names kept importable for one release, each with a ``DeprecationWarning``."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any


def module_getattr(module: str, renamed: Mapping[str, str], namespace: Mapping[str, Any]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` that serves each old name in ``renamed`` as its new name, with a warning.

    Args:
      module: the module's ``__name__``, for the messages.
      renamed: old name -> new name (see CHANGELOG.md).
      namespace: the module's ``globals()``, where the new names live.
    """

    def __getattr__(name: str) -> Any:
        if name in renamed:
            new = renamed[name]
            warnings.warn(
                f"{module}.{name} is deprecated and will be removed in the next release: use {module}.{new}",
                DeprecationWarning,
                stacklevel=2,
            )
            return namespace[new]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
