"""Three ports of transformers models that do not mirror them (examples/ports), each checked through its own KeyMap
by the parity engine (compare_modules(..., weights=KEY_MAP)): outputs and every gradient in float32 and float64, the
tie found and its gradient summed, planted mistakes named on both sides, exports round-trip."""

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from flax_ln import load_torch_state_dict, to_torch_state_dict
from flax_ln.convert import ConversionError, KeyMap, Tie
from flax_ln.parity import TOLERANCES, assert_parity, compare_modules, compare_tensors, relative_error

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ is not installed; the ports are imported from the checkout
    sys.path.insert(0, str(ROOT))
from examples.ports import llama, resnet, vit  # noqa: E402

BATCH, SEQ, IMAGE_RESNET, IMAGE_VIT = 2, 7, 32, 16


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights far from transformers' init (norm scales near 1, running statistics away from 0 and 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(noise / (p[0].numel() ** 0.5 if p.ndim > 1 else 3.0))
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
            elif name.endswith("running_var"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))
    return model.eval()


def hf_llama():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, attn_implementation="eager",
    )  # fmt: skip
    return randomized(transformers.LlamaForCausalLM(config))


def hf_resnet():
    config = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[16, 32], depths=[1, 2], layer_type="bottleneck", num_labels=5
    )
    return randomized(transformers.ResNetForImageClassification(config))


def hf_vit():
    config = transformers.ViTConfig(
        image_size=IMAGE_VIT, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5, attn_implementation="eager",
    )  # fmt: skip
    return randomized(transformers.ViTForImageClassification(config))


def token_ids():
    return np.random.default_rng(1).integers(0, 64, (BATCH, SEQ))


def images(size):
    return np.random.default_rng(2).standard_normal((BATCH, 3, size, size))  # NCHW, torch's layout


# name: (transformers model, port module, port class, torch inputs, the port's inputs for a dtype)
PORTS = {
    "llama": (hf_llama, llama, llama.Llama, token_ids, lambda x, dt: jnp.asarray(x)),
    "resnet": (hf_resnet, resnet, resnet.ResNet, lambda: images(IMAGE_RESNET), lambda x, dt: nhwc(x, dt)),
    "vit": (hf_vit, vit, vit.ViT, lambda: images(IMAGE_VIT), lambda x, dt: nhwc(x, dt)),
}


def nhwc(x, dtype):
    return jnp.asarray(x.transpose(0, 2, 3, 1), dtype)  # (B, H, W, C)


def torch_input(x, dtype):
    t = torch.from_numpy(x)
    return t if not t.is_floating_point() else t.to(getattr(torch, dtype))


def build(name, dtype):
    make_hf, module, cls, make_inputs, to_port = PORTS[name]
    hf = make_hf().to(getattr(torch, dtype))
    config = module.config_from_hf(hf.config)
    # Built abstract (shapes only, no initialiser runs) and filled by the strict loader: every variable is set.
    port = nnx.eval_shape(lambda: cls(config, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(0)))
    load_torch_state_dict(port, hf.state_dict(), weights=module.KEY_MAP)
    x = make_inputs()
    return hf, port, torch_input(x, dtype), to_port(x, getattr(jnp, dtype))


def run(port, x):
    """The port's forward, jitted once (split the model, merge inside): one compile instead of one per eager op."""
    graphdef, state = nnx.split(port)
    return np.asarray(jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, x))


def outputs(name, dtype):
    hf, port, torch_x, port_x = build(name, dtype)
    with torch.no_grad():
        expected = hf(torch_x).logits.numpy()
    return run(port, port_x), expected


LOGITS = (lambda m, x: m(x).logits, None)  # torch returns a ModelOutput; the port returns the logits


def port_of(name, dtype="float64"):
    """The port, built abstract (shapes only) for ``dtype``: the comparison fills it through the key map."""
    make_hf, module, cls, _, _ = PORTS[name]
    config = module.config_from_hf(make_hf().config)
    return nnx.eval_shape(lambda: cls(config, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(0)))


