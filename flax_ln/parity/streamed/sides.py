"""Both sides of a streamed comparison, one stage at a time: the checkpoint read lazily under torch's keys
(:class:`Checkpoint`), a stage's weights loaded into copies of its modules on each side (:func:`torch_stage`,
:func:`flax_stage`), and each side's forward and gradients of the stage (:class:`TorchStage`,
:class:`FlaxStage`). Nothing here holds more than one stage's weights.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln.convert import ConversionError, KeyMap, KeyPlan, fill_tree, load_torch_state_dict
from flax_ln.convert.keymap import key_map_error, match_targets
from flax_ln.convert.rules import export_with_rules, torch_leaves
from flax_ln.convert.tensor_files import SAFETENSORS_FLOATS, StoredTensor, checkpoint_tensors
from flax_ln.convert.trees import NNXTree
from flax_ln.parity.core.call import is_float, named_outputs
from flax_ln.parity.islands.island import Island
from flax_ln.parity.streamed.stages import (
    BoundStage,
    StageModules,
    flax_submodule,
    flax_wrapper,
    materialized,
    torch_modules,
    torch_wrapper,
)


def _torch():
    import torch

    return torch


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build torch modules in this scope with their parameters on the ``meta`` device and their buffers real.

    A model built so holds no weights (``compare_streamed`` reads them from the checkpoint stage by
    stage) but keeps the buffers its constructor computes (causal masks, rotary ``inv_freq``), which no
    checkpoint holds. Each parameter is made as its module makes it, then moved: one at a time in memory.
    """
    torch = _torch()
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def tie_names(torch_model: Any) -> dict[str, str]:
    """Every parameter name (``named_parameters(remove_duplicate=False)``) -> the name its tensor is compared
    under: the first of the names that hold it, as ``named_parameters()`` lists it. Works on the meta device."""
    first: dict[int, str] = {}
    out = {}
    for name, p in torch_model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def tie_groups(names: Mapping[str, str]) -> dict[str, list[str]]:
    """Each parameter's compared name -> every name that holds it: :func:`tie_names`'s ``names`` grouped."""
    groups: dict[str, list[str]] = {}
    for name, canonical in names.items():
        groups.setdefault(canonical, []).append(name)
    return groups


