"""Reliability, sixth round (second half): Equinox leaves that are not arrays and ``inference`` flags, NNX modules
that advance their own state, two torch tensors split into one set of variables, loaders that fill with NaN,
isolation through an aliased ``__call__``, Equinox ports that mirror torch's names, shorter discovered key maps,
and the maintainer script's errors.

Tolerances are the engine's policy (docs/tolerances.md); no test here sets its own.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

eqx = pytest.importorskip("equinox", reason="equinox is an optional dependency (the test extra installs it)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import linen, nnx  # noqa: E402

from flax_ln.convert import ConversionError, load_torch_state_dict  # noqa: E402
from flax_ln.parity import KeyMap, Linen, compare_modules  # noqa: E402

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


def test_the_float64_copy_keeps_a_batchnorms_axis_name():
    from flax_ln.parity.sides.flax import as_float64

    norm = eqx.nn.BatchNorm(WIDTH, "batch", mode="batch")
    with jax.enable_x64(True):
        wide = as_float64(norm)
    assert wide.axis_name == "batch" and wide.weight.dtype == jnp.float64 and norm.weight.dtype == jnp.float32


def test_an_equinox_dropout_runs_in_inference_mode_and_the_callers_module_keeps_its_flag():
    port = EquinoxMLPWithDropout()
    report = compare_modules(TorchMLP(), port, _x(), weights=MLP_MAP, dtype="float32")
    assert report.passed, report
    assert port.drop.inference is False


# ---- NNX modules that advance their own state


class TorchLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.lin(x)


class Calls(nnx.Variable):
    """A counter of calls: state, not a parameter."""


class CountingPort(nnx.Module):
    """Counts its calls and sums its inputs into a cache it was given; ``scale`` plants a bug."""

    def __init__(self, cache: nnx.Cache, scale: float = 1.0):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))
        self.calls = Calls(jnp.zeros((), jnp.int32))
        self.cache = cache
        self.scale = scale

    def __call__(self, x):
        self.calls[...] = self.calls[...] + 1
        self.cache[...] = self.cache[...] + x.sum()
        return self.lin(x) * self.scale


@pytest.mark.parametrize("mode", ["grad", "jvp"])
def test_an_nnx_port_that_counts_its_calls_and_fills_a_cache_it_holds_is_compared(mode):
    cache = nnx.Cache(jnp.zeros((), jnp.float32))
    port = CountingPort(cache)
    report = compare_modules(TorchLinear(), port, _x(), mode=mode)
    assert report.passed and report.float64_check is not None and report.float64_check.passed, report
    assert int(port.calls[...]) == 0 and float(cache[...]) == 0.0  # the caller's state is as it was


def test_an_nnx_port_that_counts_its_calls_is_localised_when_it_fails():
    cache = nnx.Cache(jnp.zeros((), jnp.float32))
    port = CountingPort(cache, scale=1.5)
    report = compare_modules(TorchLinear(), port, _x(), dtype="float32")
    assert not report.passed
    assert report.first_divergence is not None, report
    assert int(port.calls[...]) == 0 and float(cache[...]) == 0.0


class CachePassedIn(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))

    def __call__(self, x, cache):
        cache[...] = cache[...] + 1
        return self.lin(x)


def test_a_cache_made_outside_and_passed_in_by_the_forward_is_a_clear_error():
    cache = nnx.Cache(jnp.zeros((), jnp.float32))
    named = r"CachePassedIn\.__call__ at the root changes an NNX variable made outside"
    with pytest.raises(TypeError, match=named) as info:
        compare_modules(TorchLinear(), CachePassedIn(), _x(), forward=(None, lambda m, x: m(x, cache)))
    assert "make it inside the forward" in str(info.value)
    assert float(cache[...]) == 0.0


# ---- two distinct torch tensors split into one set of variables


class TwoFusedTensors(torch.nn.Module):
    """Two fused (2 WIDTH, WIDTH) weights of equal value, each cut in two by the port's key map."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(2 * WIDTH, WIDTH))
        self.b = torch.nn.Parameter(self.a.detach().clone())

    def forward(self, x):
        return x @ self.a.T + (2 * x) @ self.b.T


class OneSetOfHalves(nnx.Module):
    """Holds one pair of halves for both torch tensors: another model once training moves a and b apart."""

    def __init__(self):
        self.top = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=nnx.Rngs(0))
        self.bot = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return jnp.concatenate([self.top(x) + self.top(2 * x), self.bot(x) + self.bot(2 * x)], -1)


