"""compare_streamed: the whole-model comparison stage by stage from a checkpoint. On the book's GPT (both
scan_layers settings, found by themselves) and on the Llama port with its declared stages against transformers,
it agrees with compare_modules tensor for tensor, passing and failing, and names the same place; it reads one
stage's weights at a time; and its inputs are checked before any compute."""

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import linen, nnx
from safetensors.torch import save_file

import flax_ln
import torch_ref
from flax_ln.convert import ConversionError
from flax_ln.parity import Stage, Stages, compare_modules, compare_streamed, parameters_on_meta
from flax_ln.parity.streamed.compare import Streamed
from flax_ln.parity.streamed.sides import Checkpoint
from flax_ln.parity.streamed.stages import gpt_stages

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ is not installed; the port is imported from the checkout
    sys.path.insert(0, str(ROOT))
from test_localization import BATCH, HEAD, HEADS, LM, SEQ, VOCAB, TorchLM, lm_key_map, randomized  # noqa: E402

from examples.ports import llama  # noqa: E402

CONFIG = flax_ln.GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16)
IDS = np.random.default_rng(0).integers(0, 64, (2, 8))


def save(state_dict, folder: Path, drop=()) -> Path:
    """A torch state dict as ``folder/model.safetensors`` (a tie stored once: ``drop`` its other names)."""
    kept = {k: v.detach().contiguous().clone() for k, v in state_dict.items() if k not in drop}
    save_file(kept, folder / "model.safetensors")
    return folder


def meta_gpt():
    with torch.device("meta"):
        return torch_ref.GPT(CONFIG).eval()


def abstract_gpt(scan: bool, dtype="float32", plant_eps: float | None = None):
    with jax.enable_x64(dtype == "float64"):
        port = nnx.eval_shape(
            lambda: flax_ln.GPT(CONFIG, scan_layers=scan, param_dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
        )
    if plant_eps is not None:
        port.transformer.h[1].ln_1.eps = plant_eps
    return port


def real_gpt(scan: bool, plant_eps: float | None = None):
    port = flax_ln.GPT(CONFIG, scan_layers=scan, rngs=nnx.Rngs(0))
    if plant_eps is not None:
        port.transformer.h[1].ln_1.eps = plant_eps
    return port


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = torch_ref.GPT(CONFIG).eval()
    with torch.no_grad():  # biases and norms away from their init, so that every gradient carries a signal
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape))
    return model, save(model.state_dict(), tmp_path_factory.mktemp("gpt"))


def assert_same_results(streamed, whole):
    """Tensor for tensor: the same names in the same order, the same verdicts, and errors that differ by less
    than the policy's bound (each is an error against torch's value of that tensor; the two runs differ only in
    how each side's work is cut into jitted stages, which changes op order within rounding)."""
    assert [r.name for r in streamed.results] == [r.name for r in whole.results]
    for s, w in zip(streamed.results, whole.results):
        assert (s.passed, s.passed_by, s.shape, s.kind) == (w.passed, w.passed_by, w.shape, w.kind), s.name
        if s.passed_by == "zero":  # rounding noise around an exact zero on both sides: its relative error is noise
            continue
        bound = s.tolerance.rtol
        assert abs(s.relative_error - w.relative_error) <= bound * max(1.0, w.relative_error), s.name
    assert streamed.passed == whole.passed


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_gpt_streamed_agrees_with_the_whole_model_comparison_and_reads_one_stage_at_a_time(
    gpt_checkpoint, scan, monkeypatch
):
    """Unrolled, the default (float32 with the float64 check beside it); scanned, float64 alone (the stacked
    layers' slices): every dtype agrees with compare_modules, and the checkpoint is read one stage at a time,
    never a whole model's weights."""
    torch_model, folder = gpt_checkpoint
    reads = []
    read = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, keys: reads.append(list(keys)) or read(self, keys))
    dtype = "float64" if scan else None
    streamed = compare_streamed(meta_gpt(), abstract_gpt(scan, dtype or "float32"), IDS, checkpoint=folder, dtype=dtype)
    whole = compare_modules(torch_model, real_gpt(scan), IDS, dtype=dtype)
    assert streamed.passed, str(streamed)
    assert_same_results(streamed, whole)
    if dtype is None:
        assert_same_results(streamed.float64_check, whole.float64_check)
    layers = {k.split(".")[2] for keys in reads for k in keys if k.startswith("transformer.h.")}
    assert layers == {"0", "1", "2"}
    assert max(len({k.split(".")[2] for k in keys if k.startswith("transformer.h.")}) for keys in reads) == 1
    assert all(not any(k.startswith("transformer.h.") for k in keys) for keys in reads if "lm_head.weight" in keys)


