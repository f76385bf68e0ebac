"""KeyMap.discover: a port's own loader, written as port authors write theirs (a regex table over a state dict or a
safetensors folder, transposes and reshapes, a cast, a tie by copying, unknown keys skipped), measured into the key
map it implements. The discovered map must load what each port's hand-written KEY_MAP loads, export back into torch,
and pass the parity engine; every loader defect is named."""

import logging
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
from flax import nnx

from flax_ln import to_torch_state_dict
from flax_ln.convert import ConversionError, Discovery, KeyMap, LinenTree, PytreeTree, fill_tree
from flax_ln.convert.trees import NNXTree
from flax_ln.parity import Function, Linen, compare_modules

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from test_ports import IMAGE_VIT, LOGITS, TorchMLP, hf_llama, hf_resnet, hf_vit, images, randomized, token_ids  # noqa: E402

from examples.ports import llama, mlp_function, resnet, vit, vit_linen  # noqa: E402

log = logging.getLogger("port_loader")


def put(model, path, value):
    """Set the NNX variable at dotted ``path`` (attributes, list indices) to ``value`` in its own dtype."""
    *head, last = path.split(".")
    node = model
    for step in head:
        node = node[int(step)] if step.isdigit() else getattr(node, step)
    var = getattr(node, last)
    var.set_value(jnp.asarray(value, var.get_value().dtype))


def current(var):
    """A variable's value to update a part of: zeros where the model was built abstract (shapes only)."""
    old = var.get_value()
    return jnp.zeros(old.shape, old.dtype) if isinstance(old, jax.ShapeDtypeStruct) else old


def build(make, abstract=True):
    """The port, built as its loader builds it: abstract (every variable then filled), or initialised."""
    return nnx.eval_shape(make) if abstract else make()


def put_dict(tree, path, value):
    """Set ``tree``'s nested dict entry at dotted ``path`` to ``value`` in the old entry's dtype."""
    *head, last = path.split(".")
    for step in head:
        tree = tree[step]
    tree[last] = jnp.asarray(value, tree[last].dtype)