HALVES_MAP = KeyMap([(r"a|b", {f"[0:{WIDTH}]": "top.kernel", f"[{WIDTH}:{2 * WIDTH}]": "bot.kernel"}, "o i -> i o")])


@pytest.mark.parametrize("mode", ["grad", "jvp"])
def test_two_torch_tensors_split_into_one_set_of_variables_fail_naming_both_keys(mode):
    report = compare_modules(TwoFusedTensors(), OneSetOfHalves(), _x(), weights=HALVES_MAP, mode=mode, dtype="float32")
    assert not report.passed
    failed = [r for r in report.results if not r.passed]
    assert [r.name for r in failed] == ["b"], report
    assert "(a, b)" in failed[0].problem and "top.kernel, bot.kernel" in failed[0].problem
    assert set(report.shared) == {"a"} and report.shared["a"].torch_aliases == ("a", "b")
    if mode == "grad":  # each half's gradient is the sum of both torch tensors' halves, and agrees
        assert {f"a[0:{WIDTH}]", f"a[{WIDTH}:{2 * WIDTH}]"} <= {r.name for r in report.results if r.passed}


# ---- loaders that fill what they do not read with NaN


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(WIDTH, WIDTH)
        self.b = torch.nn.Linear(WIDTH, WIDTH)


class TwoLinearsPort(nnx.Module):
    def __init__(self):
        self.first = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))
        self.second = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))


def _nan_filling_loader(state):
    """As bonsai's SAM2 loader: every variable filled with NaN first, then those its table has a key for; the
    table lacks ``b.bias``, and ``first.bias`` is read in its first half only."""
    graph, params = nnx.split(TwoLinearsPort())
    params = jax.tree.map(lambda v: jnp.full_like(v, jnp.nan), params)
    params["first"]["kernel"].set_value(jnp.asarray(state["a.weight"]).T)
    params["first"]["bias"].set_value(params["first"]["bias"][...].at[: WIDTH // 2].set(state["a.bias"][: WIDTH // 2]))
    params["second"]["kernel"].set_value(jnp.asarray(state["b.weight"]).T)
    return nnx.merge(graph, params)


def _whole_first_bias(state):
    port = _nan_filling_loader(state)
    port.first.bias[...] = jnp.asarray(state["a.bias"])
    return port


def test_a_variable_a_loader_fills_with_nan_is_never_filled_and_admitted():
    with pytest.raises(ConversionError) as info:
        KeyMap.discover(_whole_first_bias, TwoLinears(), allow_dropped=[r"b\.bias"])
    said = r"second.bias': never filled: the loader filled it with NaN; admit it with allow_unfilled=['second\\.bias']"
    assert said in str(info.value)
    assert "not a gather" not in str(info.value)
    key_map = KeyMap.discover(
        _whole_first_bias, TwoLinears(), allow_dropped=[r"b\.bias"], allow_unfilled=[r"second\.bias"]
    )
    assert key_map.discovery.unfilled == {"second.bias": "never filled: the loader filled it with NaN"}
    assert len(key_map.rules) == 4, key_map.to_source()  # three gathers and the dropped key
    again = eval(key_map.to_source(), {"KeyMap": KeyMap, "np": np})  # the printed source is Python
    assert np.isnan(again.constants[r"second\.bias"]) and np.isnan(key_map.constants[r"second\.bias"])


def test_a_variable_a_loader_fills_partly_with_nan_is_partly_filled():
    with pytest.raises(ConversionError, match=r"first\.bias.*partly filled") as info:
        KeyMap.discover(_nan_filling_loader, TwoLinears(), allow_dropped=[r"b\.bias"], allow_unfilled=[r"second\.bias"])
    assert "not a gather" not in str(info.value)


# ---- isolation through an aliased __call__


class LinearNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, x):
        return self.norm(self.lin(x))


def _normalise(x, scale, bias, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * scale + bias


def _norm_call(self, x):
    return _normalise(x, self.scale[...], self.bias[...], self.eps)


class AliasedNorm(nnx.Module):
    """A norm whose ``__call__`` is a function defined outside the class, under another name."""

    def __init__(self, eps):
        self.scale, self.bias, self.eps = nnx.Param(jnp.ones(WIDTH)), nnx.Param(jnp.zeros(WIDTH)), eps

    __call__ = _norm_call


class LinearAliasedNorm(nnx.Module):
    def __init__(self, eps):
        self.proj = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))
        self.ln = AliasedNorm(eps)

    def __call__(self, x):
        return self.ln(self.proj(x))


