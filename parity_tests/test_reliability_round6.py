"""Reliability, sixth round: factories that must build the caller's model, a forged reference file, the caller's
torch module left as it was (tensors cached in plain attributes, a factory that returns the module itself),
dropped parameters judged by their float64 gradient, persistent buffers rebuilt in float64, float64's word on zero
gradients slab by slab, and the report's words.

Tolerances are the engine's policy (docs/tolerances.md); no test here sets its own.
"""

import copy
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file
from split_attention import MHA_FORWARD, MHA_MAP, Attention, E, torch_attention

from flax_ln.book.reference import DIGEST_KEY, METADATA_KEY, digest
from flax_ln.cli import main
from flax_ln.parity import Function, KeyMap, compare_modules

WIDTH = 8
LINEAR_RULES = [(r"lin\.weight", "lin.kernel", "o i -> i o"), (r"lin\.bias", "lin.bias", None)]
LINEAR_MAP = KeyMap(LINEAR_RULES)


def _x(shape=(3, WIDTH)) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


# ---- 2. a forged reference file: an extra state-dict key naming a tensor another key holds


def test_a_reference_with_an_extra_key_pointing_at_another_keys_tensor_is_refused_naming_it(tmp_path, capsys):
    path = tmp_path / "ln.safetensors"
    args = ["parity", "--model", "layernorm", "--seq-len", "4", "--batch", "1", "--quiet"]
    assert main([*args, "--save-reference", str(path)]) == 0
    with safe_open(str(path), framework="numpy") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    pairs = meta["models"][0]["side"]["state_dict"]["dict"]
    pairs.append(["forged.alias", copy.deepcopy(pairs[0][1])])  # the first key's tensor, under a second key
    text = json.dumps(meta)
    save_file(tensors, str(path), metadata={METADATA_KEY: text, DIGEST_KEY: digest(json.loads(text), tensors)})
    capsys.readouterr()
    try:
        code = main(["parity", "--reference", str(path), "--quiet"])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "forged.alias" in err and pairs[0][0] in err, err


# ---- 1. a factory must build the caller's model


class TorchGelu(torch.nn.Module):
    def __init__(self, approximate="none"):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.act = torch.nn.GELU(approximate=approximate)

    def forward(self, x):
        return self.act(self.lin(x))