# transformers 4.x's names of ViT's layers, as 5.x names them (the tables below are written for 5.x)
_VIT4 = [
    (r"vit\.encoder\.layer\.(\d+)\.attention\.attention\.(q|k|v)\w*\.", r"vit.layers.\1.attention.\2_proj."),
    (r"vit\.encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"vit.layers.\1.attention.o_proj."),
    (r"vit\.encoder\.layer\.(\d+)\.intermediate\.dense\.", r"vit.layers.\1.mlp.fc1."),
    (r"vit\.encoder\.layer\.(\d+)\.output\.dense\.", r"vit.layers.\1.mlp.fc2."),
    (r"vit\.encoder\.layer\.", "vit.layers."),
]


def _as_v5(key):
    for pattern, name in _VIT4:
        key = re.sub("^" + pattern, name, key)
    return key


def run_table(sd, table, write):
    """A port author's loop: the first matching row writes the transformed tensor; unknown keys are logged."""
    for key, w in sd.items():
        for pattern, target in table:
            if m := re.fullmatch(pattern, _as_v5(key)):
                if target is not None:
                    target(m, np.asarray(w), write)
                break
        else:
            log.info("skipping %s", key)


# ---- the five ports' loaders, each its own regex table ----------------------------------------------------------


def llama_loader(dtype=jnp.float32, skip=(), abstract=True):
    """Over a safetensors folder, cast to ``dtype``; the head copied from the embedding (the checkpoint's tie)."""
    c = llama.config_from_hf(hf_llama().config)

    def attn(m, w, put_):
        n = c.heads if m[2] == "q" else c.kv_heads
        put_(f"blocks.{m[1]}.attn.{m[2]}", w.T.reshape(c.width, n, c.head_dim))

    def ffn(model):
        def stack(m, w, put_):
            wi = model.blocks[int(m[1])].ffn.wi
            j = 0 if m[2] == "gate" else 1
            wi.set_value(current(wi).at[j].set(jnp.asarray(w.T, dtype)))

        return stack

    def load(folder):
        sd = safetensors.numpy.load_file(f"{folder}/model.safetensors")
        model = build(lambda: llama.Llama(c, param_dtype=dtype, rngs=nnx.Rngs(0)), abstract)
        layer = r"model\.layers\.(\d+)\."
        table = [(re.escape(k), None) for k in skip] + [
            (layer + r"self_attn\.(q|k|v)_proj\.weight", attn),
            (
                layer + r"self_attn\.o_proj\.weight",
                lambda m, w, p: p(f"blocks.{m[1]}.attn.o", w.T.reshape(c.heads, c.head_dim, c.width)),
            ),
            (layer + r"mlp\.(gate|up)_proj\.weight", ffn(model)),
            (layer + r"mlp\.down_proj\.weight", lambda m, w, p: p(f"blocks.{m[1]}.ffn.wo", w.T)),
            (layer + r"input_layernorm\.weight", lambda m, w, p: p(f"blocks.{m[1]}.norm1.scale", w)),
            (layer + r"post_attention_layernorm\.weight", lambda m, w, p: p(f"blocks.{m[1]}.norm2.scale", w)),
            (r"model\.norm\.weight", lambda m, w, p: p("final_norm.scale", w)),
            (r"model\.embed_tokens\.weight", lambda m, w, p: (p("tok.embedding", w), p("head.proj.kernel", w.T))),
        ]
        run_table(sd, table, lambda path, value: put(model, path, value))
        return model

    return load


def resnet_loader(sd):
    c = resnet.config_from_hf(hf_resnet().config)
    model = build(lambda: resnet.ResNet(c, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    parts = {"layer.0": "reduce", "layer.1": "spatial", "layer.2": "expand", "shortcut": "proj"}
    norm = {"weight": "scale", "bias": "bias", "running_mean": "mean", "running_var": "var"}

    def where(m):
        if m[1] == "embedder.embedder":
            return "stem.unit"
        s, b, part = re.fullmatch(r"encoder\.stages\.(\d+)\.layers\.(\d+)\.(.*)", m[1]).groups()
        return f"stages.{s}.{b}.{parts[part]}"

    table = [
        (r"resnet\.(.*)\.convolution\.weight", lambda m, w, p: p(where(m) + ".conv.kernel", w.transpose(2, 3, 1, 0))),
        (
            r"resnet\.(.*)\.normalization\.(weight|bias|running_mean|running_var)",
            lambda m, w, p: p(where(m) + ".norm." + norm[m[2]], w),
        ),
        (r"classifier\.1\.weight", lambda m, w, p: p("classify.kernel", w.T)),
        (r"classifier\.1\.bias", lambda m, w, p: p("classify.bias", w)),
    ]
    run_table(sd, table, lambda path, value: put(model, path, value))
    return model


def vit_loader(sd):
    c = vit.config_from_hf(hf_vit().config)
    model = build(lambda: vit.ViT(c, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    h = c.width // c.heads

    def qkv(m, w, p):
        attn = model.layers[int(m[1])].attn
        var = attn.qkv if m[3] == "weight" else attn.qkv_bias
        value = w.T.reshape(c.width, c.heads, h) if m[3] == "weight" else w.reshape(c.heads, h)
        var.set_value(current(var).at["qkv".index(m[2])].set(value))

    layer = r"vit\.layers\.(\d+)\."
    table = [
        (r"vit\.embeddings\.cls_token", lambda m, w, p: p("cls", w.reshape(-1))),
        (r"vit\.embeddings\.position_embeddings", lambda m, w, p: p("pos", w[0])),
        (
            r"vit\.embeddings\.patch_embeddings\.projection\.weight",
            lambda m, w, p: p("patches.conv.kernel", np.transpose(w, (2, 3, 1, 0))),
        ),
        (r"vit\.embeddings\.patch_embeddings\.projection\.bias", lambda m, w, p: p("patches.conv.bias", w)),
        (layer + r"attention\.(q|k|v)_proj\.(weight|bias)", qkv),
        (
            layer + r"attention\.o_proj\.weight",
            lambda m, w, p: p(f"layers.{m[1]}.attn.o", w.T.reshape(c.heads, h, c.width)),
        ),
        (layer + r"attention\.o_proj\.bias", lambda m, w, p: p(f"layers.{m[1]}.attn.o_bias", w)),
        (
            layer + r"layernorm_(before|after)\.(weight|bias)",
            lambda m, w, p: p(
                f"layers.{m[1]}.ln{1 if m[2] == 'before' else 2}.{'scale' if m[3] == 'weight' else 'bias'}", w
            ),
        ),
        (layer + r"mlp\.(fc1|fc2)\.weight", lambda m, w, p: p(f"layers.{m[1]}.{m[2]}.kernel", w.T)),
        (layer + r"mlp\.(fc1|fc2)\.bias", lambda m, w, p: p(f"layers.{m[1]}.{m[2]}.bias", w)),
        (r"vit\.layernorm\.(weight|bias)", lambda m, w, p: p("norm." + ("scale" if m[1] == "weight" else "bias"), w)),
        (r"classifier\.weight", lambda m, w, p: p("classify.kernel", w.T)),
        (r"classifier\.bias", lambda m, w, p: p("classify.bias", w)),
    ]
    run_table(sd, table, lambda path, value: put(model, path, value))
    return model


def linen_module():
    return vit_linen.ViT(vit_linen.config_from_hf(hf_vit().config), param_dtype=jnp.float32)


def vit_linen_loader(sd):
    module = linen_module()
    c = module.config
    h = c.width // c.heads
    variables = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, IMAGE_VIT, IMAGE_VIT, 3)))  # shapes
    params = variables["params"]
    names = {"q": "query", "k": "key", "v": "value"}
    layer = r"vit\.layers\.(\d+)\."
    table = [
        (r"vit\.embeddings\.cls_token", lambda m, w, p: p("cls", w.reshape(-1))),
        (r"vit\.embeddings\.position_embeddings", lambda m, w, p: p("pos", w[0])),
        (
            r"vit\.embeddings\.patch_embeddings\.projection\.weight",
            lambda m, w, p: p("patch_embed.kernel", w.transpose(2, 3, 1, 0)),
        ),
        (r"vit\.embeddings\.patch_embeddings\.projection\.bias", lambda m, w, p: p("patch_embed.bias", w)),
        (
            layer + r"attention\.(q|k|v)_proj\.weight",
            lambda m, w, p: p(f"blocks_{m[1]}.attn.{names[m[2]]}.kernel", w.T.reshape(c.width, c.heads, h)),
        ),
        (
            layer + r"attention\.(q|k|v)_proj\.bias",
            lambda m, w, p: p(f"blocks_{m[1]}.attn.{names[m[2]]}.bias", w.reshape(c.heads, h)),
        ),
        (
            layer + r"attention\.o_proj\.weight",
            lambda m, w, p: p(f"blocks_{m[1]}.attn.out.kernel", w.T.reshape(c.heads, h, c.width)),
        ),
        (layer + r"attention\.o_proj\.bias", lambda m, w, p: p(f"blocks_{m[1]}.attn.out.bias", w)),
        (
            layer + r"layernorm_(before|after)\.(weight|bias)",
            lambda m, w, p: p(
                f"blocks_{m[1]}.ln_{1 if m[2] == 'before' else 2}.{'scale' if m[3] == 'weight' else 'bias'}", w
            ),
        ),
        (layer + r"mlp\.(fc1|fc2)\.weight", lambda m, w, p: p(f"blocks_{m[1]}.mlp.{m[2]}.kernel", w.T)),
        (layer + r"mlp\.(fc1|fc2)\.bias", lambda m, w, p: p(f"blocks_{m[1]}.mlp.{m[2]}.bias", w)),
        (r"vit\.layernorm\.(weight|bias)", lambda m, w, p: p("norm." + ("scale" if m[1] == "weight" else "bias"), w)),
        (r"classifier\.weight", lambda m, w, p: p("head.kernel", w.T)),
        (r"classifier\.bias", lambda m, w, p: p("head.bias", w)),
    ]
    run_table(sd, table, lambda path, value: put_dict(params, path, value))
    return variables


def mlp_loader(sd):
    params = mlp_function.init(16, 32)
    table = [
        (r"norm\.weight", lambda m, w, p: p("norm.scale", w)),
        (r"norm\.bias", lambda m, w, p: p("norm.bias", w)),
        (r"(fc\d)\.weight", lambda m, w, p: p(f"{m[1]}.w", np.ascontiguousarray(w.T))),
        (r"(fc\d)\.bias", lambda m, w, p: p(f"{m[1]}.b", w)),
    ]
    run_table(sd, table, lambda path, value: put_dict(params, path, value))
    return params


# name: (torch model, loader, discover options, an empty flax tree, the flax side for compare_modules, options)
def _nnx_tree(module, cls, make_hf):
    config = module.config_from_hf(make_hf().config)
    return lambda: NNXTree(nnx.eval_shape(lambda: cls(config, param_dtype=jnp.float32, rngs=nnx.Rngs(0))))


def _linen_tree():
    module = linen_module()
    return LinenTree(jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, IMAGE_VIT, IMAGE_VIT, 3))))