def parity(name, dtype, *, port=None, key_map=None, **options):
    """compare_modules of one port against transformers through the port's key map (or ``key_map``)."""
    make_hf, module, _, make_inputs, _ = PORTS[name]
    hf = make_hf().to(getattr(torch, dtype))
    x = make_inputs()
    x = x.astype(dtype) if np.issubdtype(x.dtype, np.floating) else x
    flax_inputs = (x.transpose(0, 2, 3, 1),) if x.ndim == 4 else None  # NCHW -> NHWC for the image ports
    return compare_modules(
        hf,
        port_of(name, dtype) if port is None else port,
        (x,),
        flax_inputs=flax_inputs,
        weights=module.KEY_MAP if key_map is None else key_map,
        forward=LOGITS,
        **options,
    )


@pytest.mark.lower_bounds  # the lower-bounds CI step runs it (pyproject.toml, markers)
@pytest.mark.parametrize("name", list(PORTS))
def test_port_passes_assert_parity_in_float32(name):
    """The float32 policy (outputs 1e-5, gradients 1e-4): XLA and torch reduce in different orders, ~1e-7 per op.
    Every gradient under torch's named_parameters() names; Llama's tied embedding once, both copies summed."""
    make_hf, module, _, make_inputs, _ = PORTS[name]
    hf = make_hf()
    x = make_inputs()
    x = x.astype(np.float32) if np.issubdtype(x.dtype, np.floating) else x
    report = assert_parity(
        hf, port_of(name, "float32"), (x,), weights=module.KEY_MAP, forward=LOGITS,
        flax_inputs=(x.transpose(0, 2, 3, 1),) if x.ndim == 4 else None,
    )  # fmt: skip
    grads = {r.name for r in report.results if r.kind == "param grad"}
    assert grads == {n for n, _ in hf.named_parameters()}
    if name == "llama":
        assert report.ties == {
            "model.embed_tokens.weight": Tie(
                ("model.embed_tokens.weight", "lm_head.weight"), ("tok.embedding", "head.proj.kernel")
            )
        }
        assert report.to_json()["ties"] == {
            "model.embed_tokens.weight": {
                "torch_aliases": ["model.embed_tokens.weight", "lm_head.weight"],
                "flax_paths": ["tok.embedding", "head.proj.kernel"],
            }
        }
    else:
        assert report.ties == {}


@pytest.mark.lower_bounds  # the lower-bounds CI step runs it (pyproject.toml, markers)
@pytest.mark.parametrize("name", list(PORTS))
def test_port_passes_assert_parity_in_float64(x64, name):
    """The float64 policy (outputs 1e-12, gradients 1e-10): the same math on both sides, op-order rounding only, with
    transformers' float32 islands (RMSNorm, rotary tables, eager softmax) lifted to float64, as compare_modules does
    by default in float64."""
    report = parity(name, "float64")
    assert report.passed, str(report)


# What each port's float64 run meets: (side, module, what) of the islands it lifts, where the models have them.
LIFTED = {
    "llama": {
        ("torch", "model.layers.0.input_layernorm", "aten._to_copy to float32"),  # RMSNorm's hidden.to(float32)
        ("torch", "model.layers.1.self_attn", "softmax with dtype=float32"),
        ("torch", "model.rotary_emb", "buffer inv_freq rebuilt in float64"),  # built in float32 at construction
    },
    "resnet": set(),
    "vit": {("torch", "vit.layers.0.attention", "softmax with dtype=float32")},
}


