"""The reference stands alone and its own Hugging Face GPT-2 reader is safe.

* ``torch_ref`` imports nothing from ``flax_ln``, JAX or flax (a subprocess with them
  blocked, and a static scan of its imports); configs cross as plain data.
* A random ``transformers.GPT2LMHeadModel`` saved to disk gives the same logits through
  transformers itself, ``torch_ref.load_hf_gpt2`` and ``flax_ln.load_hf_gpt2``, for the
  GPT2LMHeadModel, GPT2Model and sharded layouts.
* Hostile or careless folders are refused before anything is allocated, with messages
  naming the file, key and problem: half precision loads, integer/bool weights are
  refused, shard paths stay inside the folder, declared sizes must match the tensors,
  malformed JSON and incomplete weight sets are named.
"""

import ast
import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file

import flax_ln
import torch_ref

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(n_layer=2, n_head=2, n_embd=16, vocab_size=37, block_size=12)


# ---------------------------------------------------------------------------------------
# the reference stands alone


@pytest.mark.slow
def test_torch_ref_imports_and_runs_with_jax_unimportable():
    script = textwrap.dedent("""
        import importlib.abc, sys, types

        BLOCKED = ("jax", "jaxlib", "flax", "flax_ln", "optax", "orbax")

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"blocked in this test: {name}")
                return None

        sys.meta_path.insert(0, Block())
        import torch
        import torch_ref

        config = types.SimpleNamespace(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=6,
                                       embd_pdrop=0.1, resid_pdrop=0.1, attn_pdrop=0.1)
        gpt = torch_ref.GPT(config).eval()
        logits, loss = gpt(torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, 4]]))
        assert logits.shape == (1, 3, 11) and torch.isfinite(loss)
        model = torch_ref.make_model(9, 9, N=1, d_model=8, d_ff=16, h=2, dropout=0.0).eval()
        src = torch.tensor([[1, 2, 3, 0]])
        out = model(src, src, (src != 0).unsqueeze(-2), torch_ref.make_std_mask(src, 0))
        assert out.shape == (1, 4, 8) and torch.isfinite(out).all()
        loaded = [m for m in sys.modules if m.split(".")[0] in BLOCKED]
        assert not loaded, loaded
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_no_torch_ref_file_imports_the_port_or_jax():
    offending = []
    files = sorted((ROOT / "torch_ref").rglob("*.py"))
    assert len(files) >= 5  # __init__, layernorm, encoder_decoder, gpt, hf_gpt2
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            offending += [
                f"{file.name}:{node.lineno} {n}"
                for n in names
                if n.split(".")[0] in ("flax_ln", "jax", "jaxlib", "flax", "optax")
            ]
    assert not offending


class BookStyleConfig:
    """A config written like the book's chapter-11 ``Config``: plain attributes, no dataclass."""

    def __init__(self):
        self.n_layer, self.n_head, self.n_embd = 2, 2, 16
        self.vocab_size, self.block_size = 37, 12
        self.embd_pdrop = self.resid_pdrop = self.attn_pdrop = 0.1


@pytest.mark.parametrize("kind", ["book", "flax_ln", "namespace", "dict", "torch_ref"])
def test_configs_cross_between_packages_as_plain_data(kind):
    config = {
        "book": BookStyleConfig(),
        "flax_ln": flax_ln.GPTConfig(**TINY),
        "namespace": types.SimpleNamespace(**TINY),
        "dict": dict(TINY),
        "torch_ref": torch_ref.GPTConfig(**TINY),
    }[kind]
    torch_model = torch_ref.GPT(config).eval()
    expected = torch_ref.GPTConfig(**TINY)
    assert torch_model.config == expected  # defaults fill ignore_index, c_proj_reinit, dropouts
    flax_model = flax_ln.GPT(config, rngs=nnx.Rngs(0))
    assert flax_model.config == flax_ln.GPTConfig(**TINY)
    flax_ln.load_torch_state_dict(flax_model, torch_model.state_dict())
    flax_model.eval()
    graphdef, state = nnx.split(flax_model)  # the config is static graph data: it must hash
    idx = np.array([[3, 1, 4, 1, 5, 9]])
    logits = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i)[0])(state, jnp.asarray(idx))
    with torch.no_grad():
        reference = torch_model(torch.as_tensor(idx))[0].numpy()
    assert relative_error(np.asarray(logits), reference) <= 1e-5  # float32, same weights: op order only


