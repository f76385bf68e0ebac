"""Reliability, fifth round: the caller's model is left as it was, autocast regions stay in half precision in float64,
report pages never overwrite each other, ``flax-ln report`` reads any JSON without a traceback, probed loaders must
not depend on values, and the report's JSON and text say the same.

Tolerances are the engine's policy (docs/tolerances.md); no test here sets its own.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_ln.cli import main
from flax_ln.convert import ConversionError
from flax_ln.parity import KeyMap, ParityReport, compare_modules

pytest_plugins = ["pytester"]

WIDTH = 8
LINEAR_RULES = [(r"lin\.weight", "lin.kernel", "o i -> i o"), (r"lin\.bias", "lin.bias", None)]
LINEAR_MAP = KeyMap(LINEAR_RULES)


def _x() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((3, WIDTH)).astype(np.float32)


class TorchWithTable(torch.nn.Module):
    """A float32 Linear beside a float64 buffer and a complex parameter the forward does not use."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.register_buffer("tab", torch.arange(8, dtype=torch.float64) / 3)
        self.phase = torch.nn.Parameter(torch.tensor([1 + 2j, 3 - 1j]), requires_grad=False)

    def forward(self, x):
        return self.lin(x) + self.tab[:WIDTH].to(x.dtype)


class FlaxWithTable(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.lin(x) + (jnp.arange(8, dtype=x.dtype) / 3)[:WIDTH]


TABLE_MAP = KeyMap([*LINEAR_RULES, (r"tab|phase", None, None)])


def test_the_default_call_leaves_every_tensor_of_the_callers_torch_model_as_it_was():
    torch.manual_seed(0)
    model = TorchWithTable()
    model.lin.weight.grad = torch.ones(WIDTH, WIDTH)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    objects = (model.tab, model.lin.weight, model.lin.weight.grad)
    x = _x()
    x_before = x.copy()
    report = compare_modules(model, FlaxWithTable(), x, weights=TABLE_MAP)
    assert report.float64_check is not None
    after = model.state_dict()
    assert {k: v.dtype for k, v in after.items()} == {k: v.dtype for k, v in before.items()}
    assert all(torch.equal(after[k], before[k]) for k in before)  # the complex phase keeps its imaginary part
    assert (model.tab, model.lin.weight, model.lin.weight.grad) == objects
    assert model.training and np.array_equal(x, x_before)


class TorchAutocast(torch.nn.Module):
    """Its Linear runs under ``torch.autocast`` in bfloat16."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x)
        return y.float()


class FlaxFloat(nnx.Module):
    """The port that forgot the autocast: its Linear in the parameters' dtype."""

    def __init__(self):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.lin(x)


@pytest.mark.parametrize("dtype", ["float64", None])
def test_a_bfloat16_autocast_region_stays_bfloat16_in_the_float64_run(dtype):
    torch.manual_seed(0)
    report = compare_modules(TorchAutocast(), FlaxFloat(), _x(), weights=LINEAR_MAP, dtype=dtype)
    check = report if dtype == "float64" else report.float64_check
    assert not check.passed, str(report)  # the bfloat16 Linear is the model's own: float64 sees it
    kept = [i for i in check.islands if i.side == "torch" and "autocast(bfloat16)" in i.what]
    assert kept and kept[0].module == "lin" and not kept[0].lifted, check.islands


def test_a_torch_view_as_int32_of_a_float32_value_keeps_its_width():
    """``x.view(torch.int32)`` (the sign bit cleared: an absolute value) on a value the model computes in float32."""

    class TorchAbs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            y = self.lin(x).float()
            return y + (y.view(torch.int32) & 0x7FFFFFFF).view(torch.float32)  # |y| through its bits: no gradient

    class FlaxAbs(FlaxFloat):
        def __call__(self, x):
            y = self.lin(x)
            return y + jax.lax.stop_gradient(jnp.abs(y))

    torch.manual_seed(0)
    report = compare_modules(TorchAbs(), FlaxAbs(), _x(), weights=LINEAR_MAP)
    assert all(r.passed for r in report.results), str(report)
    assert report.float64_check.error is None, report.float64_check.error
    assert any("view" in i.what and not i.lifted for i in report.float64_check.islands)


def test_a_float32_numpy_value_in_torch_is_listed_as_not_lifted():
    class TorchScaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return self.lin(x) * torch.from_numpy(np.array(WIDTH**-0.5, np.float32))

    class FlaxScaled(FlaxFloat):
        def __call__(self, x):
            return self.lin(x) * WIDTH**-0.5

    torch.manual_seed(0)
    report = compare_modules(TorchScaled(), FlaxScaled(), _x(), weights=LINEAR_MAP, dtype="float64")
    rounded = [i for i in report.islands if i.side == "torch" and "float32" in i.what]
    assert rounded and not any(i.lifted for i in rounded), report.islands


# ---- report pages and flax-ln report


PAGES_TEST = """
import numpy as np
import pytest
import torch
from flax import nnx

from flax_ln.parity import assert_parity


class WrongBias(nnx.Linear):
    def __call__(self, x):
        return super().__call__(x) + 1e-2


@pytest.mark.parametrize("case", ["a/b", "a_b"])
def test_page(case):
    torch.manual_seed(0)
    x = np.random.default_rng(0).standard_normal((2, 3)).astype("float32")
    assert_parity(torch.nn.Linear(3, 2), WrongBias(3, 2, rngs=nnx.Rngs(0)), (x,), name="model " + case, dtype="float32")
"""


def test_two_tests_whose_ids_read_alike_get_their_own_pages(pytester, plugin_arguments):
    pytester.makepyfile(test_pages=PAGES_TEST)
    pages = pytester.path / "pages"
    result = pytester.runpytest_inprocess(*plugin_arguments, "--parity-html", str(pages), "-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    written = sorted(pages.glob("*.html"))
    assert len(written) == 2
    names = {case: next(p for p in written if f"model {case}" in p.read_text()) for case in ("a/b", "a_b")}
    assert names["a/b"] != names["a_b"]
    for page in names.values():
        assert f"HTML report: {page}" in result.stdout.str()


def test_a_parity_html_folder_under_a_file_is_a_usage_error(pytester, plugin_arguments):
    pytester.makepyfile(test_pages=PAGES_TEST)
    (pytester.path / "afile").write_text("x")
    result = pytester.runpytest_inprocess(
        *plugin_arguments, "--parity-html", str(pytester.path / "afile" / "pages"), "-p", "no:cacheprovider"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--parity-html" in result.stderr.str() and "INTERNALERROR" not in result.stdout.str()


REMOVED_TEST = (
    PAGES_TEST
    + """

def test_removed_folder():
    import os, shutil
    shutil.rmtree(os.environ["FLAX_LN_PARITY_HTML_DIR"])
    test_page("removed")
"""
)


def test_a_parity_html_folder_removed_during_the_run_is_made_again(pytester, plugin_arguments):
    pytester.makepyfile(test_pages=REMOVED_TEST)
    pages = pytester.path / "pages"
    result = pytester.runpytest_inprocess(
        *plugin_arguments, "--parity-html", str(pages), "-p", "no:cacheprovider", "-k", "removed"
    )
    result.assert_outcomes(failed=1)
    assert "parity failed" in result.stdout.str() and "FileNotFoundError" not in result.stdout.str()
    assert len(list(pages.glob("*.html"))) == 1


@pytest.fixture(scope="module")
def report_json(tmp_path_factory):
    torch.manual_seed(0)
    report = compare_modules(TorchWithTable(), FlaxWithTable(), _x(), weights=TABLE_MAP, dtype="float32")
    path = tmp_path_factory.mktemp("report") / "in.json"
    path.write_text(json.dumps({"models": [report.to_json()]}))
    return path


def test_report_refuses_an_html_output_hard_linked_to_its_input(report_json, tmp_path, capsys):
    link = tmp_path / "out.html"
    os.link(report_json, link)
    before = report_json.read_bytes()
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(report_json), "--html", str(link)])
    assert exit_.value.code == 2 and "JSON file itself" in capsys.readouterr().err
    assert report_json.read_bytes() == before


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ("[" * 200_000 + "]" * 200_000, "nested too deeply"),
        (json.dumps({"models": [{"name": "m", "dtype": "float32", "tensors": "abc"}]}), "models[0].tensors"),
        (json.dumps({"name": "m", "dtype": "float32", "tensors": [1, 2]}), "report.tensors[0]"),
        (json.dumps([1, 2]), "top level"),
        (json.dumps({"models": "x"}), "models"),
    ],
)
def test_report_reads_any_json_without_a_traceback(tmp_path, capsys, content, field):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["report", str(path), "--html", str(tmp_path / "out.html")]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err