class FlaxGelu(nnx.Module):
    def __init__(self, approximate: bool, rngs: nnx.Rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.approximate = approximate

    def __call__(self, x):
        return jax.nn.gelu(self.lin(x), approximate=self.approximate)


def _small_x() -> np.ndarray:
    """Inputs so small (with :func:`_small_bias`) that tanh GELU and erf GELU agree to float32's tolerance."""
    return _x() * np.float32(1e-2)


def _small_bias(model: TorchGelu) -> TorchGelu:
    with torch.no_grad():
        model.lin.bias.mul_(1e-2)
    return model


def test_a_flax_factory_building_another_port_does_not_vouch_for_the_callers():
    torch.manual_seed(0)
    tanh_port = FlaxGelu(approximate=True, rngs=nnx.Rngs(0))  # torch computes erf GELU: the port is wrong
    report = compare_modules(
        _small_bias(TorchGelu()),
        tanh_port,
        _small_x(),
        weights=LINEAR_MAP,
        flax_factory=lambda: FlaxGelu(False, nnx.Rngs(0)),
    )
    assert all(r.passed for r in report.results), str(report)  # float32 cannot see it: the float32 results stand
    assert not report.passed, str(report)
    error = report.float64_check.error
    assert error is not None and "flax_factory" in error and "approximate" in error, error


def test_a_torch_factory_building_another_model_does_not_vouch_for_the_port():
    torch.manual_seed(0)
    tanh_torch = _small_bias(TorchGelu(approximate="tanh"))  # the port computes erf GELU
    report = compare_modules(
        tanh_torch, FlaxGelu(False, nnx.Rngs(0)), _small_x(), weights=LINEAR_MAP, torch_factory=TorchGelu
    )
    assert all(r.passed for r in report.results), str(report)
    assert not report.passed, str(report)
    error = report.float64_check.error
    assert error is not None and "torch_factory" in error and "approximate" in error, error


def _function_port(gelu):
    def apply(params, x):
        return gelu(x @ params["kernel"] + params["bias"])

    return Function(apply, {"kernel": jnp.zeros((WIDTH, WIDTH)), "bias": jnp.zeros(WIDTH)})


FUNCTION_MAP = KeyMap([(r"lin\.weight", "kernel", "o i -> i o"), (r"lin\.bias", "bias", None)])


def test_a_function_factory_must_build_the_same_function_over_the_same_parameters():
    torch.manual_seed(0)
    tanh_gelu = functools.partial(jax.nn.gelu, approximate=True)
    erf_gelu = functools.partial(jax.nn.gelu, approximate=False)
    report = compare_modules(
        _small_bias(TorchGelu()),
        _function_port(tanh_gelu),
        _small_x(),
        weights=FUNCTION_MAP,
        flax_factory=lambda: _function_port(erf_gelu),
    )
    assert not report.passed and "flax_factory" in report.float64_check.error, str(report)
    same = compare_modules(
        TorchGelu(),
        _function_port(erf_gelu),
        _small_x(),
        weights=FUNCTION_MAP,
        flax_factory=lambda: _function_port(erf_gelu),
    )
    assert same.passed, str(same)  # the closure built again is the same function


# ---- 3. a tensor cached in a plain attribute, in the input's dtype, on the first call


class TorchCached(torch.nn.Module):
    """Caches a table on its first call in the input's dtype, as fair-esm's rotary embedding caches cos/sin."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self._length = None
        self._table = None

    def forward(self, x):
        if self._length != x.shape[-1]:
            self._length = x.shape[-1]
            self._table = torch.cos(torch.arange(x.shape[-1], dtype=x.dtype) / 3)
        return self.lin(x) * self._table


class FlaxCached(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.lin(x) * jnp.cos(jnp.arange(x.shape[-1], dtype=x.dtype) / 3)


@pytest.mark.parametrize("called_before", [False, True])
def test_a_table_cached_in_a_plain_attribute_is_as_it_was_after_the_float64_check(called_before):
    torch.manual_seed(0)
    model = TorchCached()
    if called_before:
        model(torch.from_numpy(_x()))
    table = model._table
    report = compare_modules(model, FlaxCached(), _x(), weights=LINEAR_MAP)
    assert all(r.passed for r in report.results), str(report)
    # a table cached in float32 before the call is what the float64 run finds too: said, not lifted
    assert report.float64_check.passed != called_before, str(report)
    assert model._table.dtype == torch.float32 and model(torch.from_numpy(_x())).dtype == torch.float32
    if called_before:
        assert model._table is table  # the caller's own table object, untouched


class TableHelper:
    """A plain Python object (not a module) that caches its table on first use, held by a torch module."""

    def __init__(self):
        self.cache = {}

    def table(self, n, dtype):
        if n not in self.cache:
            self.cache[n] = torch.cos(torch.arange(n, dtype=dtype) / 3)
        return self.cache[n]


class TorchWithHelper(TorchCached):
    def __init__(self):
        super().__init__()
        self.helper = TableHelper()

    def forward(self, x):
        return self.lin(x) * self.helper.table(x.shape[-1], x.dtype)


def test_a_table_cached_by_a_plain_object_the_module_holds_is_as_it_was():
    torch.manual_seed(0)
    model = TorchWithHelper()
    report = compare_modules(model, FlaxCached(), _x(), weights=LINEAR_MAP)
    assert report.passed, str(report)
    assert [t.dtype for t in model.helper.cache.values()] == [torch.float32]


# ---- 4. torch_factory=lambda: model


@pytest.mark.parametrize("converted", [False, True])
def test_a_torch_factory_returning_the_callers_module_works_on_a_copy(converted):
    torch.manual_seed(0)
    model = TorchGelu()
    tensors = {k: (v, v.dtype) for k, v in model.named_parameters()}
    values = {k: v.detach().clone() for k, v in model.state_dict().items()}
    factory = model.double if converted else lambda: model  # model.double() converts it in place and returns it
    report = compare_modules(model, FlaxGelu(False, nnx.Rngs(0)), _x(), weights=LINEAR_MAP, torch_factory=factory)
    assert {k: (v, v.dtype) for k, v in model.named_parameters()} == tensors
    assert all(torch.equal(model.state_dict()[k], v) for k, v in values.items())
    without = compare_modules(model, FlaxGelu(False, nnx.Rngs(0)), _x(), weights=LINEAR_MAP)
    assert report.passed and without.passed, str(report)
    assert report.float64_check.error is None, report.float64_check.error


# ---- 6. a persistent buffer computed at construction, with both factories


class TorchRotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, WIDTH, 2).float() / WIDTH)))  # persistent

    def forward(self, x):
        freqs = torch.arange(x.shape[0]).to(self.inv_freq)[:, None] * self.inv_freq  # (rows, WIDTH / 2)
        return self.lin(x) * torch.cat([freqs.cos(), freqs.sin()], -1)


class FlaxRotary(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))
        self.inv_freq = nnx.data(1.0 / (10000 ** (jnp.arange(0, WIDTH, 2, dtype=jnp.float32) / WIDTH)))

    def __call__(self, x):
        freqs = jnp.arange(x.shape[0]).astype(self.inv_freq.dtype)[:, None] * self.inv_freq  # (rows, WIDTH / 2)
        return self.lin(x) * jnp.concatenate([jnp.cos(freqs), jnp.sin(freqs)], -1)


ROTARY_MAP = KeyMap([*LINEAR_RULES, (r"inv_freq", None, None)])


def test_a_persistent_buffer_computed_at_construction_is_rebuilt_in_float64_by_the_factory():
    torch.manual_seed(0)
    x = _x((6, WIDTH))
    report = compare_modules(
        TorchRotary(),
        FlaxRotary(),
        x,
        weights=ROTARY_MAP,
        dtype="float64",
        torch_factory=TorchRotary,
        flax_factory=FlaxRotary,
    )
    assert report.passed, str(report)
    lifted = [i for i in report.islands if i.side == "torch" and "inv_freq" in i.what]
    assert lifted and all(i.lifted for i in lifted), report.islands
    changed = TorchRotary()
    changed.inv_freq.mul_(2)  # changed after construction: the state dict's value is no rounding of the rebuilt one
    report = compare_modules(
        changed,
        FlaxRotary(),
        x,
        weights=ROTARY_MAP,
        dtype="float64",
        torch_factory=TorchRotary,
        flax_factory=FlaxRotary,
    )
    kept = [i for i in report.islands if i.side == "torch" and "inv_freq" in i.what]
    assert kept and not any(i.lifted for i in kept), report.islands


# ---- 16. words


def test_an_exception_inside_flax_factory_names_the_factory():
    def broken():
        raise RuntimeError("no port today")

    torch.manual_seed(0)
    report = compare_modules(TorchGelu(), FlaxGelu(False, nnx.Rngs(0)), _x(), weights=LINEAR_MAP, flax_factory=broken)
    error = report.float64_check.error
    assert "no port today" in error and "flax_factory" in error, error
    assert "loading, tracing and running the flax side" not in error, error


def test_a_torch_factory_returning_none_or_not_callable_is_said_clearly():
    torch.manual_seed(0)
    report = compare_modules(
        TorchGelu(), FlaxGelu(False, nnx.Rngs(0)), _x(), weights=LINEAR_MAP, torch_factory=lambda: None
    )
    error = report.float64_check.error
    assert "torch_factory returned None" in error and "torch.nn.Module" in error, error
    assert "NoneType" not in error, error
    calls = []
    model = TorchGelu()
    model.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(TypeError, match="torch_factory must be a zero-argument callable"):
        compare_modules(model, FlaxGelu(False, nnx.Rngs(0)), _x(), weights=LINEAR_MAP, torch_factory=5)
    assert not calls  # refused before torch ran


class FlaxNotX64Safe(FlaxGelu):
    """Broadcasts a (3,) table against its output in float64 only: a port that is not x64-safe."""

    def __call__(self, x):
        y = super().__call__(x)
        return jnp.zeros(3) + y if y.dtype == jnp.float64 else y


def test_a_float64_check_error_carries_no_jax_traceback_notice():
    torch.manual_seed(0)
    report = compare_modules(TorchGelu(), FlaxNotX64Safe(False, nnx.Rngs(0)), _x(), weights=LINEAR_MAP)
    error = report.float64_check.error
    assert error is not None and "broadcast" in error, error
    for text in (error, str(report), json.dumps(report.to_json()), report.to_html()):
        assert "internal frames" not in text


class TorchLongNames(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a_rather_long_submodule_name_for_a_projection = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.a_rather_long_submodule_name_for_a_projection(x)


class FlaxLongNames(nnx.Module):
    def __init__(self):
        self.a_rather_long_submodule_name_for_a_projection = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.a_rather_long_submodule_name_for_a_projection(x)


def test_the_table_marks_cut_names_and_says_how_to_see_every_tensor_from_python():
    torch.manual_seed(0)
    report = compare_modules(TorchLongNames(), FlaxLongNames(), _x(), dtype="float32")
    name = "a_rather_long_submodule_name_for_a_projection.weight"
    rows = [line for line in str(report).splitlines() if line.startswith("a_rather")]
    assert rows and all("..." in row.split()[0] for row in rows), rows  # a cut name says it was cut
    assert all(row.split()[0].endswith(name[-10:]) or row.split()[0].endswith("bias") for row in rows), rows
    many = copy.copy(report)
    many.results = report.results * 6  # more tensors than the table shows
    text = str(many)
    assert "--json" not in text.splitlines()[-1] or "report.results" in text, text
    hidden = [line for line in text.splitlines() if "more tensors" in line]
    assert hidden and "report.results" in hidden[0], hidden


class FlaxWrongSecond(nnx.Module):
    """Linear, ReLU, Linear, the second one's output off by one."""

    def __init__(self):
        self.first = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))
        self.second = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.second(jax.nn.relu(self.first(x))) + 1.0


