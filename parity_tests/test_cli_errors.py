"""``flax-ln parity`` never says PASS on wrong weights, and every bad argument is a clear error (exit 2) before the run.

Usage errors exit 2 (argparse's ``parser.error``: ``SystemExit(2)``, or ``main`` returning 2
for a checkpoint it refuses); a parity FAIL exits 1. Each test calls ``main`` in-process
on a tiny model and checks that nothing was built ("building" is the progress line).
"""

import json

import jax
import pytest
import torch
from safetensors.torch import save_file

import flax_ln
import torch_ref
from flax_ln.cli import main

TINY_GPT = dict(n_layer=1, n_head=2, n_embd=8, vocab_size=12, block_size=8)
TINY_SIZES = dict(src_vocab=7, tgt_vocab=9, N=1, d_model=8, d_ff=16, h=2)


def run(capsys, *args):
    """``(exit code, stdout, stderr)`` of ``flax-ln parity ARGS`` run in this process."""
    try:
        code = main(["parity", *map(str, args)])
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_usage_error(capsys, *args, says):
    code, out, err = run(capsys, *args)
    assert code == 2, out + err
    for text in [says] if isinstance(says, str) else says:
        assert text in err, err
    assert "Traceback" not in err and "building" not in err  # refused before anything was built
    assert "PASS" not in out


def gpt_state(config=TINY_GPT, seed=0):
    torch.manual_seed(seed)
    return {k: v.contiguous() for k, v in torch_ref.GPT(flax_ln.GPTConfig(**config)).state_dict().items()}


def save(path, state):
    save_file(state, str(path))
    return path


# ---- integer, bool and half-precision weights --------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool])
def test_non_floating_gpt_checkpoint_is_refused_never_passed(tmp_path, capsys, dtype):
    # int8: most of the 0.02-scale weights become 0; load_state_dict would cast them back silently
    state = {k: v.to(dtype) for k, v in gpt_state().items()}
    path = save(tmp_path / "gpt.safetensors", state)
    code, out, err = run(capsys, "--checkpoint", path, "--n-head", 2)
    name = str(dtype).removeprefix("torch.")
    assert code == 2, out + err
    assert "PASS" not in out and "Traceback" not in err
    assert f"{name} (the model's: float32): lm_head.weight, transformer.h.0.attn.bias" in err
    assert f"({len(state)} in all)" in err and "floating" in err


def test_integer_buffer_stays_allowed():
    from flax_ln.book.torch_checkpoint import check_dtypes

    bn = torch.nn.BatchNorm1d(4)  # num_batches_tracked: int64 in torch too
    check_dtypes(bn.state_dict(), bn.state_dict(), "bn.safetensors")
    state = {**bn.state_dict(), "num_batches_tracked": torch.tensor(3.0)}  # a float where torch has an integer
    with pytest.raises(ValueError, match=r"num_batches_tracked"):
        check_dtypes(state, bn.state_dict(), "bn.safetensors")


def hf_folder(folder, dtype):
    """A tiny tied GPT saved as Hugging Face's GPT2LMHeadModel folder (Conv1D weights (in, out)) in ``dtype``."""
    config = flax_ln.GPTConfig(**TINY_GPT)
    state = gpt_state()
    state["lm_head.weight"] = state["transformer.wte.weight"]
    tensors = {}
    for key, value in state.items():
        if key.endswith(".attn.bias") or key == "lm_head.weight":
            continue
        conv1d = key.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
        tensors[key] = (value.t() if conv1d else value).contiguous().to(dtype)
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_layer": config.n_layer,
                "n_head": config.n_head,
                "n_embd": config.n_embd,
                "vocab_size": config.vocab_size,
                "n_positions": config.block_size,
                "tie_word_embeddings": True,
            }
        )
    )
    return folder


def test_int8_hf_folder_is_refused(tmp_path, capsys):
    folder = hf_folder(tmp_path / "hf", torch.int8)
    code, out, err = run(capsys, "--checkpoint", folder)
    assert code == 2 and "PASS" not in out, out + err
    assert "non-floating" in err and "I8" in err and "wte.weight" in err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_hf_folder_loads_and_names_its_dtype(tmp_path, capsys, dtype):
    folder = hf_folder(tmp_path / "hf", dtype)
    report = tmp_path / "r.json"
    code, out, err = run(capsys, "--checkpoint", folder, "--quiet", "--json", report)
    name = str(dtype).removeprefix("torch.")
    assert code == 0, out + err
    assert f"checkpoint hf (float32, stored {name})" in out
    assert json.loads(report.read_text())["models"][0]["stored_dtype"] == name


def test_half_precision_state_dict_loads_and_names_its_dtype(tmp_path, capsys):
    path = save(tmp_path / "gpt.safetensors", {k: v.to(torch.bfloat16) for k, v in gpt_state().items()})
    code, out, err = run(capsys, "--checkpoint", path, "--n-head", 2, "--quiet")
    assert code == 0, out + err
    assert "checkpoint gpt.safetensors (float32, stored bfloat16)" in out