@pytest.mark.parametrize("name", list(PORTS))
def test_port_built_in_float32_passes_float64_in_one_argument_with_its_islands_listed(name):
    """float32 modules, as a user has them, and dtype="float64": both sides run on float64 copies (the caller's
    objects unchanged), the inputs cast, transformers' float32 islands lifted: the float64 policy holds, as it does
    for modules built in float64, and every island lifted is listed. islands="keep" runs each side as written:
    then transformers' islands bound the float64 comparison at float32 rounding (measured 1.6e-7 Llama, 3.8e-8 ViT)."""
    make_hf, module, _, make_inputs, _ = PORTS[name]
    hf, x = make_hf(), make_inputs()
    x = x.astype(np.float32) if np.issubdtype(x.dtype, np.floating) else x
    flax_inputs = (x.transpose(0, 2, 3, 1),) if x.ndim == 4 else None
    port = port_of(name, "float32")

    def compare(**options):
        return compare_modules(
            hf, port, (x,), flax_inputs=flax_inputs, weights=module.KEY_MAP, forward=LOGITS, dtype="float64", **options
        )

    report = compare()
    assert report.passed, str(report)
    assert report.dtype == "float64" and all(island.lifted for island in report.islands), report.islands
    assert LIFTED[name] <= {(i.side, i.module, i.what) for i in report.islands}, report.islands
    assert next(hf.parameters()).dtype == torch.float32 and report.input_casts == (
        {"input 0": "float32 -> float64"} if np.issubdtype(x.dtype, np.floating) else {}
    )
    kept = compare(islands="keep", localize_failures=False)
    if LIFTED[name]:
        assert not kept.passed and 1e-12 < kept["output"].relative_error < 1e-6, str(kept)
    else:
        assert kept.passed, str(kept)


def test_forward_mode_and_attribution_through_the_key_map():
    """mode="jvp": parameter tangents go into the port's layout through the key map (the tied copies get the
    same tangent); attribute=True runs the float64 twin through the same map. float32 policy."""
    report = parity("llama", "float32", mode="jvp")
    assert report.passed, str(report)
    assert {r.kind for r in report.results} == {"output", "tangent"}
    report = parity("resnet", "float32", attribute=True)
    assert report.passed, str(report)
    assert report["output"].flax_vs_float64 < 1e-5 and report["output"].torch_vs_float64 < 1e-5


def _named(report, torch_path, flax_path):
    """The first divergence and isolated mode name ``torch_path`` and ``flax_path``."""
    fd = report.first_divergence
    assert (fd.module, fd.flax_module) == (torch_path, flax_path), str(report)
    assert (report.isolation.culprits, report.isolation.flax_culprits) == ([torch_path], [flax_path]), str(report)
    assert f"first divergence: {torch_path} <-> {flax_path}  (" in str(report)
    payload = report.to_json()
    assert payload["first_divergence"]["flax_module"] == flax_path
    assert payload["isolated"]["flax_culprits"] == [flax_path]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_planted_tanh_gelu_in_one_vit_mlp(dtype):
    """tanh GELU instead of erf in layer 0: 7.0e-5 relative on these logits (measured; an output check at 1e-2
    never sees it), beyond the float64 policy and the float32 one (1e-5). The GELU is inline in the port's block
    (no module of its own), torch's in its parameter-free ``activation_fn`` module: the activation is named where
    it lives on each side, torch's ``activation_fn`` and the port block's own code between fc1 and fc2 (the first
    paired module after it, fc2, is fed the difference)."""
    with jax.enable_x64(dtype == "float64"):
        port = port_of("vit", dtype)
        port.layers[0].gelu_approximate = True
        report = parity("vit", dtype, port=port)
    assert not report.passed
    assert 1e-6 < report["output"].relative_error < 1e-3
    fd = report.first_divergence
    assert (fd.module, fd.flax_module) == ("vit.layers.0.mlp.activation_fn", "layers.0"), str(report)
    assert fd.flax_between == ("layers.0.fc1", "layers.0.fc2"), str(report)
    assert (report.isolation.culprits, report.isolation.flax_culprits) == (
        ["vit.layers.0.mlp.activation_fn"],
        ["layers.0"],
    ), str(report)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_planted_rope_base_in_the_first_attention_block(dtype):
    """A RoPE base other than the config's, in block 0 only: named as the first attention block on both sides,
    in float64 and (far beyond its policy) in float32."""
    with jax.enable_x64(dtype == "float64"):
        port = port_of("llama", dtype)
        port.blocks[0].attn.c = dataclasses.replace(port.blocks[0].attn.c, rope_base=5000.0)
        report = parity("llama", dtype, port=port)
    assert not report.passed
    _named(report, "model.layers.0.self_attn", "blocks.0.attn")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_planted_batchnorm_eps_in_the_norm_the_shortcut_is_added_into(dtype):
    """eps 1e-2 instead of 1e-5 in the last norm of stage 1's second block, whose output transformers adds the
    shortcut into in place (``hidden_state += residual``): records are copies, so that norm is named. No hint:
    transformers' identity-shortcut block holds exactly the parameters of its ``layer`` child, and the port's block
    is one module; the block's output (the shortcut added) is the port block's, so ``layer`` is unpaired."""
    with jax.enable_x64(dtype == "float64"):
        port = port_of("resnet", dtype)
        port.stages[1][1].expand.norm.epsilon = 1e-2
        report = parity("resnet", dtype, port=port)
    assert not report.passed
    _named(report, "resnet.encoder.stages.1.layers.1.layer.2.normalization", "stages.1.1.expand.norm")
    reason = report.module_skipped["resnet.encoder.stages.1.layers.1.layer"]
    assert reason.startswith("no flax module's output is its output") and "stages.1.1" in reason


