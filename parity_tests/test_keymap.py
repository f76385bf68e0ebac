"""KeyMap: a port's own table from torch keys to its variables. Parsing, every strictness error (all listed at
once, nothing loaded), layouts (einops, triple, Enum), tuple and stacked templates, ties, export with and
without like=, and the plan the parity engine maps gradients through."""

import enum
import re
import warnings

import jax
import numpy as np
import pytest
import torch
from flax import linen, nnx

import flax_ln
import torch_ref.gpt as tg
from flax_ln import ConversionError, KeyMap, load_torch_state_dict, to_torch_state_dict
from flax_ln.convert import LinenTree, PytreeTree, Tie, fill_tree, find_ties, keymap_transfer
from flax_ln.parity import Function, Linen

V, D, N, H = 11, 6, 2, 3  # vocabulary, width, heads, head size


class TorchToy(torch.nn.Module):
    """An embedding tied to the head (one Parameter, two keys), a fused q projection, a norm, a buffer."""

    def __init__(self, tied=True):
        super().__init__()
        self.embed = torch.nn.Embedding(V, D)
        self.q = torch.nn.Linear(D, N * H, bias=False)
        self.norm = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("freq", torch.arange(4.0))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn_like(p))


class Attn(nnx.Module):
    def __init__(self, rngs):
        self.q = nnx.Param(nnx.initializers.normal()(rngs.params(), (D, N, H)))  # (d, n, h)


