"""keras-hub conversions against their transformers originals, with no rule written: a tiny transformers folder
converted by keras-hub's own converter (``Backbone.from_preset``), its key map discovered through that converter
(``kind="keras"``), and the default comparison. A Llama decoder converts faithfully (PASS, float64 at float64
rounding; ``examples/ports/keras_hub_llama.py``, the recipe of docs/ports.md, "A Keras model"); a planted eps in one
sublayer is named on both sides. BERT does not: keras-hub builds its feed-forward
with the tanh approximation of GELU where transformers' ``hidden_act="gelu"`` is the exact (erf) one; the float64
check names that module on both sides, and passes once its activation is the exact GELU. Skipped without keras or
keras-hub, except under ``CI=true``, where a missing one fails."""

import sys
from pathlib import Path

import pytest
import torch
import transformers

from flax_ln.convert import KeyMap
from flax_ln.parity import compare_modules
from flax_ln.parity.sides.keras import layer_paths

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ is not installed; the ports are imported from the checkout
    sys.path.insert(0, str(ROOT))
from examples.ports import keras_hub_llama  # noqa: E402

IDS, MASK = keras_hub_llama.inputs()


def converted(keras_hub, hf, tmp_path):
    """The transformers model saved to a folder, keras-hub's conversion of it, and the key map its converter
    implements, discovered through it."""
    hf.save_pretrained(tmp_path)

    def loader(folder):
        return keras_hub.models.Backbone.from_preset(str(folder))

    return loader(tmp_path), KeyMap.discover(loader, hf, takes="folder", kind="keras")


def worst(report):
    """The largest relative error of a report's tensors, the gradients float64 shows are zero left out (noise)."""
    return max(r.relative_error for r in report.results if r.passed_by != "zero")


def layer(model, path):
    return next(found for p, found in layer_paths(model).values() if p == path)


@pytest.fixture(scope="module")
def llama():
    return keras_hub_llama.hf_llama()


def test_llama_conversion_passes_with_a_discovered_map(keras_hub, llama, tmp_path):
    llama.save_pretrained(tmp_path)
    key_map = keras_hub_llama.key_map(llama)
    assert "transformer_layer_0/self_attention/query/kernel" in key_map.to_source()
    report = keras_hub_llama.check(llama, keras_hub_llama.convert(tmp_path), key_map)
    assert report.passed, report
    assert "model.embed_tokens.weight" in report.ties  # the tied head, found by discovery
    assert report.float64_check is not None and report.float64_check.passed, report
    assert worst(report.float64_check) < 1e-12, report  # float64 rounding


def test_a_planted_eps_is_named_by_keras_path_and_torch_name(keras_hub, llama, tmp_path):
    llama.save_pretrained(tmp_path)
    model = keras_hub_llama.convert(tmp_path)
    layer(model, "transformer_layer_0/feedforward_layernorm").epsilon = 0.5  # transformers' is 1e-6
    report = keras_hub_llama.check(llama, model, keras_hub_llama.key_map(llama), dtype="float32")
    assert not report.passed
    fd = report.first_divergence
    assert (fd.module, fd.flax_module) == (
        "model.layers.0.post_attention_layernorm",
        "transformer_layer_0/feedforward_layernorm",
    ), report
    assert report.isolation.culprits == ["model.layers.0.post_attention_layernorm"], report
    assert report.isolation.flax_culprits == ["transformer_layer_0/feedforward_layernorm"], report


def test_bert_conversion_approximates_gelu_and_passes_once_corrected(keras, keras_hub, tmp_path):
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
        hidden_act="gelu",  # the exact GELU, erf
    )
    torch.manual_seed(0)
    bert = transformers.BertModel(config).eval()
    model, key_map = converted(keras_hub, bert, tmp_path)

    def sequence_output(k, ids, mask):
        return k({"token_ids": ids, "padding_mask": mask, "segment_ids": ids * 0})["sequence_output"]

    forward = (lambda m, ids, mask: m(input_ids=ids, attention_mask=mask).last_hidden_state, sequence_output)
    check = compare_modules(bert, model, (IDS, MASK), weights=key_map, forward=forward, dtype="float64")
    assert not check.passed, check  # at these widths the approximation hides in float32's tolerance, not float64's
    assert (check.first_divergence.module, check.first_divergence.flax_module) == (
        "encoder.layer.0.intermediate",
        "transformer_layer_0/feedforward_intermediate_dense",
    ), check
    assert check.isolation.flax_culprits == ["transformer_layer_0/feedforward_intermediate_dense"], check

    layer(model, "transformer_layer_0/feedforward_intermediate_dense").activation = keras.activations.gelu  # erf
    corrected = compare_modules(bert, model, (IDS, MASK), weights=key_map, forward=forward, dtype="float64")
    assert corrected.passed, corrected
    assert worst(corrected) < 1e-12, corrected  # float64 rounding


def tiny_vit():
    config = transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=16, patch_size=8
    )
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(config).eval()


def test_saved_names_are_the_names_save_pretrained_writes(tmp_path):
    from safetensors import safe_open

    from flax_ln.convert.tensor_files import saved_names

    vit = tiny_vit()
    vit.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        written = set(f.keys())
    names = saved_names(vit)
    if int(transformers.__version__.split(".")[0]) >= 5:  # 5 names ViT's modules apart from its checkpoints; 4 did not
        assert names
    assert {names.get(k, k) for k in vit.state_dict()} == written


def test_vit_discovery_reads_the_saved_names(keras_hub, tmp_path):
    """keras-hub's ViT converter asks for a checkpoint's names (``vit.encoder.layer.0.attention.attention.query``);
    the probe folders hold them, so the map comes out under torch's own names."""
    vit = tiny_vit()
    key_map = KeyMap.discover(
        lambda folder: keras_hub.models.Backbone.from_preset(str(folder)),
        vit,
        takes="folder",
        kind="keras",
        allow_dropped=[r"classifier\..*"],  # the backbone has no classification head
    )
    source = key_map.to_source()
    assert "vit_encoder/transformer_block_1/mha/query/kernel" in source, source
    assert set(key_map.discovery.dropped) == {"classifier.weight", "classifier.bias"}


def test_gpt2_discovery_finds_the_split_and_the_tie(keras_hub, tmp_path):
    """GPT-2's fused ``c_attn`` (Conv1D, ``(in, 3 * out)``) is split by keras-hub into three ``EinsumDense``
    kernels: one torch key, three Keras variables, found with no rule written."""
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(config).eval()
    _, key_map = converted(keras_hub, gpt2, tmp_path)
    split = next(r for r in key_map.rules if "c_attn" in r.pattern and "weight" in r.pattern)
    targets = " ".join(split.templates)
    for part in ("query/kernel", "key/kernel", "value/kernel"):
        assert part in targets, key_map.to_source()
