"""How a config crosses into the reference as plain data: :func:`config_fields`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


def config_fields(cls: type, config: Any) -> dict[str, Any]:
    """The fields of dataclass ``cls`` that ``config`` holds, read as attributes or, from a mapping, as keys:
    how a config crosses between the frameworks as plain data."""
    names = [f.name for f in dataclasses.fields(cls)]
    if isinstance(config, Mapping):
        return {name: config[name] for name in names if name in config}
    return {name: getattr(config, name) for name in names if hasattr(config, name)}