class Port(nnx.Module):
    """Its own names and nesting; the tie kept as two variables."""

    def __init__(self, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.emb = nnx.Embed(V, D, rngs=rngs)
        self.attn = Attn(rngs)
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.out = nnx.Linear(D, V, use_bias=False, rngs=rngs)


class SharedPort(nnx.Module):
    """The port ties too: one module (and so one variable) at two paths."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.emb = nnx.Embed(V, D, rngs=rngs)
        self.attn = Attn(rngs)
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.head = self.emb


RULES = [
    (r"embed\.weight", "emb.embedding", None),
    (r"head\.weight", "out.kernel", "v d -> d v"),
    (r"q\.weight", "attn.q", "(n h) d -> d n h"),
    (r"norm\.weight", "ln.scale", None),
    (r"norm\.bias", "ln.bias", None),
    (r"freq", None, None),
]


def params(model):
    return {".".join(map(str, p)): np.array(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def loaded(rules=RULES, torch_model=None):
    torch_model = torch_model or TorchToy()
    return load_torch_state_dict(Port(), torch_model.state_dict(), weights=KeyMap(rules)), torch_model


def test_load_places_every_key_through_its_layout():
    port, t = loaded()
    q = t.q.weight.detach().numpy()  # (n h, d)
    np.testing.assert_array_equal(port.attn.q[...], q.reshape(N, H, D).transpose(2, 0, 1))  # (d, n, h)
    np.testing.assert_array_equal(port.out.kernel[...], t.embed.weight.detach().numpy().T)  # (d, v)
    np.testing.assert_array_equal(port.emb.embedding[...], t.embed.weight.detach().numpy())
    np.testing.assert_array_equal(port.ln.scale[...], t.norm.weight.detach().numpy())


def test_the_mapping_form_is_the_same_map():
    as_list = KeyMap(RULES)
    as_dict = KeyMap({regex: (template, layout) for regex, template, layout in RULES})
    assert as_list.rules == as_dict.rules
    a, _ = loaded(RULES)
    b = load_torch_state_dict(Port(rngs=nnx.Rngs(1)), TorchToy().state_dict(), weights=as_dict)
    assert params(a).keys() == params(b).keys()


def test_bad_rules_are_all_listed_when_the_map_is_built():
    with pytest.raises(ValueError) as info:
        KeyMap(
            [
                (r"a(", "x", None),  # regex does not compile
                (r"b", "x", "o i"),  # not a pattern
                (r"c", ("x", "y"), ("o i -> i o",)),  # two templates, one layout
                (r"d", None, "o i -> i o"),  # an ignored key with a layout
                (r"e", "x", ((0, 0), None, False)),  # not a permutation
                (r"f", "x", "a b -> a c"),  # axes differ
            ]
        )
    text = str(info.value)
    assert "6 bad rule(s)" in text
    for index in range(6):
        assert f"rule {index} " in text


def test_a_repeated_axis_and_templates_naming_missing_groups_are_bad_rules_listed_together():
    """Every bad rule in one ValueError naming its index and regex, when the map is built: a layout einops
    cannot parse, and templates naming groups their regex lacks (which would fail only after the torch run)."""
    with pytest.raises(ValueError) as info:
        KeyMap(
            [
                (r"a\.weight", "x.kernel", "o i -> i o o"),  # a repeated axis
                (r"b\.(\d+)\.weight", r"x.\3.kernel", None),  # the regex has one group
                (r"c\.(?P<layer>\d+)\.weight", r"x.\g<foo>.kernel", None),  # no group named foo
                (r"d\.weight", r"x.\1", None),  # no group at all
                (r"e\.(\d+)", (r"x.\1", r"y.\2"), None),  # the second of two templates
                (r"f\.(\d+)\.(?P<kind>w|b)", (r"x.\1.\g<kind>", r"y.\g<2>"), None),  # a good rule
            ]
        )
    text = str(info.value)
    assert "5 bad rule(s)" in text
    lines = text.splitlines()[1:]
    for index, regex, says in [
        (0, r"a\\.weight", 'duplicate dimension "o"'),
        (1, r"b\\.(\\d+)", "invalid group reference 3"),
        (2, "foo", "unknown group name 'foo'"),
        (3, r"d\\.weight", "the regex has no groups"),
        (4, r"e\\.(\\d+)", "invalid group reference 2"),
    ]:
        line = next(line for line in lines if line.strip().startswith(f"rule {index} "))
        assert regex in line and says in line, line
    assert not any(line.strip().startswith("rule 5 ") for line in lines)


def snapshot(model):
    return {k: v.copy() for k, v in params(model).items()}


def assert_unchanged(before, model):
    after = params(model)
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)


def test_every_problem_is_listed_in_one_error_and_nothing_is_loaded():
    sd = dict(TorchToy().state_dict())
    sd["extra.weight"] = torch.zeros(3)  # no rule matches
    sd["q.weight"] = torch.zeros(N * H + 1, D)  # does not split into (n h)
    del sd["norm.bias"]  # ln.bias: filled by nothing
    rules = [*RULES, (r"(embed|extra)\.weight", "emb.embedding", None)]  # embed.weight: two rules
    port = Port()
    before = snapshot(port)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rule 4 (norm.bias) matches nothing now: a warning, tested below
        with pytest.raises(ConversionError) as info:
            load_torch_state_dict(port, sd, weights=KeyMap(rules))
    e = info.value
    text = str(e)
    assert e.unexpected == [] or e.unexpected == ["extra.weight"]
    assert "embed.weight" in text and "rule 0 " in text and "rule 6 " in text and "exactly one rule" in text
    assert "'extra.weight'" in text  # matched by rule 6 alone, which fills emb.embedding a second time...
    assert "'q.weight'" in text and "rule 2 " in text and "(n h) d -> d n h" in text
    assert "flax variable 'ln.bias'" in text and "no rule fills" in text
    assert_unchanged(before, port)


def test_a_key_no_rule_matches_and_a_path_the_model_lacks():
    sd = dict(TorchToy().state_dict())
    sd["extra.weight"] = torch.zeros(3)
    rules = [r if r[0] != r"norm\.bias" else (r"norm\.bias", "ln.bais", None) for r in RULES]
    port = Port()
    before = snapshot(port)
    with pytest.raises(ConversionError) as info:
        load_torch_state_dict(port, sd, weights=KeyMap(rules))
    assert info.value.unexpected == ["extra.weight"]
    text = str(info.value)
    assert "'norm.bias': rule 4 r'norm\\.bias' -> 'ln.bais'" in text and "did you mean 'ln.bias'" in text
    assert "(regex, None, None) to ignore it" in text
    assert_unchanged(before, port)
    with pytest.raises(ConversionError, match="unexpected key 'extra.weight'"):  # the engine's plan is as strict
        KeyMap(rules).resolve(port, sd)


def test_two_keys_into_one_variable_must_be_aliases_or_equal():
    untied = TorchToy(tied=False)
    rules = [*RULES[:1], (r"head\.weight", "emb.embedding", None), *RULES[2:]]  # both keys -> emb.embedding
    port = SharedPort()
    before = snapshot(port)
    with pytest.raises(ConversionError, match=r"flax variable 'emb.embedding': filled by 'embed.weight'"):
        load_torch_state_dict(port, untied.state_dict(), weights=KeyMap(rules))
    assert_unchanged(before, port)
    # equal values are accepted, and so are aliases of one Parameter (a tie on both sides)
    with torch.no_grad():
        untied.head.weight.copy_(untied.embed.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in (untied, TorchToy(tied=True)):
            port = load_torch_state_dict(SharedPort(), t.state_dict(), weights=KeyMap(rules))
    np.testing.assert_array_equal(port.emb.embedding[...], t.embed.weight.detach().numpy())


def test_aliases_into_one_variable_through_different_layouts_must_agree_after_them():
    """One tied tensor into one variable by two layouts (two rules, or one rule's tuple template): a square
    matrix fits both, so only the values after the layouts tell whether the variable is filled once."""
    w = np.arange(16.0, dtype=np.float32).reshape(4, 4)
    two_rules = KeyMap([(r"wte\.weight", "emb", None), (r"lm_head\.weight", "emb", "v d -> d v")])
    one_rule = KeyMap([(r"wte\.weight", ("emb", "emb"), (None, "v d -> d v")), (r"lm_head\.weight", None, None)])
    for key_map in (two_rules, one_rule):
        tree = PytreeTree({"emb": np.zeros((4, 4), np.float32)})
        with pytest.raises(ConversionError, match=r"flax variable 'emb': filled by .*through different layouts"):
            fill_tree(tree, {"wte.weight": w, "lm_head.weight": w}, key_map)  # one array: a tie
        np.testing.assert_array_equal(tree.read("emb"), 0)  # nothing written
        symmetric = w + w.T
        fill_tree(tree, {"wte.weight": symmetric, "lm_head.weight": symmetric}, key_map)
        np.testing.assert_array_equal(tree.read("emb"), symmetric)


def test_unfilled_variables_are_errors_and_strict_false_allows_them():
    sd = {k: v for k, v in TorchToy().state_dict().items() if not k.startswith("norm")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConversionError) as info:
            load_torch_state_dict(Port(), sd, weights=KeyMap(RULES))
        assert [p for p, _ in info.value.unfilled] == ["ln.bias", "ln.scale"]
        port = Port()
        scale = np.array(port.ln.scale[...])
        load_torch_state_dict(port, {**sd, "other": torch.zeros(1)}, weights=KeyMap(RULES), strict=False)
    np.testing.assert_array_equal(port.ln.scale[...], scale)


def test_a_rule_that_matches_no_key_warns_naming_it():
    rules = [*RULES, (r"lm_head\.weight", "out.kernel", "v d -> d v")]  # an alias this checkpoint lacks
    with pytest.warns(UserWarning, match=r"matched no torch key.*rule 6 r'lm_head\\.weight'"):
        loaded(rules)


class Fused(enum.Enum):
    """Layouts as some model collections keep them: (permutation, reshape, reshape_first)."""

    QKV = ((1, 0), (D, N, H), False)  # (n h, d) -> (d, n h) -> (d, n, h)
    QKV_FIRST = ((2, 0, 1), (N, H, D), True)  # (n h, d) -> (n, h, d) -> (d, n, h)


@pytest.mark.parametrize("layout", [Fused.QKV.value, Fused.QKV, Fused.QKV_FIRST, Fused.QKV_FIRST.value])
def test_triple_and_enum_layouts_equal_the_einops_pattern(layout):
    t = TorchToy()
    rules = [(r, tpl, layout if r == r"q\.weight" else lay) for r, tpl, lay in RULES]
    a, _ = loaded(RULES, t)
    b, _ = loaded(rules, t)
    np.testing.assert_array_equal(a.attn.q[...], b.attn.q[...])
    # a triple with a reshape inverts only with torch's shapes
    back = to_torch_state_dict(b, weights=KeyMap(rules), like=t.state_dict())
    np.testing.assert_array_equal(back["q.weight"], t.q.weight.detach().numpy())
    with pytest.raises(
        ConversionError, match=r"flax variable 'attn.q': rule 2 r'q\\.weight': layout .* needs torch's shapes.*like="
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            to_torch_state_dict(b, weights=KeyMap(rules))


def test_a_triple_that_does_not_fit_is_a_size_error():
    rules = [(r, tpl, ((1, 0), (D, H, N + 1), False) if r == r"q\.weight" else lay) for r, tpl, lay in RULES]
    with pytest.raises(ConversionError, match=r"'q.weight': rule 2 .*cannot reshape"):
        loaded(rules)


def test_tuple_templates_copy_one_key_into_several_variables():
    t = TorchToy(tied=False)
    sd = {k: v for k, v in t.state_dict().items() if k != "head.weight"}  # saved without the alias
    rules = [(r"embed\.weight", ("emb.embedding", "out.kernel"), (None, "v d -> d v")), *RULES[2:]]
    km = KeyMap(rules)
    port = load_torch_state_dict(Port(), sd, weights=km)
    np.testing.assert_array_equal(port.out.kernel[...], t.embed.weight.detach().numpy().T)
    plan = km.resolve(port, sd)
    assert plan.ties == {"embed.weight": Tie(("embed.weight",), ("emb.embedding", "out.kernel"))}
    back = to_torch_state_dict(port, weights=km, like=sd)
    assert list(back) == list(sd)
    np.testing.assert_array_equal(back["embed.weight"], sd["embed.weight"].numpy())
    port.out.kernel[...] = port.out.kernel[...] + 1  # the copies now differ
    with pytest.raises(ConversionError, match=r"'embed.weight': is tied across emb.embedding, out.kernel"):
        to_torch_state_dict(port, weights=km, like=sd)


def test_ties_are_found_on_the_torch_side():
    t = TorchToy(tied=True)
    expected = {"embed.weight": ("embed.weight", "head.weight")}
    assert find_ties(t) == expected
    assert find_ties(t.state_dict()) == expected
    assert find_ties({k: v.numpy() for k, v in t.state_dict().items()}) == expected  # NumPy views share memory
    assert find_ties({k: v.clone() for k, v in t.state_dict().items()}) == {}  # copies are not ties
    assert find_ties(TorchToy(tied=False)) == {}
    port, _ = loaded(RULES, t)
    plan = KeyMap(RULES).resolve(port, t.state_dict())
    assert plan.ties == {"embed.weight": Tie(("embed.weight", "head.weight"), ("emb.embedding", "out.kernel"))}
    assert plan.ties["embed.weight"].to_json() == {
        "torch_aliases": ["embed.weight", "head.weight"],
        "flax_paths": ["emb.embedding", "out.kernel"],
    }
    assert plan.canonical("head.weight") == "embed.weight" and plan.ignored == ("freq",)
    assert plan.flax_names(["norm.weight", "norm.bias", "freq"]) == {"ln.scale", "ln.bias"}  # for module pairing


def test_tied_gradients_are_summed_through_inverse_layouts():
    """The torch gradient of a tied Parameter is the sum of both uses; the plan gives the flax side's sum."""
    t = TorchToy(tied=True)
    port, _ = loaded(RULES, t)
    plan = KeyMap(RULES).resolve(port, t.state_dict())
    rng = np.random.default_rng(0)
    grads = {p: rng.standard_normal(v.shape) for p, v in params(port).items()}
    named = plan.torch_gradients(grads)
    assert set(named) == {"embed.weight", "q.weight", "norm.weight", "norm.bias"}  # canonical names only
    np.testing.assert_allclose(named["embed.weight"], grads["emb.embedding"] + grads["out.kernel"].T, rtol=0)
    np.testing.assert_array_equal(named["q.weight"], grads["attn.q"].transpose(1, 2, 0).reshape(N * H, D))


def test_a_variable_shared_in_two_places_is_filled_once_and_its_gradient_counted_once():
    t = TorchToy(tied=True)
    rules = [(r"embed\.weight", "emb.embedding", None), (r"head\.weight", "head.embedding", None), *RULES[2:]]
    km = KeyMap(rules)
    port = load_torch_state_dict(SharedPort(), t.state_dict(), weights=km)
    assert port.head.embedding is port.emb.embedding
    np.testing.assert_array_equal(port.head.embedding[...], t.embed.weight.detach().numpy())
    plan = km.resolve(port, t.state_dict())
    assert [x.path for x in plan.targets["head.weight"]] == ["emb.embedding"]  # the canonical path
    assert plan.ties == {"embed.weight": Tie(("embed.weight", "head.weight"), ("emb.embedding",))}
    grads = {p: np.random.default_rng(1).standard_normal(v.shape) for p, v in params(port).items()}
    np.testing.assert_array_equal(plan.torch_gradients(grads)["embed.weight"], grads["emb.embedding"])
    back = to_torch_state_dict(port, weights=km, like=t.state_dict())
    np.testing.assert_array_equal(back["head.weight"], t.embed.weight.detach().numpy())


def test_fill_tree_returns_the_plan_resolve_gives_and_fills_by_a_given_plan_without_resolving(monkeypatch):
    """One resolution per load: the plan a fill returns is resolve's (for the caller's ties), and a fill given
    that plan (here of other values with the same keys, shapes and dtypes) matches no key again."""
    t = TorchToy(tied=True)
    km = KeyMap(RULES)
    ties = {"head.weight": ("head.weight", "embed.weight")}  # the caller names the canonical key
    port = Port()
    plan = fill_tree(port, t.state_dict(), km, ties=ties)
    assert plan == km.resolve(port, t.state_dict(), ties=ties)
    assert plan.canonical("embed.weight") == "head.weight"
    doubled = {k: 2 * v.detach() for k, v in t.state_dict().items()}
    want = params(load_torch_state_dict(Port(), doubled, weights=km))
    monkeypatch.setattr(keymap_transfer, "match_targets", lambda *args, **kwargs: pytest.fail("resolved again"))
    again = Port(rngs=nnx.Rngs(1))
    assert fill_tree(again, doubled, km, plan=plan) is plan
    got = params(again)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_a_state_dict_that_does_not_fit_the_given_plan_is_refused_and_nothing_is_written():
    t = TorchToy()
    km = KeyMap(RULES)
    plan = km.resolve(Port(), t.state_dict())
    state = dict(t.state_dict())
    del state["norm.bias"]
    state["extra"] = torch.zeros(1)
    state["q.weight"] = torch.zeros(2, 2)
    state["norm.weight"] = torch.zeros(D, dtype=torch.int64)
    port = Port()
    before = params(port)
    pattern = (
        r"does not fit the key plan it is filled by; nothing was loaded \(4 problem\(s\)\):\n"
        r"  missing key 'norm.bias'\n  unexpected key 'extra'\n"
        r"  'norm.weight': dtype int64 is not floating.*\n  'q.weight': expected shape \(6, 6\), got \(2, 2\)$"
    )
    with pytest.raises(ConversionError, match=pattern):
        fill_tree(port, state, km, plan=plan)
    after = params(port)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_export_with_like_fixes_keys_order_dtypes_and_loads_strict():
    t = TorchToy(tied=True).double()
    port, _ = loaded(RULES, t)  # float32 port
    back = to_torch_state_dict(port, weights=KeyMap(RULES), like=t.state_dict())
    assert list(back) == list(t.state_dict())
    assert back["embed.weight"].dtype == np.float64 and back["freq"].dtype == np.float64
    np.testing.assert_array_equal(back["freq"], t.freq.numpy())  # an ignored key: taken from like
    fresh = TorchToy(tied=True).double()
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in back.items()}, strict=True)
    np.testing.assert_allclose(fresh.embed.weight.detach().numpy(), t.embed.weight.detach().numpy(), rtol=1e-7)