def rule_layout(rule):
    """A parsed rule's layout back in the form KeyMap takes (these rules use einops patterns or none)."""
    return rule.layouts[0].pattern if rule.layouts else None


def llama_rules():
    return [(r.pattern, r.templates[0] if r.templates else None, rule_layout(r)) for r in llama.KEY_MAP.rules]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_planted_fused_q_kernel_with_scrambled_heads(dtype):
    """Block 0's q loaded as ``(h n)`` instead of ``(n h)`` (a modified KeyMap rule): its heads scrambled."""
    rules = []
    for pattern, template, layout in llama_rules():
        if "(q|k|v)" in pattern:
            block_0 = pattern.replace(r"(\d+)", "(0)", 1).replace("(q|k|v)", "(q)")
            rules.append((block_0, template, "(h n) d -> d n h"))
            rules.append((pattern.replace(r"(\d+)", r"([1-9]\d*)", 1).replace("(q|k|v)", "(q)"), template, layout))
            rules.append((pattern.replace("(q|k|v)", "(k|v)"), template, layout))
        else:
            rules.append((pattern, template, layout))
    with jax.enable_x64(dtype == "float64"):
        report = parity("llama", dtype, key_map=KeyMap(rules))
    assert not report.passed
    _named(report, "model.layers.0.self_attn", "blocks.0.attn")


def test_a_bad_key_map_lists_every_problem_and_leaves_the_port_unchanged():
    """A missing rule (the final norm) and a layout that does not fit (lm_head) are listed in one error."""
    rules = [r for r in llama_rules() if "model\\.norm" not in r[0]]
    rules[1] = (rules[1][0], rules[1][1], "v d -> v d")  # lm_head: not transposed, so (64, 32) != (32, 64)
    port = port_of("llama", "float32")
    before = {k: np.array(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(port))}
    with pytest.raises(ConversionError) as error:
        parity("llama", "float32", port=port, key_map=KeyMap(rules))
    message = str(error.value)
    assert "model.norm.weight" in message and "lm_head.weight" in message, message
    after = {k: np.array(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(port))}
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)


def test_resnet_running_statistics_are_batch_stats():
    hf, port, _, _ = build("resnet", "float32")
    norm = port.stages[1][0].proj.norm
    assert isinstance(norm.mean, nnx.BatchStat) and isinstance(norm.var, nnx.BatchStat)
    torch_norm = hf.resnet.encoder.stages[1].layers[0].shortcut.normalization
    np.testing.assert_array_equal(norm.var[...], torch_norm.running_var.numpy())


