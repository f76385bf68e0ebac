"""``--dtype bfloat16`` in examples/generate_gpt2.py and examples/train_music.py: float32 parameters, bf16 compute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_examples import load_example

from flax_ln.parity import TOLERANCES

pytestmark = pytest.mark.slow  # every test here starts a subprocess or runs an example

# bf16 compute against float32 keeps 8 significant bits (u = 2^-8); the parity policy's
# bfloat16 output bound (2e-2, ~5 u) applies. Measured on these models: 6.6e-3.
BF16_OUTPUT_RTOL = TOLERANCES["bfloat16"]["output"].rtol


def param_dtypes(model):
    return {np.dtype(p.dtype) for p in jax.tree.leaves(nnx.state(model, nnx.Param))}


def relative_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_generate_gpt2_bfloat16_computes_in_bf16_with_float32_parameters(capsys):
    script = load_example("generate_gpt2.py")
    f32, bf16 = (script.random_model(0, dtype=d) for d in (jnp.float32, jnp.bfloat16))
    assert param_dtypes(bf16) == {np.dtype(np.float32)}
    idx = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)))  # (B, T)
    logits16, logits32 = bf16(idx)[0], f32(idx)[0]
    assert logits16.dtype == jnp.bfloat16
    assert 0 < relative_error(logits16, logits32) <= BF16_OUTPUT_RTOL  # > 0: bf16 really was used
    rows = script.main(["--dtype", "bfloat16", "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--temperature", "0"])
    assert len(rows) == 1 and rows[0][:3] == [1, 2, 3] and len(rows[0]) == 7


def test_train_music_bfloat16_model_and_loss():
    script = load_example("train_music.py")
    args = script.parse_args(["--config", "tiny", "--dtype", "bfloat16"])
    config = script.CONFIGS["tiny"]
    f32, bf16 = (script.new_model(config, 0, dtype) for dtype in ("float32", args.dtype))
    assert param_dtypes(bf16) == {np.dtype(np.float32)}
    for model in (f32, bf16):
        model.eval()
    rng = np.random.default_rng(0)
    idx, targets = (jnp.asarray(rng.integers(0, 388, (2, 32))) for _ in range(2))  # (B, T)
    (logits16, loss16), (logits32, loss32) = bf16(idx, targets), f32(idx, targets)
    assert logits16.dtype == jnp.bfloat16 and loss16.dtype == jnp.float32
    assert 0 < relative_error(logits16, logits32) <= BF16_OUTPUT_RTOL
    assert relative_error(loss16, loss32) <= BF16_OUTPUT_RTOL