def test_export_without_like_writes_keys_from_the_regexes_and_warns_about_ignored_ones():
    t = TorchToy(tied=True)
    port, _ = loaded(RULES, t)
    with pytest.warns(UserWarning, match=r"left out: rule 5 r'freq'"):
        back = to_torch_state_dict(port, weights=KeyMap(RULES))
    assert set(back) == set(t.state_dict()) - {"freq"}
    for k, v in back.items():
        np.testing.assert_array_equal(v, t.state_dict()[k].numpy(), err_msg=k)


def test_export_of_a_tie_whose_copies_differ_raises_naming_it():
    t = TorchToy(tied=True)
    port, _ = loaded(RULES, t)
    port.out.kernel[...] = port.out.kernel[...] * 2
    with pytest.raises(ConversionError, match=r"'embed.weight': torch ties 'embed.weight', 'head.weight'"):
        to_torch_state_dict(port, weights=KeyMap(RULES), like=t.state_dict())


def test_collection_style_tables_anchored_regexes_and_list_triples_export_without_like():
    rules = [(f"^{r}$", t, [(1, 0), None, 0] if lay == "v d -> d v" else lay) for r, t, lay in RULES]  # a list triple
    t = TorchToy(tied=True)
    port, _ = loaded(rules, t)
    with pytest.warns(UserWarning, match="left out: rule 5"):
        back = to_torch_state_dict(port, weights=KeyMap(rules))
    assert set(back) == set(t.state_dict()) - {"freq"}
    np.testing.assert_array_equal(back["head.weight"], t.embed.weight.detach().numpy())


