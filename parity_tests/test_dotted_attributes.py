"""An NNX port whose attributes hold dots (``setattr(self, "blocks.0", block)``, as ports converted from torch's
names write them): the key map discovered from its loader names ``blocks.0.fc.kernel``, and the model loads and
localises through it as discovered; an error about such a model never suggests a path it would refuse."""

import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch_weights import randomized

from flax_ln.convert import ConversionError, KeyMap
from flax_ln.parity import compare_modules

WIDTH = 8


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class TorchModel(torch.nn.Module):
    """Two blocks and a head; block 1's norm eps is planted (0.5), so only that norm differs from the port."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(TorchBlock() for _ in range(2))
        self.head = torch.nn.Linear(WIDTH, WIDTH)
        randomized(self, "float32")
        self.blocks[1].norm.eps = 0.5

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(WIDTH, epsilon=1e-5, rngs=rngs)
        self.fc = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.fc(self.norm(x)))


class DottedModel(nnx.Module):
    """Its blocks held in attributes named ``blocks.0`` and ``blocks.1``."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        for i in range(2):
            setattr(self, f"blocks.{i}", Block(rngs))
        self.head = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        for i in range(2):
            x = getattr(self, f"blocks.{i}")(x)
        return self.head(x)


def _loader(state):
    """The port's own loader: torch's names, with the blocks' dotted attribute names."""
    model = DottedModel()
    for i in range(2):
        block = getattr(model, f"blocks.{i}")
        block.norm.scale[...] = jnp.asarray(state[f"blocks.{i}.norm.weight"])
        block.norm.bias[...] = jnp.asarray(state[f"blocks.{i}.norm.bias"])
        block.fc.kernel.value = jnp.asarray(state[f"blocks.{i}.fc.weight"]).T
        block.fc.bias[...] = jnp.asarray(state[f"blocks.{i}.fc.bias"])
    model.head.kernel.value = jnp.asarray(state["head.weight"]).T
    model.head.bias[...] = jnp.asarray(state["head.bias"])
    return model


def test_a_model_with_dotted_attributes_loads_and_localises_as_discovered():
    torch_model = TorchModel()
    weights = KeyMap.discover(_loader, torch_model)
    x = np.random.default_rng(0).standard_normal((2, 4, WIDTH)).astype("float32")
    report = compare_modules(torch_model, DottedModel(), (x,), weights=weights, dtype="float32")
    assert not report.passed and report.localization_note is None, report.localization_note
    fd = report.first_divergence
    assert fd is not None and (fd.module, fd.flax_module) == ("blocks.1.norm", "blocks.1.norm"), str(report)
    assert report.isolation.culprits == ["blocks.1.norm"], str(report)
    assert report.isolation.flax_culprits == ["blocks.1.norm"], str(report)
    assert report.module_pairs["blocks.0.fc"] == "blocks.0.fc", report.module_pairs


def test_an_error_on_a_dotted_model_suggests_only_a_path_that_loads():
    """A typo in a template (``kernal``): the error suggests the variable's path, and that path loads."""
    torch_model = TorchModel()
    rules = [
        (r"blocks\.(\d+)\.norm\.weight", r"blocks.\1.norm.scale", None),
        (r"(blocks\.\d+\.norm|blocks\.\d+\.fc|head)\.bias", r"\1.bias", None),
        (r"(blocks\.\d+\.fc|head)\.weight", r"\1.kernel", "o i -> i o"),
    ]
    typo = [rules[0], rules[1], (r"(blocks\.\d+\.fc|head)\.weight", r"\1.kernal", "o i -> i o")]
    x = np.random.default_rng(0).standard_normal((2, 4, WIDTH)).astype("float32")
    with pytest.raises(ConversionError) as caught:
        compare_modules(torch_model, DottedModel(), (x,), weights=KeyMap(typo), dtype="float32")
    suggested = set(re.findall(r"did you mean '([^']+)'", str(caught.value)))
    assert "blocks.0.fc.kernel" in suggested, str(caught.value)
    named = set(KeyMap(rules).resolve(DottedModel(), torch_model.state_dict()).targets.values())
    loaded = {t.path for ts in named for t in ts}
    assert suggested <= loaded, (suggested, loaded)