class Checkpoint:
    """A safetensors checkpoint under the torch model's state-dict keys, read one stage at a time.

    Checked whole before any compute: every key of ``torch_model.state_dict()`` is stored (a tied key
    may be stored under another of its names), with torch's shape and a dtype of the same kind, and
    nothing else is stored; every problem is listed in one :class:`~flax_ln.convert.ConversionError`.
    """

    def __init__(self, path: str | Path, torch_model: Any, dtype: str):
        self.stored = checkpoint_tensors(path)
        self.dtype = np.dtype(dtype)
        canonical = tie_names(torch_model)
        groups = tie_groups(canonical)
        specs = torch_model.state_dict(keep_vars=True)
        self.sources: dict[str, StoredTensor] = {}
        missing, mismatched = set(), []
        for key, tensor in specs.items():
            aliases = groups.get(canonical.get(key, key), [key])
            found = next((self.stored[a] for a in [key, *aliases] if a in self.stored), None)
            if found is None:
                missing.add(key)
            elif tuple(found.shape) != tuple(tensor.shape):
                mismatched.append((key, f"expected shape {tuple(tensor.shape)}, {found.name!r} has {found.shape}"))
            elif tensor.is_floating_point() != (found.code in SAFETENSORS_FLOATS):
                mismatched.append((key, f"torch holds {tensor.dtype}, {found.name!r} is stored as {found.code}"))
            else:
                self.sources[key] = found
        unexpected = set(self.stored) - set(specs)
        if missing or unexpected or mismatched:
            raise ConversionError(missing, unexpected, mismatched)

    def read(self, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """The tensors of ``keys``, floating ones in the comparison's dtype; keys stored as one tensor share one array
        (so that the converter sees the tie)."""
        arrays: dict[tuple[Path, str], np.ndarray] = {}
        out = {}
        for key in keys:
            source = self.sources[key]
            at = (source.file, source.name)
            if at not in arrays:
                value = source.read()
                arrays[at] = value.astype(self.dtype) if is_float(value) and value.dtype != self.dtype else value
            out[key] = arrays[at]
        return out


def check_models(torch_model: Any, flax_model: Any) -> None:
    """``TypeError`` unless ``torch_model`` is a ``torch.nn.Module`` and ``flax_model`` an NNX module: a stage is
    cut out of each by module paths."""
    torch = _torch()
    if not isinstance(torch_model, torch.nn.Module):
        raise TypeError(f"compare_streamed's torch_module must be a torch.nn.Module, got {type(torch_model).__name__}")
    if not isinstance(flax_model, nnx.Module):
        raise TypeError(
            f"compare_streamed's flax_module must be an NNX module (abstract from nnx.eval_shape, or not), got "
            f"{type(flax_model).__name__}: its stages are cut out by module paths. Compare a Linen module or a "
            "plain function whole with compare_modules"
        )


@contextlib.contextmanager
def naming_the_stage(what: str) -> Iterator[None]:
    """An error raised inside says, in a note (Python 3.11+), which stage and which side's step raised it: a
    stage's run is the caller's declaration, and its error alone would not say where in the chain it was."""
    try:
        yield
    except Exception as err:
        if hasattr(err, "add_note"):
            err.add_note(f"compare_streamed: raised in {what}")
        raise


def check_whole(torch_model: Any, flax_model: nnx.Module, weights: KeyMap | None, dtype: str) -> None:
    """Check the whole model's conversion before any stage runs, from shapes alone (both models may hold no
    weights): through ``weights``, every problem loading would find; through the rules, every torch parameter
    a rule names and every key the rules name present in torch's state dict. One error lists them all."""
    specs = {
        k: (tuple(t.shape), np.dtype(dtype) if t.is_floating_point() else _numpy_dtype(t))
        for k, t in torch_model.state_dict(keep_vars=True).items()
    }
    if weights is not None:
        ties = {k: v for k, v in tie_groups(tie_names(torch_model)).items() if len(v) > 1}
        _, problems = match_targets(weights, NNXTree(flax_model), specs, ties, stacklevel=5)
        if problems:
            raise key_map_error(problems)
        return
    named = torch_leaves(flax_model)
    params = {k for k, _ in torch_model.named_parameters(remove_duplicate=False)}
    missing, unexpected = set(named) - set(specs), params - set(named)
    if missing or unexpected:
        raise ConversionError(missing, unexpected, [])


META_FIX = (
    "Build the torch model with its parameters alone on meta: `with flax_ln.parity.parameters_on_meta(): model = ...`"
)


def check_buffers(torch_model: Any) -> None:
    """``ValueError`` when a buffer no checkpoint holds (a non-persistent one: rotary ``inv_freq``) is on the meta
    device, with no values for the stages and extras that read it."""
    persistent = set(torch_model.state_dict(keep_vars=True))
    meta = [n for n, b in torch_model.named_buffers() if b.is_meta and n not in persistent]
    if meta:
        raise ValueError(
            f"the torch model's buffers {meta[:4]} are on the meta device and no checkpoint holds them "
            f"(non-persistent buffers). {META_FIX}"
        )


@contextlib.contextmanager
def stage_of_a_key_map() -> Iterator[None]:
    """A stage's load through the whole model's key map: its rules (and constants) for other stages match
    nothing there, which :func:`check_whole` has checked on the whole model; no warning for them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="key map: these (rules|constants) matched no")
        yield


def project(outputs: Any, cotangents: Mapping[str, Any]) -> Any:
    """``sum_k sum(output_k * c_k)`` over the named outputs ``cotangents`` names (torch tensors or jax arrays):
    the scalar whose gradient is the vector-Jacobian product with those cotangents."""
    named = dict(named_outputs(outputs))
    missing = sorted(set(cotangents) - set(named))
    if missing:
        raise ValueError(f"the stage's outputs lack {missing}; it returned {sorted(named)}")
    terms = [(named[k] * c).sum() for k, c in cotangents.items()]
    return sum(terms[1:], terms[0])


def single_output(value: Any, stage: str) -> Any:
    """``value`` when it is one floating array (what a stage other than the last must return), else ``ValueError``."""
    named = named_outputs(value)
    if len(named) != 1 or named[0][0] != "output" or not is_float(np.asarray(_host(named[0][1]))):
        got = [k for k, _ in named] or type(value).__name__
        raise ValueError(
            f"stage {stage!r} must return one floating array for the next stage (only the last stage returns the "
            f"model's outputs); it returned {got}"
        )
    return value


def _host(value: Any) -> Any:
    return value.detach().cpu() if hasattr(value, "detach") else value


# ---------------------------------------------------------------------------------------------
# The torch side


@dataclasses.dataclass
class TorchStage:
    """A stage's torch modules, copies holding its weights (``wrapper`` holds them at their model paths)."""

    bound: BoundStage
    wrapper: Any
    modules: list[Any]
    buffers_built: list[Island] = dataclasses.field(default_factory=list)

    def forward(self, x: Any, extras: Mapping[str, Any]) -> Any:
        with _torch().no_grad():
            return self.bound.stage.torch_run(self.modules, x, extras)

    def gradients(
        self, x: Any, extras: Mapping[str, Any], cotangents: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], Any]:
        """The stage's parameter gradients by the wrapper's names (the model's), and ``x``'s gradient (a tuple for
        the first stage's inputs; ``None`` for what is not floating), for the outputs' ``cotangents``."""
        torch = _torch()
        x_in = tuple(_leaf(t) for t in x) if isinstance(x, tuple) else _leaf(x)
        for p in self.wrapper.parameters():
            p.grad = None
        with torch.enable_grad():
            out = self.bound.stage.torch_run(self.modules, x_in, extras)
            value = project(out, {k: torch.from_numpy(np.asarray(c)) for k, c in cotangents.items()})
            if value.requires_grad:
                value.backward()
        grads = {
            name: np.zeros(p.shape, _numpy_dtype(p)) if p.grad is None else p.grad.numpy()
            for name, p in self.wrapper.named_parameters()
            if p.requires_grad
        }

        def grad_of(t):
            return None if not t.requires_grad else (torch.zeros_like(t) if t.grad is None else t.grad)

        x_grad = tuple(grad_of(t) for t in x_in) if isinstance(x_in, tuple) else grad_of(x_in)
        return grads, x_grad


