"""A torch checkpoint of the user's own, recognised: ``flax-ln parity --checkpoint PATH``.

:func:`torch_checkpoint_case` reads a torch_ref GPT, encoder-decoder or LayerNorm state dict
(safetensors, or ``.pt``/``.pth``/``.bin`` read without unpickling code) or a Hugging Face
GPT-2 folder, recognises the architecture from its keys and the sizes from its tensor
shapes, checks what it can before any model is built, and returns the book's case for that
model (:mod:`flax_ln.book.cases`) with the checkpoint's weights. Every refusal is a
:class:`TorchCheckpointError`. torch is imported here.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch

import flax_ln
import torch_ref
from flax_ln.book.cases import encoder_decoder, gpt_case, norm_case
from flax_ln.book.catalog import ENCODER_DECODER_LIMIT, GPT_PRESETS, check_seq_len
from flax_ln.convert import load_torch_state_dict
from flax_ln.parity import Case

TorchModuleT = TypeVar("TorchModuleT", bound=torch.nn.Module)


class TorchCheckpointError(ValueError):
    """A torch checkpoint that cannot be read safely or does not describe a model flax-ln knows."""


def read_torch_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file or a ``.pt``/``.pth``/``.bin`` state dict, read without unpickling code.

    ``torch.load`` runs with ``weights_only=True``: a file holding anything but tensors
    and plain containers is refused rather than executed.
    """
    import pickle

    if not os.path.isfile(path):
        raise TorchCheckpointError(f"--checkpoint {path!r}: no such file")
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return dict(load_file(path))
        except (SafetensorError, OSError, ValueError) as err:
            raise TorchCheckpointError(f"--checkpoint {path!r} is not a readable safetensors file: {err}") from err
    if not path.endswith((".pt", ".pth", ".bin")):
        raise TorchCheckpointError(
            f"--checkpoint {path!r}: expected a .safetensors file, a .pt/.pth/.bin state dict or a "
            "Hugging Face model folder"
        )
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).split("\n")[0].split(".")[0]  # drop torch's ANSI styling
        raise TorchCheckpointError(
            f"--checkpoint {path!r} holds objects other than tensors, which flax-ln refuses to unpickle "
            f"(torch.load with weights_only=True: {reason}). Save the model's state_dict() instead, "
            "or convert it to safetensors."
        ) from err
    except (RuntimeError, EOFError, OSError) as err:
        raise TorchCheckpointError(f"--checkpoint {path!r} is not a readable torch file: {err}") from err
    if isinstance(loaded, dict) and not any(isinstance(v, torch.Tensor) for v in loaded.values()):
        nested = [v for k, v in loaded.items() if k in ("state_dict", "model") and isinstance(v, dict)]
        loaded = nested[0] if nested else loaded
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise TorchCheckpointError(
            f"--checkpoint {path!r}: expected a dict of tensors (a state_dict), got {type(loaded).__name__}"
            + (" with non-tensor values" if isinstance(loaded, dict) else "")
        )
    return loaded


def _shown(keys: list[str], limit: int = 6) -> str:
    return ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "floating"
    return "complex" if dtype.is_complex else "bool" if dtype == torch.bool else "integer"


def stored_dtypes(state: Mapping[str, torch.Tensor]) -> str:
    """The floating dtype(s) a state dict is stored in, for the report: ``"bfloat16"``, ``"float16+float32"``."""
    return "+".join(sorted({_dtype_name(t.dtype) for t in state.values() if t.is_floating_point()})) or "none"