def test_a_bfloat16_checkpoint_is_compared_in_float64_as_its_weights_widened(gpt_checkpoint, tmp_path):
    """Real checkpoints are mostly stored in bfloat16: its tensors are widened to the comparison's dtype, so the
    streamed run agrees with the whole-model one on the same weights widened in torch."""
    torch_model, _ = gpt_checkpoint
    rounded = torch_ref.GPT(CONFIG).eval()
    rounded.load_state_dict({k: v.bfloat16().float() for k, v in torch_model.state_dict().items()})
    folder = save({k: v.bfloat16() for k, v in torch_model.state_dict().items()}, tmp_path)
    streamed = compare_streamed(meta_gpt(), abstract_gpt(False, "float64"), IDS, checkpoint=folder, dtype="float64")
    whole = compare_modules(rounded, real_gpt(False), IDS, dtype="float64")
    assert streamed.passed, str(streamed)
    assert_same_results(streamed, whole)


def test_a_planted_layernorm_eps_is_named_where_the_whole_model_comparison_names_it(gpt_checkpoint):
    """float64: every tensor fails or passes as in compare_modules, the first divergence and the isolated culprit
    are the same module, and the note names the block's stage as the first to differ alone."""
    torch_model, folder = gpt_checkpoint
    port = abstract_gpt(False, "float64", 1e-2)
    streamed = compare_streamed(meta_gpt(), port, IDS, checkpoint=folder, dtype="float64")
    whole = compare_modules(torch_model, real_gpt(False, 1e-2), IDS, dtype="float64")
    assert not streamed.passed
    assert_same_results(streamed, whole)
    assert streamed.first_divergence.module == whole.first_divergence.module == "transformer.h.1.ln_1"
    assert streamed.isolation.culprits == whole.isolation.culprits == ["transformer.h.1.ln_1"]
    assert "'block 1' (torch transformer.h.1) is the first whose own computation differs" in streamed.localization_note


def llama_parts(tmp_path, dtype):
    hf = llama_hf(dtype)
    folder = save(hf.state_dict(), tmp_path, drop=("lm_head.weight",))  # the tie stored once, as transformers does
    with parameters_on_meta():
        meta = transformers.LlamaForCausalLM(hf.config).to(getattr(torch, dtype))
    return hf, meta, folder, llama.config_from_hf(hf.config)


def llama_hf(dtype):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name else torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return hf.to(getattr(torch, dtype))


