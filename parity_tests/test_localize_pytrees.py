"""Localisation when the activations between modules are pytrees of arrays with their own node class (as named-axis
arrays are): a class registered with ``jax.tree_util.register_pytree_node_class`` whose truth value raises, whose
``==`` is elementwise and whose ``shape`` is a dict of named axes. Records, pairing, the nudged run, replay and the
report open it like a container; a planted bug is named on both sides with nothing else blamed, and every module
taking such arrays runs alone. An exception anywhere in localisation becomes a note, never an exception."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

eqx = pytest.importorskip("equinox", reason="equinox is an optional dependency (the test extra installs it)")

from torch_weights import randomized  # noqa: E402

from flax_ln.convert import KeyMap  # noqa: E402
from flax_ln.parity import compare_modules  # noqa: E402
from flax_ln.parity.localize import locate  # noqa: E402

WIDTH, SEQ, BATCH = 8, 4, 2


@jax.tree_util.register_pytree_node_class
class Named:
    """An array with named axes: one array leaf, the axis names in the tree's structure."""

    def __init__(self, array, axes):
        self.array, self.axes = array, axes

    def tree_flatten(self):
        return (self.array,), self.axes

    @classmethod
    def tree_unflatten(cls, axes, children):
        return cls(children[0], axes)

    @property
    def shape(self):  # named axes, as named-axis arrays give them: no tuple to compare with an array's shape
        return dict(zip(self.axes, self.array.shape))

    @property
    def dtype(self):
        return self.array.dtype

    def __eq__(self, other):  # elementwise, so that asking whether two of them are equal asks a truth value
        return Named(self.array == getattr(other, "array", other), self.axes)

    __hash__ = None

    def __bool__(self):
        raise ValueError("the truth value of a named array is ambiguous: reduce it first")


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class TorchModel(torch.nn.Module):
    """Two blocks; block 1's norm eps is planted (0.5), so only that norm differs from a faithful port."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.blocks = torch.nn.ModuleList(TorchBlock() for _ in range(2))
        randomized(self, "float32")
        self.blocks[1].norm.eps = 0.5

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Linear(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __init__(self, key):
        self.weight, self.bias = jax.random.normal(key, (WIDTH, WIDTH)), jnp.zeros(WIDTH)

    def __call__(self, x: Named) -> Named:
        return Named(x.array @ self.weight.T + self.bias, x.axes)


class Norm(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __init__(self):
        self.weight, self.bias = jnp.ones(WIDTH), jnp.zeros(WIDTH)

    def __call__(self, x: Named) -> Named:
        a = x.array
        mean = a.mean(-1, keepdims=True)
        var = ((a - mean) ** 2).mean(-1, keepdims=True)
        return Named((a - mean) / jnp.sqrt(var + 1e-5) * self.weight + self.bias, x.axes)


class Block(eqx.Module):
    norm: Norm
    fc: Linear

    def __init__(self, key):
        self.norm, self.fc = Norm(), Linear(key)

    def __call__(self, x: Named) -> Named:
        return Named(x.array + jnp.tanh(self.fc(self.norm(x)).array), x.axes)


class Model(eqx.Module):
    """Its activations are :class:`Named` from the input projection to the head."""

    inp: Linear
    blocks: list
    head: Linear

    def __init__(self):
        keys = jax.random.split(jax.random.key(0), 4)
        self.inp, self.head = Linear(keys[0]), Linear(keys[1])
        self.blocks = [Block(keys[2]), Block(keys[3])]

    def __call__(self, x):
        h = self.inp(Named(x, ("batch", "position", "embed")))
        for block in self.blocks:
            h = block(h)
        return self.head(h).array


MAP = KeyMap([(r"(.*)\.(weight|bias)", r"\1.\2", None)])


def _compare(**options):
    x = np.random.default_rng(0).standard_normal((BATCH, SEQ, WIDTH)).astype("float32")
    return compare_modules(TorchModel(), Model(), (x,), weights=MAP, **options)


@functools.cache
def _default_report():
    return _compare()  # float32, and the float64 check


@pytest.mark.parametrize("check", ["float32", "float64 check"])
def test_named_array_activations_are_localised_on_both_sides(check):
    report = _default_report() if check == "float32" else _default_report().float64_check
    assert not report.passed and report.localization_note is None, report.localization_note
    fd = report.first_divergence
    assert fd is not None and (fd.module, fd.flax_module) == ("blocks.1.norm", "blocks.1.norm"), str(report)
    assert report.isolation.culprits == ["blocks.1.norm"], str(report)
    assert report.isolation.flax_culprits == ["blocks.1.norm"], str(report)
    ran = {r.name for r in report.isolation.results}
    assert {"inp", "blocks.0", "blocks.0.norm", "blocks.1", "blocks.1.fc", "head"} <= ran, str(report)
    assert report.isolation.skipped == {}, str(report)
    assert "blocks.1.norm <-> blocks.1.norm" in str(report)


def test_an_exception_inside_localisation_is_a_note_not_an_exception(monkeypatch):
    """A step of localisation raises (here the telling of activations from constants, as a truth value asked of
    a named array did): the report keeps the verdict and every result, and its note says what failed."""

    def broken(*args, **kwargs):
        raise ValueError("the truth value of a named array is ambiguous: reduce it first")

    monkeypatch.setattr(locate, "constant_arguments", broken)
    report = _compare(dtype="float32")
    assert not report.passed and not report["output"].passed
    assert "ValueError: the truth value of a named array is ambiguous" in report.localization_note
    assert "the verdict and every tensor's result stand" in report.localization_note
    assert report.localization_note in str(report)