def check_dtypes(state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], path: str) -> None:
    """Refuse a checkpoint whose values are of another kind than the model's tensors under the same keys.

    Floating parameters need floating values (any width: half precision is upcast
    exactly); integer buffers (BatchNorm's ``num_batches_tracked``) need integers.
    ``torch.nn.Module.load_state_dict`` would cast an int8 or bool weight silently, and
    the check would then compare two copies of the same wrong weights. Keys the model
    lacks are left to the strict load, which lists them.
    """
    wrong: dict[str, list[str]] = {}  # "int8 (the model's: float32)" -> keys
    for key, value in state.items():
        want = expected.get(key)
        if want is not None and _dtype_kind(value.dtype) != _dtype_kind(want.dtype):
            wrong.setdefault(f"{_dtype_name(value.dtype)} (the model's: {_dtype_name(want.dtype)})", []).append(key)
    if wrong:
        listed = "\n  ".join(f"{what}: {_shown(keys)}" for what, keys in wrong.items())
        raise TorchCheckpointError(
            f"--checkpoint {path!r} stores weights of the wrong kind:\n  {listed}\nParameters must be floating "
            "point (float16, bfloat16, float32 or float64) and integer buffers integers: casting integer or bool "
            "values into the model would silently give wrong weights. Use the original floating-point checkpoint."
        )


def _check_structure(
    state: Mapping[str, torch.Tensor],
    path: str,
    architecture: str,
    required: Mapping[str, int],
    layer_prefixes: tuple[str, ...],
) -> dict[str, int]:
    """Layer counts per prefix, after checking the keys the sizes are read from; every problem listed at once.

    Args:
      required: key -> number of dimensions its tensor must have.
      layer_prefixes: where numbered layers live (``"transformer.h."``); each must hold
        layers ``0 .. n-1`` under integer indices.
    """
    problems = []
    missing = [key for key in required if key not in state]
    if missing:
        problems.append(f"missing: {', '.join(missing)}")
    problems += [
        f"malformed: {key} has shape {list(state[key].shape)}, expected a {ndim}-D tensor"
        for key, ndim in required.items()
        if key in state and state[key].ndim != ndim
    ]
    counts = {}
    for prefix in layer_prefixes:
        indices, malformed = set(), []
        for key in state:
            if key.startswith(prefix):
                index = key[len(prefix) :].split(".")[0]
                if index.isascii() and index.isdigit():
                    indices.add(int(index))
                else:
                    malformed.append(key)
        if malformed:
            problems.append(f"malformed: layer keys without an integer index after {prefix!r}: {_shown(malformed)}")
        if not indices:
            problems.append(f"missing: no layers ({prefix}0.*, {prefix}1.*, ...)")
        elif len(indices) != max(indices) + 1:
            gaps = sorted(set(range(max(indices) + 1)) - indices)
            problems.append(f"missing: layers {_shown([f'{prefix}{i}.*' for i in gaps])}")
        counts[prefix] = max(indices, default=-1) + 1
    if problems:
        raise TorchCheckpointError(
            f"--checkpoint {path!r} looks like {architecture} but is incomplete or malformed:\n  "
            + "\n  ".join(problems)
        )
    return counts


GPT_REQUIRED = {
    "transformer.wte.weight": 2,
    "transformer.wpe.weight": 2,
    "transformer.ln_f.weight": 1,
    "transformer.ln_f.bias": 1,
    "lm_head.weight": 2,
}
ENCODER_DECODER_REQUIRED = {
    "src_embed.0.lut.weight": 2,
    "tgt_embed.0.lut.weight": 2,
    "encoder.layers.0.feed_forward.w_1.weight": 2,
    "encoder.norm.a_2": 1,
    "decoder.norm.a_2": 1,
    "generator.proj.weight": 2,
}


