"""Strict, bidirectional conversion between torch state dicts and flax_ln NNX modules.

Everything is driven by :data:`RULES`, one table keyed by NNX module type. Each entry
lists the module's leaves: a :class:`Leaf` pairs a flax attribute with a torch
state-dict name (and says whether the array is transposed), a :class:`DerivedBuffer`
names a persistent torch buffer that the flax module recomputes from its own
configuration instead of storing. A torch key is the module's path in the NNX tree,
joined with dots, followed by the leaf's torch name, so the converter works for any
model built from modules in the table.

A module whose instance attribute ``num_stacked_layers`` is an int holds layers
stacked along a leading axis (``scan_layers``); its torch keys are
``<path>.<i>.<rest>``, one set per layer, as torch's ``nn.ModuleList`` writes them.

Hugging Face GPT-2 checkpoints (:func:`load_hf_gpt2`) are renamed into torch_ref's
layout by the small table :data:`HF_GPT2_KEYS` and then loaded through the same strict
:func:`load_torch_state_dict`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln.encoder_decoder import PositionalEncoding
from flax_ln.gpt import GPT, CausalSelfAttention, GPTConfig, causal_mask_buffer
from flax_ln.layernorm import LayerNorm, TorchLayerNorm


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A flax attribute ``flax`` stored under torch name ``torch``; ``transpose`` swaps the last two axes."""

    flax: str
    torch: str
    transpose: bool = False


@dataclasses.dataclass(frozen=True)
class DerivedBuffer:
    """A persistent torch buffer that the flax module computes from its config, ``make(module)``."""

    torch: str
    make: Callable[[nnx.Module], np.ndarray]


Rule = Leaf | DerivedBuffer

# The one rule table. torch nn.Linear stores weight as (out, in); flax kernel is (in, out).
RULES: dict[type, tuple[Rule, ...]] = {
    nnx.Linear: (Leaf("kernel", "weight", transpose=True), Leaf("bias", "bias")),
    nnx.Embed: (Leaf("embedding", "weight"),),
    LayerNorm: (Leaf("a_2", "a_2"), Leaf("b_2", "b_2")),
    TorchLayerNorm: (Leaf("scale", "weight"), Leaf("bias", "bias")),
    # The sinusoidal table is a stored Buffer, not a DerivedBuffer: torch checkpoints carry
    # tables whose last bits depend on the sin/cos kernel that wrote them.
    PositionalEncoding: (Leaf("pe", "pe"),),
    # torch's persistent causal mask (1, 1, block, block); flax builds the mask from iotas.
    CausalSelfAttention: (DerivedBuffer("bias", lambda m: causal_mask_buffer(m.block_size)),),
}


class ConversionError(ValueError):
    """A state dict does not fit the model. Lists every offending key; the model is unchanged."""

    def __init__(self, missing=(), unexpected=(), mismatched=()):
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = sorted(mismatched)
        lines = [f"missing key {k!r}" for k in self.missing]
        lines += [f"unexpected key {k!r}" for k in self.unexpected]
        lines += [f"{k!r}: {why}" for k, why in self.mismatched]
        super().__init__(
            f"state dict does not fit the model ({len(lines)} problem(s)); nothing was loaded:\n  "
            + "\n  ".join(lines)
        )


@dataclasses.dataclass(frozen=True)
class _Entry:
    key: str
    module: nnx.Module
    rule: Rule
    layer: int | None  # index along the stacked leading axis, or None


def _rules_for(module: nnx.Module) -> tuple[Rule, ...] | None:
    for cls in type(module).__mro__:
        if cls in RULES:
            return RULES[cls]
    return None


def _torch_path(path: tuple, stacked: dict[tuple, int], layer: int | None) -> list[str]:
    """Dotted torch path of an NNX module path, inserting the layer index after a stacked prefix."""
    parts = [str(p) for p in path]
    for prefix in stacked:
        if path[: len(prefix)] == prefix:
            parts.insert(len(prefix), str(layer))
            break
    return parts


def _entries(model: nnx.Module) -> list[_Entry]:
    modules = list(nnx.iter_modules(model))
    stacked = {
        tuple(path): m.num_stacked_layers
        for path, m in modules
        if isinstance(getattr(m, "num_stacked_layers", None), int)
    }
    entries, covered = [], set()
    for path, module in modules:
        rules = _rules_for(module)
        if rules is None:
            continue
        num_layers = next((n for p, n in stacked.items() if tuple(path[: len(p)]) == p), None)
        for layer in range(num_layers) if num_layers is not None else [None]:
            prefix = ".".join(_torch_path(tuple(path), stacked, layer))
            for rule in rules:
                if isinstance(rule, Leaf):
                    var = getattr(module, rule.flax, None)
                    if var is None:  # e.g. nnx.Linear(use_bias=False)
                        continue
                    covered.add(id(var))
                key = f"{prefix}.{rule.torch}" if prefix else rule.torch
                entries.append(_Entry(key, module, rule, layer))
    uncovered = [
        ".".join(map(str, path))
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Param) and id(node) not in covered
    ]
    if uncovered:
        raise NotImplementedError(
            f"no conversion rule covers parameter(s) {uncovered}; add the owning module type to "
            "flax_ln.convert.RULES"
        )
    return entries


