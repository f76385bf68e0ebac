"""Localisation of stacks scanned under rematerialisation, as large-model codebases write them: an Equinox stack of
three layers run by ``jax.lax.scan`` whose body is wrapped in ``eqx.filter_checkpoint``, and one whose body is a
``jax.checkpoint`` applied when it was defined. A bug planted in layer 1 is named as layer 1 on both sides, and
isolation replays each layer; where a checkpoint cannot be run eagerly, the stack is listed as not recorded.
One default call each: its float32 verdict and its float64 check."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen, nnx

eqx = pytest.importorskip("equinox", reason="equinox is an optional dependency (the test extra installs it)")

from torch_weights import randomized  # noqa: E402

from flax_ln.convert import KeyMap  # noqa: E402
from flax_ln.parity import Linen, compare_modules  # noqa: E402
from flax_ln.parity.islands import jax_remat  # noqa: E402

WIDTH, SEQ, BATCH, LAYERS = 8, 4, 2, 3


class TorchLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class TorchStack(torch.nn.Module):
    """Three layers; layer 1's norm eps is planted (0.5), so only layer 1 differs from a faithful port."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.layers = torch.nn.ModuleList(TorchLayer() for _ in range(LAYERS))
        randomized(self, "float32")
        self.layers[1].norm.eps = 0.5

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


STACKED = KeyMap(
    [
        (r"(inp|head)\.(weight|bias)", r"\1.\2", None),
        (r"layers\.(\d+)\.(norm|fc)\.(weight|bias)", r"layers.\2.\3[\1]", None),
    ]
)


class EqxLayer(eqx.Module):
    norm: eqx.nn.LayerNorm
    fc: eqx.nn.Linear

    def __init__(self, key):
        self.norm, self.fc = eqx.nn.LayerNorm(WIDTH), eqx.nn.Linear(WIDTH, WIDTH, key=key)

    def __call__(self, x):  # (T, E)
        return x + jnp.tanh(jax.vmap(self.fc)(jax.vmap(self.norm)(x)))


@jax.checkpoint  # applied once, when the module is imported: no later patch of jax.checkpoint reaches it
def _checkpointed_step(x, layer):
    return layer(x), None


class EqxStack(eqx.Module):
    """Its layers built by ``eqx.filter_vmap`` (arrays stacked on a leading layer axis), run by ``jax.lax.scan``
    with the body under ``eqx.filter_checkpoint`` (``remat="filter"``) or under the definition-time
    ``jax.checkpoint`` above (``remat="definition"``)."""

    inp: eqx.nn.Linear
    layers: EqxLayer
    head: eqx.nn.Linear
    remat: str = eqx.field(static=True)

    def __init__(self, remat):
        keys = jax.random.split(jax.random.key(0), LAYERS + 2)
        self.inp, self.head = (eqx.nn.Linear(WIDTH, WIDTH, key=k) for k in keys[:2])
        self.layers = eqx.filter_vmap(EqxLayer)(keys[2:])
        self.remat = remat

    def __call__(self, x):  # (T, E): one example
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        if self.remat == "filter":

            @eqx.filter_checkpoint
            def step(x, arrays):
                return eqx.combine(arrays, static)(x), None

        else:
            step = lambda x, arrays: _checkpointed_step(x, eqx.combine(arrays, static))  # noqa: E731
        x, _ = jax.lax.scan(step, jax.vmap(self.inp)(x), dynamic)
        return jax.vmap(self.head)(x)


def _per_example(model, x):
    return jax.vmap(model)(x)


@functools.cache
def _report(remat):
    x = np.random.default_rng(4).standard_normal((BATCH, SEQ, WIDTH)).astype("float32")
    return compare_modules(TorchStack(), EqxStack(remat), (x,), weights=STACKED, forward=(None, _per_example))


def _named_layer_one(report):
    assert not report.passed
    fd = report.first_divergence
    assert fd is not None and (fd.module, fd.flax_module) == ("layers.1.norm", "layers[1].norm"), str(report)
    assert report.isolation.culprits == ["layers.1.norm"], str(report)
    assert report.isolation.flax_culprits == ["layers[1].norm"], str(report)
    assert report.module_pairs["layers.1"] == "layers[1]", report.module_pairs
    ran = {r.name for r in report.isolation.results}
    assert {f"layers.{k}.{m}" for k in range(LAYERS) for m in ("norm", "fc")} <= ran, str(report)
    assert report.isolation.unrecorded == {}, str(report)


