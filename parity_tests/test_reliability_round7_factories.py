"""Reliability, seventh round: a factory vouches only for the caller's model. What the structure check must see (a
Keras functional model's operations, private sublayers and settings of Keras layers, a torch setting ``None`` in the
factory's model), what it must not (Keras's automatic numbering, its build wrappers, a cache a call fills), and the
float64 check's own rebuild of a transformers model, which must keep the caller's structure or say why not.

Each false PASS is set up the same way: the caller's port differs from torch by less than float32's tolerance (the
float32 results pass), and the factory builds the right model; the float64 check must refuse the factory.
Tolerances are the engine's policy (docs/tolerances.md); no test here sets its own.
"""

import functools

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from flax_ln.parity import Function, KeyMap, compare_modules
from flax_ln.parity.core.structure import model_difference

WIDTH = 8
RMS_EPS = 1e-6


def _x(scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((3, WIDTH)) * scale).astype(np.float32)


# ---- Keras: a functional model with a private sublayer and a private setting, between two auto-named layers


class TorchNet(torch.nn.Module):
    """fc1 -> exact GELU -> fc -> exact GELU -> RMS scaling with eps 1e-6 -> head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc, self.head = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))
        with torch.no_grad():  # small activations (with _x(1e-2)): tanh and erf GELU agree to float32's tolerance
            self.fc1.bias.mul_(1e-2)
            self.fc.bias.mul_(1e-2)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc(torch.nn.functional.gelu(self.fc1(x))))
        return self.head(h / torch.sqrt((h * h).mean(-1, keepdim=True) + RMS_EPS))


def keras_net(keras, *, approximate=False, inner=None, eps=RMS_EPS, dtype=None, named=False):
    """The Keras twin: auto-named Dense layers, ``keras.activations.gelu`` applied between layers (an operation of
    the functional model), and a layer holding its sublayer and its eps privately, as keras-hub's layers do.
    ``named``: every layer named, so that its paths are the same in every build."""

    def name(n):
        return {"name": n} if named else {}

    class Block(keras.layers.Layer):
        def __init__(self, activation, eps, **kwargs):
            super().__init__(**kwargs)
            self._fc = keras.layers.Dense(WIDTH, activation=activation, dtype=self.dtype_policy, **name("fc"))
            self._eps = eps

        def build(self, shape):
            self._fc.build(shape)

        def call(self, x):
            h = self._fc(x)
            return h / keras.ops.sqrt(keras.ops.mean(h * h, axis=-1, keepdims=True) + self._eps)

    inputs = keras.Input((WIDTH,), dtype=dtype)
    h = keras.layers.Dense(WIDTH, dtype=dtype, **name("fc1"))(inputs)
    h = keras.activations.gelu(h, approximate=approximate)
    h = Block(inner or keras.activations.gelu, eps, dtype=dtype, **name("block"))(h)
    return keras.Model(inputs, keras.layers.Dense(WIDTH, dtype=dtype, **name("head"))(h))


def key_map(model) -> KeyMap:
    """torch's names -> the model's own Keras paths (auto-numbered: they depend on what was built before)."""
    fc1, block, head = (layer for layer in model.layers if layer.variables)
    rules = []
    for torch_name, layer in (("fc1", fc1), ("fc", block._fc), ("head", head)):
        rules += [
            (rf"{torch_name}\.weight", layer.kernel.path, "o i -> i o"),
            (rf"{torch_name}\.bias", layer.bias.path, None),
        ]
    return KeyMap(rules)


def _refused_with(keras, port, inputs, *words):
    """The port compared with a factory building the right model (every layer named, as in ``port``): refused."""
    factory = functools.partial(keras_net, keras, dtype="float64", named=True)
    report = compare_modules(TorchNet(), port, inputs, weights=key_map(port), flax_factory=factory)
    assert all(r.passed for r in report.results), str(report)  # float32 cannot see the planted difference
    assert not report.passed, str(report)
    error = report.float64_check.error
    assert error is not None and "flax_factory" in error, str(report)
    for word in words:
        assert word in error, error


def test_a_keras_factory_rebuilding_the_model_with_auto_named_layers_passes_in_float64(keras):
    model = keras_net(keras)
    report = compare_modules(
        TorchNet(), model, (_x(),), weights=key_map(model), flax_factory=lambda: keras_net(keras, dtype="float64")
    )
    assert report.passed, str(report)
    assert report.float64_check.error is None and report.float64_check.passed, str(report)


def test_a_keras_factory_must_rebuild_the_functional_models_operations(keras):
    port = keras_net(keras, approximate=True, named=True)  # the tanh GELU between two layers: torch's is exact
    _refused_with(keras, port, (_x(1e-2),), "Gelu", "approximate")


def test_a_keras_factory_must_rebuild_a_sublayer_held_privately(keras):
    tanh = functools.partial(keras.activations.gelu, approximate=True)
    port = keras_net(keras, inner=tanh, named=True)  # the private sublayer _fc applies the tanh GELU
    _refused_with(keras, port, (_x(1e-2),), "_fc.activation")


def test_a_keras_factory_must_rebuild_a_setting_held_privately(keras):
    port = keras_net(keras, eps=1.001e-6, named=True)  # moves the output by about 5e-7 relative
    _refused_with(keras, port, (_x(),), "_eps: 1.001e-06 in the given model, 1e-06 in the factory's")


def test_a_functional_subclass_built_before_and_after_keras_makes_it_functional_is_one_model(keras):
    """keras-hub's backbones subclass keras.Model and call the functional constructor: Keras makes the class
    functional on its first instance, so the first instance's build wrapper wraps Layer.build and later ones wrap
    Functional.build. Keras's own wrappers are not configuration."""

    class Net(keras.Model):
        def __init__(self, **kwargs):
            inputs = keras.Input((WIDTH,))
            super().__init__(inputs, keras.layers.Dense(WIDTH, name="head")(inputs), **kwargs)

    first, second = Net(), Net(dtype="float64")
    assert model_difference(first, second) is None
    assert model_difference(second, first) is None


