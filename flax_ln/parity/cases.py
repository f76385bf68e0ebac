"""The models ``flax-ln parity`` checks: each builder returns a :class:`flax_ln.parity.Case`.

A builder takes ``(dtype, batch, seq_len, seed)`` and makes a torch_ref module with
random weights, its flax twin (weights are copied by the harness) and random inputs.
torch is imported here; importing :mod:`flax_ln` does not import this module.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable, Mapping
from typing import TypeVar

import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

import flax_ln
import flax_ln.train
import torch_ref
from flax_ln._deprecated import module_getattr
from flax_ln.convert import load_torch_state_dict
from flax_ln.parity.engine import Case, TrainSpec
from flax_ln.parity.reference import decoder_output_and_log_probs, logits_and_loss


def _perturb(module: torch.nn.Module, seed: int, scale: float = 0.1, *, replace: bool = False) -> None:
    """Add normal(0, scale) noise to every parameter (or, with ``replace``, set it to such noise),
    so ones/zeros initialisations (norm scales, biases) cannot hide a swapped or transposed
    weight, while small noise keeps a deep model's activations sane."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale
            if replace:
                p.copy_(noise)
            else:
                p.add_(noise)


def _regression_training(target: np.ndarray, learning_rate: float) -> TrainSpec:
    """Training for a lone layer: mean squared error to a fixed random target, Adam, no clipping."""
    return TrainSpec(
        loss=(lambda y: ((y - torch.from_numpy(target)) ** 2).mean(), lambda y: jnp.mean((y - target) ** 2)),
        torch_optimizer=lambda m: (torch.optim.Adam(m.parameters(), lr=learning_rate), None),
        optax_optimizer=optax.adam(learning_rate),
    )


def _norm_case(
    name: str,
    torch_norm: torch.nn.Module,
    flax_cls,
    dtype: str,
    batch: int,
    seq_len: int,
    seed: int,
    features: int,
    randomize: bool = True,
) -> Case:
    if randomize:
        _perturb(torch_norm, seed, scale=1.0, replace=True)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((batch, seq_len, features)) * 2 + 0.5).astype(dtype)
    return Case(
        name=name,
        torch_model=torch_norm.to(getattr(torch, dtype)),
        flax_model=flax_cls(features, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(seed)),
        inputs=[x],
        input_names=["x"],
        dtype=dtype,
        train=_regression_training(rng.standard_normal(x.shape).astype(dtype), learning_rate=1e-2),
        spec={"builder": flax_cls.__name__, "features": features, "eps": torch_norm.eps},
    )


