"""A reference file is a contract: ``flax-ln parity --reference F`` on an edited file.

Each case edits the metadata (or a tensor) of a reference written by ``--save-reference``
and runs ``flax-ln parity --reference F`` in this process. Metadata that breaks the schema,
and every other error from reading to the verdict, is exit 2 with one line naming the file
(and the field); exit 1 means a comparison failed or the file was altered since it was
written; nothing is a PASS that compared nothing.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file
from test_cli_errors import run  # flax-ln parity in this process: (exit code, stdout, stderr)

from flax_ln.book.reference import DIGEST_KEY, METADATA_KEY, digest
from flax_ln.cli import main


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One reference per builder family: LayerNorm, GPT, encoder-decoder (tiny: batch 1, 4 positions)."""
    folder = tmp_path_factory.mktemp("refs")
    paths = {}
    for model in ("layernorm", "gpt", "encoder-decoder"):
        paths[model] = folder / f"{model}.safetensors"
        args = ["parity", "--model", model, "--seq-len", "4", "--batch", "1", "--quiet"]
        assert main([*args, "--save-reference", str(paths[model])]) == 0
    return paths


def read(path):
    with safe_open(str(path), framework="numpy") as f:
        stored = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return json.loads(stored[METADATA_KEY]), tensors, stored


def write(path, metadata, tensors, *, redigest=True, text=None):
    """Save an edited reference; ``redigest``: with a digest of the edit (as if it had been written so)."""
    text = json.dumps(metadata) if text is None else text
    # safetensors' numpy writer stores a non-contiguous view's buffer, not its values: save what is digested
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    stored = {METADATA_KEY: text}
    if redigest:
        stored[DIGEST_KEY] = digest(json.loads(text), tensors)
    save_file(tensors, str(path), metadata=stored)
    return path


def entry(side, field):
    """The packed dict ``side[field]`` as a Python dict of name -> packed node (a view to edit in place)."""
    return side[field]["dict"]


def drop_from_dict(side, field, name):
    side[field]["dict"] = [pair for pair in side[field]["dict"] if pair[0] != name]


def scale_weight(meta, tensors, factor=3.0):
    key = next(k for k in tensors if "/state_dict/" in k)
    tensors[key] = tensors[key] * np.asarray(factor, tensors[key].dtype)


DEEP = "__deep__"


def nested(depth):
    """A placeholder for JSON nested ``depth`` deep (too deep for json.dumps), spliced in by the test."""
    return f"{DEEP}{depth}"


def _set_input(index, array_fn):
    def edit(meta, tensors):
        key = meta["models"][0]["side"]["inputs"]["list"][index]["tensor"]
        tensors[key] = array_fn(tensors[key], meta)

    return edit


def _remove_expected_and_kinds(meta, tensors):
    scale_weight(meta, tensors)
    side = meta["models"][0]["side"]
    del side["expected"], side["kinds"]


def _empty_expected(meta, tensors):
    scale_weight(meta, tensors)
    side = meta["models"][0]["side"]
    side["expected"], side["kinds"] = {"dict": []}, {"dict": []}


def _outputs_only(meta, tensors):
    side = meta["models"][0]["side"]
    kinds = dict((k, v["value"]) for k, v in entry(side, "kinds"))
    for name, kind in kinds.items():
        if kind != "output":
            drop_from_dict(side, "expected", name)
            drop_from_dict(side, "kinds", name)


def _zero_element_expected(meta, tensors):
    key = meta["models"][0]["side"]["expected"]["dict"][0][1]["tensor"]
    tensors[key] = tensors[key][:0]


def _integer_weights(meta, tensors):
    key = next(k for k in tensors if "/state_dict/" in k)
    tensors[key] = tensors[key].astype(np.int32)


def _extra_weight(meta, tensors):
    side = meta["models"][0]["side"]
    tensors["0/state_dict/extra"] = np.ones(3, np.float32)
    side["state_dict"]["dict"].append(["extra", {"tensor": "0/state_dict/extra"}])


def _missing_weight(meta, tensors):
    side = meta["models"][0]["side"]
    name = side["state_dict"]["dict"][0][0]
    drop_from_dict(side, "state_dict", name)