def test_state_dict_of_a_model_too_large_to_build_is_a_clear_error(tmp_path, capsys):
    # 8 MB on disk, but block_size 10^6 gives a (10^6, 10^6) float32 causal mask: 4 TB per layer
    state = gpt_state(dict(TINY_GPT, n_embd=2, n_head=1))
    state["transformer.wpe.weight"] = torch.zeros(1_000_000, 2)
    path = save(tmp_path / "gpt.safetensors", state)
    code, out, err = run(capsys, "--checkpoint", path, "--n-head", 1)
    assert code == 2 and "Traceback" not in err, out + err
    assert "too large" in err and "block_size=1000000" in err


# ---- incomplete or odd state dicts -------------------------------------------------------


def enc_dec_state():
    torch.manual_seed(0)
    return {k: v.contiguous() for k, v in torch_ref.make_model(**TINY_SIZES).state_dict().items()}


@pytest.mark.parametrize(
    ("problem", "says"),
    [
        (
            "only-wte",
            [
                "missing: transformer.wpe.weight, transformer.ln_f.weight, transformer.ln_f.bias, lm_head.weight",
                "missing: no layers (transformer.h.0.*",
            ],
        ),
        ("1-d-wte", ["malformed: transformer.wte.weight has shape [96], expected a 2-D tensor"]),
        ("h.x", ["malformed: layer keys without an integer index after 'transformer.h.': transformer.h.x.ln_1.weight"]),
        ("gap", ["missing: layers transformer.h.1.*"]),
        ("no-tgt-embed", ["looks like a torch_ref encoder-decoder", "missing: tgt_embed.0.lut.weight"]),
    ],
)
def test_incomplete_state_dict_lists_what_is_missing_or_malformed(tmp_path, capsys, problem, says):
    if problem == "no-tgt-embed":
        state = {k: v for k, v in enc_dec_state().items() if not k.startswith("tgt_embed.")}
    else:
        state = gpt_state(dict(TINY_GPT, n_layer=3) if problem == "gap" else TINY_GPT)
        if problem == "only-wte":
            state = {"transformer.wte.weight": state["transformer.wte.weight"]}
        elif problem == "1-d-wte":
            state["transformer.wte.weight"] = state["transformer.wte.weight"].reshape(-1)
        elif problem == "h.x":
            state["transformer.h.x.ln_1.weight"] = state.pop("transformer.h.0.ln_1.weight")
        elif problem == "gap":
            state = {k: v for k, v in state.items() if not k.startswith("transformer.h.1.")}
    path = save(tmp_path / "model.safetensors", state)
    code, out, err = run(capsys, "--checkpoint", path, "--n-head", 2)
    assert code == 2 and "Traceback" not in err, out + err
    for text in says:
        assert text in err, err


# ---- --seq-len against each model's limit ------------------------------------------------


@pytest.mark.parametrize(
    ("model", "seq_len", "limit"),
    [
        ("encoder-decoder", 100_000, 5000),  # OOM-killed before
        ("encoder-decoder", 6000, 5000),
        ("gpt2-xl-block", 1100, 1024),
        ("gpt", 33, 32),
        ("music", 2049, 2048),
        ("all", 33, 32),  # the first model that cannot take it, before any model runs
    ],
)
def test_seq_len_beyond_a_models_limit_is_refused_before_building(capsys, model, seq_len, limit):
    assert_usage_error(capsys, "--model", model, "--seq-len", seq_len, says=f"at most {limit} ")


def test_seq_len_beyond_a_checkpoints_block_size_is_refused(tmp_path, capsys):
    path = save(tmp_path / "gpt.safetensors", gpt_state())
    code, out, err = run(capsys, "--checkpoint", path, "--n-head", 2, "--seq-len", 9)
    assert code == 2 and "PASS" not in out, out + err
    assert "--seq-len 9 is too long" in err and "at most 8 positions" in err


# ---- output paths and tolerances ---------------------------------------------------------


@pytest.mark.parametrize("where", ["missing-folder", "proc", "directory"])
@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_unwritable_output_is_refused_before_the_run(tmp_path, capsys, option, where):
    suffix = ".json" if option == "--json" else ".png"
    path, says = {
        "missing-folder": (tmp_path / "nope" / f"r{suffix}", "does not exist"),
        "proc": (f"/proc/version{suffix if option == '--plot' else ''}", "cannot be written"),
        "directory": (tmp_path, "is a directory"),
    }[where]
    if option == "--plot" and where == "directory":
        says = "no file extension"  # a folder name has none; before, the chart went to DIR.png
    assert_usage_error(capsys, "--model", "layernorm", option, path, says=[option, says])
    assert not (tmp_path.parent / f"{tmp_path.name}.png").exists()


def test_plot_format_must_be_one_matplotlib_writes(tmp_path, capsys):
    assert_usage_error(
        capsys,
        "--model",
        "layernorm",
        "--plot",
        tmp_path / "chart.xyz",
        says=["--plot", "extension .xyz", ".png", ".svg"],
    )