def _image_inputs(size):
    x = images(size).astype(np.float32)
    return (x,), dict(flax_inputs=(x.transpose(0, 2, 3, 1),), forward=LOGITS)


PORTS = {
    "llama": (hf_llama, llama_loader(), dict(takes="folder"), _nnx_tree(llama, llama.Llama, hf_llama), llama.KEY_MAP),
    "resnet": (hf_resnet, resnet_loader, {}, _nnx_tree(resnet, resnet.ResNet, hf_resnet), resnet.KEY_MAP),
    "vit": (hf_vit, vit_loader, {}, _nnx_tree(vit, vit.ViT, hf_vit), vit.KEY_MAP),
    "vit_linen": (hf_vit, vit_linen_loader, dict(kind="linen"), _linen_tree, vit_linen.KEY_MAP),
    "mlp_function": (
        lambda: randomized(TorchMLP()),
        mlp_loader,
        dict(kind="function"),
        lambda: PytreeTree(mlp_function.init(16, 32)),
        mlp_function.KEY_MAP,
    ),
}


def loaded(tree, state_dict, key_map):
    """Every variable of ``tree`` filled from ``state_dict`` through ``key_map``: ``{path: array}``."""
    fill_tree(tree, state_dict, key_map)
    return {p: np.asarray(tree.read(p)) for p in tree.variables()}


