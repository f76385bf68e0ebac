"""Keras 3 as a flax side (``flax_ln.parity.Keras``): a plain Keras model with BatchNormalization (moving statistics as
state), a nested layer that takes ``training``, a dropout and a dense layer applying its own activation (torch's
is apart), against its torch twin, through a key map in Keras paths:
float32 and float64, ``jvp``, a float64 rebuild, isolation of every sublayer, a planted eps named on both sides,
export; and the errors before torch runs (no key map, another backend, keras missing). Skipped without keras, except
under ``CI=true``, where a missing keras fails."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from flax_ln.convert import KeyMap, to_torch_state_dict
from flax_ln.parity import Keras, compare_modules

BN_NAMES = {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean", "running_var": "moving_variance"}
KEY_MAP = KeyMap(
    [
        (r"(fc1|head)\.weight", r"\1/kernel", "a b -> b a"),
        (r"(fc1|head)\.bias", r"\1/bias", None),
        (r"block\.fc\.weight", r"block/fc/kernel", "a b -> b a"),
        (r"block\.fc\.bias", r"block/fc/bias", None),
        *((rf"bn1\.{t}", f"bn1/{k}", None) for t, k in BN_NAMES.items()),
        *((rf"block\.bn\.{t}", f"block/bn/{k}", None) for t, k in BN_NAMES.items()),
        (r".*num_batches_tracked", None, None),
    ]
)


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16, eps=1e-3)

    def forward(self, x):
        return x + torch.relu(self.bn(self.fc(x)))


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn1 = torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16, eps=1e-3)
        self.drop, self.block, self.head = torch.nn.Dropout(0.1), TorchBlock(), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.block(self.drop(self.bn1(torch.tanh(self.fc1(x))))))


def torch_net():
    torch.manual_seed(0)
    net = TorchNet().eval()
    with torch.no_grad():  # moving statistics away from 0 and 1: a BatchNorm reading the wrong ones shows
        for bn in (net.bn1, net.block.bn):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.add_(0.3 * torch.randn_like(bn.weight))
    return net


def keras_net(keras, eps=1e-3, dtype=None):
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.fc = keras.layers.Dense(16, name="fc", dtype=self.dtype_policy)
            self.bn = keras.layers.BatchNormalization(epsilon=1e-3, name="bn", dtype=self.dtype_policy)

        def build(self, shape):
            self.fc.build(shape)
            self.bn.build(shape)

        def call(self, x, training=None):
            return x + keras.ops.relu(self.bn(self.fc(x), training=training))

    inputs = keras.Input((8,), dtype=dtype)
    h = keras.layers.Dense(16, activation="tanh", name="fc1", dtype=dtype)(inputs)  # torch's tanh is apart
    h = keras.layers.BatchNormalization(epsilon=eps, name="bn1", dtype=dtype)(h)
    h = keras.layers.Dropout(0.1, name="drop", dtype=dtype)(h)
    h = Block(name="block", dtype=dtype)(h)
    return keras.Model(inputs, keras.layers.Dense(4, name="head", dtype=dtype)(h), name="net")


X = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)


def test_batchnorm_model_passes_in_float32_and_float64_and_is_not_changed(keras):
    model = keras_net(keras)
    before = {v.path: np.array(v.value) for v in model.variables}
    report = compare_modules(torch_net(), model, (X,), weights=KEY_MAP)  # bare: taken as Keras(model)
    assert report.passed, report
    assert report.float64_check is not None and report.float64_check.passed, report
    worst = max(r.relative_error for r in report.float64_check.results)
    assert worst < 1e-12, report  # float64 rounding of a few dozen ops, no float32 left on either side
    casts = [i for i in report.float64_check.islands if i.side == "flax" and i.what == "asarray with dtype float32"]
    assert len(casts) == 1 and casts[0].lifted and casts[0].count > 1, report.float64_check.islands  # policy casts
    assert f"(lifted, {casts[0].count} times)" in str(report)  # listed once, with their count
    names = {r.name for r in report.results}
    assert "bn1.weight" in names and "bn1.running_mean" not in names  # moving statistics: state, no gradient
    assert {v.path: np.array(v.value) for v in model.variables}.keys() == before.keys()
    for v in model.variables:  # the caller's variables keep their values: the comparison filled copies
        np.testing.assert_array_equal(np.array(v.value), before[v.path])


def test_jvp_and_a_float64_rebuild(keras):
    report = compare_modules(torch_net(), Keras(keras_net(keras)), (X,), weights=KEY_MAP, mode="jvp", dtype="float32")
    assert report.passed, report
    assert any(r.name.startswith("tangent") for r in report.results)
    rebuilt = compare_modules(
        torch_net(),
        keras_net(keras),
        (X,),
        weights=KEY_MAP,
        dtype="float64",
        flax_factory=lambda: keras_net(keras, dtype="float64"),  # its layers compute in float64: no cast to lift
    )
    assert rebuilt.passed, rebuilt
    assert max(r.relative_error for r in rebuilt.results) < 1e-12, rebuilt  # float64 rounding


def test_a_float64_rebuild_of_another_model_is_refused(keras):
    # the factory must rebuild the model compared in float32: only dtypes (and auto-numbered names, seeds) may differ
    report = compare_modules(
        torch_net(), keras_net(keras), (X,), weights=KEY_MAP, flax_factory=lambda: keras_net(keras, eps=1e-2)
    )
    assert not report.passed and report.float64_check.error is not None
    assert "epsilon: 0.001 in the given model, 0.01 in the factory's" in report.float64_check.error


def test_isolation_runs_every_sublayer_alone(keras):
    report = compare_modules(
        torch_net(), keras_net(keras), (X,), weights=KEY_MAP, dtype="float32", capture_modules=True
    )
    assert report.passed, report
    pairs = {t: f for t, f in report.module_pairs.items() if f is not None}
    assert pairs == {
        "fc1": "fc1 (before its activation)",  # torch's fc1 is the projection alone
        "bn1": "bn1",
        "block": "block",
        "block.fc": "block/fc",
        "block.bn": "block/bn",
        "head": "head",
        "(whole model)": "(whole model)",
    }
    alone = {r.name for r in report.isolation.results}
    assert alone == set(pairs), report.isolation.skipped  # those taking training (bn1, block, block.bn) included
    assert set(report.isolation.skipped) == {"drop"}  # no parameters, so no pair: the reason is kept


def test_planted_eps_is_named_on_both_sides(keras):
    report = compare_modules(torch_net(), keras_net(keras, eps=0.1), (X,), weights=KEY_MAP, dtype="float32")
    assert not report.passed
    fd = report.first_divergence
    assert (fd.module, fd.flax_module) == ("bn1", "bn1"), report
    assert report.isolation.culprits == ["bn1"] and report.isolation.flax_culprits == ["bn1"], report
    assert "bn1" in report.to_html()


def test_export_through_the_key_map(keras):
    net, model = torch_net(), keras_net(keras)
    model.get_layer("bn1").moving_mean.assign(np.arange(16, dtype=np.float32))
    exported = to_torch_state_dict(Keras(model), weights=KEY_MAP)
    np.testing.assert_array_equal(exported["bn1.running_mean"], np.arange(16, dtype=np.float32))
    np.testing.assert_array_equal(exported["head.weight"], np.array(model.get_layer("head").kernel.value).T)
    assert set(exported) == {k for k in net.state_dict() if not k.endswith("num_batches_tracked")}


class Untouchable(torch.nn.Module):
    """A torch module whose run is an error: the flax side's checks must come first."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)

    def forward(self, x):
        raise AssertionError("torch ran before the flax side was checked")


def test_without_a_key_map_names_discovery(keras):
    with pytest.raises(TypeError, match=r"KeyMap\.discover\(loader, torch_module, kind='keras'\)"):
        compare_modules(Untouchable(), keras_net(keras), (X,))


def test_another_backend_is_refused_before_torch_runs(keras, monkeypatch):
    model = keras_net(keras)
    monkeypatch.setattr(keras.backend, "backend", lambda: "tensorflow")
    with pytest.raises(TypeError, match=r"'tensorflow' backend.*KERAS_BACKEND=jax"):
        compare_modules(Untouchable(), model, (X,), weights=KEY_MAP)


def test_keras_missing_is_refused_before_torch_runs(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras", None)  # `import keras` now raises ImportError
    with pytest.raises(ImportError, match=r"needs keras 3.*flax-ln\[keras\].*KERAS_BACKEND=jax"):
        compare_modules(Untouchable(), Keras(object()), (X,), weights=KEY_MAP)


def test_importing_flax_ln_does_not_import_keras():
    code = "import sys, flax_ln, flax_ln.parity, flax_ln.convert; sys.exit('keras' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
