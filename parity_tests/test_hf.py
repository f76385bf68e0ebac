"""Hugging Face GPT-2 folders in and out of flax_ln: hostile inputs, half precision, export, loading onto a mesh.

Reference folders are written by ``transformers`` itself (``GPT2LMHeadModel.save_pretrained``),
so neither the layout nor the logits depend on flax_ln's own writer.
"""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from test_gpt import randomize

import flax_ln
from flax_ln import GPTConfig
from flax_ln.convert import read_hf_gpt2
from flax_ln.parity import relative_error

transformers = pytest.importorskip("transformers")

SMALL = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=50, block_size=16)
IDX = np.random.default_rng(3).integers(0, SMALL.vocab_size, (2, 16)).astype(np.int32)

# float32 logits of the same weights through transformers (torch) and flax_ln (XLA): the
# two sum in different orders, ~1e-7 relative per op; 1e-5 is the project's float32
# output bound (the engine's tolerance policy, docs/tolerances.md), far below what a wrong or
# transposed weight gives (~1).
RTOL_F32 = 1e-5


def hf_model(config: GPTConfig = SMALL, *, tied: bool = True, seed: int = 0):
    """A ``transformers.GPT2LMHeadModel`` with O(1) random weights (LayerNorms too), eval mode."""
    hf_config = transformers.GPT2Config(
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        vocab_size=config.vocab_size,
        n_positions=config.block_size,
        tie_word_embeddings=tied,
        activation_function="gelu_new",
        bos_token_id=None,
        eos_token_id=None,  # GPT-2's 50256 is outside this small vocabulary
    )
    torch.manual_seed(seed)
    return randomize(transformers.GPT2LMHeadModel(hf_config), seed).eval()  # a tied lm_head follows wte


def hf_logits(model, idx=IDX) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(idx, dtype=torch.long)).logits.float().numpy()


def flax_logits(model, idx=IDX) -> np.ndarray:
    return np.asarray(model(jnp.asarray(idx))[0])


def saved(model, folder: Path, dtype=torch.float32) -> Path:
    model.to(dtype).save_pretrained(folder, safe_serialization=True)
    return folder


def rewrite(folder: Path, change) -> Path:
    """Rewrite ``folder``'s model.safetensors with ``change(tensors)`` applied (in place)."""
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


# ---------------------------------------------------------------------------------------
# dtypes: half precision loads, integers and bools are refused


@pytest.mark.parametrize("dtype", ["int8", "int32", "bool"])
@pytest.mark.parametrize("reader", [read_hf_gpt2, flax_ln.load_hf_gpt2], ids=["read", "load"])
def test_non_floating_weights_are_refused(tmp_path, dtype, reader):
    folder = saved(hf_model(), tmp_path / "hf")

    def cast(tensors):
        tensors["transformer.wte.weight"] = tensors["transformer.wte.weight"].astype(dtype)
        # HF's own bool causal-mask buffer (older checkpoints carry it) is not a weight: still accepted
        tensors["transformer.h.0.attn.bias"] = np.tril(np.ones((16, 16), bool))[None, None]

    rewrite(folder, cast)
    with pytest.raises(ValueError, match="non-floating tensors") as info:
        reader(folder)
    assert f"'transformer.wte.weight' ({dtype}, in model.safetensors)" in str(info.value)
    assert "attn.bias" not in str(info.value)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_folders_load_in_param_dtype(tmp_path, dtype):
    model = hf_model()
    folder = saved(model, tmp_path / "hf", getattr(torch, dtype))
    config, state = read_hf_gpt2(folder)
    assert config == SMALL and state["transformer.wte.weight"].dtype.name == dtype  # the checkpoint's dtype
    flax_model = flax_ln.load_hf_gpt2(folder, scan_layers=True)
    kernel = flax_model.transformer.h.mlp.c_fc.kernel  # (n_layer, in, out): HF's Conv1D layout, stacked
    assert kernel.dtype == jnp.float32
    np.testing.assert_array_equal(kernel[1], model.transformer.h[1].mlp.c_fc.weight.detach().float().numpy())
    # The half-precision weights, upcast exactly, through transformers in float32:
    assert relative_error(flax_logits(flax_model), hf_logits(model.float())) <= RTOL_F32


