"""What a torch module holds besides its parameters and buffers: its plain attributes (a cache a call fills, its
length, a tensor kept on ``self``), and those of the plain objects it holds, kept as they are now
(:func:`plain_attributes`) to be restored after a float64 run (:func:`~flax_ln.parity.islands.torch.torch_in_float64`).
torch is imported when these run, not when this module is."""

from __future__ import annotations

import copy
import functools
import types


def plain_attributes(module) -> list[PlainAttributes]:
    """The plain attributes of every submodule of ``module`` and, recursively, of the plain Python objects they hold
    (a helper object with a cache of its own), each object once."""
    import torch

    found: dict[int, PlainAttributes] = {}
    stack = [(m, 0) for m in module.modules()]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in found:
            continue
        found[id(obj)] = held = PlainAttributes(obj)
        for value in held.held.values():
            plain = not isinstance(value, (torch.Tensor, torch.nn.Module, type, types.FunctionType, types.ModuleType))
            if plain and depth < _ATTRIBUTE_DEPTH and isinstance(getattr(value, "__dict__", None), dict):
                stack.append((value, depth + 1))
    return list(found.values())


_ATTRIBUTE_DEPTH = 4  # how deep plain objects held by a module are followed


class PlainAttributes:
    """An object's plain attributes (a torch module's: all but torch's own bookkeeping; a cache a call fills, its
    length, a tensor kept on ``self``) as they are now, to :meth:`restore` them: each to its own object, lists,
    dicts and sets to their items, and an attribute added since removed. A float64 run that fills a cache in the
    input's dtype (a rotary cos/sin table made on the first call) leaves no float64 table behind."""

    def __init__(self, module):
        self.module = module
        self.held = {k: v for k, v in vars(module).items() if k not in _torch_bookkeeping()}
        self.items = {k: copy.copy(v) for k, v in self.held.items() if type(v) in (list, dict, set)}

    def restore(self) -> None:
        now = vars(self.module)
        for k in [k for k in now if k not in self.held and k not in _torch_bookkeeping()]:
            del now[k]
        now.update(self.held)
        for k, items in self.items.items():
            container = self.held[k]
            container.clear()
            if isinstance(container, list):
                container.extend(items)
            else:
                container.update(items)


@functools.cache
def _torch_bookkeeping() -> frozenset[str]:
    """The attributes every ``torch.nn.Module`` has (parameters, buffers, submodules, hooks, modes): not plain."""
    import torch

    return frozenset(vars(torch.nn.Module()))