def test_the_json_round_trip_keeps_what_the_text_shows_and_the_text_shows_ties():
    torch.manual_seed(0)

    class TiedTorch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(WIDTH, WIDTH, bias=False)
            self.head = torch.nn.Linear(WIDTH, WIDTH, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x):
            return self.head(torch.tanh(self.embed(x)))

    class TiedFlax(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((WIDTH, WIDTH)))
            self.gain = nnx.Variable(jnp.zeros(()))

        def __call__(self, x):
            return jnp.tanh(x @ self.w[...]) @ self.w[...] + self.gain[...]

    weights = KeyMap([(r"(embed|head)\.weight", "w", "o i -> i o")], constants={"gain": 0.0})
    weights.discovery = "measured from a loader (a note)"
    report = compare_modules(TiedTorch(), TiedFlax(), _x(), weights=weights)
    text = str(report)
    assert "tie: embed.weight = head.weight" in text and "-> flax w" in text
    again = ParityReport.from_json(json.loads(json.dumps(report.to_json())))
    assert str(again).replace(f"{again.seconds:.1f}s", "") == text.replace(f"{report.seconds:.1f}s", "")


def test_a_loader_whose_layout_depends_on_the_values_is_refused():
    class TorchLin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def loader(state):
        port = FlaxFloat()
        weight = state["lin.weight"]
        kernel = weight.T if np.abs(weight).mean() > 1 else weight  # transposes only for large values
        port.lin.kernel.set_value(jnp.asarray(kernel, jnp.float32))
        port.lin.bias.set_value(jnp.asarray(state["lin.bias"], jnp.float32))
        return port

    with pytest.raises(ConversionError, match="depends on the values"):
        KeyMap.discover(loader, TorchLin())