def test_config_missing_fields_are_named():
    partial = types.SimpleNamespace(n_layer=2, n_head=2, n_embd=16)
    for make in (torch_ref.GPT, lambda c: flax_ln.GPT(c, rngs=nnx.Rngs(0))):
        with pytest.raises(TypeError, match=r"lacks \['vocab_size', 'block_size'\]"):
            make(partial)


def test_memory_estimate_counts_every_parameter_and_buffer():
    from torch_ref.gpt import gpt_float32_bytes

    for sizes in (TINY, dict(n_layer=3, n_head=4, n_embd=8, vocab_size=5, block_size=20)):
        model = torch_ref.GPT(sizes)
        counted = sum(t.numel() for t in model.state_dict().values())  # lm_head untied in torch_ref: counted
        assert gpt_float32_bytes(torch_ref.GPTConfig(**sizes)) == 4 * counted


def test_torch_ref_refuses_a_gpt_larger_than_memory():
    # n_layer * block_size^2 float32 mask buffers: 64 * 1e10 * 4 bytes = 2.5 TB, refused before allocation
    with pytest.raises(MemoryError, match=r"block_size=100000 need .* GiB"):
        torch_ref.GPT(dict(n_layer=64, n_head=1, n_embd=2, vocab_size=5, block_size=100_000))


# ---------------------------------------------------------------------------------------
# helpers