def test_a_regex_that_is_not_a_literal_needs_like():
    rules = [(r"emb\w*\.weight", "emb.embedding", None), *RULES[1:]]
    port, t = loaded(rules)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            ConversionError,
            match=re.escape("flax variable 'emb.embedding': rule 0 r'emb\\w*\\.weight' cannot write its torch key"),
        ):
            to_torch_state_dict(port, weights=KeyMap(rules))
    assert "embed.weight" in to_torch_state_dict(port, weights=KeyMap(rules), like=t.state_dict())


def test_without_weights_like_is_refused():
    with pytest.raises(TypeError, match="like= goes with weights="):
        to_torch_state_dict(Port(), like={})


def test_linen_variables_and_parameter_pytrees_export_through_a_key_map():
    """Every variable tree exports through a key map (it came back empty); a bare pytree, and anything but an
    nnx.Module without a key map or for an in-place load, is a TypeError saying what to pass."""
    torch_linear = torch.nn.Linear(3, 2)
    sd = torch_linear.state_dict()
    module = linen.Dense(2)
    key_map = KeyMap([(r"weight", "kernel", "o i -> i o"), (r"bias", "bias", None)])
    tree = LinenTree(module.init(jax.random.key(0), np.zeros((1, 3), np.float32)))
    fill_tree(tree, sd, key_map)
    variables = tree.tree()
    function = Function(lambda p, x: x @ p["kernel"] + p["bias"], variables["params"])
    for model in (Linen(module, variables), LinenTree(variables), function, PytreeTree(variables["params"])):
        for like in (sd, None):
            back = to_torch_state_dict(model, weights=key_map, like=like)
            assert list(back) == ["weight", "bias"], type(model).__name__
            for k, v in sd.items():
                np.testing.assert_array_equal(back[k], v.numpy(), err_msg=k)
    with pytest.raises(TypeError, match=r"got dict: wrap a pytree in LinenTree\(\.\.\.\) or PytreeTree"):
        to_torch_state_dict(variables, weights=key_map)
    with pytest.raises(TypeError, match=r"to_torch_state_dict without weights= takes an nnx.Module, got Function"):
        to_torch_state_dict(function)
    for weights in (key_map, None):
        with pytest.raises(TypeError, match=r"load_torch_state_dict takes an nnx.Module, got dict; fill a copy"):
            load_torch_state_dict(variables, sd, weights=weights)


