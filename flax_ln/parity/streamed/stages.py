"""A model as a chain of stages, for :func:`~flax_ln.parity.streamed.compare.compare_streamed`: the declaration
(:class:`Stage`, :class:`Stages`), the stages of the book's GPT found by themselves (:func:`gpt_stages`), and a
stage's modules picked out of each side's model and nested under their own paths (:func:`torch_wrapper`,
:func:`flax_wrapper`), so that the converter and a key map name a stage's weights as they name the whole model's.

A stage is a few submodules of the model and how they are called: ``run(modules, x, extras)``, where ``modules``
are the stage's modules in the order its paths list them, ``x`` the previous stage's output (the first stage
gets the tuple of the model's inputs) and ``extras`` what :attr:`Stages.torch_extras` or
:attr:`Stages.flax_extras` computed once from the inputs (masks, positions, rotary tables). The last stage
returns the model's outputs; every other stage returns one floating array.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Run = Callable[[Sequence[Any], Any, Mapping[str, Any]], Any]
Extras = Callable[..., Mapping[str, Any]]

_STACKED = re.compile(r"(?P<base>.+)\[(?P<index>[^\]]+)\]")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One link of the chain: submodules of each side's model and how each side calls them.

    Args:
      name: the stage's name in progress and in the report (``"block {i}"``).
      torch: the torch module paths it holds, as ``named_modules()`` names them; ``{i}`` is the layer.
      flax: the flax module paths, dotted; ``{i}`` is the layer, and ``"h[{i}]"`` is layer ``i`` of
        layers stacked on a leading axis (``nnx.vmap``, a scan over layers).
      torch_run: ``run(modules, x, extras)``, the stage's computation on the torch side.
      flax_run: ``run(modules, x, extras)``, the stage's computation on the flax side.
      layers: the stage repeats for ``i`` in ``range(layers)``; ``None``: it is one stage.
    """

    name: str
    torch: tuple[str, ...]
    flax: tuple[str, ...]
    torch_run: Run
    flax_run: Run
    layers: int | None = None

    def expand(self) -> list[BoundStage]:
        """The stage once per layer (once if it has none), its paths with ``{i}`` filled in."""
        if self.layers is None:
            return [BoundStage(self, None)]
        return [BoundStage(self, i) for i in range(self.layers)]


@dataclasses.dataclass(frozen=True)
class BoundStage:
    """A :class:`Stage` at one layer (``None``: it has none)."""

    stage: Stage
    layer: int | None

    def _fill(self, pattern: str) -> str:
        return pattern if self.layer is None else pattern.replace("{i}", str(self.layer))

    @property
    def name(self) -> str:
        return self._fill(self.stage.name)

    @property
    def torch_paths(self) -> tuple[str, ...]:
        return tuple(self._fill(p) for p in self.stage.torch)

    @property
    def flax_paths(self) -> tuple[str, ...]:
        return tuple(self._fill(p) for p in self.stage.flax)


@dataclasses.dataclass(frozen=True)
class Stages:
    """A model declared as a chain of :class:`Stage` s, each side's extras computed once from the inputs.

    ``torch_extras(torch_model, *inputs, dtype=torch.float64)`` and ``flax_extras(flax_model, *inputs,
    dtype=jnp.float64)`` return a mapping (torch tensors, jax arrays) given to every stage's ``run``;
    ``dtype`` is the comparison's, in that framework's terms. The models hold no weights then (torch's
    parameters may be on the ``meta`` device, the flax model abstract), only buffers. ``None``: no extras.
    """

    stages: Sequence[Stage]
    torch_extras: Extras | None = None
    flax_extras: Extras | None = None

    def bound(self) -> list[BoundStage]:
        """Every stage at every layer, in the order they run."""
        out = [b for stage in self.stages for b in stage.expand()]
        if not out:
            raise ValueError("Stages(stages=[]) declares no stage: give at least one Stage")
        return out


# ---------------------------------------------------------------------------------------------
# The book's GPT, found by itself


def _torch_embed(modules, inputs, extras):
    import torch

    wte, wpe, drop = modules
    idx = inputs[0]
    return drop(wte(idx) + wpe(torch.arange(idx.shape[1], device=idx.device)))  # (B, T, C)


def _flax_embed(modules, inputs, extras):
    wte, wpe, drop = modules
    idx = jnp.asarray(inputs[0])
    return drop(wte(idx) + wpe(jnp.arange(idx.shape[1])))  # (B, T, C)


def _block(modules, x, extras):
    return modules[0](x)


def _head(modules, x, extras):
    ln_f, lm_head = modules
    return lm_head(ln_f(x)), None  # as the model returns: (logits, loss) without targets


def gpt_stages(torch_model: Any, flax_model: Any) -> Stages | None:
    """The stages of the book's GPT (``torch_ref.gpt.GPT`` against :class:`flax_ln.models.gpt.GPT`, either
    ``scan_layers``): the embedding, each block, and the final norm with the head; ``None`` for other models."""
    from flax_ln.models.gpt import GPT

    if not isinstance(flax_model, GPT) or not all(
        hasattr(torch_model, a) for a in ("transformer", "lm_head", "config")
    ):
        return None
    n_layer = flax_model.config.n_layer
    block = "transformer.h[{i}]" if flax_model.scan_layers else "transformer.h.{i}"
    embed = ("transformer.wte", "transformer.wpe", "transformer.drop")
    head = ("transformer.ln_f", "lm_head")
    return Stages(
        [
            Stage("embedding", embed, embed, _torch_embed, _flax_embed),
            Stage("block {i}", ("transformer.h.{i}",), (block,), _block, _block, layers=n_layer),
            Stage("head", head, head, _head, _head),
        ]
    )


