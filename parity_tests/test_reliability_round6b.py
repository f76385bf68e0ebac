"""Reliability, sixth round (second half): Equinox leaves that are not arrays and ``inference`` flags, NNX modules
that advance their own state, two torch tensors split into one set of variables, loaders that fill with NaN,
isolation through an aliased ``__call__``, Equinox ports that mirror torch's names, shorter discovered key maps,
and the maintainer script's errors.

Tolerances are the engine's policy (docs/tolerances.md); no test here sets its own.
"""

import numpy as np
import pytest
import torch

eqx = pytest.importorskip("equinox", reason="equinox is an optional dependency (the test extra installs it)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from flax_ln.parity import KeyMap, compare_modules  # noqa: E402

WIDTH = 4


def _x() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((3, WIDTH)).astype(np.float32)


# ---- Equinox leaves that are not arrays, and inference flags


class TorchMLP(torch.nn.Module):
    """Two Linears around a ReLU, with a Dropout (off in eval mode, as the engine runs torch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(WIDTH, 8), torch.nn.Linear(8, WIDTH)])
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.layers[1](torch.relu(self.layers[0](x))))


class EquinoxMLP(eqx.Module):
    """``eqx.nn.MLP`` (its activation a leaf that is a function) beside a string field."""

    mlp: eqx.nn.MLP
    tag: str

    def __init__(self):
        self.mlp = eqx.nn.MLP(WIDTH, WIDTH, 8, 1, key=jax.random.PRNGKey(0))
        self.tag = "mlp"

    def __call__(self, x):  # x (B, WIDTH), one example at a time
        return jax.vmap(self.mlp)(x)


class EquinoxMLPWithDropout(EquinoxMLP):
    """And an ``eqx.nn.Dropout`` after it, called without a key (it needs one unless in inference mode)."""

    drop: eqx.nn.Dropout

    def __init__(self):
        super().__init__()
        self.drop = eqx.nn.Dropout(0.5)

    def __call__(self, x):
        return jax.vmap(lambda t: self.drop(self.mlp(t)))(x)


MLP_MAP = KeyMap([(r"layers\.(\d)\.(weight|bias)", r"mlp.layers.\1.\2", None)])


def test_an_equinox_port_with_a_function_leaf_and_a_string_field_passes_in_float64():
    port = EquinoxMLP()
    report = compare_modules(TorchMLP(), port, _x(), weights=MLP_MAP)
    assert report.float64_check is not None and report.float64_check.error is None, report.float64_check
    assert report.passed and report.float64_check.passed, report
    assert port.tag == "mlp" and port.mlp.activation is jax.nn.relu  # static leaves kept as they are


def test_an_equinox_dropout_runs_in_inference_mode_and_the_callers_module_keeps_its_flag():
    port = EquinoxMLPWithDropout()
    report = compare_modules(TorchMLP(), port, _x(), weights=MLP_MAP, dtype="float32")
    assert report.passed, report
    assert port.drop.inference is False
