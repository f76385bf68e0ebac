"""keras-hub's Llama, converted from a ``transformers`` folder by keras-hub's own converter, checked against the
``transformers`` model with no rule written: docs/ports.md, "A Keras model".

1. :func:`hf_llama` builds a tiny ``LlamaForCausalLM``; ``save_pretrained`` writes it to a folder, as a Hugging
   Face checkpoint is;
2. :func:`convert` is keras-hub's conversion, ``keras_hub.models.Backbone.from_preset(folder)``: a Keras model whose
   variables are named by Keras paths (``transformer_layer_0/self_attention/query/kernel``);
3. :func:`key_map` discovers the key map that conversion implements, with the converter itself as the loader
   (``KeyMap.discover(convert, hf, takes="folder", kind="keras")``): layouts, the tied head, nothing written;
4. :func:`check` compares the two: the Keras model is passed as it is (taken as ``Keras(model)``), and
   :data:`FORWARD` says how each side is called (transformers' hidden states; the backbone takes a dict).

keras-hub runs on Keras 3's JAX backend here: ``KERAS_BACKEND=jax`` must be set before keras is imported (this module
sets it when it is not set). Install: ``pip install 'flax-ln[keras]'``, then ``pip install --no-deps
keras-hub==0.32.0 sentencepiece kagglehub kagglesdk==0.1.28`` (keras-hub declares tensorflow-text, which its
transformers converters never import). Run: ``python examples/ports/keras_hub_llama.py``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported: Keras reads it once

import numpy as np  # noqa: E402

from flax_ln.convert import KeyMap  # noqa: E402
from flax_ln.parity import ParityReport, compare_modules  # noqa: E402

HF_CONFIG = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "tie_word_embeddings": True,
}
"""A tiny Llama: 1 layer, width 16, 2 query heads sharing 1 key/value head, vocabulary 64, the head tied."""


def hf_llama() -> Any:
    """The transformers model, seeded, in eval mode."""
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG)).eval()


def convert(folder: str | Path) -> Any:
    """keras-hub's conversion of a transformers folder (``config.json`` and ``model.safetensors``)."""
    import keras_hub

    return keras_hub.models.Backbone.from_preset(str(folder))


def key_map(hf: Any) -> KeyMap:
    """The key map keras-hub's converter implements, discovered by running it on probe folders."""
    return KeyMap.discover(convert, hf, takes="folder", kind="keras")


def hidden_states(hf: Any, ids: Any, mask: Any) -> Any:
    """transformers' side: the decoder's last hidden states (after the final norm), ``(batch, seq, hidden)``."""
    return hf.model(input_ids=ids, attention_mask=mask).last_hidden_state


def backbone(run: Any, ids: Any, mask: Any) -> Any:
    """keras-hub's side: the backbone takes a dict and returns the same hidden states."""
    return run({"token_ids": ids, "padding_mask": mask})


FORWARD = (hidden_states, backbone)


def inputs(batch: int = 2, seq: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and a padding mask of ones (no padding), ``(batch, seq)`` each."""
    ids = np.random.default_rng(0).integers(0, HF_CONFIG["vocab_size"], size=(batch, seq))
    return ids, np.ones((batch, seq), np.int64)


def check(hf: Any, model: Any, weights: KeyMap, **options: Any) -> ParityReport:
    """``compare_modules`` of the transformers model and its keras-hub conversion (``options`` passed on)."""
    return compare_modules(hf, model, inputs(), weights=weights, forward=FORWARD, **options)


def main() -> None:
    hf = hf_llama()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        model = convert(folder)
    weights = key_map(hf)
    print(weights.to_source())
    print(check(hf, model, weights))


if __name__ == "__main__":
    main()
