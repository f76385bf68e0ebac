"""torch's ``nn.MultiheadAttention`` and a port with separate q, k and v projections, with the key map that splits
torch's fused ``in_proj`` across them: shared by the split-rule tests (not a test module: pytest collects test_*.py)."""

import jax
import jax.numpy as jnp
import torch
from flax import nnx

from flax_ln.convert import KeyMap

E, H = 16, 4

MHA_MAP = KeyMap(
    [
        (r"in_proj_weight", {"[0:16]": "q.kernel", "[16:32]": "k.kernel", "[32:48]": "v.kernel"}, "o i -> i o"),
        (r"in_proj_bias", {"[0:16]": "q.bias", "[16:32]": "k.bias", "[32:48]": "v.bias"}, None),
        (r"out_proj\.weight", "out.kernel", "o i -> i o"),
        (r"out_proj\.bias", "out.bias", None),
    ]
)
MHA_FORWARD = (lambda m, x: m(x, x, x, need_weights=False)[0], None)


class Attention(nnx.Module):
    """Multi-head self-attention with separate q, k and v projections (batch first). ``frozen_v``: v's
    parameters get no gradient (``stop_gradient``), the forward unchanged: a bug only v's gradients show."""

    def __init__(self, rngs: nnx.Rngs, frozen_v: bool = False, dtype=jnp.float32):
        self.q, self.k, self.v, self.out = (nnx.Linear(E, E, rngs=rngs, param_dtype=dtype) for _ in range(4))
        self.frozen_v = frozen_v

    def __call__(self, x):
        B, T, _ = x.shape
        v = self.v(x)
        if self.frozen_v:
            v = x @ jax.lax.stop_gradient(self.v.kernel[...]) + jax.lax.stop_gradient(self.v.bias[...])
        heads = lambda y: y.reshape(B, T, H, E // H).transpose(0, 2, 1, 3)  # noqa: E731  (B, H, T, d)
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(v)
        weights = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(E // H), axis=-1)  # (B, H, T, T)
        return self.out((weights @ v).transpose(0, 2, 1, 3).reshape(B, T, E))  # (B, T, E)


def torch_attention() -> torch.nn.MultiheadAttention:
    """torch's attention, seeded, with its biases drawn (torch starts them at zero: a wrong slab would go unseen)."""
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(E, H, batch_first=True)
    with torch.no_grad():
        module.in_proj_bias.normal_()
        module.out_proj.bias.normal_()
    return module
