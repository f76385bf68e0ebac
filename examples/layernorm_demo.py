"""Load a torch_ref LayerNorm's weights into flax_ln and compare outputs and gradients.

Run: python examples/layernorm_demo.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import flax_ln
import torch_ref
from flax_ln.parity import relative_error

jax.config.update("jax_default_matmul_precision", "highest")


def main() -> None:
    torch.manual_seed(0)
    torch_norm = torch_ref.LayerNorm(512)
    with torch.no_grad():
        torch_norm.a_2.normal_()
        torch_norm.b_2.normal_()
    flax_norm = flax_ln.load_torch_state_dict(flax_ln.LayerNorm(512), torch_norm.state_dict())

    x = np.random.default_rng(0).normal(size=(32, 512)).astype(np.float32)
    x_torch = torch.tensor(x, requires_grad=True)
    torch_norm(x_torch).pow(2).sum().backward()

    graphdef, params = nnx.split(flax_norm, nnx.Param)
    loss = jax.jit(lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x) ** 2))
    g_params, g_x = jax.grad(loss, argnums=(0, 1))(params, jnp.asarray(x))
    flax_grads = flax_ln.to_torch_state_dict(nnx.merge(graphdef, g_params))

    y_err = relative_error(flax_norm(jnp.asarray(x)), torch_norm(torch.tensor(x)).detach().numpy())
    print(f"{'tensor':<10} {'rel. error (float32)':>22}")
    print(f"{'output':<10} {y_err:>22.2e}")
    print(f"{'grad x':<10} {relative_error(g_x, x_torch.grad.numpy()):>22.2e}")
    for name, p in torch_norm.named_parameters():
        print(f"{'grad ' + name:<10} {relative_error(flax_grads[name], p.grad.numpy()):>22.2e}")


if __name__ == "__main__":
    main()