def _leaf(t: Any) -> Any:
    t = t.detach()
    return t.requires_grad_(True) if t.is_floating_point() else t


def _numpy_dtype(p: Any) -> np.dtype:
    return np.dtype(str(p.dtype).removeprefix("torch."))


def torch_stage(
    skeleton: Any, bound: BoundStage, checkpoint: Checkpoint, dtype: str
) -> tuple[TorchStage, dict[str, np.ndarray]]:
    """Copies of the stage's torch modules holding its weights from ``checkpoint`` (floating ones in ``dtype``),
    in eval mode, and those weights (the torch tensors share their memory); ``skeleton``'s parameters may be on
    the meta device (:func:`check_buffers`). The copies' buffers that no checkpoint holds (non-persistent ones)
    are the skeleton's, cast to ``dtype``."""
    paths = bound.torch_paths
    copies = copy.deepcopy(torch_modules(skeleton, paths))  # one deepcopy: a tie within the stage stays one tensor
    wrapper = torch_wrapper(paths, copies)
    tensors = checkpoint.read(list(wrapper.state_dict(keep_vars=True)))
    torch = _torch()
    wrapper.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, assign=True)
    if dtype == "float64":
        wrapper.double()
    wrapper.eval()
    return TorchStage(bound, wrapper, copies), tensors


# ---------------------------------------------------------------------------------------------
# The flax side