NORM_MAP = KeyMap(
    [
        (r"lin\.weight", "proj.kernel", "o i -> i o"),
        (r"lin\.bias", "proj.bias", None),
        (r"norm\.weight", "ln.scale", None),
        (r"norm\.bias", "ln.bias", None),
    ]
)


def test_isolation_calls_an_nnx_module_through_its_aliased_call():
    report = compare_modules(LinearNorm(), LinearAliasedNorm(eps=0.5), _x(), weights=NORM_MAP, dtype="float32")
    assert not report.passed and report.isolation is not None
    assert report.isolation.skipped == {}, report.isolation.skipped
    assert report.isolation.culprits == ["norm"] and report.isolation.flax_culprits == ["ln"]


def _linen_norm_call(self, x):
    scale = self.param("scale", linen.initializers.ones, (WIDTH,))
    bias = self.param("bias", linen.initializers.zeros, (WIDTH,))
    return _normalise(x, scale, bias, self.eps)


class LinenAliasedNorm(linen.Module):
    eps: float

    def stats(self, x):  # another method, called first
        return x.mean(-1)

    __call__ = linen.compact(_linen_norm_call)


class LinenLinearAliasedNorm(linen.Module):
    eps: float

    @linen.compact
    def __call__(self, x):
        h = linen.Dense(WIDTH, name="proj")(x)
        norm = LinenAliasedNorm(self.eps, name="ln")
        mean = norm.stats(h)  # (B,), unused: the norm's other method, called before its __call__
        return norm(h) + 0 * mean[..., None]


def test_linen_records_and_isolates_an_aliased_call_as_the_modules_call():
    from flax_ln.parity.sides.linen import capture_linen

    port = LinenLinearAliasedNorm(eps=0.5)
    variables = port.init(jax.random.PRNGKey(0), _x())
    calls = {}
    capture_linen(lambda: port.apply(variables, _x()), calls=calls)
    assert calls["ln"].method == "__call__" and calls["ln.stats"].method == "stats", calls.keys()
    report = compare_modules(LinearNorm(), Linen(port, variables), _x(), weights=NORM_MAP, dtype="float32")
    assert report.isolation is not None and report.isolation.skipped == {}, report.isolation
    assert report.isolation.culprits == ["norm"] and report.isolation.flax_culprits == ["ln"]


# ---- Equinox ports whose names mirror torch's


class TorchConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.norm = torch.nn.LayerNorm(3)
        self.head = torch.nn.Linear(3, 2)
        with torch.no_grad():  # a LayerNorm starts at 1 and 0: a wrong eps or a swapped pair would hide
            self.norm.weight.add_(0.3 * torch.randn(3))
            self.norm.bias.add_(0.3 * torch.randn(3))

    def forward(self, x):  # x (B, 2, H, W)
        return self.head(self.norm(self.conv(x).mean((2, 3))))


class EquinoxConvNet(eqx.Module):
    """torch's attribute names; eqx.nn.Conv2d's bias is (3, 1, 1) where torch's is (3,)."""

    conv: eqx.nn.Conv2d
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, eps=1e-5):
        k = jax.random.split(jax.random.PRNGKey(0), 2)
        self.conv = eqx.nn.Conv2d(2, 3, 3, padding=1, key=k[0])
        self.norm = eqx.nn.LayerNorm(3, eps=eps)
        self.head = eqx.nn.Linear(3, 2, key=k[1])

    def __call__(self, x):  # x (B, 2, H, W), one image at a time
        return jax.vmap(lambda image: self.head(self.norm(self.conv(image).mean((1, 2)))))(x)


def _images() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((2, 2, 5, 5)).astype(np.float32)


def test_an_equinox_port_that_mirrors_torchs_names_is_compared_without_weights():
    report = compare_modules(TorchConvNet(), EquinoxConvNet(), _images())
    assert report.passed and report.float64_check is not None and report.float64_check.passed, report
    assert "conv.bias" in {r.name for r in report.results}


def test_a_mirrored_equinox_port_with_a_planted_eps_is_localised():
    report = compare_modules(TorchConvNet(), EquinoxConvNet(eps=0.5), _images(), dtype="float32")
    assert not report.passed and report.first_divergence is not None
    assert report.first_divergence.module == "norm" and report.first_divergence.flax_module == "norm"


