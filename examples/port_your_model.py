"""Port your own model: a PyTorch token tagger, its Flax NNX twin written by hand, checked with assert_parity.

The model is not from the book: token ids -> Embedding -> Conv1d -> GELU -> LayerNorm ->
Linear -> per-token tag logits. Every layer is a standard one, so the converter's rule
table copies the weights with no rule written by the user; the torch side convolves
(B, C, T), the flax side (B, T, C), and the parity engine lines the two up by the
converter's declared activation layout.

Run:  python examples/port_your_model.py     (a few seconds on a CPU)

It checks the port in float32 and float64, then plants a mistake in one layer and prints
the report that names it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from flax_ln.parity import assert_parity, compare_modules

VOCAB, WIDTH, TAGS, KERNEL = 40, 16, 5, 3
MISTAKES = {
    # a convolution padded on the left only (as in a causal model) instead of centred
    "conv_padding": "conv",
    # flax's nnx.LayerNorm defaults to epsilon=1e-6; torch's nn.LayerNorm to 1e-5
    "norm_eps": "norm",
}


class TorchTagger(torch.nn.Module):
    """The model as written in PyTorch: tag logits (B, T, TAGS) for token ids (B, T)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.conv = torch.nn.Conv1d(WIDTH, WIDTH, KERNEL, padding=KERNEL // 2)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, TAGS)

    def forward(self, ids):
        x = self.embed(ids)  # (B, T, C)
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)  # (B, C, T) -> conv -> (B, T, C)
        return self.head(self.norm(torch.nn.functional.gelu(x)))  # (B, T, TAGS)


class Tagger(nnx.Module):
    """The NNX port: the same attribute names, so a module path names the same layer in both.

    Flax convolves channels-last, so no transposes. torch's ``F.gelu`` is the exact (erf)
    GELU, flax's ``nnx.gelu`` defaults to the tanh approximation; torch's LayerNorm eps is
    1e-5, flax's 1e-6. ``mistake`` plants one of :data:`MISTAKES`.
    """

    def __init__(self, *, param_dtype=jnp.float32, mistake: str | None = None, rngs: nnx.Rngs):
        if mistake not in (None, *MISTAKES):
            raise ValueError(f"mistake must be None or one of {sorted(MISTAKES)}, got {mistake!r}")
        padding = ((KERNEL - 1, 0),) if mistake == "conv_padding" else ((KERNEL // 2, KERNEL // 2),)
        eps = 1e-6 if mistake == "norm_eps" else 1e-5
        self.embed = nnx.Embed(VOCAB, WIDTH, param_dtype=param_dtype, rngs=rngs)
        self.conv = nnx.Conv(WIDTH, WIDTH, (KERNEL,), padding=padding, param_dtype=param_dtype, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, epsilon=eps, param_dtype=param_dtype, rngs=rngs)
        self.head = nnx.Linear(WIDTH, TAGS, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, ids):
        x = self.conv(self.embed(ids))  # (B, T, C)
        return self.head(self.norm(nnx.gelu(x, approximate=False)))  # (B, T, TAGS)


def make_pair(dtype: str = "float32", mistake: str | None = None, seed: int = 0):
    """A random torch tagger in ``dtype`` (no parameter left at ones or zeros), its flax twin, and token ids."""
    torch.manual_seed(seed)
    torch_model = TorchTagger().to(getattr(torch, dtype))
    with torch.no_grad():  # LayerNorm starts at ones/zeros, which could hide a swapped scale and bias
        for p in torch_model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    with jax.enable_x64(dtype == "float64"):  # float64 parameters need x64 while they are created
        flax_model = Tagger(param_dtype=jnp.dtype(dtype), mistake=mistake, rngs=nnx.Rngs(seed))
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(4, 12))  # (B, T)
    return torch_model, flax_model, ids


def check(dtype: str = "float32", mistake: str | None = None):
    """The parity report of the port (weights copied from torch by the converter) in ``dtype``."""
    torch_model, flax_model, ids = make_pair(dtype, mistake)
    return compare_modules(torch_model, flax_model, ids, dtype=dtype)


def main() -> None:
    for dtype in ("float32", "float64"):
        torch_model, flax_model, ids = make_pair(dtype)
        assert_parity(torch_model, flax_model, ids, dtype=dtype)
        print(f"{dtype}: the port matches torch (outputs and every parameter gradient)")
    print("\nplanted mistake: the flax conv padded on the left only\n")
    print(check("float32", mistake="conv_padding"))


if __name__ == "__main__":
    main()