# ---- torch: a setting None in the factory's model ("None means the default"), a cache a call fills


class TorchScaled(torch.nn.Module):
    """A linear layer, then RMS scaling with ``_eps`` (``None``: the default, 1e-6); caches ``cached_width`` on its
    first call, as modules cache a table's length (a public attribute: a cache is told by having been filled)."""

    def __init__(self, eps=None):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self._eps = eps
        self.cached_width = None

    def forward(self, x):
        if self.cached_width is None:
            self.cached_width = x.shape[-1]
        h = self.lin(x)
        eps = RMS_EPS if self._eps is None else self._eps
        return h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)


def flax_scaled():
    class Scaled(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))

        def __call__(self, x):
            h = self.lin(x)
            return h / jnp.sqrt((h * h).mean(-1, keepdims=True) + RMS_EPS)

    return Scaled()


SCALED_MAP = KeyMap([(r"lin\.weight", "lin.kernel", "o i -> i o"), (r"lin\.bias", "lin.bias", None)])


def test_a_torch_factory_leaving_a_private_setting_none_does_not_vouch_for_a_set_one():
    given = TorchScaled(eps=1.001e-6)  # the port computes with 1e-6: about 5e-7 relative apart
    report = compare_modules(given, flax_scaled(), _x(), weights=SCALED_MAP, torch_factory=TorchScaled)
    assert all(r.passed for r in report.results), str(report)
    assert not report.passed, str(report)
    error = report.float64_check.error
    assert error is not None and "torch_factory" in error and "_eps: 1.001e-06 in the given model, None" in error, error


def test_a_cache_the_factorys_model_fills_in_its_call_is_not_configuration():
    given = TorchScaled()  # never called: its cache is None, the factory's model fills its own in the float64 run
    report = compare_modules(given, flax_scaled(), _x(), weights=SCALED_MAP, torch_factory=TorchScaled)
    assert report.passed and report.float64_check.error is None, str(report)
    assert given.cached_width == WIDTH  # filled by the float32 run
    fresh = TorchScaled()  # called once: its cache is filled, the fresh build's is None until its own call
    fresh(torch.from_numpy(_x()))
    report = compare_modules(fresh, flax_scaled(), _x(), weights=SCALED_MAP, torch_factory=TorchScaled)
    assert report.passed and report.float64_check.error is None, str(report)


# ---- the float64 check's own rebuild of a transformers model


def test_the_float64_rebuild_of_a_transformers_model_keeps_its_constructor_arguments_or_says_why():
    config = transformers.BertConfig(
        vocab_size=32,
        hidden_size=WIDTH,
        intermediate_size=16,
        num_hidden_layers=0,  # the embeddings alone: a port of a few lines
        num_attention_heads=2,
        max_position_embeddings=16,
        type_vocab_size=1,
    )
    torch.manual_seed(0)
    bert = transformers.BertModel(config, add_pooling_layer=False).eval()  # no pooler: the config does not say

    def apply(p, ids):
        h = p["word"][ids] + p["pos"][: ids.shape[-1]] + p["type"][0]
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        return (h - mean) / jnp.sqrt(var + config.layer_norm_eps) * p["scale"] + p["bias"]

    shapes = {"word": (32, WIDTH), "pos": (16, WIDTH), "type": (1, WIDTH), "scale": (WIDTH,), "bias": (WIDTH,)}
    port = Function(apply, {k: jnp.zeros(s) for k, s in shapes.items()})
    names = {"word": "word_embeddings", "pos": "position_embeddings", "type": "token_type_embeddings"}
    rules = [(rf"embeddings\.{torch_name}\.weight", k, None) for k, torch_name in names.items()]
    rules += [(r"embeddings\.LayerNorm\.weight", "scale", None), (r"embeddings\.LayerNorm\.bias", "bias", None)]
    weights = KeyMap(rules)
    ids = np.random.default_rng(0).integers(1, 32, (2, 5))  # not the padding id 0, whose row torch never updates
    forward = (lambda m, i: m(input_ids=i).last_hidden_state, None)
    report = compare_modules(bert, port, (ids,), weights=weights, forward=forward)
    assert report.passed, str(report)
    assert report.float64_check.error is None and report.float64_check.passed, str(report)
    said = [i.what for i in report.float64_check.islands if not i.lifted and "torch_factory=" in i.what]
    assert len(said) == 1 and "pooler" in said[0], report.float64_check.islands
    assert "torch_factory=" in str(report)
