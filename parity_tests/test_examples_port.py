"""examples/port_your_model.py: the hand port passes the parity engine; each planted mistake is named."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here starts a subprocess or runs an example

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "port_your_model.py"


def load_example():
    spec = importlib.util.spec_from_file_location("port_your_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


port = load_example()


@pytest.mark.lower_bounds  # the lower-bounds CI step runs it (pyproject.toml, markers)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_hand_port_passes_with_no_rule_written(dtype):
    report = port.check(dtype)
    assert report.passed, str(report)
    assert report.first_divergence is None


def test_a_planted_mistake_fails_and_names_its_module():
    """float64: a 1e-6 against 1e-5 epsilon is far above the float64 bound."""
    report = port.check("float64", mistake="norm_eps")
    assert not report.passed
    assert report.first_divergence.module == port.MISTAKES["norm_eps"] == "norm"


def test_assert_parity_raises_with_the_report_naming_the_conv():
    """The conv's outputs differ in layout, (B, C, T) against (B, T, C); the declared layout rule lines them up,
    so the mistake is pinned on the conv itself and not on the first layer after it."""
    torch_model, flax_model, ids = port.make_pair("float32", mistake="conv_padding")
    with pytest.raises(AssertionError, match="first divergence: conv "):
        port.assert_parity(torch_model, flax_model, ids)
