"""PyTorch reference implementations of the book's modules, with the book's state-dict keys."""

from torch_ref.encoder_decoder import (
    LabelSmoothing,
    Transformer,
    make_model,
    make_std_mask,
    noam_rate,
    subsequent_mask,
)
from torch_ref.gpt import GPT, GPTConfig, load_hf_gpt2
from torch_ref.layernorm import LayerNorm

__all__ = [
    "LabelSmoothing",
    "LayerNorm",
    "GPT",
    "GPTConfig",
    "load_hf_gpt2",
    "Transformer",
    "make_model",
    "make_std_mask",
    "noam_rate",
    "subsequent_mask",
]