# ---------------------------------------------------------------------------------------
# shard paths stay inside the folder


def sharded_folder(folder: Path, model, names: list[str]) -> Path:
    """``model`` saved as len(names) shards under ``names`` (relative to ``folder``) and an index."""
    tensors = load_file(str(saved(model, folder) / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    keys = sorted(tensors)
    weight_map = {}
    for i, name in enumerate(names):
        part = keys[i :: len(names)]
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: tensors[k] for k in part}, str(folder / name))
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def test_shards_inside_the_folder_load(tmp_path):
    model = hf_model()
    folder = sharded_folder(tmp_path / "hf", model, ["model-1.safetensors", "sub/../sub/model-2.safetensors"])
    assert relative_error(flax_logits(flax_ln.load_hf_gpt2(folder)), hf_logits(model)) <= RTOL_F32


@pytest.mark.parametrize("where", ["parent", "absolute", "passwd", "symlink"])
def test_shard_paths_leaving_the_folder_are_refused_unopened(tmp_path, monkeypatch, where):
    model = hf_model()
    outside = saved(model, tmp_path / "good") / "model.safetensors"  # a valid checkpoint, elsewhere
    folder = sharded_folder(tmp_path / "hf", model, ["model-1.safetensors", "model-2.safetensors"])
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    entry = sorted(k for k, v in index["weight_map"].items() if v == "model-2.safetensors")[0]
    bad = {
        "parent": "../good/model.safetensors",
        "absolute": str(outside),
        "passwd": "../../../../etc/passwd",
        "symlink": "link.safetensors",
    }[where]
    if where == "symlink":
        (folder / "link.safetensors").symlink_to(outside)
    index["weight_map"][entry] = bad
    index_file.write_text(json.dumps(index))
    opened = []
    real_safe_open = safetensors.safe_open
    monkeypatch.setattr(
        safetensors, "safe_open", lambda file, *a, **k: opened.append(file) or real_safe_open(file, *a, **k)
    )
    for reader in (read_hf_gpt2, flax_ln.load_hf_gpt2):
        with pytest.raises(ValueError, match="leads outside the checkpoint folder") as info:
            reader(folder)
        assert str(index_file) in str(info.value) and f"{entry!r} -> {bad!r}" in str(info.value)
    assert opened == []  # refused before any shard was opened


# ---------------------------------------------------------------------------------------
# sizes from small files: a config is checked against the tensors, and no buffer grows with its sizes


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        (
            {"n_positions": 1_000_000},
            "n_positions=1000000, but transformer.wpe.weight in model.safetensors has shape (16, 32)",
        ),
        ({"n_layer": 1_000_000_000}, "n_layer=1000000000, but the checkpoint holds transformer.h.0 to transformer.h.1"),
        ({"vocab_size": 10**9, "n_embd": 64, "n_head": 2}, "vocab_size=1000000000, but transformer.wte.weight"),
    ],
    ids=["n_positions", "n_layer", "vocab_size"],
)
def test_config_sizes_are_checked_against_the_tensors_first(tmp_path, entry, fragment):
    folder = saved(hf_model(), tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **entry}))
    for reader in (read_hf_gpt2, flax_ln.load_hf_gpt2):
        with pytest.raises(ValueError, match="does not match the checkpoint's tensors") as info:
            reader(folder)
        assert str(folder / "config.json") in str(info.value) and fragment in str(info.value)


def test_a_config_argument_is_checked_too(tmp_path):
    folder = saved(hf_model(), tmp_path / "hf")
    with pytest.raises(ValueError, match=r"config= does not match .* block_size=100000, but transformer.wpe.weight"):
        flax_ln.load_hf_gpt2(folder / "model.safetensors", config=dataclasses.replace(SMALL, block_size=100_000))


