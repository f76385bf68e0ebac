"""The models ``flax-ln parity`` checks: each builder returns a :class:`flax_ln.parity.Case`.

A builder takes ``(dtype, batch, seq_len, seed)`` and makes a torch_ref module with
random weights, its flax twin (weights are copied by the harness) and random inputs.
torch is imported here; importing :mod:`flax_ln` does not import this module.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

import flax_ln
import flax_ln.train
import torch_ref
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


def _norm_case(name: str, torch_norm: torch.nn.Module, flax_cls, dtype: str, batch: int, seq_len: int, seed: int,
               features: int, randomize: bool = True) -> Case:
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
    return _norm_case("torch-layernorm", torch.nn.LayerNorm(1600), flax_ln.TorchLayerNorm, dtype, batch,
                      seq_len or 16, seed, 1600)


def encoder_decoder(dtype: str, batch: int, seq_len: int | None, seed: int, *, sizes: dict | None = None,
                    torch_model: torch.nn.Module | None = None, ffn_activation: str | None = None,
                    name: str = "encoder-decoder") -> Case:
    """Chapters 9-10's encoder-decoder, by default on a small config (N=2, d_model 32, 4 heads, d_ff 64,
    vocab 13), with padding in the source and the pad+causal target mask. Pad id 0."""
    sizes = sizes or dict(src_vocab=13, tgt_vocab=13, N=2, d_model=32, d_ff=64, h=4)
    pad, d_model = 0, sizes["d_model"]
    src_vocab, vocab = sizes["src_vocab"], sizes["tgt_vocab"]
    seq_len = seq_len or 10
    if torch_model is None:
        torch.manual_seed(seed)
        torch_model = torch_ref.make_model(**sizes, dropout=0.1, ffn_activation=ffn_activation)
        _perturb(torch_model, seed)
    torch_model = torch_model.to(getattr(torch, dtype))
    flax_model = flax_ln.make_model(**sizes, dropout=0.1, ffn_activation=ffn_activation,
                                    param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    src = rng.integers(1, src_vocab, (batch, seq_len)).astype(np.int64)
    tgt = rng.integers(1, vocab, (batch, seq_len + 1)).astype(np.int64)
    src[0, seq_len // 2:] = pad  # padding: masked keys in self- and source attention
    tgt[-1, (seq_len + 1) // 2:] = pad
    tgt_in, tgt_y = tgt[:, :-1], tgt[:, 1:]
    src_mask = (src != pad)[:, None, :]  # (B, 1, S)
    tgt_mask = torch_ref.make_std_mask(torch.from_numpy(tgt_in), pad).numpy()  # (B, T, T)
    ntokens = int((tgt_y != pad).sum())

    criterion = torch_ref.LabelSmoothing(vocab, padding_idx=pad, smoothing=0.1)

    def torch_loss(outputs):
        return criterion(outputs["log probs"].reshape(-1, vocab), torch.from_numpy(tgt_y).reshape(-1)) / ntokens

    def flax_loss(outputs):
        return flax_ln.label_smoothing_loss(outputs["log probs"], jnp.asarray(tgt_y), padding_idx=pad,
                                            smoothing=0.1) / ntokens

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


def _gpt_case(name: str, config: flax_ln.GPTConfig, dtype: str, batch: int, seq_len: int, seed: int,
              pad_targets: bool, torch_model: torch.nn.Module | None = None) -> Case:
    """A torch_ref.GPT (random, or the given one) and a flax_ln.GPT on (idx, targets);
    the book's Adam(1e-4) + clip 1 for training."""
    if seq_len > config.block_size:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's block_size {config.block_size}")
    if torch_model is None:
        torch.manual_seed(seed)
        torch_model = torch_ref.GPT(config)
        _perturb(torch_model, seed, scale=0.02)
    torch_model = torch_model.to(getattr(torch, dtype))
    flax_model = flax_ln.GPT(config, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, config.vocab_size, (batch, seq_len)).astype(np.int64)
    targets = rng.integers(0, config.vocab_size, (batch, seq_len)).astype(np.int64)
    targets[0, seq_len - max(1, seq_len // 4):] = config.ignore_index  # positions the loss skips
    if pad_targets:
        idx[0, seq_len - max(1, seq_len // 4):] = config.ignore_index  # padding is a real token id too

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


def gpt(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """A small GPT (2 layers, 4 heads, width 64, vocab 50, block 32), chapter 11's loss (ignore_index -1)."""
    config = flax_ln.GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=50, block_size=32)
    return _gpt_case("gpt", config, dtype, batch, seq_len or 16, seed, pad_targets=False)


def music(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """Chapter 14's music Transformer at full width (8 heads, 512, vocab 390, block 2048) with 2 layers,
    loss ignoring the padding id 389."""
    config = flax_ln.GPTConfig.music(n_layer=2)
    return _gpt_case("music", config, dtype, batch, seq_len or 32, seed, pad_targets=True)


def gpt2_xl_block(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """One full-width GPT-2XL block: n_embd 1600, 25 heads, block_size 1024."""
    from flax_ln.models.gpt import Block as FlaxBlock
    from torch_ref.gpt import Block as TorchBlock

    config = flax_ln.GPTConfig.gpt2_xl()
    torch.manual_seed(seed)
    torch_block = TorchBlock(config)
    _perturb(torch_block, seed, scale=0.02)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, seq_len or 32, config.n_embd)).astype(dtype)
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


class CheckpointError(ValueError):
    """A checkpoint that cannot be read safely or does not describe a model flax-ln knows."""


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file or a ``.pt``/``.pth``/``.bin`` state dict, read without unpickling code.

    ``torch.load`` runs with ``weights_only=True``: a file holding anything but tensors
    and plain containers is refused rather than executed.
    """
    import os
    import pickle

    if not os.path.isfile(path):
        raise CheckpointError(f"--checkpoint {path!r}: no such file")
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return dict(load_file(path))
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"--checkpoint {path!r} is not a readable safetensors file: {err}") from err
    if not path.endswith((".pt", ".pth", ".bin")):
        raise CheckpointError(
            f"--checkpoint {path!r}: expected a .safetensors file, a .pt/.pth/.bin state dict or a "
            "Hugging Face model folder"
        )
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).split("\n")[0].split(".")[0]  # drop torch's ANSI styling
        raise CheckpointError(
            f"--checkpoint {path!r} holds objects other than tensors, which flax-ln refuses to unpickle "
            f"(torch.load with weights_only=True: {reason}). Save the model's state_dict() instead, "
            "or convert it to safetensors."
        ) from err
    except (RuntimeError, EOFError, OSError) as err:
        raise CheckpointError(f"--checkpoint {path!r} is not a readable torch file: {err}") from err
    if isinstance(loaded, dict) and not any(isinstance(v, torch.Tensor) for v in loaded.values()):
        nested = [v for k, v in loaded.items() if k in ("state_dict", "model") and isinstance(v, dict)]
        loaded = nested[0] if nested else loaded
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise CheckpointError(
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


def _count_layers(keys, prefix: str) -> int:
    indices = {int(k[len(prefix):].split(".")[0]) for k in keys if k.startswith(prefix)}
    return max(indices) + 1 if indices else 0


def _gpt_config_from_shapes(state: dict[str, torch.Tensor], preset: str | None, n_head: int | None,
                            path: str) -> flax_ln.GPTConfig:
    """Sizes from the tensor shapes; the head count (and loss settings) from ``--n-head`` or ``--preset``."""
    vocab_size, n_embd = state["transformer.wte.weight"].shape
    sizes = dict(n_layer=_count_layers(state, "transformer.h."), n_embd=n_embd, vocab_size=vocab_size,
                 block_size=state["transformer.wpe.weight"].shape[0])
    base = {}
    if preset is not None:
        preset_config = GPT_PRESETS[preset](**({"vocab_size": vocab_size} if preset == "chapter12" else {}))
        base = {f.name: getattr(preset_config, f.name) for f in dataclasses.fields(preset_config)}
    if n_head is not None:
        base["n_head"] = n_head
    if "n_head" not in base:
        raise CheckpointError(
            f"--checkpoint {path!r}: a GPT of width {n_embd} with {sizes['n_layer']} layers, but the head count "
            f"cannot be read from tensor shapes; pass --n-head N or --preset {{{','.join(GPT_PRESETS)}}}"
        )
    try:
        return flax_ln.GPTConfig(**{**base, **sizes})
    except ValueError as err:
        raise CheckpointError(f"--checkpoint {path!r}: {err}") from err


def _load_strict(torch_model: torch.nn.Module, state: dict[str, torch.Tensor], path: str) -> torch.nn.Module:
    try:
        torch_model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"--checkpoint {path!r} does not fit the inferred model:\n{err}") from err
    return torch_model


def checkpoint_case(path: str, dtype: str, batch: int, seq_len: int | None, seed: int, *,
                    preset: str | None = None, n_head: int | None = None,
                    ffn_activation: str | None = None) -> Case:
    """A case for a user's checkpoint: a GPT or encoder-decoder state dict, a lone norm, or an HF GPT-2 folder.

    The architecture is recognised from the keys and its sizes from the tensor shapes;
    the head count cannot be inferred and comes from ``n_head`` or a GPT ``preset``.
    The encoder-decoder's feed-forward activation is not visible in its weights either:
    ``ffn_activation`` (default: the book's, none).
    """
    import os

    if os.path.isdir(path):
        try:
            torch_model = torch_ref.load_hf_gpt2(path)
        except (ValueError, OSError, RuntimeError, MemoryError) as err:
            raise CheckpointError(f"--checkpoint {path!r}: not a usable Hugging Face GPT-2 folder: {err}") from err
        config = flax_ln.GPTConfig.from_any(torch_model.config)  # torch_ref's own config, as plain data
        return _gpt_case(f"checkpoint {os.path.basename(os.path.normpath(path))}", config, dtype, batch,
                         min(seq_len or 16, config.block_size), seed, pad_targets=False, torch_model=torch_model)
    state = read_state_dict(path)
    name = f"checkpoint {os.path.basename(path)}"
    keys = set(state)
    if "transformer.wte.weight" in keys:
        config = _gpt_config_from_shapes(state, preset, n_head, path)
        torch_model = _load_strict(torch_ref.GPT(config), state, path)
        return _gpt_case(name, config, dtype, batch, min(seq_len or 16, config.block_size), seed,
                         pad_targets=config.ignore_index >= 0, torch_model=torch_model)
    if "src_embed.0.lut.weight" in keys:
        if n_head is None:
            raise CheckpointError(f"--checkpoint {path!r}: an encoder-decoder; its head count cannot be read from "
                                  "tensor shapes, pass --n-head N")
        src_vocab, d_model = state["src_embed.0.lut.weight"].shape
        sizes = dict(src_vocab=src_vocab, tgt_vocab=state["tgt_embed.0.lut.weight"].shape[0],
                     N=_count_layers(state, "encoder.layers."), d_model=d_model,
                     d_ff=state["encoder.layers.0.feed_forward.w_1.weight"].shape[0], h=n_head)
        if d_model % n_head:
            raise CheckpointError(f"--checkpoint {path!r}: d_model {d_model} is not divisible by --n-head {n_head}")
        torch_model = _load_strict(torch_ref.make_model(**sizes, ffn_activation=ffn_activation), state, path)
        return encoder_decoder(dtype, batch, seq_len, seed, sizes=sizes, torch_model=torch_model,
                               ffn_activation=ffn_activation, name=name)
    for leaves, flax_cls, torch_cls in ((("a_2", "b_2"), flax_ln.LayerNorm, torch_ref.LayerNorm),
                                        (("weight", "bias"), flax_ln.TorchLayerNorm, torch.nn.LayerNorm)):
        if keys == set(leaves) and state[leaves[0]].ndim == 1:
            features = state[leaves[0]].shape[0]
            torch_norm = _load_strict(torch_cls(features), state, path)
            return _norm_case(name, torch_norm, flax_cls, dtype, batch, seq_len or 16, seed, features, randomize=False)
    shown = ", ".join(sorted(keys)[:6]) + (", ..." if len(keys) > 6 else "")
    raise CheckpointError(
        f"--checkpoint {path!r}: not a model flax-ln knows (keys: {shown}). Expected a torch_ref GPT "
        "('transformer.wte.weight', ...), an encoder-decoder ('src_embed.0.lut.weight', ...), a LayerNorm "
        "('a_2', 'b_2' or 'weight', 'bias') or a Hugging Face GPT-2 folder."
    )
