"""Mixed precision for the encoder-decoder: bfloat16 compute, float32 parameters, against the float32 torch model.

(The GPT's twin is ``test_gpt.py::test_bfloat16_compute_with_float32_params``; the norms'
float32 statistics on bfloat16 inputs are tested in ``test_layernorm.py``.)
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from test_encoder_decoder import (
    D_FF,
    DROPOUT,
    SRC_V,
    TGT_V,
    ZERO_GRAD_SUFFIX,
    B,
    D,
    H,
    N,
    T,
    full_model,
    model_inputs,
    perturb,
    to_jax,
)

import flax_ln
from flax_ln.parity import relative_error
from torch_ref import encoder_decoder as te

# bfloat16 keeps 8 significant bits: unit roundoff u = 2^-8 ~ 3.9e-3 per rounding. With
# dtype=bfloat16 every projection, the feed-forward, the embeddings and the residual
# stream are rounded to bfloat16, while the norms' statistics, attention scores, softmax
# and the generator's log_softmax run in float32. Measured over three seeds: log-probs
# 4.2e-3 to 5.1e-3 (~1.3 u); all gradients as one vector 1.7e-2 to 2.1e-2 (~5 u: the
# backward pass rounds twice as often and the book's feed-forward has no activation to
# damp errors); single tensors up to 6.8e-2, the small ones (norm biases, whose gradient is
# a sum over positions with cancellation) worst. Bounds: ~3x the measured worst.
TOL = {"out": 2e-2, "grads": 6e-2, "grad": 0.2, "zero_grad": 1e-3}


def test_encoder_decoder_bfloat16_matches_float32_torch():
    """Log-probs and the gradient of ``sum(log_probs * cot)`` w.r.t. every parameter, in eval mode."""
    torch.manual_seed(0)
    torch_model = perturb(te.make_model(SRC_V, TGT_V, N, D, D_FF, H, DROPOUT), 1)  # as test_encoder_decoder's
    half = flax_ln.make_model(SRC_V, TGT_V, N, D, D_FF, H, DROPOUT, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    flax_ln.load_torch_state_dict(half, torch_model.state_dict())
    torch_model.eval()
    half.eval()
    inputs = model_inputs(np.random.default_rng(9))

    out_t = full_model(torch_model, *map(torch.as_tensor, inputs))
    cot = np.random.default_rng(0).normal(size=tuple(out_t.shape)).astype(np.float32)
    (out_t * torch.as_tensor(cot)).sum().backward()
    grads_t = {name: p.grad.numpy() for name, p in torch_model.named_parameters()}

    graphdef, params, rest = nnx.split(half, nnx.Param, ...)

    @jax.jit  # bfloat16 op by op is slow on the CPU
    def loss(params, *xs):
        out = full_model(nnx.merge(graphdef, params, rest), *xs)
        return jnp.sum(out * cot), out

    (_, out_f), g = jax.value_and_grad(loss, has_aux=True)(params, *map(to_jax, inputs))
    grads_f = {k: np.asarray(v) for k, v in flax_ln.to_torch_state_dict(nnx.merge(graphdef, g, rest)).items()
               if k in grads_t}
    assert grads_f.keys() == grads_t.keys()

    assert half.encoder.layers[0].self_attn.linears[0].kernel.dtype == jnp.float32  # float32 parameters
    hidden = jax.eval_shape(lambda p, *xs: nnx.merge(graphdef, p, rest)(*xs), params, *map(to_jax, inputs))
    assert hidden.dtype == jnp.bfloat16 and hidden.shape == (B, T, D)  # bfloat16 compute
    assert out_f.dtype == jnp.float32 and out_f.shape == tuple(out_t.shape)  # log-probs in float32
    assert relative_error(out_f, out_t.detach().numpy()) <= TOL["out"]

    scale = math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads_t.values()))
    checked = []
    for name, g in grads_f.items():
        assert g.dtype == np.float32 and g.shape == grads_t[name].shape, name
        if name.endswith(ZERO_GRAD_SUFFIX):  # exactly zero in exact arithmetic: noise against the global scale
            assert np.linalg.norm(g) <= TOL["zero_grad"] * scale, name
            continue
        assert relative_error(g, grads_t[name]) <= TOL["grad"], name
        checked.append(name)
    flat = [np.concatenate([grads[k].ravel() for k in checked]) for grads in (grads_f, grads_t)]
    assert relative_error(*flat) <= TOL["grads"]
