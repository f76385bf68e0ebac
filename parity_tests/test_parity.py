"""The parity engine and the `flax-ln parity` command: compare_modules on plain layers, capture,
exit codes, JSON, localisation, NaN reporting."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_ln import parity
from flax_ln.book import cases as parity_cases
from flax_ln.book.catalog import MODEL_NAMES
from flax_ln.book.torch_checkpoint import torch_checkpoint_case
from flax_ln.cli import main
from flax_ln.parity import Tolerance, assert_parity, compare_modules, compare_tensors
from flax_ln.parity.records.capture import WHOLE_MODEL
from flax_ln.parity.sides.nnx_record import capture_nnx
from flax_ln.parity.sides.torch import run_torch_side

JSON_TENSOR_KEYS = {
    "name",
    "kind",
    "shape",
    "max_abs_error",
    "max_error_index",
    "relative_error",
    "tolerance",
    "passed_by",
    "nonfinite",
    "passed",
    "problem",
    "torch_vs_float64",
    "flax_vs_float64",
}


# ---- compare_modules on a model of plain torch.nn / flax.nnx layers ------------------------------

VOCAB, WIDTH, FEATURES, CLASSES = 11, 8, 5, 3


class TorchTagger(torch.nn.Module):
    """Embedding + Linear(features) -> tanh -> GELU -> Linear; channels-first features (B, F, T)."""

    def __init__(self, returns="array"):
        super().__init__()
        self.returns = returns
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.proj = torch.nn.Linear(FEATURES, WIDTH)
        self.act = torch.nn.GELU()  # erf form
        self.head = torch.nn.Linear(WIDTH, CLASSES)

    def forward(self, ids, features, scale=None):
        hidden = self.act(torch.tanh(self.embed(ids) + self.proj(features.transpose(1, 2))))  # (B, T, W)
        if scale is not None:
            hidden = hidden * scale
        logits = self.head(hidden)
        return {"array": logits, "tuple": (hidden, logits), "dict": {"hidden": hidden, "logits": logits}}[self.returns]


class Gelu(nnx.Module):
    def __init__(self, approximate=False):
        self.approximate = approximate

    def __call__(self, x):
        return jax.nn.gelu(x, approximate=self.approximate)


class FlaxTagger(nnx.Module):
    """The NNX twin: the same attribute names, channels-last features (B, T, F)."""

    def __init__(self, returns="array", *, param_dtype=jnp.float32, rngs):
        self.returns = returns
        self.embed = nnx.Embed(VOCAB, WIDTH, param_dtype=param_dtype, rngs=rngs)
        self.proj = nnx.Linear(FEATURES, WIDTH, param_dtype=param_dtype, rngs=rngs)
        self.act = Gelu()
        self.head = nnx.Linear(WIDTH, CLASSES, param_dtype=param_dtype, rngs=rngs)
        self.scale_power = 1  # 2 plants a mistake that only the scale kwarg reveals

    def __call__(self, ids, features, scale=None):
        hidden = self.act(jnp.tanh(self.embed(ids) + self.proj(features)))  # (B, T, W)
        if scale is not None:
            hidden = hidden * scale**self.scale_power
        logits = self.head(hidden)
        return {"array": logits, "tuple": (hidden, logits), "dict": {"hidden": hidden, "logits": logits}}[self.returns]


def tagger_pair(dtype, returns="array"):
    torch.manual_seed(0)
    torch_model = TorchTagger(returns).to(getattr(torch, dtype))
    with jax.enable_x64(dtype == "float64"):  # float64 parameters need x64 when they are made
        flax_model = FlaxTagger(returns, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (2, 4))
    features = rng.standard_normal((2, FEATURES, 4)).astype(dtype)  # (B, F, T), torch's layout
    return torch_model, flax_model, ids, features, np.swapaxes(features, 1, 2)  # flax: (B, T, F)


@pytest.mark.lower_bounds  # the lower-bounds CI step runs it (pyproject.toml, markers)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("returns", ["array", "tuple", "dict"])
def test_compare_modules_on_plain_layers(dtype, returns):
    torch_model, flax_model, ids, features, features_nlc = tagger_pair(dtype, returns)
    report = compare_modules(torch_model, flax_model, (ids, features), flax_inputs=(ids, features_nlc))
    assert report.passed, str(report)
    assert report.dtype == dtype  # taken from the torch parameters
    outputs = {"array": ["output"], "tuple": ["output[0]", "output[1]"], "dict": ["hidden", "logits"]}[returns]
    assert [r.name for r in report.results if r.kind == "output"] == outputs
    params = [name for name, _ in torch_model.named_parameters()]
    assert [r.name for r in report.results if r.kind == "param grad"] == params  # torch names, every parameter
    assert [r.name for r in report.results if r.kind == "input grad"] == ["grad input 1"]  # floating inputs only
    assert report["grad input 1"].shape == features.shape  # back in torch's (B, F, T) layout
    # the policy's tolerance for this dtype, and an error far inside it
    assert report["proj.weight"].tolerance == parity.TOLERANCES[dtype]["grad"]
    assert report["head.weight"].relative_error <= {"float32": 1e-6, "float64": 1e-14}[dtype]
    assert not jax.config.jax_enable_x64  # x64 was on only during the float64 call
    assert flax_model.head.kernel.dtype == jnp.dtype(dtype)


def test_kwargs_and_custom_loss_leave_the_modules_as_they_were():
    torch_model, flax_model, ids, features, features_nlc = tagger_pair("float32", "dict")
    scale = np.linspace(0.5, 1.5, WIDTH).astype(np.float32)
    loss = (lambda out: (out["logits"] ** 2).mean(), lambda out: jnp.mean(out["logits"] ** 2))
    sentinel = torch.ones_like(torch_model.head.bias)
    torch_model.head.bias.grad = sentinel
    torch_model.train()
    report = assert_parity(
        torch_model, flax_model, (ids, features), flax_inputs=(ids, features_nlc), kwargs={"scale": scale}, loss=loss
    )
    assert report["loss"].kind == "loss" and report["loss"].shape == ()
    assert torch_model.head.bias.grad is sentinel and torch_model.training  # restored after the call
    # the kwarg reaches both forwards: a mistake in how flax applies it is found in the model's own code, right
    # before the first module fed the scaled hidden state (head), which is where it is seen
    flax_model.scale_power = 2
    report = compare_modules(
        torch_model, flax_model, (ids, features), flax_inputs=(ids, features_nlc), kwargs={"scale": scale}, loss=loss
    )
    fd = report.first_divergence
    assert not report.passed and (fd.module, fd.seen_at, fd.between[1]) == (WHOLE_MODEL, "head", "head"), str(report)
    assert not all(r.passed for r in fd.inputs)  # head is fed diverged data


def test_planted_mistake_is_named_and_reported():
    torch_model, flax_model, ids, features, features_nlc = tagger_pair("float64")
    flax_model.act.approximate = True  # the planted mistake: tanh GELU where torch uses erf
    report = compare_modules(torch_model, flax_model, (ids, features), flax_inputs=(ids, features_nlc))
    assert not report.passed
    assert report.first_divergence.module == "act"
    assert all(r.passed for r in report.first_divergence.inputs)  # fed the same data: the module itself is wrong
    with pytest.raises(AssertionError, match="first divergence: act") as info:
        assert_parity(torch_model, flax_model, (ids, features), flax_inputs=(ids, features_nlc))
    assert "FAIL" in str(info.value) and "head.weight" in str(info.value)


def test_float64_in_one_argument_runs_on_copies_and_a_wrong_layout_is_a_clear_error():
    torch_model, flax_model, ids, features, features_nlc = tagger_pair("float32")
    torch_before = {k: v.clone() for k, v in torch_model.state_dict().items()}
    flax_before = nnx.state(flax_model, nnx.Param)
    # float32 modules, float32 inputs: both sides run on float64 copies, the inputs cast (and said so)
    report = compare_modules(torch_model, flax_model, (ids, features), flax_inputs=(ids, features_nlc), dtype="float64")
    assert report.passed, str(report)
    assert report.dtype == "float64" and report.input_casts == {"input 1": "float32 -> float64"}
    assert all(r.relative_error <= 1e-12 for r in report.results if r.kind == "output"), str(report)
    # the caller's objects are unchanged: dtypes and values
    for k, v in torch_model.state_dict().items():
        assert v.dtype == torch_before[k].dtype and torch.equal(v, torch_before[k]), k
    after = nnx.state(flax_model, nnx.Param)
    assert jax.tree.map(lambda a, b: a.dtype == b.dtype and bool(jnp.array_equal(a, b)), after, flax_before)
    # a float64 torch module against a float32 port: the port's float64 copy is compared
    report = compare_modules(
        torch_model.double(), flax_model, (ids, features.astype(np.float64)), flax_inputs=(ids, features_nlc)
    )
    assert report.passed and report.input_casts == {}, str(report)
    torch_model.float()
    with pytest.raises(ValueError, match=r"flax_inputs\[1\] .* in some axis order"):
        compare_modules(torch_model, flax_model, (ids, features), flax_inputs=(ids, features_nlc + 1), dtype="float32")


def test_capture_records_one_instance_and_restores_after_an_exception():
    model = FlaxTagger(rngs=nnx.Rngs(0))
    other = FlaxTagger(rngs=nnx.Rngs(1))  # the same class, another instance
    linear = nnx.Linear(3, 2, rngs=nnx.Rngs(2))  # flax's own Linear, used elsewhere
    ids, features = jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4, FEATURES))
    profile_before = sys.getprofile()
    seen = {}

    def call():
        model(ids, features)
        other(ids, features)
        linear(jnp.ones((1, 3)))
        seen["classes"] = (type(model), type(other), type(linear), type(model.head))
        seen["methods"] = (FlaxTagger.__call__, nnx.Linear.__call__)
        raise RuntimeError("boom")

    methods = (FlaxTagger.__call__, nnx.Linear.__call__)
    with pytest.raises(RuntimeError, match="boom"):
        capture_nnx(model, call)
    # during and after the call: no class or method was swapped, the profile hook is gone
    assert seen["classes"] == (FlaxTagger, FlaxTagger, nnx.Linear, nnx.Linear) and seen["methods"] == methods
    assert (type(model), type(linear), FlaxTagger.__call__, nnx.Linear.__call__) == (FlaxTagger, nnx.Linear, *methods)
    assert sys.getprofile() is profile_before

    records = capture_nnx(model, lambda: (model(ids, features), other(ids, features), linear(jnp.ones((1, 3)))))
    assert list(records) == ["embed", "proj", "act", "head", WHOLE_MODEL]  # this instance only, in execution order
    (head_in,), (head_out,) = records["head"]
    assert head_in.shape == (1, 4, WIDTH) and head_out.shape == (1, 4, CLASSES)


# ---- compare_tensors and the book's cases -------------------------------------------------------


def test_compare_reports_max_error_index_and_relative_error():
    expected = np.array([[1.0, 2.0], [3.0, 4.0]])
    actual = expected.copy()
    actual[1, 0] += 0.3
    r = compare_tensors("t", "output", actual, expected, Tolerance(1e-3, 1e-9))
    assert r.max_error_index == (1, 0)
    assert r.max_abs_error == pytest.approx(0.3)
    assert r.relative_error == pytest.approx(0.3 / np.sqrt(30))
    assert not r.passed and r.nonfinite is None


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_values_are_flagged_never_zeroed(bad):
    expected = np.ones((3, 3))
    actual = expected.copy()
    actual[2, 1] = bad
    r = compare_tensors("t", "output", actual, expected, Tolerance(1.0, 1.0))  # any finite error would pass
    assert not r.passed
    assert ("NaN in flax: 1" if np.isnan(bad) else "Inf in flax: 1") in r.nonfinite
    # even identical NaNs on both sides are reported, and fail: NaN is not "within tolerance"
    r_both = compare_tensors("t", "output", actual, actual, Tolerance(1.0, 1.0))
    assert not r_both.passed and "torch: 1" in r_both.nonfinite


def test_nan_from_the_model_is_reported_in_the_table():
    case = parity_cases.layernorm("float32", 2, 4, 0)
    case.inputs[0][1, 2, 5] = np.nan
    report = parity.check_case(case)
    assert not report.passed
    y = report["output"]
    assert y.nonfinite and "NaN in flax: 512" in y.nonfinite and "NaN in torch: 512" in y.nonfinite
    assert "NONFINITE" in str(report)


def test_planted_discrepancy_is_localised():
    case = parity_cases.layernorm("float32", 2, 4, 0)
    case.flax_model.eps = 1e-2  # the planted bug: the flax norm's eps differs from torch's
    report = parity.check_case(case)
    assert not report.passed
    assert report.first_divergence is not None
    assert report.first_divergence.module == WHOLE_MODEL
    assert all(r.relative_error == 0 for r in report.first_divergence.inputs)  # fed identical data
    assert "first divergence: (whole model)" in str(report)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "flax_ln", "parity", *args], capture_output=True, text=True)


@pytest.mark.slow
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
    assert {t["name"] for t in model["tensors"]} == {"output", "grad x", "a_2", "b_2"}
    for tensor in model["tensors"]:
        assert tensor.keys() == JSON_TENSOR_KEYS
        assert tensor["tolerance"].keys() == {"rtol", "atol", "gtol"}
    assert picture.stat().st_size > 1000 and picture.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_cli_exit_code_is_one_when_out_of_tolerance(tmp_path):
    out = tmp_path / "report.json"
    # float32 parity is ~1e-7, not exact: zero tolerance must fail
    proc = run_cli("--model", "torch-layernorm", "--rtol", "0", "--atol", "0", "--quiet", "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout
    report = json.loads(out.read_text())
    assert report["passed"] is False
    assert report["models"][0]["first_divergence"]["module"] == WHOLE_MODEL


def test_cli_float64_is_exact_to_rounding():
    assert main(["parity", "--model", "layernorm", "--dtype", "float64", "--rtol", "1e-14", "--quiet"]) == 0


@pytest.mark.slow
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


# ---- localisation in the Transformer models ---------------------------------------------------


@pytest.mark.lower_bounds  # the lower-bounds CI step runs it (pyproject.toml, markers)
def test_planted_bug_in_one_block_is_named():
    case = parity_cases.gpt("float32", 2, 8, 0)
    case.flax_model.transformer.h[1].ln_2.eps = 1e-2  # torch keeps 1e-5
    report = parity.check_case(case)
    assert not report.passed
    assert report.first_divergence.module == "transformer.h.1.ln_2"
    # its input still agrees: the bug is in this module, not upstream
    assert all(r.passed for r in report.first_divergence.inputs)
    # everything before it in execution order is within tolerance
    names = [r.name for r in report.module_errors]
    assert all(r.passed for r in report.module_errors[: names.index("transformer.h.1.ln_2")])
    assert "first divergence: transformer.h.1.ln_2" in str(report)


def test_planted_bug_in_a_shared_function_is_named_at_its_first_use(monkeypatch, x64):
    import flax_ln.models.gpt

    monkeypatch.setattr(flax_ln.models.gpt, "gelu", lambda x: jax.nn.gelu(x, approximate=False))  # erf, not tanh
    case = parity_cases.gpt("float64", 2, 8, 0)
    report = parity.check_case(case)
    assert report.first_divergence.module == "transformer.h.0.mlp.act"


@pytest.mark.lower_bounds  # the lower-bounds CI step runs it (pyproject.toml, markers)
def test_planted_bug_in_the_encoder_decoder_is_named():
    case = parity_cases.encoder_decoder("float32", 2, 6, 0)
    case.flax_model.decoder.layers[0].sublayer[2].norm.eps = 1e-1
    report = parity.check_case(case)
    assert report.first_divergence.module == "decoder.layers.0.sublayer.2.norm"


# ---- --checkpoint ---------------------------------------------------------------------------


def save_book_gpt(path, config):
    import torch
    from safetensors.torch import save_file

    import torch_ref

    torch.manual_seed(0)
    model = torch_ref.GPT(config)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return model


SMALL_GPT = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=40, block_size=16)


@pytest.mark.slow
def test_checkpoint_book_gpt_safetensors(tmp_path):
    import flax_ln

    path = tmp_path / "gpt.safetensors"
    save_book_gpt(path, flax_ln.GPTConfig(**SMALL_GPT))
    out = tmp_path / "r.json"
    proc = run_cli("--checkpoint", str(path), "--n-head", "4", "--json", str(out), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (model,) = json.loads(out.read_text())["models"]
    assert model["name"] == "checkpoint gpt.safetensors"
    assert {t["name"] for t in model["tensors"]} >= {"logits", "loss", "transformer.h.1.mlp.c_proj.weight"}
    # without the head count, a clear error
    proc = run_cli("--checkpoint", str(path))
    assert proc.returncode == 2 and "--n-head" in proc.stderr and "head count" in proc.stderr


def test_checkpoint_music_preset(tmp_path):
    import flax_ln

    path = tmp_path / "music.safetensors"
    save_book_gpt(path, flax_ln.GPTConfig.music(n_layer=1, block_size=32))
    case = torch_checkpoint_case(str(path), "float32", 2, 8, 0, preset="music")
    assert case.flax_model.config.ignore_index == 389 and case.flax_model.config.n_head == 8
    assert (case.inputs[1] == 389).any()  # padded targets exercise ignore_index
    assert parity.check_case(case).passed


@pytest.mark.slow
def test_checkpoint_hf_folder(tmp_path):
    from test_gpt import hf_config, hf_tensors, tied_torch_gpt, write_hf

    import flax_ln

    config = flax_ln.GPTConfig(**SMALL_GPT)
    folder = write_hf(tmp_path / "hf", hf_tensors(tied_torch_gpt(config)), hf_config(config))
    proc = run_cli("--checkpoint", str(folder), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checkpoint hf (float32)" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("problem", ["corrupt", "wrong-architecture", "wrong-shapes", "pickled-objects", "missing"])
def test_checkpoint_errors_are_clear(tmp_path, problem):
    import torch

    path = tmp_path / ("model.pt" if problem == "pickled-objects" else "model.safetensors")
    marker = tmp_path / "executed"
    if problem == "corrupt":
        path.write_bytes(b"\x00" * 5 + b"not a safetensors header")
        expected = "not a readable safetensors file"
    elif problem == "wrong-architecture":
        from safetensors.torch import save_file

        save_file({"encoder.conv.weight": torch.zeros(3, 3)}, str(path))
        expected = "not a model flax-ln knows"
    elif problem == "wrong-shapes":
        from safetensors.torch import load_file, save_file

        import flax_ln

        save_book_gpt(path, flax_ln.GPTConfig(**SMALL_GPT))
        state = load_file(str(path))
        state["transformer.h.0.mlp.c_fc.weight"] = torch.zeros(100, 32)  # not 4 * n_embd
        save_file(state, str(path))
        expected = "does not fit"
    elif problem == "pickled-objects":

        class Payload:  # unpickling this would run code: it must be refused, not executed
            def __reduce__(self):
                return (open, (str(marker), "w"))

        torch.save({"weight": torch.zeros(2), "payload": Payload()}, path)
        expected = "refuses to unpickle"
    else:
        expected = "no such file"
    proc = run_cli("--checkpoint", str(path), "--n-head", "4")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_checkpoint_and_model_are_exclusive():
    proc = run_cli("--checkpoint", "x.safetensors", "--model", "gpt")
    assert proc.returncode == 2 and "replaces --model" in proc.stderr


# ---- forward mode, attribution, LM metrics, isolated mode, reference files ---------------------


def test_forward_mode_matches_torch_jvp_and_central_differences():
    torch_model, flax_model, ids, features, features_nlc = tagger_pair("float64", "dict")
    report = compare_modules(torch_model, flax_model, (ids, features), flax_inputs=(ids, features_nlc), mode="jvp")
    assert report.passed, str(report)
    assert [r.name for r in report.results if r.kind == "tangent"] == ["tangent hidden", "tangent logits"]
    assert report["tangent logits"].tolerance == parity.TOLERANCES["float64"]["grad"]
    # the torch tangent the engine compared with equals float64 central differences along the same tangents
    side = run_torch_side(
        torch_model,
        (ids, features),
        input_names=["input 0", "input 1"],
        kwargs={},
        forward=None,
        loss=None,
        dtype="float64",
        mode="jvp",
    )
    tangent_params = {n: torch.from_numpy(side.tangents[n]) for n, _ in torch_model.named_parameters()}
    base = {n: p.detach().clone() for n, p in torch_model.named_parameters()}

    def logits_at(h):
        with torch.no_grad():
            for n, p in torch_model.named_parameters():
                p.copy_(base[n] + h * tangent_params[n])
            x = torch.from_numpy(features + h * side.tangents["tangent input 1"])
            return torch_model(torch.from_numpy(ids), x)["logits"].numpy()

    h = 1e-6  # float64: truncation error ~h^2, rounding ~1e-16/h; both far below 1e-8
    central = (logits_at(h) - logits_at(-h)) / (2 * h)
    assert parity.relative_error(side.expected["tangent logits"], central) < 1e-8
    # float32: the twins agree in forward mode too; a planted mistake shows in the outputs and tangents
    report = compare_modules(
        torch_model.float(),
        FlaxTagger("dict", rngs=nnx.Rngs(0)),
        (ids, features.astype(np.float32)),
        flax_inputs=(ids, features_nlc.astype(np.float32)),
        mode="jvp",
    )
    assert report.passed, str(report)
    bad = FlaxTagger("dict", rngs=nnx.Rngs(0))
    bad.act.approximate = True
    report = compare_modules(
        torch_model,
        bad,
        (ids, features.astype(np.float32)),
        flax_inputs=(ids, features_nlc.astype(np.float32)),
        mode="jvp",
    )
    assert not report["tangent hidden"].passed and report.first_divergence.module == "act"


def test_forward_mode_through_torch_and_nnx_layernorm():
    torch.manual_seed(0)
    torch_norm = torch.nn.LayerNorm(6).double()
    with torch.no_grad():
        torch_norm.weight.normal_()
        torch_norm.bias.normal_()
    with jax.enable_x64(True):
        flax_norm = nnx.LayerNorm(6, epsilon=1e-5, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).standard_normal((3, 6)) * 3 + 2
    report = compare_modules(torch_norm, flax_norm, x, mode="jvp", tangent_params=False)
    assert report.passed, str(report)
    assert {r.name for r in report.results} == {"output", "tangent output"}


def test_attribution_says_which_side_is_wrong():
    torch_model, flax_model, ids, features, features_nlc = tagger_pair("float32", "dict")
    flax_model.act.approximate = True  # flax's GELU is off; torch's float32 is only rounding away from float64
    report = compare_modules(torch_model, flax_model, (ids, features), flax_inputs=(ids, features_nlc), attribute=True)
    failing = [r for r in report.results if not r.passed]
    assert failing
    for r in failing:
        assert r.torch_vs_float64 < 1e-5 < r.flax_vs_float64, r  # float32 rounding against a 1e-4-size mistake
    assert report.attribution["flax_float64_rel"] > 1e-5  # the float64 twins disagree: the math differs
    assert "logits: flax" in str(report) and "flax is further off" in str(report)
    assert report.to_json()["tensors"][0]["flax_vs_float64"] == report.results[0].flax_vs_float64


def test_lm_metrics_against_hand_computed_values():
    torch_logits = np.log(np.array([[[0.5, 0.5, 1e-9], [0.7, 0.2, 0.1]]]))  # (B=1, T=2, V=3)
    flax_logits = np.log(np.array([[[0.25, 0.75, 1e-9], [0.7, 0.2, 0.1]]]))
    m = parity.lm_metrics(flax_logits, torch_logits, "logits")
    kl0 = 0.5 * np.log(0.5 / 0.25) + 0.5 * np.log(0.5 / 0.75)  # position 0; position 1 is identical
    assert np.isclose(m["kl_max"], kl0, rtol=1e-6) and np.isclose(m["kl_mean"], kl0 / 2, rtol=1e-6)
    assert m["worst_position"] == [0, 0] and m["positions"] == 2
    assert m["top1_agreement"] == 0.5  # position 0: torch's tie breaks to token 0, flax picks token 1
    assert m["top3_agreement"] == 1.0  # vocabulary of 3: the top-5 sets are the whole vocabulary


@pytest.mark.lower_bounds  # the lower-bounds CI step runs it (pyproject.toml, markers)
def test_book_cases_report_lm_metrics():
    report = parity.check_case(parity_cases.gpt("float32", 2, 8, 0))
    m = report.lm_metrics
    assert m["output"] == "logits" and m["positions"] == 16
    assert m["top1_agreement"] == 1.0 and m["top5_agreement"] == 1.0
    assert m["kl_max"] < 1e-10  # float32 logits agree to ~4e-7 relative: KL ~ (1e-7)^2 scale
    assert "LM metrics (logits, 16 positions)" in str(report)
    assert report.to_json()["lm_metrics"]["worst_position"] == m["worst_position"]


def test_isolated_mode_names_the_module_whose_own_computation_differs():
    case = parity_cases.gpt("float32", 2, 8, 0)
    case.flax_model.transformer.h[1].ln_2.eps = 1e-2  # torch keeps 1e-5
    report = parity.check_case(case)
    iso = report.isolation
    assert iso.culprits == ["transformer.h.1.ln_2"]
    by_name = {r.name: r for r in iso.results}
    # every module above it fails too when run alone (it contains the bug); every other module passes
    assert not by_name["transformer.h.1"].passed and not by_name[WHOLE_MODEL].passed
    assert by_name["transformer.h.1.mlp"].passed and by_name["transformer.h.0"].passed
    assert "isolated: transformer.h.1.ln_2 (own output rel" in str(report)
    assert report.to_json()["isolated"]["culprits"] == ["transformer.h.1.ln_2"]


TORCH_BLOCKER = """
import runpy, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is blocked: this run must not need torch")
sys.meta_path.insert(0, NoTorch())
sys.argv = ["flax-ln", *sys.argv[1:]]
runpy.run_module("flax_ln", run_name="__main__")
"""


def run_without_torch(*args):
    return subprocess.run([sys.executable, "-c", TORCH_BLOCKER, "parity", *args], capture_output=True, text=True)


@pytest.mark.slow
def test_reference_file_checks_flax_without_torch(tmp_path):
    from safetensors.numpy import load_file, save_file

    from flax_ln.book.reference import DIGEST_KEY, METADATA_KEY, digest

    ref = tmp_path / "ref.safetensors"
    assert (
        main(
            ["parity", "--model", "layernorm", "--seq-len", "4", "--attribute", "--save-reference", str(ref), "--quiet"]
        )
        == 0
    )
    proc = run_without_torch("--reference", str(ref), "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch None" in proc.stdout and "overall: 1/1 models within tolerance -> PASS" in proc.stdout
    report = json.loads((tmp_path / "r.json").read_text())["models"][0]
    assert report["attribution"]["truth"] == "torch float64"  # the float64 values came from the file

    # one output value changed: a parity failure, localised from the file's records alone
    from safetensors import safe_open

    with safe_open(str(ref), framework="numpy") as f:
        metadata = f.metadata()
    tensors = load_file(str(ref))
    key = next(k for k in tensors if k.endswith("/expected/output"))
    tensors[key] = tensors[key].copy()
    tensors[key][0, 0, 0] += 1.0
    altered = tmp_path / "altered.safetensors"
    save_file(tensors, str(altered), metadata=metadata)  # the digest written with the file no longer matches
    proc = run_without_torch("--reference", str(altered))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ALTERED" in proc.stdout and "building" not in proc.stderr  # no comparison: the file was altered
    # the same values with a matching digest (a torch side that differs): a comparison that fails
    metadata = {**metadata, DIGEST_KEY: digest(json.loads(metadata[METADATA_KEY]), tensors)}
    save_file(tensors, str(altered), metadata=metadata)
    proc = run_without_torch("--reference", str(altered))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "attribution: output: flax" in proc.stdout

    # files that are not references: usage errors
    stranger = tmp_path / "random.safetensors"
    save_file({"w": np.ones(3, np.float32)}, str(stranger))
    text = tmp_path / "notes.txt"
    text.write_text("not a reference\n")
    for path, message in (
        (stranger, f"without '{METADATA_KEY}' metadata"),
        (text, "not a safetensors file"),
        (tmp_path / "missing.safetensors", "no such file"),
    ):
        proc = run_without_torch("--reference", str(path))
        assert proc.returncode == 2, (path, proc.stdout, proc.stderr)
        assert message in proc.stderr


def test_reference_with_all_models_in_one_file(tmp_path):
    ref = tmp_path / "all.safetensors"
    from flax_ln.book.reference import load_reference

    assert (
        main(["parity", "--model", "all", "--seq-len", "4", "--batch", "1", "--save-reference", str(ref), "--quiet"])
        == 0
    )
    settings, models = load_reference(str(ref))
    assert [m.side.name for m in models] == MODEL_NAMES
    assert settings["model"] == "all" and settings["seq_len"] == 4
    assert all(m.side.records and m.side.calls for m in models)  # per-submodule records travel with the file


def test_forward_mode_book_models(x64):
    """jvp through every book model in float64 against torch.func.jvp (needs the custom_jvp norms)."""
    for build in (parity_cases.layernorm, parity_cases.torch_layernorm, parity_cases.gpt, parity_cases.encoder_decoder):
        case = build("float64", 2, 4, 0)
        report = parity.check_case(case, mode="jvp")
        assert report.passed, str(report)
        assert any(r.kind == "tangent" for r in report.results)