def layernorm(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """The chapter-9 LayerNorm (torch_ref.LayerNorm vs flax_ln.LayerNorm), 512 features."""
    return _norm_case("layernorm", torch_ref.LayerNorm(512), flax_ln.LayerNorm, dtype, batch, seq_len or 16, seed, 512)


def torch_layernorm(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """torch.nn.LayerNorm vs its twin flax_ln.TorchLayerNorm, 1600 features (GPT-2XL width)."""
    return _norm_case(
        "torch-layernorm", torch.nn.LayerNorm(1600), flax_ln.TorchLayerNorm, dtype, batch, seq_len or 16, seed, 1600
    )


def encoder_decoder(
    dtype: str,
    batch: int,
    seq_len: int | None,
    seed: int,
    *,
    sizes: dict | None = None,
    torch_model: torch.nn.Module | None = None,
    ffn_activation: str | None = None,
    name: str = "encoder-decoder",
) -> Case:
    """Chapters 9-10's encoder-decoder, by default on a small config (N=2, d_model 32, 4 heads, d_ff 64,
    vocab 13), with padding in the source and the pad+causal target mask. Pad id 0."""
    sizes = sizes or dict(src_vocab=13, tgt_vocab=13, N=2, d_model=32, d_ff=64, h=4)
    pad, d_model = 0, sizes["d_model"]
    src_vocab, vocab = sizes["src_vocab"], sizes["tgt_vocab"]
    seq_len = seq_len or 10
    check_seq_len(name, seq_len, *ENCODER_DECODER_LIMIT)
    if torch_model is None:
        torch.manual_seed(seed)
        torch_model = torch_ref.make_model(**sizes, dropout=0.1, ffn_activation=ffn_activation)
        _perturb(torch_model, seed)
    torch_model = torch_model.to(getattr(torch, dtype))
    flax_model = flax_ln.make_model(
        **sizes, dropout=0.1, ffn_activation=ffn_activation, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(seed)
    )
    rng = np.random.default_rng(seed)
    src = rng.integers(1, src_vocab, (batch, seq_len)).astype(np.int64)
    tgt = rng.integers(1, vocab, (batch, seq_len + 1)).astype(np.int64)
    src[0, seq_len // 2 :] = pad  # padding: masked keys in self- and source attention
    tgt[-1, (seq_len + 1) // 2 :] = pad
    tgt_in, tgt_y = tgt[:, :-1], tgt[:, 1:]
    src_mask = (src != pad)[:, None, :]  # (B, 1, S)
    tgt_mask = torch_ref.make_std_mask(torch.from_numpy(tgt_in), pad).numpy()  # (B, T, T)
    ntokens = int((tgt_y != pad).sum())

    criterion = torch_ref.LabelSmoothing(vocab, padding_idx=pad, smoothing=0.1)

    def torch_loss(outputs):
        return criterion(outputs["log probs"].reshape(-1, vocab), torch.from_numpy(tgt_y).reshape(-1)) / ntokens

    def flax_loss(outputs):
        return (
            flax_ln.label_smoothing_loss(outputs["log probs"], jnp.asarray(tgt_y), padding_idx=pad, smoothing=0.1)
            / ntokens
        )

    def torch_optimizer(m):  # chapter 10: Adam(0.9, 0.98, 1e-9) with the Noam rate set before each step
        opt = torch.optim.Adam(m.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: torch_ref.noam_rate(s + 1, d_model, 1.0, 400))

    return Case(
        name=name,
        torch_model=torch_model,
        flax_model=flax_model,
        inputs=[src, tgt_in, src_mask, tgt_mask],
        input_names=["src", "tgt", "src_mask", "tgt_mask"],
        dtype=dtype,
        forward=decoder_output_and_log_probs,
        train=TrainSpec((torch_loss, flax_loss), torch_optimizer, flax_ln.noam_adam(d_model, 1.0, 400)),
        lm_logits="log probs",
        spec={"builder": "make_model", "sizes": dict(sizes), "ffn_activation": ffn_activation},
    )


def _the_loss(outputs):
    return outputs["loss"]


def _gpt_case(
    name: str,
    config: flax_ln.GPTConfig,
    dtype: str,
    batch: int,
    seq_len: int,
    seed: int,
    pad_targets: bool,
    torch_model: torch.nn.Module | None = None,
) -> Case:
    """A torch_ref.GPT (random, or the given one) and a flax_ln.GPT on (idx, targets);
    the book's Adam(1e-4) + clip 1 for training."""
    check_seq_len(name, seq_len, config.block_size, "positions (its block_size)")
    if torch_model is None:
        torch.manual_seed(seed)
        torch_model = torch_ref.GPT(config)
        _perturb(torch_model, seed, scale=0.02)
    torch_model = torch_model.to(getattr(torch, dtype))
    flax_model = flax_ln.GPT(config, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, config.vocab_size, (batch, seq_len)).astype(np.int64)
    targets = rng.integers(0, config.vocab_size, (batch, seq_len)).astype(np.int64)
    targets[0, seq_len - max(1, seq_len // 4) :] = config.ignore_index  # positions the loss skips
    if pad_targets:
        idx[0, seq_len - max(1, seq_len // 4) :] = config.ignore_index  # padding is a real token id too

    return Case(
        name=name,
        torch_model=torch_model,
        flax_model=flax_model,
        inputs=[idx, targets],
        input_names=["idx", "targets"],
        dtype=dtype,
        forward=logits_and_loss,
        train=TrainSpec(
            loss=(_the_loss, _the_loss),
            torch_optimizer=lambda m: (torch.optim.Adam(m.parameters(), lr=1e-4), None),
            optax_optimizer=flax_ln.train.gpt_adam(1e-4, clip_norm=1.0),
            clip_norm=1.0,
        ),
        lm_logits="logits",
        spec={"builder": "GPT", "config": dataclasses.asdict(config)},
    )


GPT_CONFIG = flax_ln.GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=50, block_size=32)
MUSIC_CONFIG = flax_ln.GPTConfig.music(n_layer=2)
ENCODER_DECODER_POSITIONS = 5000  # the book's positional table (max_len) on both sides


def gpt(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """A small GPT (2 layers, 4 heads, width 64, vocab 50, block 32), chapter 11's loss (ignore_index -1)."""
    return _gpt_case("gpt", GPT_CONFIG, dtype, batch, seq_len or 16, seed, pad_targets=False)


def music(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """Chapter 14's music Transformer at full width (8 heads, 512, vocab 390, block 2048) with 2 layers,
    loss ignoring the padding id 389."""
    return _gpt_case("music", MUSIC_CONFIG, dtype, batch, seq_len or 32, seed, pad_targets=True)


def gpt2_xl_block(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """One full-width GPT-2XL block: n_embd 1600, 25 heads, block_size 1024."""
    from flax_ln.models.gpt import Block as FlaxBlock
    from torch_ref.gpt import Block as TorchBlock

    config = flax_ln.GPTConfig.gpt2_xl()
    seq_len = seq_len or 32
    check_seq_len("gpt2-xl-block", seq_len)
    torch.manual_seed(seed)
    torch_block = TorchBlock(torch_ref.gpt.GPTConfig.from_any(config))
    _perturb(torch_block, seed, scale=0.02)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, seq_len, config.n_embd)).astype(dtype)
    return Case(
        name="gpt2-xl-block",
        torch_model=torch_block.to(getattr(torch, dtype)),
        flax_model=FlaxBlock(config, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(seed)),
        inputs=[x],
        input_names=["x"],
        dtype=dtype,
        train=_regression_training(rng.standard_normal(x.shape).astype(dtype), learning_rate=1e-4),
        spec={"builder": "Block", "config": dataclasses.asdict(config)},
    )


TorchModuleT = TypeVar("TorchModuleT", bound=torch.nn.Module)
ENCODER_DECODER_LIMIT = (ENCODER_DECODER_POSITIONS, "positions in the positional-encoding table")
# The longest sequence each book case takes (None: any), and what sets the limit.
SEQ_LEN_LIMITS: dict[str, tuple[int, str] | None] = {
    "layernorm": None,
    "torch-layernorm": None,
    "encoder-decoder": ENCODER_DECODER_LIMIT,
    "gpt": (GPT_CONFIG.block_size, "positions (its block_size)"),
    "gpt2-xl-block": (flax_ln.GPTConfig.gpt2_xl().block_size, "positions (GPT-2XL's block_size, its causal mask)"),
    "music": (MUSIC_CONFIG.block_size, "positions (its block_size)"),
}


def check_seq_len(model: str, seq_len: int, limit: int | None = None, what: str | None = None) -> None:
    """Raise ``ValueError`` naming the limit when ``seq_len`` exceeds what ``model`` takes.

    ``limit`` and ``what`` default to the book case's entry in :data:`SEQ_LEN_LIMITS`;
    a checkpoint passes its own (its ``block_size``). Called before any model is built.
    """
    if limit is None:
        entry = SEQ_LEN_LIMITS.get(model)
        if entry is None:
            return
        limit, what = entry
    if seq_len > limit:
        raise ValueError(
            f"--seq-len {seq_len} is too long for {model}: it takes at most {limit} {what}; "
            f"pass --seq-len {limit} or less"
        )


BUILDERS: dict[str, Callable[[str, int, int | None, int], Case]] = {
    "layernorm": layernorm,
    "torch-layernorm": torch_layernorm,
    "encoder-decoder": encoder_decoder,
    "gpt": gpt,
    "gpt2-xl-block": gpt2_xl_block,
    "music": music,
}


# ---------------------------------------------------------------------------------------
# user checkpoints


class TorchCheckpointError(ValueError):
    """A checkpoint that cannot be read safely or does not describe a model flax-ln knows."""


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
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


GPT_PRESETS = {
    "gpt2": flax_ln.GPTConfig.gpt2,
    "gpt2-xl": flax_ln.GPTConfig.gpt2_xl,
    "chapter12": lambda **kw: flax_ln.GPTConfig.chapter12(**kw),
    "music": flax_ln.GPTConfig.music,
}


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


def _checkpoint_seq_len(name: str, seq_len: int | None, block_size: int) -> int:
    """``--seq-len``, checked against the checkpoint's ``block_size``; default 16 (or ``block_size`` if smaller)."""
    if seq_len is None:
        return min(16, block_size)
    check_seq_len(name, seq_len, block_size, "positions (its block_size)")
    return seq_len


def checkpoint_case(
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
    """A case for a user's checkpoint: a GPT or encoder-decoder state dict, a lone norm, or an HF GPT-2 folder.

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
        seq_len = _checkpoint_seq_len(name, seq_len, config.block_size)
        try:
            torch_model = torch_ref.load_hf_gpt2(path)
        except (ValueError, OSError, RuntimeError, MemoryError) as err:
            raise TorchCheckpointError(f"{unusable}: {err}") from err
        case = _gpt_case(name, config, dtype, batch, seq_len, seed, pad_targets=False, torch_model=torch_model)
        return dataclasses.replace(case, stored_dtype=stored)
    state = read_state_dict(path)
    name = f"checkpoint {os.path.basename(path)}"
    keys = set(state)
    if "transformer.wte.weight" in keys:
        config = _gpt_config_from_shapes(state, preset, n_head, path)
        seq_len = _checkpoint_seq_len(name, seq_len, config.block_size)
        torch_model = _load_checked(_build(lambda: torch_ref.GPT(config), path), state, path)
        case = _gpt_case(
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
                case = _norm_case(
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


__getattr__ = module_getattr(
    __name__, {"CheckpointError": "TorchCheckpointError"}, globals()
)  # deprecated alias, see CHANGELOG.md
