"""The models ``flax-ln parity`` checks: each builder returns a :class:`flax_ln.parity.Case`.

A builder takes ``(dtype, batch, seq_len, seed)`` and makes a torch_ref module with
random weights, its flax twin (weights are copied by the harness) and random inputs.
torch is imported here; importing :mod:`flax_ln` does not import this module.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

import flax_ln
import torch_ref
from flax_ln.parity import Case, TrainSpec


def _randomize(module: torch.nn.Module, seed: int, std: float = 1.0) -> None:
    """Give every parameter random values, so that no ones/zeros initialisation hides a bug."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)


def _norm_case(name: str, torch_norm: torch.nn.Module, flax_cls, dtype: str, batch: int, seq_len: int, seed: int,
               features: int) -> Case:
    _randomize(torch_norm, seed)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((batch, seq_len, features)) * 2 + 0.5).astype(dtype)
    target = rng.standard_normal((batch, seq_len, features)).astype(dtype)
    # Training a lone norm: regress onto a fixed random target with Adam(1e-2).
    train = TrainSpec(
        torch_loss=lambda m, x: ((m(x) - torch.from_numpy(target)) ** 2).mean(),
        flax_loss=lambda m, x: jnp.mean((m(x) - target) ** 2),
        torch_optimizer=lambda m: (torch.optim.Adam(m.parameters(), lr=1e-2), None),
        optax_optimizer=optax.adam(1e-2),
    )
    return Case(
        name=name,
        torch_model=torch_norm.to(getattr(torch, dtype)),
        flax_model=flax_cls(features, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(seed)),
        inputs=[x],
        input_names=["x"],
        torch_call=lambda m, x: {"y": m(x)},
        flax_call=lambda m, x: {"y": m(x)},
        dtype=dtype,
        train=train,
    )


def layernorm(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """The chapter-9 LayerNorm (torch_ref.LayerNorm vs flax_ln.LayerNorm), 512 features."""
    return _norm_case("layernorm", torch_ref.LayerNorm(512), flax_ln.LayerNorm, dtype, batch, seq_len or 16, seed, 512)


def torch_layernorm(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """torch.nn.LayerNorm vs its twin flax_ln.TorchLayerNorm, 1600 features (GPT-2XL width)."""
    return _norm_case("torch-layernorm", torch.nn.LayerNorm(1600), flax_ln.TorchLayerNorm, dtype, batch,
                      seq_len or 16, seed, 1600)


BUILDERS: dict[str, Callable[[str, int, int | None, int], Case]] = {
    "layernorm": layernorm,
    "torch-layernorm": torch_layernorm,
}
