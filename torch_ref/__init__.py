"""PyTorch reference implementations of the book's modules, with the book's state-dict keys."""

from torch_ref.layernorm import LayerNorm

__all__ = ["LayerNorm"]
