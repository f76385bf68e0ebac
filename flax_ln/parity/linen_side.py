"""The flax side as a Linen module with its variables: :class:`LinenSide`, for a
:class:`~flax_ln.parity.flax_side.Linen`. Its submodules are scope paths, recorded (:func:`capture_linen`) and
run on torch's inputs during one ``apply`` each, through ``flax.linen.intercept_methods``. Imports no torch."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen

from flax_ln.convert import LinenTree, PytreeTree, rules
from flax_ln.convert.layouts import Permute
from flax_ln.convert.trees import path_step
from flax_ln.parity.capture import WHOLE_MODEL, Calls, Records, floating_leaves
from flax_ln.parity.flax_side import Linen, Parts, Run
from flax_ln.parity.pairing import NO_HOLDER, Pairs, ParameterGroups, substitute_floats
from flax_ln.parity.tree_side import TreeSide


def _scope_path(module) -> str:
    """A bound Linen module's scope path, dotted (:data:`WHOLE_MODEL` for the root)."""
    return ".".join(map(str, module.path)) or WHOLE_MODEL


def capture_linen(call: Callable[[], Any], types: dict[str, type] | None = None) -> Records:
    """Run ``call`` (one or more Linen ``apply``, eagerly) with the (positional inputs, outputs) of every
    submodule recorded by dotted scope path, through ``flax.linen.intercept_methods``.

    As for NNX (:func:`~flax_ln.parity.nnx_side.capture_nnx`): dict order is execution order, the outermost
    call of any of a module's methods is recorded (``setup`` aside), the first completed call with a floating
    output is kept, and a call traced inside a transform (an ``nn.scan`` body) holds no values and is not
    recorded. With ``types``, each recorded path's module class is kept there.
    """
    records: Records = {}
    active: set[str] = set()

    def interceptor(next_fun, args, kwargs, context):
        if context.method_name == "setup":
            return next_fun(*args, **kwargs)
        path = _scope_path(context.module)
        if path in active:
            return next_fun(*args, **kwargs)
        active.add(path)
        try:
            out = next_fun(*args, **kwargs)
        finally:
            active.discard(path)
        outputs = floating_leaves(out)
        if outputs and path not in records:
            records[path] = (floating_leaves(list(args)), outputs)
            if types is not None:
                types[path] = type(context.module)
        return out

    with linen.intercept_methods(interceptor):
        call()
    return records


def _linen_run(module: linen.Module, variables, method):
    def run(*args, **kwargs):
        return module.apply(variables, *args, method=method, **kwargs)

    return run


def _named_leaves(tree: PytreeTree, prefix: tuple[str, ...], pytree) -> dict[str, Any]:
    """``{dotted path in tree: leaf}`` of ``pytree``, a subtree of ``tree``'s at key path ``prefix``."""
    flat = jax.tree_util.tree_flatten_with_path(pytree)[0]
    return {tree.name_of((*prefix, *(path_step(k) for k in path))): leaf for path, leaf in flat}


def _substitute(pairs: Pairs, path: str, args: Sequence[Any], torch_inputs: list[np.ndarray]) -> tuple | str:
    """The flax call's positional ``args`` with their floating arrays replaced by torch's recorded floating inputs
    (:func:`~flax_ln.parity.pairing.substitute_floats`); or why they cannot be."""
    leaves, treedef = jax.tree_util.tree_flatten(list(args))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return "its call is traced (inside nn.scan, nn.remat or another transform): it cannot be run alone"
    replaced = substitute_floats(pairs, path, leaves, torch_inputs)
    if isinstance(replaced, str):
        return replaced
    return tuple(jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in replaced]))


_CONVOLUTIONS = (linen.Conv, linen.ConvTranspose, linen.ConvLocal)  # channels-last, as nnx.Conv