def flax_side(name, tree):
    if name == "vit_linen":
        return Linen(linen_module(), tree.tree())
    if name == "mlp_function":
        return Function(mlp_function.apply, tree.tree())
    return tree.model


def inputs(name):
    if name == "llama":
        return (token_ids(),), dict(forward=LOGITS)
    if name == "mlp_function":
        return (np.random.default_rng(4).standard_normal((2, 7, 16)).astype(np.float32),), {}
    return _image_inputs(32 if name == "resnet" else IMAGE_VIT)


@pytest.mark.lower_bounds  # the lower-bounds CI step runs it (pyproject.toml, markers)
@pytest.mark.parametrize("name", list(PORTS))
def test_the_discovered_map_of_each_ports_loader_is_its_key_map(name):
    """Same values as the hand-written KEY_MAP for a random state dict (exact: both are copies), exported back into
    torch with strict=True, rebuilt from its source, and the float32 parity policy through it (op-order rounding)."""
    make_hf, loader, options, empty, key_map = PORTS[name]
    hf = make_hf()
    found = KeyMap.discover(loader, hf, **options)
    assert isinstance(found.discovery, Discovery) and found.discovery.loads >= 6
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    want = loaded(empty(), state, key_map)
    got = loaded(empty(), state, found)
    assert want.keys() == got.keys() and all(np.array_equal(want[p], got[p]) for p in want), name
    rebuilt = eval(found.to_source(comments=found.discovery.comments), {"KeyMap": KeyMap, "np": np})
    again = loaded(empty(), state, rebuilt)
    assert all(np.array_equal(want[p], again[p]) for p in want)
    tree = empty()
    fill_tree(tree, state, found)
    exported = to_torch_state_dict(flax_side(name, tree), weights=found, like=hf.state_dict())
    fresh = make_hf()
    fresh.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in exported.items()}, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), hf.state_dict().values()))
    args, kwargs = inputs(name)
    report = compare_modules(
        hf, flax_side(name, empty()), args, weights=found, dtype="float32", localize_failures=False, **kwargs
    )
    assert report.passed, str(report)
    assert report.discovery is found.discovery and "discovered from 6 loads" in str(report)
    if name == "llama":  # the loader copies the embedding into the head: one torch tensor, two flax variables
        assert found.discovery.loads == 6  # 4 constant loads, one float32 digit (ids below 2**20), 1 check load
        assert found.discovery.ties == {"model.embed_tokens.weight": ["head.proj.kernel", "tok.embedding"]}
    if name == "resnet":  # BatchNorm's batch counters: buffers the loader skips, listed and fine
        assert found.discovery.dropped and all(k.endswith("num_batches_tracked") for k in found.discovery.dropped)


