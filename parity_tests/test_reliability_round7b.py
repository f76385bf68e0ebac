"""Issue 71, items 3-7: float32 constants a float64 run meets, told by where they were made (a Keras model's, built
with the model; a Linen port's, made in ``setup`` on every apply); and the words of a report."""

import collections
import copy
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen, nnx

from flax_ln.convert import ConversionError, KeyMap, load_torch_state_dict, to_torch_state_dict
from flax_ln.parity import Linen, compare_modules
from flax_ln.parity.islands.island import Island

WIDTH = 12  # sqrt(12) is irrational: its float32 rounding shows in float64 (relative 1e-8, far above 1e-12)
LINEAR_MAP = KeyMap([(r"fc\.weight", "fc/kernel", "a b -> b a"), (r"fc\.bias", "fc/bias", None)])
LINEN_MAP = KeyMap([(r"fc\.weight", "fc.kernel", "a b -> b a"), (r"fc\.bias", "fc.bias", None)])


def _x():
    return (np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32),)


class TorchScaled(torch.nn.Module):
    """A linear layer whose output is scaled by sqrt(WIDTH), computed in the input's dtype (as Gemma scales)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, WIDTH)

    def forward(self, x):
        return self.fc(x) * math.sqrt(WIDTH)


def _keras_scaled(keras, dtype=None):
    """keras-hub's Gemma idiom: ``x * ops.cast(ops.sqrt(hidden_dim), x.dtype)``, computed when the functional model
    is built (a float32 constant, weakly typed, held by the model's multiply node)."""
    inputs = keras.Input((8,), dtype=dtype)
    h = keras.layers.Dense(WIDTH, name="fc", dtype=dtype)(inputs)
    scaled = h * keras.ops.cast(keras.ops.sqrt(WIDTH), h.dtype)
    return keras.Model(inputs, keras.layers.Identity(name="out", dtype=dtype)(scaled))  # named: not auto-numbered


def test_a_float32_constant_a_keras_model_built_is_listed_with_the_advice(keras):
    report = compare_modules(TorchScaled(), _keras_scaled(keras), _x(), weights=LINEAR_MAP)
    assert report.results and all(r.passed for r in report.results), report  # float32 cannot see it
    check = report.float64_check
    assert check is not None and not check.passed, report
    constants = [i for i in check.islands if i.side == "flax" and "float32 constant ()" in i.what]
    assert len(constants) == 1 and not constants[0].lifted, check.islands
    assert "built before the comparison" in constants[0].what and "flax_factory=" in constants[0].what
    assert "float32 constant () built before the comparison" in str(report)
    rebuilt = compare_modules(
        TorchScaled(),
        _keras_scaled(keras),
        _x(),
        weights=LINEAR_MAP,
        dtype="float64",
        flax_factory=lambda: _keras_scaled(keras),  # built under lifting: its sqrt computed in float64
    )
    assert rebuilt.passed, rebuilt
    assert not [i for i in rebuilt.islands if i.side == "flax" and not i.lifted], rebuilt.islands


class LinenTableInSetup(linen.Module):
    """transformers' FlaxLlama idiom: a NumPy float32 table made inside the call (FlaxLlama: in ``setup``, run on
    every apply)."""

    @linen.compact
    def __call__(self, x):
        table = np.sqrt(np.full(WIDTH, WIDTH, dtype=np.float32))  # NumPy float32, inside the call
        return linen.Dense(WIDTH, name="fc")(x) * table


def test_a_float32_table_the_port_makes_during_its_call_is_not_sent_to_a_factory():
    module = LinenTableInSetup()
    variables = module.init(jax.random.key(0), _x()[0])
    report = compare_modules(TorchScaled(), Linen(module, variables), _x(), weights=LINEN_MAP)
    assert report.results and all(r.passed for r in report.results), report
    check = report.float64_check
    assert check is not None and not check.passed, report
    constants = [i for i in check.islands if i.side == "flax" and f"float32 constant ({WIDTH},)" in i.what]
    assert len(constants) == 1 and not constants[0].lifted, check.islands
    what = constants[0].what
    assert "during its call" in what and "the port itself computes it in float32" in what, what
    assert "built before the comparison" not in what and "build the port under lifting" not in what, what
    assert "test_reliability_round7b.py:" in what, what  # where: the port's line that uses it


# ---- item 7: the words of a report


class TorchTwoBlocks(torch.nn.Module):
    """Two blocks, each a linear layer: the same leaf names in two places (``blocks.0.fc``, ``blocks.1.fc``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Sequential(collections.OrderedDict(fc=torch.nn.Linear(8, 8))) for _ in range(2)]
        )

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class LinenBlock(linen.Module):
    def setup(self):
        self.fc = linen.Dense(8)


def _block_call(self, x):
    return self.fc(x)


LinenBlock.__call__ = _block_call  # type: ignore[attr-defined]  # a plain function set after flax made the class: never wrapped


class LinenTwoBlocks(linen.Module):
    shift: float = 0.0  # a planted bug in the second block's output

    @linen.compact
    def __call__(self, x):
        x = LinenBlock(name="blocks_0")(x)
        return LinenBlock(name="blocks_1")(x) + self.shift


BLOCKS_MAP = KeyMap(
    [
        (r"blocks\.(\d)\.fc\.weight", r"blocks_\1.fc.kernel", "a b -> b a"),
        (r"blocks\.(\d)\.fc\.bias", r"blocks_\1.fc.bias", None),
    ]
)


def _blocks(shift=0.0):
    module = LinenTwoBlocks(shift=shift)
    return Linen(module, module.init(jax.random.key(0), _x()[0]))


def test_a_linen_call_flax_never_wrapped_is_named_as_the_reason_it_was_not_run_alone():
    report = compare_modules(TorchTwoBlocks(), _blocks(shift=1e-3), _x(), weights=BLOCKS_MAP, dtype="float32")
    assert not report.passed and report.isolation is not None, report
    for block in ("blocks.0", "blocks.1"):
        why = report.isolation.skipped.get(block, "")
        assert "LinenBlock.__call__" in why and "setattr(cls, '__call__', f)" in why, report.isolation.skipped
        assert "define __call__ in the class body" in why, why


@pytest.fixture(scope="module")
def passing():
    """A passing default call (the float32 run and its float64 check), made once for the tests of its words."""
    report = compare_modules(TorchTwoBlocks(), _blocks(), _x(), weights=BLOCKS_MAP)
    assert report.passed and report.float64_check is not None, report
    return report


def test_the_summary_says_which_time_is_which(passing):
    summary = next(line for line in str(passing).splitlines() if line.startswith("summary:"))
    own = passing.seconds - passing.float64_check.seconds  # report.seconds keeps its meaning: the whole call
    assert f"in {own:.1f}s, {passing.seconds:.1f}s with the float64 check -> PASS" in summary, summary


def test_islands_recurring_in_many_modules_are_one_line_and_the_unlifted_come_first(passing):
    # a T5's report: one lifted cast in each of 40 modules, one unlifted constant in two: a line per kind
    lifted = [Island("flax", f"encoder.block.{i}.layer.0.SelfAttention", "astype to float32", True) for i in range(40)]
    kept = [Island("flax", f"decoder.block.{i}", "a float32 constant (4,)", False) for i in range(2)]
    report = copy.deepcopy(passing)
    report.float64_check.islands = lifted + kept
    text = str(report)
    lines = [line for line in text.splitlines() if "astype to float32" in line or "float32 constant (4,)" in line]
    assert len(lines) == 2, text
    assert "decoder.block.0" in lines[0] and "NOT lifted, in 2 modules" in lines[0], lines  # the unlifted first
    assert "40 modules (encoder.block.0.layer.0.SelfAttention" in lines[1] and "lifted, in 40 modules" in lines[1]
    assert len(report.float64_check.islands) == 42  # the data keeps one entry per module and kind


def test_cut_names_of_two_layers_stay_distinct(passing):
    # two names that differ only where a cut to the column drops characters
    long = "model.encoder.transformer.layer.{}.attention.multi_head_projection.k_lin.weight"
    report = copy.deepcopy(passing)
    report.results = [dataclasses.replace(r, name=long.format(i)) for i, r in enumerate(report.results[:2])]
    rows = [line.split()[0] for line in str(report).splitlines() if line.startswith("model.")]
    assert len(rows) == 2 and rows[0] != rows[1], rows
    assert all(len(row) <= 44 and "..." in row for row in rows), rows  # still cut to the column
    assert ".0." in rows[0] and ".1." in rows[1], rows  # each shows its own layer


# ---- item 5: a loader that rounds every weight to float16 on the way


class TorchTwo(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class PortTwo(nnx.Module):
    def __init__(self, rngs):
        self.first, self.second = nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.second(jnp.tanh(self.first(x)))


def _float16_loader(state):
    """keras-hub's Mistral converter's way: each weight cast to float16 on the way into float32 variables."""
    model = PortTwo(nnx.Rngs(0))
    for module, key in ((model.first, "a"), (model.second, "b")):
        module.kernel[...] = jnp.asarray(np.asarray(state[f"{key}.weight"]).T.astype(np.float16), jnp.float32)
        module.bias[...] = jnp.asarray(np.asarray(state[f"{key}.bias"]).astype(np.float16), jnp.float32)
    return model


def test_a_loader_rounding_to_float16_is_a_key_map_with_the_rounding_written_and_named():
    key_map = KeyMap.discover(_float16_loader, TorchTwo())
    assert key_map.discovery.rounded == {
        p: "float16" for p in ("first.kernel", "first.bias", "second.kernel", "second.bias")
    }
    assert "the loader rounds weights to float16" in str(key_map.discovery)
    source = key_map.to_source()
    assert "'round': 'float16'" in source, source
    again = eval(source, {"KeyMap": KeyMap, "np": np})  # noqa: S307 - the map's own source, read back
    assert again.to_source() == source
    # loading through the map gives the port what its own loader gives
    torch_model = TorchTwo()
    state = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}
    mapped = load_torch_state_dict(PortTwo(nnx.Rngs(1)), state, weights=key_map)
    own = _float16_loader(state)
    for got, want in zip(jax.tree.leaves(nnx.state(mapped)), jax.tree.leaves(nnx.state(own)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    report = compare_modules(torch_model, PortTwo(nnx.Rngs(1)), _x(), weights=key_map, dtype="float32")
    assert not report.passed, report  # float16's 11 bits: far outside float32's tolerance
    assert "the loader rounds weights to float16" in str(report), report


# ---- item 6: a tensor read only in part


class TorchOffsetPositions(torch.nn.Module):
    """RoBERTa's way: a position table whose first ``offset`` rows (padding) a forward from ``first`` never reads."""

    def __init__(self, first=2):
        super().__init__()
        torch.manual_seed(0)
        self.pos, self.fc, self.first = torch.nn.Embedding(6, 8), torch.nn.Linear(8, 8), first

    def forward(self, x):
        return self.fc(x + self.pos(torch.arange(self.first, self.first + x.shape[1])))


class PortPositions(nnx.Module):
    """A port holding rows 2: of the table (keras-hub's RoBERTa converter reads ``position_embeddings[2:]``)."""

    def __init__(self, rngs):
        self.pos, self.fc = nnx.Embed(4, 8, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc(x + self.pos(jnp.arange(x.shape[1])))


PART_MAP = KeyMap(
    [
        (r"pos\.weight", {"[0:2]": None, "[2:6]": "pos.embedding"}, None),
        (r"fc\.weight", "fc.kernel", "a b -> b a"),
        (r"fc\.bias", "fc.bias", None),
    ]
)


def _positions():
    return (np.random.default_rng(1).normal(size=(2, 4, 8)).astype(np.float32),)


def test_a_slab_no_variable_reads_is_written_read_back_and_compared_as_dropped():
    source = PART_MAP.to_source()
    assert '"[0:2]": None' in source, source
    assert eval(source, {"KeyMap": KeyMap, "np": np}).to_source() == source  # noqa: S307 - its own source
    passing = compare_modules(TorchOffsetPositions(), PortPositions(nnx.Rngs(0)), _positions(), weights=PART_MAP)
    assert passing.passed, passing  # rows 0:2 unread by torch's forward too: zero gradient, nothing to compare
    # a torch forward that reads row 0 and 1 (positions from 0): the port cannot, and the report names the slab
    failing = compare_modules(
        TorchOffsetPositions(first=0), PortPositions(nnx.Rngs(0)), _positions(), weights=PART_MAP, dtype="float32"
    )
    assert not failing.passed
    named = [r for r in failing.results if r.name == "pos.weight[0:2]"]
    assert named and not named[0].passed, [r.name for r in failing.results]


def _rows_2_loader(state):
    """keras-hub's RoBERTa converter's way: rows 2: of the position table."""
    model = PortPositions(nnx.Rngs(0))
    model.pos.embedding[...] = jnp.asarray(state["pos.weight"][2:])
    model.fc.kernel[...] = jnp.asarray(state["fc.weight"]).T
    model.fc.bias[...] = jnp.asarray(state["fc.bias"])
    return model


def test_a_slab_read_is_discovered_only_where_the_unread_part_is_admitted():
    with pytest.raises(ConversionError, match=r"only partly read; admit the unread part with allow_dropped="):
        KeyMap.discover(_rows_2_loader, TorchOffsetPositions())
    key_map = KeyMap.discover(_rows_2_loader, TorchOffsetPositions(), allow_dropped=[r"pos\.weight\[0:2\]"])
    assert key_map.discovery.dropped == {"pos.weight": "[0:2]"}
    assert key_map.to_source() == PART_MAP.to_source()  # the map written by hand above, found by probing


def test_export_through_a_map_with_an_unread_slab_takes_that_slab_from_like():
    torch_model = TorchOffsetPositions()
    state = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}
    port = load_torch_state_dict(PortPositions(nnx.Rngs(0)), state, weights=PART_MAP)
    np.testing.assert_array_equal(np.asarray(port.pos.embedding[...]), state["pos.weight"][2:])
    back = to_torch_state_dict(port, weights=PART_MAP, like=torch_model.state_dict())
    np.testing.assert_array_equal(np.asarray(back["pos.weight"]), state["pos.weight"])  # rows 0:2 from like=