LONG_BLOCK = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # no 40 GB (1, 1, block, block) mask fits
    import jax.numpy as jnp, numpy as np
    import flax_ln
    model = flax_ln.load_hf_gpt2(sys.argv[1])
    logits = model(jnp.zeros((1, 4), jnp.int32))[0]
    wpe = np.asarray(model.transformer.wpe.embedding[...])
    print(wpe.shape, logits.shape, bool(jnp.isfinite(logits).all()))
""")


@pytest.mark.slow
def test_a_long_block_loads_without_a_block_squared_buffer(tmp_path):
    """wpe (100000, 2), 800 KB: torch's causal-mask buffer would be 40 GB; the port builds none."""
    folder = tmp_path / "hf"
    folder.mkdir()
    rng = np.random.default_rng(0)
    shapes = {
        "wte.weight": (5, 2),
        "wpe.weight": (100_000, 2),
        "ln_f.weight": (2,),
        "ln_f.bias": (2,),
        "h.0.ln_1.weight": (2,),
        "h.0.ln_1.bias": (2,),
        "h.0.ln_2.weight": (2,),
        "h.0.ln_2.bias": (2,),
        "h.0.attn.c_attn.weight": (2, 6),
        "h.0.attn.c_attn.bias": (6,),
        "h.0.attn.c_proj.weight": (2, 2),
        "h.0.attn.c_proj.bias": (2,),
        "h.0.mlp.c_fc.weight": (2, 8),
        "h.0.mlp.c_fc.bias": (8,),
        "h.0.mlp.c_proj.weight": (8, 2),
        "h.0.mlp.c_proj.bias": (2,),
    }
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps(
            {"model_type": "gpt2", "n_layer": 1, "n_head": 1, "n_embd": 2, "vocab_size": 5, "n_positions": 100_000}
        )
    )
    proc = subprocess.run(
        [sys.executable, "-c", LONG_BLOCK, str(folder)],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "(100000, 2) (1, 4, 5) True"


# ---------------------------------------------------------------------------------------
# malformed JSON names the file and the problem


@pytest.mark.parametrize(
    ("file", "text", "fragment"),
    [
        ("config.json", "[1, 2]", "expected a JSON object ({...}) holding the Hugging Face GPT-2 settings"),
        ("config.json", '{"n_layer": 2,', "invalid JSON syntax at line 1, column 15"),
        ("config.json", '{"n_layer": "2"}', "n_layer must be a positive int, got '2'"),
        ("model.safetensors.index.json", '{"metadata": {}}', 'no "weight_map" entry'),
        (
            "model.safetensors.index.json",
            '{"weight_map": ["model-1.safetensors"]}',
            '"weight_map" must be a JSON object mapping tensor names to shard file names, got a JSON array',
        ),
        (
            "model.safetensors.index.json",
            '{"weight_map": {"wte.weight": 3}}',
            "\"weight_map\" entry 'wte.weight': expected a shard file name, got 3",
        ),
        ("model.safetensors.index.json", '{"weight_map": {', "invalid JSON syntax at line 1, column 17"),
    ],
    ids=[
        "config-list",
        "config-syntax",
        "config-string-size",
        "index-no-weight-map",
        "index-weight-map-list",
        "index-shard-not-a-name",
        "index-syntax",
    ],
)
def test_malformed_json_names_the_file(tmp_path, file, text, fragment):
    folder = saved(hf_model(), tmp_path / "hf")
    if file == "model.safetensors.index.json":
        (folder / "model.safetensors").rename(folder / "model-1.safetensors")
    (folder / file).write_text(text)
    for reader in (read_hf_gpt2, flax_ln.load_hf_gpt2):
        with pytest.raises(ValueError) as info:
            reader(folder)
        assert str(info.value).startswith(f"{folder / file}: ") and fragment in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------
# export


def noisy_flax_gpt(config=SMALL, *, scan_layers=False, tied=False, seed=0) -> flax_ln.GPT:
    """A flax_ln GPT (own lm_head, as the book's) with every parameter moved off its init, eval mode."""
    model = flax_ln.GPT(config, scan_layers=scan_layers, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            var.set_value(var[...] + 0.2 * rng.standard_normal(var.shape).astype(np.float32))
    if tied:
        model.lm_head.kernel.set_value(model.transformer.wte.embedding[...].T)
    model.eval()
    return model


@pytest.mark.slow
@pytest.mark.parametrize(("tied", "scan_layers"), [(False, False), (True, True)])
def test_save_hf_gpt2_opens_in_transformers(tmp_path, tied, scan_layers):
    model = noisy_flax_gpt(scan_layers=scan_layers, tied=tied)
    folder = flax_ln.save_hf_gpt2(model, tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    stored = load_file(str(folder / "model.safetensors"))
    assert config["tie_word_embeddings"] is tied and ("lm_head.weight" in stored) is not tied
    assert stored["transformer.h.1.attn.c_attn.weight"].shape == (32, 96)  # Conv1D: (in, out)
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    assert relative_error(hf_logits(hf), flax_logits(model)) <= RTOL_F32
    reloaded = flax_ln.load_hf_gpt2(folder)  # and back: every parameter bit for bit
    expected = flax_ln.to_torch_state_dict(model)
    for key, value in flax_ln.to_torch_state_dict(reloaded).items():
        np.testing.assert_array_equal(value, expected[key], err_msg=key)


# ---------------------------------------------------------------------------------------
# loading onto a mesh, exporting a sharded model, on 8 CPU devices

MESH = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    import flax_ln
    from flax_ln import GPT, GPTConfig
    from flax_ln.parity import relative_error
    from flax_ln.sharding import abstract_model, fsdp_spec, make_mesh

    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.device_count() == 8, jax.devices()
    folder, out = sys.argv[1], sys.argv[2]
    idx = jnp.asarray(np.random.default_rng(3).integers(0, 50, (2, 16)), jnp.int32)
    report = {}
    logits = nnx.jit(lambda model, idx: model(idx)[0])

    def params(model):
        return [(".".join(map(str, p)), v) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]

    def placement(model, mesh):  # every parameter on all of the mesh's devices, with training's spec
        return all(v.get_value().sharding.mesh.devices.size == 8
                   and v.get_value().sharding.spec == fsdp_spec(v.shape, mesh.shape["fsdp"])
                   for _, v in params(model))

    for scan in (False, True):
        for fsdp in (8, 4):
            if fsdp == 4 and not scan:
                continue
            mesh = make_mesh(fsdp)
            one = flax_ln.load_hf_gpt2(folder, scan_layers=scan)
            sharded = flax_ln.load_hf_gpt2(folder, mesh=mesh, scan_layers=scan)
            name = f"scan={scan},fsdp={fsdp}"
            report[name] = {
                "specs": {k: list(v.get_value().sharding.spec) for k, v in params(sharded)},
                "placement": placement(sharded, mesh),
                "equal": all(np.array_equal(np.asarray(a[...]), np.asarray(b[...]))
                             for (_, a), (_, b) in zip(params(one), params(sharded))),
                "logits": relative_error(logits(sharded, idx), logits(one, idx)),
            }
            if scan and fsdp == 8:
                reference = flax_ln.to_torch_state_dict(one)
                gathered = flax_ln.to_torch_state_dict(sharded)
                report["to_torch_equal"] = sorted(reference) == sorted(gathered) and all(
                    np.array_equal(gathered[k], reference[k]) for k in reference)
                flax_ln.save_hf_gpt2(sharded, out)
                back = flax_ln.to_torch_state_dict(flax_ln.load_hf_gpt2(out, scan_layers=True))
                report["saved_equal"] = all(np.array_equal(back[k], reference[k]) for k in reference)
                abstract = abstract_model(lambda: GPT(one.config, scan_layers=True, rngs=nnx.Rngs(0)), mesh)
                loaded = flax_ln.load_torch_state_dict(abstract, reference)
                back = flax_ln.to_torch_state_dict(loaded)
                report["torch_loaded"] = {"placement": placement(loaded, mesh),
                                          "equal": all(np.array_equal(back[k], reference[k]) for k in reference)}
    print(json.dumps(report))
""")


@pytest.fixture(scope="module")
def mesh_report(tmp_path_factory, built_once):
    def build():
        folder = saved(hf_model(), tmp_path_factory.mktemp("mesh") / "hf")
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run(
            [sys.executable, "-c", MESH, str(folder), str(folder.parent / "out")],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return built_once("hf-mesh-report", build)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["scan=False,fsdp=8", "scan=True,fsdp=8", "scan=True,fsdp=4"])
def test_load_hf_gpt2_onto_a_mesh(mesh_report, layout):
    got = mesh_report[layout]
    assert got["placement"] and got["equal"]
    scanned = layout.startswith("scan=True")
    c_fc = got["specs"]["transformer.h.mlp.c_fc.kernel" if scanned else "transformer.h.0.mlp.c_fc.kernel"]
    assert c_fc == ([None, None, "fsdp"] if scanned else [None, "fsdp"])  # (n_layer,) in, out = 4 * 32
    assert got["specs"]["transformer.wte.embedding"] == [None, "fsdp"]  # (vocab 50, n_embd 32)
    # Sharded matmuls may sum in another order (partial sums, then a reduction): float32 rounding only.
    assert got["logits"] <= RTOL_F32


@pytest.mark.slow
def test_a_sharded_model_converts_and_saves(mesh_report):
    assert mesh_report["to_torch_equal"]  # to_torch_state_dict gathers every shard
    assert mesh_report["saved_equal"]  # save_hf_gpt2 of the sharded model, read back unsharded
    assert mesh_report["torch_loaded"] == {"placement": True, "equal": True}  # load_torch_state_dict on a mesh


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield 0o640
    finally:
        os.umask(old)


def test_save_hf_gpt2_files_follow_the_umask(tmp_path, umask_027):
    folder = flax_ln.save_hf_gpt2(noisy_flax_gpt(), tmp_path / "out")
    for name in ("model.safetensors", "config.json"):
        assert (folder / name).stat().st_mode & 0o777 == umask_027, name
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]  # no temporary left


def test_save_hf_gpt2_over_a_sharded_save_removes_its_index_and_exactly_its_shards(tmp_path):
    folder = tmp_path / "out"
    old = noisy_flax_gpt(seed=1)
    flax_ln.save_hf_gpt2(old, folder)
    state = load_file(str(folder / "model.safetensors"))
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, names in shards.items():
        save_file({k: state[k] for k in names}, str(folder / name), metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: name for name, names in shards.items() for k in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model-00003-of-00003.safetensors").write_bytes(b"not named by the index")
    (folder / "README.md").write_text("kept\n")
    assert (
        relative_error(flax_logits(flax_ln.load_hf_gpt2(folder)), flax_logits(old)) <= RTOL_F32
    )  # the old sharded save

    new = noisy_flax_gpt(seed=2)
    flax_ln.save_hf_gpt2(new, folder)
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "config.json",
        "model-00003-of-00003.safetensors",
        "model.safetensors",
    ]
    assert (folder / "README.md").read_text() == "kept\n"
    assert (
        relative_error(flax_logits(flax_ln.load_hf_gpt2(folder)), flax_logits(new)) <= RTOL_F32
    )  # the new weights, not the old shards


def test_save_hf_gpt2_refuses_a_stale_index_it_cannot_read_before_writing(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../elsewhere.safetensors"}}))
    with pytest.raises(ValueError, match=r"stale model.safetensors.index.json .* nothing was written"):
        flax_ln.save_hf_gpt2(noisy_flax_gpt(), folder)
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors.index.json"]