# ---- loader defects, each named ------------------------------------------------------------------------------


def test_a_table_that_drops_one_layers_key_is_named_and_admitted():
    """The loader's table skips layer 1's down projection: the key is never read and the port's variable it should fill
    keeps its initial value. Both are named; admitted, the key becomes an ignore rule and the variable a constant."""
    hf, dropped = hf_llama(), "model.layers.1.mlp.down_proj.weight"
    loader = llama_loader(skip=(dropped,), abstract=False)  # built initialised: the variable keeps its init
    with pytest.raises(ConversionError) as error:
        KeyMap.discover(loader, hf, takes="folder")
    assert f"'{dropped}': a parameter the loader never reads" in str(error.value)
    assert "flax variable 'blocks.1.ffn.wo': left at init by the loader (array (48, 32)" in str(error.value)
    found = KeyMap.discover(
        loader, hf, takes="folder", allow_dropped=[re.escape(dropped)], allow_unfilled=[r"blocks\.1\.ffn\.wo"]
    )
    assert found.discovery.dropped == {dropped: "all"} and list(found.discovery.unfilled) == ["blocks.1.ffn.wo"]
    assert found.matches(dropped)[0][0].templates == ()  # an ignore rule
    initial = np.asarray(llama.Llama(llama.config_from_hf(hf.config), rngs=nnx.Rngs(0)).blocks[1].ffn.wo[...])
    values = loaded(PORTS["llama"][3](), {k: v.numpy() for k, v in hf.state_dict().items()}, found)
    assert np.array_equal(values["blocks.1.ffn.wo"], initial)  # the constant: what the loader left there
    assert "dropped by the loader: model.layers.1.mlp.down_proj.weight (all)" in str(found)


def _mlp(extra=None, change=None):
    """mlp_loader with ``extra`` flax-only parameters (left as given) and ``change(params, sd)`` applied after."""

    def load(sd):
        params = mlp_loader(sd)
        params.update(extra() if extra else {})
        if change:
            change(params, sd)
        return params

    return load


