"""Old public names and module paths kept importable for one release, each with a ``DeprecationWarning``."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
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


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An import hook that serves each old module path as the module now at its new path, with a warning.

    ``import old.path`` and ``from old.path import name`` then give the very module object at the new path
    (not a copy: patching one patches the other), after a ``DeprecationWarning`` that names the new home.
    Install it with :func:`alias_modules`.
    """

    def __init__(self, moved: Mapping[str, str]):
        self.moved = dict(moved)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in self.moved else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a placeholder module; exec_module replaces it in sys.modules with the moved one

    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__
        new = self.moved[old]
        warnings.warn(
            f"{old} is deprecated and will be removed in the next release: it moved to {new}",
            DeprecationWarning,
            stacklevel=2,  # the importing line: warnings skips the import system's own frames
        )
        # the import system returns what sys.modules holds under the old name once this returns
        sys.modules[old] = importlib.import_module(new)


def alias_modules(moved: Mapping[str, str]) -> None:
    """Serve each old module path in ``moved`` (old dotted path -> new dotted path) through :class:`MovedModules`.

    Call it from the package that holds the old paths, so that the hook is in place before any of them is
    imported; calling it again with the same paths adds nothing.
    """
    if not any(isinstance(f, MovedModules) and f.moved == dict(moved) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModules(moved))