def _spec(**changes):
    def edit(meta, tensors):
        spec = meta["models"][0]["spec"]
        for k, v in changes.items():
            if v is KeyError:
                del spec[k]
            else:
                spec[k] = v

    return edit


def _config(**changes):
    def edit(meta, tensors):
        meta["models"][0]["spec"]["config"].update(changes)

    return edit


def _side(**changes):
    def edit(meta, tensors):
        meta["models"][0]["side"].update(changes)

    return edit


def _settings(**changes):
    def edit(meta, tensors):
        for k, v in changes.items():
            if v is KeyError:
                del meta["settings"][k]
            else:
                meta["settings"][k] = v

    return edit


def _unknown_kind(meta, tensors):
    side = meta["models"][0]["side"]
    side["kinds"]["dict"][0][1] = {"value": "evil"}


def _wrong_truth(meta, tensors):
    side = meta["models"][0]["side"]
    tensors["0/truth/output"] = np.zeros((1, 2), np.float64)
    side["truth"] = {"dict": [["output", {"tensor": "0/truth/output"}]]}


def _token_equal_to_vocab(meta, tensors):
    vocab = meta["models"][0]["spec"]["config"]["vocab_size"]
    key = meta["models"][0]["side"]["inputs"]["list"][0]["tensor"]
    tensors[key] = np.full_like(tensors[key], vocab)


def _models(value):
    def edit(meta, tensors):
        meta["models"] = value

    return edit


# (case id, which reference, edit(meta, tensors), words the error must contain)
CASES = [
    # false PASS: forged files that would otherwise pass with too little, or the wrong thing, compared
    ("no expected and kinds, a weight x3", "layernorm", _remove_expected_and_kinds, ["expected", "kinds"]),
    ("expected and kinds empty", "layernorm", _empty_expected, ["models[0].side.expected", "no output"]),
    ("outputs only, no gradient", "layernorm", _outputs_only, ["no input grad or param grad"]),
    ("zero-element expected tensor", "layernorm", _zero_element_expected, ["zero elements"]),
    ("models: []", "layernorm", _models([]), ["models", "non-empty"]),
    ("dtype bfloat16", "layernorm", _settings(dtype="bfloat16"), ["settings.dtype", "bfloat16"]),
    ("side dtype bfloat16", "layernorm", _side(dtype={"value": "bfloat16"}), ["side.dtype"]),
    ("mode evil", "layernorm", _side(mode={"value": "evil"}), ["side.mode", "evil"]),
    # memory bombs
    ("features 1e10", "layernorm", _spec(features=1e10), ["spec.features", "10000000000.0"]),
    ("features 10**10", "layernorm", _spec(features=10**10), ["spec.features"]),
    ("GPT block_size 1e6", "gpt", _config(block_size=10**6), ["config.block_size"]),
    ("GPT block_size swapped with vocab_size", "gpt", _config(block_size=50, vocab_size=32), ["config.block_size"]),
    ("GPT n_layer 100", "gpt", _config(n_layer=100), ["spec", "parameter elements"]),
    # the reference module's own errors
    ("unknown builder", "layernorm", _spec(builder="Evil"), ["spec.builder", "Evil"]),
    ("module path as builder", "layernorm", _spec(builder="os.system"), ["spec.builder"]),
    ("no builder", "layernorm", _spec(builder=KeyError), ["spec.builder", "None"]),
    # what was a ConversionError
    ("integer weights", "layernorm", _integer_weights, ["state_dict", "int32"]),
    ("an extra weight", "layernorm", _extra_weight, ["could not be checked", "ConversionError"]),
    ("a missing weight", "layernorm", _missing_weight, ["param_names", "not in the state dict"]),
    ("wrong features", "layernorm", _spec(features=256), ["spec", "parameter elements"]),
    # JAX shape errors
    ("inputs cut", "layernorm", _set_input(0, lambda x, m: x[..., :256]), ["side.expected.grad x", "shape"]),
    ("empty batch", "layernorm", _set_input(0, lambda x, m: x[:0]), ["inputs[x]", "batch of 1"]),
    ("empty batch in settings too", "layernorm", _settings(batch=0), ["settings.batch"]),
    # what was a KeyError
    ("unknown kind", "layernorm", _unknown_kind, ["kinds", "evil"]),
    ("jvp without tangents", "layernorm", _side(mode={"value": "jvp"}), ["no tangent"]),
    ("no batch in settings", "layernorm", _settings(batch=KeyError), ["settings.batch"]),
    # what was an IndexError
    ("no input names", "layernorm", _side(input_names={"list": []}), ["input_names"]),
    # what was a ValueError
    (
        "lm_logits naming a missing output",
        "gpt",
        lambda meta, tensors: meta["models"][0].update(lm_logits="nope"),
        ["lm_logits", "nope"],
    ),
    ("a token id equal to the vocabulary", "gpt", _token_equal_to_vocab, ["could not be checked", "ValueError"]),
    ("float64 truth of the wrong shape", "layernorm", _wrong_truth, ["truth.output", "shape"]),
    # what was a TypeError / AttributeError
    ("string spec", "layernorm", lambda meta, tensors: meta["models"][0].update(spec="LayerNorm"), ["spec"]),
    ("negative features", "layernorm", _spec(features=-4), ["spec.features", "-4"]),
    ("__class__ config key", "gpt", _config(__class__="x"), ["config", "__class__"]),
    ("encoder-decoder N 0", "encoder-decoder", lambda m, t: m["models"][0]["spec"]["sizes"].update(N=0), ["sizes.N"]),
    (
        "encoder-decoder ffn_activation",
        "encoder-decoder",
        _spec(ffn_activation="gelu"),
        ["ffn_activation"],
    ),
    ("GPT n_head not dividing n_embd", "gpt", _config(n_head=3), ["spec", "does not describe a model", "n_head"]),
    ("an unexpected keyword", "layernorm", _side(kwargs={"dict": [["evil", {"value": 1}]]}), ["could not be checked"]),
    ("unknown forward", "layernorm", lambda m, t: m["models"][0].update(forward="evil"), ["forward", "evil"]),
    ("a tensor name the file lacks", "layernorm", _side(inputs={"list": [{"tensor": "nope"}]}), ["nope"]),
    # what was a RecursionError
    ("metadata nested 5,000 deep", "layernorm", _settings(extra=nested(5000)), ["nests", "deep"]),
    ("metadata nested 100 deep", "layernorm", _settings(extra=nested(100)), ["nests", "deep"]),
]


