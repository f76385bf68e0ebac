"""The book's chapter-9 LayerNorm in PyTorch, the reference that flax_ln mirrors."""

from __future__ import annotations

import torch
from torch import nn


class LayerNorm(nn.Module):
    """Chapter-9 LayerNorm: ``a_2 * (x - mean) / sqrt(std**2 + eps) + b_2``.

    ``std`` is torch's default unbiased standard deviation over the last axis, and
    ``eps`` goes inside the square root. With one feature the unbiased std is NaN,
    and so is the output. State dict keys: ``a_2``, ``b_2``.
    """

    def __init__(self, features: int, eps: float = 1e-6):
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / torch.sqrt(std**2 + self.eps) + self.b_2