def test_a_parameter_left_at_init_is_named_and_admitted_as_a_constant():
    hf = randomized(TorchMLP())
    loader = _mlp(extra=lambda: {"temperature": np.ones((), np.float32)})
    with pytest.raises(ConversionError, match=r"'temperature': left at init by the loader \(constant 1.0\)"):
        KeyMap.discover(loader, hf, kind="function")
    found = KeyMap.discover(loader, hf, kind="function", allow_unfilled=["temperature"])
    assert found.discovery.unfilled == {"temperature": "constant 1.0"} and found.constants == {"temperature": 1.0}
    tree = PytreeTree({**mlp_function.init(16, 32), "temperature": np.zeros((), np.float32)})
    assert loaded(tree, {k: v.numpy() for k, v in hf.state_dict().items()}, found)["temperature"] == 1.0


def test_a_variable_initialised_at_random_by_each_load_is_reported_left_at_init():
    """A loader that draws a fresh value each call: no map explains it, and it is said to be left at init."""
    loader = _mlp(extra=lambda: {"noise": np.random.default_rng().standard_normal(4).astype(np.float32)})
    with pytest.raises(ConversionError, match=r"'noise': left at init .*a different value at each load"):
        KeyMap.discover(loader, randomized(TorchMLP()), kind="function")


class Square(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)


def test_one_variable_filled_through_two_layouts_is_refused():
    def loader(sd):
        w = sd["lin.weight"]
        return {"w": np.stack([w.T, w]), "b": sd["lin.bias"]}  # (2, 4, 4): the kernel, then torch's own layout

    with pytest.raises(
        ConversionError, match=r"'w': filled by 'lin.weight' through two layouts \('a b -> b a' and 'identity'\)"
    ):
        KeyMap.discover(loader, Square(), kind="function")


@pytest.mark.parametrize("combine", ["add", "multiply"])
def test_a_loader_that_is_not_a_gather_is_refused_naming_the_variable(combine):
    def change(params, sd):
        a, b = sd["fc1.weight"].T, sd["fc2.weight"]  # both (16, 32)
        params["fc1"]["w"] = a + b if combine == "add" else a * b

    with pytest.raises(ConversionError, match=r"flax variable 'fc1.w': (is not a gather|not a function of one torch)"):
        KeyMap.discover(_mlp(change=change), randomized(TorchMLP()), kind="function")


def test_a_norm_scale_stored_as_an_offset_from_one_is_discovered_and_compared_through():
    """The port keeps ``scale - 1`` and applies ``1 + scale``: the rule carries offset -1, the discovery lists it, and
    the float32 parity policy holds through it."""

    def change(params, sd):
        params["norm"]["scale"] = sd["norm.weight"] - 1

    hf = randomized(TorchMLP())
    found = KeyMap.discover(_mlp(change=change), hf, kind="function")
    assert found.discovery.offsets == {"norm.scale": (1.0, -1.0)}
    assert "norm.scale (scale 1, offset -1)" in str(found)

    def apply(p, x):
        return mlp_function.apply({**p, "norm": {**p["norm"], "scale": 1 + p["norm"]["scale"]}}, x)

    x = np.random.default_rng(4).standard_normal((2, 7, 16)).astype(np.float32)
    report = compare_modules(hf, Function(apply, mlp_function.init(16, 32)), (x,), weights=found, dtype="float32")
    assert report.passed, str(report)


class QKV(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, x):
        return self.q(x) * self.k(x) + self.v(x)


def test_a_loader_that_fuses_q_k_v_is_discovered_as_three_slice_rules():
    def loader(sd):
        kernel = np.concatenate([sd[f"{n}.weight"].T for n in "qkv"], axis=1)  # (8, 24)
        return {"qkv": kernel, "qkv_b": np.concatenate([sd[f"{n}.bias"] for n in "qkv"])}  # (24,)

    def apply(p, x):
        q, k, v = jnp.split(x @ p["qkv"] + p["qkv_b"], 3, axis=-1)  # each (..., 8)
        return q * k + v

    hf = randomized(QKV())
    found = KeyMap.discover(loader, hf, kind="function")
    templates = {t for rule in found.rules for t in rule.templates}
    assert {"qkv[:, 0:8]", "qkv[:, 8:16]", "qkv[:, 16:24]", "qkv_b[0:8]", "qkv_b[8:16]", "qkv_b[16:24]"} <= templates
    x = np.random.default_rng(5).standard_normal((2, 3, 8)).astype(np.float32)
    flax = Function(apply, {"qkv": np.zeros((8, 24), np.float32), "qkv_b": np.zeros(24, np.float32)})
    report = compare_modules(hf, flax, (x,), weights=found, dtype="float32")
    assert report.passed, str(report)


