"""Issue 71, items 3-7: float32 constants a float64 run meets, told by where they were made (a Keras model's, built
with the model; a Linen port's, made in ``setup`` on every apply); and the words of a report."""

import math

import jax
import numpy as np
import torch
from flax import linen

from flax_ln.convert import KeyMap
from flax_ln.parity import Linen, compare_modules

WIDTH = 12  # sqrt(12) is irrational: its float32 rounding shows in float64 (relative 1e-8, far above 1e-12)
LINEAR_MAP = KeyMap([(r"fc\.weight", "fc/kernel", "a b -> b a"), (r"fc\.bias", "fc/bias", None)])
LINEN_MAP = KeyMap([(r"fc\.weight", "fc.kernel", "a b -> b a"), (r"fc\.bias", "fc.bias", None)])


def _x():
    return (np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32),)


class TorchScaled(torch.nn.Module):
    """A linear layer whose output is scaled by sqrt(WIDTH), computed in the input's dtype (as Gemma scales)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, WIDTH)

    def forward(self, x):
        return self.fc(x) * math.sqrt(WIDTH)


def _keras_scaled(keras, dtype=None):
    """keras-hub's Gemma idiom: ``x * ops.cast(ops.sqrt(hidden_dim), x.dtype)``, computed when the functional model
    is built (a float32 constant, weakly typed, held by the model's multiply node)."""
    inputs = keras.Input((8,), dtype=dtype)
    h = keras.layers.Dense(WIDTH, name="fc", dtype=dtype)(inputs)
    scaled = h * keras.ops.cast(keras.ops.sqrt(WIDTH), h.dtype)
    return keras.Model(inputs, keras.layers.Identity(name="out", dtype=dtype)(scaled))  # named: not auto-numbered


def test_a_float32_constant_a_keras_model_built_is_listed_with_the_advice(keras):
    report = compare_modules(TorchScaled(), _keras_scaled(keras), _x(), weights=LINEAR_MAP)
    assert report.results and all(r.passed for r in report.results), report  # float32 cannot see it
    check = report.float64_check
    assert check is not None and not check.passed, report
    constants = [i for i in check.islands if i.side == "flax" and "float32 constant ()" in i.what]
    assert len(constants) == 1 and not constants[0].lifted, check.islands
    assert "built before the comparison" in constants[0].what and "flax_factory=" in constants[0].what
    assert "float32 constant () built before the comparison" in str(report)
    rebuilt = compare_modules(
        TorchScaled(),
        _keras_scaled(keras),
        _x(),
        weights=LINEAR_MAP,
        dtype="float64",
        flax_factory=lambda: _keras_scaled(keras),  # built under lifting: its sqrt computed in float64
    )
    assert rebuilt.passed, rebuilt
    assert not [i for i in rebuilt.islands if i.side == "flax" and not i.lifted], rebuilt.islands


class LinenTableInSetup(linen.Module):
    """transformers' FlaxLlama idiom: a NumPy float32 table made inside the call (FlaxLlama: in ``setup``, run on
    every apply)."""

    @linen.compact
    def __call__(self, x):
        table = np.sqrt(np.full(WIDTH, WIDTH, dtype=np.float32))  # NumPy float32, inside the call
        return linen.Dense(WIDTH, name="fc")(x) * table


def test_a_float32_table_the_port_makes_during_its_call_is_not_sent_to_a_factory():
    module = LinenTableInSetup()
    variables = module.init(jax.random.key(0), _x()[0])
    report = compare_modules(TorchScaled(), Linen(module, variables), _x(), weights=LINEN_MAP)
    assert report.results and all(r.passed for r in report.results), report
    check = report.float64_check
    assert check is not None and not check.passed, report
    constants = [i for i in check.islands if i.side == "flax" and f"float32 constant ({WIDTH},)" in i.what]
    assert len(constants) == 1 and not constants[0].lifted, check.islands
    what = constants[0].what
    assert "during its call" in what and "the port itself computes it in float32" in what, what
    assert "built before the comparison" not in what and "build the port under lifting" not in what, what
    assert "test_reliability_round7b.py:" in what, what  # where: the port's line that uses it