@pytest.mark.lower_bounds  # the lower-bounds CI step runs it (pyproject.toml, markers)
def test_llama_tie_is_found_and_its_gradient_is_the_sum_of_both_copies():
    """transformers ties lm_head to the embedding (one Parameter); the port keeps two variables. The plan sums
    their gradients under the canonical name. float32 gradient policy (1e-4): rounding of two backward passes."""
    hf, port, torch_ids, ids = build("llama", "float32")
    plan = llama.KEY_MAP.resolve(port, hf.state_dict())
    assert plan.ties == {
        "model.embed_tokens.weight": Tie(
            ("model.embed_tokens.weight", "lm_head.weight"), ("tok.embedding", "head.proj.kernel")
        )
    }
    weights = np.random.default_rng(3).standard_normal((BATCH, SEQ, 64)).astype(np.float32)
    (hf(torch_ids).logits * torch.from_numpy(weights)).sum().backward()
    graphdef, params = nnx.split(port)
    grads = jax.jit(jax.grad(lambda params: (nnx.merge(graphdef, params)(ids) * weights).sum()))(params)
    flat = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}
    named = plan.torch_gradients(flat)
    torch_grads = {n: p.grad.numpy() for n, p in hf.named_parameters()}
    assert named.keys() == torch_grads.keys()
    for n, g in torch_grads.items():
        result = compare_tensors(n, "param grad", named[n], g, TOLERANCES["float32"]["grad"])
        assert result.passed, result
    # either copy alone is far off: the tie matters
    embed_only = flat["tok.embedding"]
    assert relative_error(embed_only, torch_grads["model.embed_tokens.weight"]) > 0.1


@pytest.mark.parametrize("name", list(PORTS))
def test_export_round_trips_into_transformers_strict(name):
    hf, port, _, _ = build(name, "float32")
    module = PORTS[name][1]
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    state = to_torch_state_dict(port, weights=module.KEY_MAP, like=hf.state_dict())
    assert list(state) == list(original)
    fresh = PORTS[name][0]().float()
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    for key, value in fresh.state_dict().items():
        assert value.dtype == original[key].dtype, key
        assert torch.equal(value, original[key]), key


def test_llama_exports_without_like_from_its_regexes():
    """Every Llama rule is a literal with groups and its layouts are einops patterns: no like= needed."""
    hf, port, _, _ = build("llama", "float32")
    state = to_torch_state_dict(port, weights=llama.KEY_MAP)
    assert set(state) == set(hf.state_dict())
    fresh = hf_llama()
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    for key, value in hf.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


