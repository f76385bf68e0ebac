"""Localisation through NNX's lifted transforms: the submodules of a block under ``nnx.remat`` are recorded
(rematerialisation changes no value, so the block runs plainly while recording) and the mistake inside is named;
layers run under ``nnx.scan`` over stacked parameters are recorded per iteration (the eager localisation run unrolls
the scan) and named per layer; a method decorated with ``nnx.remat`` runs traced: the report names its modules as not
recorded, and no parent's own code is blamed for a difference that may lie in them. Small ports, each planted
with one mistake, in float32 and float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch_weights import randomized

from flax_ln.convert import KeyMap
from flax_ln.parity import compare_modules

WIDTH, SEQ, BATCH = 8, 5, 2
DTYPES = ["float32", "float64"]


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.mlp(self.norm(x)))


class TorchStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(WIDTH, WIDTH)
        self.blocks = torch.nn.ModuleList(TorchBlock() for _ in range(2))
        self.head = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Block(nnx.Module):
    def __init__(self, dtype, eps, *, rngs):
        self.norm = nnx.LayerNorm(WIDTH, epsilon=eps, param_dtype=dtype, rngs=rngs)
        self.mlp = nnx.Linear(WIDTH, WIDTH, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.mlp(self.norm(x)))


def _run_block(block: Block, x):
    return block(x)


class RematStack(nnx.Module):
    """Each block rematerialised with ``nnx.remat`` (block 1's norm ``eps`` planted)."""

    def __init__(self, dtype, eps):
        rngs, dtype = nnx.Rngs(0), getattr(jnp, dtype)
        self.inp = nnx.Linear(WIDTH, WIDTH, param_dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(dtype, e, rngs=rngs) for e in eps])
        self.head = nnx.Linear(WIDTH, WIDTH, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = nnx.remat(_run_block)(block, x)
        return self.head(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nnx_remat_blocks_are_recorded_and_the_inner_norm_is_named(dtype):
    """Block 1's norm eps differs, inside nnx.remat: its submodules are recorded, the first divergence and
    isolation name block 1's norm, and every module inside the blocks ran alone."""
    x = np.random.default_rng(3).standard_normal((BATCH, SEQ, WIDTH)).astype(dtype)
    with jax.enable_x64(dtype == "float64"):
        report = compare_modules(randomized(TorchStack(), dtype), RematStack(dtype, (1e-5, 1e-1)), (x,), dtype=dtype)
    assert not report.passed
    assert report.first_divergence.module == "blocks.1.norm", str(report)
    assert report.isolation.culprits == ["blocks.1.norm"], str(report)
    ran = {r.name for r in report.isolation.results}
    assert {"blocks.0.norm", "blocks.0.mlp", "blocks.1.norm", "blocks.1.mlp", "blocks.0", "blocks.1"} <= ran, ran
    assert report.isolation.unrecorded == {}, str(report)


class DecoratedBlock(Block):
    @nnx.remat
    def __call__(self, x):
        return x + jnp.tanh(self.mlp(self.norm(x)))


class DecoratedStack(RematStack):
    """``nnx.remat`` applied once, as the blocks' class is defined: its calls are traced, not recordable."""

    def __init__(self, dtype, eps):
        super().__init__(dtype, eps)
        rngs, dtype = nnx.Rngs(1), getattr(jnp, dtype)
        self.blocks = nnx.List([DecoratedBlock(dtype, e, rngs=rngs) for e in eps])

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nnx_remat_as_a_decorator_names_the_blocks_as_not_recorded(dtype):
    """A method decorated with nnx.remat runs traced even eagerly: its modules are named as not recorded, the model's
    own code is not blamed for the gap they ran in, and isolation (on torch's inputs) still names the norm."""
    x = np.random.default_rng(3).standard_normal((BATCH, SEQ, WIDTH)).astype(dtype)
    with jax.enable_x64(dtype == "float64"):
        port = DecoratedStack(dtype, (1e-5, 1e-1))
        report = compare_modules(randomized(TorchStack(), dtype), port, (x,), dtype=dtype)
    assert {"blocks.0", "blocks.1", "blocks.1.norm"} <= set(report.isolation.unrecorded), str(report)
    fd = report.first_divergence
    assert fd.between == ("inp", "head") and "blocks.1.norm" in fd.unrecorded, str(report)
    assert "between inp and head: in its submodules that ran there without a record (" in str(report), str(report)
    assert report.isolation.culprits == ["blocks.1.norm"], str(report)


# --- layers stacked and run under nnx.scan: recorded per iteration ------------------------------------------------


class ScanStack(nnx.Module):
    """The blocks' parameters stacked on a leading layer axis (``nnx.vmap``) and run with ``nnx.scan``, as the
    book's GPT with ``scan_layers``; the norm's ``eps`` is planted in every layer."""

    def __init__(self, dtype, eps):
        rngs, dtype = nnx.Rngs(0), getattr(jnp, dtype)
        self.inp = nnx.Linear(WIDTH, WIDTH, param_dtype=dtype, rngs=rngs)
        keys = jax.random.split(jax.random.key(1), 2)
        self.blocks = nnx.vmap(lambda k: Block(dtype, eps, rngs=nnx.Rngs(k)))(keys)
        self.head = nnx.Linear(WIDTH, WIDTH, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def step(block, x):
            return block(x)

        return self.head(step(self.blocks, x))


SCAN_MAP = KeyMap(
    [
        (r"inp\.weight", "inp.kernel", "o i -> i o"),
        (r"inp\.bias", "inp.bias", None),
        (r"blocks\.(\d+)\.norm\.weight", r"blocks.norm.scale[\1]", None),
        (r"blocks\.(\d+)\.norm\.bias", r"blocks.norm.bias[\1]", None),
        (r"blocks\.(\d+)\.mlp\.weight", r"blocks.mlp.kernel[\1]", "o i -> i o"),
        (r"blocks\.(\d+)\.mlp\.bias", r"blocks.mlp.bias[\1]", None),
        (r"head\.weight", "head.kernel", "o i -> i o"),
        (r"head\.bias", "head.bias", None),
    ]
)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nnx_scan_layers_are_named_as_not_recorded_and_no_own_code_is_blamed(dtype):
    """The norm eps differs inside the scanned layers (in every layer: a stack shares its static fields). The
    eager localisation run unrolls the scan (``jax.disable_jit()``), so each layer is recorded and paired with
    torch's: the first divergence names layer 0's norm on both sides (``blocks[0].norm``), isolation names each
    layer's norm, and nothing is left unrecorded or blamed in its own code."""
    x = np.random.default_rng(3).standard_normal((BATCH, SEQ, WIDTH)).astype(dtype)
    with jax.enable_x64(dtype == "float64"):
        report = compare_modules(
            randomized(TorchStack(), dtype), ScanStack(dtype, 1e-1), (x,), weights=SCAN_MAP, dtype=dtype
        )
    assert not report.passed
    assert report.isolation.unrecorded == {}, str(report)
    fd = report.first_divergence
    assert (fd.module, fd.flax_module, fd.between) == ("blocks.0.norm", "blocks[0].norm", None), str(report)
    assert report.module_pairs["blocks.1"] == "blocks[1]", report.module_pairs
    assert "its own code:" not in str(report) and report.isolation.own_code == [], str(report)
    assert report.isolation.culprits == ["blocks.0.norm", "blocks.1.norm"], str(report)
    assert report.isolation.flax_culprits == ["blocks[0].norm", "blocks[1].norm"], str(report)
