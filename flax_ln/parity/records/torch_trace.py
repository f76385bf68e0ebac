"""What torch's own code does around each recorded module, read from its op trace while the torch side is recorded
(:func:`tracing`: a ``TorchFunctionMode`` and module hooks, for one call): the layouts torch's code puts a module's
output in downstream (``q_proj(x).view(B, T, n, h)``, a parent's ``conv(x).permute(0, 2, 3, 1)``) and the operations
a module applies after its parameterised operation inside its own forward (an activation inside a
``BatchNormAct2d``). Structure only: no value decides anything here. torch is imported lazily.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from flax_ln.parity.records.capture import WHOLE_MODEL

# operations that move, split or merge axes (or copy, cast or drop nothing in eval): no new values
LAYOUT_OPS = frozenset(
    "view reshape permute transpose t flatten unflatten movedim moveaxis swapaxes swapdims contiguous squeeze "
    "unsqueeze".split()
)
PASSING_OPS = LAYOUT_OPS | frozenset(
    "to type_as float double half bfloat16 type clone detach dropout dropout1d dropout2d dropout3d alpha_dropout "
    "feature_alpha_dropout __get__ size dim".split()
)
MAX_LAYOUTS = 6  # layouts kept per module output (a chain of views rarely has more)


@dataclasses.dataclass
class TorchTrace:
    """What torch's own code did around each recorded module (torch path ->).

    ``layouts``: the index maps of torch's downstream layout operations on the module's first floating output, each
    ``np.arange(size).reshape(output shape)`` taken through the same ``view``/``permute``/... chain (one per tensor
    of the chain); ``after``: the operations (names) the module's forward applied after its parameterised operation
    (one that takes the module's own parameters, or its descendants', with an activation), when any did."""

    layouts: dict[str, list[np.ndarray]] = dataclasses.field(default_factory=dict)
    after: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    fed_by: dict[str, str] = dataclasses.field(default_factory=dict)  # its first input: an earlier output, same shape


def _tensors(tree: Any) -> list[Any]:
    import torch

    leaves = torch.utils._pytree.tree_leaves(tree)  # noqa: SLF001 - torch's own pytree, the one its ops take
    return [x for x in leaves if isinstance(x, torch.Tensor)]


class _Marks:
    """Per tensor (by identity, never kept alive): what is known of it."""

    def __init__(self):
        self.table: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, tensor) -> Any:
        found = self.table.get(id(tensor))
        return None if found is None or found[0]() is not tensor else found[1]

    def put(self, tensor, value) -> None:
        try:
            self.table[id(tensor)] = (weakref.ref(tensor), value)
        except TypeError:  # a tensor subclass without weak references: not followed
            pass


@contextlib.contextmanager
def tracing(model, trace: TorchTrace) -> Iterator[Callable[[str, Any], None]]:
    """While active, torch's operations are watched and ``trace`` filled; yields ``hook(path, output)``, to be called
    by the recorder when the module at ``path`` (:data:`WHOLE_MODEL` for the root) returns its first ``output``."""
    import torch
    from torch.overrides import TorchFunctionMode

    owners: dict[int, str] = {}  # id(parameter or buffer) -> the path of the module holding it directly
    params: dict[int, Any] = {}
    for path, module in model.named_modules():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            owners.setdefault(id(tensor), path or WHOLE_MODEL)
            params[id(tensor)] = tensor
    held_by = {  # torch path -> the modules holding the parameters and buffers it holds
        path or WHOLE_MODEL: {owners[id(t)] for t in [*module.parameters(), *module.buffers()]}
        for path, module in model.named_modules()
    }
    derived = _Marks()  # tensors made from parameters alone (a weight cast, 1 + weight): their owner's path
    marks = _Marks()  # activations: (path of the parameterised operation's owner, operations applied after it)
    nodes = _Marks()  # tensors of a recorded output's layout chain: (torch path, index map as a tensor)
    streams = _Marks()  # tensors made from a recorded output without moving an axis or changing the shape: its path

    def owner_of(x) -> str | None:
        if id(x) in params and params[id(x)] is x:
            return owners[id(x)]
        return derived.get(x)

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = getattr(func, "__name__", "")
            if name not in ("__get__", "size", "dim"):
                try:
                    note(func, name, args, kwargs, out)
                except Exception:  # noqa: BLE001 - the trace is a reading aid: it never changes torch's run
                    pass
            return out

    def note(func, name: str, args, kwargs, out) -> None:
        """What the op ``func`` (called ``name``) tells of the tensors it made (``out``)."""
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        if not outs:
            return
        held = [o for x in ins if (o := owner_of(x)) is not None]
        activations = [x for x in ins if owner_of(x) is None]
        if held and not activations:
            for o in outs:
                derived.put(o, held[0])
        elif held:
            for o in outs:
                marks.put(o, (held[-1], []))
        else:
            found = next((m for x in ins if (m := marks.get(x)) is not None), None)
            if found is not None:
                after = found[1] if name in PASSING_OPS else [*found[1], name]
                for o in outs:
                    marks.put(o, (found[0], after))
        if name not in LAYOUT_OPS:
            source = next(((x, p) for x in ins if (p := streams.get(x)) is not None), None)
            if source is not None:
                for o in outs:
                    if tuple(o.shape) == tuple(source[0].shape) and streams.get(o) is None:
                        streams.put(o, source[1])
        elif args and isinstance(out, torch.Tensor) and (node := nodes.get(args[0])) is not None:
            _follow(node, func, args, kwargs, out)

    def _follow(node, func, args, kwargs, out) -> None:
        path, index = node
        if index is None:  # made only when torch's code moves the output: most outputs are never moved
            size = args[0].numel()
            index = torch.arange(size, dtype=torch.int64 if size >= 2**31 else torch.int32).reshape(args[0].shape)
        try:  # inside the mode's own handler: the index map's op is not watched
            moved = func(index, *args[1:], **kwargs)
        except Exception:  # noqa: BLE001 - an op the index map cannot take (a dtype view) ends the chain
            return
        if tuple(moved.shape) != tuple(out.shape) or moved.numel() != index.numel():
            return
        kept = trace.layouts.setdefault(path, [])
        if len(kept) < MAX_LAYOUTS:
            kept.append(moved.numpy().copy())
        nodes.put(out, (path, moved))

    def hook(path: str, output, inputs=()) -> None:
        try:
            returned(path, output, inputs)
        except Exception:  # noqa: BLE001 - the trace is a reading aid: it never costs the recording
            pass

    def returned(path: str, output, inputs) -> None:
        given = [x for x in _tensors(inputs) if x.is_floating_point()]
        if given and (source := streams.get(given[0])) is not None and source != path:
            trace.fed_by[path] = source
        floats = [x for x in _tensors(output) if x.is_floating_point()]
        if not floats:
            return
        nodes.put(floats[0], (path, None))
        streams.put(floats[0], path)
        found = marks.get(floats[0])
        if found is not None and found[1] and held_by.get(path) == {found[0]}:
            trace.after[path] = list(found[1])

    with Watch():
        yield hook
