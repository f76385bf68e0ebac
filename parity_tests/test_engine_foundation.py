"""The parity engine's foundation: records that in-place ops cannot corrupt, per-side forwards, outputs named the
same way on both sides, and what never passes (nothing compared, frozen parameters, the blame of a mismatch)."""

import numpy as np
import torch
from flax import nnx

from flax_ln.parity import compare_modules

WIDTH = 6


# ---- records are copies ------------------------------------------------------------------------


class TorchInPlaceBlock(torch.nn.Module):
    """Linear -> LayerNorm, then the shortcut added in place to the norm's output (as transformers' ResNet does)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, x):
        h = self.norm(self.lin(x))
        h += x  # in place, after the norm has returned: its recorded output must not change
        return h


class TorchInPlaceStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([TorchInPlaceBlock(), TorchInPlaceBlock()])
        self.head = torch.nn.Linear(WIDTH, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class FlaxBlock(nnx.Module):
    def __init__(self, eps, *, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, epsilon=eps, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.lin(x)) + x


class FlaxStack(nnx.Module):
    def __init__(self, eps_of_block_1, *, rngs):
        self.blocks = nnx.List([FlaxBlock(1e-5, rngs=rngs), FlaxBlock(eps_of_block_1, rngs=rngs)])
        self.head = nnx.Linear(WIDTH, 3, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_an_in_place_residual_after_a_norm_does_not_move_the_blame():
    torch.manual_seed(0)
    torch_model = TorchInPlaceStack()
    x = np.random.default_rng(0).standard_normal((2, 4, WIDTH)).astype(np.float32)
    assert compare_modules(torch_model, FlaxStack(1e-5, rngs=nnx.Rngs(0)), x).passed  # the faithful twin
    report = compare_modules(torch_model, FlaxStack(0.5, rngs=nnx.Rngs(0)), x)  # eps planted in blocks.1.norm
    assert not report.passed
    assert report.first_divergence is not None and report.first_divergence.module == "blocks.1.norm", str(report)
    assert report.isolation.culprits == ["blocks.1.norm"], str(report)
    # every module before the planted mistake agrees, blocks.0.norm (whose output torch changes in place) included
    errors = {r.name: r for r in report.module_errors}
    assert errors["blocks.0.norm"].passed and errors["blocks.0"].passed