GPT_MAP = KeyMap(
    [
        (r"transformer\.(wte|wpe)\.weight", r"transformer.\1.embedding", None),
        (r"transformer\.h\.(\d+)\.(ln_1|ln_2)\.weight", r"transformer.h.\2.scale[\1]", None),
        (
            r"transformer\.h\.(\d+)\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.bias",
            r"transformer.h.\2.bias[\1]",
            None,
        ),
        (r"transformer\.h\.(\d+)\.attn\.bias", None, None),  # the causal mask; flax builds it from iotas
        (
            r"transformer\.h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight",
            r"transformer.h.\2.kernel[\1]",
            "o i -> i o",
        ),
        (r"transformer\.ln_f\.weight", "transformer.ln_f.scale", None),
        (r"transformer\.ln_f\.bias", "transformer.ln_f.bias", None),
        (r"lm_head\.weight", "lm_head.kernel", "v d -> d v"),
    ]
)


def test_stacked_templates_load_a_scanned_gpt_as_the_converter_does():
    """flax_ln's GPT(scan_layers=True) stacks its blocks: the key map fills slice i from torch's h.{i}."""
    config = flax_ln.GPTConfig(vocab_size=50, block_size=8, n_layer=3, n_head=2, n_embd=8)
    torch.manual_seed(0)
    torch_model = tg.GPT(config)
    sd = torch_model.state_dict()

    def abstract():  # shapes only: no initialiser runs (every Param is then filled by the strict loaders)
        return nnx.eval_shape(lambda: flax_ln.GPT(config, scan_layers=True, rngs=nnx.Rngs(0)))

    by_map = load_torch_state_dict(abstract(), sd, weights=GPT_MAP)
    by_rules = load_torch_state_dict(abstract(), sd)
    a, b = params(by_map), params(by_rules)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    back = to_torch_state_dict(by_map, weights=GPT_MAP, like=sd)
    assert list(back) == list(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(back[k], v.numpy(), err_msg=k)
    # a layer missing from the checkpoint: its slice is reported, nothing is loaded
    partial = {k: v for k, v in sd.items() if not k.startswith("transformer.h.2.")}
    with pytest.raises(ConversionError, match=r"flax variable 'transformer.h.attn.c_attn.kernel': slices \[2\]"):
        load_torch_state_dict(abstract(), partial, weights=GPT_MAP)
    # a slice beyond the stack
    extra = {**sd, "transformer.h.3.ln_1.weight": sd["transformer.h.0.ln_1.weight"]}
    with pytest.raises(ConversionError, match=r"slice '3' is not an index"):
        load_torch_state_dict(abstract(), extra, weights=GPT_MAP)


class _OneKernel(nnx.Module):
    def __init__(self):
        self.kernel = nnx.Param(np.zeros((3, 2), np.float32))


def test_distinct_equal_keys_in_other_layouts_share_one_gradient_in_the_first_ones_layout():
    """Two distinct torch tensors, equal once in flax's layout (one transposed, one not), fill one variable: the
    plan groups them (``shared``), carries a tensor between their layouts, and gives the variable's gradient once,
    under the first key, in its layout."""
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    sd = {"a.weight": w, "b.weight": w.T.copy()}
    plan = KeyMap([(r"a\.weight", "kernel", "o i -> i o"), (r"b\.weight", "kernel", None)]).resolve(_OneKernel(), sd)
    assert plan.shared() == {"a.weight": Tie(("a.weight", "b.weight"), ("kernel",))}
    np.testing.assert_array_equal(plan.carry("a.weight", "b.weight", w), w.T)
    np.testing.assert_array_equal(plan.carry("b.weight", "a.weight", w.T), w)
    grads = plan.torch_gradients({"kernel": w.T})
    assert list(grads) == ["a.weight"]
    np.testing.assert_array_equal(grads["a.weight"], w)