def _expected_spec(entry: _Entry) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype, in torch layout, that a state-dict value for this entry must have."""
    if isinstance(entry.rule, DerivedBuffer):
        buffer = np.asarray(entry.rule.make(entry.module))
        return buffer.shape, buffer.dtype
    var = getattr(entry.module, entry.rule.flax)
    shape = tuple(var.shape[1:] if entry.layer is not None else var.shape)
    if entry.rule.transpose:
        shape = shape[:-2] + shape[-2:][::-1]
    return shape, np.dtype(var.dtype)


def _torch_layout(entry: _Entry, host_values: dict[int, np.ndarray]) -> np.ndarray:
    """The torch-layout array this entry contributes to a state dict (an owned copy)."""
    if isinstance(entry.rule, DerivedBuffer):
        return np.array(entry.rule.make(entry.module))
    var = getattr(entry.module, entry.rule.flax)
    if id(var) not in host_values:  # one device-to-host copy per variable, not per layer
        host_values[id(var)] = np.asarray(var[...])
    value = host_values[id(var)]
    if entry.layer is not None:
        value = value[entry.layer]
    if entry.rule.transpose:
        value = np.swapaxes(value, -1, -2)
    return np.array(value)


def _as_numpy(value: Any) -> np.ndarray:
    """A NumPy view of a torch tensor or array-like, without importing torch unless given one."""
    if hasattr(value, "detach"):  # a torch.Tensor
        import torch

        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            import ml_dtypes

            return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()
    return np.asarray(value)


def _dtype_problem(got: np.dtype, want: np.dtype) -> str | None:
    if jnp.issubdtype(want, jnp.floating) and not jnp.issubdtype(got, jnp.floating):
        return f"dtype {got} cannot be cast to the parameter's floating dtype {want}"
    if jnp.issubdtype(want, jnp.integer) and not jnp.issubdtype(got, jnp.integer):
        return f"dtype {got} cannot be cast to the parameter's integer dtype {want}"
    return None


def load_torch_state_dict(
    model: nnx.Module, state_dict: Mapping[str, Any], *, strict: bool = True
) -> nnx.Module:
    """Load a torch-style state dict into ``model`` in place and return it.

    Values may be ``torch.Tensor`` or NumPy arrays; each is cast to the dtype of the
    parameter it replaces. Every key is validated before anything is written: missing
    and unexpected keys (only when ``strict``), wrong shapes and incompatible dtypes are
    all listed in one :class:`ConversionError`, and a failed load leaves the model as
    it was. Persistent buffers that flax recomputes (:class:`DerivedBuffer`) must equal
    the recomputed value.
    """
    entries = _entries(model)
    expected = {e.key for e in entries}
    missing = expected - state_dict.keys() if strict else set()
    unexpected = state_dict.keys() - expected if strict else set()
    mismatched: list[tuple[str, str]] = []
    per_variable: dict[int, tuple[nnx.Variable, dict[int | None, np.ndarray]]] = {}
    for entry in entries:
        if entry.key not in state_dict:
            continue
        got = _as_numpy(state_dict[entry.key])
        want_shape, want_dtype = _expected_spec(entry)
        if got.shape != want_shape:
            mismatched.append((entry.key, f"expected shape {want_shape}, got {got.shape}"))
            continue
        problem = _dtype_problem(got.dtype, want_dtype)
        if problem:
            mismatched.append((entry.key, problem))
            continue
        if isinstance(entry.rule, DerivedBuffer):
            want = np.asarray(entry.rule.make(entry.module), dtype=np.float64)
            if not np.array_equal(got.astype(np.float64), want):
                mismatched.append(
                    (entry.key, "buffer differs from the value this module computes from its config")
                )
            continue
        if entry.rule.transpose:
            got = np.swapaxes(got, -1, -2)
        var = getattr(entry.module, entry.rule.flax)
        per_variable.setdefault(id(var), (var, {}))[1][entry.layer] = got
    if missing or unexpected or mismatched:
        raise ConversionError(missing, unexpected, mismatched)

    for var, layers in per_variable.values():
        if None in layers:
            new = layers[None]
        elif len(layers) == var.shape[0]:
            new = np.stack([layers[i] for i in range(len(layers))])  # (n_layer, ...)
        else:  # strict=False with some layers absent: fill in from the current value
            new = np.array(var[...])
            for i, arr in layers.items():
                new[i] = arr
        old = var.get_value()  # also a ShapeDtypeStruct, for a model made by nnx.eval_shape
        # An owned copy: torch's state_dict() shares memory with its parameters, and JAX
        # on the CPU may alias a NumPy buffer, so a later in-place torch update (an
        # optimizer step) would otherwise change the flax model behind its back.
        value = jnp.asarray(np.array(new, dtype=old.dtype, copy=True))
        if isinstance(old, jax.Array) and not old.is_fully_replicated:
            value = jax.device_put(value, old.sharding)
        var.set_value(value)
    return model


def to_torch_state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's weights as a dict of NumPy arrays with torch names and layouts.

    Includes the persistent buffers torch saves, so the result loads with
    ``strict=True`` into the matching ``torch_ref`` module (wrap values with
    ``torch.from_numpy``). Stacked layers come out as per-layer keys.
    """
    host_values: dict[int, np.ndarray] = {}
    return {entry.key: _torch_layout(entry, host_values) for entry in _entries(model)}


# ---------------------------------------------------------------------------------------
# Hugging Face GPT-2 checkpoints (safetensors only)

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