@pytest.mark.parametrize("option", ["--rtol", "--atol"])
@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_tolerance_must_be_finite_and_non_negative(capsys, option, value):
    assert_usage_error(capsys, "--model", "layernorm", option, value, says=f"{option} must be a finite number >= 0")


def test_usage_error_is_2_and_parity_fail_is_1(capsys):
    assert run(capsys, "--model", "layernorm", "--rtol", "-1")[0] == 2
    # float32 parity is ~1e-7, not exact: zero tolerance is a real FAIL
    assert (
        run(capsys, "--model", "layernorm", "--rtol", "0", "--atol", "0", "--quiet", "--batch", 1, "--seq-len", 2)[0]
        == 1
    )


# ---- mesh arguments ----------------------------------------------------------------------


def test_more_devices_than_jax_has_says_how_to_get_them(capsys):
    jax.devices()  # this process's backend has started: its CPU device count is fixed
    assert_usage_error(
        capsys,
        "--model",
        "layernorm",
        "--devices",
        jax.device_count() + 7,
        says=f"XLA_FLAGS=--xla_force_host_platform_device_count={jax.device_count() + 7}",
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--devices", "0"], "--devices must be at least 1"),
        (["--fsdp", "0"], "--fsdp must be at least 1"),
        (["--devices", "1", "--fsdp", "2"], "--fsdp 2 must divide --devices 1"),
        (["--devices", "1", "--train-steps", "1"], "--train-steps runs unsharded"),
    ],
)
def test_mesh_arguments_are_checked(capsys, args, says):
    assert_usage_error(capsys, "--model", "layernorm", *args, says=says)


# ---- reference-file options, checked like the others --------------------------------------


def test_save_reference_into_a_missing_folder_is_refused_before_the_run(tmp_path, capsys):
    assert_usage_error(
        capsys,
        "--model",
        "layernorm",
        "--save-reference",
        tmp_path / "nope" / "ref.safetensors",
        says=["--save-reference", "does not exist"],
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--model", "gpt"], "--reference replaces --model"),
        (["--seq-len", "4"], "--reference replaces --model"),
        (["--attribute"], "takes attribution from the file"),
    ],
)
def test_reference_refuses_what_the_file_decides(tmp_path, capsys, args, says):
    ref = tmp_path / "ref.safetensors"
    ref.write_bytes(b"")  # exists: only the combination is wrong
    assert_usage_error(capsys, "--reference", ref, *args, says=says)


def test_missing_reference_is_refused_before_the_run(tmp_path, capsys):
    assert_usage_error(capsys, "--reference", tmp_path / "missing.safetensors", says="no such file")


# ---- outputs never overwrite inputs or each other ----------------------------------------


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--reference", "REF", "--json", "REF"], "--json"),
        (["--reference", "REF", "--plot", "REF.png"], None),  # different files: allowed (checked below)
        (["--model", "layernorm", "--save-reference", "X.png", "--plot", "X.png"], "--plot"),
        (["--model", "layernorm", "--save-reference", "X", "--json", "X"], "--json"),
        (["--model", "layernorm", "--json", "X.png", "--plot", "X.png"], "--plot"),
        (["--model", "layernorm", "--json", "sub/../X", "--save-reference", "X"], "--save-reference"),
        (["--reference", "LINK", "--json", "REF"], "--json"),  # a symlink to the reference: the same file
        (["--checkpoint", "CKPT/model.safetensors", "--json", "CKPT/model.safetensors"], "--json"),
        (["--checkpoint", "CKPT", "--json", "CKPT/config.json"], "--json"),
        (["--checkpoint", "CKPT", "--save-reference", "CKPT/model.safetensors"], "--save-reference"),
    ],
)
def test_an_output_that_is_an_input_or_another_output_is_refused(tmp_path, capsys, options, says):
    ref = tmp_path / "REF"
    ref.write_bytes(b"precious")
    (tmp_path / "LINK").symlink_to(ref)
    (tmp_path / "sub").mkdir()
    ckpt = tmp_path / "CKPT"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights")
    (ckpt / "config.json").write_text("{}")
    args = [str(tmp_path / o) if o.isupper() or "/" in o or o.startswith("X") else o for o in options]
    if says is None:
        code, out, err = run(capsys, *args)
        assert "same file" not in err
        return
    assert_usage_error(capsys, *args, says=[says, "same file"])
    assert ref.read_bytes() == b"precious" and (ckpt / "model.safetensors").read_bytes() == b"weights"
    assert not (tmp_path / "X").exists() and not (tmp_path / "X.png").exists()


def test_reference_with_dtype_is_refused_before_reading(tmp_path, capsys):
    ref = tmp_path / "ref.safetensors"
    ref.write_bytes(b"")
    assert_usage_error(capsys, "--reference", ref, "--dtype", "float64", says=["--dtype", "from the file"])
