"""How a float64 comparison runs both sides in float64: the torch module's float64 copy, and both sides'
float32 islands lifted while they run (``islands="lift"``) or kept as written (``"keep"``).

In float64 both frameworks compute the same math, so what is left is rounding, about 1e-16 per op, unless
one side computes part of it in float32: transformers' RMSNorm, attention softmax and rotary tables, flax's
``dot_product_attention`` softmax, a port's own ``astype(float32)``. Lifting runs those parts in float64 on
both sides (torch: :mod:`flax_ln.parity.islands.torch`, per dispatched op; flax:
:mod:`flax_ln.parity.islands.jax`, while the flax side is traced), and lists each island it met. Only
float32 is lifted: a cast to bfloat16 or float16 is the port's own computation, which a check must show.

Built-in islands are values made in float32 when the model was built (rotary ``inv_freq`` buffers): a
``.double()`` copy keeps them float32-rounded. The torch model is rebuilt with lifting on during its
construction when a factory is known (``torch_factory=``, or ``type(m)(m.config)`` for a transformers
model), loaded with the caller's weights and checked equal to them; without one, the float64 buffers whose
values are all float32-rounded (and that the weights do not overwrite) are listed, not lifted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import flax_ln.parity.islands.jax as jax_islands
import flax_ln.parity.islands.torch as torch_islands
from flax_ln.parity.core.structure import Rebuild
from flax_ln.parity.islands.island import Island
from flax_ln.parity.islands.torch import Float64Parameters, torch_in_float64
from flax_ln.parity.records.capture import WHOLE_MODEL

ISLAND_MODES = ("lift", "keep")


def check_island_mode(islands: str) -> None:
    """``ValueError`` unless ``islands`` is one of :data:`ISLAND_MODES`."""
    if islands not in ISLAND_MODES:
        raise ValueError(f"islands must be one of {list(ISLAND_MODES)}, got {islands!r}")


class Found:
    """The islands one comparison met, in the order it met them, each once."""

    def __init__(self) -> None:
        self.islands: list[Island] = []

    def add(self, islands: list[Island]) -> None:
        for island in islands:
            if island not in self.islands:
                self.islands.append(island)


@contextlib.contextmanager
def torch_model_for(
    torch_module: Any, dtype: str, islands: str, factory: Callable[[], Any] | None, found: Found
) -> Iterator[tuple[Any, Float64Parameters | None, Rebuild | None]]:
    """The torch model a comparison in ``dtype`` runs: the caller's module, in float64 for this scope when the
    comparison is float64 and the module is not (restored after, exactly), or, with lifting and a factory,
    a float64 copy rebuilt with its construction-time buffers in float64. Built-in islands go into ``found``.
    With it, the parameters this scope cast to float64 (:class:`~flax_ln.parity.islands.torch.Float64Parameters`,
    which may be given back early), or ``None`` where it cast none; and, for a copy the caller's ``torch_factory``
    built, its :class:`~flax_ln.parity.core.structure.Rebuild`, to confirm after the copy's first call.

    A transformers model rebuilt from its config alone (no ``torch_factory``) that is not the caller's model (built
    with constructor arguments the config does not hold: ``BertModel(config, add_pooling_layer=False)``) is not
    used: the caller's module runs, cast, and an island (not lifted) says why and names ``torch_factory=``."""
    if dtype != "float64":
        yield torch_module, None, None
        return
    given = factory is not None  # the caller's factory must build the caller's model; the default rebuilds it
    factory = (factory or torch_islands.default_factory(torch_module)) if islands == "lift" else None
    if factory is not None:
        try:
            model, built = torch_islands.build_lifted(factory, torch_module, same_model=False)
            other = None if given else _other_module_tree(torch_module, model)
        except ValueError as error:
            if given:
                raise
            other = " ".join(str(error).split())  # torch's load error spans lines
        if other is None:
            found.add(built)
            yield model, None, Rebuild(torch_module, model) if given else None
            return
        what = (
            f"the model rebuilt from its config alone is not this one ({other[:300]}), so its tables built at "
            "construction were not rebuilt in float64: pass torch_factory= (lambda: MyModel(config, ...), "
            "with the constructor arguments the model was built with)"
        )
        found.add([Island("torch", WHOLE_MODEL, what, lifted=False)])
    weights = set(torch_module.state_dict())
    if all(str(t.dtype) == "torch.float64" for t in _floats(torch_module)):
        found.add(torch_islands.rounded_buffers(torch_module, weights))
        yield torch_module, None, None
        return
    with torch_in_float64(torch_module) as cast:
        found.add(torch_islands.rounded_buffers(torch_module, weights))
        yield torch_module, cast, None


def _other_module_tree(given: Any, built: Any) -> str | None:
    """The first module path where ``built``'s module tree (paths and classes) is not ``given``'s, in words."""
    mine = {name: type(m) for name, m in built.named_modules()}
    for name, module in given.named_modules():
        rebuilt = mine.pop(name, None)
        if rebuilt is not type(module):
            other = "nothing" if rebuilt is None else f"a {rebuilt.__name__}"
            return f"{name or WHOLE_MODEL}: a {type(module).__name__} in the given model, {other} in the rebuilt one"
    return f"{next(iter(mine))}: in the rebuilt model only" if mine else None


def _floats(module: Any) -> list[Any]:
    return [t for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()]


@contextlib.contextmanager
def torch_lifted(torch_model: Any, dtype: str, islands: str, found: Found) -> Iterator[None]:
    """The torch side of a float64 comparison in this scope: its ``torch.autocast`` regions kept in their half
    precision (as in the model's own run), and, when it lifts, its float32 islands run in float64."""
    if dtype != "float64":
        yield
        return
    lifting = torch_islands.lift_float32(torch_model) if islands == "lift" else contextlib.nullcontext()
    with torch_islands.keep_autocast(torch_model) as kept, lifting as lifted:
        try:
            yield
        finally:
            found.add(kept.islands + (lifted.islands if lifted is not None else []))


@contextlib.contextmanager
def flax_lifted(dtype: str, islands: str, found: Found) -> Iterator[None]:
    """The flax side's float32 islands run in float64 in this scope, while it is traced (a float64
    comparison that lifts)."""
    if dtype != "float64" or islands != "lift":
        yield
        return
    with jax_islands.lift_float32() as lifted:
        try:
            yield
        finally:
            found.add(lifted.islands)