def test_isolation_says_a_parameter_free_module_holds_no_parameters():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH))
    rules = [(rf"{i}\.weight", f"{name}.kernel", "o i -> i o") for i, name in ((0, "first"), (2, "second"))]
    rules += [(rf"{i}\.bias", f"{name}.bias", None) for i, name in ((0, "first"), (2, "second"))]
    report = compare_modules(model, FlaxWrongSecond(), _x(), weights=KeyMap(rules), dtype="float32")
    assert not report.passed and report.isolation is not None, str(report)
    reason = report.isolation.skipped["1"]
    assert "no flax module holds its parameters" not in reason and "holds no parameters" in reason, reason


# ---- 7. float64's word on zero gradients, slab by slab, in every mode


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_the_key_slab_of_a_split_bias_passes_as_zero_in_every_mode(dtype):
    """Softmax ignores a shift of the keys: the key slab's gradient is zero in the mathematics, q's and v's not."""
    x = _x((2, 5, E))
    report = compare_modules(
        torch_attention(), Attention(nnx.Rngs(0)), x, weights=MHA_MAP, forward=MHA_FORWARD, dtype=dtype
    )
    assert all(r.passed for r in report.results), str(report)
    assert report["in_proj_bias[16:32]"].passed_by == "zero", report["in_proj_bias[16:32]"]