def relative_error(a, b):
    """``||a - b|| / ||b||`` in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_hf_model(seed=0, **overrides):
    """A tiny random GPT2LMHeadModel (eager attention) with O(1) activations in every parameter."""
    import transformers

    sizes = {"n_layer": 2, "n_head": 2, "n_embd": 16, "vocab_size": 37, "n_positions": 12, **overrides}
    config = transformers.GPT2Config(**sizes, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("wte.weight", "wpe.weight")):
                p.copy_(noise)
            elif p.ndim == 2:  # Conv1D (in, out)
                p.copy_(noise / math.sqrt(p.shape[0]))
            elif ".ln_" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)
    return model


def hf_logits(model, idx, dtype=torch.float64):
    with torch.no_grad():
        return model.to(dtype)(torch.as_tensor(idx)).logits.numpy()


def torch_ref_logits(model, idx):
    with torch.no_grad():
        return model(torch.as_tensor(idx))[0].numpy()


IDX = np.array([[1, 5, 9, 36, 0, 2, 7, 7, 3, 11, 30, 4], [8, 6, 4, 2, 0, 35, 1, 3, 5, 7, 9, 10]])


@pytest.fixture(scope="module")
def hf_model():
    return random_hf_model()


@pytest.fixture(scope="module")
def truth(hf_model):
    """float64 logits of the in-memory transformers model: the ground truth for every reader."""
    import copy

    return hf_logits(copy.deepcopy(hf_model), IDX)


def save(model, folder, **kwargs):
    model.save_pretrained(str(folder), **kwargs)
    return folder


# ---------------------------------------------------------------------------------------
# three readers, one folder


@pytest.mark.parametrize("layout", ["lm-head", "model-only", "sharded"])
def test_three_readers_agree_on_a_transformers_folder(tmp_path, hf_model, truth, layout):
    import copy

    import transformers

    if layout == "lm-head":
        folder = save(hf_model, tmp_path / layout)
    elif layout == "model-only":
        folder = save(hf_model.transformer, tmp_path / layout)  # GPT2Model: keys without "transformer."
    else:
        folder = save(hf_model, tmp_path / layout, max_shard_size=4000)
        assert len(list(folder.glob("model-*.safetensors"))) > 1
        assert (folder / "model.safetensors.index.json").is_file()
    assert not (folder / "pytorch_model.bin").exists()

    from_hf = transformers.GPT2LMHeadModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    ours64 = torch_ref.load_hf_gpt2(folder, dtype=torch.float64)
    ours32 = torch_ref.load_hf_gpt2(folder)
    assert not ours64.training and ours32.transformer.wte.weight.dtype == torch.float32
    # Every weight where it belongs: Conv1D transposed back, lm_head tied to wte.
    hf_state = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items()}
    for key, value in ours32.state_dict().items():
        if key.endswith(".attn.bias"):
            continue
        hf_key = "lm_head.weight" if key == "lm_head.weight" else key.removeprefix("transformer.")
        stored = hf_state[hf_key]
        if key.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            stored = stored.T
        np.testing.assert_array_equal(value.numpy(), stored.numpy(), err_msg=key)

    # float64: the same math in all three, so only op order differs (about 1e-16 per op).
    assert relative_error(hf_logits(copy.deepcopy(from_hf), IDX), truth) <= 1e-12
    assert relative_error(torch_ref_logits(ours64, IDX), truth) <= 1e-12
    with jax.enable_x64(True):
        flax64 = flax_ln.load_hf_gpt2(folder, param_dtype=jnp.float64)
        assert relative_error(flax64(jnp.asarray(IDX))[0], truth) <= 1e-12
    # float32 against the float64 truth: float32 rounding (eps 6e-8) through two blocks.
    assert relative_error(torch_ref_logits(ours32, IDX), truth) <= 1e-5
    flax32 = flax_ln.load_hf_gpt2(folder, scan_layers=True)
    with jax.default_matmul_precision("highest"):
        assert relative_error(flax32(jnp.asarray(IDX))[0], truth) <= 1e-5


def test_an_untied_folder_keeps_its_own_lm_head(tmp_path):
    import transformers

    model = random_hf_model(seed=3, tie_word_embeddings=False)
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()
    folder = save(model, tmp_path / "untied")
    ours = torch_ref.load_hf_gpt2(folder, dtype=torch.float64)
    np.testing.assert_array_equal(ours.lm_head.weight.detach().numpy(), model.lm_head.weight.detach().double().numpy())
    assert not torch.equal(ours.lm_head.weight, ours.transformer.wte.weight)
    expected = hf_logits(transformers.GPT2LMHeadModel.from_pretrained(str(folder)).eval(), IDX)
    assert relative_error(torch_ref_logits(ours, IDX), expected) <= 1e-12  # float64, op order only


# ---------------------------------------------------------------------------------------
# half precision loads, integers and bools are refused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_folders_load(tmp_path, dtype):
    import copy

    half = copy.deepcopy(random_hf_model(seed=1)).to(dtype)
    folder = save(half, tmp_path / str(dtype))
    ours = torch_ref.load_hf_gpt2(folder)  # float32 model: the half values upcast exactly
    assert ours.transformer.h[0].attn.c_attn.weight.dtype == torch.float32
    np.testing.assert_array_equal(
        ours.transformer.h[1].mlp.c_fc.weight.detach().numpy(),
        half.transformer.h[1].mlp.c_fc.weight.detach().float().T.numpy(),
    )
    config, tie, state = torch_ref.read_hf_gpt2(folder)
    assert tie and {value.dtype for value in state.values()} == {dtype}  # the stored dtype, as read
    # Same (half-valued) weights in float64 on both sides: op order only.
    expected = hf_logits(half, IDX)
    assert relative_error(torch_ref_logits(ours.double(), IDX), expected) <= 1e-12


@pytest.mark.parametrize("dtype, name", [(torch.int8, "I8"), (torch.int32, "I32"), (torch.bool, "BOOL")])
def test_integer_and_bool_weights_are_refused(tmp_path, hf_model, dtype, name):
    folder = save(hf_model, tmp_path / "f")
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    key = "transformer.h.1.mlp.c_fc.weight"
    tensors[key] = tensors[key].to(dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(torch_ref.HFCheckpointError, match=rf"model.safetensors: .*{key} \({name}\).*floating point"):
        torch_ref.load_hf_gpt2(folder)


def test_a_whole_int8_folder_is_refused_key_by_key(tmp_path, hf_model):
    folder = save(hf_model, tmp_path / "f")
    from safetensors.torch import load_file

    tensors = {k: (v * 10).to(torch.int8) for k, v in load_file(str(folder / "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(torch_ref.HFCheckpointError) as info:
        torch_ref.load_hf_gpt2(folder)
    assert str(info.value).count("(I8)") == len(tensors) == 4 + 2 * 12  # every weight named, none skipped
    assert "transformer.wte.weight (I8)" in str(info.value)


# ---------------------------------------------------------------------------------------
# shard names resolve inside the folder


def sharded_folder(tmp_path, hf_model):
    folder = save(hf_model, tmp_path / "sharded", max_shard_size=4000)
    index_path = folder / "model.safetensors.index.json"
    return folder, index_path, json.loads(index_path.read_text())


@pytest.mark.parametrize("escape", ["parent", "absolute", "symlink"])
def test_shard_paths_must_stay_inside_the_folder(tmp_path, hf_model, escape):
    folder, index_path, index = sharded_folder(tmp_path, hf_model)
    key, shard = next(iter(index["weight_map"].items()))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (folder / shard).rename(outside / shard)  # a real, readable shard, only in the wrong place
    entry = {"parent": f"../elsewhere/{shard}", "absolute": str(outside / shard), "symlink": "link.safetensors"}[escape]
    if escape == "symlink":
        (folder / "link.safetensors").symlink_to(outside / shard)
    index["weight_map"] = {k: (entry if v == shard else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model.safetensors.index.json") as info:
        torch_ref.load_hf_gpt2(folder)
    assert entry in str(info.value) and key in str(info.value)


def test_a_shard_named_in_the_index_must_exist(tmp_path, hf_model):
    folder, index_path, index = sharded_folder(tmp_path, hf_model)
    shard = next(iter(index["weight_map"].values()))
    (folder / shard).unlink()
    with pytest.raises(FileNotFoundError, match=rf"index.json.*{shard}"):
        torch_ref.load_hf_gpt2(folder)


def test_an_index_that_misplaces_a_tensor_is_refused(tmp_path, hf_model):
    folder, index_path, index = sharded_folder(tmp_path, hf_model)
    key_a, shard_a = next(iter(index["weight_map"].items()))
    shard_b = next(v for v in index["weight_map"].values() if v != shard_a)
    index["weight_map"][key_a] = shard_b  # a real shard, but not the one holding key_a
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"index.json' places tensors in shards that do not hold them: '{key_a}'"):
        torch_ref.load_hf_gpt2(folder)


# ---------------------------------------------------------------------------------------
# declared sizes are checked against the tensors before anything is built


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("n_positions", 1_000_000, r"wpe.weight: expected shape \[1000000, 16\].*got \[12, 16\]"),
        ("n_layer", 1_000_000_000, r"n_layer=1000000000, but the checkpoint holds layers \[0, 1\]"),
        ("vocab_size", 10**9, r"wte.weight: expected shape \[1000000000, 16\]"),
        ("n_embd", 4096, r"n_embd=4096"),
    ],
)
def test_huge_declared_sizes_fail_before_allocation(tmp_path, hf_model, field, value, fragment):
    folder = save(hf_model, tmp_path / "f")
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    assert (folder / "config.json").stat().st_size < 2048
    with pytest.raises(torch_ref.HFCheckpointError, match=fragment) as info:
        torch_ref.load_hf_gpt2(folder)
    assert "config.json" in str(info.value)


def test_head_count_that_does_not_divide_the_width_names_config_json(tmp_path, hf_model):
    folder = save(hf_model, tmp_path / "f")
    config = json.loads((folder / "config.json").read_text())
    config["n_head"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: GPTConfig: n_embd=16 is not divisible by n_head=3"):
        torch_ref.load_hf_gpt2(folder)


def test_consistent_but_huge_positions_fail_before_the_mask_buffers(tmp_path):
    # 64 layers of width 2 and a (100000, 2) wpe: a 1 MB file whose (block, block) mask
    # buffers would take 64 * 100000^2 * 4 bytes = 2.5 TB.
    n_layer, C, P, V = 64, 2, 100_000, 5
    shapes = {"wte.weight": (V, C), "wpe.weight": (P, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(n_layer):
        for leaf, shape in {
            "ln_1.weight": (C,),
            "ln_1.bias": (C,),
            "ln_2.weight": (C,),
            "ln_2.bias": (C,),
            "attn.c_attn.weight": (C, 3 * C),
            "attn.c_attn.bias": (3 * C,),
            "attn.c_proj.weight": (C, C),
            "attn.c_proj.bias": (C,),
            "mlp.c_fc.weight": (C, 4 * C),
            "mlp.c_fc.bias": (4 * C,),
            "mlp.c_proj.weight": (4 * C, C),
            "mlp.c_proj.bias": (C,),
        }.items():
            shapes[f"h.{i}.{leaf}"] = shape
    folder = tmp_path / "wide"
    folder.mkdir()
    save_file({k: torch.zeros(s) for k, s in shapes.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps(
            {"model_type": "gpt2", "n_layer": n_layer, "n_head": 1, "n_embd": C, "vocab_size": V, "n_positions": P}
        )
    )
    with pytest.raises(MemoryError, match="n_layer=64.*block_size=100000"):
        torch_ref.load_hf_gpt2(folder)


# ---------------------------------------------------------------------------------------
# malformed JSON names the file and the problem


@pytest.mark.parametrize(
    "which, text, fragment",
    [
        ("config", "[1, 2, 3]", r"config.json' must hold a JSON object .*got a JSON list"),
        ("config", '{"n_layer": 2,,}', r"config.json' is not valid JSON"),
        ("index", '{"metadata": {}}', r"index.json' has no \"weight_map\" entry"),
        ("index", '{"weight_map": ["a", "b"]}', r"index.json': \"weight_map\" must be a JSON object.*got a JSON list"),
        ("index", '{"weight_map": {', r"index.json' is not valid JSON"),
        ("index", '"just a string"', r"index.json' must hold a JSON object .*got a JSON str"),
    ],
)
def test_malformed_json_names_the_file(tmp_path, hf_model, which, text, fragment):
    folder, index_path, _ = sharded_folder(tmp_path, hf_model)
    (index_path if which == "index" else folder / "config.json").write_text(text)
    with pytest.raises(ValueError, match=fragment):
        torch_ref.load_hf_gpt2(folder)


def test_bad_values_in_config_json_are_named(tmp_path, hf_model):
    folder = save(hf_model, tmp_path / "f")
    base = json.loads((folder / "config.json").read_text())
    for change, fragment in (
        ({"n_layer": "2"}, "n_layer must be a positive integer, got '2'"),
        ({"n_positions": 1e3}, "n_positions must be a positive integer, got 1000.0"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
    ):
        (folder / "config.json").write_text(json.dumps({**base, **change}))
        with pytest.raises(ValueError, match=f"config.json: .*{fragment}"):
            torch_ref.load_hf_gpt2(folder)


# ---------------------------------------------------------------------------------------
# incomplete or malformed weight sets list what is wrong


def write_tensors(folder, tensors, config):
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


HF_TINY = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 4, "vocab_size": 7, "n_positions": 5}


def test_only_wte_lists_every_missing_weight(tmp_path):
    folder = write_tensors(tmp_path / "f", {"transformer.wte.weight": torch.zeros(7, 4)}, HF_TINY)
    with pytest.raises(torch_ref.HFCheckpointError, match="missing: transformer.wpe.weight") as info:
        torch_ref.load_hf_gpt2(folder)
    assert len(info.value.missing) == 1 + 12 + 2  # wpe, one layer's 12 weights, ln_f
    assert "transformer.h.0.mlp.c_proj.bias" in info.value.missing and "no h.{i} layers" in str(info.value)


def test_one_dimensional_wte_and_bad_layer_keys_are_named(tmp_path, hf_model):
    folder = save(hf_model, tmp_path / "f")
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["transformer.wte.weight"] = torch.zeros(37)
    tensors["transformer.h.x.ln_1.weight"] = torch.zeros(16)
    tensors["transformer.h.01.ln_1.weight"] = torch.zeros(16)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(torch_ref.HFCheckpointError) as info:
        torch_ref.load_hf_gpt2(folder)
    assert info.value.mismatched == [("transformer.wte.weight", (37, 16), (37,))]
    assert sorted(info.value.unexpected) == ["transformer.h.01.ln_1.weight", "transformer.h.x.ln_1.weight"]
    assert "transformer.wte.weight: expected shape [37, 16]" in str(info.value) and "got [37]" in str(info.value)


def test_tied_lm_head_that_differs_from_wte_is_refused(tmp_path, hf_model):
    folder = save(hf_model, tmp_path / "f")
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 1e-3
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(torch_ref.HFCheckpointError, match="lm_head.weight differs from transformer.wte.weight"):
        torch_ref.load_hf_gpt2(folder)


def test_file_errors(tmp_path, hf_model):
    folder = save(hf_model, tmp_path / "f")
    single = folder / "model.safetensors"
    with pytest.raises(ValueError, match="pass config="):
        torch_ref.load_hf_gpt2(single)
    model = torch_ref.load_hf_gpt2(single, config=types.SimpleNamespace(**TINY))
    assert model.config == torch_ref.GPTConfig(**TINY)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((folder / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(FileNotFoundError, match="Only safetensors"):
        torch_ref.load_hf_gpt2(pickled)
    with pytest.raises(ValueError, match="expected a .safetensors file"):
        torch_ref.load_hf_gpt2(pickled / "pytorch_model.bin", config=TINY)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        torch_ref.load_hf_gpt2(folder)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        torch_ref.load_hf_gpt2(tmp_path / "absent")
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
        torch_ref.load_hf_gpt2(single, config=TINY, dtype=torch.int64)
    (tmp_path / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(ValueError, match="junk.safetensors' is not a readable safetensors file"):
        torch_ref.load_hf_gpt2(tmp_path / "junk.safetensors", config=TINY)
