"""Mixed precision for the encoder-decoder: bfloat16 compute, float32 parameters, against the float32 torch model.

(The GPT's twin is ``test_gpt.py::test_half_precision_compute_with_float32_params``; the norms'
float32 statistics on bfloat16 inputs are tested in ``test_layernorm.py``.)
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from test_encoder_decoder import D_FF, DROPOUT, SRC_V, TGT_V, B, D, H, N, T, full_model, model_inputs, perturb, to_jax

import flax_ln
from flax_ln.parity import TOLERANCES, Case, check_case
from torch_ref import encoder_decoder as te

# The engine's bfloat16 policy (u = 2^-8 ~ 3.9e-3): outputs 2e-2, the whole gradient as one
# vector 3e-2 (this test's own bound was 6e-2; measured 1.7e-2 to 2.5e-2), zero gradients
# by gtol 1e-3 (as before). One exception, kept from before the merge: single gradient
# tensors at 0.2, not the policy's 4e-2. That bound comes from the GPT, whose GELU damps
# rounding errors; the book's feed-forward has no activation, and the backward pass
# rounds twice as often, so single tensors reach 4.8e-2 here and 6.8e-2 over three seeds
# (the small ones worst: norm biases, sums over positions with cancellation); 0.2 is ~3x that.
POLICY = TOLERANCES["bfloat16"]
TOLERANCE = {**POLICY, "grad": dataclasses.replace(POLICY["grad"], rtol=0.2)}


def test_encoder_decoder_bfloat16_matches_float32_torch():
    """Log-probs and the gradient of ``sum(log_probs * cot)`` w.r.t. every parameter, in eval mode,
    under the engine's bfloat16 policy: each tensor, the whole gradient as one vector, and
    the zero-gradient rule for the key-projection biases."""
    torch.manual_seed(0)
    torch_model = perturb(te.make_model(SRC_V, TGT_V, N, D, D_FF, H, DROPOUT), 1)  # as test_encoder_decoder's
    half = flax_ln.make_model(SRC_V, TGT_V, N, D, D_FF, H, DROPOUT, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    inputs = model_inputs(np.random.default_rng(9))
    case = Case(
        "encoder-decoder bfloat16",
        torch_model,
        half,
        inputs,
        ["src", "tgt", "src_mask", "tgt_mask"],
        dtype="bfloat16",
        forward=full_model,
    )
    report = check_case(case, TOLERANCE)
    assert report.passed, str(report)
    assert {r.kind for r in report.results} == {"output", "param grad", "grads"}
    assert len([r for r in report.results if r.kind == "param grad"]) == len(list(torch_model.parameters()))

    half.eval()
    assert half.encoder.layers[0].self_attn.linears[0].kernel.dtype == jnp.float32  # float32 parameters
    graphdef, state = nnx.split(half)
    args = [to_jax(x) for x in inputs]
    hidden = jax.eval_shape(lambda s, *xs: nnx.merge(graphdef, s)(*xs), state, *args)
    assert hidden.dtype == jnp.bfloat16 and hidden.shape == (B, T, D)  # bfloat16 compute
    log_probs = jax.eval_shape(lambda s, *xs: full_model(nnx.merge(graphdef, s), *xs), state, *args)
    assert log_probs.dtype == jnp.float32 and log_probs.shape == (B, T, TGT_V)  # log-probs in float32