@dataclasses.dataclass
class FlaxStage:
    """A stage's flax modules holding its weights, split for jit; ``plan``: the key map's plan (``None``: rules)."""

    bound: BoundStage
    graphdefs: tuple[Any, ...]
    params: tuple[Any, ...]
    rest: tuple[Any, ...]
    plan: KeyPlan | None
    torch_names: frozenset[str]

    def modules(self, params: Sequence[Any] | None = None) -> list[nnx.Module]:
        params = self.params if params is None else params
        return [nnx.merge(g, p, r) for g, p, r in zip(self.graphdefs, params, self.rest)]

    def torch_gradients(self, grads: Sequence[Any]) -> dict[str, np.ndarray]:
        """The stage's parameter gradients (``params``-shaped) under torch's names and layouts."""
        wrapper = flax_wrapper(self.bound.flax_paths, self.modules(grads))
        if self.plan is None:
            named = export_with_rules(wrapper, views=True)  # read once, where they lie: no copy
        else:
            flat = {
                p: np.asarray(v.get_value()) for p, v in NNXTree(wrapper).variable_items() if isinstance(v, nnx.Param)
            }
            named = self.plan.torch_gradients(flat)
        return {k: v for k, v in named.items() if k in self.torch_names}


def flax_stage(
    flax_model: nnx.Module,
    bound: BoundStage,
    tensors: Mapping[str, np.ndarray],
    dtype: str,
    weights: KeyMap | None,
    torch_names: frozenset[str],
) -> FlaxStage:
    """Eval-mode copies of the stage's flax modules (``flax_model`` may be abstract) holding ``tensors`` through the
    converter's rules or ``weights``, strictly; ``torch_names``: the torch parameters the stage's gradients cover."""
    modules = [materialized(*flax_submodule(flax_model, p), dtype) for p in bound.flax_paths]
    for m in modules:
        m.eval()
    wrapper = flax_wrapper(bound.flax_paths, modules)
    plan = None
    if weights is None:
        load_torch_state_dict(wrapper, tensors)
    else:
        with stage_of_a_key_map():
            plan = fill_tree(wrapper, tensors, weights)  # checked, filled, and its plan: one resolution
    graphdefs, params, rest = zip(*(nnx.split(m, nnx.Param, ...) for m in modules))  # each (graph, params, rest)
    return FlaxStage(bound, graphdefs, params, rest, plan, torch_names)


def run_stage(stage: BoundStage, graphdefs, params, rest, x: Any, extras: Mapping[str, Any]) -> Any:
    """The stage's flax run on its modules merged from ``(graphdefs, params, rest)``: what each compiled function
    traces."""
    modules = [nnx.merge(g, p, r) for g, p, r in zip(graphdefs, params, rest)]
    root = flax_wrapper(stage.flax_paths, modules, StageModules)
    assert isinstance(root, StageModules)  # every level of the nesting is one
    return root.run(stage.stage.flax_run, modules, x, extras)


class FlaxRunner:
    """Each side's compiled stage functions, one per kind of stage (the run and its modules' graphs): a block
    compiles once for every layer. One per comparison, so that each compiles under its numerics and lifting."""

    def __init__(self) -> None:
        self._forward: dict[Any, Any] = {}
        self._gradients: dict[Any, Any] = {}

    def forward(self, stage: FlaxStage, x: Any, extras: Mapping[str, Any]) -> Any:
        bound, graphdefs = stage.bound, stage.graphdefs
        key = (bound.stage.flax_run, graphdefs)
        if key not in self._forward:
            self._forward[key] = jax.jit(functools.partial(run_stage, bound, graphdefs))
        return self._forward[key](stage.params, stage.rest, x, extras)

    def gradients(self, stage: FlaxStage, x: Any, extras: Mapping[str, Any], cotangents: Mapping[str, Any]):
        """``(parameter gradients, x's gradient)`` of the stage for its outputs' ``cotangents``."""
        bound, graphdefs = stage.bound, stage.graphdefs
        key = (bound.stage.flax_run, graphdefs)
        if key not in self._gradients:

            def value(params, x, rest, extras, cotangents):
                return project(run_stage(bound, graphdefs, params, rest, x, extras), cotangents)

            self._gradients[key] = jax.jit(jax.grad(value, argnums=(0, 1), allow_int=True))
        cot = {k: jnp.asarray(c) for k, c in cotangents.items()}
        return self._gradients[key](stage.params, x, stage.rest, extras, cot)


def float_grad(g: Any) -> Any:
    """A gradient of jax's, or ``None`` for an integer input's (``float0``)."""
    return None if getattr(g, "dtype", None) == jax.dtypes.float0 else g