@pytest.mark.parametrize("remat", ["filter", "definition"])
@pytest.mark.parametrize("check", ["float32", "float64 check"])
def test_a_checkpointed_scan_is_localised_per_layer(remat, check):
    report = _report(remat)
    _named_layer_one(report if check == "float32" else report.float64_check)


def test_a_checkpoint_that_cannot_run_eagerly_lists_the_stack_as_not_recorded(monkeypatch):
    """Where this JAX's checkpoints cannot be run eagerly, the scan stays traced: the report says so, lists the
    stack as not recorded, and names no layer it did not see."""
    monkeypatch.setattr(jax_remat, "supported", lambda: False)
    x = np.random.default_rng(4).standard_normal((BATCH, SEQ, WIDTH)).astype("float32")
    report = compare_modules(
        TorchStack(), EqxStack("filter"), (x,), weights=STACKED, forward=(None, _per_example), dtype="float32"
    )
    assert not report.passed
    assert "layers" in report.isolation.unrecorded, str(report)
    assert "layers" in str(report) and "not recorded" in str(report), str(report)
    assert not any(c.startswith("layers[") for c in report.isolation.flax_culprits), str(report)


# --- regression: NNX's and Linen's own rematerialised scans were already named per layer -------------------------


class NnxLayer(nnx.Module):
    def __init__(self, key):
        rngs = nnx.Rngs(key)
        self.norm, self.fc = nnx.LayerNorm(WIDTH, epsilon=1e-5, rngs=rngs), nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.fc(self.norm(x)))


class NnxStack(nnx.Module):
    """Its layers stacked by ``nnx.vmap`` and run by ``nnx.scan`` over an ``nnx.remat`` body."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.inp, self.head = nnx.Linear(WIDTH, WIDTH, rngs=rngs), nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.layers = nnx.vmap(NnxLayer)(jax.random.split(jax.random.key(1), LAYERS))

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        @nnx.remat
        def step(layer, x):
            return layer(x)

        return self.head(step(self.layers, self.inp(x)))


class LinenLayer(linen.Module):
    @linen.compact
    def __call__(self, x, _):
        y = linen.Dense(WIDTH, name="fc")(linen.LayerNorm(epsilon=1e-5, name="norm")(x))
        return x + jnp.tanh(y), None


class LinenStack(linen.Module):
    """Its layers run by ``nn.scan(nn.remat(...))`` with their parameters stacked on a leading layer axis."""

    @linen.compact
    def __call__(self, x):
        x = linen.Dense(WIDTH, name="inp")(x)
        scanned = linen.scan(
            linen.remat(LinenLayer), variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
        )
        x, _ = scanned(name="layers")(x, None)
        return linen.Dense(WIDTH, name="head")(x)


FLAX_STACKED = KeyMap(
    [
        (r"(inp|head)\.weight", r"\1.kernel", "o i -> i o"),
        (r"(inp|head)\.bias", r"\1.bias", None),
        (r"layers\.(\d+)\.norm\.weight", r"layers.norm.scale[\1]", None),
        (r"layers\.(\d+)\.fc\.weight", r"layers.fc.kernel[\1]", "o i -> i o"),
        (r"layers\.(\d+)\.(norm|fc)\.bias", r"layers.\2.bias[\1]", None),
    ]
)


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_nnx_and_linen_scans_over_a_remat_body_stay_localised_per_layer(kind):
    x = np.random.default_rng(4).standard_normal((BATCH, SEQ, WIDTH)).astype("float32")
    if kind == "nnx":
        port = NnxStack()
    else:
        module = LinenStack()
        port = Linen(module, jax.eval_shape(module.init, jax.random.key(0), jnp.asarray(x)))
    report = compare_modules(TorchStack(), port, (x,), weights=FLAX_STACKED, dtype="float32")
    _named_layer_one(report)