def test_a_bfloat16_loader_decodes_with_more_digit_loads():
    """bfloat16 holds integers exactly only to 256: the digits are narrower, so more loads; the map still loads what
    the port's KEY_MAP loads into the bfloat16 port."""
    hf = hf_llama()
    narrow = KeyMap.discover(llama_loader(jnp.bfloat16), hf, takes="folder")
    # 4 constant loads, 1 check load, and digit loads: the tiny Llama's ~20k elements need one float32 digit (the
    # port test sees 6 loads) but two bfloat16 digits, each below 256
    assert narrow.discovery.loads == 7
    config = llama.config_from_hf(hf.config)

    def empty():
        return NNXTree(nnx.eval_shape(lambda: llama.Llama(config, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))

    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    want, got = loaded(empty(), state, llama.KEY_MAP), loaded(empty(), state, narrow)
    assert all(np.array_equal(want[p], got[p]) for p in want)


def test_a_dict_without_kind_is_a_type_error_saying_so():
    with pytest.raises(TypeError, match="pass kind='linen'.*or kind='function'"):
        KeyMap.discover(mlp_loader, randomized(TorchMLP()))


class Tied(torch.nn.Module):
    """The ports guide's torch model: an embedding tied to the head, two layers, a norm, an integer buffer."""

    def __init__(self, vocab=16, d=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(2))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))


def guide_loader(folder, forget_bias=False):
    """The ports guide's loader: safetensors folder, regex table, bfloat16, the tie copied, unknown keys logged."""
    tensors = safetensors.numpy.load_file(f"{folder}/model.safetensors")
    params = {"embed": None, "head": None, "norm": {}, "layers": [{}, {}]}
    for key, w in tensors.items():
        w = jnp.asarray(w, jnp.bfloat16)
        if key == "embed.weight":
            params["embed"], params["head"] = w, w.T
        elif m := re.fullmatch(r"layers\.(\d+)\.(weight|bias)", key):
            params["layers"][int(m[1])]["w" if m[2] == "weight" else "b"] = w.T if m[2] == "weight" else w
        elif m := re.fullmatch(r"norm\.(weight|bias)", key):
            params["norm"][{"weight": "scale", "bias": "bias"}[m[1]]] = w
        else:
            log.info("skipping %s", key)
    if forget_bias:
        params["layers"][1]["b"] = jnp.zeros(8, jnp.bfloat16)
    return params


def test_the_ports_guide_example_a_bfloat16_pytree_with_a_tie_and_a_forgotten_bias():
    model = Tied()
    found = KeyMap.discover(guide_loader, model, takes="folder", kind="function")
    assert found.discovery.ties == {"embed.weight": ["embed", "head"]} and found.discovery.dropped == {"step": "all"}
    assert found.discovery.loads == 7  # 288 elements: two bfloat16 digits (below 256), 4 constant loads, 1 check
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    layer = {"w": bf16(8, 8), "b": bf16(8)}
    tree = PytreeTree(
        {
            "embed": bf16(16, 8),
            "head": bf16(8, 16),
            "norm": {"scale": bf16(8), "bias": bf16(8)},
            "layers": [layer, layer],
        }
    )
    values = loaded(tree, state, found)
    assert np.array_equal(values["head"], state["embed.weight"].T.astype(jnp.bfloat16))
    with pytest.raises(ConversionError) as error:
        KeyMap.discover(lambda f: guide_loader(f, forget_bias=True), model, takes="folder", kind="function")
    assert "'layers.1.bias': a parameter the loader never reads" in str(error.value)
    assert "flax variable 'layers.1.b': left at init by the loader (constant 0.0)" in str(error.value)