class FlaxBitsAndPrecision(FlaxFloat):
    """A port of :class:`TorchFloatScaled`: ``|y|`` through float32's bits, torch's ``.float()`` as
    ``reduce_precision`` (both faithful), and a NumPy float32 floor (rounded before the run: named, not lifted)."""

    def __call__(self, x):
        y = jax.lax.reduce_precision(self.lin(x), exponent_bits=8, mantissa_bits=23)
        bits = jax.lax.bitcast_convert_type(y.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF
        return y + jax.lax.stop_gradient(jax.lax.bitcast_convert_type(bits, jnp.float32)), jnp.maximum(
            y, np.float32(-0.1)
        )


class TorchFloatScaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        y = self.lin(x).float()
        magnitude = (y.detach().view(torch.int32) & 0x7FFFFFFF).view(torch.float32)
        return y + magnitude, torch.maximum(y, torch.tensor(-0.1, dtype=torch.float32))


def test_bit_level_views_keep_their_width_and_rounded_numpy_constants_are_named_on_the_flax_side():
    torch.manual_seed(0)
    report = compare_modules(TorchFloatScaled(), FlaxBitsAndPrecision(), _x(), weights=LINEAR_MAP, dtype="float64")
    flax = {i.what: i for i in report.islands if i.side == "flax"}
    assert flax["reduce_precision to float32's precision"].lifted
    assert not flax["bitcast_convert_type of a float32 value to int32: kept in float32"].lifted
    assert any("float32 constant ()" in w and not i.lifted for w, i in flax.items()), flax
    assert report["output[0]"].passed, str(report)  # |y| is read from float32 bits on both sides
    assert not report["output[1]"].passed  # np.float32(-0.1) is rounded; torch's float32 request is lifted