class _TiedTorch(torch.nn.Module):
    """Embedding and output projection that are one Parameter (two state-dict keys)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.mix = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.embed(ids))))


class _SharedFlax(nnx.Module):
    """The port shares one Variable in two places (``table`` and ``head``): a tie on both sides."""

    def __init__(self, rngs: nnx.Rngs):
        self.table = nnx.Embed(11, 6, param_dtype=jnp.float64, rngs=rngs)
        self.head = self.table.embedding  # the same nnx.Param, reached by a second path
        self.mix = nnx.Linear(6, 6, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, ids):
        return jnp.tanh(self.mix(self.table(ids))) @ self.head[...].T


def test_a_variable_shared_in_two_places_in_the_port_counts_once(x64):
    """Both torch aliases fill the one shared flax Variable; its gradient already holds both uses, so it is
    compared once under the canonical name. float64 policy: the same math on both sides."""
    torch.manual_seed(0)
    model = _TiedTorch().double()
    key_map = KeyMap(
        [
            (r"embed\.weight", "table.embedding", None),
            (r"out\.weight", "head", None),
            (r"mix\.weight", "mix.kernel", "o i -> i o"),
            (r"mix\.bias", "mix.bias", None),
        ]
    )
    ids = np.random.default_rng(0).integers(0, 11, (2, 5))
    report = assert_parity(model, _SharedFlax(nnx.Rngs(0)), (ids,), weights=key_map)
    assert {r.name for r in report.results if r.kind == "param grad"} == {"embed.weight", "mix.weight", "mix.bias"}
    assert report.ties["embed.weight"].torch_aliases == ("embed.weight", "out.weight")


# ---- a Linen port and a Function port, through flax_ln.parity.Linen / Function ---------------------------

from examples.ports import mlp_function, vit_linen  # noqa: E402
from flax_ln.parity import Function, Linen  # noqa: E402


def linen_vit(dtype, **fields):
    """The Linen ViT and its variables, abstract (shapes only): the comparison fills a copy through the key map."""
    module = vit_linen.ViT(vit_linen.config_from_hf(hf_vit().config), param_dtype=getattr(jnp, dtype), **fields)
    variables = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, IMAGE_VIT, IMAGE_VIT, 3)))
    return Linen(module, variables)


def linen_parity(dtype, flax, **options):
    hf = hf_vit().to(getattr(torch, dtype))
    x = images(IMAGE_VIT).astype(dtype)
    return compare_modules(
        hf, flax, (x,), flax_inputs=(x.transpose(0, 2, 3, 1),), weights=vit_linen.KEY_MAP, forward=LOGITS, **options
    )


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_linen_vit_passes_under_the_policy(dtype):
    """float32 policy (outputs 1e-5, gradients 1e-4), and float64 (1e-12, 1e-10) with ViT's eager softmax, a float32
    island in transformers, lifted to float64. Every gradient under torch's names."""
    with jax.enable_x64(dtype == "float64"):
        report = linen_parity(dtype, linen_vit(dtype))
    assert report.passed, str(report)
    assert {r.name for r in report.results if r.kind == "param grad"} == {n for n, _ in hf_vit().named_parameters()}


def test_planted_tanh_gelu_in_the_linen_vit_is_named_on_both_sides(x64):
    """tanh GELU in block 0's MLP, float64 policy: the GELU is inline in the port's MLP module and torch's own
    parameter-free ``activation_fn`` module: named where it lives on each side, torch's ``activation_fn`` and the
    port MLP's own code between fc1 and fc2."""
    report = linen_parity("float64", linen_vit("float64", tanh_gelu_blocks=(0,)))
    assert not report.passed
    fd = report.first_divergence
    assert (fd.module, fd.flax_module) == ("vit.layers.0.mlp.activation_fn", "blocks_0.mlp"), str(report)
    assert fd.flax_between == ("blocks_0.mlp.fc1", "blocks_0.mlp.fc2"), str(report)
    assert (report.isolation.culprits, report.isolation.flax_culprits) == (
        ["vit.layers.0.mlp.activation_fn"],
        ["blocks_0.mlp"],
    ), str(report)
    # q/k/v kernels are (d, heads, head_dim): their (B, T, n, h) outputs are compared through their rules' layouts
    assert "vit.layers.0.attention.q_proj" not in report.module_skipped
    assert "vit.layers.0.attention.q_proj" in {r.name for r in report.module_errors}


def test_planted_layer_norm_eps_in_the_linen_vit_is_named_on_both_sides():
    """eps 1e-3 instead of 1e-12 in block 1's second LayerNorm, float32 policy: named on both sides."""
    report = linen_parity("float32", linen_vit("float32", ln_2_eps=((1, 1e-3),)))
    assert not report.passed
    _named(report, "vit.layers.1.layernorm_after", "blocks_1.ln_2")