def _gpt_config_from_shapes(
    state: dict[str, torch.Tensor], preset: str | None, n_head: int | None, path: str
) -> flax_ln.GPTConfig:
    """Sizes from the tensor shapes; the head count (and loss settings) from ``--n-head`` or ``--preset``."""
    n_layer = _check_structure(state, path, "a torch_ref GPT", GPT_REQUIRED, ("transformer.h.",))["transformer.h."]
    vocab_size, n_embd = state["transformer.wte.weight"].shape
    sizes = dict(
        n_layer=n_layer, n_embd=n_embd, vocab_size=vocab_size, block_size=state["transformer.wpe.weight"].shape[0]
    )
    base = {}
    if preset is not None:
        preset_config = GPT_PRESETS[preset](**({"vocab_size": vocab_size} if preset == "chapter12" else {}))
        base = {f.name: getattr(preset_config, f.name) for f in dataclasses.fields(preset_config)}
    if n_head is not None:
        base["n_head"] = n_head
    if "n_head" not in base:
        raise TorchCheckpointError(
            f"--checkpoint {path!r}: a GPT of width {n_embd} with {sizes['n_layer']} layers, but the head count "
            f"cannot be read from tensor shapes; pass --n-head N or --preset {{{','.join(GPT_PRESETS)}}}"
        )
    try:
        return flax_ln.GPTConfig(**{**base, **sizes})
    except ValueError as err:
        raise TorchCheckpointError(f"--checkpoint {path!r}: {err}") from err


def _build(make: Callable[[], TorchModuleT], path: str) -> TorchModuleT:
    """The torch model of a checkpoint; sizes it cannot allocate are a :class:`TorchCheckpointError`."""
    try:
        return make()
    except MemoryError as err:  # torch_ref refuses a config larger than the machine's memory
        raise TorchCheckpointError(
            f"--checkpoint {path!r}: the model its tensor shapes describe is too large: {err}"
        ) from err


def _load_checked(torch_model: TorchModuleT, state: Mapping[str, torch.Tensor], path: str) -> TorchModuleT:
    """``load_state_dict(strict=True)`` after :func:`check_dtypes`; floating values are cast to the model's dtype."""
    check_dtypes(state, torch_model.state_dict(), path)
    try:
        torch_model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise TorchCheckpointError(f"--checkpoint {path!r} does not fit the inferred model:\n{err}") from err
    return torch_model


def _flax_accepts(case: Case, state: Mapping[str, torch.Tensor], path: str) -> Case:
    """The flax side's own check of the checkpoint: the strict converter on the stored tensors (names, shapes,
    dtype kinds), not on the torch model's (already cast) copy. The engine then loads the torch copy."""
    try:
        load_torch_state_dict(case.flax_model, state)
    except ValueError as err:  # ConversionError
        raise TorchCheckpointError(f"--checkpoint {path!r}: the flax side refuses it: {err}") from err
    return case


def _seq_len_of(name: str, seq_len: int | None, block_size: int) -> int:
    """``--seq-len``, checked against the torch checkpoint's ``block_size``; by default 16, at most ``block_size``."""
    if seq_len is None:
        return min(16, block_size)
    check_seq_len(name, seq_len, block_size, "positions (its block_size)")
    return seq_len


