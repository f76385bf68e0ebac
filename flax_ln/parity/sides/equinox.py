"""The flax side as an Equinox module: :class:`Equinox` (what a user passes; an ``equinox.Module`` passed bare is
taken as ``Equinox(module)``) and :class:`EquinoxSide`. Its variables are the module's array leaves, named by
attribute names and indices, dotted (:class:`~flax_ln.convert.trees.EquinoxTree`), filled through a key map, or,
without one, through the identity map where those paths are torch's names (:func:`mirrored_key_map`); it runs as
``eqx.nn.inference_mode`` leaves it (eval mode, as torch); its submodules are recorded by
swapping each for a recording wrapper in a copy of the module (the caller's is never changed), under ``jax.vmap``
and ``eqx.filter_jit`` too. Imports neither torch nor, until an Equinox module is compared, equinox."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import jax
import numpy as np

from flax_ln.convert import KeyMap, PytreeTree
from flax_ln.convert.trees import EquinoxTree, is_equinox_module
from flax_ln.parity.islands.jax_remat import eager_checkpoints
from flax_ln.parity.records.capture import WHOLE_MODEL, Calls, Records, floating_leaves
from flax_ln.parity.records.pairing import Pairs, ParameterGroups, layer_groups
from flax_ln.parity.records.replay import PortCall, Replayed, nudged, replays
from flax_ln.parity.sides.equinox_record import EquinoxRecording, call_again, instrumented, recording
from flax_ln.parity.sides.flax import Parts, Run
from flax_ln.parity.sides.tree import TreeSide


@dataclasses.dataclass(frozen=True)
class Equinox:
    """An Equinox module as the flax side of a comparison, with ``weights=KeyMap(...)``, or without where its dotted
    paths are torch's state-dict names with torch's shapes (a convolution's bias may add unit axes): it is then
    filled through the identity map, as an NNX module that mirrors torch's tree is filled through the rules.

    The forward receives the module, filled from the torch weights on a copy (the caller's is not modified), in
    inference mode (the copy ``eqx.nn.inference_mode`` returns: ``eqx.nn.Dropout`` off), as it receives an NNX
    module. The parameters (differentiated, and filled by the key map) are its inexact arrays, or those ``params``
    chooses: an Equinox filter as ``eqx.partition`` takes it (a callable on leaves, or a pytree of bools). Its other
    arrays are state; everything else (an activation function, a string field) is static, kept as it is. A key map
    names a leaf by the module's attribute names and sequence indices, dotted (``layers.0.attn.query_proj.weight``).
    """

    module: Any
    params: Any = None

    def variable_tree(self) -> EquinoxTree:
        """Its arrays as the converter names them (``load_torch_state_dict``/``to_torch_state_dict`` take them)."""
        return EquinoxTree(self.module, self.params)


def _wrapper(flax_module: Any) -> Equinox:
    return flax_module if isinstance(flax_module, Equinox) else Equinox(flax_module)


@dataclasses.dataclass
class EquinoxSide(TreeSide):
    """The flax side as an :class:`Equinox` module: its parameters are differentiated, its other leaves are state
    or static; the forward receives the module rebuilt from them."""

    wrapper_type: ClassVar[type] = Equinox
    tree_type: ClassVar[type[PytreeTree]] = EquinoxTree
    variable_noun: ClassVar[str] = "parameter"
    paths_named: ClassVar[str] = "Equinox attribute paths (dotted, as the key map names them)"
    port_calls: dict[str, tuple[PortCall, int, list[int]]] = dataclasses.field(default_factory=dict)  # record()
    traced: dict[str, str] = dataclasses.field(default_factory=dict)  # record(): stacks called inside a trace
    isolates_from_calls: ClassVar[bool] = True

    @classmethod
    def takes(cls, flax_module: Any) -> bool:
        return isinstance(flax_module, Equinox) or is_equinox_module(flax_module)

    @classmethod
    def variables_of(cls, wrapper: Any) -> Any:
        return _wrapper(wrapper).module

    @classmethod
    def weights_for(cls, flax_module: Any, torch_module: Any, weights: KeyMap | None) -> KeyMap | None:
        """``weights``; without it the identity map of a module whose paths mirror torch's names
        (:func:`mirrored_key_map`), else the ``TypeError`` naming the first key that does not mirror."""
        wrapper = _wrapper(flax_module)
        if weights is not None or not is_equinox_module(wrapper.module):
            return weights
        return mirrored_key_map(cls.tree_of(wrapper), torch_module.state_dict())

    @classmethod
    def check(cls, flax_module: Any, weights: KeyMap | None, mesh) -> None:
        """A key map, an Equinox module, and no ``mesh`` (its arrays have no sharding rule)."""
        wrapper = _wrapper(flax_module)
        if not is_equinox_module(wrapper.module):
            raise TypeError(f"Equinox(module): module must be an equinox.Module, got {type(wrapper.module).__name__}")
        if weights is None:
            raise TypeError(
                "an Equinox flax side needs weights=KeyMap(...) (written, or KeyMap.discover(loader, torch_module, "
                "kind='equinox')) unless its paths mirror torch's names (compare_modules then makes the identity map)"
            )
        super().check(wrapper, weights, mesh)
        if mesh is not None:
            raise ValueError("mesh= is not supported for an Equinox flax side; compare it without mesh")

    @classmethod
    def wrapped(cls, flax_module: Any) -> Equinox:
        """A bare ``equinox.Module`` as ``Equinox(module)``."""
        return _wrapper(flax_module)

    @classmethod
    def tree_of(cls, wrapper: Any) -> EquinoxTree:
        """Its arrays, with the wrapper's ``params`` filter (kept in every tree made from this one), in the copy
        ``eqx.nn.inference_mode`` returns: every ``inference`` flag set (``eqx.nn.Dropout`` off, ``eqx.nn.BatchNorm``
        on its running statistics), as torch runs in eval mode; the caller's module keeps its flags."""
        import equinox as eqx  # an Equinox module is compared: equinox is imported

        return EquinoxTree(eqx.nn.inference_mode(wrapper.module), wrapper.params)

    def _tree(self) -> EquinoxTree:
        assert isinstance(self.tree, EquinoxTree)
        return self.tree

    def parts(self) -> Parts:
        """The parameters are differentiated; the other arrays are state; the rest (callables, numbers) static."""
        tree = self._tree()
        module = tree.tree()
        leaves, treedef = jax.tree_util.tree_flatten(module)
        names = list(tree.names(module))
        chosen = [i for i, n in enumerate(names) if n in tree.chosen]
        arrays = [i for i, x in enumerate(leaves) if i not in chosen and isinstance(x, (jax.Array, np.ndarray))]
        static = list(leaves)

        def build(params, rest):
            out = list(static)
            for i, x in itertools.chain(zip(chosen, params), zip(arrays, rest)):
                out[i] = x
            return jax.tree_util.tree_unflatten(treedef, out)

        chosen_names = [names[i] for i in chosen]
        return Parts(
            build, [leaves[i] for i in chosen], [leaves[i] for i in arrays], lambda g: dict(zip(chosen_names, g))
        )

    # ---- its module tree

    def eager_model(self) -> Any:
        """A copy of the filled module with every submodule (the root too) wrapped in a recorder
        (:func:`instrumented`): it computes what the module computes, and records only inside :meth:`record`."""
        return instrumented(self.tree.tree())

    def submodules(self) -> dict[str, Any]:
        """``{dotted path: submodule}`` of every callable ``equinox.Module`` in the filled module, root included."""
        return dict(_walk(self.tree.tree(), ()))

    def record(self, forward: Callable[[], Any]) -> Records:
        """Run ``forward()`` (over :meth:`eager_model`'s copy) with its recorders on: each submodule's first call
        by dotted path, in call order, with the batch axes ``jax.vmap`` adds (nested ones too) and a scanned
        stack's layers one by one (``layers[3].attn``; see :mod:`~flax_ln.parity.sides.equinox_record`); under
        ``jit`` its values arrive when it runs."""
        records, self.port_calls, self.traced = _recorded(self.tree.tree(), forward)
        return records

    def unrecorded(self) -> dict[str, str]:
        return dict(self.traced)

    def recorded_calls(self) -> Mapping[str, PortCall]:
        return {name: call for name, (call, _, _) in self.port_calls.items()}

    def record_nudged(self, forward_of: Callable[[Any], Any]) -> Mapping[str, PortCall]:
        """On a copy of the filled module with its floating arrays nudged (the module is not changed)."""
        model = nudged(self.tree.tree())
        _, calls, _ = _recorded(model, lambda: forward_of(instrumented(model)))
        return {name: call for name, (call, _, _) in calls.items()}

    def module_paths(self, groups: ParameterGroups, recorded: Records) -> dict[str, Any]:
        """Its submodules, and each recorded layer of a scanned stack (``layers[3]``, ``layers[3].attn``) as the
        module that iteration called."""
        layers = {name: call.state for name, (call, _, _) in self.port_calls.items() if "[" in name}
        return {**self.submodules(), **layers}

    def parameter_groups(self, filled: set[str], recorded: Records) -> ParameterGroups:
        """The filled variables under each submodule's path -> the submodules' path steps; a scanned stack's
        recorded layer ``layers[k]...`` holds layer ``k`` of each of its stacked variables (``name[k]``)."""
        out: ParameterGroups = {}
        for path in self.submodules():
            prefix = "" if path == WHOLE_MODEL else path + "."
            own = frozenset(n for n in filled if n.split("[")[0].startswith(prefix))
            if own:
                out.setdefault(own, []).append(tuple(prefix[:-1].split(".")) if prefix else ())
        for own, paths in layer_groups(filled, recorded).items():
            out.setdefault(own, []).extend(paths)
        return out

    def run_alone(
        self,
        pairs: Pairs,
        torch_records: Records,
        torch_calls: Calls | None,
        flax_records: Records,
        forward: Callable[[], Any],
    ) -> Iterator[tuple[str, Run]]:
        """Each paired submodule's recorded call made again (under the ``jax.vmap`` the port called it under),
        with its floating arguments replaced by torch's values by the rule every kind uses
        (:func:`~flax_ln.parity.records.replay.replay_arguments`: positional and keyword, ``key=``, flags and other
        values as recorded); or why it was not run (one module that cannot run alone skips only itself)."""
        prepare = replays(
            pairs, torch_records, torch_calls, flax_records, {n: c for n, (c, _, _) in self.port_calls.items()}
        )
        for path in torch_records:
            if pairs.modules.get(path) is None:
                yield path, pairs.why_unpaired(path)
                continue
            recorded = self.port_calls.get(pairs.flax_paths[path])
            if recorded is None or path not in flax_records:
                yield path, "its flax twin was not called (with a floating output) in the flax run"
                continue
            call, levels, batched = recorded
            prepared = prepare(path, call)
            if isinstance(prepared, str):
                yield path, prepared
                continue
            try:
                out = call_again(call.state, prepared.args, prepared.kwargs, levels, batched)
                yield path, Replayed(floating_leaves(out), prepared.kept)
            except Exception as err:  # noqa: BLE001 - any failure to call is reported as the reason
                yield path, f"the flax call on torch's arguments raised {type(err).__name__}: {str(err)[:120]}"


def mirrored_key_map(tree: EquinoxTree, torch_state: Mapping[str, Any]) -> KeyMap:
    """The identity key map of an Equinox module (its ``tree``) whose dotted paths are the torch state dict's names,
    each array of the torch tensor's shape, or of that shape with unit axes after it (an ``eqx.nn.Conv2d`` bias,
    ``(out, 1, 1)`` for torch's ``(out,)``), and whose every parameter is one of them; else a ``TypeError`` naming
    the first key (torch's, then the module's) that does not mirror and how to give a key map."""
    variables = tree.variables()
    rules: list[tuple[str, str, str | None]] = []
    problem = None
    for key, value in torch_state.items():
        want, have = tuple(value.shape), variables.get(key, (None,))[0]
        if have == want:
            rules.append((re.escape(key), key, None))
        elif have is not None and want and have[: len(want)] == want and all(n == 1 for n in have[len(want) :]):
            axes = " ".join(f"a{i}" for i in range(len(want)))  # torch's axes, then the module's unit axes
            rules.append((re.escape(key), key, f"{axes} -> {axes}{' 1' * (len(have) - len(want))}"))
        else:
            at = "has no array there" if have is None else f"holds {have} there"
            problem = f"torch's {key!r} {want}: the Equinox module {at}"
            break
    unfilled = [p for p, (_, _, required) in variables.items() if required and p not in torch_state]
    if problem is None and unfilled:
        problem = f"the Equinox module's parameter {unfilled[0]!r} is no torch key"
    if problem is not None:
        raise TypeError(
            f"an Equinox flax side without weights= is filled through the identity map, which needs its dotted "
            f"paths to be torch's state-dict names with torch's shapes: {problem}. Pass weights=KeyMap(...), "
            "written or KeyMap.discover(loader, torch_module, kind='equinox') for the loader that builds the port"
        )
    return KeyMap(rules)


def _recorded(
    module: Any, forward: Callable[[], Any]
) -> tuple[Records, dict[str, tuple[PortCall, int, list[int]]], dict[str, str]]:
    """``forward()`` run with the recorders of ``module``'s instrumented copy on: its records, each call whole
    (with the ``vmap`` levels it ran under), and the stacks called inside a trace (not recorded, with the reason);
    a scanned stack's layers told apart by ``module``'s stacked arrays."""
    stacked = {
        path: [x for x in jax.tree_util.tree_leaves(sub) if isinstance(x, (jax.Array, np.ndarray))]
        for path, sub in _walk(module, ())
    }
    recorder = EquinoxRecording(stacked)
    with recording(recorder), eager_checkpoints():  # a checkpointed scan body runs on values: layer by layer
        jax.block_until_ready(forward())
        jax.effects_barrier()
    return recorder.records(), recorder.port_calls(), dict(recorder.traced)


def _walk(node: Any, path: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """``(dotted path, module)`` of every callable ``equinox.Module`` under ``node`` (its fields, lists, dicts)."""
    if is_equinox_module(node):
        if callable(node):
            yield ".".join(path) or WHOLE_MODEL, node
        for field in dataclasses.fields(node):
            yield from _walk(getattr(node, field.name, None), (*path, field.name))
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from _walk(item, (*path, str(i)))
    elif isinstance(node, dict):
        for key, item in node.items():
            yield from _walk(item, (*path, str(key)))