class Stack(torch.nn.Module):
    def __init__(self, n=3, d=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_a_loader_that_stacks_layers_for_a_scan_is_one_folded_rule_per_family():
    """Layer i's tensors fill index i of stacked (layers, ...) variables: one ``(\\d+)`` rule a family, ``w[\\1]``."""

    def loader(sd):
        return {
            "w": np.stack([sd[f"layers.{i}.weight"].T for i in range(3)]),  # (3, in, out)
            "b": np.stack([sd[f"layers.{i}.bias"] for i in range(3)]),  # (3, out)
        }

    def apply(p, x):
        def step(x, wb):
            return jnp.tanh(x @ wb[0] + wb[1]), None

        return jax.lax.scan(step, x, (p["w"], p["b"]))[0]

    hf = randomized(Stack())
    found = KeyMap.discover(loader, hf, kind="function")
    assert [(r.pattern, r.templates) for r in found.rules] == [
        (r"layers\.(\d+)\.weight", (r"w[\1]",)),
        (r"layers\.(\d+)\.bias", (r"b[\1]",)),
    ]
    x = np.random.default_rng(6).standard_normal((2, 4)).astype(np.float32)
    flax = Function(apply, {"w": np.zeros((3, 4, 4), np.float32), "b": np.zeros((3, 4), np.float32)})
    report = compare_modules(hf, flax, (x,), weights=found, dtype="float32")
    assert report.passed, str(report)


class Rotary(torch.nn.Module):
    """A query projection of 2 heads of 4: rotate-half order within each head, as Hugging Face checkpoints hold it."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(6, 8, bias=False)

    def forward(self, x):
        return self.q(x)


def test_a_loader_that_interleaves_rotary_halves_is_discovered_with_axis_sizes():
    """A port with interleaved rotary pairs reorders each head's rows, (h two d) -> (h d two): a split axis
    permuted, which einops writes only with the sizes of the split axes; discovered, written as source, compared."""

    def loader(sd):
        w = sd["q.weight"].reshape(2, 2, 2, 6)  # (h, two, d, in)
        return {"q": w.transpose(3, 0, 2, 1).reshape(6, 8)}  # (in, (h d two))

    def apply(p, x):
        y = (x @ p["q"]).reshape(*x.shape[:-1], 2, 2, 2)  # (..., h, d, two)
        return y.swapaxes(-1, -2).reshape(*x.shape[:-1], 8)  # back to torch's (h two d)

    hf = randomized(Rotary())
    found = KeyMap.discover(loader, hf, kind="function")
    (rule,) = found.rules
    assert rule.layouts[0].pattern == "(a b c) d -> d (a c b); a=2, b=2, c=2"
    rebuilt = eval(found.to_source(), {"KeyMap": KeyMap})
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    want = loader(state)["q"]
    for key_map in (found, rebuilt):
        assert np.array_equal(loaded(PytreeTree({"q": np.zeros((6, 8), np.float32)}), state, key_map)["q"], want)
    x = np.random.default_rng(6).standard_normal((2, 3, 6)).astype(np.float32)
    report = compare_modules(hf, Function(apply, {"q": np.zeros((6, 8), np.float32)}), (x,), weights=found)
    assert report.passed, str(report)


def test_a_loader_that_flips_a_tensor_is_named_as_reading_it_in_no_einops_order():
    def loader(sd):
        return {"q": sd["q.weight"][::-1].T.copy()}  # rows reversed: a gather, but no rearrange

    with pytest.raises(ConversionError) as error:
        KeyMap.discover(loader, randomized(Rotary()), kind="function")
    assert "flax variable 'q': holds the elements of 'q.weight'" in str(error.value)
    assert "never reads" not in str(error.value)  # the loader reads it; what it does is what is not a key map