def llama_port(config, dtype, rope_base=None):
    with jax.enable_x64(dtype == "float64"):
        port = nnx.eval_shape(lambda: llama.Llama(config, param_dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    if rope_base is not None:
        port.blocks[1].attn.c = dataclasses.replace(port.blocks[1].attn.c, rope_base=rope_base)
    return port


@pytest.mark.parametrize("rope_base", [None, 5000.0], ids=["faithful", "planted-rope-base"])
def test_llama_port_with_declared_stages_agrees_with_the_whole_model_comparison(tmp_path, rope_base):
    """transformers' Llama (a tie stored once, rotary tables and the mask as extras, inv_freq rebuilt in float64)
    against the port through its key map: float64 agrees tensor for tensor, the tie's gradient is the sum of both
    stages', and a RoPE base planted in block 1 is named as that block's attention on both."""
    hf, meta, folder, config = llama_parts(tmp_path, "float64")
    ids = np.random.default_rng(1).integers(0, 64, (2, 7))
    options = dict(weights=llama.KEY_MAP, dtype="float64")
    streamed = compare_streamed(
        meta, llama_port(config, "float64", rope_base), ids, checkpoint=folder, stages=llama.stages(config), **options
    )
    logits = (lambda m, x: m(x).logits, None)  # transformers returns a ModelOutput; the last stage gives the logits
    whole = compare_modules(hf, llama_port(config, "float64", rope_base), ids, forward=logits, **options)
    assert_same_results(streamed, whole)
    assert "lm_head.weight" not in [r.name for r in streamed.results]  # compared once, under named_parameters' name
    assert any(i.what == "buffer inv_freq rebuilt in float64" for i in streamed.islands)
    if rope_base is None:
        assert streamed.passed, str(streamed)
        assert streamed["model.embed_tokens.weight"].relative_error < 1e-12
    else:
        assert not streamed.passed
        assert streamed.first_divergence.module == whole.first_divergence.module == "model.layers.1.self_attn"
        assert streamed.first_divergence.flax_module == "blocks.1.attn"


def lm_stages():
    """The localisation tests' language model (its attention's key bias has a gradient that is zero in the
    mathematics: softmax ignores a shift shared by every key) as embedding, two layers and head."""

    def torch_extras(model, ids, dtype):
        return {"mask": torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()}

    def flax_extras(model, ids, dtype):
        empty = jnp.zeros((ids.shape[0], 0, HEADS, HEAD), dtype)  # (B, 0, n, h): nothing cached
        return {"mask": jnp.tril(jnp.ones((ids.shape[1], ids.shape[1]), bool)), "cache": (empty, empty)}

    def embed(m, x, e):
        return m[0](x[0])

    def head(m, x, e):
        return m[1](m[0](x))

    return Stages(
        [
            Stage("embedding", ("embed_tokens",), ("embedder",), embed, embed),
            Stage(
                "layer {i}",
                ("layers.{i}",),
                ("layers.{i}",),
                lambda m, x, e: m[0](x, e["mask"]),
                lambda m, x, e: m[0](x, e["mask"], cache=e["cache"]),
                layers=2,
            ),
            Stage("head", ("norm", "lm_head"), ("norm", "head"), head, head),
        ],
        torch_extras=torch_extras,
        flax_extras=flax_extras,
    )


@pytest.mark.parametrize("dtype", ["float32", None], ids=["explicit-float32", "default"])
def test_a_gradient_float64_shows_is_zero_passes_and_islands_are_named_as_in_the_whole_model_comparison(
    tmp_path, dtype
):
    """The key biases' float32 gradients are noise around an exact zero and fail the relative tolerance. With
    dtype="float32" alone the streamed comparison asks a float64 streamed run which gradients are zero, as
    compare_modules asks a float64 run; by default the float64 check says. Both pass them as zero. The float64
    check names the port's float32 island (nnx.Embed's own compute dtype) by its path in the whole model."""
    torch_model = randomized(TorchLM(), "float32")
    folder = save(torch_model.state_dict(), tmp_path)
    with parameters_on_meta():
        meta = TorchLM()
    ids = np.random.default_rng(1).integers(0, VOCAB, (BATCH, SEQ))
    options = dict(weights=lm_key_map(), dtype=dtype)
    streamed = compare_streamed(meta, nnx.eval_shape(lambda: LM("float32")), ids, checkpoint=folder,
                                stages=lm_stages(), **options)  # fmt: skip
    whole = compare_modules(torch_model, nnx.eval_shape(lambda: LM("float32")), ids, **options)
    assert streamed.passed, str(streamed)
    assert_same_results(streamed, whole)
    zero = [r.name for r in streamed.results if r.passed_by == "zero"]
    assert zero == ["layers.0.attn.k_proj.bias", "layers.1.attn.k_proj.bias"]
    if dtype is None:
        flax_islands = [i for i in streamed.float64_check.islands if i.side == "flax"]
        assert flax_islands == [i for i in whole.float64_check.islands if i.side == "flax"]
        assert [i.module for i in flax_islands] == ["embedder.table"]


# ---------------------------------------------------------------------------------------------
# Inputs checked before any compute


def test_a_checkpoint_missing_keys_is_refused_listing_them(gpt_checkpoint, tmp_path):
    torch_model, _ = gpt_checkpoint
    folder = save(torch_model.state_dict(), tmp_path, drop=("transformer.h.2.mlp.c_fc.weight", "lm_head.weight"))
    with pytest.raises(ConversionError) as err:
        compare_streamed(meta_gpt(), abstract_gpt(False), IDS, checkpoint=folder, dtype="float32")
    assert "transformer.h.2.mlp.c_fc.weight" in str(err.value) and "lm_head.weight" in str(err.value)


def test_a_checkpoint_that_is_no_safetensors_is_refused_naming_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no safetensors checkpoint"):
        compare_streamed(meta_gpt(), abstract_gpt(False), IDS, checkpoint=tmp_path, dtype="float32")


def test_stages_that_leave_out_a_parameter_are_refused(gpt_checkpoint):
    """Without the head stage lm_head's gradient would never be compared: refused, naming it."""
    _, folder = gpt_checkpoint

    def block(m, x, e):
        return m[0](x)

    blocks = Stages([Stage("block {i}", ("transformer.h.{i}",), ("transformer.h.{i}",), block, block, layers=3)])
    with pytest.raises(ValueError, match="lm_head.weight"):
        compare_streamed(meta_gpt(), abstract_gpt(False), IDS, checkpoint=folder, stages=blocks, dtype="float32")


def test_a_model_without_known_stages_asks_for_a_declaration(gpt_checkpoint):
    _, folder = gpt_checkpoint
    with pytest.raises(ValueError, match="stages=Stages"):
        compare_streamed(torch.nn.Linear(2, 2), nnx.Linear(2, 2, rngs=nnx.Rngs(0)), np.ones((1, 2)), checkpoint=folder)


def test_half_precision_is_refused(gpt_checkpoint):
    _, folder = gpt_checkpoint
    with pytest.raises(ValueError, match="float32 or float64"):
        compare_streamed(meta_gpt(), abstract_gpt(False), IDS, checkpoint=folder, dtype="bfloat16")


def test_a_key_map_problem_is_listed_before_any_stage_runs(tmp_path):
    """A rule's layout the shapes refuse (o_proj read with q's pattern) is the loader's error, for the whole model."""
    _, meta, folder, config = llama_parts(tmp_path, "float32")
    source = llama.KEY_MAP.to_source().replace('"d (n h) -> n h d"', '"(n h) d -> d n h"')  # o_proj read as q
    bad = eval(source, {"KeyMap": flax_ln.KeyMap})  # to_source() writes a map as Python that rebuilds it
    with pytest.raises(ConversionError, match="o_proj"):
        compare_streamed(meta, llama_port(config, "float32"), np.zeros((1, 4), int), checkpoint=folder,
                         stages=llama.stages(config), weights=bad, dtype="float32")  # fmt: skip


def test_parameters_on_meta_keeps_the_buffers_a_constructor_computes():
    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)
            self.register_buffer("table", torch.arange(4.0), persistent=False)

    with parameters_on_meta():
        module = WithBuffer()
    assert module.linear.weight.is_meta and module.linear.weight.requires_grad
    assert not module.table.is_meta and module.table.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert not torch.nn.Linear(2, 2).weight.is_meta  # restored after the scope


def test_a_model_built_on_meta_whole_is_refused_with_the_fix(tmp_path):
    """Built under torch.device("meta"), transformers' rotary inv_freq (no checkpoint holds it) has no values: the
    extras computed from it would be meta tensors. Refused, with parameters_on_meta as the fix."""
    hf = llama_hf("float32")
    folder = save(hf.state_dict(), tmp_path, drop=("lm_head.weight",))
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(hf.config)
    config = llama.config_from_hf(hf.config)
    with pytest.raises(ValueError, match="parameters_on_meta"):
        compare_streamed(meta, llama_port(config, "float32"), np.zeros((1, 4), int), checkpoint=folder,
                         stages=llama.stages(config), weights=llama.KEY_MAP, dtype="float32")  # fmt: skip


def test_a_stage_path_that_names_no_module_is_refused_before_any_stage_runs(gpt_checkpoint, monkeypatch):
    """A typo in the last stage's flax path is found before the first stage's weights are read."""
    _, folder = gpt_checkpoint
    monkeypatch.setattr(Checkpoint, "read", lambda self, keys: pytest.fail("a stage ran before the paths were checked"))
    auto = gpt_stages(meta_gpt(), abstract_gpt(False))
    head = dataclasses.replace(auto.stages[-1], flax=("transformer.ln_f", "lm_heed"))
    stages = Stages([*auto.stages[:-1], head])
    with pytest.raises(ValueError, match="lm_heed"):
        compare_streamed(meta_gpt(), abstract_gpt(False), IDS, checkpoint=folder, stages=stages, dtype="float32")


def test_a_linen_module_or_a_function_is_refused_naming_compare_modules(gpt_checkpoint):
    _, folder = gpt_checkpoint
    stages = gpt_stages(meta_gpt(), abstract_gpt(False))
    for port in (linen.Dense(16), lambda x: x):
        with pytest.raises(TypeError, match="NNX module .* compare_modules"):
            compare_streamed(meta_gpt(), port, IDS, checkpoint=folder, stages=stages)


def test_an_error_in_a_declared_stage_names_the_stage_and_the_step(gpt_checkpoint):
    """A declaration's mistake (an extra it never computed) raises the caller's own error, with a note saying
    which stage and which side's step raised it."""
    _, folder = gpt_checkpoint
    stages = gpt_stages(meta_gpt(), abstract_gpt(False))
    block = next(s for s in stages.stages if s.layers)
    wrong = dataclasses.replace(block, flax_run=lambda m, x, e: m[0](x) + e["missing"])
    stages = dataclasses.replace(stages, stages=[wrong if s is block else s for s in stages.stages])
    with pytest.raises(KeyError, match="missing") as err:
        compare_streamed(meta_gpt(), abstract_gpt(False), IDS, checkpoint=folder, stages=stages, dtype="float32")
    if sys.version_info >= (3, 11):  # notes are Python 3.11's
        ours = "compare_streamed: raised in forward: stage 2/5 'block 0': flax forward"
        assert err.value.__notes__[-1].startswith(ours)  # after jax's own note on its filtered traceback


def test_an_error_in_running_a_stage_alone_keeps_the_verdict_and_every_result(gpt_checkpoint, monkeypatch):
    """Localisation never costs the verdict: the failing report keeps every result, and its note says what failed."""
    _, folder = gpt_checkpoint

    def broken(self, k, *args):
        raise RuntimeError("planted")

    monkeypatch.setattr(Streamed, "_alone", broken)
    port = abstract_gpt(False, "float64", 1e-2)
    report = compare_streamed(meta_gpt(), port, IDS, checkpoint=folder, dtype="float64")
    assert not report.passed and len(report.results) == 1 + len(list(meta_gpt().parameters()))
    assert "running stage 1/5 'embedding' alone failed (RuntimeError: planted)" in report.localization_note
