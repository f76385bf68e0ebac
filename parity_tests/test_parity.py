"""The parity harness and the `flax-ln parity` command: exit codes, JSON, localisation, NaN reporting."""

import json
import subprocess
import sys

import numpy as np
import pytest

from flax_ln import parity, parity_cases
from flax_ln.cli import main
from flax_ln.parity import Tolerance, compare

JSON_TENSOR_KEYS = {"name", "kind", "shape", "max_abs_error", "max_error_index", "relative_error", "tolerance", "passed_by",
                    "nonfinite", "passed"}


def test_compare_reports_max_error_index_and_relative_error():
    expected = np.array([[1.0, 2.0], [3.0, 4.0]])
    actual = expected.copy()
    actual[1, 0] += 0.3
    r = compare("t", "output", actual, expected, Tolerance(1e-3, 1e-9))
    assert r.max_error_index == (1, 0)
    assert r.max_abs_error == pytest.approx(0.3)
    assert r.relative_error == pytest.approx(0.3 / np.sqrt(30))
    assert not r.passed and r.nonfinite is None


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_values_are_flagged_never_zeroed(bad):
    expected = np.ones((3, 3))
    actual = expected.copy()
    actual[2, 1] = bad
    r = compare("t", "output", actual, expected, Tolerance(1.0, 1.0))  # any finite error would pass
    assert not r.passed
    assert ("NaN in flax: 1" if np.isnan(bad) else "Inf in flax: 1") in r.nonfinite
    # even identical NaNs on both sides are reported, and fail: NaN is not "within tolerance"
    r_both = compare("t", "output", actual, actual, Tolerance(1.0, 1.0))
    assert not r_both.passed and "torch: 1" in r_both.nonfinite


def test_nan_from_the_model_is_reported_in_the_table():
    case = parity_cases.layernorm("float32", 2, 4, 0)
    case.inputs[0][1, 2, 5] = np.nan
    report = parity.check_case(case)
    assert not report.passed
    y = next(r for r in report.results if r.name == "y")
    assert y.nonfinite and "NaN in flax: 512" in y.nonfinite and "NaN in torch: 512" in y.nonfinite
    assert "NONFINITE" in parity.format_case(report)


def test_planted_discrepancy_is_localised():
    case = parity_cases.layernorm("float32", 2, 4, 0)
    case.flax_model.eps = 1e-2  # the planted bug: the flax norm's eps differs from torch's
    report = parity.check_case(case)
    assert not report.passed
    assert report.first_divergence is not None
    assert report.first_divergence.module == parity.WHOLE_MODEL
    assert all(r.relative_error == 0 for r in report.first_divergence.inputs)  # fed identical data
    assert "first divergence: (whole model)" in parity.format_case(report)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "flax_ln", "parity", *args], capture_output=True, text=True)


def test_cli_passes_writes_json_and_plot(tmp_path):
    out = tmp_path / "report.json"
    picture = tmp_path / "errors.png"
    proc = run_cli("--model", "layernorm", "--json", str(out), "--plot", str(picture))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend cpu" in proc.stdout and "matmul precision highest" in proc.stdout
    assert "overall: 1/1 models within tolerance -> PASS" in proc.stdout
    assert "layernorm: building" in proc.stderr  # progress goes to stderr
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["dtype"] == "float32"
    assert {"backend", "devices", "jax", "flax", "torch", "x64", "matmul_precision"} <= report["environment"].keys()
    (model,) = report["models"]
    assert model["name"] == "layernorm" and model["passed"] is True
    assert {t["name"] for t in model["tensors"]} == {"y", "grad x", "a_2", "b_2"}
    for tensor in model["tensors"]:
        assert tensor.keys() == JSON_TENSOR_KEYS
        assert tensor["tolerance"].keys() == {"rtol", "atol", "gtol"}
    assert picture.stat().st_size > 1000 and picture.read_bytes()[:4] == b"\x89PNG"


def test_cli_exit_code_is_one_when_out_of_tolerance(tmp_path):
    out = tmp_path / "report.json"
    # float32 parity is ~1e-7, not exact: zero tolerance must fail
    proc = run_cli("--model", "torch-layernorm", "--rtol", "0", "--atol", "0", "--quiet", "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout
    report = json.loads(out.read_text())
    assert report["passed"] is False
    assert report["models"][0]["first_divergence"]["module"] == parity.WHOLE_MODEL


def test_cli_float64_is_exact_to_rounding():
    assert main(["parity", "--model", "layernorm", "--dtype", "float64", "--rtol", "1e-14", "--quiet"]) == 0


def test_cli_rejects_bad_arguments():
    for args in (["--batch", "0"], ["--model", "nope"], ["--dtype", "float16"], ["--train-steps", "-1"]):
        proc = run_cli(*args)
        assert proc.returncode == 2, args
        assert "error" in proc.stderr


def test_train_steps_report_drift_per_step(x64):
    case = parity_cases.layernorm("float64", 2, 4, 0)
    records = parity.check_training(case, 3, parity.TOLERANCES["float64"])
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["passed"] for r in records)
    assert records[0]["loss_flax"] != records[-1]["loss_flax"]  # the weights really moved