@dataclasses.dataclass
class LinenSide(TreeSide):
    """The flax side as a :class:`~flax_ln.parity.flax_side.Linen` module: gradients with respect to the
    ``params`` collection (the others are state); its submodules are the scope paths that hold its parameters
    or ran."""

    wrapper_type: ClassVar[type] = Linen
    tree_type: ClassVar[type[PytreeTree]] = LinenTree
    variable_noun: ClassVar[str] = "variable"
    paths_named: ClassVar[str] = "Linen scope paths"
    module_types: dict[str, type] = dataclasses.field(default_factory=dict)  # by scope path, from record()

    @classmethod
    def variables_of(cls, wrapper: Any) -> Any:
        return wrapper.variables

    def parts(self) -> Parts:
        variables = self.tree.tree()
        module, method = self.wrapper.module, self.wrapper.method
        rest = {k: v for k, v in variables.items() if k != "params"}
        return Parts(
            lambda params, rest: _linen_run(module, {"params": params, **rest}, method),
            variables.get("params", {}),
            rest,
            functools.partial(_named_leaves, self.tree, ("params",)),
        )

    def float64(self) -> LinenSide:
        """And the module's ``dtype`` and ``param_dtype`` set to float64 where they are floating."""
        module = self.wrapper.module
        attrs = {
            a: jnp.float64
            for a in ("dtype", "param_dtype")
            if getattr(module, a, None) is not None and jnp.issubdtype(getattr(module, a), jnp.floating)
        }
        wrapper = dataclasses.replace(self.wrapper, module=module.clone(**attrs) if attrs else module)
        return dataclasses.replace(self, tree=self.float64_tree(), wrapper=wrapper)

    # ---- its module tree

    def eager_model(self) -> Any:
        """``run`` over the filled variables."""
        parts = self.parts()
        return parts.build(parts.params, parts.rest)

    def record(self, forward: Callable[[], Any]) -> Records:
        """And each recorded scope path's module class (for :meth:`type_layout`)."""
        self.module_types = {}
        return capture_linen(forward, self.module_types)

    def type_layout(self, handle: Any) -> Permute | None:
        """Channels-last for a Linen convolution (the handle is its scope path)."""
        cls = self.module_types.get(handle)
        return rules.CHANNELS_LAST if cls is not None and issubclass(cls, _CONVOLUTIONS) else None

    def module_paths(self, groups: ParameterGroups, recorded: Records) -> dict[str, Any]:
        """The scope paths that hold parameters or ran; a handle is its path."""
        known = {".".join(p) or WHOLE_MODEL for ps in groups.values() for p in ps} | set(recorded)
        return {p: p for p in known}

    def parameter_groups(self, filled: set[str], recorded: Records) -> ParameterGroups:
        """The filled variables under each scope path (every prefix of a variable's scope, and every module that
        ran) -> the scope paths."""
        tree = self.tree
        assert isinstance(tree, LinenTree)  # tree_type
        scopes = {name: tree.scope(name) for name in filled}
        paths = {scope[:i] for scope in scopes.values() for i in range(len(scope) + 1)}
        paths |= {tuple(p.split(".")) if p != WHOLE_MODEL else () for p in recorded}
        groups: ParameterGroups = {}
        for path in sorted(paths):
            own = frozenset(name for name, scope in scopes.items() if scope[: len(path)] == path)
            if own:
                groups.setdefault(own, []).append(path)
        return groups

    def run_alone(
        self,
        pairs: Pairs,
        torch_records: Records,
        torch_calls: Calls | None,
        flax_records: Records,
        forward: Callable[[], Any],
    ) -> Iterator[tuple[str, Run]]:
        """The first call of each paired submodule intercepted (``flax.linen.intercept_methods``) and made on
        torch's recorded inputs instead of its own (floating positional arrays, in order, in the flax layout; the
        other arguments as flax passed them), its own submodules running as usual; its output is recorded and
        passed on. One eager ``apply`` (``forward()``) per nesting depth, so that no isolated module runs inside
        another. A submodule whose call is traced (an ``nn.scan`` body), or whose inputs do not fit, is not run:
        the reason comes back (first, then the runs in torch's order, then the modules without a pair)."""
        by_flax = {f: t for t, f in pairs.flax_paths.items() if t in pairs.modules and t in torch_records}
        outputs: dict[str, list[np.ndarray]] = {}
        skipped: dict[str, str] = {}

        def depth(path: str) -> int:
            return 0 if path == WHOLE_MODEL else path.count(".") + 1

        for level in sorted({depth(f) for f in by_flax}):
            done: set[str] = set()

            def interceptor(next_fun, args, kwargs, context, level=level, done=done):
                path = _scope_path(context.module) if context.method_name != "setup" else ""
                torch_path = by_flax.get(path)
                if torch_path is None or path in done or depth(path) != level:
                    return next_fun(*args, **kwargs)
                done.add(path)
                prepared = _substitute(pairs, torch_path, args, torch_records[torch_path][0])
                if isinstance(prepared, str):
                    skipped[torch_path] = prepared
                    return next_fun(*args, **kwargs)
                out = next_fun(*prepared, **kwargs)
                outputs[torch_path] = floating_leaves(out)
                return out

            try:
                with linen.intercept_methods(interceptor):
                    forward()
            except Exception as err:  # noqa: BLE001 - any failure is reported as the reason these were not isolated
                reason = f"the flax apply on torch's inputs raised {type(err).__name__}: {str(err)[:120]}"
                skipped.update({t: reason for f, t in by_flax.items() if depth(f) == level and t not in outputs})
        yield from skipped.items()
        for torch_path in torch_records:
            if torch_path in by_flax.values() and torch_path not in skipped:
                yield torch_path, outputs.get(torch_path, "not called during the flax apply")
        for torch_path in torch_records:
            if torch_path not in pairs.modules:
                yield torch_path, pairs.unpaired.get(torch_path, NO_HOLDER)