def test_an_equinox_port_that_does_not_mirror_names_the_first_key_and_discovery():
    named = r"torch's 'layers\.0\.weight' \(8, 4\): the Equinox module has no array"
    with pytest.raises(TypeError, match=named) as info:
        compare_modules(TorchMLP(), EquinoxMLP(), _x())
    assert "KeyMap.discover(loader, torch_module, kind='equinox')" in str(info.value)


# ---- shorter discovered key maps


class Bottleneck(torch.nn.Module):
    """torchvision's naming: conv1 (1x1), conv2 (3x3), conv3 (1x1), each with its BatchNorm bn1..bn3."""

    def __init__(self, width, downsample=False):
        super().__init__()
        for i, k in ((1, 1), (2, 3), (3, 1)):
            setattr(self, f"conv{i}", torch.nn.Conv2d(width, width, k, padding=k // 2, bias=False))
            setattr(self, f"bn{i}", torch.nn.BatchNorm2d(width))
        if downsample:  # a 1x1 conv and a BatchNorm, told apart by their index only
            conv = torch.nn.Conv2d(width, width, 1, bias=False)
            self.downsample = torch.nn.Sequential(conv, torch.nn.BatchNorm2d(width))


class SmallResNet(torch.nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, width, 3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(width)
        self.layer1 = torch.nn.Sequential(Bottleneck(width, downsample=True), Bottleneck(width))
        self.layer2 = torch.nn.Sequential(Bottleneck(width, downsample=True), Bottleneck(width))
        self.fc = torch.nn.Linear(width, 2)


class PortBlock(nnx.Module):
    def __init__(self, width, rngs, downsample=False):
        for i, k in ((1, 1), (2, 3), (3, 1)):
            setattr(self, f"conv{i}", nnx.Conv(width, width, (k, k), use_bias=False, rngs=rngs))
            setattr(self, f"norm{i}", nnx.BatchNorm(width, rngs=rngs))
        if downsample:
            self.down_conv = nnx.Conv(width, width, (1, 1), use_bias=False, rngs=rngs)
            self.down_norm = nnx.BatchNorm(width, rngs=rngs)


class PortStage(nnx.Module):
    def __init__(self, width, rngs):
        self.blocks = nnx.List([PortBlock(width, rngs, downsample=True), PortBlock(width, rngs)])


class PortStem(nnx.Module):
    def __init__(self, width, rngs):
        self.conv = nnx.Conv(3, width, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(width, rngs=rngs)


class SmallResNetPort(nnx.Module):
    def __init__(self, width=4):
        rngs = nnx.Rngs(0)
        self.stem, self.stage1, self.stage2 = PortStem(width, rngs), PortStage(width, rngs), PortStage(width, rngs)
        self.fc = nnx.Linear(width, 2, rngs=rngs)


_NORM_LEAVES = {"weight": "scale", "bias": "bias", "running_mean": "mean", "running_var": "var"}


def _resnet_loader(state):
    """A regex table as published loaders write one: kernels (O, I, kh, kw) -> (kh, kw, I, O) whatever their size,
    BatchNorm leaves renamed, ``num_batches_tracked`` skipped."""
    graph, state_of_port = nnx.split(nnx.eval_shape(SmallResNetPort))  # built abstract, as bonsai's loaders do
    table = [
        (r"conv1\.weight", "stem.conv.kernel"),
        (r"bn1\.(\w+)", "stem.bn.{0}"),
        (r"layer(\d)\.(\d)\.conv(\d)\.weight", r"stage\1.blocks.\2.conv\3.kernel"),
        (r"layer(\d)\.(\d)\.bn(\d)\.(\w+)", r"stage\1.blocks.\2.norm\3.{0}"),
        (r"layer(\d)\.(\d)\.downsample\.0\.weight", r"stage\1.blocks.\2.down_conv.kernel"),
        (r"layer(\d)\.(\d)\.downsample\.1\.(\w+)", r"stage\1.blocks.\2.down_norm.{0}"),
        (r"fc\.weight", "fc.kernel"),
        (r"fc\.bias", "fc.bias"),
    ]
    for key, value in state.items():
        for regex, template in table:
            found = re.fullmatch(regex, key)
            if found is None or key.endswith("num_batches_tracked"):
                continue
            path = found.expand(template).format(_NORM_LEAVES.get(key.rsplit(".", 1)[-1], ""))
            value = value.transpose(2, 3, 1, 0) if value.ndim == 4 else value.T if value.ndim == 2 else value
            node = state_of_port
            for step in path.split("."):
                node = node[int(step) if step.isdigit() else step]
            node.set_value(jnp.asarray(value))
    return nnx.merge(graph, state_of_port)


def test_to_source_folds_kernel_sizes_glued_numbers_and_drop_rules():
    key_map = KeyMap.discover(_resnet_loader, SmallResNet())
    source = key_map.to_source()
    # the stem's conv, its BatchNorm's four leaves, one rule for every block's conv (1x1 and 3x3), four for every
    # block's BatchNorm leaves, the downsample's conv and its BatchNorm's four, the head's two, and one drop rule
    # per family of num_batches_tracked (the stem's, the blocks', the downsamples')
    assert len(key_map.rules) == 20, source
    kernel = '"a b c d -> c d b a"'  # one layout for the 1x1 and 3x3 kernels
    assert rf'(r"layer(\d+)\.0\.downsample\.0\.weight", r"stage\1.blocks.0.down_conv.kernel", {kernel})' in source
    assert rf'(r"layer(\d+)\.(\d+)\.conv(\d+)\.weight", r"stage\1.blocks.\2.conv\3.kernel", {kernel})' in source
    assert r'(r"layer(\d+)\.(\d+)\.bn(\d+)\.num_batches_tracked", None, None)' in source
    assert "1 1" not in source
    state = {k: v.numpy() for k, v in SmallResNet().state_dict().items()}
    loaded, again = _resnet_loader(state), nnx.eval_shape(SmallResNetPort)
    load_torch_state_dict(again, state, weights=eval(source, {"KeyMap": KeyMap}))  # the printed map loads
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(loaded)), nnx.to_flat_state(nnx.state(again))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


# ---- the maintainer script's errors

GOOD_PYPROJECT = """\
[project]
name = "x"
dependencies = ["numpy>=2.0"]

[project.optional-dependencies]
torch = ["torch>=2.5"]
test = ["pytest>=8.0"]
"""


def _refresh_lower(tmp_path, pyproject: str, *flags: str):
    """Run a copy of constraints/refresh_lower.py in a repository of its own (``tmp_path``) over ``pyproject``."""
    (tmp_path / "constraints").mkdir(exist_ok=True)
    script = Path(__file__).resolve().parent.parent / "constraints" / "refresh_lower.py"
    shutil.copy(script, tmp_path / "constraints" / "refresh_lower.py")
    (tmp_path / "pyproject.toml").write_text(pyproject)
    out = tmp_path / "constraints" / "lower-bounds.txt"
    out.write_text("as it was\n")
    done = subprocess.run(
        [sys.executable, str(tmp_path / "constraints" / "refresh_lower.py"), *flags], capture_output=True, text=True
    )
    return done, out.read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    "pyproject, words",
    [
        ("[project\nname = 'x'\n", "is not valid TOML"),
        (GOOD_PYPROJECT.replace('test = ["pytest>=8.0"]\n', ""), "[project.optional-dependencies] [test] is missing"),
        ("[tool.x]\nname = 'x'\n", "has no [project] table"),
        (GOOD_PYPROJECT.replace('["numpy>=2.0"]', '"numpy>=2.0"'), "[project] dependencies is a str"),
    ],
    ids=["bad-toml", "missing-extra", "no-project", "dependencies-not-a-list"],
)
@pytest.mark.parametrize("flags", [(), ("--check",)])
def test_refresh_lower_names_a_malformed_pyproject_in_one_line(tmp_path, pyproject, words, flags):
    done, written = _refresh_lower(tmp_path, pyproject, *flags)
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert words in done.stderr and "pyproject.toml" in done.stderr
    assert written == "as it was\n"


@pytest.mark.slow
def test_refresh_lower_refuses_a_misspelt_flag_and_writes_nothing(tmp_path):
    done, written = _refresh_lower(tmp_path, GOOD_PYPROJECT, "--chek")
    assert done.returncode == 2 and "unrecognized arguments: --chek" in done.stderr, done
    assert written == "as it was\n"
    done, written = _refresh_lower(tmp_path, GOOD_PYPROJECT, "--check")  # the good file: stale, said so
    assert done.returncode == 1 and "is stale" in done.stderr and written == "as it was\n"
    done, written = _refresh_lower(tmp_path, GOOD_PYPROJECT)
    assert done.returncode == 0 and written.endswith("numpy==2.0\npytest==8.0\ntorch==2.5\n"), written
