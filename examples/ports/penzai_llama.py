"""penzai's own Llama, converted from ``transformers`` by penzai's converter, checked as a ``Function``.

penzai (``penzai.models.transformer.variants.llama.llama_from_huggingface_model``) is a port with
its own loader: it reads a ``transformers.LlamaForCausalLM``'s state dict and returns a penzai
model whose parameters are ``pz.Parameter`` objects holding ``NamedArray`` s, labelled
``transformer/block_0/attention/query.weights``. The recipe, with no penzai side in the engine:

1. ``pz.unbind_params(model, freeze=True)`` splits the model into its structure (with parameter
   slots) and the parameter values;
2. :func:`params_of` keeps each value's plain array, nested by its label (``transformer.block_0.
   attention.query.weights``), and each one's axis names apart;
3. :func:`function` returns ``Function(apply, params)``: ``apply`` wraps the arrays back into
   ``NamedArray`` s, rebinds them with ``pz.bind_variables``, tags the token ids ``(batch, seq)``
   and unwraps the logits in torch's order ``(batch, seq, vocabulary)``;
4. :func:`key_map` discovers the key map from penzai's converter itself, used as a loader
   (``KeyMap.discover(loader, hf, kind="function")``);
5. :func:`factory` re-runs the conversion, for ``compare_modules(..., flax_factory=)``: penzai
   builds float32 constants when it converts (the attention scale ``head_dim ** -0.5`` and the
   masked-out value as ``jnp.array(..., jnp.float32)``, the activations' dtype), which a float64
   run lifts only if they are built under lifting.

A ``Function`` has no modules: the report compares every output and gradient, but has no first
divergence or isolated mode.

penzai 0.2.5 reads ``config.rope_theta``, which transformers 5 keeps in
``config.rope_parameters["rope_theta"]``: :func:`convert` sets the attribute before converting.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np

from flax_ln.convert import KeyMap
from flax_ln.parity import Function

HF_CONFIG = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""A tiny Llama: 2 layers, width 32, 4 query heads sharing 2 key/value heads (head_dim 8)."""


def hf_llama(seed: int = 0, **config: Any):
    """A ``transformers.LlamaForCausalLM`` of :data:`HF_CONFIG` (updated by ``config``), seeded, in eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF_CONFIG, **config})).eval()


def convert(hf: Any) -> Any:
    """penzai's converter, as published; first gives transformers 5's config the ``rope_theta`` penzai reads."""
    from penzai.models.transformer.variants.llama import llama_from_huggingface_model

    if "rope_theta" not in hf.config.to_dict():
        hf.config.rope_theta = hf.config.rope_parameters["rope_theta"]
    return llama_from_huggingface_model(hf)


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b.c": x}`` -> ``{"a": {"b": {"c": x}}}``: a label's parts as nested keys (paths ``a.b.c``)."""
    nested: dict[str, Any] = {}
    for label, value in flat.items():
        *parents, leaf = label.replace("/", ".").split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def params_of(model: Any) -> tuple[Any, dict[str, Any], dict[str, tuple[str, ...]]]:
    """``(unbound model, params, axes)``: ``params`` nests each parameter's plain array by its label;
    ``axes`` maps a label to its ``NamedArray`` axis names, in the array's order."""
    from penzai import pz

    unbound, values = pz.unbind_params(model, freeze=True)
    if any(v.value.positional_shape for v in values):
        raise ValueError("a penzai parameter with positional axes: this recipe wraps fully named arrays only")
    arrays = {v.label: v.value.data_array for v in values}
    axes = {v.label: tuple(v.value.named_axes) for v in values}
    return unbound, _nest(arrays), axes


def function(model: Any) -> Function:
    """``Function(apply, params)`` of a converted penzai model: token ids (B, T) -> logits (B, T, vocab)."""
    from penzai import pz

    unbound, params, axes = params_of(model)

    paths = {label: label.replace("/", ".").split(".") for label in axes}

    def apply(params: dict[str, Any], ids: jax.Array) -> jax.Array:
        values = []
        for label, names in axes.items():
            array: Any = params
            for part in paths[label]:
                array = array[part]
            named = pz.nx.NamedArray(named_axes=collections.OrderedDict(zip(names, array.shape)), data_array=array)
            values.append(pz.ParameterValue(value=named, label=label))
        logits = pz.bind_variables(unbound, values)(pz.nx.wrap(ids).tag("batch", "seq"))
        return logits.unwrap("batch", "seq", "vocabulary")

    return Function(apply, params)


def loader(state_dict: dict[str, np.ndarray]) -> dict[str, Any]:
    """penzai's converter as a loader: a torch state dict (NumPy arrays) -> the converted model's params."""
    import torch

    hf = hf_llama()
    hf.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state_dict.items()}, strict=True)
    return params_of(convert(hf))[1]


def key_map(hf: Any) -> KeyMap:
    """The key map penzai's converter implements, discovered by running it (:func:`loader`) on probes of ``hf``."""
    return KeyMap.discover(loader, hf, kind="function")


def factory(hf: Any):
    """A ``flax_factory=`` for ``compare_modules``: converts ``hf`` again, so its constants are built under lifting."""
    return lambda: function(convert(hf))
