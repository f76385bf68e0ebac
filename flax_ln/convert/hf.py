"""Hugging Face GPT-2 checkpoints (safetensors only) in and out of :class:`flax_ln.GPT`.

Keys are renamed into torch_ref's layout by the small table :data:`HF_GPT2_KEYS` and then
loaded through the strict :func:`flax_ln.convert.load_torch_state_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln.convert.rules import ConversionError, load_torch_state_dict
from flax_ln.models.gpt import GPT, GPTConfig, causal_mask_buffer

# How a Hugging Face GPT-2 key becomes a torch_ref.GPT key, by suffix (after adding the
# "transformer." prefix that GPT2Model files lack). Conv1D weights are stored (in, out),
# the transpose of nn.Linear; the attention-mask buffers are not weights. Every other
# key is copied as is.
HF_GPT2_KEYS: dict[str, str] = {
    "attn.c_attn.weight": "transpose",
    "attn.c_proj.weight": "transpose",
    "mlp.c_fc.weight": "transpose",
    "mlp.c_proj.weight": "transpose",
    "attn.bias": "drop",
    "attn.masked_bias": "drop",
}

HF_GPT2_UNPREFIXED = ("wte", "wpe", "h", "ln_f")  # GPT2Model's top-level names

# Hugging Face config entries this GPT can only take at one value: (key, HF default, allowed).
HF_GPT2_FIXED: tuple[tuple[str, Any, tuple[Any, ...]], ...] = (
    ("model_type", "gpt2", ("gpt2",)),
    ("activation_function", "gelu_new", ("gelu_new", "gelu_pytorch_tanh")),  # both the tanh GELU
    ("scale_attn_weights", True, (True,)),
    ("scale_attn_by_inverse_layer_idx", False, (False,)),
    ("reorder_and_upcast_attn", False, (False,)),
    ("layer_norm_epsilon", 1e-5, (1e-5,)),
    ("add_cross_attention", False, (False,)),
)


def gpt_config_from_hf(hf: Mapping[str, Any]) -> tuple[GPTConfig, bool]:
    """``(GPTConfig, tie_word_embeddings)`` from a Hugging Face GPT-2 ``config.json`` dict.

    Raises ``ValueError`` listing every setting this GPT cannot express.
    """
    problems = [
        f"{key}={hf.get(key, default)!r} (this GPT supports {' or '.join(map(repr, allowed))})"
        for key, default, allowed in HF_GPT2_FIXED
        if hf.get(key, default) not in allowed
    ]
    n_embd = hf.get("n_embd", 768)
    if hf.get("n_inner") not in (None, 4 * n_embd):
        problems.append(f"n_inner={hf['n_inner']!r} (this GPT's MLP is 4*n_embd = {4 * n_embd} wide)")
    if problems:
        raise ValueError(
            "this Hugging Face GPT-2 config cannot be expressed by flax_ln.GPT: " + "; ".join(problems)
        )
    config = GPTConfig(
        n_layer=hf.get("n_layer", 12), n_head=hf.get("n_head", 12), n_embd=n_embd,
        vocab_size=hf.get("vocab_size", 50257), block_size=hf.get("n_positions", 1024),
        embd_pdrop=hf.get("embd_pdrop", 0.1), resid_pdrop=hf.get("resid_pdrop", 0.1),
        attn_pdrop=hf.get("attn_pdrop", 0.1),
    )
    return config, bool(hf.get("tie_word_embeddings", True))


def hf_gpt2_to_torch_state_dict(
    tensors: Mapping[str, np.ndarray], config: GPTConfig, *, tied: bool = True
) -> dict[str, np.ndarray]:
    """A Hugging Face GPT-2 state dict renamed and transposed into ``torch_ref.GPT``'s layout.

    Applies :data:`HF_GPT2_KEYS`, fills ``lm_head.weight`` from ``wte`` when ``tied`` (an
    explicit ``lm_head.weight`` must then equal ``wte``) and adds the ``attn.bias`` mask
    buffers, so the result is a complete torch_ref state dict. Key-set and shape checks
    are left to the converter (or torch's ``load_state_dict``).
    """
    state_dict: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        name = f"transformer.{key}" if key.split(".")[0] in HF_GPT2_UNPREFIXED else key
        action = next((a for suffix, a in HF_GPT2_KEYS.items() if name.endswith("." + suffix)), "copy")
        if action != "drop":
            state_dict[name] = np.swapaxes(value, -1, -2) if action == "transpose" else value
    wte = state_dict.get("transformer.wte.weight")
    if tied and wte is not None:
        head = state_dict.setdefault("lm_head.weight", wte)
        if head is not wte and (head.shape != wte.shape or not np.array_equal(head, wte)):
            raise ConversionError(mismatched=[(
                "lm_head.weight",
                "differs from transformer.wte.weight, but the checkpoint ties them (tie_word_embeddings); "
                "fix the checkpoint or set tie_word_embeddings=false in config.json",
            )])
    mask = causal_mask_buffer(config.block_size)
    for i in range(config.n_layer):
        state_dict[f"transformer.h.{i}.attn.bias"] = mask
    return state_dict


def _read_safetensors(files: list) -> dict[str, np.ndarray]:
    try:
        from safetensors import SafetensorError
        from safetensors.numpy import load_file
    except ImportError as err:
        raise ImportError("reading Hugging Face checkpoints needs the safetensors package: pip install safetensors") from err
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{file}: not a readable safetensors file: {err}") from err
    return tensors


def read_hf_gpt2(path, *, config: GPTConfig | None = None) -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """``(config, torch_ref-layout state dict)`` of a Hugging Face GPT-2 checkpoint; see :func:`load_hf_gpt2`."""
    import json
    from pathlib import Path

    path = Path(path)
    tied = True  # GPT-2 ties lm_head to wte
    if path.is_dir():
        if config is None:
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"{path}: no config.json; pass config=GPTConfig(...)")
            config, tied = gpt_config_from_hf(json.loads((path / "config.json").read_text()))
        index = path / "model.safetensors.index.json"
        if (path / "model.safetensors").is_file():
            files = [path / "model.safetensors"]
        elif index.is_file():
            files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        else:
            raise FileNotFoundError(
                f"{path}: no model.safetensors. Only safetensors are read (pickled .bin files can run code); "
                "convert with transformers: model.save_pretrained(folder, safe_serialization=True)"
            )
    elif path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"{path}: expected a .safetensors file or a Hugging Face model folder")
        if config is None:
            raise ValueError(f"{path}: a single .safetensors file has no config; pass config=GPTConfig(...)")
        files = [path]
    else:
        raise FileNotFoundError(f"{path}: no such file or folder")
    return config, hf_gpt2_to_torch_state_dict(_read_safetensors(files), config, tied=tied)


def load_hf_gpt2(
    path,
    *,
    config: GPTConfig | None = None,
    scan_layers: bool = False,
    dtype=None,
    param_dtype=jnp.float32,
) -> GPT:
    """A :class:`flax_ln.GPT` holding a Hugging Face GPT-2 checkpoint, in eval mode.

    ``path`` is a model folder as ``save_pretrained`` writes it (``config.json`` and
    ``model.safetensors``, or sharded ``model.safetensors.index.json``) or one
    ``.safetensors`` file, which needs ``config``. A given ``config`` is used instead of
    ``config.json``. Keys may carry the ``transformer.`` prefix (``GPT2LMHeadModel``) or
    not (``GPT2Model``). The four Conv1D weights are transposed, ``lm_head`` is tied to
    ``wte``, the ``attn.bias``/``attn.masked_bias`` buffers are skipped (see
    :data:`HF_GPT2_KEYS`); the result goes through :func:`load_torch_state_dict`, so every
    missing, unexpected or mis-shaped key is reported at once. Only safetensors are read.

    Args:
      path: folder or ``.safetensors`` file.
      config: the :class:`GPTConfig`; required for a single file.
      scan_layers, dtype, param_dtype: as :class:`flax_ln.GPT` (dropout streams are seeded 0).

    Raises:
      ValueError: a config this GPT cannot express (e.g. ``activation_function="relu"``,
        ``scale_attn_by_inverse_layer_idx``), or a file that is not safetensors.
      ConversionError: weights that do not fit, or ``lm_head.weight`` differing from ``wte``.
    """
    config, state_dict = read_hf_gpt2(path, config=config)

    def make():
        return GPT(config, scan_layers=scan_layers, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))

    # Parameters stay abstract until loaded (no random init of weights about to be
    # replaced); the RNG state is computed for real, XLA dropping the unused weight init.
    graphdef, params, _ = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
    rest = jax.jit(lambda: nnx.split(make(), nnx.Param, ...)[2])()
    model = load_torch_state_dict(nnx.merge(graphdef, params, rest), state_dict)
    model.eval()
    return model