# ---- 5. admitted is not compared: dropped parameters judged by their float64 gradient


class TorchWithHead(torch.nn.Module):
    """A Linear and a head the forward does not use (fair-esm's contact head, for a port that leaves it out)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, 2)

    def forward(self, x):
        return self.lin(x)


class FlaxLinear(nnx.Module):
    def __init__(self, use_bias=True):
        self.lin = nnx.Linear(WIDTH, WIDTH, use_bias=use_bias, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.lin(x)


def _load_without_head(state):
    port = FlaxLinear()
    port.lin.kernel[...] = jnp.asarray(state["lin.weight"].T)
    port.lin.bias[...] = jnp.asarray(state["lin.bias"])
    return port


@pytest.mark.parametrize("how", ["ignore rule", "allow_dropped"])
def test_a_dropped_parameter_whose_float64_gradient_is_zero_is_listed_not_compared(how):
    torch.manual_seed(0)
    model = TorchWithHead()
    if how == "ignore rule":
        weights = KeyMap([*LINEAR_RULES, (r"head\..*", None, None)])
    else:
        weights = KeyMap.discover(_load_without_head, model, allow_dropped=[r"head\..*"])
    report = compare_modules(model, FlaxLinear(), _x(), weights=weights)
    assert report.passed, str(report)
    assert report.dropped_parameters == ["head.weight", "head.bias"], report.dropped_parameters
    assert not [r for r in report.results if r.name.startswith("head.")], [r.name for r in report.results]
    assert "dropped parameters" in str(report) and report.to_json()["dropped_parameters"] == report.dropped_parameters


@pytest.mark.parametrize("dtype", [None, "float32", "float64"])
def test_a_dropped_parameter_torch_uses_still_fails_naming_it(dtype):
    torch.manual_seed(0)
    weights = KeyMap([LINEAR_RULES[0], (r"lin\.bias", None, None)])  # the port leaves out a bias torch adds
    with torch.no_grad():
        model = TorchGelu()
        model.act = torch.nn.Identity()
    report = compare_modules(model, FlaxLinear(use_bias=False), _x(), weights=weights, dtype=dtype)
    assert not report.passed, str(report)
    assert "lin.bias" not in report.dropped_parameters
    bias = report["lin.bias"]
    assert not bias.passed and "dropped by the key map" in bias.problem, bias


class TorchTied(torch.nn.Module):
    def __init__(self, tie=True):
        super().__init__()
        self.embed = torch.nn.Embedding(10, WIDTH)
        self.head = torch.nn.Linear(WIDTH, 10, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def _scaled_by(factor):
    def scale(y):
        return y * factor

    return scale


class NNXWithClosure(nnx.Module):
    def __init__(self, factor=0.5, approximate=False):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))
        self.scale = _scaled_by(factor)  # a closure, built again by each build
        self.act = functools.partial(jax.nn.gelu, approximate=approximate)


def test_what_a_factory_must_rebuild_and_what_may_differ():
    """The structure check alone (no comparison): closures built again and dtypes may differ; configuration,
    functions and sharing may not."""
    from flax_ln.parity.core.structure import model_difference

    assert model_difference(TorchTied(), TorchTied()) is None
    assert model_difference(TorchTied(), TorchTied().double()) is None  # only dtypes differ
    assert "head.weight" in model_difference(TorchTied(), TorchTied(tie=False))  # a tie is structure
    assert model_difference(NNXWithClosure(), NNXWithClosure()) is None  # the closure built again
    with jax.enable_x64(True):
        assert model_difference(NNXWithClosure(), NNXWithClosure()) is None  # its arrays in float64
    assert "factor" in model_difference(NNXWithClosure(), NNXWithClosure(factor=2.0))  # a closed-over value
    assert "act" in model_difference(NNXWithClosure(), NNXWithClosure(approximate=True))