def torch_checkpoint_case(
    path: str,
    dtype: str,
    batch: int,
    seq_len: int | None,
    seed: int,
    *,
    preset: str | None = None,
    n_head: int | None = None,
    ffn_activation: str | None = None,
) -> Case:
    """A case for a user's torch checkpoint: a GPT or encoder-decoder state dict, a lone norm, or an HF GPT-2 folder.

    The architecture is recognised from the keys and its sizes from the tensor shapes;
    the head count cannot be inferred and comes from ``n_head`` or a GPT ``preset``.
    The encoder-decoder's feed-forward activation is not visible in its weights either:
    ``ffn_activation`` (default: the book's, none). Before any model is built, the keys
    the sizes come from are checked (every missing or malformed one listed) and
    ``seq_len`` is checked against the model's positions. Weights must be floating point
    (:func:`check_dtypes`); half-precision ones are upcast to ``dtype`` and the stored
    dtype is named in the report (``case.stored_dtype``).
    """
    if os.path.isdir(path):
        name = f"checkpoint {os.path.basename(os.path.normpath(path))}"
        # Read first for the sizes and stored dtypes (torch_ref checks names, shapes and floating
        # dtypes on the headers), then loaded by torch_ref's own loader (tying, mask buffers,
        # float32): the files are read twice rather than the loader copied here.
        unusable = f"--checkpoint {path!r}: not a usable Hugging Face GPT-2 folder"
        try:
            torch_config, _, state = torch_ref.read_hf_gpt2(path)
        except (ValueError, OSError) as err:
            raise TorchCheckpointError(f"{unusable}: {err}") from err
        config = flax_ln.GPTConfig.from_any(torch_config)
        stored = stored_dtypes(state)
        del state
        seq_len = _seq_len_of(name, seq_len, config.block_size)
        try:
            torch_model = torch_ref.load_hf_gpt2(path)
        except (ValueError, OSError, RuntimeError, MemoryError) as err:
            raise TorchCheckpointError(f"{unusable}: {err}") from err
        case = gpt_case(name, config, dtype, batch, seq_len, seed, pad_targets=False, torch_model=torch_model)
        return dataclasses.replace(case, stored_dtype=stored)
    state = read_torch_state_dict(path)
    name = f"checkpoint {os.path.basename(path)}"
    keys = set(state)
    if "transformer.wte.weight" in keys:
        config = _gpt_config_from_shapes(state, preset, n_head, path)
        seq_len = _seq_len_of(name, seq_len, config.block_size)
        torch_model = _load_checked(_build(lambda: torch_ref.GPT(config), path), state, path)
        case = gpt_case(
            name, config, dtype, batch, seq_len, seed, pad_targets=config.ignore_index >= 0, torch_model=torch_model
        )
    elif any(key.startswith(("src_embed.", "tgt_embed.", "encoder.layers.", "decoder.layers.")) for key in keys):
        counts = _check_structure(
            state, path, "a torch_ref encoder-decoder", ENCODER_DECODER_REQUIRED, ("encoder.layers.", "decoder.layers.")
        )
        if n_head is None:
            raise TorchCheckpointError(
                f"--checkpoint {path!r}: an encoder-decoder; its head count cannot be read from "
                "tensor shapes, pass --n-head N"
            )
        src_vocab, d_model = state["src_embed.0.lut.weight"].shape
        sizes = dict(
            src_vocab=src_vocab,
            tgt_vocab=state["tgt_embed.0.lut.weight"].shape[0],
            N=counts["encoder.layers."],
            d_model=d_model,
            d_ff=state["encoder.layers.0.feed_forward.w_1.weight"].shape[0],
            h=n_head,
        )
        if d_model % n_head:
            raise TorchCheckpointError(
                f"--checkpoint {path!r}: d_model {d_model} is not divisible by --n-head {n_head}"
            )
        check_seq_len(name, seq_len or 10, *ENCODER_DECODER_LIMIT)
        torch_transformer = _load_checked(
            _build(lambda: torch_ref.make_model(**sizes, ffn_activation=ffn_activation), path), state, path
        )
        case = encoder_decoder(
            dtype,
            batch,
            seq_len,
            seed,
            sizes=sizes,
            torch_model=torch_transformer,
            ffn_activation=ffn_activation,
            name=name,
        )
    else:
        for leaves, flax_cls, torch_cls in (
            (("a_2", "b_2"), flax_ln.LayerNorm, torch_ref.LayerNorm),
            (("weight", "bias"), flax_ln.TorchLayerNorm, torch.nn.LayerNorm),
        ):
            if keys == set(leaves) and state[leaves[0]].ndim == 1:
                features = state[leaves[0]].shape[0]
                torch_norm = _load_checked(_build(functools.partial(torch_cls, features), path), state, path)
                case = norm_case(
                    name, torch_norm, flax_cls, dtype, batch, seq_len or 16, seed, features, randomize=False
                )
                break
        else:
            raise TorchCheckpointError(
                f"--checkpoint {path!r}: not a model flax-ln knows (keys: {_shown(sorted(keys))}). Expected a "
                "torch_ref GPT ('transformer.wte.weight', ...), an encoder-decoder ('src_embed.0.lut.weight', ...), "
                "a LayerNorm ('a_2', 'b_2' or 'weight', 'bias') or a Hugging Face GPT-2 folder."
            )
    return dataclasses.replace(_flax_accepts(case, state, path), stored_dtype=stored_dtypes(state))
