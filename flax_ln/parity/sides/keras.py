"""The flax side as a Keras 3 model on the JAX backend: :class:`Keras` (what a user passes; a ``keras.Model`` or
``keras.Layer`` passed bare is taken as ``Keras(model)``) and :class:`KerasSide`. Its variables are named by their
Keras paths (:class:`~flax_ln.convert.trees.KerasTree`): the trainable ones are the parameters, the others state;
its forward is the model's own call made pure (``stateless_call``, ``training=False``) over a filled copy of the
values (the caller's model and its variables are never changed). Its sublayers' calls are recorded, and replayed
alone, by wrapping ``Layer.__call__`` while a recording runs on this thread. Imports neither torch nor, until a Keras
model is compared, keras."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import jax

from flax_ln.convert import KeyMap, PytreeTree
from flax_ln.convert.trees import KerasTree, is_keras_layer
from flax_ln.parity.records.capture import WHOLE_MODEL, Calls, Records, floating_leaves
from flax_ln.parity.records.pairing import Pairs, ParameterGroups
from flax_ln.parity.records.replay import TRACED, PortCall, Replayed, nudged, replays
from flax_ln.parity.sides.flax import Parts, Run, require_differentiable
from flax_ln.parity.sides.tree import TreeSide

INSTALL = (
    "pip install 'flax-ln[keras]' (keras 3), and set KERAS_BACKEND=jax before keras is imported; keras-hub with "
    "pip install --no-deps keras-hub plus its light imports (see docs/ports.md, 'A Keras model')"
)


def keras_module() -> Any:
    """The ``keras`` package, imported now; an ``ImportError`` saying how to install it when it cannot be."""
    try:
        import keras
    except ImportError as err:
        raise ImportError(f"a Keras flax side needs keras 3, which could not be imported ({err}): {INSTALL}") from err
    return keras


@dataclasses.dataclass(frozen=True)
class Keras:
    """A Keras 3 model (or layer) on the JAX backend as the flax side of a comparison (``weights=KeyMap(...)``
    required: ``KeyMap.discover(loader, torch_module, kind="keras")`` finds it).

    Its variables are named by their Keras paths (``transformer_layer_0/self_attention/query/kernel``); the
    trainable ones are the parameters (differentiated), the non-trainable ones (BatchNorm moving statistics, seed
    states) are state, filled from torch's buffers where the key map names them. The forward receives the model
    made pure, ``run(*a, **k) = model.stateless_call(trainable, non_trainable, *a, training=False, **k)[0]`` over
    filled copies of the values (the caller's model and its variables are not changed); a model that takes a dict
    (keras-hub's ``{"token_ids", "padding_mask"}``) is called through ``forward=``.
    """

    model: Any
    # a model this one is built again from (what flax_factory builds in a float64 check): its variables are named by
    # that model's paths, variable by variable in the layer tree's order, whatever this build's automatic numbering
    named_like: Any = None

    def variable_tree(self) -> KerasTree:
        """Its variables as the converter names them (``to_torch_state_dict(Keras(model), weights=...)``)."""
        return KerasTree(self.model, named_like=self.named_like)


def _wrapper(flax_module: Any) -> Keras:
    return flax_module if isinstance(flax_module, Keras) else Keras(flax_module)


class KerasRun:
    """A Keras model made pure over given values: calling it runs the model's own ``__call__`` (its input casts,
    masks and ``training`` handled by Keras) inside a ``keras.StatelessScope`` where every variable reads these
    values, as ``stateless_call`` does, with ``training=False`` unless the call passes ``training``; what the call
    assigns (moving statistics) stays in the scope. ``model`` is the model."""

    def __init__(self, model: Any, trainable: list[Any], non_trainable: list[Any]):
        self.model, self.trainable, self.non_trainable = model, trainable, non_trainable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("training", False)
        with self.scope():
            return self.model(*args, **kwargs)

    def scope(self) -> Any:
        """A ``keras.StatelessScope`` in which every variable of the model reads these values."""
        variables = [*self.model.trainable_variables, *self.model.non_trainable_variables]
        return keras_module().StatelessScope(state_mapping=list(zip(variables, [*self.trainable, *self.non_trainable])))


def layer_paths(model: Any) -> dict[int, tuple[str, Any]]:
    """``id(layer) -> (path, layer)`` of every layer in ``model`` (the model itself: :data:`WHOLE_MODEL`): its Keras
    path, or, for a layer built without one (a dropout made in ``build``), its parent's path and its name."""
    found: dict[int, tuple[str, Any]] = {id(model): (WHOLE_MODEL, model)}

    def walk(layer: Any, path: str) -> None:
        for child in layer._flatten_layers(include_self=False, recursive=False):
            if id(child) in found:
                continue
            own = child.path or (child.name if path == WHOLE_MODEL else f"{path}/{child.name}")
            found[id(child)] = (own, child)
            walk(child, own)

    walk(model, WHOLE_MODEL)
    return found


def _positional(layer: Any) -> tuple[str, ...]:
    try:
        params = inspect.signature(layer.call).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def _takes_training(layer: Any) -> bool:
    try:
        return "training" in inspect.signature(layer.call).parameters
    except (TypeError, ValueError):
        return False


def _traced(args: Any, kwargs: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((args, kwargs)))


BEFORE_ACTIVATION = " (before its activation)"  # the name of a layer's output before the activation it applies


@dataclasses.dataclass(frozen=True)
class BeforeActivation:
    """A layer that applies its own activation (``Dense(activation="gelu")``) seen as its output before it: torch
    often has the activation apart (``fc1`` then ``act``), and pairing takes whichever output is torch's."""

    layer: Any


def _activation(layer: Any) -> Any:
    """The activation ``layer`` applies at the end of its call (a ``Dense``'s, a ``Conv``'s), or ``None``."""
    act = getattr(layer, "activation", None)
    return act if callable(act) and getattr(act, "__name__", "linear") != "linear" else None


@contextlib.contextmanager
def activation_inputs(layer: Any) -> Iterator[list[Any]]:
    """While active, ``layer``'s activation is a transparent wrapper that keeps what it is given (the layer's output
    before it) in the list yielded; it computes what the activation computes, and is taken off after."""
    act = _activation(layer)
    seen: list[Any] = []
    if act is None:
        yield seen
        return

    def keeping(x: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(x)
        return act(x, *args, **kwargs)

    object.__setattr__(layer, "activation", keeping)  # object's: Keras's tracking has nothing to track here
    try:
        yield seen
    finally:
        object.__setattr__(layer, "activation", act)


_local = threading.local()  # the recording active on this thread: a function (layer, call, args, kwargs) -> out
_lock = threading.Lock()
_patched: dict[str, Any] = {}


def _intercepting(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(layer: Any, *args: Any, **kwargs: Any) -> Any:
        hook = getattr(_local, "hook", None)
        if hook is None:
            return original(layer, *args, **kwargs)
        return hook(layer, functools.partial(original, layer), args, kwargs)

    return call


@contextlib.contextmanager
def intercept_layers(hook: Callable[..., Any]) -> Iterator[None]:
    """While active on this thread, every ``keras.Layer`` call goes through ``hook(layer, call, args, kwargs)``
    (``call(*args, **kwargs)`` is the layer's own); other threads, and every call after, see Keras unchanged."""
    layer_class = keras_module().layers.Layer
    with _lock:
        if not _patched:
            _patched["call"] = layer_class.__call__
            layer_class.__call__ = _intercepting(_patched["call"])
        _patched["users"] = _patched.get("users", 0) + 1
    outer, _local.hook = getattr(_local, "hook", None), hook
    try:
        yield
    finally:
        _local.hook = outer
        with _lock:
            _patched["users"] -= 1
            if not _patched["users"]:
                layer_class.__call__ = _patched.pop("call")
                _patched.clear()


@dataclasses.dataclass
class KerasSide(TreeSide):
    """The flax side as a :class:`Keras` model: its trainable variables are differentiated, the others are state;
    the forward receives the model made pure (:class:`KerasRun`)."""

    wrapper_type: ClassVar[type] = Keras
    tree_type: ClassVar[type[PytreeTree]] = KerasTree
    variable_noun: ClassVar[str] = "variable"
    paths_named: ClassVar[str] = "Keras layer paths (transformer_layer_0/self_attention/query)"
    port_calls: dict[str, PortCall] = dataclasses.field(default_factory=dict)  # by layer path, from record()
    traced: dict[str, str] = dataclasses.field(default_factory=dict)  # layer paths not recorded, and why

    @classmethod
    def takes(cls, flax_module: Any) -> bool:
        return isinstance(flax_module, Keras) or is_keras_layer(flax_module)

    @classmethod
    def variables_of(cls, wrapper: Any) -> Any:
        return _wrapper(wrapper).model

    @classmethod
    def check(cls, flax_module: Any, weights: KeyMap | None, mesh) -> None:
        """A Keras model on the JAX backend, built, with a key map and no ``mesh``; trainable variables floating."""
        model = _wrapper(flax_module).model
        keras = keras_module()
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"Keras(model): model must be a keras.Model or keras.Layer, got {type(model).__name__}")
        backend = keras.backend.backend()
        if backend != "jax":
            raise TypeError(
                f"the Keras model runs on the {backend!r} backend; the parity engine runs Keras on JAX only: set "
                "KERAS_BACKEND=jax before keras is imported (first thing in the process) and build the model again"
            )
        if weights is None:
            raise TypeError(
                "a Keras flax side needs weights=KeyMap(...): its variables are named by Keras paths, which never "
                "mirror torch's names; find it with KeyMap.discover(loader, torch_module, kind='keras'), a loader "
                "returning the Keras model (e.g. lambda folder: keras_hub.models.Backbone.from_preset(folder) with "
                "takes='folder')"
            )
        if not model.built:
            raise ValueError(
                f"the Keras model {model.name!r} has no variables yet: build it (call it once on an input, or "
                "model.build(input_shape)) before comparing it"
            )
        if mesh is not None:
            raise ValueError("mesh= is not supported for a Keras flax side; compare it without mesh")
        tree = KerasTree(model)
        values = tree.tree()
        trainable = {p: values[p] for p in tree.trainable}
        fix = "Make its variable non-trainable (trainable=False), so that it is state"
        require_differentiable(trainable, "trainable variable", fix)

    @classmethod
    def rebuilt_as(cls, built: Any, given: Any) -> Keras:
        """``built`` with its variables named by ``given``'s paths: Keras numbers the layers of each build
        (``dense_1/kernel`` in a second build of ``dense/kernel``), and a key map names the caller's."""
        return Keras(_wrapper(built).model, named_like=_wrapper(given).model)

    @classmethod
    def wrapped(cls, flax_module: Any) -> Keras:
        """A bare Keras model as ``Keras(model)``."""
        return _wrapper(flax_module)

    @classmethod
    def tree_of(cls, wrapper: Any) -> KerasTree:
        return wrapper.variable_tree()

    def _tree(self) -> KerasTree:
        assert isinstance(self.tree, KerasTree)
        return self.tree

    def parts(self) -> Parts:
        """The trainable variables are differentiated (a list, in ``trainable_variables`` order); the others state."""
        tree = self._tree()
        trainable, non_trainable = tree.ordered(tree.tree())
        model, names = tree.model, list(tree.trainable)
        return Parts(
            lambda params, rest: KerasRun(model, params, rest),
            trainable,
            non_trainable,
            lambda grads: dict(zip(names, grads)),
        )

    # ---- its layer tree

    def eager_model(self) -> KerasRun:
        parts = self.parts()
        return parts.build(parts.params, parts.rest)

    def record(self, forward: Callable[[], Any]) -> Records:
        """Run ``forward()`` with each layer's first call with a floating output recorded by its path (the model
        itself: :data:`WHOLE_MODEL`), whole, for isolation; a call traced inside a transform is not recorded."""
        names = layer_paths(self._tree().model)
        kept: dict[str, tuple[list[Any], list[Any]]] = {}
        own: dict[str, PortCall] = {}
        active: set[str] = set()
        clock = itertools.count()
        self.port_calls, self.traced = {}, {}

        def hook(layer, call, args, kwargs):
            path = names.get(id(layer), (None,))[0]
            if path is None or path in active:
                return call(*args, **kwargs)
            if _traced(args, kwargs):
                self.traced.setdefault(path, TRACED)
                return call(*args, **kwargs)
            active.add(path)
            port_call = PortCall("__call__", list(args), dict(kwargs), _positional(layer), next(clock))
            try:
                with activation_inputs(layer) as before:
                    out = call(*args, **kwargs)
            finally:
                active.discard(path)
            port_call.end = next(clock)
            outputs = floating_leaves(out)
            inputs = floating_leaves(list(args)) + floating_leaves(dict(kwargs))
            if outputs and path not in kept:
                kept[path], own[path] = (inputs, outputs), port_call
                if before:  # the output before the layer's own activation: a candidate of its own
                    kept[path + BEFORE_ACTIVATION] = (inputs, floating_leaves(before[-1]))
                    own[path + BEFORE_ACTIVATION] = port_call
            return out

        with intercept_layers(hook):
            jax.block_until_ready(forward())
        ordered = sorted(own, key=lambda p: own[p].start)
        self.port_calls = {path: own[path] for path in ordered}
        return {path: kept[path] for path in ordered}

    def unrecorded(self) -> dict[str, str]:
        return dict(self.traced)

    def recorded_calls(self) -> dict[str, PortCall]:
        return dict(self.port_calls)

    def record_nudged(self, forward_of: Callable[[Any], Any]) -> dict[str, PortCall]:
        """Each layer's first call in one more eager forward over the trainable variables
        :func:`~flax_ln.parity.records.replay.nudged` (the model's own variables are not changed): what tells a call's
        activations from its constants (a mask built from ids keeps its value)."""
        names = layer_paths(self._tree().model)
        parts = self.parts()
        run = parts.build(nudged(parts.params), parts.rest)
        calls: dict[str, PortCall] = {}

        def hook(layer, call, args, kwargs):
            path = names.get(id(layer), (None,))[0]
            if path is not None and path not in calls and not _traced(args, kwargs):
                calls[path] = PortCall("__call__", list(args), dict(kwargs), _positional(layer))
                if _activation(layer) is not None:  # the same call, as recorded under its output before activation
                    calls[path + BEFORE_ACTIVATION] = calls[path]
            return call(*args, **kwargs)

        with intercept_layers(hook):
            jax.block_until_ready(forward_of(run))
        return calls

    def module_paths(self, groups: ParameterGroups, recorded: Records) -> dict[str, Any]:
        """Every layer by its path (a handle is the layer), and each layer that applies its own activation as its
        output before it too (``path (before its activation)``, a :class:`BeforeActivation`)."""
        out: dict[str, Any] = {}
        for path, layer in layer_paths(self._tree().model).values():
            out[path] = layer
            if _activation(layer) is not None:
                out[path + BEFORE_ACTIVATION] = BeforeActivation(layer)
        return out

    def parameter_groups(self, filled: set[str], recorded: Records) -> ParameterGroups:
        """The filled variables each layer holds (by identity) -> the layers' paths, innermost first (a layer's output
        before its own activation first of all: torch's twin is often the projection alone)."""
        tree = self._tree()
        variables = [*tree.model.trainable_variables, *tree.model.non_trainable_variables]
        path_of = dict(zip(map(id, variables), [*tree.trainable, *tree.non_trainable]))
        groups: ParameterGroups = {}
        layers = sorted(layer_paths(tree.model).values(), key=lambda item: -item[0].count("/"))
        for path, layer in layers:
            own = frozenset(p for v in layer.variables if (p := path_of.get(id(v))) in filled)
            if own:
                before = [(path + BEFORE_ACTIVATION,)] if _activation(layer) is not None else []
                groups.setdefault(own, []).extend([*before, () if path == WHOLE_MODEL else (path,)])
        return groups

    def run_alone(
        self,
        pairs: Pairs,
        torch_records: Records,
        torch_calls: Calls | None,
        flax_records: Records,
        forward: Callable[[], Any],
    ) -> Iterator[tuple[str, Run]]:
        """Each paired layer called alone, eagerly, over the filled values (a ``keras.StatelessScope``), on its
        own recorded call with torch's values in it (:func:`~flax_ln.parity.records.replay.replay_arguments`:
        floating arguments by provenance or correspondence, the others, ``training`` and masks included, exactly as
        recorded; ``training=False`` for a layer that takes it and was not passed it). A layer whose call raises
        is skipped with the reason."""
        prepare = replays(pairs, torch_records, torch_calls, flax_records, self.port_calls)
        run = self.eager_model()
        for path in torch_records:
            layer = pairs.modules.get(path)
            if layer is None:
                yield path, pairs.why_unpaired(path)
                continue
            flax_path = pairs.flax_paths[path]
            own = self.port_calls.get(flax_path)
            if own is None:
                yield path, self.traced.get(flax_path, "its flax twin was not called (with a floating output)")
                continue
            prepared = prepare(path, own)
            if isinstance(prepared, str):
                yield path, prepared
                continue
            kwargs = dict(prepared.kwargs)
            if "training" not in kwargs and _takes_training(getattr(layer, "layer", layer)):
                kwargs["training"] = False
            called = layer.layer if isinstance(layer, BeforeActivation) else layer
            try:
                with run.scope(), activation_inputs(called) as before:
                    out = called(*prepared.args, **kwargs)
            except Exception as err:  # noqa: BLE001 - any failure to call is reported as the reason
                yield path, f"the flax call on torch's arguments raised {type(err).__name__}: {str(err)[:120]}"
                continue
            outputs = before[-1:] if isinstance(layer, BeforeActivation) else out
            yield path, Replayed(floating_leaves(outputs), prepared.kept)
