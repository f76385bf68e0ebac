"""What a Keras 3 object holds that says what it computes, for the factory check
(:func:`~flax_ln.parity.core.structure.model_difference`): every attribute, private ones included (keras-hub holds its
sublayers as ``self._fc``, Keras's ``MultiHeadAttention`` its settings as ``self._dropout``), less Keras's own
bookkeeping; and, for a functional model, its graph: each operation (``keras.activations.gelu(h, approximate=True)``
is an operation with its own settings) with the arguments of each of its calls in the model. Imports no keras: the
object's classes say what it is."""

from __future__ import annotations

import sys
import types
from typing import Any

# Keras's bookkeeping: trackers, graph links and build records, auto-numbered paths, locks and flags a call sets,
# and what training (Trainer.__init__ and compile) keeps. None of it says what the model computes. The graph of a
# functional model is compared as its operations and their calls ("(operations)", below), not as these lists of
# auto-named tensors and node ids.
KERAS_BOOKKEEPING = frozenset(
    {
        "_tracker",
        "_inbound_nodes",
        "_outbound_nodes",
        "_build_shapes_dict",
        "_seed_generators",
        "_auto_config",
        "_auto_config_error_args",
        "_lock",
        "_called",
        "_path",
        "_parent_path",
        "_trainable_variables",
        "_non_trainable_variables",
        "_losses",
        "_losses_override",
        "_loss_ids",
        "_metrics",
        "_jax_state_synced",
        "_self_setattr_tracking",
        "_nnx_op_mapping",
        "_functional_layer_ids",  # keras-hub's Backbone: the ids of its layers
        "output_names",
        "_inputs",
        "_outputs",
        "_inputs_struct",
        "_outputs_struct",
        "_nodes",
        "_nodes_by_depth",
        "_operations",
        "_operations_by_depth",
        # training (Trainer.__init__, compile, fit)
        "_compile_config",
        "_compile_loss",
        "_compile_metrics",
        "_compiled_trainable_state",
        "_compute_loss_has_training_arg",
        "_initial_epoch",
        "_jit_compile",
        "_loss_tracker",
        "_run_eagerly",
        "compiled",
        "custom_metric",
        "history",
        "jit_compile",
        "loss",
        "loss_tracker",
        "optimizer",
        "predict_function",
        "run_eagerly",
        "steps_per_execution",
        "stop_training",
        "test_function",
        "train_function",
    }
)


def keras_attributes(x: Any, held: dict[str, Any]) -> dict[str, Any]:
    """``held`` (the attributes of ``x``, a Keras object) as the factory check compares them: Keras's bookkeeping
    (:data:`KERAS_BOOKKEEPING`) and its own wrappers of ``build`` and ``quantize`` (set on each layer when it is
    made, wrapping whichever ``build`` the class had then) left out; a functional model's graph added as
    ``(operations)``."""
    wrappers = _keras_wrapper_code(type(x))
    out = {
        k: v
        for k, v in held.items()
        if k not in KERAS_BOOKKEEPING and not (isinstance(v, types.FunctionType) and v.__code__ in wrappers)
    }
    graph = functional_graph(x)
    if graph is not None:
        out["(operations)"] = graph
    if "_layers" in out:  # last: a sublayer is named by the attribute that holds it (_fc), not by its place here
        out["_layers"] = out.pop("_layers")
    return out


def _keras_wrapper_code(cls: type) -> set[Any]:
    """The code of the functions a Keras class's ``__new__`` makes (``Layer.__new__``'s ``build_wrapper``)."""
    code: set[Any] = set()
    for c in cls.__mro__:
        new = vars(c).get("__new__")
        new = getattr(new, "__func__", new)
        if c.__module__.startswith("keras.") and isinstance(new, types.FunctionType):
            code.update(k for k in new.__code__.co_consts if isinstance(k, types.CodeType))
    return code


def functional_graph(model: Any) -> dict[str, Any] | None:
    """A functional model's graph as plain data: its inputs and outputs (Keras tensors: compared by shape, and by
    which is which), then each operation in the model's order (``Gelu#4``: its class and place) and, under
    ``Gelu#4 calls``, each of its calls that belongs to the model: the call's arguments (tensors and settings:
    ``ops.multiply(h, 0.5)`` holds its 0.5 there; not ``training``, which Keras passes down from the call's
    context while it builds a graph) and outputs. ``None`` for an object that is not a functional
    model."""
    operations = getattr(model, "_operations", None)
    nodes = getattr(model, "_nodes", None)
    if not isinstance(operations, list) or not isinstance(nodes, set):
        return None
    key = sys.modules["keras.src.ops.function"].make_node_key  # a node's key in a graph, as Keras makes it
    graph: dict[str, Any] = {
        "inputs": list(getattr(model, "_inputs", None) or []),
        "outputs": list(getattr(model, "_outputs", None) or []),
    }
    for place, op in enumerate(operations):
        name = f"{type(op).__name__}#{place}"
        graph[name] = op
        context = set(getattr(op, "_call_context_args", ()))  # training: the call's context, which a run sets
        graph[f"{name} calls"] = [
            (node.arguments.args, {k: v for k, v in node.arguments.kwargs.items() if k not in context}, node.outputs)
            for i, node in enumerate(getattr(op, "_inbound_nodes", ()))
            if key(op, i) in nodes
        ]
    return graph