@pytest.mark.parametrize(("case", "model", "edit", "says"), CASES, ids=[c[0] for c in CASES])
def test_a_broken_reference_is_a_usage_error_naming_file_and_field(
    references, tmp_path, capsys, case, model, edit, says
):
    meta, tensors, _ = read(references[model])
    edit(meta, tensors)
    text = json.dumps(meta)
    for depth in (100, 5000):
        text = text.replace(f'"{DEEP}{depth}"', "[" * depth + "0" + "]" * depth)
    path = write(tmp_path / "edited.safetensors", meta, tensors, text=text, redigest=DEEP not in json.dumps(meta))
    code, out, err = run(capsys, "--reference", path)
    assert code == 2, (case, out, err)
    assert "Traceback" not in err and "PASS" not in out
    lines = [line for line in err.splitlines() if line.startswith("flax-ln parity: error:")]
    assert len(lines) == 1, err
    assert str(path) in lines[0], lines[0]
    for text in says:
        assert text in lines[0], (case, lines[0])


def test_an_unedited_reference_passes_and_has_a_digest(references, capsys):
    for path in references.values():
        _, _, stored = read(path)
        assert DIGEST_KEY in stored
        code, out, err = run(capsys, "--reference", path, "--quiet")
        assert code == 0, out + err
        assert "no digest" not in err


def test_an_altered_tensor_is_reported_altered_with_exit_1(references, tmp_path, capsys):
    meta, tensors, _ = read(references["layernorm"])
    scale_weight(meta, tensors, 1.002)
    path = tmp_path / "altered.safetensors"
    original = read(references["layernorm"])[2][DIGEST_KEY]
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(meta), DIGEST_KEY: original})
    report = tmp_path / "r.json"
    code, out, err = run(capsys, "--reference", path, "--json", report)
    assert code == 1, out + err
    assert "ALTERED" in out and "altered" in err and "building" not in err
    assert json.loads(report.read_text())["verdict"] == "altered"


