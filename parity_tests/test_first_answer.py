"""What keeps a failing comparison's localisation cheap, each part checked for what it must still do: the
fingerprint that pairs values in any layout (one pass, no sort), the nudged run (every value moves; the arrays keep
their placement, so the run reuses XLA's programs of the recorded run), the float32 run reusing the float64
check's constant arguments only for the same calls, and the loader keeping an array uncommitted."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from torch_weights import randomized

import flax_ln.parity.localize.locate as locate
from flax_ln.convert.assign import assign
from flax_ln.parity import compare_modules
from flax_ln.parity.records.pairing import fingerprint
from flax_ln.parity.records.replay import nudged
from flax_ln.parity.sides.nnx import NNXSide

WIDTH = 8


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16, np.int64, np.bool_])
def test_a_fingerprint_is_the_same_in_any_layout_and_differs_for_other_values(dtype):
    x = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(dtype)
    assert fingerprint(x) == fingerprint(x.transpose(2, 0, 1).copy()) == fingerprint(x.reshape(-1)[::-1].copy())
    if dtype in (np.int64, np.bool_):
        return
    changed = x.copy()  # one value up by an ulp, another down: a plain sum of the bit patterns would not see it
    changed.flat[0] = np.nextafter(changed.flat[0], dtype(np.inf))
    changed.flat[1] = np.nextafter(changed.flat[1], dtype(-np.inf))
    assert fingerprint(changed) != fingerprint(x)
    assert fingerprint(x.astype(np.float16)) != fingerprint(x.astype(np.float16).astype(np.float32))


def test_a_fingerprint_keeps_each_eight_byte_value_whole():
    words = np.array([1, 2, 3, 4], np.uint32)
    swapped = np.array([1, 4, 3, 2], np.uint32)  # the same 32-bit words, paired into other 64-bit values
    assert fingerprint(words.view(np.float64)) != fingerprint(swapped.view(np.float64))
    zeros = np.array([0.0, -0.0])
    assert fingerprint(zeros) == fingerprint(zeros[::-1].copy()) != fingerprint(np.zeros(2))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16, np.float16])
def test_the_nudge_moves_every_finite_value_and_keeps_dtype_and_placement(dtype):
    values = np.array([-1.0, 0.0, 2.0, -3.5, 1e-30, 65000.0], dtype)  # -1 is the fixed point of x * 1.016 + 0.016
    with jax.enable_x64(dtype == np.float64):
        leaves = (jnp.asarray(values), jax.device_put(values, jax.devices()[0]), values)  # uncommitted, committed
        for leaf in leaves:
            moved = nudged({"w": leaf, "ids": np.arange(3)})
            assert moved["w"].dtype == values.dtype and np.array_equal(moved["ids"], np.arange(3))
            assert not np.any(np.asarray(moved["w"]) == values), (leaf, moved["w"])
            assert type(moved["w"]) is type(leaf)
            if isinstance(leaf, jax.Array):
                assert moved["w"].committed == leaf.committed and moved["w"].sharding == leaf.sharding


def test_the_loader_keeps_an_uncommitted_array_uncommitted_and_a_committed_one_in_place():
    for value in (jnp.zeros(3), jax.device_put(np.zeros(3, np.float32), jax.devices()[0])):
        var = nnx.Param(value)
        assign(var, np.arange(3, dtype=np.float32))
        assert var.get_value().committed == value.committed
        assert np.array_equal(var.get_value(), np.arange(3))


# --- the float32 run takes the float64 check's constant arguments -------------------------------------------------


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.head = torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.fc(x))))


class Net(nnx.Module):
    def __init__(self, eps):
        rngs = nnx.Rngs(0)
        self.fc, self.head = nnx.Linear(WIDTH, WIDTH, rngs=rngs), nnx.Linear(WIDTH, 2, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, epsilon=eps, rngs=rngs)

    def __call__(self, x):
        return self.head(self.norm(jnp.tanh(self.fc(x))))


COMPILES = [0]  # XLA programs compiled in this process, counted by JAX's own monitoring event
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _count_compile(event: str, *_, **__) -> None:
    COMPILES[0] += event == BACKEND_COMPILE


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def _planted_default_call(monkeypatch, signature=None):
    """The default call (float64 check, then the float32 run) on a port with the norm's eps planted; the nudged runs
    counted, with the XLA programs each compiled. ``signature``: stands in for the calls' signature."""
    runs: list[int] = []
    record_nudged = NNXSide.record_nudged

    def counted(self, forward_of):
        before = COMPILES[0]
        try:
            return record_nudged(self, forward_of)
        finally:
            runs.append(COMPILES[0] - before)

    monkeypatch.setattr(NNXSide, "record_nudged", counted)
    if signature is not None:
        monkeypatch.setattr(locate, "call_signature", signature)
    x = np.random.default_rng(0).standard_normal((4, WIDTH)).astype(np.float32)
    report = compare_modules(randomized(TorchNet(), "float32"), Net(eps=0.1), (x,), quiet=True)
    return report, runs


def test_the_float32_run_reuses_the_float64_checks_constants_and_names_the_same_module(monkeypatch):
    report, runs = _planted_default_call(monkeypatch)
    assert not report.passed and not report.float64_check.passed
    for r in (report, report.float64_check):
        assert r.first_divergence.module == "norm" and r.isolation.culprits == ["norm"], str(r)
    assert runs == [0]  # one nudged run (the float64 check's), no XLA program compiled for it


def test_calls_that_differ_between_the_runs_get_their_own_nudged_run(monkeypatch):
    signature = iter(({"one": ()}, {"another": ()}))
    report, runs = _planted_default_call(monkeypatch, lambda calls: next(signature))
    assert len(runs) == 2
    assert report.isolation.culprits == report.float64_check.isolation.culprits == ["norm"], str(report)