# ---------------------------------------------------------------------------------------------
# A stage's modules, out of each side's model


def torch_modules(model: Any, paths: Sequence[str]) -> list[Any]:
    """The torch submodules at ``paths`` (``ValueError`` naming a path the model lacks)."""
    out = []
    for path in paths:
        try:
            out.append(model.get_submodule(path))
        except AttributeError as err:
            raise ValueError(f"stage path {path!r} names no torch submodule of {type(model).__name__}: {err}") from err
    return out


def _flax_child(node: Any, step: str) -> Any:
    if step.isdigit() and not hasattr(node, step):
        return node[int(step)]
    try:
        return getattr(node, step)
    except AttributeError:
        return node[step]


def flax_submodule(model: nnx.Module, path: str) -> tuple[nnx.Module, int | None]:
    """The flax submodule at ``path`` and, for ``"base[i]"``, the layer ``i`` of its stacked variables."""
    match = _STACKED.fullmatch(path)
    base, layer = (match["base"], int(match["index"])) if match else (path, None)
    node: Any = model
    for step in base.split(".") if base else ():
        try:
            node = _flax_child(node, step)
        except (AttributeError, KeyError, IndexError, TypeError) as err:
            raise ValueError(
                f"stage path {path!r} names no flax submodule of {type(model).__name__} (no {step!r})"
            ) from err
    if not isinstance(node, nnx.Module):
        raise ValueError(f"stage path {path!r} names a {type(node).__name__}, not an nnx.Module")
    return node, layer


def _nest(pairs: Sequence[tuple[str, Any]], make: Callable[[dict[str, Any]], Any]) -> Any:
    """``pairs`` of (dotted path, module) as nested containers built by ``make``, each module at its path."""
    tree: dict[str, Any] = {}
    for path, module in pairs:
        *parents, leaf = path.split(".")
        node = tree
        for step in parents:
            node = node.setdefault(step, {})
        node[leaf] = module

    def build(node: dict[str, Any]) -> Any:
        return make({k: build(v) if isinstance(v, dict) else v for k, v in node.items()})

    return build(tree)


def torch_wrapper(paths: Sequence[str], modules: Sequence[Any]) -> Any:
    """One ``torch.nn.Module`` holding ``modules`` at their ``paths``: its state dict has the whole model's keys."""
    import torch

    return _nest(list(zip(paths, modules)), torch.nn.ModuleDict)


def wrapper_path(path: str) -> str:
    """Where :func:`flax_wrapper` holds the module of stage path ``path``: a stacked layer's ``base[i]`` at
    ``base.i``, any other at ``path``."""
    return _STACKED.sub(r"\g<base>.\g<index>", path)


class StageModules(nnx.Dict):
    """A stage's flax modules at their model paths, whose :meth:`run` runs the stage from a method of theirs: a
    float32 island found inside is named by its path in the whole model, as a whole-model comparison names it."""

    def run(self, run: Run, modules: Sequence[nnx.Module], x: Any, extras: Mapping[str, Any]) -> Any:
        return run(modules, x, extras)


def flax_wrapper(
    paths: Sequence[str], modules: Sequence[nnx.Module], container: type[nnx.Dict] = nnx.Dict
) -> nnx.Module:
    """One ``container`` holding ``modules`` at their ``paths`` (:func:`wrapper_path`): the converter and a key map
    name its variables as they name the whole model's."""
    return _nest([(wrapper_path(p), m) for p, m in zip(paths, modules)], lambda children: container(**children))


def materialized(module: nnx.Module, layer: int | None, dtype: str | None) -> nnx.Module:
    """A copy of ``module`` (layer ``layer`` of stacked variables) to load a stage's weights into: its parameters
    abstract (``jax.ShapeDtypeStruct``, floating ones in ``dtype``) for the converter to fill, its other
    variables real. Abstract ones of those (``nnx.eval_shape``) become zeros, RNG keys key 0: eval mode reads no
    RNG. A module that holds arrays keeps their values."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]  # typed as a variadic tuple

    def layer_of(leaf):
        if layer is None:
            return leaf
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype) if _abstract(leaf) else leaf[layer]

    def abstract(leaf):
        leaf = layer_of(leaf)
        floating = dtype is not None and jnp.issubdtype(leaf.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(leaf.shape, jnp.dtype(dtype) if floating else leaf.dtype)

    def real(leaf):
        leaf = layer_of(leaf)
        if not _abstract(leaf):
            return jnp.asarray(leaf)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jnp.broadcast_to(jax.random.key(0), leaf.shape)
        return jnp.zeros(leaf.shape, leaf.dtype)

    return nnx.merge(graphdef, jax.tree.map(abstract, params), jax.tree.map(real, rest))


def _abstract(leaf: Any) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)