def test_altered_metadata_is_reported_altered(references, tmp_path, capsys):
    meta, tensors, stored = read(references["layernorm"])
    meta["models"][0]["spec"]["eps"] = 0.1  # a valid spec, a wrong twin
    path = tmp_path / "altered.safetensors"
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(meta), DIGEST_KEY: stored[DIGEST_KEY]})
    code, out, err = run(capsys, "--reference", path)
    assert code == 1 and "ALTERED" in out and "PASS" not in out, out + err


def _flip_low_bit(meta, tensors):
    key = next(k for k in tensors if "/state_dict/" in k)
    tensors[key] = (tensors[key].view(np.uint32) ^ np.uint32(1)).view(np.float32)  # the last mantissa bit


@pytest.mark.parametrize("edit", [lambda meta, tensors: None, _flip_low_bit], ids=["as written", "a low bit flipped"])
def test_a_reference_without_digest_is_refused_with_the_fix(references, tmp_path, capsys, edit):
    meta, tensors, _ = read(references["layernorm"])
    edit(meta, tensors)
    path = write(tmp_path / "old.safetensors", meta, tensors, redigest=False)
    code, out, err = run(capsys, "--reference", path, "--quiet")
    assert code == 2, out + err
    assert "PASS" not in out and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("flax-ln parity: error:")]
    assert str(path) in line and "no 'flax_ln_reference_sha256' digest" in line, line
    assert "write the file again with --save-reference" in line, line


def _retype_a_gradient(meta, tensors):
    side = meta["models"][0]["side"]
    kinds = dict((k, v["value"]) for k, v in entry(side, "kinds"))
    name = next(k for k, kind in kinds.items() if kind != "output")
    key = dict(entry(side, "expected"))[name]["tensor"]
    tensors[key] = tensors[key].astype(np.float16)  # a dtype the schema refuses


def _an_extra_output(meta, tensors):
    side = meta["models"][0]["side"]
    output = next(k for k, v in entry(side, "kinds") if v["value"] == "output")
    tensors["0/expected/extra"] = tensors[dict(entry(side, "expected"))[output]["tensor"]].copy()
    side["expected"]["dict"].append(["extra", {"tensor": "0/expected/extra"}])


@pytest.mark.parametrize("edit", [_retype_a_gradient, _an_extra_output], ids=["a re-typed gradient", "an extra output"])
def test_an_altered_file_that_also_breaks_the_schema_is_reported_altered(references, tmp_path, capsys, edit):
    """The digest is checked before the schema: an edit after writing is ALTERED (exit 1), whatever it breaks."""
    meta, tensors, stored = read(references["layernorm"])
    edit(meta, tensors)
    path = tmp_path / "altered.safetensors"
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(meta), DIGEST_KEY: stored[DIGEST_KEY]})
    code, out, err = run(capsys, "--reference", path)
    assert code == 1, out + err
    assert "ALTERED" in out and "altered" in err and "PASS" not in out and "field" not in err, out + err
    # the same edit, written with its own digest, is a usage error (exit 2)
    write(path, meta, tensors)
    code, out, err = run(capsys, "--reference", path)
    assert code == 2 and "flax-ln parity: error:" in err and "ALTERED" not in out, out + err


def test_a_wrong_twin_in_a_consistent_file_is_a_parity_fail(references, tmp_path, capsys):
    meta, tensors, _ = read(references["layernorm"])
    scale_weight(meta, tensors, 1.002)  # the stored weights differ from those the expected values came from
    path = write(tmp_path / "wrong.safetensors", meta, tensors)
    code, out, err = run(capsys, "--reference", path, "--quiet")
    assert code == 1 and "FAIL" in out, out + err


def test_reference_with_dtype_is_a_usage_error(references, capsys):
    for dtype in ("float32", "float64"):
        code, out, err = run(capsys, "--reference", references["layernorm"], "--dtype", dtype)
        assert code == 2 and "--dtype" in err and "file" in err and "building" not in err, err


def test_a_saved_reference_follows_the_umask(tmp_path, capsys):
    ref = tmp_path / "ref.safetensors"
    old = os.umask(0o027)
    try:
        code, out, err = run(capsys, "--model", "layernorm", "--seq-len", "4", "--batch", "1", "--save-reference", ref)
    finally:
        os.umask(old)
    assert code == 0, out + err
    assert ref.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["ref.safetensors"]  # no temporary file left