class TorchMLP(torch.nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``: the torch twin of examples/ports/mlp_function."""

    def __init__(self, width=16, hidden=32):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc1, self.fc2 = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_function_mlp_passes_under_the_policy(dtype):
    """float32 and float64 policies: the same math in plain jax.numpy, op-order rounding only."""
    torch_model = randomized(TorchMLP()).to(getattr(torch, dtype))
    x = np.random.default_rng(4).standard_normal((BATCH, SEQ, 16)).astype(dtype)
    with jax.enable_x64(dtype == "float64"):
        flax = Function(mlp_function.apply, mlp_function.init(16, 32, dtype))
        report = assert_parity(torch_model, flax, (x,), weights=mlp_function.KEY_MAP)
    assert {r.name for r in report.results if r.kind == "param grad"} == {n for n, _ in torch_model.named_parameters()}


def test_planted_tanh_gelu_in_the_function_mlp_fails_and_says_localisation_needs_modules():
    torch_model = randomized(TorchMLP())
    x = np.random.default_rng(4).standard_normal((BATCH, SEQ, 16)).astype(np.float32)
    flax = Function(lambda p, x: mlp_function.apply(p, x, approximate=True), mlp_function.init(16, 32))
    report = compare_modules(torch_model, flax, (x,), weights=mlp_function.KEY_MAP)
    assert not report.passed and not report["fc1.weight"].passed
    assert report.first_divergence is None and report.isolation is None
    assert "localisation needs modules" in str(report)


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_planted_tanh_gelu_at_the_default_initialisation_fails_the_default_call(kind):
    """transformers' own initialisation (std 0.02) keeps activations small: tanh GELU for erf in block 0 then sits
    below float32's tolerance, so the float32 comparison alone passes. The default call also runs the float64 check,
    islands lifted, which sees the changed function: it fails, naming the block."""
    torch.manual_seed(0)
    hf = transformers.ViTForImageClassification(hf_vit().config).eval()  # not randomized: the default init
    x = images(IMAGE_VIT).astype(np.float32)
    if kind == "nnx":
        flax = port_of("vit", "float32")
        flax.layers[0].gelu_approximate = True
    else:
        flax = linen_vit("float32", tanh_gelu_blocks=(0,))
    options = dict(flax_inputs=(x.transpose(0, 2, 3, 1),), forward=LOGITS)
    weights = vit.KEY_MAP if kind == "nnx" else vit_linen.KEY_MAP
    alone = compare_modules(hf, flax, (x,), weights=weights, dtype="float32", localize_failures=False, **options)
    assert alone.passed, str(alone)  # what a float32 check alone says of this port
    report = compare_modules(hf, flax, (x,), weights=weights, **options)
    assert report.dtype == "float32" and not report.passed and not report.float64_check.passed, str(report)
    assert report.float64_check["output"].relative_error > 1e-12, str(report)
    # where the GELU lives: torch's activation_fn module; inline in the NNX port's block, the Linen ViT's MLP module
    flax_culprit = {"nnx": "layers.0", "linen": "blocks_0.mlp"}[kind]
    isolation = report.float64_check.isolation
    assert (isolation.culprits, isolation.flax_culprits) == (["vit.layers.0.mlp.activation_fn"], [flax_culprit])


@pytest.mark.parametrize("kind", ["linen", "function"])
def test_linen_and_function_ports_built_in_float32_pass_float64_in_one_argument(kind):
    """The Linen ViT and the Function MLP as a user has them (float32 variables) and dtype="float64": their copies
    are cast to float64, the torch model too, islands lifted: the float64 policy (1e-12, 1e-10) holds."""
    if kind == "linen":
        hf, x = hf_vit(), images(IMAGE_VIT).astype(np.float32)
        flax, weights = linen_vit("float32"), vit_linen.KEY_MAP
        options = dict(flax_inputs=(x.transpose(0, 2, 3, 1),), forward=LOGITS)
        lifted = {("torch", "vit.layers.0.attention", "softmax with dtype=float32")}
    else:
        hf, x = randomized(TorchMLP()), np.random.default_rng(4).standard_normal((BATCH, SEQ, 16)).astype(np.float32)
        flax, weights, options, lifted = (
            Function(mlp_function.apply, mlp_function.init(16, 32)),
            mlp_function.KEY_MAP,
            {},
            set(),
        )
    report = compare_modules(hf, flax, (x,), weights=weights, dtype="float64", **options)
    assert report.passed and report.dtype == "float64", str(report)
    assert lifted <= {(i.side, i.module, i.what) for i in report.islands}, report.islands
    assert next(hf.parameters()).dtype == torch.float32
